"""``conformance.bench`` on the random tiny Llama (``random_model_dir``, conftest)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conformance.bench import lanes as bench_lanes
from conformance.bench import measure
from conformance.bench import result as bench_result_module
from conformance.bench.device import DeviceMeter
from conformance.bench.lanes import ENGINE_LANES, parse_batch_sizes, parse_engine_lanes
from conformance.bench.measure import run_bench
from conformance.bench.result import (
    BackendTiming,
    BenchResult,
    BenchRow,
    format_table,
    ratio_pairs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recorder:
    """A ``BenchProgress`` that keeps every line it is given."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def start(self, label: str) -> None:
        self.lines.append(f"start {label}")

    def note(self, text: str) -> None:
        self.lines.append(f"note {text}")

    def done(self, result: str) -> None:
        self.lines.append(f"done {result}")


@pytest.fixture(scope="module")
def bench_result(random_model_dir: Path) -> tuple[BenchResult, list[str]]:
    recorder = Recorder()
    result = run_bench(["refengine", "hf"], [1, 2], 4, "none", recorder,
                       model=str(random_model_dir))
    return result, recorder.lines


def test_bench_measures_both_backends(bench_result: tuple[BenchResult, list[str]]) -> None:
    result, messages = bench_result
    assert [row.batch_size for row in result.rows] == [1, 2]
    for row in result.rows:
        assert set(row.results) == {"refengine", "hf"}
        for timing in row.results.values():
            assert timing.total_tokens == row.batch_size * 4  # ignore_eos: exactly max_new
            assert timing.seconds > 0
            assert timing.tokens_per_s == pytest.approx(timing.total_tokens / timing.seconds)
            assert timing.tokens_per_s > 0
    assert result.threads == 1
    assert result.versions["hf"].startswith("hf transformers ")
    starts = [m for m in messages if m.startswith("start ")]
    assert [m.split()[2] for m in starts] == ["1", "2"]  # one item per batch size, in order
    done = [m for m in messages if m.startswith("done ")]
    assert len(done) == 2 and all("refengine " in m and "hf " in m for m in done)


def test_table_and_json(bench_result: tuple[BenchResult, list[str]]) -> None:
    result, _ = bench_result
    table = format_table(result)
    assert "refengine tok/s" in table and "hf tok/s" in table and "refengine/hf" in table
    assert "max_new_tokens=4" in table and "torch threads=1" in table
    assert result.model in table
    lines = table.splitlines()
    dashes = next(i for i, line in enumerate(lines) if set(line.replace(" ", "")) == {"-"})
    body = lines[dashes + 1: dashes + 3]
    assert [line.split()[0] for line in body] == ["1", "2"]
    assert all(line.endswith("x") for line in body)
    data = json.loads(json.dumps(dataclasses.asdict(result)))
    assert data["rows"][1]["results"]["hf"]["total_tokens"] == 8


def test_single_backend_has_no_ratio(random_model_dir: Path) -> None:
    result = run_bench(["hf"], [3], 2, "none", Recorder(), model=str(random_model_dir))
    assert result.rows[0].results["hf"].total_tokens == 6
    assert ["batch", "hf", "tok/s"] in [line.split() for line in format_table(result).splitlines()]


def test_min_requests_runs_groups_of_each_batch_size(random_model_dir: Path) -> None:
    """Batch b runs ceil(min_requests / b) groups; their tokens and seconds are pooled."""
    recorder = Recorder()
    result = run_bench(["refengine"], [1, 2], 3, "none", recorder,
                       model=str(random_model_dir), min_requests=3)
    totals = [row.results["refengine"].total_tokens for row in result.rows]
    assert totals == [3 * 3, 2 * 2 * 3]
    assert recorder.lines[-4].startswith("start batch 1 (3 group(s)")
    assert recorder.lines[-3].startswith("done refengine ") and "(9 tokens in" in recorder.lines[-3]


def test_repeats_keep_each_groups_fastest_run(random_model_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lane runs every group ``repeats`` times; per group the fastest run counts, and
    the pooled seconds are the sum of those minima."""
    seconds = {"b1g0r0": 3.0, "b1g0r1": 1.0, "b1g0r2": 2.0,
               "b1g1r0": 0.5, "b1g1r1": 4.0, "b1g1r2": 5.0}
    tags: list[str] = []

    def scripted(handle: object, prompts: list[tuple[int, ...]], max_new_tokens: int,
                 tag: str, meter: object = None) -> measure.BatchRun:
        tags.append(tag)
        return measure.BatchRun(max_new_tokens * len(prompts), seconds.get(tag, 0.01), [[]], 1,
                                [[]])

    monkeypatch.setattr(measure, "_run_batch", scripted)
    result = run_bench(["refengine"], [1], 2, "none", Recorder(),
                       model=str(random_model_dir), min_requests=2, repeats=3)
    timing = result.rows[0].results["refengine"]
    assert tags[1:] == list(seconds)  # after the warm-up, each group three times in turn
    assert timing.seconds == 1.0 + 0.5 and timing.total_tokens == 4
    assert "repeats=3 (fastest kept)" in format_table(result).splitlines()[0]


def test_repeats_that_disagree_are_refused(random_model_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    counts = iter([2, 2, 3])  # warm-up, then two repeats of one group emitting different counts
    monkeypatch.setattr(measure, "_run_batch",
                        lambda *_: measure.BatchRun(next(counts), 1.0, [[]], 1, [[]]))
    with pytest.raises(RuntimeError, match="repeats of one group emitted different"):
        run_bench(["refengine"], [1], 2, "none", Recorder(), model=str(random_model_dir),
                  repeats=2)


def test_rejects_bad_arguments(random_model_dir: Path) -> None:
    model = str(random_model_dir)
    with pytest.raises(ValueError, match=r"^--spec: 'warp' not supported by bench"):
        run_bench(["refengine"], [1], 4, "warp", Recorder(), model=model)
    with pytest.raises(ValueError, match=r"^--batch-sizes"):
        run_bench(["refengine"], [0], 4, "none", Recorder(), model=model)
    with pytest.raises(ValueError, match=r"^--max-new-tokens"):
        run_bench(["refengine"], [1], 0, "none", Recorder(), model=model)
    with pytest.raises(ValueError, match=r"^--backends"):
        run_bench(["hf", "hf"], [1], 4, "none", Recorder(), model=model)
    with pytest.raises(ValueError, match=r"^--min-requests"):
        run_bench(["refengine"], [1], 4, "none", Recorder(), model=model, min_requests=0)
    with pytest.raises(ValueError, match=r"^--repeats"):
        run_bench(["refengine"], [1], 4, "none", Recorder(), model=model, repeats=0)


def test_overlap_lanes_sit_beside_their_sequential_twins() -> None:
    lanes = bench_lanes.lanes_for("eagle-v2", ["refengine"])
    assert [ln.label for ln in lanes] == ["plain", "chain-s3-n4", "chain-s3-n4-v2",
                                          "tree-s3-k4-n8", "tree-s3-k4-n8-v2"]
    assert [ln.spec.overlap for ln in lanes[1:] if ln.spec] == [False, True, False, True]


def test_further_backends_add_plain_lanes_beside_a_spec() -> None:
    """A yardstick engine (e.g. a C++ one) decodes plainly beside the first backend's spec
    lanes, in the same run."""
    lanes = bench_lanes.lanes_for("eagle", ["refengine", "ctranslate2"])
    assert [(ln.label, ln.backend, ln.spec is None) for ln in lanes] == [
        ("plain", "refengine", True), ("chain-s3-n4", "refengine", False),
        ("chain-s5-n6", "refengine", False), ("ctranslate2", "ctranslate2", True)]


def test_graph_lanes_sit_beside_their_eager_twins(random_model_dir: Path) -> None:
    """--graphs: a twin lane through the graph runner for each backend claiming one (not hf),
    with the same tokens as its eager twin; its warm-up is reported, not timed."""
    lanes = bench_lanes.with_graph_lanes(bench_lanes.lanes_for("none", ["refengine", "hf"]),
                                         "replay", lambda b: b == "refengine")
    assert [(ln.label, ln.graphs) for ln in lanes] == [
        ("refengine", None), ("refengine+replay", "replay"), ("hf", None)]
    recorder = Recorder()
    result = run_bench(["refengine"], [2], 4, "none", recorder, model=str(random_model_dir),
                       graphs="replay")
    assert result.backends == ["refengine", "refengine+replay"]
    assert result.rows[0].results["refengine+replay"].total_tokens == 2 * 4
    assert any("refengine+replay: batch 2 warm-up" in line for line in recorder.lines)


def test_parse_engine_lanes() -> None:
    """The engine benchmarks' --lanes: names of the shared table, in the order given."""
    assert parse_engine_lanes("mtp-chain, plain") == ["mtp-chain", "plain"]
    assert ENGINE_LANES["plain"] is None and ENGINE_LANES["eagle-chain"] is not None
    for bad in ("", "plain,nope", ","):
        with pytest.raises(ValueError, match="--lanes"):
            parse_engine_lanes(bad)


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("1,8,32") == [1, 8, 32]
    assert parse_batch_sizes(" 4 ") == [4]
    for bad in ("", "1,x", "0", "-2"):
        with pytest.raises(ValueError, match=r"^--batch-sizes"):
            parse_batch_sizes(bad)


def test_ratios_set_graph_lanes_beside_eager_and_other_backends() -> None:
    """``--spec none`` with a graph twin: the twin over its eager lane, and both of the first
    backend's lanes over the other backend; with a spec, every configuration over plain."""
    plain = BenchResult("none", "m", 4, 1, ["refengine", "refengine+compiled", "hf"], {})
    assert ratio_pairs(plain) == [("refengine+compiled", "refengine"), ("refengine", "hf"),
                                  ("refengine+compiled", "hf")]
    spec = BenchResult("eagle", "m", 4, 1, ["plain", "plain+compiled", "chain-s3-n4"], {})
    assert ratio_pairs(spec) == [("plain+compiled", "plain"), ("chain-s3-n4", "plain")]


def test_overlap_lanes_are_set_beside_their_sequential_twins() -> None:
    """``--spec eagle-v2``: each V2 lane (and its graph twin) over its V1 twin, so the table
    reads V2/V1 off at every batch size."""
    lanes = ["plain", "chain-s3-n4", "chain-s3-n4-v2", "chain-s3-n4+cuda",
             "chain-s3-n4-v2+cuda"]
    result = BenchResult("eagle-v2", "m", 4, 1, lanes, {})
    pairs = ratio_pairs(result)
    assert ("chain-s3-n4-v2", "chain-s3-n4") in pairs
    assert ("chain-s3-n4-v2+cuda", "chain-s3-n4+cuda") in pairs


def test_the_fastest_lane_is_set_against_each_yardstick() -> None:
    """With a spec, further backends are yardsticks: each batch size's fastest lane of the
    first backend is printed over each of them."""
    result = BenchResult("mtp", "m", 4, 1, ["plain", "mtp-chain+frozen", "ctranslate2", "hf"],
                         {}, yardsticks=["ctranslate2", "hf"])
    speeds = {"plain": 400.0, "mtp-chain+frozen": 1100.0, "ctranslate2": 1375.0, "hf": 275.0}
    result.rows.append(BenchRow(1, {n: BackendTiming(v, 64, 64 / v) for n, v in speeds.items()}))
    assert ("batch 1: fastest lane mtp-chain+frozen (1,100.0 tok/s) = 0.80x ctranslate2, "
            "4.00x hf") in format_table(result).splitlines()
    assert bench_lanes.lanes_for("mtp", ["refengine", "ctranslate2"])[-1].label == "ctranslate2"


def test_with_a_spec_graph_twins_are_set_beside_their_eager_lanes_and_yardsticks() -> None:
    """The GPU bench's ratios: each twin over its eager lane (graphs/eager), a configuration's
    twin over plain decoding's twin (the speedup with graphs), plain's twin over hf."""
    lanes = ["plain", "plain+cuda", "chain-s3-n4", "chain-s3-n4+cuda", "hf"]
    result = BenchResult("eagle", "m", 4, 1, lanes, {}, yardsticks=["hf"])
    assert ratio_pairs(result) == [
        ("plain+cuda", "plain"), ("chain-s3-n4", "plain"), ("chain-s3-n4+cuda", "chain-s3-n4"),
        ("chain-s3-n4+cuda", "plain+cuda"), ("hf", "plain"), ("plain+cuda", "hf")]
    speeds = dict(zip(lanes, (100.0, 400.0, 150.0, 900.0, 50.0), strict=True))
    for b in (1, 32):
        result.rows.append(BenchRow(b, {n: BackendTiming(v * b, 64, 64 / v) for n, v in
                                        speeds.items()}))
    lines = format_table(result).splitlines()
    # more lanes and ratios than fit side by side: a row per lane, then a row per ratio, a
    # column per batch size in both
    assert [ln.split() for ln in lines if ln.startswith(("lane ", "chain-s3-n4+cuda "))] == [
        ["lane", "batch", "1", "tok/s", "batch", "32", "tok/s"],
        ["chain-s3-n4+cuda", "900.0", "28,800.0"]]
    assert [ln.split() for ln in lines if ln.startswith(("ratio ", "chain-s3-n4+cuda/plain+"))
            ] == [["ratio", "batch", "1", "batch", "32"],
                  ["chain-s3-n4+cuda/plain+cuda", "2.25x", "2.25x"]]


def test_step_split_and_the_device_lines() -> None:
    """ms per step from the phase clock; on a CUDA device also the kernels' time, the host
    share, capture cost and peak memory; a CPU result prints only a graph lane's first-use
    cost."""
    t = BackendTiming(100.0, 40, 0.4, phase_seconds={"schedule": 0.04, "decode": 0.2,
                                                     "prefill": 0.06},
                      steps=40, device_seconds=0.1, held_gpu_bytes=2**20,
                      peak_gpu_bytes=3 * 2**20,
                      capture_seconds=1.5)
    assert bench_result_module.step_split(t) == pytest.approx(
        {"step": 10.0, "schedule": 1.0, "forwards": 6.5, "resolve": 2.5, "device": 2.5,
         "host share": 75.0})
    assert bench_result_module.step_split(BackendTiming(1.0, 1, 1.0)) == {}
    hf_like = BackendTiming(100.0, 40, 0.4, steps=1, device_seconds=0.3)
    assert bench_result_module.step_split(hf_like) == pytest.approx(
        {"step": 400.0, "device": 300.0, "host share": 25.0})
    result = BenchResult("none", "m", 4, 1, ["refengine+cuda"], {}, device="NVIDIA H100")
    result.rows.append(BenchRow(1, {"refengine+cuda": t}))
    table = format_table(result)
    assert "device=NVIDIA H100" in table.splitlines()[0]
    assert ("  batch   1 refengine+cuda: step 10.000, schedule 1.000, forwards 6.500, resolve "
            "2.500, device 2.500, host share 75.0%, capture 1.50 s, holds 1.0 MiB, "
            "peak 3.0 MiB") in table
    cpu = BenchResult("none", "m", 4, 1, ["refengine"], {})
    cpu.rows.append(BenchRow(1, {"refengine": t}))
    assert "host share" not in format_table(cpu)
    assert format_table(cpu).splitlines()[-1] == (
        "first use of each graph lane's shapes (compile, build or load), beyond its timed "
        "run: batch 1 refengine 1.50 s")


def test_the_device_meter_does_nothing_on_the_cpu() -> None:
    meter = DeviceMeter("cpu")
    meter.sync()
    meter.reset_peak()
    assert meter.peak_bytes() is None and meter.allocated_bytes() is None
    assert meter.name() == "cpu"
    assert meter.kernel_seconds(lambda: pytest.fail("profiled on a CPU")) is None


def test_a_cpu_bench_counts_steps_and_records_no_device_figures(random_model_dir: Path) -> None:
    result = run_bench(["refengine"], [2], 4, "none", Recorder(), model=str(random_model_dir),
                       graphs="replay", device="cpu")
    assert result.device == "cpu"
    for t in result.rows[0].results.values():
        assert t.steps >= 4  # a prefill and a decode step per token at least
        assert (t.device_seconds, t.held_gpu_bytes, t.peak_gpu_bytes) == (None, None, None)
    assert result.rows[0].results["refengine"].capture_seconds is None
    assert result.rows[0].results["refengine+replay"].capture_seconds is not None


def test_eagle3_lanes_sit_beside_eagle_at_each_shape() -> None:
    """``--spec eagle3`` / ``eagle3-tree``: each EAGLE-3 configuration follows its EAGLE twin
    (the EAGLE-1 head at the same shape), so the two heads' tau are read side by side."""
    for spec, shapes in (("eagle3", ["chain-s3-n4", "chain-s5-n6"]),
                         ("eagle3-tree", ["tree-s3-k4-n8", "tree-s5-k8-n16"])):
        lanes = bench_lanes.lanes_for(spec, ["refengine"])
        assert [ln.label for ln in lanes] == ["plain", *(label for shape in shapes
                                                         for label in (shape, f"eagle3-{shape}"))]
        assert [(ln.spec.algorithm, ln.spec.draft_model) for ln in lanes[1:] if ln.spec] == [
            ("eagle", "tiny-code-eagle"), ("eagle3", "tiny-code-eagle3")] * 2


def test_draft_model_overrides_the_specs_own_lanes_not_their_eagle_twins() -> None:
    """``--draft-model`` names the spec's own head: an EAGLE-3 head (or an MTP assistant) is
    no EAGLE-1 head, so the twins keep theirs; n-gram lookup reads no model, so there the flag
    names its twins' head."""
    def drafts(spec: str, draft: str) -> list[tuple[str, str]]:
        lanes = bench_lanes.with_draft_model(bench_lanes.lanes_for(spec, ["refengine"]), draft,
                                             spec)
        return [(ln.label, ln.spec.draft_model) for ln in lanes if ln.spec is not None]

    assert drafts("eagle3", "other-eagle3")[:2] == [("chain-s3-n4", "tiny-code-eagle"),
                                                    ("eagle3-chain-s3-n4", "other-eagle3")]
    assert drafts("mtp", "other-mtp")[:2] == [("chain-s3-n4", "tiny-code-eagle"),
                                              ("mtp-chain-s3-n4", "other-mtp")]
    assert drafts("ngram", "other-eagle")[:2] == [("chain-s3-n4", "other-eagle"),
                                                  ("ngram-n4", "")]
    assert {d for _, d in drafts("eagle-v2", "other-eagle")} == {"other-eagle"}


def test_chain_lanes_follow_each_backends_eagle3_claim() -> None:
    """``--spec chains``: EAGLE-3's chains right after EAGLE's, on every backend claiming
    ``eagle3`` and no other, drafting with the spec's own head whatever the EAGLE lanes' head;
    a backend claiming ``graph_runner`` adds a graph twin of each."""
    claims = {"refengine": {"none", "eagle", "eagle3"}, "vllm": {"none", "eagle", "eagle3"},
              "hf": {"none"}}
    lanes = bench_lanes.chain_lanes(["refengine", "vllm", "hf"], lambda b, a: a in claims[b],
                                    "some-eagle-head")
    assert [(ln.backend, ln.label) for ln in lanes][3:] == [
        ("refengine", "chain-s3-n4"), ("vllm", "chain-s3-n4"),
        ("refengine", "chain-s5-n6"), ("vllm", "chain-s5-n6"),
        ("refengine", "eagle3-chain-s3-n4"), ("vllm", "eagle3-chain-s3-n4"),
        ("refengine", "eagle3-chain-s5-n6"), ("vllm", "eagle3-chain-s5-n6")]
    assert {ln.spec.draft_model for ln in lanes if ln.spec and ln.spec.algorithm == "eagle3"} \
        == {"tiny-code-eagle3"}
    without = bench_lanes.chain_lanes(["vllm"], lambda b, a: a in {"none", "eagle"})
    assert not any(ln.spec and ln.spec.algorithm == "eagle3" for ln in without)
    graphs = bench_lanes.with_graph_lanes(lanes, "aot", lambda b: b == "refengine")
    assert [ln.label for ln in graphs if ln.backend == "refengine"][-2:] == [
        "eagle3-chain-s5-n6", "eagle3-chain-s5-n6+aot"]


def test_an_eagle3_bench_reports_both_heads_tau() -> None:
    """The bundled target with ``tiny-code-eagle3`` beside ``tiny-code-eagle``: every
    speculative lane drafts and reports tau and per-position acceptance."""
    result = run_bench(["refengine"], [1], 4, "eagle3", Recorder())
    assert result.backends == ["plain", "chain-s3-n4", "eagle3-chain-s3-n4", "chain-s5-n6",
                               "eagle3-chain-s5-n6"]
    timings = result.rows[0].results
    assert timings["plain"].tau is None
    for label in result.backends[1:]:
        assert timings[label].tau is not None and timings[label].tau >= 1.0
        assert timings[label].per_position_acceptance
        assert timings[label].total_tokens == 4
    assert "batch   1 eagle3-chain-s3-n4: tau " in format_table(result)

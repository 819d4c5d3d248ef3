"""``specgate bench --spec chains``: lane planning for several backends, the worker's JSON, the
per-process runner (the reference engine, hf and a broken engine, each in a process of its
own, on the random tiny Llama), the output comparison, the table and its summary line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conformance.bench import isolated
from conformance.bench.compare import format_isolated, outputs_verdict, reference_backend
from conformance.bench.isolated import IsolatedBench, LaneRun, run_worker
from conformance.bench.lanes import (
    SHARED_EAGLE_HEAD,
    Lane,
    Workload,
    chain_lanes,
    parse_backends,
)
from conformance.bench.result import BackendTiming, BenchResult, BenchRow
from conformance.bench.worker import LaneJob
from conformance.cli import main
from conformance.contract import SpecConfig

CLAIMS = {"refengine": {"none", "eagle", "ngram", "draft_model", "frozen_kv_mtp"},
          "vllm": {"none", "eagle", "ngram", "draft_model"}, "hf": {"none", "draft_model"}}


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


def test_every_chain_lane_runs_on_each_backend_claiming_its_algorithm() -> None:
    lanes = chain_lanes(["refengine", "vllm", "hf"], lambda b, a: a in CLAIMS[b])
    assert [(ln.backend, ln.label) for ln in lanes] == [
        ("refengine", "plain"), ("vllm", "plain"), ("hf", "plain"),
        ("refengine", "chain-s3-n4"), ("vllm", "chain-s3-n4"),
        ("refengine", "chain-s5-n6"), ("vllm", "chain-s5-n6"),
        ("refengine", "ngram-n4"), ("vllm", "ngram-n4"),
        ("refengine", "ngram-n6"), ("vllm", "ngram-n6"),
        ("refengine", "draft-n4"), ("vllm", "draft-n4"), ("hf", "draft-n4"),
        ("refengine", "draft-n6"), ("vllm", "draft-n6"), ("hf", "draft-n6")]
    drafts = {(ln.label, ln.spec.draft_model) for ln in lanes if ln.spec and ln.spec.draft_model}
    assert drafts == {("chain-s3-n4", SHARED_EAGLE_HEAD), ("chain-s5-n6", SHARED_EAGLE_HEAD),
                      ("draft-n4", "tiny-code-draft"), ("draft-n6", "tiny-code-draft")}
    own_head = chain_lanes(["refengine"], lambda b, a: True, "tiny-code-eagle")
    assert own_head[1].spec is not None and own_head[1].spec.draft_model == "tiny-code-eagle"


def test_parse_backends() -> None:
    assert parse_backends(" refengine, vllm ") == ["refengine", "vllm"]
    for bad, needle in ((",", "expected comma-separated"), ("vllm,refengine,vllm", "twice")):
        with pytest.raises(ValueError, match=rf"^--backends: .*{needle}"):
            parse_backends(bad)


def test_a_job_and_a_result_round_trip_through_json() -> None:
    spec = SpecConfig(algorithm="eagle", draft_model=SHARED_EAGLE_HEAD, num_steps=3, topk=1,
                      num_draft_tokens=4)
    job = LaneJob(Lane("chain-s3-n4+aot", "refengine", spec, "aot"),
                  Workload("tiny-code", (1, 8), 16, min_requests=8, repeats=2))
    assert LaneJob.from_json(job.to_json()) == job
    result = BenchResult("chains", "tiny-code", 16, 2, ["plain"], {"plain": "refengine 0.1"},
                         open_seconds={"plain": 1.5})
    result.rows.append(BenchRow(1, {"plain": BackendTiming(100.0, 32, 0.32, tau=2.5,
                                                           outputs=[[1, 2], [3, 4]])}))
    assert BenchResult.from_dict(json.loads(json.dumps(dataclasses.asdict(result)))) == result
    with pytest.raises(ValueError, match=r"^--max-new-tokens: must be >= 1"):
        Workload("tiny-code", (1,), 0)


@pytest.fixture(scope="module")
def worker_runs(random_model_dir: Path) -> dict[str, tuple[BenchResult, list[str]]]:
    """Plain decoding in a worker process each: the reference engine, hf (a correct engine)
    and a broken one (one token too many per request)."""
    workload = Workload(str(random_model_dir), (1, 2), 3, min_requests=2)
    runs = {}
    for backend in ("refengine", "hf", "mutant:max_new_tokens_off_by_one"):
        recorder = Recorder()
        runs[backend] = run_worker(Lane("plain", backend, None), workload, recorder), \
            recorder.lines
    return runs


def test_a_worker_measures_its_lane_in_a_process_of_its_own(
        worker_runs: dict[str, tuple[BenchResult, list[str]]]) -> None:
    result, lines = worker_runs["refengine"]
    assert [row.batch_size for row in result.rows] == [1, 2]
    for row in result.rows:
        timing = row.results["plain"]
        assert timing.total_tokens == 2 * 3 and len(timing.outputs) == 2
        assert all(len(out) == 3 for out in timing.outputs)
    assert result.open_seconds["plain"] > 0
    assert result.versions["plain"].startswith("refengine ")
    assert any(line.startswith("note opening plain (refengine") for line in lines)
    assert any("plain" in line and "tok/s" in line for line in lines)


def test_outputs_are_compared_with_the_reference_engines(
        worker_runs: dict[str, tuple[BenchResult, list[str]]]) -> None:
    """A correct engine's greedy outputs are the reference's; a broken one's are not."""
    def outputs(backend: str, batch: int) -> list[list[int]]:
        return worker_runs[backend][0].rows[batch].results["plain"].outputs

    for batch in (0, 1):
        assert outputs_verdict(outputs("refengine", batch), outputs("hf", batch)) == "same"
        assert outputs_verdict(outputs("refengine", batch),
                               outputs("mutant:max_new_tokens_off_by_one", batch)) == \
            "2 of 2 differ"


def test_a_backend_the_worker_cannot_load_is_one_line(random_model_dir: Path) -> None:
    with pytest.raises(ValueError) as err:
        run_worker(Lane("plain", "nomodule_xyz:backend", None),
                   Workload(str(random_model_dir), (1,), 2), Recorder())
    message = str(err.value)
    assert message.startswith("backend 'nomodule_xyz:backend' in its bench process: ")
    assert "cannot import 'nomodule_xyz'" in message and "\n" not in message


def test_outputs_verdict() -> None:
    assert outputs_verdict([[1, 2], [3]], [[1, 2], [3]]) == "same"
    assert outputs_verdict([[1, 2], [3], [4]], [[1, 2], [5], [4]]) == "1 of 3 differ"
    with pytest.raises(ValueError, match="outputs of 1 requests against 2"):
        outputs_verdict([[1], [2]], [[1]])
    assert reference_backend(["vllm", "refengine"]) == "refengine"
    assert reference_backend(["vllm", "hf"]) == "vllm"


def _run(backend: str, lane: str, speeds: dict[int, float], outputs: list[list[int]],
         tau: float | None = None) -> LaneRun:
    result = BenchResult("chains", "m", 2, 2, [lane], {lane: f"{backend} 1.0"},
                         open_seconds={lane: 2.0})
    result.rows = [BenchRow(b, {lane: BackendTiming(v, 4, 4 / v, tau=tau, steps=4,
                                                    outputs=outputs)})
                   for b, v in speeds.items()]
    return LaneRun(backend, lane, result)


def test_the_table_compares_outputs_and_sets_best_lanes_side_by_side() -> None:
    same, other = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    bench = IsolatedBench("m", 2, 2, 1, [1, 8], ["refengine", "vllm"], "refengine",
                          SHARED_EAGLE_HEAD, [
                              _run("refengine", "plain", {1: 100.0, 8: 400.0}, same),
                              _run("refengine", "plain+aot", {1: 150.0, 8: 500.0}, same),
                              _run("vllm", "plain", {1: 120.0, 8: 300.0}, other),
                              _run("refengine", "chain-s3-n4", {1: 180.0, 8: 350.0}, same, 2.5),
                              _run("vllm", "chain-s3-n4", {1: 200.0, 8: 320.0}, same, 2.25),
                              _run("vllm", "ngram-n4", {1: 90.0, 8: 100.0}, same, 1.5)])
    lines = format_isolated(bench).splitlines()
    rows = [line.split(maxsplit=7) for line in lines if line.startswith(("refengine", "vllm"))]
    assert rows[:6] == [
        ["refengine", "plain", "1", "100.0", "-", "10.00", "2.00", "reference"],
        ["refengine", "plain+aot", "1", "150.0", "-", "6.67", "2.00", "same"],
        ["vllm", "plain", "1", "120.0", "-", "8.33", "2.00", "1 of 2 differ"],
        ["refengine", "chain-s3-n4", "1", "180.0", "2.50", "5.56", "2.00", "reference"],
        ["vllm", "chain-s3-n4", "1", "200.0", "2.25", "5.00", "2.00", "same"],
        ["vllm", "ngram-n4", "1", "90.0", "1.50", "11.11", "2.00", "-"]]
    assert len(rows) == 12 and rows[6][:3] == ["refengine", "plain", "8"]
    assert lines[-2:] == [
        "batch 1: refengine's best lane chain-s3-n4 (180.0 tok/s) = 0.90x vllm's best lane "
        "chain-s3-n4 (200.0 tok/s)",
        "batch 8: refengine's best lane plain+aot (500.0 tok/s) = 1.56x vllm's best lane "
        "chain-s3-n4 (320.0 tok/s)"]
    assert "  vllm: vllm 1.0, torch threads 2" in lines


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("specgate: error:"), err
    return err[0]


@pytest.mark.parametrize("backends, needle", [(",", "--backends: expected"),
                                              ("refengine,refengine", "--backends: refengine "
                                                                      "named twice"),
                                              ("refengine,nomodule_xyz:b", "nomodule_xyz")])
def test_backends_errors_are_one_line(capsys: pytest.CaptureFixture[str], backends: str,
                                      needle: str, random_model_dir: Path) -> None:
    for spec in ("chains", "none"):
        assert needle in _usage_error(capsys, "bench", "--spec", spec, "--backends", backends,
                                      "--model", str(random_model_dir))


def test_vllm_missing_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    line = _usage_error(capsys, "bench", "--spec", "chains", "--backends", "refengine,vllm")
    assert "backend 'vllm'" in line and "pip install" in line


def test_the_command_prints_the_table_and_writes_the_json(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """The lanes the command plans (with a graph twin per lane of the backend claiming a graph
    runner) reach the runner, and its table and JSON come out (the worker itself stubbed: the
    runner's own test starts real processes)."""
    seen: list[tuple[str, str, str | None]] = []

    def stub(lane: Lane, workload: Workload, progress: object) -> BenchResult:
        seen.append((lane.backend, lane.label, lane.spec and lane.spec.draft_model))
        assert workload == Workload("tiny-code", (1,), 2, 1, 1, "cpu")
        return _run(lane.backend, lane.label, {1: 10.0}, [[1, 2]]).result

    monkeypatch.setattr(isolated, "run_worker", stub)
    target = tmp_path / "bench.json"
    code = main(["bench", "--spec", "chains", "--backends", "refengine,hf", "--batch-sizes",
                 "1", "--max-new-tokens", "2", "--min-requests", "1", "--graphs", "replay",
                 "--json", str(target)])
    out = capsys.readouterr().out
    assert code == 0
    assert seen[:4] == [("refengine", "plain", None), ("refengine", "plain+replay", None),
                        ("hf", "plain", None), ("refengine", "chain-s3-n4", SHARED_EAGLE_HEAD)]
    assert ("hf", "draft-n6", "tiny-code-draft") in seen and len(seen) == 9 + 9 + 3
    assert ("refengine", "eagle3-chain-s3-n4+replay", "tiny-code-eagle3") in seen
    assert "batch 1: refengine's best lane plain (10.0 tok/s) = 1.00x hf's best lane " \
        "plain (10.0 tok/s)" in out
    data = json.loads(target.read_text())
    assert data["reference"] == "refengine" and len(data["runs"]) == 21
    assert data["runs"][0]["result"]["rows"][0]["results"]["plain"]["outputs"] == [[1, 2]]

"""The reference engine's graph probe (``conformance/backends/refengine/graph_probe.py``) and
the graph tier's mutant: the probe speaks the protocol, its runs are deterministic and
self-contained, it uses the engine's own graph runner, and the tier's padding check kills
``stale_padded_rows`` while graph == eager cannot see it. Probes that misreport (wrappers of the
reference probe, ``Misreporting``) make no check pass vacuously: a max batch with no padded
row, a max context below every key width, an infinite tolerance, empty outputs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conformance.backends.mutants import MUTANTS, mutant_backend
from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.backends.refengine.graph_kinds import KINDS
from conformance.backends.refengine.graph_kinds import PADDED_FIELDS as REF_PADDED_FIELDS
from conformance.backends.refengine.graph_probe import RefGraphProbe
from conformance.checks.graph import (
    TOLERANCE_CAP,
    NotApplicable,
    Recorder,
    check_graph_matches_eager,
    check_key_width_boundaries,
    check_no_history_dependence,
    check_padding_policy,
    check_poisoned_padding,
    check_probe_bounds,
    compare_outputs,
    near_tie_flips,
)
from conformance.cli import main
from conformance.contract import GraphProbe, KeyWidthProbe, OpenConfig
from conformance.contract.graph_probe import (
    PADDED_FIELDS,
    STATE_DIGESTS,
    GraphCase,
    GraphRun,
    Mode,
)
from conformance.plan.run_plan import RunPlan
from conformance.run.suite import SuiteOptions, run_suite
from refengine.config import SamplingParams
from refengine.graph.runner import GraphRunner

LIMITS = {"max_running_requests": 10, "kv_pool_tokens": 1024, "page_size": 4}


@pytest.fixture
def open_handle(random_model_dir: Path, one_torch_thread: None) -> Iterator[
        type[RefEngineHandle]]:
    handles: list[RefEngineHandle] = []

    def opened(graphs: str | None = None, backend: RefEngineBackend | None = None,
               **limits: int) -> RefEngineHandle:
        cfg = OpenConfig(model=str(random_model_dir), graph_executor=graphs,
                         **(LIMITS | limits))  # type: ignore[arg-type]
        handle = (backend or RefEngineBackend()).open(cfg)
        handles.append(handle)
        return handle

    yield opened  # type: ignore[misc]
    for handle in handles:
        handle.close()


def test_speaks_the_protocol(open_handle: type[RefEngineHandle]) -> None:
    probe = open_handle().graph_probe()  # type: ignore[call-arg]
    assert isinstance(probe, GraphProbe)
    assert set(REF_PADDED_FIELDS.values()) == set(PADDED_FIELDS)
    assert probe.kinds() == ("decode", "verify-chain", "verify-tree")  # no draft model
    assert set(KINDS) == {*probe.kinds(), "draft:eagle", "draft:mtp", "extend:eagle",
                          "step:eagle-chain", "step:mtp-chain"}
    assert probe.buckets() == (1, 2, 4, 8, 10) and probe.max_batch() == 10
    assert all(probe.writes_kv(k) for k in probe.kinds())
    assert probe.padding_policy("decode").length_fill == 1
    assert probe.padding_policy("verify-tree").length_fill == 4  # no spec: 4 verify tokens
    run = probe.run(GraphCase("verify-tree", 3), "graph")
    assert run.bucket == 4 and set(run.state) == set(run.initial) == set(STATE_DIGESTS)
    assert set(run.padded) == set(PADDED_FIELDS)
    assert run.padded["token_ids"].shape == (1, 4) and run.padded["request_rows"].shape == (1,)
    assert run.outputs["logits"].shape[0] == 3 * 4 and run.outputs["kv_k"].shape[1] == 12
    eager = probe.run(GraphCase("verify-tree", 3), "eager")
    assert eager.bucket == 3 and eager.buffers == {} and eager.padded == {}
    assert eager.key_width is None and run.key_width == 256
    assert isinstance(probe, KeyWidthProbe) and probe.key_widths("decode") == (256, 512)
    wide = probe.run(GraphCase("decode", 3, context=257), "graph")
    assert wide.key_width == 512 and wide.bucket == 4


def test_runs_are_deterministic_and_self_contained(
        open_handle: type[RefEngineHandle]) -> None:
    """The same case gives the same bits and digests whatever ran between (another seed's
    world included); another seed gives other inputs; the engine ends idle."""
    handle = open_handle()
    probe = handle.graph_probe()  # type: ignore[call-arg]
    first = probe.run(GraphCase("decode", 5, seed=0), "eager")
    other = probe.run(GraphCase("decode", 5, seed=1), "eager")
    assert not torch.equal(first.outputs["logits"], other.outputs["logits"])
    probe.run(GraphCase("verify-chain", 10, seed=1), "graph", poison=True)
    again = probe.run(GraphCase("decode", 5, seed=0), "eager")
    compare_outputs(again, first, 0, "rerun")
    assert again.state == first.state and again.initial == first.initial
    bigger = probe.run(GraphCase("decode", 7, seed=0), "eager")  # extends the smaller batch
    assert torch.equal(bigger.outputs["next_tokens"][:5], first.outputs["next_tokens"])
    # The world's requests hold rows and KV until the probe releases them.
    assert handle.memory().rows_free < handle.memory().rows_capacity
    probe.release()
    memory = handle.memory()
    assert memory.rows_free == memory.rows_capacity and memory.free == memory.capacity
    assert [len(o.output_ids) for o in handle.engine.generate([[5, 6, 7]], SamplingParams(
        max_new_tokens=3, temperature=0.0, ignore_eos=True))] == [3]


def test_the_kv_digest_sees_every_changed_bit_outside_the_skipped_slots(
        open_handle: type[RefEngineHandle]) -> None:
    """The "kv" state digest of a run on a world: any changed bit of any pool (target K or V)
    outside the run's targets changes it, NaN and a sign-only change of zero included;
    changes in a target slot do not; putting the bytes back restores it."""
    probe = open_handle().graph_probe()  # type: ignore[call-arg]
    targets = torch.tensor([40, 41])
    k, v = probe.kv.target_pool.k, probe.kv.target_pool.v
    with probe.requests(3, seed=2):
        clean = probe.digests(targets, "decode")["kv"]
        for pool, at in ((k, (1, 300, 1, 7)), (v, (0, 999, 0, 0))):
            kept = pool[at].clone()
            for value in (kept + 1e-6, float("nan"), -kept):
                pool[at] = value
                assert probe.digests(targets, "decode")["kv"] != clean, (at, value)
            pool[at] = kept
            assert probe.digests(targets, "decode")["kv"] == clean
        v[0, 999, 0, 0], kept = 0.0, v[0, 999, 0, 0].clone()
        zero = probe.digests(targets, "decode")["kv"]
        v[0, 999, 0, 0] = -0.0
        assert probe.digests(targets, "decode")["kv"] != zero
        v[0, 999, 0, 0] = kept
        k[1, 41] += 1.0  # a target slot: the run's own write
        assert probe.digests(targets, "decode")["kv"] == clean


def test_bad_use_is_refused(open_handle: type[RefEngineHandle]) -> None:
    handle = open_handle()
    probe = handle.graph_probe()  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="raw"):
        probe.run(GraphCase("decode", 11), "graph")
    with pytest.raises(ValueError, match="unknown graph kind"):
        probe.run(GraphCase("prefill", 1), "graph")
    with pytest.raises(ValueError, match="poison"):
        probe.run(GraphCase("decode", 1), "eager", poison=True)
    with pytest.raises(ValueError, match="mode"):
        probe.run(GraphCase("decode", 1), "lazy")  # type: ignore[arg-type]
    busy = open_handle()
    busy.engine.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=2))
    busy.step()
    with pytest.raises(RuntimeError, match="idle"):
        busy.graph_probe()  # type: ignore[call-arg]


def test_uses_the_engines_graph_runner(open_handle: type[RefEngineHandle]) -> None:
    """With graphs on, decode replays on the engine's own runner; verify (no spec: the engine
    has no verify kind) on one of the same class and executor. With graphs off, on a replay
    runner of the engine's class."""
    engine = open_handle("replay").engine
    probe = RefGraphProbe.for_engine(engine)
    assert probe.graph("decode") is engine.runner
    verify = probe.graph("verify")
    assert verify is not engine.runner and type(verify) is type(engine.runner)
    assert verify.executor.name == "replay" and verify.runner is engine.runner.runner
    plain = open_handle().engine
    probe = RefGraphProbe.for_engine(plain)
    assert isinstance(probe.graph("decode"), GraphRunner)
    assert probe.graph("decode") is probe.graph("verify") and probe.runner is plain.runner


def test_stale_padded_rows_is_invisible_in_outputs_but_not_in_the_padding(
        open_handle: type[RefEngineHandle]) -> None:
    """The mutant opens with the graph runner on; graph == eager passes (the padded rows'
    outputs are sliced away and they still write the dummy slot), the padding check fails and
    names the field."""
    handle = open_handle(backend=mutant_backend("stale_padded_rows"))
    assert handle.engine.config.cuda_graph and handle.engine.config.graph_executor == "replay"
    probe = handle.graph_probe()  # type: ignore[call-arg]
    for kind in probe.kinds():
        check_graph_matches_eager(probe, kind)
    with pytest.raises(AssertionError, match=r"kind=decode raw=3 bucket=4 .*padded request_rows"):
        check_padding_policy(probe, "decode")
    assert MUTANTS["stale_padded_rows"].bug_class.startswith("Stale padded rows")


def test_mutants_command_kills_stale_padded_rows(capsys: pytest.CaptureFixture[str],
                                                 random_model_dir: Path) -> None:
    code = main(["mutants", "--only", "stale_padded_rows", "--model", str(random_model_dir),
                 "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0, rows
    assert rows[0]["status"] == "killed", rows
    assert rows[0]["killed_by"].endswith("test_graph.py::test_padded_rows_follow_the_policy")


@pytest.mark.slow
def test_graph_tier_passes_under_the_compiled_executor(
        random_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier alone, through the plugin, with ``--specgate-graphs compiled``: inductor
    compiles every (kind, bucket) key once (minutes on a cold cache), then every check runs
    on the compiled graphs."""
    from conformance.run.suite import SuiteOptions, suite_args, suite_dir

    opts = SuiteOptions(RunPlan("refengine", ("none",), model=str(random_model_dir),
                                graph_executor="compiled"))
    results = tmp_path / "results.json"
    args = suite_args(opts, results, None)
    assert args[0] == str(suite_dir())
    args[0] = str(suite_dir() / "test_graph.py")  # this tier only
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # as certify runs the suite
    pytest.main(args)
    checks = json.loads(results.read_text())["checks"]
    outcomes = {c["nodeid"].split("::")[-1]: c["outcome"] for c in checks}
    assert outcomes.pop("test_kinds_without_kv_writes_leave_the_pool_untouched") == "skipped"
    assert set(outcomes.values()) == {"passed"} and len(outcomes) == 6, checks


# --- probes that misreport -------------------------------------------------------------------

class Misreporting:
    """The reference probe with some of its reports replaced (``lies``: method name -> the
    value it returns); ``empty_outputs``: every run reports no outputs."""

    def __init__(self, inner: RefGraphProbe, empty_outputs: bool = False,
                 **lies: object) -> None:
        self.inner = inner
        self.lies = lies
        self.empty_outputs = empty_outputs

    def __getattr__(self, name: str) -> object:
        if name in self.lies:
            return lambda *args: self.lies[name]
        return getattr(self.inner, name)

    def run(self, case: GraphCase, mode: Mode, poison: bool = False) -> GraphRun:
        run = self.inner.run(case, mode, poison)
        return replace(run, outputs={}) if self.empty_outputs else run


def test_misreporting_wrappers_are_probes(open_handle: type[RefEngineHandle]) -> None:
    probe = Misreporting(open_handle().graph_probe(), max_batch=1)  # type: ignore[call-arg]
    assert isinstance(probe, GraphProbe) and isinstance(probe, KeyWidthProbe)
    assert probe.max_batch() == 1 and probe.buckets() == (1, 2, 4, 8, 10)


def test_the_reference_probe_is_within_bounds(open_handle: type[RefEngineHandle]) -> None:
    probe = open_handle().graph_probe()  # type: ignore[call-arg]
    check_probe_bounds(probe, LIMITS["max_running_requests"])
    assert probe.float_tolerance() * 10 <= TOLERANCE_CAP["float32"]


@pytest.mark.parametrize("max_batch", [0, LIMITS["max_running_requests"] + 1])
def test_a_max_batch_outside_the_engines_requests_is_refused(
        open_handle: type[RefEngineHandle], max_batch: int) -> None:
    probe = Misreporting(open_handle().graph_probe(), max_batch=max_batch)  # type: ignore
    with pytest.raises(AssertionError, match=rf"max_batch\(\) {max_batch}: must be 1 to 10"):
        check_probe_bounds(probe, LIMITS["max_running_requests"])  # type: ignore[arg-type]


def test_a_max_batch_with_no_padded_row_makes_the_padding_checks_not_applicable(
        open_handle: type[RefEngineHandle]) -> None:
    """Max batch 1 on buckets from 1: no raw size runs padded. The padding checks would
    check nothing: not applicable (never passed); graph == eager still runs its one size."""
    probe = Misreporting(open_handle().graph_probe(), max_batch=1)  # type: ignore[call-arg]
    for check in (check_padding_policy, check_poisoned_padding):
        with pytest.raises(NotApplicable, match=r"no raw size 1\.\.1 runs padded"):
            check(probe, "decode")  # type: ignore[arg-type]
    assert check_graph_matches_eager(probe, "decode").pointers  # type: ignore[arg-type]


def test_a_max_context_below_every_key_width_is_not_applicable(
        open_handle: type[RefEngineHandle]) -> None:
    probe = Misreporting(open_handle().graph_probe(), max_context=100)  # type: ignore
    with pytest.raises(NotApplicable, match=r"kind=decode: no key length in reach .*"
                                            r"max_context 100"):
        check_key_width_boundaries(probe, "decode", 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("tolerance", [float("inf"), float("nan"), -1.0,
                                       2 * TOLERANCE_CAP["float32"]])
def test_a_tolerance_that_is_not_finite_or_past_the_cap_is_refused(
        open_handle: type[RefEngineHandle], tolerance: float) -> None:
    probe = Misreporting(open_handle().graph_probe(),  # type: ignore[call-arg]
                         float_tolerance=tolerance)
    with pytest.raises(AssertionError, match=r"float_tolerance\(\) .*: must be finite, from "
                                             r"0 to 0\.001 \(the cap for a float32"):
        check_graph_matches_eager(probe, "decode")  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="float_tolerance"):
        check_key_width_boundaries(probe, "decode", 3)  # type: ignore[arg-type]


def test_the_cap_follows_the_declared_precision(open_handle: type[RefEngineHandle]) -> None:
    probe = Misreporting(open_handle().graph_probe(),  # type: ignore[call-arg]
                         float_tolerance=TOLERANCE_CAP["bfloat16"])
    check_graph_matches_eager(probe, "decode", precision="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="the cap for a float32 backend"):
        check_graph_matches_eager(probe, "decode")  # type: ignore[arg-type]


def test_empty_outputs_are_refused(open_handle: type[RefEngineHandle]) -> None:
    """Empty outputs would compare equal to each other: a run that reports none (or an empty
    tensor) is refused, whichever check runs it."""
    probe = Misreporting(open_handle().graph_probe(), empty_outputs=True)  # type: ignore
    for check in (check_graph_matches_eager, check_padding_policy, check_no_history_dependence):
        with pytest.raises(AssertionError, match=r"reported no outputs for \d+ real rows"):
            check(probe, "decode")  # type: ignore[arg-type]
    real = open_handle().graph_probe()  # type: ignore[call-arg]
    run = real.run(GraphCase("decode", 2), "eager")
    hollow = Misreporting(real)
    hollow.run = lambda case, mode, poison=False: replace(  # type: ignore[method-assign]
        run, outputs={**run.outputs, "logits": run.outputs["logits"][:0]})
    with pytest.raises(AssertionError, match=r"reported empty \['logits'\]"):
        Recorder(hollow).run("decode", 2, "eager")  # type: ignore[arg-type]


class MisreportingBackend(RefEngineBackend):
    """The reference engine whose graph probe reports max batch 1, a max context below every
    key width and an infinite float tolerance."""

    name = "misreporting-graph-probe"

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        handle = super().open(cfg)
        probe = Misreporting(handle.graph_probe(), max_batch=1, max_context=100,
                             float_tolerance=float("inf"))
        handle.graph_probe = lambda: probe  # type: ignore[method-assign]
        return handle


def misreporting_backend() -> MisreportingBackend:
    return MisreportingBackend()


def test_the_tier_never_passes_a_check_that_ran_nothing(tmp_path: Path,
                                                        random_model_dir: Path) -> None:
    """Through the suite: what the lies would have emptied is not applicable, with why; the
    infinite tolerance fails graph == eager; what still runs something passes."""
    run = run_suite(SuiteOptions(RunPlan("tests.test_graph_probe:misreporting_backend",
                                         ("none",), model=str(random_model_dir),
                                         keyword="test_graph")),
                    tmp_path / "results.json")
    assert run.results is not None, run.problems
    rows = {c.nodeid.split("::")[-1]: c for c in run.results.checks
            if c.nodeid.startswith("test_graph.py")}
    outcomes = {name: row.outcome for name, row in rows.items()}
    assert outcomes == {
        "test_padded_rows_follow_the_policy": "skipped",
        "test_graph_matches_eager_at_every_size": "failed",
        "test_poisoned_padding_changes_nothing": "skipped",
        "test_no_history_dependence": "passed",
        "test_static_buffers_stay_put_and_outputs_are_fresh": "passed",
        "test_kinds_without_kv_writes_leave_the_pool_untouched": "skipped",
        "test_graph_matches_eager_either_side_of_every_key_width": "skipped"}, rows
    skipped = [row.message for row in rows.values() if row.outcome == "skipped"]
    assert all(m.startswith("Skipped: not applicable: ") for m in skipped), skipped
    assert "no raw size 1..1 runs padded" in rows["test_padded_rows_follow_the_policy"].message
    assert "max_context 100" in rows[
        "test_graph_matches_eager_either_side_of_every_key_width"].message
    assert "float_tolerance() inf" in rows["test_graph_matches_eager_at_every_size"].message


def _tokens_run(logits: list[list[float]], mode: str) -> GraphRun:
    t = torch.tensor(logits)
    return GraphRun(GraphCase("decode", len(logits)), mode, len(logits),  # type: ignore[arg-type]
                    {"logits": t, "next_tokens": t.argmax(-1)}, {}, {})


def test_greedy_tokens_may_flip_only_at_a_near_tie() -> None:
    """Logits within the tolerance may flip an argmax whose top two are within twice the
    tolerance (a false failure otherwise, on a near-tie of the model); a token that differs
    past that fails, and with tolerance 0 (bitwise comparisons) every flip fails."""
    eager = _tokens_run([[1.0, 0.99995, -3.0], [0.0, 2.0, 1.0]], "eager")
    flipped = _tokens_run([[1.0, 1.00004, -3.0], [0.0, 2.0, 1.0]], "graph")
    compare_outputs(flipped, eager, 1e-4, "near tie")
    assert not near_tie_flips(flipped, eager, 0)
    far = _tokens_run([[1.0, 0.99995, -3.0], [0.0, 2.0, 2.1]], "graph")
    assert near_tie_flips(flipped, eager, 1e-4) and not near_tie_flips(far, eager, 1e-4)
    assert not near_tie_flips(flipped, eager, 1e-5)  # a gap of 5e-5 is past twice 1e-5


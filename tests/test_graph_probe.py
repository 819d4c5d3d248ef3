"""The reference engine's graph probe (``conformance/backends/refengine/graph_probe.py``) and
the graph tier's mutant: the probe speaks the protocol, its runs are deterministic and
self-contained, it uses the engine's own graph runner, and the tier's padding check kills
``stale_padded_rows`` while graph == eager cannot see it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conformance.backends.mutants import MUTANTS, mutant_backend
from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.backends.refengine.graph_kinds import KINDS
from conformance.backends.refengine.graph_kinds import PADDED_FIELDS as REF_PADDED_FIELDS
from conformance.backends.refengine.graph_probe import RefGraphProbe
from conformance.checks.graph import (
    check_graph_matches_eager,
    check_padding_policy,
    compare_outputs,
)
from conformance.cli import main
from conformance.contract import GraphProbe, KeyWidthProbe, OpenConfig
from conformance.contract.graph_probe import PADDED_FIELDS, STATE_DIGESTS, GraphCase
from refengine.config import SamplingParams
from refengine.graph import GraphRunner

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
    assert set(KINDS) == {*probe.kinds(), "draft:eagle", "draft:mtp", "extend:eagle"}
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

    opts = SuiteOptions("refengine", "none", "gate", str(random_model_dir), graphs="compiled")
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

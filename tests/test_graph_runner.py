"""The graph runner against the eager runner, on the small random Llama.

The properties the graph tier states for any backend (``conformance/checks/graph.py``) run here on
the reference engine's probe (``conformance/backends/refengine/graph_probe.py``) over the random
model, for every raw batch size 1..MAX_BS (not only the buckets) and decode and verify (chain and
tree): replay equals eager, poisoned padding changes nothing, padded rows hold the policy and write
nothing a request owns (KV pool, row table, allocator), no history dependence, stable static
buffers, fresh outputs. Beside them, white-box checks the tier cannot make from outside: the staged
attention, capture, fallbacks, key widths, the compiled executor and the benchmark's per-layer
region split (``benchmarks/graph_executors.py``; both exact under Dynamo's eager backend), and
inductor against eager on a few sizes (slow: a cold compile takes tens of seconds here).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.graph_executors import LayersExecutor
from conformance.backends.mutants import MUTANTS
from conformance.backends.refengine.graph_kinds import (
    KINDS,
    ForwardKind,
    decode_batch,
    verify_batch,
)
from conformance.backends.refengine.graph_probe import RefGraphProbe
from conformance.backends.refengine.graph_world import POISON_STYLES
from conformance.checks import graph as checks
from conformance.checks.graph import Recorder, compare_outputs, compare_state
from conformance.contract.graph_probe import GraphCase, GraphProbe, KeyWidthProbe
from refengine.graph.compiled import CompiledExecutor
from refengine.graph.program import Executor
from refengine.graph.runner import GraphBatch, GraphRunner
from refengine.graph.staging import (
    DUMMY_ROW,
    DUMMY_SLOT,
    capture_sizes,
    kv_widths,
    pad_to_bucket,
    static_attention,
)
from refengine.graph.target import GraphKey, TargetForward
from refengine.memory.manager import KVManager
from refengine.model.attention import AttentionMetadata
from refengine.model.llama import LlamaForCausalLM
from refengine.runner import ModelRunner

# The kinds that are one target forward (the draft loops need a draft model:
# tests/test_graph_engine.py runs them)
FORWARD_KINDS = [name for name, kind in KINDS.items() if isinstance(kind, ForwardKind)]
MAX_BS = 10          # buckets 1, 2, 4, 8, 10: sizes 3, 5-7 and 9 are padded
N = 4                # verify tokens per request
PAGE = 4             # the dummy page is slots 0..3

MakeProbe = Callable[..., RefGraphProbe]


@pytest.fixture(scope="module")
def model(random_model_dir: Path, one_torch_thread: None) -> LlamaForCausalLM:
    return LlamaForCausalLM.load(random_model_dir, torch.float32, "cpu")


@pytest.fixture(scope="module")
def make_probe(model: LlamaForCausalLM) -> MakeProbe:
    """A probe on a fresh KV manager over the random model; ``executor`` and ``graph_kw`` go
    to its graph runner (replay, buckets up to MAX_BS, N verify tokens by default)."""

    def make(executor: Any = "replay", graph_class: type[GraphRunner] = GraphRunner,
             **graph_kw: Any) -> RefGraphProbe:
        cfg = model.config
        kv = KVManager(4096, PAGE, MAX_BS, cfg.max_position_embeddings,
                       (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
                       torch.float32, "cpu", row_headroom=N)
        runner = ModelRunner(model, None, kv)
        exe = executor(runner) if callable(executor) else executor
        return RefGraphProbe(runner, make_graph=lambda: graph_class(
            runner, exe, verify_tokens=N, **graph_kw))

    return make


@pytest.fixture(scope="module")
def probe(make_probe: MakeProbe) -> RefGraphProbe:
    return make_probe()


def test_buckets() -> None:
    assert capture_sizes(MAX_BS) == [1, 2, 4, 8, 10]
    assert capture_sizes(1) == [1] and capture_sizes(32)[-1] == 32
    sizes = capture_sizes(MAX_BS)
    assert [pad_to_bucket(n, sizes) for n in range(1, 11)] == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10]
    with pytest.raises(ValueError):
        pad_to_bucket(MAX_BS + 1, sizes)
    assert kv_widths(2052) == [256, 512, 1024, 2052]
    assert kv_widths(516) == [256, 516] and kv_widths(512) == [256, 512]
    assert kv_widths(100) == [100] and kv_widths(257) == [257]


# --- the graph tier's properties, on the reference engine -------------------------------------

@pytest.mark.parametrize("seed", [0, 1])  # other prompt lengths, so other rows and widths
@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_replay_matches_eager_every_size(probe: RefGraphProbe, kind: str, seed: int) -> None:
    checks.check_graph_matches_eager(probe, kind, seed)


@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_padded_rows_follow_the_policy(probe: RefGraphProbe, kind: str) -> None:
    checks.check_padding_policy(probe, kind)


@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_poisoned_padding_changes_nothing(probe: RefGraphProbe, kind: str) -> None:
    checks.check_poisoned_padding(probe, kind)


@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_every_poison_style_changes_nothing(probe: RefGraphProbe, kind: str) -> None:
    """Each poison on its own over the whole tail: out-of-range up, out-of-range down, and
    what an earlier, bigger batch would leave (a live request's row, slots and length, an
    all-visible mask)."""
    rec = Recorder(probe)
    for raw in range(1, MAX_BS + 1):
        clean = rec.run(kind, raw, "graph", seed=1)
        for style in POISON_STYLES:
            poisoned = probe.run(GraphCase(kind, raw, 1), "graph", poison=style)
            compare_outputs(poisoned, clean, 0, f"poison {style}")
            compare_state(poisoned, clean.state, "the clean run's", f"poison {style}")


@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_no_history_dependence(probe: RefGraphProbe, kind: str) -> None:
    checks.check_no_history_dependence(probe, kind)


def test_history_check_probes_when_the_buckets_cover_every_size(
        make_probe: MakeProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Buckets 1, 2, 3 leave no raw size padded: the check still runs every size, after
    each of its preludes, rather than probing nothing and passing."""
    probe = make_probe(sizes=[1, 2, 3])
    cases: list[GraphCase] = []
    run = probe.run
    monkeypatch.setattr(probe, "run", lambda case, *a, **kw: (cases.append(case),
                                                               run(case, *a, **kw))[1])
    checks.check_no_history_dependence(probe, "decode")
    assert {c.raw for c in cases} == {1, 2, 3}
    assert len(cases) == 3 * (1 + 3 * 2), cases  # per size: first run, 3 x (prelude, again)


@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_key_width_boundaries(make_probe: MakeProbe, kind: str) -> None:
    """Key lengths either side of every width (here 64, 128, 256, 516) up to what the model
    reaches: graph == eager on the smallest width that holds the case."""
    probe = make_probe(kv_sizes=[64, 128, 256, 516])
    assert isinstance(probe, KeyWidthProbe) and probe.key_widths(kind) == (64, 128, 256, 516)
    top = probe.max_context(kind)  # one position short of the context limit, plus the block
    assert top == 511 + (1 if kind == "decode" else N)
    assert checks.width_contexts(probe, kind) == [63, 64, 65, 127, 128, 129, 255, 256, 257,
                                                  *([515] if top >= 515 else [])]
    assert checks.width_contexts(probe, kind, up_to=128) == [63, 64, 65, 127, 128]
    checks.check_key_width_boundaries(probe, kind, 3)
    for context, width in ((64, 64), (65, 128), (top, 516)):
        run = probe.run(GraphCase(kind, 3, context=context), "graph")
        assert run.key_width == width and run.bucket == 4, (context, run.key_width)
    with pytest.raises(ValueError, match="context: at most"):
        probe.run(GraphCase(kind, 3, context=top + 1), "graph")
    with pytest.raises(ValueError, match="committed: at least the longest prompt"):
        probe.run(GraphCase(kind, 3, context=8), "graph")


def test_key_width_check_sees_a_width_one_too_narrow(make_probe: MakeProbe) -> None:
    """A runner choosing the width for the cached prefix alone (the zoo's
    ``key_width_ignores_new_tokens``) replays 65 key columns on width 64: the newest key is
    dropped and the outputs differ from eager."""
    probe = make_probe(graph_class=MUTANTS["key_width_ignores_new_tokens"].engine_class
                       .graph_runner_class, kv_sizes=[64, 128, 516])
    with pytest.raises(AssertionError, match=r"context=65 key_width=64: output 'logits'"):
        checks.check_key_width_boundaries(probe, "decode", 3)


def test_a_probe_without_widths_is_still_a_graph_probe(probe: RefGraphProbe) -> None:
    """The widths are optional: a probe with only ``GraphProbe``'s methods is one, and the
    width check refuses it (the tier reports its check not applicable)."""

    methods = ("kinds", "max_batch", "buckets", "padding_policy", "float_tolerance",
               "writes_kv", "run")
    plain = type("Plain", (), {m: staticmethod(getattr(probe, m)) for m in methods})()
    assert isinstance(plain, GraphProbe) and not isinstance(plain, KeyWidthProbe)
    with pytest.raises(AssertionError, match="lists no key widths"):
        checks.check_key_width_boundaries(plain, "decode", 3)  # type: ignore[arg-type]


def test_static_buffers_stay_put_and_outputs_are_fresh(probe: RefGraphProbe) -> None:
    checks.check_static_buffers_and_fresh_outputs(probe)


# --- white-box: what only the engine can see ---------------------------------------------------

@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_graph_key_and_dummy_page(probe: RefGraphProbe, kind: str) -> None:
    """Every raw size replays on its bucket and the kind's staging; what padded rows write to
    the dummy page is finite (real rows' masked key columns read it)."""
    for raw in range(1, MAX_BS + 1):
        with probe.prepared(GraphCase(kind, raw), "graph") as prep:
            assert prep.batch is not None
            key = probe.graph("verify").graph_key(prep.batch)
            assert key is not None and key.bucket == pad_to_bucket(raw, capture_sizes(MAX_BS))
            assert key.kind == ("decode" if kind == "decode" else "verify")
            prep.execute()
            assert torch.isfinite(probe.kv.target_pool.k[:, :PAGE]).all(), (kind, raw)
            assert torch.isfinite(probe.kv.target_pool.v[:, :PAGE]).all(), (kind, raw)


@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_staged_attention(probe: RefGraphProbe, kind: str) -> None:
    """The attention a replay derives from its staged views: real rows see exactly what eager
    shows them (nothing past their width), every padded query sees at least one key and only
    the dummy slot. Checked after a stale tail, so the padding must have been rewritten."""
    for raw in range(1, MAX_BS + 1):
        with probe.prepared(GraphCase(kind, raw), "graph") as prep:
            batch = prep.batch
            assert isinstance(batch, GraphBatch)
            graph = probe.graph("verify")
            key = graph.graph_key(batch)
            assert key is not None
            probe.poison(prep.buffers, raw, "stale")
            prep.execute()
            views = prep.buffers
            meta = static_attention(views["rows"][:key.bucket], views["seq_lens"][:key.bucket],
                                    views["tree_mask"][:key.bucket], probe.kv.rows.table,
                                    key.max_kv)
            # What eager shows the batch, built now (the metadata is built on first use): the
            # world, row table included, is restored when the block ends.
            want = AttentionMetadata(batch.attention.kv_slots, batch.attention.mask)
        width = want.mask.shape[-1]
        assert torch.equal(meta.mask[:raw, ..., :width], want.mask)
        assert not meta.mask[:raw, ..., width:].any()
        seen = want.mask[:, 0].any(1)  # [raw, width] key columns some query sees
        assert torch.equal(meta.kv_slots[:raw, :width][seen], want.kv_slots[seen])
        padded = meta.mask[raw:, 0]  # [pad, q, max_kv]
        assert padded.any(-1).all()
        assert (meta.kv_slots[raw:][padded.any(1)] == DUMMY_SLOT).all()


def test_padding_only_batch_writes_dummy_page_only(make_probe: MakeProbe) -> None:
    """Capture runs every bucket on padding alone: only the dummy page may change."""
    probe = make_probe()
    with probe.requests(MAX_BS):  # the world's requests hold rows and KV meanwhile
        kv = probe.kv
        k, v, table = kv.target_pool.k.clone(), kv.target_pool.v.clone(), kv.rows.table.clone()
        allocator = kv.allocator.backup_state()
        probe.graph("verify").capture()
        assert torch.equal(kv.target_pool.k[:, PAGE:], k[:, PAGE:])
        assert torch.equal(kv.target_pool.v[:, PAGE:], v[:, PAGE:])
        assert torch.equal(kv.rows.table, table)
        assert kv.allocator.backup_state() == allocator
        assert not kv.rows.table[DUMMY_ROW].any() and DUMMY_SLOT < PAGE


def test_fallbacks(probe: RefGraphProbe) -> None:
    runner = probe.runner
    graph = GraphRunner(runner, max_bs=4, kv_sizes=[16, 32], verify_tokens=N)
    # More requests than the largest bucket.
    with probe.requests(6) as reqs:
        batch = decode_batch(probe, graph, reqs, 0)
        assert not graph.can_run(batch)
        eager = runner.forward(batch)
        assert torch.equal(graph.forward(batch).logits, eager.logits)
    with probe.requests(2) as two:
        # A ragged batch (prefill-like: different token counts).
        for r, n in zip(two, [1, 2], strict=True):
            runner.kv.extend(r, n)
        ragged = graph.prepare_extend(two, [1, 2], [5, 6, 7], [0, 2])
        assert ragged.attention.ragged is not None and not graph.can_run(ragged)
    with probe.requests(2) as two:
        # An untagged batch (built by the plain runner).
        for r in two:
            runner.kv.extend(r, 1)
        plain = runner.prepare_extend(two, [1, 1], [5, 6], [0, 1])
        assert not isinstance(plain, GraphBatch) and not graph.can_run(plain)
    with probe.requests(MAX_BS) as reqs:
        # The narrowest key width that holds the longest request; none past the widest.
        short = [r for r in reqs if r.kv_committed_len < 15][:2]
        assert graph.graph_key(decode_batch(probe, graph, short, 0)) == GraphKey("decode", 2, 16)
    with probe.requests(MAX_BS) as reqs:
        long = [r for r in reqs if r.kv_committed_len >= 32][:1]
        assert long and not graph.can_run(decode_batch(probe, graph, long, 0))
    with probe.requests(2) as two:
        # A verify batch on a runner without a verify kind.
        assert not GraphRunner(runner).can_run(verify_batch(probe, graph, two, 0, True))



def test_graphed_batches_never_build_eager_attention(probe: RefGraphProbe,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode or verify batch the graph replays derives its attention from the staged views:
    its eager metadata is never built (host work, a launch per op on a GPU). A batch that falls
    back builds it on first use, the same metadata the plain runner builds."""
    runner = probe.runner
    graph = GraphRunner(runner, max_bs=4, verify_tokens=N)
    built: list[int] = []
    eager_build = ModelRunner.attention_metadata

    def counting(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return eager_build(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "attention_metadata", counting)
    batches = [lambda reqs: decode_batch(probe, graph, reqs, 0),
               lambda reqs: verify_batch(probe, graph, reqs, 0, True),
               lambda reqs: verify_batch(probe, graph, reqs, 0, False)]
    for make_batch in batches:
        with probe.requests(3) as reqs:  # one batch per world: its allocations roll back
            batch = make_batch(reqs)
            assert graph.can_run(batch)
            graph.forward(batch)
    assert not built
    with probe.requests(6) as reqs:  # more than the largest bucket: eager
        batch = verify_batch(probe, graph, reqs, 0, False)
        assert not built and not graph.can_run(batch)
        assert torch.equal(graph.forward(batch).logits, runner.forward(batch).logits)
        assert len(built) == 1  # built once, on first use


def test_narrow_key_width_matches_eager(make_probe: MakeProbe) -> None:
    probe = make_probe(kv_sizes=[64, 128])
    rec = Recorder(probe)
    for kind in FORWARD_KINDS:
        for raw in (1, 5):
            with probe.prepared(GraphCase(kind, raw), "graph") as prep:
                assert prep.batch is not None
                key = probe.graph("verify").graph_key(prep.batch)
                assert key is not None and key.max_kv == 64
            eager, graph = rec.run(kind, raw, "eager"), rec.run(kind, raw, "graph")
            compare_outputs(graph, eager, probe.float_tolerance(), "narrow key width")
            compare_state(graph, eager.state, "the eager run's", "narrow key width")


def compiled_whole(runner: ModelRunner, backend: str = "inductor") -> Executor[Any, Any, Any]:
    """The engine's compiled executor: the whole forward, its writes through the write op."""
    return CompiledExecutor(TargetForward(runner), backend)


def compiled_layers(runner: ModelRunner, backend: str = "inductor") -> Executor[Any, Any, Any]:
    """The benchmark's per-layer regions, eager writes between them."""
    return LayersExecutor(runner.target, runner.kv.target_pool, runner.kv.rows.table, backend)


SPLITS = {"whole": compiled_whole, "layers": compiled_layers}


@pytest.mark.parametrize("split", list(SPLITS))
def test_compiled_forward_is_exact(make_probe: MakeProbe, probe: RefGraphProbe,
                                   split: str) -> None:
    """The compiled executor's forward traced by Dynamo and run as plain torch ("eager"
    backend) gives the replay's bits, its KV writes included: it restates the model exactly,
    and the write op (whole) or the eager writes between regions (layers) write what eager
    does. (Both probes build the same worlds bit for bit.)"""
    compiled = make_probe(lambda runner: SPLITS[split](runner, "eager"))
    for kind in ("decode", "verify-tree"):
        for raw in (1, 3):
            want = probe.run(GraphCase(kind, raw), "graph")
            got = compiled.run(GraphCase(kind, raw), "graph")
            compare_outputs(got, want, 0, f"compiled ({split}, eager backend) vs replay")
            compare_state(got, want.state, "the replay's", "compiled wrote elsewhere")


def test_a_new_thread_count_compiles_a_variant_instead_of_failing(
        make_probe: MakeProbe, probe: RefGraphProbe) -> None:
    """Torch's thread count is part of the global state a compiled key is guarded on, and a
    library loaded beside torch may change it between two calls; the key's later calls skip
    guards, under which Dynamo refuses to recompile. A call under a new count goes through
    every guard instead, and gives the same forward."""
    compiled = make_probe(lambda runner: compiled_whole(runner, "eager"))
    want = probe.run(GraphCase("decode", 1), "graph")
    threads = torch.get_num_threads()
    compiled.run(GraphCase("decode", 1), "graph")
    try:
        torch.set_num_threads(threads + 1)
        got = compiled.run(GraphCase("decode", 1), "graph")
    finally:
        torch.set_num_threads(threads)
    compare_outputs(got, want, 0, "compiled after a thread-count change vs replay")
    compare_state(got, want.state, "the replay's", "compiled after a thread-count change")


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["compiled", "compiled-layers", "frozen"])
def test_compiled_matches_eager(make_probe: MakeProbe, executor: str) -> None:
    """Inductor: within the probe's tolerance of eager, and the KV writes stay in the real
    slots and the dummy page (a cold compile is tens of seconds per key here, hence slow;
    "frozen" compiles every key again in each process)."""
    probe = make_probe(compiled_layers if executor == "compiled-layers" else executor,
                       kv_sizes=[64])
    rec = Recorder(probe)
    for kind in ("decode", "verify-tree"):
        for raw in (1, 3):
            eager, graph = rec.run(kind, raw, "eager"), rec.run(kind, raw, "graph")
            compare_outputs(graph, eager, 1e-5, executor)
            checks.check_state_untouched(probe, graph)
            compare_state(graph, eager.state, "the eager run's", executor)


def test_an_aot_key_is_built_for_the_rows_it_multiplies(
        model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What ``package_settings`` picks GEMM kernels by: a key's requests times its tokens per
    request (a verify key of bucket 8 and 4 tokens multiplies 32 rows), not its bucket."""
    from refengine.graph.aot import AotExecutor, AotPackages, PackageCache

    rows_by_key: dict[str, int] = {}

    def record(self: AotPackages, key: Any, label: str, module: Any, inputs: Any, rows: int,
               free: Any = ()) -> None:
        rows_by_key[label.rsplit("-kv", 1)[0]] = rows

    monkeypatch.setattr(AotPackages, "load", record)
    monkeypatch.setattr(AotPackages, "run", lambda self, key, inputs: [inputs[0], inputs[1]])
    cfg = model.config
    kv = KVManager(4096, PAGE, MAX_BS, cfg.max_position_embeddings,
                   (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
                   torch.float32, "cpu", row_headroom=N)
    runner = ModelRunner(model, None, kv)
    executor = AotExecutor(TargetForward(runner), PackageCache(tmp_path))
    graph = GraphRunner(runner, executor, verify_tokens=N)
    graph.capture(sizes=[1, 8], kv_sizes=graph.kv_sizes[:1])
    assert rows_by_key == {"decode-b1": 1, "decode-b8": 8, f"verify-n{N}-b1": N,
                           f"verify-n{N}-b8": 8 * N}

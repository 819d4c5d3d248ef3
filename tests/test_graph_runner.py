"""The graph runner against the eager runner, on the small random Llama.

Every raw batch size 1..MAX_BS (not only the buckets), decode and verify (chain and tree):
replay equals eager, poisoned padding changes nothing, padded rows write nothing a request owns
(KV pool, row table, allocator), no history dependence, stable static buffers, fresh outputs.
The compiled executor: its region split is exact (Dynamo with the eager backend), and inductor
matches eager on a few sizes (slow: a cold compile takes tens of seconds here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from refengine.config import SamplingParams
from refengine.graph import (
    DUMMY_ROW,
    DUMMY_SLOT,
    CompiledExecutor,
    GraphKey,
    GraphRunner,
    capture_sizes,
    kv_widths,
    pad_to_bucket,
    static_attention,
)
from refengine.graph.runner import GraphBatch
from refengine.memory.manager import KVManager
from refengine.model.llama import ForwardBatch, ForwardOutput, LlamaForCausalLM
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.spec.inputs import VerifyInput

MAX_BS = 10          # buckets 1, 2, 4, 8, 10: sizes 3, 5-7 and 9 are padded
N = 4                # verify tokens per request
PAGE = 4             # the dummy page is slots 0..3
TREE_PARENTS = [-1, 0, 0, 1]  # node i's parent: a tree with two branches
ATOL = 1e-5


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n]: node i sees itself and its ancestors."""
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


@dataclass
class Setup:
    runner: ModelRunner
    kv: KVManager
    reqs: list[Req]

    def graph(self, executor: str = "replay", **kw: object) -> GraphRunner:
        return GraphRunner(self.runner, executor, verify_tokens=N, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def setup(random_model_dir: Path, one_torch_thread: None) -> Setup:
    torch.set_num_threads(1)
    model = LlamaForCausalLM.load(random_model_dir, torch.float32, "cpu")
    cfg = model.config
    kv = KVManager(4096, PAGE, MAX_BS, cfg.max_position_embeddings,
                   (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
                   torch.float32, "cpu", row_headroom=N)
    runner = ModelRunner(model, None, kv)
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(MAX_BS):  # different context lengths (3 .. 52), prefilled eagerly
        ids = torch.randint(1, cfg.vocab_size, (3 + 7 * i % 50,), generator=gen).tolist()
        req = Req(f"r{i}", ids, SamplingParams(), 0, i)
        assert kv.assign_row(req)
        runner.forward(runner.prepare_extend([req], [len(ids)], ids, [len(ids) - 1]))
        kv.commit(req, len(ids))
        reqs.append(req)
    return Setup(runner, kv, reqs)


def pick(setup: Setup, raw: int, shift: int = 0) -> list[Req]:
    """``raw`` requests in a rotated order, so rows and lengths differ between sizes."""
    reqs = setup.reqs
    return [reqs[(shift + 3 * raw + i) % len(reqs)] for i in range(raw)]


def decode_batch(graph: GraphRunner, reqs: list[Req]) -> ForwardBatch:
    ids = [(7 * r.kv_committed_len + 11) % 2000 + 1 for r in reqs]
    return graph.prepare_extend(reqs, [1] * len(reqs), ids, list(range(len(reqs))))


def verify_batch(graph: GraphRunner, reqs: list[Req], causal: bool) -> ForwardBatch:
    b = len(reqs)
    tokens = torch.arange(b * N, dtype=torch.int64).view(b, N) * 37 % 2000 + 1
    start = torch.tensor([r.kv_committed_len for r in reqs])
    mask = tree_mask(list(range(-1, N - 1)) if causal else TREE_PARENTS)
    minus = torch.full((b, N), -1, dtype=torch.int64)
    vin = VerifyInput(tokens, mask.expand(b, N, N).clone(), start[:, None] + torch.arange(N),
                      minus, minus, minus, minus)
    slots = torch.stack([graph.kv.extend(r, N) for r in reqs])
    return graph.prepare_verify(reqs, vin, slots, causal)


BUILDERS: dict[str, Callable[[GraphRunner, list[Req]], ForwardBatch]] = {
    "decode": decode_batch,
    "verify-chain": lambda g, reqs: verify_batch(g, reqs, causal=True),
    "verify-tree": lambda g, reqs: verify_batch(g, reqs, causal=False),
}


@pytest.fixture
def rollback(setup: Setup) -> Iterator[Callable[[], None]]:
    """Release every slot past the committed ends (a test's batches allocate them)."""

    def undo() -> None:
        for r in setup.reqs:
            setup.kv.truncate(r, r.kv_committed_len)

    yield undo
    undo()


@dataclass
class Snapshot:
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    allocator: object

    @classmethod
    def of(cls, kv: KVManager) -> Snapshot:
        return cls(kv.kv.k.clone(), kv.kv.v.clone(), kv.rows.table.clone(),
                   kv.allocator.backup_state())

    def restore_pool(self, kv: KVManager) -> None:
        kv.kv.k.copy_(self.k)
        kv.kv.v.copy_(self.v)


def other_slots(batch: ForwardBatch) -> torch.Tensor:
    """A bool over every slot: True where neither the batch's real tokens nor the dummy page
    live (padded rows may write the dummy page; nothing else may change)."""
    slots = torch.ones(4096 + PAGE, dtype=torch.bool)
    slots[batch.out_slots] = False
    slots[:PAGE] = False
    return slots


def scribble(setup: Setup, seed: int) -> None:
    """Fresh noise in every slot no live request holds (and outside the dummy page): a write
    by a padded row into a free slot then shows, even if it repeats the bytes of an earlier
    identical write. Nothing reads these slots except through masked key columns, so the
    forward is unaffected (the noise is finite)."""
    held = torch.zeros(setup.kv.kv.k.shape[1], dtype=torch.bool)
    held[:PAGE] = True
    for r in setup.reqs:
        held[setup.kv.rows.table[r.row, :r.kv_allocated_len]] = True
    gen = torch.Generator().manual_seed(seed)
    for pool in (setup.kv.kv.k, setup.kv.kv.v):
        free = pool[:, ~held]
        pool[:, ~held] = torch.randn(free.shape, generator=gen)


def run_pair(setup: Setup, graph: GraphRunner, batch: ForwardBatch
             ) -> tuple[ForwardOutput, ForwardOutput, Snapshot, Snapshot, Snapshot]:
    """(eager output, graph output, state after eager, state before the graph forward
    (scribbled), state after it), both forwards from the same KV."""
    before = Snapshot.of(setup.kv)
    eager = setup.runner.forward(batch)
    after_eager = Snapshot.of(setup.kv)
    before.restore_pool(setup.kv)
    scribble(setup, len(batch.out_slots))
    scribbled = Snapshot.of(setup.kv)
    replayed = graph.forward(batch)
    return eager, replayed, after_eager, scribbled, Snapshot.of(setup.kv)


def assert_close(eager: ForwardOutput, graph: ForwardOutput) -> None:
    assert graph.logits.shape == eager.logits.shape
    assert graph.features.shape == eager.features.shape
    assert torch.equal(graph.logits.argmax(-1), eager.logits.argmax(-1))
    torch.testing.assert_close(graph.logits, eager.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(graph.features, eager.features, rtol=0, atol=ATOL)


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


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_replay_matches_eager_every_size(setup: Setup, kind: str,
                                         rollback: Callable[[], None]) -> None:
    """Replay == eager for every raw size; the graph forward's KV writes are eager's on the
    real slots, the dummy page aside nothing else changes, and neither the row table nor the
    allocator moves."""
    graph = setup.graph()
    for raw in range(1, MAX_BS + 1):
        batch = BUILDERS[kind](graph, pick(setup, raw))
        key = graph.graph_key(batch)
        assert key is not None and key.bucket == pad_to_bucket(raw, graph.sizes)
        assert key.kind == ("decode" if kind == "decode" else "verify")
        eager, replayed, after_eager, before, after_graph = run_pair(setup, graph, batch)
        assert_close(eager, replayed)
        real = batch.out_slots
        torch.testing.assert_close(after_graph.k[:, real], after_eager.k[:, real],
                                   rtol=0, atol=ATOL)
        torch.testing.assert_close(after_graph.v[:, real], after_eager.v[:, real],
                                   rtol=0, atol=ATOL)
        rest = other_slots(batch)
        assert torch.equal(after_graph.k[:, rest], before.k[:, rest])
        assert torch.equal(after_graph.v[:, rest], before.v[:, rest])
        assert torch.isfinite(after_graph.k[:, :PAGE]).all()  # real rows' masked keys read it
        assert torch.equal(after_graph.table, before.table)
        assert after_graph.allocator == before.allocator
        rollback()


POISON: dict[str, Callable[[Setup], dict[str, int | bool]]] = {
    # What a stale tail from an earlier, bigger batch holds: a live request's row, slots and
    # length, and an all-visible mask.
    "stale-real": lambda s: {"input_ids": 5, "positions": 40, "out_slots": int(
        s.kv.rows.table[s.reqs[0].row, 1]), "rows": s.reqs[0].row or 0,
        "seq_lens": s.reqs[0].kv_committed_len, "tree_mask": True},
    "huge": lambda s: {name: 2**62 for name in ("input_ids", "positions", "out_slots", "rows",
                                                 "seq_lens")} | {"tree_mask": True},
    "negative": lambda s: {name: -(2**40) for name in ("input_ids", "positions", "out_slots",
                                                       "rows", "seq_lens")}
    | {"tree_mask": False},
}
# No staged buffer is floating point (ids, positions, slots, rows and lengths are int64, the
# mask is bool), so NaN has nowhere to go: out-of-range and stale-but-valid values are the
# poisons that can hurt here.


def poison(graph: GraphRunner, kind: str, raw: int, values: dict[str, int | bool]) -> None:
    for name, buf in graph.staging[kind].buffers.items():
        buf[raw:] = values[name]


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_poisoned_padding_changes_nothing(setup: Setup, kind: str,
                                          rollback: Callable[[], None]) -> None:
    graph = setup.graph()
    for raw in range(1, MAX_BS + 1):
        batch = BUILDERS[kind](graph, pick(setup, raw, shift=1))
        key = graph.graph_key(batch)
        assert key is not None
        scribble(setup, raw)
        before = Snapshot.of(setup.kv)
        clean = graph.forward(batch)
        for name, values in POISON.items():
            before.restore_pool(setup.kv)
            poison(graph, key.kind, raw, values(setup))
            poisoned = graph.forward(batch)
            assert torch.equal(poisoned.logits, clean.logits), (raw, name)
            assert torch.equal(poisoned.features, clean.features), (raw, name)
            rest = other_slots(batch)
            assert torch.equal(setup.kv.kv.k[:, rest], before.k[:, rest]), (raw, name)
            assert torch.equal(setup.kv.kv.v[:, rest], before.v[:, rest]), (raw, name)
            assert torch.equal(setup.kv.rows.table, before.table)
        rollback()


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_staged_attention(setup: Setup, kind: str, rollback: Callable[[], None]) -> None:
    """The attention a replay derives from its staged views: real rows see exactly what eager
    shows them (nothing past their width), every padded query sees at least one key and only
    the dummy slot. Checked after a poisoned tail, so the padding must have been rewritten."""
    graph = setup.graph()
    for raw in range(1, MAX_BS + 1):
        batch = BUILDERS[kind](graph, pick(setup, raw))
        key = graph.graph_key(batch)
        assert key is not None
        poison(graph, key.kind, raw, POISON["stale-real"](setup))
        graph.forward(batch)
        views = graph.staging[key.kind].buffers
        meta = static_attention(views["rows"][:key.bucket], views["seq_lens"][:key.bucket],
                                views["tree_mask"][:key.bucket], setup.kv.rows.table,
                                key.max_kv)
        want = batch.attention
        width = want.mask.shape[-1]
        assert torch.equal(meta.mask[:raw, ..., :width], want.mask)
        assert not meta.mask[:raw, ..., width:].any()
        seen = want.mask[:, 0].any(1)  # [raw, width] key columns some query sees
        assert torch.equal(meta.kv_slots[:raw, :width][seen], want.kv_slots[seen])
        padded = meta.mask[raw:, 0]  # [pad, q, max_kv]
        assert padded.any(-1).all()
        assert (meta.kv_slots[raw:][padded.any(1)] == DUMMY_SLOT).all()
        rollback()


def test_padding_only_batch_writes_dummy_page_only(setup: Setup) -> None:
    """Capture runs every bucket on padding alone: only the dummy page may change."""
    graph = setup.graph()
    before = Snapshot.of(setup.kv)
    graph.capture()
    assert torch.equal(setup.kv.kv.k[:, PAGE:], before.k[:, PAGE:])
    assert torch.equal(setup.kv.kv.v[:, PAGE:], before.v[:, PAGE:])
    assert torch.equal(setup.kv.rows.table, before.table)
    assert setup.kv.allocator.backup_state() == before.allocator
    assert not setup.kv.rows.table[DUMMY_ROW].any() and DUMMY_SLOT < PAGE


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_no_history_dependence(setup: Setup, kind: str, rollback: Callable[[], None]) -> None:
    """The same batch (3 requests, bucket 4) gives identical outputs fresh, after the biggest
    batch, after another bucket, and after a poisoned run."""
    graph = setup.graph()
    build = BUILDERS[kind]
    target = pick(setup, 3)

    def run_target() -> ForwardOutput:
        out = graph.forward(build(graph, target))
        rollback()
        return out

    def run_other(raw: int) -> None:
        graph.forward(build(graph, pick(setup, raw, shift=2)))
        rollback()

    def poisoned() -> None:
        key = graph.graph_key(build(graph, target))
        rollback()
        assert key is not None
        poison(graph, key.kind, 3, POISON["stale-real"](setup))

    reference = run_target()
    for prelude in (lambda: run_other(MAX_BS), lambda: run_other(2), lambda: run_other(7),
                    poisoned):
        prelude()
        again = run_target()
        assert torch.equal(again.logits, reference.logits)
        assert torch.equal(again.features, reference.features)


def test_static_buffers_stay_put_and_outputs_are_fresh(setup: Setup,
                                                       rollback: Callable[[], None]) -> None:
    graph = setup.graph()
    buffers = [buf for st in graph.staging.values() for buf in st.buffers.values()]
    buffers += [setup.kv.kv.k, setup.kv.kv.v, setup.kv.rows.table]
    addresses = [buf.data_ptr() for buf in buffers]
    storages = {buf.untyped_storage().data_ptr() for buf in buffers}
    kept: list[ForwardOutput] = []
    copies: list[torch.Tensor] = []
    for kind in BUILDERS:
        for raw in (1, 3, MAX_BS, 2):
            out = graph.forward(BUILDERS[kind](graph, pick(setup, raw)))
            rollback()
            for t in (out.logits, out.features):
                assert t.untyped_storage().data_ptr() not in storages
            kept.append(out)
            copies.append(out.logits.clone())
    assert [buf.data_ptr() for buf in buffers] == addresses
    # Later replays did not overwrite earlier outputs.
    assert all(torch.equal(out.logits, c) for out, c in zip(kept, copies, strict=True))
    assert len({out.logits.untyped_storage().data_ptr() for out in kept}) == len(kept)


def test_fallbacks(setup: Setup, rollback: Callable[[], None]) -> None:
    graph = setup.graph(max_bs=4, kv_sizes=[16, 32])
    reqs = pick(setup, 6)
    # More requests than the largest bucket.
    batch = decode_batch(graph, reqs)
    assert not graph.can_run(batch)
    eager = setup.runner.forward(batch)
    assert torch.equal(graph.forward(batch).logits, eager.logits)
    rollback()
    # A ragged batch (prefill-like: different token counts).
    two = pick(setup, 2)
    ragged = graph.prepare_extend(two, [1, 2], [5, 6, 7], [0, 2])
    assert ragged.attention.query_index is not None and not graph.can_run(ragged)
    rollback()
    # An untagged batch (built by the plain runner).
    plain = setup.runner.prepare_extend(two, [1, 1], [5, 6], [0, 1])
    assert not isinstance(plain, GraphBatch) and not graph.can_run(plain)
    rollback()
    # The narrowest key width that holds the longest request; none past the widest.
    short = [r for r in setup.reqs if r.kv_committed_len < 15][:2]
    key = graph.graph_key(decode_batch(graph, short))
    assert key == GraphKey("decode", 2, 16)
    rollback()
    long = [r for r in setup.reqs if r.kv_committed_len >= 32][:1]
    assert long and not graph.can_run(decode_batch(graph, long))
    rollback()
    # A verify batch on a runner without a verify kind.
    assert not GraphRunner(setup.runner).can_run(verify_batch(graph, pick(setup, 2), True))
    rollback()


def test_narrow_key_width_matches_eager(setup: Setup, rollback: Callable[[], None]) -> None:
    graph = setup.graph(kv_sizes=[64, 128])
    for kind in BUILDERS:
        for raw in (1, 5):
            batch = BUILDERS[kind](graph, pick(setup, raw))
            key = graph.graph_key(batch)
            assert key is not None and key.max_kv == 64
            eager, replayed, *_ = run_pair(setup, graph, batch)
            assert_close(eager, replayed)
            rollback()


@pytest.mark.parametrize("split", ["whole", "layers"])
def test_compiled_forward_is_exact(setup: Setup, split: str,
                                   rollback: Callable[[], None]) -> None:
    """The compiled executor's forward traced by Dynamo and run as plain torch ("eager"
    backend) gives the replay's bits, KV pool included: it restates the model exactly, and
    the write op (whole) or the eager writes between regions (layers) write what eager does."""
    replay = setup.graph()
    compiled = setup.graph(executor=CompiledExecutor(
        setup.runner.target, setup.kv.kv, setup.kv.rows.table, backend="eager",
        split=split))  # type: ignore[arg-type]
    for kind in ("decode", "verify-tree"):
        for raw in (1, 3):
            batch = BUILDERS[kind](replay, pick(setup, raw))
            before = Snapshot.of(setup.kv)
            want = replay.forward(batch)
            after_replay = Snapshot.of(setup.kv)
            before.restore_pool(setup.kv)
            got = compiled.forward(batch)
            assert torch.equal(got.logits, want.logits)
            assert torch.equal(got.features, want.features)
            assert torch.equal(setup.kv.kv.k, after_replay.k)
            assert torch.equal(setup.kv.kv.v, after_replay.v)
            rollback()


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["compiled", "compiled-layers"])
def test_compiled_matches_eager(setup: Setup, executor: str,
                                rollback: Callable[[], None]) -> None:
    """Inductor: within 1e-5 of eager, and the KV writes stay in the real slots and the
    dummy page (a cold compile is tens of seconds per key here, hence slow)."""
    graph = setup.graph(executor=executor, kv_sizes=[64])
    for kind in ("decode", "verify-tree"):
        for raw in (1, 3):
            batch = BUILDERS[kind](graph, pick(setup, raw))
            eager, compiled, after_eager, before, after_graph = run_pair(setup, graph, batch)
            assert_close(eager, compiled)
            real = batch.out_slots
            torch.testing.assert_close(after_graph.k[:, real], after_eager.k[:, real],
                                       rtol=0, atol=ATOL)
            rest = other_slots(batch)
            assert torch.equal(after_graph.k[:, rest], before.k[:, rest])
            assert torch.equal(after_graph.v[:, rest], before.v[:, rest])
            rollback()

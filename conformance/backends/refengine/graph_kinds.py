"""The graph probe's kinds: how each kind of forward builds and runs its case in either mode.

Kinds are a table (``KINDS``): a kind says how to build and run its case in either mode and
which of its staged buffers are index fields. A kind that is one target forward is a
``ForwardKind`` (a batch builder and the graph runner's staging kind); the draft loops add
kinds of their own the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Protocol, TypeVar

import torch

from conformance.backends.refengine.graph_world import ProbeWorld
from conformance.contract import Mode
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.graph.runner import GraphBatch, GraphRunner
from refengine.graph.staging import PAD_POLICY
from refengine.graph.step_graph import StepGraph
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.speculative.accept import VerifyOutcome, accept
from refengine.speculative.draft_search import Candidates, LoopOutput, top_k
from refengine.speculative.inputs import DraftExtendInput, DraftInput, SeedInput, VerifyInput

# The names the probe protocol gives the index fields of the padded rows, by the name of the
# staged buffer that holds them (``Staging.buffers``).
PADDED_FIELDS: dict[str, str] = {"rows": "request_rows", "out_slots": "out_slots",
                                 "input_ids": "token_ids", "positions": "positions",
                                 "seq_lens": "lengths"}


@dataclass
class Prepared:
    """A case ready to run in one mode: its allocations made, nothing executed yet."""

    execute: Callable[[], dict[str, torch.Tensor]]   # runs it -> the real rows' outputs
    targets: torch.Tensor                            # KV slots the real rows write
    bucket: int
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # static buffers (graph)
    padded_names: Mapping[str, str] = field(default_factory=dict)   # buffer -> protocol name
    batch: ForwardBatch | None = None   # a one-forward kind's batch (for white-box tests)
    key_width: int | None = None        # the key width a graph run replays on


class ProbeKind(Protocol):
    """One entry of ``KINDS``: adding a kind (a draft loop) is one class like ``ForwardKind``
    and one line in the table."""

    @property
    def writes_kv(self) -> bool:
        """Whether the kind's real rows write KV (their target slots are then left out of
        the "kv" digest)."""

    def available(self, probe: ProbeWorld) -> bool:
        """Whether the probe's engine has what the kind runs (a draft loop of its kind)."""

    def length_fill(self, probe: ProbeWorld) -> int:
        """The length a padded row's length field must hold."""

    def key_widths(self, probe: ProbeWorld) -> list[int]:
        """The key widths the kind's graph chooses from, ascending."""

    def past_committed(self, probe: ProbeWorld) -> int:
        """Key columns past a request's committed end that the kind's attention spans (the
        new token, the verify block, the draft's scratch): its key length is its committed
        length plus these."""

    def reach(self, probe: ProbeWorld) -> int:
        """The most positions past a request's committed end the case allocates."""

    def prepare(self, probe: ProbeWorld, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        """Build the case for ``reqs`` in ``mode``: the eager path unpadded, the graph path on
        the graph runner (raising if it would not replay)."""


Batcher = ModelRunner | GraphRunner  # both build batches (the graph runner only adds tags)
BatchBuilder = Callable[["ProbeWorld", Batcher, list[Req], int], ForwardBatch]


def decode_batch(probe: ProbeWorld, runner: Batcher, reqs: list[Req], seed: int
                 ) -> ForwardBatch:
    """One new token per request at its committed end."""
    vocab = probe.vocab_size
    ids = [(7 * r.kv_committed_len + 11 + 13 * seed) % (vocab - 1) + 1 for r in reqs]
    for r in reqs:
        probe.kv.extend(r, 1)  # what the scheduler allocates for a decode step
    return runner.prepare_extend(reqs, [1] * len(reqs), ids, list(range(len(reqs))))


Inputs = TypeVar("Inputs", VerifyInput, DraftInput, SeedInput, DraftExtendInput)


def on_device(inputs: Inputs, device: torch.device) -> Inputs:
    """``inputs`` with every tensor on ``device``, where the engine keeps a step's inputs
    (drawn on the CPU first, so a seed gives the same case on every device)."""
    return replace(inputs, **{f.name: value.to(device) for f in fields(inputs)
                              if isinstance(value := getattr(inputs, f.name), torch.Tensor)})


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n]: node i sees itself and its ancestors (``parents[i]``, -1 for the root)."""
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def verify_batch(probe: ProbeWorld, runner: Batcher, reqs: list[Req], seed: int,
                 causal: bool) -> ForwardBatch:
    """``N`` draft nodes per request after its committed end: a chain (causal) or a binary
    tree (node i's parent is (i - 1) // 2: two branches from the root already at N = 3)."""
    b, n, vocab = len(reqs), probe.verify_tokens, probe.vocab_size
    flat = torch.arange(b * n, dtype=torch.int64).view(b, n)
    tokens = (flat * 37 + 101 * seed) % (vocab - 1) + 1
    start = torch.tensor([r.kv_committed_len for r in reqs], dtype=torch.int64)
    parents = [i - 1 for i in range(n)] if causal else [(i - 1) // 2 if i else -1
                                                         for i in range(n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    minus = torch.full((b, n), -1, dtype=torch.int64)
    verify_input = on_device(VerifyInput(tokens, tree_mask(parents).expand(b, n, n).clone(),
                               start[:, None] + torch.tensor(depth), minus, minus, minus,
                               minus), probe.device)
    slots = torch.stack([probe.kv.extend(r, n) for r in reqs]) if reqs else \
        torch.empty((0, n), dtype=torch.int64, device=probe.device)
    return runner.prepare_verify(reqs, verify_input, slots, causal)


@dataclass(frozen=True)
class ForwardKind:
    """A kind that is one target forward, replayed on the graph runner's ``staging`` kind."""

    staging: str
    build: BatchBuilder
    writes_kv: bool = True

    def available(self, probe: ProbeWorld) -> bool:
        return True

    def length_fill(self, probe: ProbeWorld) -> int:
        q = probe.graph(self.staging).kinds[self.staging]
        fill = PAD_POLICY["seq_lens"].fill(q)
        assert isinstance(fill, int)
        return fill

    def key_widths(self, probe: ProbeWorld) -> list[int]:
        return probe.graph(self.staging).kv_sizes

    def past_committed(self, probe: ProbeWorld) -> int:
        return probe.graph(self.staging).kinds[self.staging]  # the new tokens

    def reach(self, probe: ProbeWorld) -> int:
        return self.past_committed(probe)

    def prepare(self, probe: ProbeWorld, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        if mode == "eager":
            batch = self.build(probe, probe.runner, reqs, seed)
            return Prepared(lambda: probe.collect(probe.runner.forward(batch), batch),
                            batch.out_slots, len(reqs), batch=batch)
        graph = probe.graph(self.staging)
        batch = self.build(probe, graph, reqs, seed)
        key = graph.graph_key(batch)
        if key is None or key.kind != self.staging:
            raise RuntimeError(f"graph probe: {len(reqs)} requests do not replay on the "
                               f"{self.staging!r} graph (key {key}); a graph run that fell "
                               "back to eager would prove nothing")
        assert isinstance(batch, GraphBatch)
        return Prepared(lambda: probe.collect(graph.forward(batch), batch), batch.out_slots,
                        key.bucket, graph.staging[key.kind].buffers, PADDED_FIELDS, batch,
                        key.max_kv)


@dataclass(frozen=True)
class DraftLoopKind:
    """A whole draft step of the engine's worker: eager = the worker's own forward-by-forward
    search (Frozen-KV MTP: the seed step, then the loop); graph = the ``DraftLoopGraph``
    (MTP's seed folded in). Inputs are seeded: the step's candidates and features for EAGLE,
    the bonus tokens and target features for MTP. EAGLE writes its head's KV into scratch
    slots (the targets); MTP writes none, anywhere."""

    loop_kind: str                      # "draft:eagle" or "draft:mtp"
    writes_kv: bool
    length_fill_value: int
    padded_names: Mapping[str, str]     # staged buffer -> protocol name

    def available(self, probe: ProbeWorld) -> bool:
        loop = probe.draft_loop()
        return loop is not None and loop.kind == self.loop_kind

    def length_fill(self, probe: ProbeWorld) -> int:
        return self.length_fill_value

    def key_widths(self, probe: ProbeWorld) -> list[int]:
        loop = probe.draft_loop()
        assert loop is not None
        return loop.kv_sizes

    def past_committed(self, probe: ProbeWorld) -> int:
        """EAGLE's scratch lies past the root (the committed end); MTP reads the prefix only."""
        loop = probe.draft_loop()
        assert loop is not None
        return loop.topk * (loop.steps - 1) if self.loop_kind == "draft:eagle" else 0

    def reach(self, probe: ProbeWorld) -> int:
        return draft_reach(probe)

    def inputs(self, probe: ProbeWorld, reqs: list[Req], seed: int
               ) -> DraftInput | SeedInput:
        loop = probe.draft_loop()
        assert loop is not None and probe.worker is not None
        return seeded_draft_state(probe, len(reqs), loop.topk, loop.staging.buffers["hidden"],
                                  seed, mtp=self.loop_kind == "draft:mtp")

    def prepare(self, probe: ProbeWorld, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        worker, loop = probe.worker, probe.draft_loop()
        assert worker is not None and loop is not None
        draft_input = self.inputs(probe, reqs, seed)
        targets = torch.empty((0,), dtype=torch.int64, device=probe.device)
        if self.writes_kv:  # the reserved slots the draft writes its scratch KV into
            slots = worker.reserved_slots(reqs, loop.topk * (loop.steps - 1))
            targets = slots.reshape(-1).clone()
        if mode == "eager":
            return Prepared(lambda: loop_outputs(worker.eager_search(reqs, draft_input)), targets,
                            len(reqs))
        key = replay_key(loop, len(reqs), max(worker.roots(reqs)))

        def execute() -> dict[str, torch.Tensor]:
            found = worker.graph_search(reqs, draft_input, loop)  # type: ignore[arg-type]
            assert found is not None
            return loop_outputs(found)

        return Prepared(execute, targets, key[0], loop.staging.buffers, self.padded_names,
                        key_width=key[1])


@dataclass(frozen=True)
class DraftExtendKind:
    """EAGLE's draft-extend: eager = the worker's head forward over each request's accepted
    tokens; graph = the extend graph (``DraftLoopGraph`` of kind "extend:eagle"). Inputs are
    seeded: 1..N accepted tokens per request ending at its committed end (the root), with
    random features. The head writes its KV at those positions' slots (the targets)."""

    writes_kv = True
    padded_names: Mapping[str, str]     # staged buffer -> protocol name

    def available(self, probe: ProbeWorld) -> bool:
        return probe.draft_extend() is not None

    def length_fill(self, probe: ProbeWorld) -> int:
        return 1

    def key_widths(self, probe: ProbeWorld) -> list[int]:
        graph = probe.draft_extend()
        assert graph is not None
        return graph.kv_sizes

    def past_committed(self, probe: ProbeWorld) -> int:
        return 0  # the accepted tokens end at the root, the committed end

    def reach(self, probe: ProbeWorld) -> int:
        return draft_reach(probe)

    def prepare(self, probe: ProbeWorld, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        worker, graph = probe.worker, probe.draft_extend()
        assert worker is not None and graph is not None
        n, hidden_size = graph.staging.buffers["hidden"].shape[1:]
        gen = torch.Generator().manual_seed(10_007 * seed + 29)
        ends = torch.tensor(worker.roots(reqs), dtype=torch.int64)
        lens = torch.minimum(torch.randint(1, n + 1, (len(reqs),), generator=gen), ends)
        total = int(lens.sum())
        ids = torch.randint(1, probe.vocab_size, (total,), generator=gen)
        hidden = torch.randn((total, hidden_size), generator=gen).to(
            graph.staging.buffers["hidden"].dtype)
        targets = torch.cat([probe.kv.rows.table[r.row, e - a:e] for r, e, a
                             in zip(reqs, ends.tolist(), lens.tolist(), strict=True)])
        accepted = on_device(DraftExtendInput(hidden, ids, lens), probe.device)
        if mode == "eager":
            return Prepared(lambda: extend_outputs(worker.eager_extend(reqs, accepted)), targets,
                            len(reqs))
        key = replay_key(graph, len(reqs), int(ends.max()))

        def execute() -> dict[str, torch.Tensor]:
            found = worker.graph_extend(reqs, accepted, graph)
            assert found is not None
            return extend_outputs(found)

        return Prepared(execute, targets, key[0], graph.staging.buffers, self.padded_names,
                        key_width=key[1])


def seeded_draft_state(probe: ProbeWorld, b: int, k: int, hidden_buffer: torch.Tensor,
                       seed: int, mtp: bool = False) -> DraftInput | SeedInput:
    """A seeded draft state for ``b`` requests (``k`` candidates each), its features shaped
    and typed like a loop's staged ``hidden`` buffer: an EAGLE ``DraftInput``, or (``mtp``)
    Frozen-KV MTP's ``SeedInput``."""
    vocab = probe.vocab_size
    gen = torch.Generator().manual_seed(10_007 * seed + 17)
    hidden = torch.randn((b, hidden_buffer.shape[1]), generator=gen).to(hidden_buffer.dtype)
    tokens = torch.randint(1, vocab, (b,), generator=gen)
    if mtp:
        return on_device(SeedInput(tokens, hidden), probe.device)
    scores = torch.rand((b, k), generator=gen).sort(dim=1, descending=True).values
    return on_device(DraftInput(scores, torch.randint(1, vocab, (b, k), generator=gen),
                                hidden, tokens), probe.device)


@dataclass(frozen=True)
class OneGraphStepKind:
    """A whole greedy chain step (EAGLE's or Frozen-KV MTP's): eager = the worker's phases one
    by one on the plain runner (its draft search, the verify forward, the accept rule, then
    the next draft state: EAGLE's draft-extend over the accepted run at the positions it holds
    once committed and its top-1, MTP's last accepted (token, feature)); graph = the step
    graph (``StepGraph``). Inputs are seeded draft states. The step writes the target's
    verify block (and EAGLE's scratch and extend KV) in the reserved slots from each root on
    (the targets)."""

    step_kind: str                      # "step:eagle-chain" or "step:mtp-chain"
    padded_names: Mapping[str, str]     # staged buffer -> protocol name
    writes_kv = True

    def available(self, probe: ProbeWorld) -> bool:
        """Only where the worker runs it: a sequential (V1) worker; V2 extends in its launch."""
        graph = probe.spec_step()
        return (graph is not None and graph.kind == self.step_kind
                and probe.worker is not None and not probe.worker.mode.overlap)

    def graph(self, probe: ProbeWorld) -> StepGraph:
        graph = probe.spec_step()
        assert graph is not None
        return graph

    def length_fill(self, probe: ProbeWorld) -> int:
        return int(self.graph(probe).staging.fields["roots"].fill)

    def key_widths(self, probe: ProbeWorld) -> list[int]:
        return self.graph(probe).kv_sizes

    def past_committed(self, probe: ProbeWorld) -> int:
        return self.graph(probe).reach()

    def reach(self, probe: ProbeWorld) -> int:
        return draft_reach(probe)

    def prepare(self, probe: ProbeWorld, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        worker, graph = probe.worker, self.graph(probe)
        assert worker is not None
        state = seeded_draft_state(probe, len(reqs), 1, graph.staging.buffers["hidden"], seed,
                                   mtp=self.step_kind == "step:mtp-chain")
        targets = worker.reserved_slots(reqs, graph.reach()).reshape(-1).clone()
        if mode == "eager":
            return Prepared(lambda: eager_step(probe, reqs, state), targets, len(reqs))
        key = replay_key(graph, len(reqs), max(worker.roots(reqs)))

        def execute() -> dict[str, torch.Tensor]:
            found = worker.run_step_graph(reqs, state, graph)
            assert found is not None
            walk, tokens = found[:2]
            return step_outputs(tokens, walk[:, :tokens.shape[1]], graph.next_state(found))

        return Prepared(execute, targets, key[0], graph.staging.buffers, self.padded_names,
                        key_width=key[1])


def eager_step(probe: ProbeWorld, reqs: list[Req], state: DraftInput | SeedInput
               ) -> dict[str, torch.Tensor]:
    """The step of ``OneGraphStepKind`` with its phases one by one on the probe's plain
    runner: what the worker runs when it has no step graph, the commit left out (EAGLE's
    extend sits where the committed run puts it)."""
    worker, runner = probe.worker, probe.runner
    assert worker is not None
    n, steps = worker.spec.num_draft_tokens, worker.spec.num_steps
    root_tokens = state.verified_id if isinstance(state, DraftInput) else state.bonus_tokens
    verify_input = worker.to_verify_input(reqs, root_tokens, worker.eager_search(reqs, state))
    out = runner.forward(runner.prepare_verify(reqs, verify_input,
                                               worker.reserved_slots(reqs, n), causal=True))
    nodes, emitted = accept(reqs, verify_input, out.logits.view(len(reqs), n, -1), steps,
                            worker.sample_path)
    outcome = VerifyOutcome(nodes, emitted, out.features.view(len(reqs), n, -1), verify_input)
    accepted = worker.extend_input(outcome, list(range(len(reqs))))
    last = torch.cumsum(accepted.accept_lens, 0) - 1  # each request's newest emitted token
    following: DraftInput | SeedInput
    if isinstance(state, DraftInput):
        ends = [root + len(path) for root, path in zip(worker.roots(reqs), nodes, strict=True)]
        logits, predicted = runner.forward_draft(
            runner.prepare_draft_extend(reqs, accepted, ends), accepted.hidden_states)
        following = DraftInput(*top_k(logits, 1), predicted, accepted.input_ids[last])
    else:
        following = SeedInput(accepted.input_ids[last], accepted.hidden_states[last])
    paths = torch.tensor([path + [-1] * (steps + 1 - len(path)) for path in nodes],
                         dtype=torch.int64, device=probe.device)
    return step_outputs(verify_input.draft_tokens, paths, following)


def step_outputs(tokens: torch.Tensor, paths: torch.Tensor, following: DraftInput | SeedInput
                 ) -> dict[str, torch.Tensor]:
    """A step's result: the verify tokens (root first), the accepted nodes (root first, -1
    padded) and the next step's draft state (its root token is the bonus), every field."""
    return {"draft_tokens": tokens, "accepted_nodes": paths,
            **{f"next_{name}": value for name, value in following.columns().items()}}


def replay_key(graph: DraftLoopGraph, raw: int, longest: int) -> tuple[int, int]:
    """The key ``graph`` replays ``raw`` requests on (``longest``: their longest committed
    length); RuntimeError where it would not take them: a graph run that fell back to eager
    would prove nothing."""
    key = graph.key(raw, longest)
    if key is None:
        raise RuntimeError(f"graph probe: {raw} requests do not replay on the {graph.kind!r} "
                           "graph; a graph run that fell back to eager would prove nothing")
    return key


def draft_reach(probe: ProbeWorld) -> int:
    """A draft kind's allocation past the committed end: the worker's decode reservation
    (rounded up to a whole page where it is page-aligned)."""
    assert probe.worker is not None
    reservation = probe.worker.reservation
    return reservation.reach + (probe.kv.page_size - 1 if reservation.page_aligned else 0)


def extend_outputs(found: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A draft-extend's result: the head's logits, greedy tokens and predicted features at
    each request's newest accepted token."""
    logits, predicted = found
    return {"logits": logits, "next_tokens": logits.argmax(-1), "features": predicted}


def loop_outputs(found: LoopOutput) -> dict[str, torch.Tensor]:
    """A draft step's result: a chain's tokens, or a beam's candidates."""
    if isinstance(found, Candidates):
        return {"scores": found.scores, "tokens": found.tokens, "parents": found.parents}
    return {"draft_tokens": found}


KINDS: dict[str, ProbeKind] = {
    "decode": ForwardKind("decode", decode_batch),
    "verify-chain": ForwardKind(
        "verify", lambda p, r, reqs, s: verify_batch(p, r, reqs, s, causal=True)),
    "verify-tree": ForwardKind(
        "verify", lambda p, r, reqs, s: verify_batch(p, r, reqs, s, causal=False)),
    "draft:eagle": DraftLoopKind("draft:eagle", True, 0, {
        "rows": "request_rows", "scratch": "out_slots", "topk_index": "token_ids",
        "roots": "lengths"}),
    "draft:mtp": DraftLoopKind("draft:mtp", False, 1, {
        "rows": "request_rows", "bonus_tokens": "token_ids", "seq_lens": "lengths"}),
    "extend:eagle": DraftExtendKind({
        "rows": "request_rows", "slots": "out_slots", "ids": "token_ids", "ends": "lengths"}),
    "step:eagle-chain": OneGraphStepKind("step:eagle-chain", {
        "rows": "request_rows", "slots": "out_slots", "verified_id": "token_ids",
        "roots": "lengths"}),
    "step:mtp-chain": OneGraphStepKind("step:mtp-chain", {
        "rows": "request_rows", "slots": "out_slots", "bonus_tokens": "token_ids",
        "roots": "lengths"}),
}



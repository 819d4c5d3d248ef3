"""One graph per speculative step: a greedy chain step of EAGLE (``step:eagle-chain``) or of
Frozen-KV MTP (``step:mtp-chain``) as a single static forward, so a step is one replay, one
device read, then the commit.

The forward composes the pieces the separate graphs run, in the order the worker runs them:
the draft loop (``loops.eagle_loop`` or ``loops.mtp_loop``), the target's verify forward over
the root and the ``S`` drafts (``forward.whole_forward``, the chain's causal mask) with the
greedy walk (``forward.verify_walk``: the accepted nodes, their count, the bonus), then what
the next step starts from, built here from the walk instead of on the host:

* EAGLE: the head's draft-extend over the accepted run (``eagle_extend``'s forward). Column
  ``j`` pairs node ``j``'s feature with the token emitted after it (the next draft, or the
  bonus at ``j = a``), at position ``root + j`` and the verify block's slot ``j``; columns
  past ``a`` write the dummy slot and are never read back; the kept query is column ``a``.
  The extend runs for every request of the step, before resolve (the separate path runs it
  after resolve, for the requests still running): a request that finishes in this step has
  its head KV written into its own reserved slots, which resolve then frees.
* MTP: the seed, the bonus with the target's feature at the last accepted node (no forward).

Sampled requests, trees and overlap steps take the separate graphs (the sampled accept draws
from per-request CPU generators).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from refengine.graph.compile import InPlaceKV
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.graph.export import open_limits, register_tables
from refengine.graph.forward import verify_walk, whole_forward
from refengine.graph.loops import LoopKey, LoopViews, eagle_loop, mtp_loop
from refengine.graph.program import Executor, PackageSpec
from refengine.graph.staging import DUMMY_SLOT
from refengine.memory.kv_pool import KVPool
from refengine.model.attention import AttentionMetadata
from refengine.model.eagle3 import EagleHead
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import KVCache, LlamaForCausalLM
from refengine.speculative.draft_search import top_k
from refengine.speculative.inputs import DraftInput, SeedInput

EAGLE_CHAIN, MTP_CHAIN = "step:eagle-chain", "step:mtp-chain"
# A step's outputs: the walk ``[b, S + 3]`` (accepted nodes, their count, the bonus), the
# verify tokens ``[b, N]`` (root first), then the next draft state's other fields: EAGLE's
# ``topk_p [b, 1]``, ``topk_index [b, 1]`` and the head's predicted feature ``[b, H]``;
# MTP's target feature at the last accepted node ``[b, H]``.
StepOutput = tuple[torch.Tensor, ...]


def verify_chain(target: LlamaForCausalLM, target_kv: KVCache, table: torch.Tensor,
                 steps: int, max_kv: int, root_tokens: torch.Tensor, chain: torch.Tensor,
                 rows: torch.Tensor, roots: torch.Tensor, slots: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's verify of each request's root and ``chain [b, S]`` at positions ``root +
    j`` into the verify block ``slots [b, N]``, and the greedy walk -> (walk, the verify
    tokens ``[b, N]``, the drafter's features at every node ``[b, N, H]``)."""
    b, n = slots.shape
    tokens = torch.cat([root_tokens[:, None], chain], dim=1)
    columns = torch.arange(n, device=slots.device)
    causal = torch.ones((n, n), dtype=torch.bool, device=slots.device).tril().expand(b, n, n)
    logits, features = whole_forward(
        target, target_kv.k, target_kv.v, tokens.reshape(-1),
        (roots[:, None] + columns).reshape(-1), slots.reshape(-1), rows, roots + n, causal,
        table, max_kv, None)
    return verify_walk(logits, tokens.reshape(-1), causal, steps), tokens, features.view(b, n, -1)


def eagle_chain_step(target: LlamaForCausalLM, draft: EagleHead, target_kv: KVCache,
                     draft_kv: KVCache | None, table: torch.Tensor, steps: int, max_kv: int,
                     topk_p: torch.Tensor, topk_index: torch.Tensor, hidden: torch.Tensor,
                     verified_id: torch.Tensor, rows: torch.Tensor, roots: torch.Tensor,
                     slots: torch.Tensor) -> StepOutput:
    """A greedy EAGLE chain step from each request's ``DraftInput`` rows, its row and root
    position, and its reserved slots from the root on (``slots [b, N]``, N = S + 1: the
    draft's scratch is the first S - 1, the verify block all N)."""
    assert draft_kv is not None, "an EAGLE head keeps draft KV"
    b, n = slots.shape
    device = slots.device
    chain = eagle_loop(draft, draft_kv, table, 1, steps, max_kv, topk_p, topk_index, hidden,
                       rows, roots, slots[:, :steps - 1])
    assert isinstance(chain, torch.Tensor)
    walk, tokens, features = verify_chain(target, target_kv, table, steps, max_kv, verified_id,
                                          chain, rows, roots, slots)
    accepted, bonus = walk[:, steps + 1], walk[:, steps + 2]
    columns = torch.arange(n, device=device)
    real = columns <= accepted[:, None]
    following = torch.cat([tokens[:, 1:], tokens.new_zeros((b, 1))], dim=1)
    ids = torch.where(columns == accepted[:, None], bonus[:, None],
                      torch.where(real, following, 0))
    attention = AttentionMetadata.over_blocks(table, rows, roots + accepted, max_kv)
    logits_next, predicted = draft.compute(
        ids.reshape(-1), torch.where(real[..., None], features, 0).reshape(b * n, -1),
        (roots[:, None] + columns).reshape(-1), attention,
        torch.where(real, slots, DUMMY_SLOT).reshape(-1), InPlaceKV(draft_kv.k, draft_kv.v),
        keep=torch.arange(b, device=device) * n + accepted)
    next_p, next_index = top_k(logits_next, 1)
    return walk, tokens, next_p, next_index, predicted


def mtp_chain_step(target: LlamaForCausalLM, draft: FrozenKVMTPDraftModel, target_kv: KVCache,
                   draft_kv: KVCache | None, table: torch.Tensor, steps: int, max_kv: int,
                   bonus_tokens: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor,
                   roots: torch.Tensor, slots: torch.Tensor) -> StepOutput:
    """A greedy Frozen-KV MTP chain step from each request's ``SeedInput`` rows, its row and
    root position (its committed length: the assistant reads the target's KV before it), and
    its verify block ``slots [b, N]``."""
    chain = mtp_loop(draft, target_kv, table, 1, steps, max_kv, bonus_tokens, hidden, rows,
                     roots)
    assert isinstance(chain, torch.Tensor)
    walk, tokens, features = verify_chain(target, target_kv, table, steps, max_kv, bonus_tokens,
                                          chain, rows, roots, slots)
    last = features[torch.arange(slots.shape[0], device=slots.device), walk[:, steps + 1]]
    return walk, tokens, last


STEPS = {EAGLE_CHAIN: eagle_chain_step, MTP_CHAIN: mtp_chain_step}


class StepProgram:
    """A chain step (a ``Program``) over the target, the draft, the target's KV pool, the
    draft's (EAGLE) and the row table, for staged buffers in ``fields`` order; keyed like a
    draft loop by (bucket, key width)."""

    def __init__(self, kind: str, target: LlamaForCausalLM,
                 draft: EagleHead | FrozenKVMTPDraftModel, target_pool: KVPool,
                 draft_pool: KVPool | None, table: torch.Tensor, steps: int,
                 fields: Sequence[str]) -> None:
        self.kind, self.step = kind, STEPS[kind]
        self.target, self.draft = target, draft
        self.target_pool, self.draft_pool, self.table = target_pool, draft_pool, table
        self.steps, self.fields = steps, list(fields)

    def run(self, key: LoopKey, views: LoopViews) -> StepOutput:
        return self.step(self.target, self.draft, self.target_pool, self.draft_pool,
                         self.table, self.steps, key[1], **views)

    def module(self, key: LoopKey) -> torch.nn.Module:
        return StepForward(self, key[1])

    def weights(self) -> torch.nn.Module:
        return StepForward(self, 0)

    def pools(self) -> list[torch.Tensor]:
        pools = [self.target_pool.k, self.target_pool.v]
        return pools if self.draft_pool is None else [*pools, self.draft_pool.k,
                                                      self.draft_pool.v]

    def inputs(self, views: LoopViews) -> list[torch.Tensor]:
        return [*self.pools(), self.table, *(views[f] for f in self.fields)]

    def outputs(self, tensors: Sequence[torch.Tensor]) -> StepOutput:
        return tuple(tensors)

    def package(self, key: LoopKey, views: LoopViews) -> PackageSpec:
        """``step-eagle-chain-s3-b8-kv256``: the steps are baked into its code; its verify
        (and EAGLE's extend) multiply bucket times N rows."""
        pool, table = open_limits()
        return PackageSpec(f"{self.kind.replace(':', '-')}-s{self.steps}-b{key[0]}-kv{key[1]}",
                           key[0] * (self.steps + 1), [*(pool for _ in self.pools()), table])


class StepForward(torch.nn.Module):
    """The step at one key width as a module to compile or export: the target's and the
    draft's weights (with the target's feature tap, what the draft borrows of the target and
    the rotary tables) are its own; the pools, the row table and the staged buffers are its
    inputs."""

    def __init__(self, program: StepProgram, max_kv: int) -> None:
        super().__init__()
        self.target, self.draft = program.target, program.draft
        if isinstance(program.target.feature_tap, torch.nn.Module):
            self.add_module("feature_tap", program.target.feature_tap)
        register_tables(self, program.target.rotary)
        self.step, self.fields = program.step, program.fields
        self.steps, self.max_kv = program.steps, max_kv
        self.draft_pool = program.draft_pool is not None

    def forward(self, *inputs: torch.Tensor) -> StepOutput:
        """``inputs``: the target pool's K and V, the draft pool's (EAGLE), the row table, the
        staged buffers."""
        pools = 4 if self.draft_pool else 2
        draft_kv = InPlaceKV(inputs[2], inputs[3]) if self.draft_pool else None
        return self.step(self.target, self.draft, InPlaceKV(inputs[0], inputs[1]), draft_kv,
                         inputs[pools], self.steps, self.max_kv,
                         **dict(zip(self.fields, inputs[pools + 1:], strict=True)))


class StepGraph(DraftLoopGraph):
    """``run(inputs, longest)``: stage -> execute -> slice a whole greedy chain step for
    batches of up to the largest bucket whose longest request fits the widest key width with
    its verify block; None otherwise (the worker then runs the separate phases). Executed on
    a sibling of the target's executor, like the draft loops."""

    def __init__(self, target: LlamaForCausalLM, draft: EagleHead | FrozenKVMTPDraftModel,
                 target_pool: KVPool, draft_pool: KVPool | None, table: torch.Tensor,
                 steps: int, sizes: Sequence[int], kv_sizes: Sequence[int],
                 executor: Executor[Any, Any, Any]) -> None:
        kind = EAGLE_CHAIN if isinstance(draft, EagleHead) else MTP_CHAIN
        self.bind(kind, draft, table, 1, steps, sizes, kv_sizes, {"k": 1, "N": steps + 1},
                  lambda fields: StepProgram(kind, target, draft, target_pool, draft_pool,
                                             table, steps, fields), executor)

    def reach(self) -> int:
        """Key columns past a request's root that the step's attention spans: the verify
        block's N (EAGLE's scratch lies inside it)."""
        return self.steps + 1

    def inputs(self, state: DraftInput | SeedInput, rows: torch.Tensor, roots: torch.Tensor,
               slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The staged inputs of a step from the draft state's rows (its features as
        ``hidden``), each request's row, root position and reserved slots from the root on."""
        fields = {("hidden" if name == "hidden_states" else name): t
                  for name, t in state.columns().items()}
        return {**fields, "rows": rows, "roots": roots, "slots": slots}

    def next_state(self, found: StepOutput) -> DraftInput | SeedInput:
        """The next step's draft state of every request of the step: the walk's bonus is its
        root token."""
        walk, _, *rest = found
        if self.kind == EAGLE_CHAIN:
            next_p, next_index, predicted = rest
            return DraftInput(next_p, next_index, predicted, walk[:, -1])
        (last,) = rest
        return SeedInput(walk[:, -1], last)

"""EAGLE V1 (sequential): draft -> verify -> draft-extend, one decode step at a time.

Positions: a decoding request with ``s = kv_committed_len`` has its root (the newest emitted
token, ``verified_id``) at position ``s``; its KV is written by this step's verify.

* draft: ``S - 1`` forwards of the draft head over a beam of ``k`` nodes per request. Step-i
  nodes sit at position ``s + i - 1`` and write scratch KV at row positions
  ``s + (i-1)k .. s + ik - 1``; each attends to the committed prefix and to its own ancestors'
  scratch entries. The scratch pages come from the allocator's scratch bracket, so drafting
  leaves the pool exactly as it found it. The best ``N - 1`` of all candidates by path score
  form the tree (``kernels.tree_reference``). A chain (``k = 1``) is the tree itself, with
  causal attention: ``draft_chain`` skips the beam and score work.
* verify: ``N`` slots per request at positions ``s .. s+N-1`` (root + drafts, positions
  ``s + depth``), one tree-masked target forward, then a greedy walk or tree speculative
  sampling per request.
* commit (after the engine's per-token finish checks): accepted nodes' KV moves to the
  contiguous positions ``s+1 ..``, ``committed += accepted + 1``, slots past it are freed
  (whole pages only).
* draft-extend: the head over the accepted positions (``f_p``, ``x_{p+1}``) writes its KV and
  yields the next ``DraftInput``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from refengine.config import SpecConfig
from refengine.kernels.tree_reference import (
    build_tree_reference,
    greedy_walk,
    select_candidates,
)
from refengine.memory.manager import KVManager
from refengine.model.attention import AttentionMetadata
from refengine.model.eagle import EagleDraftModel
from refengine.model.llama import ForwardBatch, LlamaForCausalLM
from refengine.request import Req
from refengine.sampler import sampling_probs
from refengine.spec.inputs import DraftExtendInput, DraftInput, VerifyInput
from refengine.spec.verify import SampledPath, verify_tree_sampling


@dataclass
class VerifyOutcome:
    """Per request: accepted nodes (root first) and the tokens they emit (drafts + bonus)."""

    nodes: list[list[int]]
    emitted: list[list[int]]
    features: torch.Tensor       # [b, N, H] target features at every tree node
    verify_input: VerifyInput


class ChainTree:
    """The verify tree of a chain (``topk == 1``) of ``n`` nodes: node i sits at depth i, sees
    nodes 0..i (causal), has parent i - 1 and first child i + 1. It never changes, so its
    tensors are built once per batch size and handed out as views (consumers read a
    VerifyInput, they never write it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.depth = torch.arange(n)
        self._by_batch: dict[int, dict[str, torch.Tensor]] = {}

    def _structure(self, b: int) -> dict[str, torch.Tensor]:
        """The VerifyInput fields that depend only on the batch size."""
        if b not in self._by_batch:
            n, node = self.n, self.depth
            self._by_batch[b] = {
                "tree_mask": (node[None, :] <= node[:, None]).expand(b, n, n),
                "parents": (node - 1).expand(b, n),
                "retrieve_index": torch.arange(b * n).view(b, n),
                "retrieve_next_token": torch.where(node < n - 1, node + 1, -1).expand(b, n),
                "retrieve_next_sibling": torch.full((b, n), -1)}
        return self._by_batch[b]

    def verify_input(self, tokens: torch.Tensor, start: torch.Tensor) -> VerifyInput:
        """``tokens [b, n]`` (root first); ``start [b]``: each root's position."""
        return VerifyInput(draft_tokens=tokens, positions=start[:, None] + self.depth,
                           **self._structure(tokens.shape[0]))


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, k, dim=-1)
    return top.values, top.indices


class EagleWorker:
    def __init__(self, spec: SpecConfig, target: LlamaForCausalLM, draft: EagleDraftModel,
                 kv: KVManager) -> None:
        self.spec = spec
        self.target = target
        self.draft_model = draft
        self.kv = kv
        self._chain = ChainTree(spec.num_steps + 1)

    @property
    def hidden_size(self) -> int:
        return self.target.config.hidden_size

    def idle_input(self) -> DraftInput:
        return DraftInput.idle(self.spec.topk, self.hidden_size,
                               self.target.lm_head.weight.dtype)

    # --- prefill: the draft over the prompt ---------------------------------------------------

    def draft_prefill(self, fb: ForwardBatch, features: torch.Tensor, next_ids: torch.Tensor,
                      last_rows: torch.Tensor, roots: torch.Tensor) -> DraftInput:
        """Run the head over a target prefill batch. ``next_ids[t]`` is the token after flat
        token t (the next prompt token, or the sampled one at a prompt's end); ``last_rows`` are
        the flat rows of requests whose prompt completed (their new draft state)."""
        draft_fb = ForwardBatch(next_ids, fb.positions, fb.out_slots, fb.attention, last_rows)
        logits, predicted = self.draft_model(draft_fb, features, self.kv.draft_kv)
        topk_p, topk_index = _topk(logits, self.spec.topk)
        return DraftInput(topk_p, topk_index, predicted, roots)

    # --- draft ----------------------------------------------------------------------------------

    def draft(self, reqs: list[Req], din: DraftInput) -> VerifyInput:
        # Draft KV goes to the scratch slots just past each allocation, which must be the
        # committed end (the root's position): commit and prefill leave nothing past it.
        stray = [r.rid for r in reqs if r.kv_allocated_len != r.kv_committed_len]
        if stray:
            raise RuntimeError(f"requests {stray} hold KV past their committed end at draft")
        return (self.draft_chain(reqs, din) if self.spec.topk == 1
                else self.draft_tree(reqs, din))

    def draft_chain(self, reqs: list[Req], din: DraftInput) -> VerifyInput:
        """``topk == 1``: the beam is a single path, so the tree is the chain itself
        (``N = S + 1``, every candidate kept) and each step's node sees the committed prefix and
        the earlier steps' scratch entries, which is plain causal attention. Same result as
        ``draft_tree`` with ``topk == 1`` (``tests/test_spec_engine.py`` checks it), without
        the beam, score and mask bookkeeping, which costs a decode step as much as a head forward.
        """
        b, steps = len(reqs), self.spec.num_steps
        seq = [r.kv_committed_len for r in reqs]
        start = torch.tensor(seq)
        rows = torch.tensor([r.row for r in reqs])
        tokens = [din.verified_id, din.topk_index[:, 0]]
        features = din.hidden_states
        with self.kv.scratch(reqs, steps - 1) as slots:
            for i in range(1, steps):  # step i's node sits at position s + i - 1
                meta = AttentionMetadata.build(self.kv.rows.table, rows, [1] * b,
                                               [s + i for s in seq])
                fb = ForwardBatch(tokens[-1], start + (i - 1), slots[:, i - 1], meta)
                logits, features = self.draft_model(fb, features, self.kv.draft_kv)
                # argmax of the logits: the top-1 of their softmax without computing it
                tokens.append(torch.argmax(logits, dim=-1))
        return self._chain.verify_input(torch.stack(tokens, dim=1), start)

    def draft_tree(self, reqs: list[Req], din: DraftInput) -> VerifyInput:
        """Beam search over ``S - 1`` head forwards, then the best ``N - 1`` candidates."""
        k, steps, n = self.spec.topk, self.spec.num_steps, self.spec.num_draft_tokens
        b = len(reqs)
        seq = torch.tensor([r.kv_committed_len for r in reqs])
        rows = torch.tensor([r.row for r in reqs])
        scores = [din.topk_p]                    # candidate path scores, flat per step
        cand_tokens = [din.topk_index]
        cand_parents = [torch.full((b, k), -1, dtype=torch.int64)]
        beam_tokens, beam_scores = din.topk_index, din.topk_p
        beam_feat = din.hidden_states[:, None, :].expand(b, k, -1)
        beam_flat = torch.arange(k).expand(b, k)
        scratch = k * (steps - 1)
        ancestors = torch.zeros((b, k, max(scratch, 1)), dtype=torch.bool)
        offset = k
        own_entry = torch.eye(k, dtype=torch.bool)   # beam node m sees its own scratch entry
        with self.kv.scratch(reqs, scratch) as scratch_slots:
            for i in range(1, steps):
                node_mask = ancestors.clone()
                node_mask[:, :, (i - 1) * k:i * k] |= own_entry
                width = i * k
                meta = AttentionMetadata.build(self.kv.rows.table, rows, [k] * b,
                                               (seq + width).tolist(),
                                               [node_mask[r, :, :width] for r in range(b)])
                positions = (seq[:, None] + (i - 1)).expand(b, k).reshape(-1)
                fb = ForwardBatch(beam_tokens.reshape(-1), positions,
                                  scratch_slots[:, (i - 1) * k:i * k].reshape(-1), meta)
                logits, predicted = self.draft_model(fb, beam_feat.reshape(b * k, -1),
                                                     self.kv.draft_kv)
                child_p, child_tok = _topk(logits, k)                      # [b*k, k]
                child_scores = beam_scores[:, :, None] * child_p.view(b, k, k)
                child_scores = child_scores.reshape(b, k * k)
                scores.append(child_scores)
                cand_tokens.append(child_tok.view(b, k * k))
                cand_parents.append(beam_flat[:, :, None].expand(b, k, k).reshape(b, k * k))
                pick = torch.sort(-child_scores, dim=-1, stable=True).indices[:, :k]
                parent_slot = pick // k
                beam_tokens = torch.gather(child_tok.view(b, k * k), 1, pick)
                beam_scores = torch.gather(child_scores, 1, pick)
                beam_feat = torch.gather(predicted.view(b, k, -1), 1, parent_slot[:, :, None]
                                         .expand(-1, -1, predicted.shape[-1]))
                beam_flat = offset + pick
                ancestors = torch.gather(node_mask, 1, parent_slot[:, :, None]
                                         .expand(-1, -1, node_mask.shape[-1]))
                offset += k * k
        all_scores = torch.cat(scores, dim=1)
        selected = select_candidates(all_scores, n)
        tree = build_tree_reference(din.verified_id, torch.cat(cand_tokens, dim=1),
                                    torch.cat(cand_parents, dim=1), selected)
        flat = torch.arange(b)[:, None] * n + torch.arange(n)[None, :]
        return VerifyInput(tree.tokens, tree.mask, seq[:, None] + tree.depth, tree.parents,
                           flat, tree.next_token, tree.next_sibling)

    # --- verify -----------------------------------------------------------------------------

    def verify(self, reqs: list[Req], vin: VerifyInput) -> VerifyOutcome:
        n = self.spec.num_draft_tokens
        b = len(reqs)
        rows = torch.tensor([r.row for r in reqs])
        seq = [r.kv_committed_len for r in reqs]
        slots = torch.stack([self.kv.extend(r, n) for r in reqs])
        # A chain's tree mask is causal, the metadata's default.
        meta = AttentionMetadata.build(self.kv.rows.table, rows, [n] * b, [s + n for s in seq],
                                       None if self.spec.topk == 1 else list(vin.tree_mask))
        fb = ForwardBatch(vin.draft_tokens.reshape(-1), vin.positions.reshape(-1),
                          slots.reshape(-1), meta)
        out = self.target(fb, self.kv.kv)
        logits = out.logits.view(b, n, -1)
        # Python lists once for the whole batch: per-element tensor reads cost an op each.
        draft_tokens = vin.draft_tokens.tolist()
        accept_index, accept_len, bonus = greedy_walk(
            draft_tokens, vin.retrieve_next_token.tolist(), vin.retrieve_next_sibling.tolist(),
            torch.argmax(logits, dim=-1).tolist(), self.spec.num_steps)
        nodes, emitted = [], []
        for i, req in enumerate(reqs):
            if req.params.greedy:
                path, last = accept_index[i][: accept_len[i] + 1], bonus[i]
            else:
                sampled = self.sample_path(req, vin, i, sampling_probs(logits[i], req.params))
                path, last = sampled.nodes, sampled.bonus
            nodes.append(path)
            emitted.append([draft_tokens[i][j] for j in path[1:]] + [last])
        return VerifyOutcome(nodes, emitted, out.features.view(b, n, -1), vin)

    def sample_path(self, req: Req, vin: VerifyInput, row: int, probs: torch.Tensor
                    ) -> SampledPath:
        """Tree speculative sampling for one sampled request (``probs``: [N, V] float64)."""
        return verify_tree_sampling(
            vin.draft_tokens[row].tolist(), vin.retrieve_next_token[row].tolist(),
            vin.retrieve_next_sibling[row].tolist(), probs, self.spec.num_steps, req.seed,
            len(req.output_ids))

    def commit(self, req: Req, nodes: list[int]) -> None:
        """Keep the accepted run's KV at positions s .. s+a and free the rest of the block."""
        s = req.kv_committed_len
        if nodes != list(range(len(nodes))):  # not a prefix of the block: move the path's KV
            src = self.kv.rows.table[req.row, [s + j for j in nodes]]
            dst = self.kv.rows.table[req.row, s: s + len(nodes)]
            self.kv.kv.k[:, dst] = self.kv.kv.k[:, src]
            self.kv.kv.v[:, dst] = self.kv.kv.v[:, src]
        req.kv_committed_len = s + len(nodes)
        self.kv.truncate(req, req.kv_committed_len)

    def extend_input(self, outcome: VerifyOutcome, keep: list[int]) -> DraftExtendInput:
        """Rows of the requests ``keep`` (unfinished after verify), in that order."""
        if not keep:
            return DraftExtendInput.idle(self.hidden_size, outcome.features.dtype)
        n = outcome.features.shape[1]
        flat = torch.tensor([i * n + j for i in keep for j in outcome.nodes[i]])
        return DraftExtendInput(outcome.features.flatten(0, 1)[flat],
                                torch.tensor([t for i in keep for t in outcome.emitted[i]]),
                                torch.tensor([len(outcome.nodes[i]) for i in keep]))

    # --- draft-extend -----------------------------------------------------------------------

    def draft_extend(self, reqs: list[Req], ext: DraftExtendInput) -> DraftInput:
        """The head over each request's accepted positions (already committed)."""
        lens = ext.accept_lens.tolist()
        ends = [r.kv_committed_len for r in reqs]
        rows = [r.row for r in reqs]
        positions = torch.tensor([p for e, n in zip(ends, lens, strict=True)
                                  for p in range(e - n, e)])
        slots = self.kv.rows.table[torch.tensor([r for r, n in zip(rows, lens, strict=True)
                                                 for _ in range(n)]), positions]
        last = torch.tensor([end - 1 for end in itertools.accumulate(lens)])
        meta = AttentionMetadata.build(self.kv.rows.table, torch.tensor(rows), lens, ends)
        fb = ForwardBatch(ext.input_ids, positions, slots, meta, last)
        logits, predicted = self.draft_model(fb, ext.hidden_states, self.kv.draft_kv)
        topk_p, topk_index = _topk(logits, self.spec.topk)
        return DraftInput(topk_p, topk_index, predicted, ext.input_ids[last])

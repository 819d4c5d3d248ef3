"""Mutants of rules keyed on a speculative shape rather than on what the tree is."""

from __future__ import annotations

from dataclasses import replace

import torch

from refengine import Engine
from refengine.request import Req
from refengine.speculative.core import SpeculativeWorker
from refengine.speculative.draft_search import LoopOutput
from refengine.speculative.inputs import VerifyInput


class _ChainMaskAtChainLength(SpeculativeWorker):
    def to_verify_input(self, reqs: list[Req], root_tokens: torch.Tensor, found: LoopOutput
                        ) -> VerifyInput:
        built = super().to_verify_input(reqs, root_tokens, found)
        s, n = self.spec.num_steps, self.spec.num_draft_tokens
        if n != s + 1:
            return built
        # BUG: N = S + 1 nodes is a chain's count, so the tree is masked as one: each node sees
        # every node before it, its siblings and their subtrees included.
        causal = torch.ones(n, n, dtype=torch.bool, device=built.tree_mask.device).tril()
        return replace(built, tree_mask=causal.expand_as(built.tree_mask))


class TreeMaskWrongWhenNIsSPlus1(Engine):
    """A tree of N = S + 1 nodes (as many as a chain of S drafts has) is verified with a
    chain's causal mask: where the tree branches, a node attends to its siblings' tokens and
    the target verifies it in a context it was not drafted for. Other shapes are right."""

    worker_class = _ChainMaskAtChainLength

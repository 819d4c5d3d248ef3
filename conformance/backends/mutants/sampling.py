"""Sampling mutants: a verifier whose rejection residual keeps the rejected drafts (the
distribution tier's negative control), verify paths that misapply top-p or temperature, one
that hands each request's verify rows its batch neighbour's parameters, one whose top-k-only
batches threshold every row at the batch's largest k, and an engine that drops the sampling
settings altogether (every request greedy)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from typing import ClassVar

import torch

from conformance.checks.distribution import DraftTree, draft_tree
from conformance.contract import SamplingParams
from refengine import Engine
from refengine.request import Req
from refengine.scheduler import Scheduler
from refengine.speculative.accept import VerifyOutcome
from refengine.speculative.core import SpeculativeWorker
from refengine.speculative.inputs import VerifyInput
from refengine.speculative.verify import SampledPath, verify_tree_sampling


def _residual_is_p(p: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    """BUG: the rejected children stay in. A rejected draft token can come back as the bonus,
    so each child ``c`` is emitted with ``p(c) + (1 - sum p(children)) p(c)`` instead of
    ``p(c)``: draft tokens are over-weighted."""
    return p


class _ResidualIsP(SpeculativeWorker):
    """Samples with the biased residual (under every drafter: the verify path is shared), and
    records each draft tree per root sequence in ``trees`` so the distribution tier can derive
    this mutant's exact output distribution (its negative-control power)."""

    @cached_property
    def trees(self) -> dict[tuple[int, ...], Counter[DraftTree]]:
        """The draft trees verified so far, per root sequence (this instance's own)."""
        return {}

    def sample_path(self, req: Req, verify_input: VerifyInput, row: int, probs: torch.Tensor
                    ) -> SampledPath:
        tokens = verify_input.draft_tokens[row].tolist()
        next_token = verify_input.retrieve_next_token[row].tolist()
        next_sibling = verify_input.retrieve_next_sibling[row].tolist()
        root = (*req.prompt_ids, *req.output_ids)
        self.trees.setdefault(root, Counter())[draft_tree(tokens, next_token, next_sibling)] += 1
        return verify_tree_sampling(tokens, next_token, next_sibling, probs, self.spec.num_steps,
                                    req.seed, self.output_index(req), residual=_residual_is_p)


def verified_draft_trees(handle: object) -> dict[tuple[int, ...], Counter[DraftTree]]:
    """The draft trees a ``biased_verify_sampler`` handle verified, per root sequence: what the
    distribution tier needs to derive this negative control's exact output law. Asked of the
    mutant that recorded them, so the suite never reaches into a handle itself."""
    worker = getattr(getattr(handle, "engine", None), "worker", None)
    if not isinstance(worker, _ResidualIsP):
        raise TypeError("verified_draft_trees: not a biased_verify_sampler handle")
    return worker.trees


class BiasedVerifySampler(Engine):
    """Speculative sampling draws the bonus after a rejection from the target distribution
    itself instead of the residual without the rejected drafts: draft tokens are over-weighted.

    Greedy output is untouched, every emitted token is in the support and each run is
    reproducible; only the distribution of sampled tokens is wrong. Plain decoding (no
    speculation) is exactly the reference engine's."""

    worker_class = _ResidualIsP


# --- sampling parameters on the verify path ----------------------------------------------------

def drop_top_p(params: SamplingParams) -> SamplingParams:
    """BUG: top-p never reaches the verify path (temperature and top-k do)."""
    return replace(params, top_p=1.0)


def drop_temperature(params: SamplingParams) -> SamplingParams:
    """BUG: the verify path scores at temperature 1 (the temperature reaches only the plain
    sampler); greedy requests stay greedy."""
    return params if params.greedy else replace(params, temperature=1.0)


def from_previous_row(batch: list[SamplingParams]) -> list[SamplingParams]:
    """BUG: per-request temperature, top-k and top-p expanded to the verify rows one request
    off: each sampled request gets those of the request before it in the batch (the first,
    the last's). Whether a request is greedy, and its seed, stay its own; a greedy
    neighbour's temperature reads as 1 (vLLM's expansion replaces the greedy marker so)."""
    shifted = batch[-1:] + batch[:-1]
    return [own if own.greedy else replace(own, temperature=prev.temperature or 1.0,
                                           top_k=prev.top_k, top_p=prev.top_p)
            for own, prev in zip(batch, shifted, strict=True)]


def top_k_alone_at_batch_max(batch: list[SamplingParams]) -> list[SamplingParams]:
    """BUG: a batch where no request sets top-p takes a top-k-only path that thresholds every
    sampled row at the batch's largest top-k (one ``k.max()`` for all rows) instead of each
    request's own. A batch holding a top-p request takes the general path and is right."""
    sampled = [p for p in batch if not p.greedy]
    if any(p.top_p < 1.0 for p in sampled) or not any(p.top_k > 0 for p in sampled):
        return batch
    widest = max(p.top_k for p in sampled)
    return [p if p.greedy or p.top_k <= 0 else replace(p, top_k=widest) for p in batch]


class _VerifyParamsAltered(SpeculativeWorker):
    """Verify sees the batch's params through ``verify_params`` (the batch's list in, one per
    request out): each target distribution is built from them, while the plain (prefill)
    sampler uses the real ones."""

    verify_params: ClassVar[Callable[[list[SamplingParams]], list[SamplingParams]]]

    def verify(self, reqs: list[Req], verify_input: VerifyInput) -> VerifyOutcome:
        own = [req.params for req in reqs]
        for req, params in zip(reqs, type(self).verify_params(own), strict=True):
            req.params = params
        try:
            return super().verify(reqs, verify_input)
        finally:
            for req, params in zip(reqs, own, strict=True):
                req.params = params


def each(alter: Callable[[SamplingParams], SamplingParams]
         ) -> Callable[[list[SamplingParams]], list[SamplingParams]]:
    """A per-request alteration applied to every request of the batch."""
    return lambda batch: [alter(params) for params in batch]


class _VerifyIgnoresTopP(_VerifyParamsAltered):
    verify_params = staticmethod(each(drop_top_p))


class _VerifyIgnoresTemperature(_VerifyParamsAltered):
    verify_params = staticmethod(each(drop_temperature))


class _VerifyRowsOneRequestOff(_VerifyParamsAltered):
    verify_params = staticmethod(from_previous_row)


class _VerifyTopKAloneAtBatchMax(_VerifyParamsAltered):
    verify_params = staticmethod(top_k_alone_at_batch_max)


class VerifyIgnoresTopP(Engine):
    """Top-p ignored in verify: speculative verification samples from the target distribution
    without top-p filtering while plain sampling applies it, so tokens outside the nucleus are
    emitted after the first. Greedy output is untouched."""

    worker_class = _VerifyIgnoresTopP


class VerifyTemperatureMisapplied(Engine):
    """Temperature misapplied in verify: verification scores the target at temperature 1
    (the temperature reaches only the plain sampler), so every verified token follows the
    untempered law. Greedy output is untouched."""

    worker_class = _VerifyIgnoresTemperature


class VerifyParamsFromPreviousRow(Engine):
    """Sampling parameters expanded to the wrong verify rows: each sampled request verifies
    with the temperature, top-k and top-p of the request before it in the batch.

    The per-request to per-token expansion is one request off. Invisible in a batch whose
    requests share one setting (the distribution tier's); greedy output, seeds and plain
    decoding are untouched."""

    worker_class = _VerifyRowsOneRequestOff


class VerifyTopKAloneAtBatchMax(Engine):
    """Top-k alone, thresholded at the batch's largest k: in a batch where no request sets
    top-p, verification filters every sampled request at the largest top-k of the batch
    (a top-k-only fast path taking one threshold for all rows). Invisible in a batch that
    holds a top-p request and in a batch of one; greedy output and plain decoding are
    untouched."""

    worker_class = _VerifyTopKAloneAtBatchMax


# The verify-path parameter bugs, by mutant name: their exact output law follows from the
# altered params alone (verification stays exact for them), which the distribution tier uses
# to report its power against each.
VERIFY_PARAM_BUGS: dict[str, Callable[[SamplingParams], SamplingParams]] = {
    "verify_ignores_top_p": drop_top_p,
    "verify_temperature_misapplied": drop_temperature,
}


# --- sampling settings dropped on the way in ---------------------------------------------------

class _DropsSamplingSettings(Scheduler):
    def add(self, req: Req) -> None:
        # BUG: temperature, top-k and top-p never reach the sampler: the request decodes
        # greedily, and its seed (given or derived) draws nothing
        req.params = replace(req.params, temperature=0.0, top_k=-1, top_p=1.0)
        super().add(req)


class IgnoresTemperatureAndSeed(Engine):
    """Sampling settings ignored: every request decodes greedily whatever its temperature,
    top-k, top-p and seed say. Each run is reproducible and greedy output is untouched; sampled
    requests with one prompt all give the same stream."""

    scheduler_class = _DropsSamplingSettings

"""Bugs of specgate's seed classes planted in vLLM's own code paths, at run time, so the vLLM
certification can be shown to catch them (docs/backends/vllm.md, "Planted bugs").

Each factory below returns the vLLM backend (``conformance.backends.vllm``) after patching one
function of the vLLM modules imported in this process; nothing installed is edited. Name one
with ``specgate certify --backend tests.vllm_planted:<factory>`` from the repository root,
with the root on ``PYTHONPATH`` (the ``specgate`` script does not add the working directory). A
patch goes in before vLLM builds an engine (``open``) and stays for the life of the process:
a certify process certifies one planted backend. ``planted(name)`` applies one for the length
of a ``with`` block, for tests.

- ``rejection_accepts_one_more``: the greedy rejection sampler keeps the first rejected draft
  and the target's token after it, one accepted draft too many; outputs stop being the
  target's (class: greedy accept rule, lossless).
- ``ngram_one_position_late``: the n-gram proposer copies from one position past the end of
  the matched n-gram; output stays lossless, acceptance drops (class: draft-side off-by-one).
- ``kv_freed_one_step_late``: a finished (or aborted) request's KV blocks go back to the pool
  only at the scheduler's next ``schedule()`` (class: KV leak on finish, memory).
- ``eagle_reads_previous_hidden``: the EAGLE proposer pairs each token with the target's
  hidden state of the position before it; output stays lossless, acceptance drops (class:
  draft-side off-by-one).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Undo = Callable[[], None]


@dataclass(frozen=True)
class Plant:
    """One planted bug: where it goes in vLLM, what it breaks, and how to apply it."""

    name: str
    bug_class: str
    patch_point: str          # vLLM file: function
    breaks: str
    install: Callable[[], Undo]


_INSTALLED: dict[str, Undo] = {}


# --- 1. rejection sampler: one draft accepted too many (greedy path) --------------------------

def accept_one_more(out: Any, draft_ids: Any, num_draft: list[int], target_argmax: Any,
                    bonus_ids: Any, greedy_rows: list[bool]) -> None:
    """The planted error, in place on a correct greedy result ``out [batch, max_spec + 1]``:
    where row r's walk stopped at draft p (draft != target argmax), keep draft p as accepted
    and write the target's token after it (its argmax at p + 1, or the bonus after the last
    draft)."""
    start = 0
    for row, n in enumerate(num_draft):
        drafts = draft_ids[start:start + n]
        target = target_argmax[start:start + n]
        start += n
        if n == 0 or not greedy_rows[row]:
            continue
        wrong = (drafts.long() != target.long()).nonzero()
        if len(wrong) == 0:
            continue
        p = int(wrong[0])
        out[row, p] = drafts[p]
        out[row, p + 1] = target[p + 1] if p + 1 < n else bonus_ids.reshape(-1)[row]


def _install_rejection() -> Undo:
    from vllm.v1.sample import rejection_sampler

    original = rejection_sampler.rejection_sample

    def rejection_sample(draft_token_ids: Any, num_draft_tokens: list[int], max_spec_len: int,
                         cu_num_draft_tokens: Any, draft_probs: Any, target_logits: Any,
                         bonus_token_ids: Any, sampling_metadata: Any, *args: Any,
                         **kwargs: Any) -> Any:
        out = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                       draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                       *args, **kwargs)
        if sampling_metadata.all_random:
            return out
        if sampling_metadata.all_greedy:
            greedy = [True] * len(num_draft_tokens)
        else:
            greedy = (sampling_metadata.temperature == 0).tolist()
        accept_one_more(out, draft_token_ids, list(num_draft_tokens),
                        target_logits.argmax(dim=-1), bonus_token_ids, greedy)
        return out

    rejection_sampler.rejection_sample = rejection_sample

    def undo() -> None:
        rejection_sampler.rejection_sample = original
    return undo


# --- 2. n-gram proposer: copies from one position too late -----------------------------------

def _register_kernels_first() -> None:
    """vLLM's CPU kernel-override registration, done now if not yet: importing the n-gram
    proposer loads numba (and llvmlite), after which that registration cannot run in this
    process (docs/backends/vllm.md); the adapter then keeps it from running a second time."""
    from vllm.platforms import current_platform

    from conformance.backends.vllm.process import kernel_overrides_once

    kernel_overrides_once()
    if "llvmlite.binding.ffi" not in sys.modules:   # else too late: it would raise
        current_platform.register_triton_kernel_overrides()


def _install_ngram() -> Undo:
    _register_kernels_first()
    from vllm.v1.spec_decode import ngram_proposer

    original = ngram_proposer.batch_propose_numba
    find = ngram_proposer._find_longest_matched_ngram_and_propose_tokens

    def batch_propose_numba(valid_ngram_requests: list[int], num_tokens_no_spec: Any,
                            token_ids_cpu: Any, min_n: int, max_n: int, max_model_len: int,
                            k: int, valid_ngram_draft: Any, valid_ngram_num_drafts: Any) -> None:
        # vLLM's own lookup asked for one token more, its first dropped: the proposal starts
        # one position past the end of the matched n-gram.
        for idx in valid_ngram_requests:
            context = token_ids_cpu[idx, :num_tokens_no_spec[idx]]
            drafts = find(context, min_n, max_n, max_model_len, k + 1)[1:]
            valid_ngram_num_drafts[idx] = len(drafts)
            if len(drafts):
                valid_ngram_draft[idx, :len(drafts)] = drafts

    ngram_proposer.batch_propose_numba = batch_propose_numba

    def undo() -> None:
        ngram_proposer.batch_propose_numba = original
    return undo


# --- 3. scheduler: a finished request's KV blocks freed one step late ------------------------

def _install_late_free() -> Undo:
    from vllm.v1.core.sched.scheduler import Scheduler

    original_free = Scheduler._free_request_blocks
    original_schedule = Scheduler.schedule

    def _free_request_blocks(self: Any, request: Any) -> None:
        self.__dict__.setdefault("_planted_late_frees", []).append(request)

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        late = self.__dict__.pop("_planted_late_frees", [])
        for request in late:
            original_free(self, request)
        return original_schedule(self, *args, **kwargs)

    Scheduler._free_request_blocks = _free_request_blocks  # type: ignore[method-assign]
    Scheduler.schedule = schedule  # type: ignore[method-assign]

    def undo() -> None:
        Scheduler._free_request_blocks = original_free  # type: ignore[method-assign]
        Scheduler.schedule = original_schedule  # type: ignore[method-assign]
    return undo


# --- 4. EAGLE proposer: the hidden state of the wrong position -------------------------------

def previous_positions(num_tokens: int, query_start_loc: Any) -> Any:
    """Index ``i -> i - 1`` over a flat batch of ``num_tokens``, each request's first token
    (its ``query_start_loc`` entry) mapped to itself."""
    import torch

    index = torch.arange(num_tokens) - 1
    starts = query_start_loc.to("cpu").long()
    starts = starts[starts < num_tokens]
    index[starts] = starts
    return index


def _install_eagle() -> Undo:
    from vllm.v1.spec_decode.eagle import EagleProposer

    original = EagleProposer.set_inputs_first_pass
    had_own = "set_inputs_first_pass" in EagleProposer.__dict__

    def set_inputs_first_pass(self: Any, target_token_ids: Any, next_token_ids: Any,
                              target_positions: Any, target_hidden_states: Any,
                              token_indices_to_sample: Any, cad: Any,
                              num_rejected_tokens_gpu: Any) -> Any:
        index = previous_positions(target_hidden_states.shape[0], cad.query_start_loc)
        shifted = target_hidden_states[index.to(target_hidden_states.device)]
        return original(self, target_token_ids, next_token_ids, target_positions, shifted,
                        token_indices_to_sample, cad, num_rejected_tokens_gpu)

    EagleProposer.set_inputs_first_pass = set_inputs_first_pass  # type: ignore[method-assign]

    def undo() -> None:
        if had_own:
            EagleProposer.set_inputs_first_pass = original  # type: ignore[method-assign]
        else:
            del EagleProposer.set_inputs_first_pass
    return undo


PLANTS: dict[str, Plant] = {p.name: p for p in (
    Plant("rejection_accepts_one_more", "greedy accept rule (lossless)",
          "vllm/v1/sample/rejection_sampler.py: rejection_sample",
          "keeps the first rejected draft and the target's token after it", _install_rejection),
    Plant("ngram_one_position_late", "draft-side off-by-one",
          "vllm/v1/spec_decode/ngram_proposer.py: batch_propose_numba",
          "proposes from one position past the matched n-gram's end", _install_ngram),
    Plant("kv_freed_one_step_late", "KV leak on finish",
          "vllm/v1/core/sched/scheduler.py: Scheduler._free_request_blocks",
          "a finished request's blocks return to the pool at the next schedule()",
          _install_late_free),
    Plant("eagle_reads_previous_hidden", "draft-side off-by-one",
          "vllm/v1/spec_decode/llm_base_proposer.py: set_inputs_first_pass (EagleProposer)",
          "each token's feature is the target's hidden state one position earlier",
          _install_eagle),
)}


def install(name: str) -> None:
    """Apply plant ``name`` in this process (once; a second call changes nothing)."""
    if name not in _INSTALLED:
        _INSTALLED[name] = PLANTS[name].install()


def uninstall(name: str) -> None:
    """Put back what ``install(name)`` replaced."""
    undo = _INSTALLED.pop(name, None)
    if undo is not None:
        undo()


@contextlib.contextmanager
def planted(name: str) -> Iterator[Plant]:
    """Plant ``name`` for the length of the block."""
    install(name)
    try:
        yield PLANTS[name]
    finally:
        uninstall(name)


def _backend(name: str) -> Any:
    from conformance.backends.vllm import backend

    made = backend()          # imports vLLM (VllmNotInstalled without it)
    install(name)
    made.name = f"vllm+{name}"   # the certificate names the plant
    return made


def rejection_accepts_one_more() -> Any:
    """vLLM with its greedy rejection sampler accepting one draft too many."""
    return _backend("rejection_accepts_one_more")


def ngram_one_position_late() -> Any:
    """vLLM with its n-gram proposer copying from one position too late."""
    return _backend("ngram_one_position_late")


def kv_freed_one_step_late() -> Any:
    """vLLM with finished requests' KV blocks freed at the next schedule()."""
    return _backend("kv_freed_one_step_late")


def eagle_reads_previous_hidden() -> Any:
    """vLLM with its EAGLE proposer reading the previous position's hidden state."""
    return _backend("eagle_reads_previous_hidden")

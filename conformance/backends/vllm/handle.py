"""The vLLM backend's handle: one ``LLMEngine.step()`` per ``handle.step()``.

Requests go in as token-id prompts with vLLM ``SamplingParams`` mapped from specwire's; vLLM
decides every finish itself (EOS, stop tokens, stop strings, ``max_tokens``, the model
length), so what is certified is vLLM's behaviour, not a rule of this adapter. Outputs are
cumulative (``RequestOutputKind.CUMULATIVE``): each step's new tokens are the suffix past what
was already streamed, the finish carries vLLM's final token list and text.
"""

from __future__ import annotations

# vLLM's environment first: vLLM reads some of it when imported.
import conformance.backends.vllm.process  # noqa: F401

# isort: split

import contextlib
import zlib
from dataclasses import dataclass, field
from typing import TypedDict

from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.llm_engine import LLMEngine

from conformance.backends.request_check import check_request
from conformance.backends.vllm.claims import NAME
from conformance.backends.vllm.memory import PreemptionWatch, read_view
from conformance.contract import (
    Event,
    FinishEvent,
    FinishReason,
    MemoryView,
    OpenConfig,
    Request,
    RetractEvent,
    TokenEvent,
)

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length",
                                             "abort": "abort"}


class RequestBlocks(TypedDict):
    """One live request in ``VllmHandle.kv_blocks`` (None: vLLM no longer knows it)."""

    blocks: list[int]
    num_computed_tokens: int | None
    num_tokens: int | None
    status: str | None


class KVBlocks(TypedDict):
    """``VllmHandle.kv_blocks``: vLLM's own KV accounting."""

    num_blocks: int
    free_blocks: int
    block_size: int
    requests: dict[str, RequestBlocks]


@dataclass
class _Live:
    req: Request
    internal_id: str            # vLLM's request id (the rid plus a random suffix)
    output: list[int] = field(default_factory=list)
    accept_lens: list[int] = field(default_factory=list)


class VllmHandle:
    def __init__(self, engine: LLMEngine, cfg: OpenConfig, vocab_size: int,
                 max_context_len: int, speculative: bool) -> None:
        self.engine: LLMEngine | None = engine
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.speculative = speculative
        self.live: dict[str, _Live] = {}
        self.pending: list[Event] = []   # abort finishes, reported by the next step()
        self.preemptions = PreemptionWatch({})  # vLLM preemptions -> RetractEvents

    # --- requests ---------------------------------------------------------------------------

    def _vllm_params(self, req: Request) -> VllmSamplingParams:
        p = req.params
        seed = p.seed
        if seed is None and not p.greedy:
            # Unseeded sampled requests derive their draws from the engine seed and the rid
            # (as refengine does), so an engine instance is reproducible.
            seed = zlib.crc32(f"{self.cfg.seed}\0{req.rid}".encode())
        return VllmSamplingParams(
            temperature=float(p.temperature),
            top_k=0 if p.top_k == -1 else int(p.top_k),   # vLLM: 0 disables top-k
            top_p=float(p.top_p),
            seed=seed,
            max_tokens=int(p.max_new_tokens),
            stop_token_ids=list(p.stop_token_ids),
            stop=list(p.stop),
            ignore_eos=bool(p.ignore_eos),
            include_stop_str_in_output=False,
            skip_special_tokens=True,
            output_kind=RequestOutputKind.CUMULATIVE,
        )

    def submit(self, req: Request) -> None:
        if self.engine is None:
            raise RuntimeError("vllm backend: handle is closed")
        check_request(req, self.live, self.vocab_size, self.max_context_len, NAME)
        self._check_pool(req)
        internal = self.engine.add_request(req.rid, {"prompt_token_ids": list(req.prompt_ids)},
                                           self._vllm_params(req))
        self.live[req.rid] = _Live(req, internal)

    def _scheduler(self) -> Scheduler:
        assert self.engine is not None
        return self.engine.engine_core.engine_core.scheduler

    def _internal_ids(self) -> dict[str, str]:
        return {rid: live.internal_id for rid, live in self.live.items()}

    def _check_pool(self, req: Request) -> None:
        """``ValueError`` naming ``kv_pool_tokens`` for a request whose whole context (prompt
        plus ``max_new_tokens``, up to the model's limit) can never be in the pool. Only a pool
        smaller than the model's context lowers vLLM's ``max_model_len`` (``engine_args``);
        every request accepted then ends before that lowered limit, as under the model's."""
        pool_len = int(self._scheduler().max_model_len)
        need = min(len(req.prompt_ids) + req.params.max_new_tokens, self.max_context_len)
        if need > pool_len:
            raise ValueError(f"kv_pool_tokens: request {req.rid!r} needs up to {need} KV slots "
                             f"(prompt {len(req.prompt_ids)} + max_new_tokens "
                             f"{req.params.max_new_tokens}) but the pool holds {pool_len}")

    def _in_prefill(self) -> set[str]:
        """Live rids whose next forward computes prompt (or recomputed) positions: the token
        such a step emits comes from a prefill, not a verify step."""
        assert self.engine is not None
        requests = self.engine.engine_core.engine_core.scheduler.requests
        out = set()
        for rid, live in self.live.items():
            r = requests.get(live.internal_id)
            if r is None or r.num_computed_tokens < r.num_tokens - 1:
                out.add(rid)
        return out

    def step(self) -> list[Event]:
        if self.engine is None:
            raise RuntimeError("vllm backend: handle is closed")
        events: list[Event] = self.pending
        self.pending = []
        if not self.live:
            return events
        prefill = self._in_prefill() if self.speculative else set()
        for out in self.engine.step():
            live = self.live.get(out.request_id)
            if live is None:
                continue
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            if ids[:len(live.output)] != live.output:
                raise RuntimeError(f"vllm backend: request {live.req.rid!r}: vLLM's cumulative "
                                   f"output no longer extends what was streamed")
            new = ids[len(live.output):]
            if new:
                live.output.extend(new)
                events.append(TokenEvent(live.req.rid, tuple(new)))
                if self.speculative and live.req.rid not in prefill:
                    live.accept_lens.append(len(new))
            if out.finished:
                reason = _FINISH_REASONS.get(str(completion.finish_reason))
                if reason is None:
                    raise RuntimeError(f"vllm backend: request {live.req.rid!r} finished with "
                                       f"unknown reason {completion.finish_reason!r}")
                events.append(FinishEvent(live.req.rid, reason, tuple(live.output),
                                          completion.text or "", tuple(live.accept_lens)))
                del self.live[live.req.rid]
        events.extend(RetractEvent(rid) for rid in
                      self.preemptions.retracted(self._scheduler(), self._internal_ids()))
        return events

    def abort(self, rid: str) -> None:
        if self.engine is None:
            raise RuntimeError("vllm backend: handle is closed")
        live = self.live.pop(rid, None)
        if live is None:
            return  # finished or aborted already: aborting is idempotent (docs/adapter.md)
        self.engine.abort_request([rid])
        text = ""
        if live.output:
            tokenizer = self.engine.get_tokenizer()
            text = tokenizer.decode(live.output, skip_special_tokens=True)
        self.pending.append(FinishEvent(rid, "abort", tuple(live.output), text,
                                        tuple(live.accept_lens)))

    def memory(self) -> MemoryView:
        """vLLM's KV-cache manager as a ``MemoryView`` (``memory.read_view``)."""
        if self.engine is None:
            raise RuntimeError("vllm backend: handle is closed")
        return read_view(self._scheduler(), self._internal_ids())

    def open_session(self, session_id: str) -> None:
        raise ValueError(f"session_id: the {NAME} backend has no streaming sessions")

    def close_session(self, session_id: str) -> None:
        raise ValueError(f"session_id: the {NAME} backend has no streaming sessions")

    # --- introspection (docs/backends/vllm.md) ----------------------------------------------

    def kv_blocks(self) -> KVBlocks:
        """vLLM's own KV accounting, read from its scheduler's KV-cache manager: pool size and
        free blocks (the null block excluded from neither), block size, each live request's
        block count and computed tokens. Not a ``MemoryView``: see the doc."""
        assert self.engine is not None
        scheduler = self.engine.engine_core.engine_core.scheduler
        kvm = scheduler.kv_cache_manager
        pool = kvm.block_pool
        per_request: dict[str, RequestBlocks] = {}
        for rid, live in self.live.items():
            r = scheduler.requests.get(live.internal_id)
            blocks = kvm.get_block_ids(live.internal_id)
            per_request[rid] = {
                "blocks": [len(group) for group in blocks],
                "num_computed_tokens": None if r is None else r.num_computed_tokens,
                "num_tokens": None if r is None else r.num_tokens,
                "status": None if r is None else str(r.status),
            }
        return {"num_blocks": pool.num_gpu_blocks, "free_blocks": pool.get_num_free_blocks(),
                "block_size": scheduler.cache_config.block_size, "requests": per_request}

    def close(self) -> None:
        engine, self.engine = self.engine, None
        self.live.clear()
        if engine is not None:
            # best effort: the engine is dropped either way
            with contextlib.suppress(Exception):
                engine.engine_core.shutdown()

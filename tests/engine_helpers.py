"""Helpers shared by the engine tests: drive an Engine to completion while recording what it
emits (and, optionally, the logits each token was chosen from), and the ``transformers`` greedy
oracle."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refengine import (
    Engine,
    EngineConfig,
    FinishEvent,
    RetractEvent,
    SamplingParams,
    SpecConfig,
    TokenEvent,
)
from refengine.memory.kv_pool import KVPool
from refengine.model.llama import ForwardBatch, ForwardOutput


class LogitsRecorder:
    """Stands in for the runner's target model and keeps a copy of every forward's output
    logits.

    The engine samples one token per row of ``out.logits``, in the order its TokenEvents of
    that step come out, which is how :func:`drive` ties each row to a request.
    """

    def __init__(self, engine: Engine) -> None:
        self.inner = engine.runner.target
        self.steps: list[torch.Tensor] = []
        engine.runner.target = self  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # config, lm_head, ...: the model's own
        return getattr(self.inner, name)

    def __call__(self, batch: ForwardBatch, kv: KVPool) -> ForwardOutput:
        out = self.inner(batch, kv)
        self.steps.append(out.logits.detach().clone())
        return out


@dataclass
class Run:
    """What an engine emitted, per request; :meth:`step` checks the event stream as it goes:
    no token after a request's finish, at most one finish per request, and a FinishEvent's
    output equals the tokens its TokenEvents carried."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finishes: dict[str, FinishEvent] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    retractions: int = 0
    steps: int = 0
    events: list[list[Any]] = field(default_factory=list)

    def step(self, engine: Engine, recorder: LogitsRecorder | None = None) -> list[Any]:
        """One ``engine.step()``, recorded."""
        recorded = len(recorder.steps) if recorder is not None else 0
        events = engine.step()
        self.events.append(events)
        self.steps += 1
        token_events = [e for e in events if isinstance(e, TokenEvent)]
        if recorder is not None and len(recorder.steps) > recorded:
            assert len(recorder.steps) == recorded + 1, "more than one forward in a step"
            rows = recorder.steps[-1]
            assert rows.shape[0] == len(token_events)
            for ev, row in zip(token_events, rows, strict=True):
                self.logits.setdefault(ev.rid, []).append(row)
        elif recorder is not None:
            assert not token_events, "tokens without a forward"
        for ev in events:
            if isinstance(ev, TokenEvent):
                assert ev.rid not in self.finishes, f"token for finished request {ev.rid}"
                self.tokens.setdefault(ev.rid, []).extend(ev.token_ids)
            elif isinstance(ev, FinishEvent):
                assert ev.rid not in self.finishes, f"second finish for {ev.rid}"
                assert list(ev.output_ids) == self.tokens.get(ev.rid, [])
                self.finishes[ev.rid] = ev
            elif isinstance(ev, RetractEvent):
                self.retractions += 1
        return events


def has_work(engine: Engine) -> bool:
    """Live requests, or events a step has yet to return (an abort's FinishEvent): what a test
    that steps an engine by hand loops on."""
    return bool(engine._live) or bool(engine._pending)


def drive(engine: Engine, recorder: LogitsRecorder | None = None,
          before_step: Callable[[int], None] | None = None,
          after_step: Callable[[int, list[Any]], None] | None = None,
          run: Run | None = None, max_steps: int = 10_000) -> Run:
    """Step ``engine`` until it has no work (continuing ``run`` if given); ``before_step`` and
    ``after_step`` get the step's index (and its events)."""
    run = run if run is not None else Run()
    while has_work(engine):
        assert run.steps < max_steps, "engine did not drain"
        if before_step is not None:
            before_step(run.steps)
        events = run.step(engine, recorder)
        if after_step is not None:
            after_step(run.steps - 1, events)
    return run


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int,
              eos_token_id: int | None = None) -> tuple[list[int], torch.Tensor]:
    """``transformers`` greedy generate: the new tokens and the raw logits each came from.

    ``eos_token_id=None`` disables EOS (the model's generation config is overridden by the
    keyword), so the run has exactly ``new_tokens`` tokens unless an EOS is given.
    """
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                             eos_token_id=eos_token_id, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    if eos_token_id is None:
        assert len(tokens) == new_tokens
    logits = torch.cat([step.float() for step in out.logits])[:len(tokens)]
    return tokens, logits


def max_logit_diff(ours: list[torch.Tensor], theirs: torch.Tensor) -> float:
    assert len(ours) == theirs.shape[0]
    return float((torch.stack(ours) - theirs).abs().max())


# --- speculative engines on the spec pair (conftest ``spec_pair``) --------------------------------

SPEC_PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Foo:\n    def __init__(self):",
                "x = 1\n" * 10, "for i in range(10):\n    print(i)\n", "# comment\n"]
SPEC_SHAPES = {"chain-s3-n4": (3, 1, 4), "tree-s3-k4-n8": (3, 4, 8), "tree-s5-k8-n16": (5, 8, 16)}
SPEC_GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def spec_engine(pair: tuple[Path, Path], config: str | None, overlap: bool = False,
                draft: Path | None = None, algorithm: str = "eagle", **kw: object) -> Engine:
    """An engine on the spec pair's target: plain (``config=None``) or one of ``SPEC_SHAPES``
    with the pair's draft head (or ``draft`` of ``algorithm``), under overlap scheduling if
    asked."""
    target, head = pair
    spec = None
    if config is not None:
        steps, topk, tokens = SPEC_SHAPES[config]
        spec = SpecConfig(algorithm=algorithm,  # type: ignore[arg-type]
                          draft_model=str(draft or head), num_steps=steps, topk=topk,
                          num_draft_tokens=tokens, overlap=overlap)
    return Engine(EngineConfig(model=str(target), spec=spec, **{"kv_pool_tokens": 4096, **kw}))


def mtp_engine(pair: tuple[Path, Path], mtp: Path, config: str | None, overlap: bool = False,
               **kw: object) -> Engine:
    """``spec_engine`` with the Frozen-KV MTP assistant ``mtp``, strict checks on."""
    return spec_engine(pair, config, overlap, draft=mtp, algorithm="frozen_kv_mtp",
                       **{"strict_mem_check": True, **kw})


def model_with_eos(model_dir: Path, out: Path, eos: int) -> Path:
    """A copy of ``model_dir`` at ``out`` whose ``config.json`` names ``eos`` as its EOS."""
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(cfg))
    return out

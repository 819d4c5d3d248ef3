"""Committed expected outputs: the reference's greedy continuations of the bundled prompts,
recorded once (``specgate expected record``) and checked against transformers when recorded.

The oracle answers a covered request from these, not by running ``refengine``: when specgate
gates a change to the reference engine itself, a bug in a path plain decoding shares with
speculation (sampler, stop and length checks, scheduler, model forward) changes the backend
and a live oracle alike; the committed outputs do not change with it.

What is stored, per prompt (keyed by a digest of its token ids): the greedy continuation with
``ignore_eos``, as long as the longest request any tier makes of that prompt (or up to the
context limit), and per output index the reference's runner-up token and top-2 logit margin
(what the near-tie judgment needs; ``conformance.oracle``). A request is answered from a
continuation by the stop and length rules of the adapter contract (``docs/adapter.md``),
implemented here and not taken from ``refengine.stopping``: stop token ids and EOS end it
(the stop token kept), ``max_new_tokens`` or the context limit end it by length. Requests with
stop strings, sampled requests and prompts not recorded are not covered.

Recording refuses to write the file unless HF ``LlamaForCausalLM`` in float32, fed the same
prompt and continuation, picks the reference's token at every output index, except where its
own top two logits are within the float32 near-tie epsilon: such indices are stored as
``hf_near_ties``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

from refengine.config import SamplingParams
from refengine.data import fixture_names, fixtures_root, golden_root

if TYPE_CHECKING:
    import torch

    from refengine import Engine

# The longest request a tier makes of a bundled prompt: the memory tier's load mix asks up to
# 8 + (max_new_tokens - 1) tokens, and the full profile's max_new_tokens is 64.
PROMPT_SET_TOKENS = 72
FORMAT = 1


class ExpectedMismatch(ValueError):
    """Recording found transformers disagreeing with the reference away from a near-tie."""


def prompt_key(prompt_ids: tuple[int, ...] | list[int]) -> str:
    """A short, stable name for a prompt's token ids."""
    text = ",".join(str(int(t)) for t in prompt_ids)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def fixture_digest(model: str) -> str:
    """A digest of the manifest entries of fixture ``model``: recorded outputs apply only to
    the very files they were recorded from."""
    manifest = json.loads((fixtures_root() / "MANIFEST.json").read_text())
    entries = sorted((k, v) for k, v in manifest.items() if k.startswith(f"{model}/"))
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def expected_path(model: str) -> Path:
    return golden_root() / "expected" / f"{model}.json"


@dataclass(frozen=True)
class Continuation:
    prompt_len: int
    tokens: tuple[int, ...]          # greedy, ignore_eos
    runner_up: tuple[int, ...]       # per output index: the second-best token
    margins: tuple[float, ...]       # per output index: top logit minus the second's
    hf_near_ties: tuple[int, ...]    # output indices where transformers' argmax differs


@dataclass(frozen=True)
class ExpectedOutputs:
    model: str
    fixture_digest: str
    context_limit: int
    eos_token_id: int
    continuations: dict[str, Continuation]

    def lookup(self, prompt_ids: tuple[int, ...]) -> Continuation | None:
        found = self.continuations.get(prompt_key(prompt_ids))
        return found if found is not None and found.prompt_len == len(prompt_ids) else None

    def greedy(self, prompt_ids: tuple[int, ...], params: SamplingParams) -> list[int] | None:
        """The expected output of a greedy request, or None if it is not covered."""
        found = self.lookup(prompt_ids)
        if found is None or not params.greedy or params.stop:
            return None
        room = min(params.max_new_tokens, self.context_limit - len(prompt_ids))
        if room < 1:
            return None
        out: list[int] = []
        for token in found.tokens:
            if len(out) == room:
                break
            out.append(token)
            if token in params.stop_token_ids or (token == self.eos_token_id
                                                  and not params.ignore_eos):
                return out
        return out if len(out) == room else None

    def to_json(self) -> str:
        rows = {key: {**asdict(c), "margins": [float(f"{m:.6g}") for m in c.margins]}
                for key, c in sorted(self.continuations.items())}
        head = {"format": FORMAT, "model": self.model, "fixture_digest": self.fixture_digest,
                "context_limit": self.context_limit, "eos_token_id": self.eos_token_id}
        # one line per prompt: diffs of a re-recording stay readable
        body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in rows.items())
        return json.dumps(head)[:-1] + ', "continuations": {\n' + body + "\n}}\n"

    @classmethod
    def from_json(cls, text: str) -> ExpectedOutputs:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"expected outputs: format {data.get('format')!r}, this specgate "
                             f"reads {FORMAT}")
        conts = {k: Continuation(v["prompt_len"], tuple(v["tokens"]), tuple(v["runner_up"]),
                                 tuple(v["margins"]), tuple(v["hf_near_ties"]))
                 for k, v in data["continuations"].items()}
        return cls(data["model"], data["fixture_digest"], data["context_limit"],
                   data["eos_token_id"], conts)


# A re-recording's margins are differences of float32 logits of magnitude ~10, stored to 6
# significant digits: on another machine or thread count each logit moves by a few ulps, so a
# margin moves by up to about 2e-5 whatever its size (1.2e-5 seen on a margin of 0.199, 1.07e-5
# on one of 7.17). Compared within half the float32 near-tie epsilon (1e-4): a drift that
# small cannot move a position across the fragility line by more than the noise itself.
MARGIN_TOLERANCE = 5e-5


def differences(committed: ExpectedOutputs, recorded: ExpectedOutputs) -> list[str]:
    """What a fresh recording changes: everything but the margins exactly, the margins within
    ``MARGIN_TOLERANCE`` (absolute, in logits)."""
    found = [f"{name}: {a!r} -> {b!r}" for name, a, b in (
        ("model", committed.model, recorded.model),
        ("fixture_digest", committed.fixture_digest, recorded.fixture_digest),
        ("context_limit", committed.context_limit, recorded.context_limit),
        ("eos_token_id", committed.eos_token_id, recorded.eos_token_id)) if a != b]
    for key in sorted(committed.continuations.keys() ^ recorded.continuations.keys()):
        where = "committed" if key in committed.continuations else "new"
        found.append(f"prompt {key}: only in the {where} file")
    for key in sorted(committed.continuations.keys() & recorded.continuations.keys()):
        a, b = committed.continuations[key], recorded.continuations[key]
        if (a.prompt_len, a.tokens, a.runner_up, a.hf_near_ties) != (
                b.prompt_len, b.tokens, b.runner_up, b.hf_near_ties):
            found.append(f"prompt {key}: tokens, runner-up or near-ties differ")
            continue
        moved = [i for i, (x, y) in enumerate(zip(a.margins, b.margins, strict=True))
                 if abs(x - y) > MARGIN_TOLERANCE]
        if moved:
            i = moved[0]
            found.append(f"prompt {key}: margin at output index {i} {a.margins[i]:.6g} -> "
                         f"{b.margins[i]:.6g} ({len(moved)} index(es) beyond tolerance)")
    return found


@cache
def load_expected(model: str) -> ExpectedOutputs | None:
    """The committed outputs for bundled fixture ``model``; None for a model directory, a
    fixture without recorded outputs, or one whose files changed since they were recorded."""
    path = expected_path(model)
    if model not in fixture_names() or not path.exists():
        return None
    expected = ExpectedOutputs.from_json(path.read_text())
    return expected if expected.fixture_digest == fixture_digest(model) else None


# --- recording ---------------------------------------------------------------------------------

def covered_prompts(model: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every prompt the tiers ask greedy outputs of, with the length to record: each prompt of
    the profiles' prompt sets, and each long context the lossless and memory tiers build
    around the profiles' context boundaries."""
    from conformance.plugin import PROFILES, SuiteContext
    from conformance.prompts import load_prompt_set
    from conformance.suites.support import context_limit, long_context_requests

    wanted: dict[str, tuple[tuple[int, ...], int]] = {}
    for profile in PROFILES.values():
        for case in load_prompt_set(profile.prompt_set, model):
            wanted[prompt_key(case.ids)] = (case.ids, PROMPT_SET_TOKENS)
    limit = context_limit(model)
    # long_context_requests reads only the context's model
    ctx = cast(SuiteContext, SimpleNamespace(model=model))
    for boundary in sorted({min(b, limit) for p in PROFILES.values()
                            for b in p.context_boundaries}):
        for prompt, params in long_context_requests(ctx, boundary).values():
            ids = tuple(prompt)
            wanted[prompt_key(ids)] = (ids, params.max_new_tokens)
    return wanted


def _top2(logits: torch.Tensor) -> tuple[list[int], list[int], list[float]]:
    top = logits.topk(2, dim=-1)
    return (top.indices[:, 0].tolist(), top.indices[:, 1].tolist(),
            (top.values[:, 0] - top.values[:, 1]).tolist())


def _hf_near_ties(hf_logits: torch.Tensor, tokens: list[int], epsilon: float) -> tuple[int, ...]:
    """Output indices where transformers' argmax differs from ``tokens``; ExpectedMismatch if
    any of them is not a near-tie of transformers' own logits."""
    picks = hf_logits.argmax(dim=-1).tolist()
    ties = []
    for i, (pick, token) in enumerate(zip(picks, tokens, strict=True)):
        if pick == token:
            continue
        gap = float(hf_logits[i, pick] - hf_logits[i, token])
        if gap >= epsilon:
            raise ExpectedMismatch(f"output index {i}: transformers picks {pick}, the reference "
                                   f"{token}, {gap:.3g} apart (near-tie epsilon {epsilon:g})")
        ties.append(i)
    return tuple(ties)


def record_one(engine: Engine, hf_model: torch.nn.Module, prompt: tuple[int, ...],
               tokens: list[int], epsilon: float) -> Continuation:
    """``tokens``, the reference's greedy continuation of ``prompt``, with its runner-ups and
    margins from one scoring prefill, checked against transformers fed the same tokens."""
    import torch

    scored = list(prompt) + tokens[:-1]
    logits = engine.prompt_logits(scored)[len(prompt) - 1:]
    top, runner_up, margins = _top2(logits)
    if top != tokens:  # the engine's own scoring must agree with its decoding
        first = next(i for i, (a, b) in enumerate(zip(top, tokens, strict=True)) if a != b)
        raise ExpectedMismatch(f"output index {first}: the reference decodes {tokens[first]} "
                               f"but its scoring prefill ranks {top[first]} first")
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([scored])).logits[0, len(prompt) - 1:].float()
    return Continuation(len(prompt), tuple(tokens), tuple(runner_up), tuple(margins),
                        _hf_near_ties(hf_logits, tokens, epsilon))


def record(model: str) -> ExpectedOutputs:
    """Record every covered prompt's continuation with the reference engine, one request at a
    time as the live oracle decodes, checked against transformers (ExpectedMismatch names the
    first prompt it disagrees on)."""
    import torch
    from transformers import LlamaForCausalLM

    from conformance.oracle import NEAR_TIE_EPSILON
    from refengine import Engine, EngineConfig
    from refengine.data import resolve_model_dir

    engine = Engine(EngineConfig(model=model, kv_pool_tokens=8192, max_running_requests=1))
    hf_model = LlamaForCausalLM.from_pretrained(resolve_model_dir(model),
                                                dtype=torch.float32).eval()
    conts = {}
    for key, (prompt, length) in covered_prompts(model).items():
        room = min(length, engine.max_context_len - len(prompt))
        params = SamplingParams(max_new_tokens=room, temperature=0.0, ignore_eos=True)
        tokens = engine.generate([list(prompt)], params)[0].output_ids
        try:
            conts[key] = record_one(engine, hf_model, prompt, tokens,
                                    NEAR_TIE_EPSILON["float32"])
        except ExpectedMismatch as err:
            raise ExpectedMismatch(f"prompt {key} ({len(prompt)} tokens): {err}") from None
    return ExpectedOutputs(model, fixture_digest(model), engine.max_context_len,
                           engine.eos_token_id, conts)

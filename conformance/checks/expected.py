"""Committed expected outputs: the reference's greedy continuations of the bundled prompts,
recorded once (``specgate expected record``) and checked against transformers when recorded.

The oracle answers a covered request from these, not by running ``refengine``: when specgate
gates a change to the reference engine itself, a bug in a path plain decoding shares with
speculation (sampler, stop and length checks, scheduler, model forward) changes the backend
and a live oracle alike; the committed outputs do not change with it.

What is stored, per prompt (keyed by a digest of its token ids): the greedy continuation with
``ignore_eos``, as long as the longest request any tier makes of that prompt (or up to the
context limit), and per output index the reference's runner-up token and top-2 logit margin
(what the near-tie judgment needs; ``conformance.checks.oracle``). A request is answered from a
continuation by the stop and length rules of the adapter contract (``docs/adapter.md``),
implemented here and not taken from ``refengine.stopping``: stop token ids and EOS end it
(the stop token kept), ``max_new_tokens`` or the context limit end it by length. Requests with
stop strings, sampled requests and prompts not recorded are not covered.

Recording (``expected_record.py``) checks every continuation against transformers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from conformance.contract import SamplingParams
from refengine.data import fixture_names, fixtures_root, golden_root

# The longest request a tier makes of a bundled prompt: the memory tier's load mix asks up to
# 8 + (max_new_tokens - 1) tokens, and the full profile's max_new_tokens is 64.
PROMPT_SET_TOKENS = 72
FORMAT = 1


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

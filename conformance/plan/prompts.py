"""Prompt sets (fixtures/prompts/*.jsonl), tokenized with the fixture model's tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

from tokenizers import Tokenizer

from refengine.data import fixtures_root, resolve_model_dir


@dataclass(frozen=True)
class PromptCase:
    id: str
    text: str
    ids: tuple[int, ...]


@cache
def load_prompt_set(name: str, model: str = "tiny-code") -> tuple[PromptCase, ...]:
    path = fixtures_root() / "prompts" / f"{name}.jsonl"
    if not path.exists():
        known = sorted(p.stem for p in (fixtures_root() / "prompts").glob("*.jsonl"))
        raise FileNotFoundError(f"unknown prompt set {name!r} (known: {', '.join(known)})")
    tok = Tokenizer.from_file(str(resolve_model_dir(model) / "tokenizer.json"))
    cases = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        cases.append(PromptCase(row["id"], row["text"], tuple(tok.encode(row["text"]).ids)))
    return tuple(cases)


LONG_PROMPT_SOURCE = "default"


@cache
def _prompt_stream(model: str) -> tuple[int, ...]:
    """Every prompt of the source set, tokenized one by one and concatenated in file order."""
    return tuple(t for case in load_prompt_set(LONG_PROMPT_SOURCE, model) for t in case.ids)


def long_prompt(length: int, offset: int = 0, model: str = "tiny-code") -> tuple[int, ...]:
    """``length`` tokens of the bundled prompts laid end to end, from token ``offset`` on
    (wrapping around): long contexts built deterministically from held-out code."""
    stream = _prompt_stream(model)
    return tuple(stream[(offset + i) % len(stream)] for i in range(length))

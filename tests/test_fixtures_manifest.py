"""The committed fixtures are what MANIFEST.json says, within the size budget, and loadable by
transformers unchanged."""

from __future__ import annotations

import json

import pytest

from refengine.data import MANIFEST_SKIP, fixture_names, fixtures_root, sha256_file

FIXTURES = fixtures_root()
MB = 1024 * 1024


def fixture_files() -> dict[str, int]:
    return {p.relative_to(FIXTURES).as_posix(): p.stat().st_size
            for p in FIXTURES.rglob("*") if p.is_file() and p.name not in MANIFEST_SKIP
            and "__pycache__" not in p.parts}


def test_every_file_matches_the_manifest() -> None:
    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    files = fixture_files()
    assert sorted(manifest) == sorted(files), "files and manifest entries differ"
    bad = [rel for rel, digest in manifest.items() if sha256_file(FIXTURES / rel) != digest]
    assert not bad, f"sha256 mismatch: {bad}"


def test_size_budget() -> None:
    files = fixture_files()
    models = sum(size for rel, size in files.items()
                 if rel.split("/")[0] in ("tiny-code", "tiny-code-draft"))
    assert models <= 15 * MB, f"target + draft model files: {models / MB:.1f} MB > 15 MB"
    assert sum(files.values()) <= 25 * MB, f"all fixtures: {sum(files.values()) / MB:.1f} MB"


def test_prompt_sets() -> None:
    rows = [json.loads(line) for line in (FIXTURES / "prompts" / "default.jsonl").open()]
    assert len(rows) >= 32 and len({r["id"] for r in rows}) == len(rows)
    lengths = sorted(len(r["text"]) for r in rows)
    assert lengths[0] * 10 < lengths[-1], "prompt lengths should vary"


@pytest.mark.parametrize("name", ["tiny-code", "tiny-code-draft"])
def test_transformers_loads_the_models_unchanged(name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert name in fixture_names()
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name)
    tok = AutoTokenizer.from_pretrained(FIXTURES / name)
    ids = tok("def fib(n):", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size == len(tok)

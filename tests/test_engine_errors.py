"""Acceptance A4 (API side): bad models and bad requests fail with one clear error, and a
rejected request leaves the engine untouched."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from engine_helpers import has_work

import refengine.data
from refengine import Engine, EngineConfig, FinishEvent, SamplingParams
from refengine.data import sha256_file
from refengine.memory.view import idle_error


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def engine(random_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(random_model_dir), kv_pool_tokens=1024))


def assert_untouched(engine: Engine) -> None:
    assert not has_work(engine)
    assert idle_error(engine.memory()) is None
    assert engine.step() == []


# --- model resolution and loading -------------------------------------------------------------


def test_unknown_fixture_name() -> None:
    with pytest.raises(FileNotFoundError, match=r"unknown fixture 'no-such-fixture'"):
        Engine(EngineConfig(model="no-such-fixture"))


def test_missing_model_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"does not exist") as err:
        Engine(EngineConfig(model=str(missing)))
    assert str(missing) in str(err.value)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_model_dir_missing_file(random_model_dir: Path, tmp_path: Path, name: str) -> None:
    model = copy_model(random_model_dir, tmp_path / "m")
    (model / name).unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing {name}") as err:
        Engine(EngineConfig(model=str(model)))
    assert str(model) in str(err.value)


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda b: b"",
    "truncated_half": lambda b: b[: len(b) // 2],
    "truncated_one_byte": lambda b: b[:-1],
    "trailing_bytes": lambda b: b + b"\0\0",
    "garbled_header_json": lambda b: b[:8] + b"#" + b[9:],
    "header_length_huge": lambda b: (10**12).to_bytes(8, "little") + b[8:],
    "all_zero": lambda b: bytes(len(b)),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_safetensors(random_model_dir: Path, tmp_path: Path, kind: str) -> None:
    model = copy_model(random_model_dir, tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(CORRUPTIONS[kind](weights.read_bytes()))
    with pytest.raises(ValueError, match=r"corrupt safetensors") as err:
        Engine(EngineConfig(model=str(model)))
    assert str(weights) in str(err.value)


def edit_config(model: Path, **changes: object) -> None:
    path = model / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(("changes", "message"), [
    ({"model_type": "gpt2"}, "model_type must be 'llama'"),
    ({"hidden_size": None}, "missing field 'hidden_size'"),
    ({"vocab_size": None}, "missing field 'vocab_size'"),
    ({"num_hidden_layers": 3}, "weights do not match config.json"),   # a layer's weights missing
    ({"num_hidden_layers": 1}, "weights do not match config.json"),   # unexpected weights
    ({"intermediate_size": 256}, "weights do not match config.json"),  # shapes differ
    ({"vocab_size": 4096}, "weights do not match config.json"),
])
def test_config_and_weights_disagree(random_model_dir: Path, tmp_path: Path,
                                     changes: dict[str, object], message: str) -> None:
    model = copy_model(random_model_dir, tmp_path / "m")
    edit_config(model, **changes)
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(model=str(model)))


def test_config_not_json(random_model_dir: Path, tmp_path: Path) -> None:
    model = copy_model(random_model_dir, tmp_path / "m")
    (model / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        Engine(EngineConfig(model=str(model)))


# --- fixtures checked against MANIFEST.json ---------------------------------------------------


@pytest.fixture
def fake_fixtures(random_model_dir: Path, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fixtures root holding the random model as fixture ``tiny-rand``, with its manifest."""
    root = tmp_path / "fixtures"
    copy_model(random_model_dir, root / "tiny-rand")
    manifest = {f"tiny-rand/{p.name}": sha256_file(p)
                for p in sorted((root / "tiny-rand").iterdir())}
    (root / "MANIFEST.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(refengine.data, "fixtures_root", lambda: root)
    return root


def test_fixture_by_name_loads(fake_fixtures: Path) -> None:
    """Positive control for the manifest tests below: the untouched fixture loads by name."""
    assert refengine.data.fixture_names() == ["tiny-rand"]
    engine = Engine(EngineConfig(model="tiny-rand"))
    assert engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))[0].finish_reason \
        in ("length", "stop")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json",
                                  "tokenizer_config.json"])
def test_manifest_hash_mismatch(fake_fixtures: Path, name: str) -> None:
    path = fake_fixtures / "tiny-rand" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"manifest hash mismatch") as err:
        Engine(EngineConfig(model="tiny-rand"))
    assert f"tiny-rand/{name}" in str(err.value)


def test_manifest_file_missing(fake_fixtures: Path) -> None:
    (fake_fixtures / "tiny-rand" / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"fixture file missing") as err:
        Engine(EngineConfig(model="tiny-rand"))
    assert "tokenizer_config.json" in str(err.value)


def test_manifest_without_entries(fake_fixtures: Path) -> None:
    (fake_fixtures / "MANIFEST.json").write_text("{}")
    with pytest.raises(ValueError, match=r"manifest: fixture 'tiny-rand' has no entries"):
        Engine(EngineConfig(model="tiny-rand"))


def test_unknown_fixture_lists_known_ones(fake_fixtures: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"unknown fixture 'tiny-other'.*tiny-rand"):
        Engine(EngineConfig(model="tiny-other"))


# --- bad requests -----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[], ""])
def test_empty_prompt(engine: Engine, prompt: list[int] | str) -> None:
    with pytest.raises(ValueError, match=r"^prompt: empty"):
        engine.add_request("r", prompt)
    assert_untouched(engine)


@pytest.mark.parametrize("bad", [2048, 10**9, -1, True, 3.0, "7", None])
def test_token_outside_vocab(engine: Engine, bad: object) -> None:
    with pytest.raises(ValueError,
                       match=r"^prompt: token id .* outside the vocabulary \(0\.\.2047\)"):
        engine.add_request("r", [1, 2, bad])  # type: ignore[list-item]
    assert_untouched(engine)


@pytest.mark.parametrize("length", [512, 513, 2000])
def test_prompt_longer_than_context(engine: Engine, length: int) -> None:
    with pytest.raises(ValueError, match=rf"^prompt: {length} tokens exceed the context length"):
        engine.add_request("r", [7] * length, SamplingParams(max_new_tokens=1))  # context 512
    assert_untouched(engine)


def test_prompt_one_short_of_context_is_accepted(engine: Engine) -> None:
    """Boundary: 511 prompt tokens leave room for exactly one new token."""
    out = engine.generate([[7] * 511], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert len(out.output_ids) == 1
    assert out.finish_reason == "length"
    assert_untouched(engine)


def test_kv_pool_smaller_than_one_request(random_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(random_model_dir), kv_pool_tokens=16))
    with pytest.raises(ValueError, match=r"^kv_pool_tokens: request 'big' needs up to \d+ KV "
                                         r"slots \(prompt 10 \+ max_new_tokens 20\) but the "
                                         r"pool holds 16"):
        engine.add_request("big", list(range(1, 11)), SamplingParams(max_new_tokens=20))
    assert_untouched(engine)
    # A request that fits the pool is accepted and runs.
    out = engine.generate([list(range(1, 11))], SamplingParams(max_new_tokens=4,
                                                               ignore_eos=True))[0]
    assert len(out.output_ids) == 4
    assert_untouched(engine)


def test_kv_pool_check_counts_whole_pages(random_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(random_model_dir), kv_pool_tokens=16, page_size=8))
    with pytest.raises(ValueError, match=r"^kv_pool_tokens") as err:
        engine.add_request("r", list(range(1, 11)), SamplingParams(max_new_tokens=7))
    found = re.search(r"needs up to (\d+)", str(err.value))
    assert found is not None and int(found.group(1)) % 8 == 0 and int(found.group(1)) > 16
    engine.add_request("ok", list(range(1, 11)), SamplingParams(max_new_tokens=4))
    engine.abort("ok")
    assert [type(e) for e in engine.step()] == [FinishEvent]
    assert_untouched(engine)


def test_duplicate_live_rid(engine: Engine) -> None:
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match=r"^rid: request 'dup' is already live"):
        engine.add_request("dup", [4, 5, 6], SamplingParams(max_new_tokens=2))
    finished = []
    while has_work(engine):
        finished += [e for e in engine.step() if isinstance(e, FinishEvent)]
    assert [(e.rid, len(e.output_ids)) for e in finished] == [("dup", 2)]
    # Once finished, the rid may be used again.
    engine.add_request("dup", [4, 5, 6], SamplingParams(max_new_tokens=1))
    engine.abort("dup")
    engine.step()
    assert_untouched(engine)


def test_sessions_are_rejected(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"^session_id"):
        engine.add_request("s", [1, 2], session_id="s1")
    assert_untouched(engine)


def test_generate_params_count_mismatch(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"^params: 1 given for 2 prompts"):
        engine.generate([[1, 2], [3, 4]], [SamplingParams()])
    assert_untouched(engine)

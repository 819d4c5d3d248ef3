"""A damaged model directory is refused up front with one line naming the file and the problem:
``check_model_dir`` reads config.json and only the header of model.safetensors, and a bundled
fixture is checked against MANIFEST.json first (``resolve_model_dir``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refengine.data
from conformance.cli import main
from refengine.data import fixtures_root, resolve_model_dir, sha256_file
from refengine.model.loader import check_draft_dir, check_model_dir, check_safetensors_header

FIXTURE = "tiny-code"


def copy_model(random_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(random_model_dir, tmp_path / "model"))


def split(data: bytes) -> tuple[dict, bytes]:
    """(parsed header, data section) of the bytes of a safetensors file."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), data[8 + length:]


def join(header: object, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


def edit_header(edit: Callable[[dict], object]) -> Callable[[bytes], bytes]:
    """A damage that rewrites the header (the length prefix follows) and keeps the data."""
    def damage(data: bytes) -> bytes:
        header, body = split(data)
        return join(edit(header), body)
    return damage


def first_tensor(header: dict) -> dict:
    return header[min(k for k in header if k != "__metadata__")]


def shrink_shape(header: dict) -> dict:
    first_tensor(header)["shape"][0] -= 1
    return header


def halve_dtype(header: dict) -> dict:
    first_tensor(header)["dtype"] = "F16"  # the random model is float32
    return header


def overlap(header: dict) -> dict:
    # Same shape and dtype, so every size still matches: only the tiling check sees that the
    # embedding now shares its bytes with lm_head.
    header["model.embed_tokens.weight"]["data_offsets"] = header["lm_head.weight"]["data_offsets"]
    return header


def drop_offsets(header: dict) -> dict:
    del first_tensor(header)["data_offsets"]
    return header


def reverse_offsets(header: dict) -> dict:
    begin, end = first_tensor(header)["data_offsets"]
    first_tensor(header)["data_offsets"] = [end, begin]
    return header


# name -> (damage to the bytes of model.safetensors, word the one-line error must contain)
DAMAGES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "cut_last_100_bytes": (lambda b: b[:-100], "truncated"),
    "cut_to_5_bytes": (lambda b: b[:5], "truncated"),
    "empty": (lambda b: b"", "truncated"),
    "header_length_past_end": (lambda b: len(b).to_bytes(8, "little") + b[8:], "header length"),
    "header_length_zero": (lambda b: bytes(8) + b[8:], "header length"),
    "header_not_json": (lambda b: b[:8] + b"#" + b[9:], "not valid JSON"),
    "header_not_utf8": (lambda b: b[:8] + b"\xff" + b[9:], "not valid JSON"),
    "header_is_a_list": (edit_header(lambda h: list(h)), "not an object"),
    "offsets_disagree_with_shape": (edit_header(shrink_shape), "data_offsets"),
    "offsets_disagree_with_dtype": (edit_header(halve_dtype), "data_offsets"),
    "offsets_overlap": (edit_header(overlap), "overlap"),
    "offsets_missing": (edit_header(drop_offsets), "data_offsets"),
    "offsets_reversed": (edit_header(reverse_offsets), "out of order"),
    "trailing_bytes": (lambda b: b + bytes(3), "trailing"),
    "git_lfs_pointer": (lambda b: b"version https://git-lfs.github.com/spec/v1\n"
                                  b"oid sha256:0\nsize 1\n", "Git LFS"),
}


def assert_one_line_error(err: pytest.ExceptionInfo[ValueError], path: Path, word: str) -> None:
    message = str(err.value)
    assert "\n" not in message, message
    assert str(path) in message, message
    assert word in message, message


def test_good_directory_passes(random_model_dir: Path) -> None:
    check_model_dir(random_model_dir)


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_damaged_safetensors_refused(random_model_dir: Path, tmp_path: Path, kind: str) -> None:
    damage, word = DAMAGES[kind]
    model = copy_model(random_model_dir, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ValueError, match="safetensors") as err:
        check_model_dir(model)
    assert_one_line_error(err, weights, word)


@pytest.mark.parametrize(("dtype", "offsets", "word"), [
    ("F4", [0, 3], None),              # unknown dtype: any span passes the size check
    ("F4", [3, 0], "out of order"),    # ... but not bad bounds
    ("F32", [0, 3], "data_offsets"),   # 2 x F32 needs 8 bytes, not 3
    ("F32", [0, True], "two integers"),
])
def test_dtypes(tmp_path: Path, dtype: str, offsets: list[int], word: str | None) -> None:
    path = tmp_path / "one.safetensors"
    path.write_bytes(join({"__metadata__": {"format": "pt"},
                           "t": {"dtype": dtype, "shape": [2], "data_offsets": offsets}},
                          bytes(3)))
    if word is None:
        check_safetensors_header(path)
        return
    with pytest.raises(ValueError) as err:
        check_safetensors_header(path)
    assert_one_line_error(err, path, word)


@pytest.mark.parametrize(("text", "word"), [
    (b"{ not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[]", "not an object"),
    (b'{"model_type": "llama", "num_attention_heads": null}', "bad field value"),
])
def test_bad_config_refused(random_model_dir: Path, tmp_path: Path, text: bytes,
                            word: str) -> None:
    model = copy_model(random_model_dir, tmp_path)
    (model / "config.json").write_bytes(text)
    with pytest.raises(ValueError) as err:
        check_model_dir(model)
    assert_one_line_error(err, model / "config.json", word)


def test_missing_file_is_still_file_not_found(random_model_dir: Path, tmp_path: Path) -> None:
    model = copy_model(random_model_dir, tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing model\.safetensors"):
        check_model_dir(model)


def test_draft_dir(tmp_path: Path) -> None:
    """An EAGLE head directory: no tokenizer needed, the same config and header checks."""
    check_draft_dir(fixtures_root() / "tiny-code-eagle")
    draft = Path(shutil.copytree(fixtures_root() / "tiny-code-eagle", tmp_path / "eagle"))
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError) as err:
        check_draft_dir(draft)
    assert_one_line_error(err, weights, "truncated")
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"draft model directory .* model\.safetensors"):
        check_draft_dir(draft)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_truncation_refused(random_model_dir: Path, tmp_path: Path,
                                  data: st.DataObject) -> None:
    good = (random_model_dir / "model.safetensors").read_bytes()
    cut = data.draw(st.integers(min_value=0, max_value=len(good) - 1), label="kept bytes")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(good[:cut])
    with pytest.raises(ValueError) as err:
        check_safetensors_header(weights)
    assert_one_line_error(err, weights, "corrupt safetensors")


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_header_byte_changes_never_escape(random_model_dir: Path, tmp_path: Path,
                                          data: st.DataObject) -> None:
    """A changed header byte either leaves a consistent header or gives the one-line
    ValueError: never another exception type (that would reach the CLI as a traceback)."""
    good = (random_model_dir / "model.safetensors").read_bytes()
    end = 8 + int.from_bytes(good[:8], "little")
    where = data.draw(st.integers(min_value=0, max_value=end - 1), label="byte")
    damaged = bytearray(good)
    damaged[where] = data.draw(st.integers(min_value=0, max_value=255), label="value")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(damaged))
    try:
        check_safetensors_header(weights)
    except ValueError as err:
        assert "\n" not in str(err) and str(weights) in str(err), str(err)


# --- through the CLI, and for a bundled fixture -----------------------------------------------


@pytest.mark.parametrize(("name", "content", "word"), [
    ("model.safetensors", b"\x10\0\0\0\0\0\0\0{}", "truncated"),
    ("config.json", b"{ not json", "not valid JSON"),
], ids=["truncated-weights", "config-not-json"])
def test_certify_refuses_damaged_model(capsys: pytest.CaptureFixture[str],
                                       random_model_dir: Path, tmp_path: Path, name: str,
                                       content: bytes, word: str) -> None:
    model = copy_model(random_model_dir, tmp_path)
    (model / name).write_bytes(content)
    code = main(["certify", "--model", str(model), "-n", "0", "--report", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(model / name) in err and word in err, err


@pytest.fixture
def fixture_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fixtures root holding MANIFEST.json and a copy of ``tiny-code``: safe to damage."""
    root = tmp_path / "fixtures"
    shutil.copytree(fixtures_root() / FIXTURE, root / FIXTURE)
    shutil.copy(fixtures_root() / "MANIFEST.json", root / "MANIFEST.json")
    monkeypatch.setattr(refengine.data, "fixtures_root", lambda: root)
    return root


def test_fixture_copy_passes(fixture_copy: Path) -> None:
    """Positive control for the damaged-fixture tests below."""
    path = resolve_model_dir(FIXTURE)
    assert path == fixture_copy / FIXTURE
    check_model_dir(path)


def test_damaged_fixture_refused_by_manifest(fixture_copy: Path) -> None:
    weights = fixture_copy / FIXTURE / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match="manifest hash mismatch") as err:
        resolve_model_dir(FIXTURE)
    assert f"{FIXTURE}/model.safetensors" in str(err.value)
    assert "\n" not in str(err.value)


def test_damaged_fixture_with_matching_manifest_refused_by_header(fixture_copy: Path) -> None:
    """A fixture built or re-hashed from an already damaged file passes the manifest; the
    header check behind it still refuses the file."""
    weights = fixture_copy / FIXTURE / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    manifest_path = fixture_copy / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest[f"{FIXTURE}/model.safetensors"] = sha256_file(weights)
    manifest_path.write_text(json.dumps(manifest))
    path = resolve_model_dir(FIXTURE)
    with pytest.raises(ValueError) as err:
        check_model_dir(path)
    assert_one_line_error(err, weights, "truncated")

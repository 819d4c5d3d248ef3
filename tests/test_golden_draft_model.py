"""Golden traces per draft head: a configuration drafting with another bundled head than the
suite's own (``--draft-model tiny-code-eagle-vllm``) has traces of its own under
``golden/<config>@<draft model>/``, and is never held to another head's."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from conformance.checks import golden
from conformance.cli import main
from conformance.plan.specs import SPECS, config_id
from refengine.data import fixtures_root, golden_root

VLLM_HEAD = "tiny-code-eagle-vllm"
CHAIN, CHAIN_S5 = SPECS["eagle"].configs
TREE = SPECS["eagle-tree"].configs[0]


def test_the_suite_heads_keep_their_directories() -> None:
    """Every configuration of the suite's specs, with its own draft model, keeps the directory
    it always had (overlap: its sequential twin's)."""
    for choice in SPECS.values():
        for config in choice.configs:
            if config is not None:
                twin = replace(config, overlap=False)
                assert golden.golden_path(config, "default") == (
                    golden_root() / config_id(twin) / "default.json")


def test_another_bundled_head_has_its_own_directory() -> None:
    config = replace(CHAIN, draft_model=VLLM_HEAD)
    assert golden.trace_dir_name(config) == f"chain-s3-n4@{VLLM_HEAD}"
    assert golden.golden_path(replace(config, overlap=True), "default-chunked") == (
        golden_root() / f"chain-s3-n4@{VLLM_HEAD}" / "default-chunked.json")


def test_a_head_that_is_not_bundled_has_no_traces(tmp_path: Path) -> None:
    config = replace(CHAIN, draft_model=str(tmp_path / "head"))
    with pytest.raises(ValueError, match="golden traces are kept for bundled fixtures only"):
        golden.load(config, "default")


def test_a_trace_of_another_head_is_refused(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace file in the directory of one head but recorded with another fails to load."""
    shutil.copytree(golden_root() / "chain-s3-n4", tmp_path / f"chain-s3-n4@{VLLM_HEAD}")
    monkeypatch.setattr(golden, "golden_root", lambda: tmp_path)
    with pytest.raises(ValueError, match="recorded with draft model 'tiny-code-eagle'"):
        golden.load(replace(CHAIN, draft_model=VLLM_HEAD), "default")


@pytest.mark.parametrize("config", [CHAIN, CHAIN_S5, TREE], ids=config_id)
@pytest.mark.parametrize("trace", ["default", "default-chunked", "default-sessions"])
def test_vllm_layout_head_traces_are_recorded(config, trace: str) -> None:  # type: ignore[no-untyped-def]
    """The EAGLE configurations have traces of ``tiny-code-eagle-vllm``, recorded with it."""
    loaded = golden.load(replace(config, draft_model=VLLM_HEAD), trace)
    assert loaded.spec.draft_model == VLLM_HEAD
    assert f"{VLLM_HEAD}/model.safetensors" in loaded.fixtures


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--spec", "all", "--draft-model", VLLM_HEAD], "needs one --spec"),
    (["--spec", "ngram", "--draft-model", VLLM_HEAD], "needs one --spec"),
    (["--spec", "eagle", "--draft-model", "no-such-head"], "no-such-head"),
])
def test_golden_draft_model_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str],
                                         needle: str) -> None:
    code, err = run(capsys, "golden", "check", *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_golden_draft_model_directory_is_refused(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """A head given as a directory is a fine draft model but names no traces."""
    head = shutil.copytree(fixtures_root() / VLLM_HEAD, tmp_path / "head")
    code, err = run(capsys, "golden", "check", "--spec", "eagle", "--draft-model", str(head))
    assert code == 2 and "bundled fixtures only" in err, err


@pytest.mark.slow
def test_refengine_reproduces_the_vllm_layout_head_trace() -> None:
    """What ``specgate golden check --spec eagle --draft-model tiny-code-eagle-vllm`` holds,
    for the first configuration's plain trace."""
    config = replace(CHAIN, draft_model=VLLM_HEAD)
    assert golden.record(config, "default").to_json() == golden.load(config, "default").to_json()

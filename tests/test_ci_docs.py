"""docs/ci.md cannot rot: the GitHub Actions workflow's own commands run here (every shard of
its matrix, the artifacts handed over as the runners would, then the merge), on a quick
selection added to the workflow's own ``CERTIFY_ARGS``; the GitLab equivalent's commands parse
and split the same way; the known-failures example parses."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conformance.cli import build_parser
from conformance.run.known_failures import load_known

DOC = Path(__file__).resolve().parent.parent / "docs" / "ci.md"
ROOT = DOC.parent.parent
# what the test adds to the workflow's CERTIFY_ARGS: a backend claiming plain decoding alone
# (so the default --spec claimed certifies one spec), the random model, six quick checks
NARROW = ("--backend tests.test_certify_selection:plain_only -n 0 "
          "-k 'test_max_new_tokens or test_stop_at_first_token'")


def blocks(language: str, heading: str) -> str:
    section = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)[0]


def substitute(text: str, values: dict[str, str]) -> str:
    """GitHub's ``${{ ... }}`` expressions, replaced as text before the shell reads the line."""
    def one(m: re.Match[str]) -> str:
        return values[m.group(1)]
    return re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", one, text)


def sh(line: str, cwd: Path, env: dict[str, str]) -> int:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, timeout=300).returncode


def shim(bin_dir: Path) -> None:
    """``specgate`` on PATH: this checkout's CLI in this interpreter."""
    bin_dir.mkdir()
    (bin_dir / "specgate").write_text(f'#!/bin/sh\nexec {sys.executable} -m conformance.cli "$@"\n')
    (bin_dir / "specgate").chmod(0o755)


def specgate_steps(job: dict[str, object]) -> list[dict[str, object]]:
    return [s for s in job["steps"] if str(s.get("run", "")).startswith("specgate ")]  # type: ignore[attr-defined]


def uploads(job: dict[str, object]) -> list[dict[str, str]]:
    return [s["with"] for s in job["steps"]  # type: ignore[attr-defined]
            if str(s.get("uses", "")).startswith("actions/upload-artifact")]


def test_the_github_workflow_runs(tmp_path: Path, random_model_dir: Path) -> None:
    flow = yaml.safe_load(blocks("yaml", "GitHub Actions"))
    certify, merge = flow["jobs"]["certify"], flow["jobs"]["merge"]
    assert merge["needs"] == "certify" and merge["if"] == "always()"
    shim(tmp_path / "bin")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}
    args = f"{flow['env']['CERTIFY_ARGS']} {NARROW} --model {random_model_dir}"
    artifacts = tmp_path / "artifacts"
    shards = certify["strategy"]["matrix"]["shard"]
    assert len(shards) > 1
    for shard in shards:
        runner = tmp_path / f"runner-{shard}"
        kf = runner / ".specgate" / "known-failures.toml"
        kf.parent.mkdir(parents=True)
        kf.write_text(blocks("toml", "Known failures"))
        values = {"matrix.shard": str(shard), "env.CERTIFY_ARGS": args}
        (step,) = specgate_steps(certify)
        assert step["continue-on-error"] is True
        assert sh(substitute(str(step["run"]), values), runner, env) == 0
        for upload in uploads(certify):
            shutil.copytree(runner / substitute(upload["path"], values),
                            artifacts / substitute(upload["name"], values))
    runner = tmp_path / "runner-merge"
    runner.mkdir()
    (download,) = [s["with"] for s in merge["steps"]
                   if str(s.get("uses", "")).startswith("actions/download-artifact")]
    for found in sorted(artifacts.glob(download["pattern"])):
        shutil.copytree(found, runner / found.name)  # one directory per artifact, by name
    (step,) = specgate_steps(merge)
    assert sh(str(step["run"]), runner, env) == 0
    (upload,) = uploads(merge)
    certificate = runner / upload["path"]
    assert (certificate / "summary.md").exists() and (certificate / "none" / "report.md").exists()
    (junit,) = [s["with"]["report_paths"] for s in merge["steps"]
                if "junit" in str(s.get("uses", ""))]
    assert glob.glob(str(runner / junit), recursive=True)
    md = (certificate / "none" / "report.md").read_text()
    assert "shard: `merged from 3 shards`" in md and "## Known failures" in md


def test_the_gitlab_pipeline_says_the_same(tmp_path: Path) -> None:
    pipeline = yaml.safe_load(blocks("yaml", "GitLab CI"))
    certify, gate = pipeline["certify"], pipeline["gate"]
    total = certify["parallel"]
    parser = build_parser()
    words = {"CERTIFY_ARGS": pipeline["variables"]["CERTIFY_ARGS"], "CI_NODE_TOTAL": str(total)}
    reports = []
    for index in range(1, total + 1):
        (line,) = certify["script"]
        values = {**words, "CI_NODE_INDEX": str(index)}
        expanded = re.sub(r"\$(\w+)", lambda m, v=values: v[m.group(1)], line)
        args = parser.parse_args(shlex.split(expanded)[1:])
        assert args.shard == f"{index}/{total}"
        reports.append(args.report)
    (line,) = gate["script"]
    merge = parser.parse_args(shlex.split(line)[1:])
    assert all(fnmatch.fnmatch(r, d) for r in reports for d in merge.dirs)
    assert gate["artifacts"]["paths"] == [merge.out]
    assert certify["artifacts"]["paths"] == merge.dirs


def test_the_known_failures_example_parses(tmp_path: Path) -> None:
    (tmp_path / "kf.toml").write_text(blocks("toml", "Known failures"))
    entries = load_known(tmp_path / "kf.toml")
    assert len(entries) == 2 and entries[1].spec == "eagle" and entries[1].expires is not None


@pytest.mark.parametrize("heading", ["GitHub Actions", "GitLab CI"])
def test_the_workflows_certify_every_claimed_spec(heading: str) -> None:
    """No --spec in the shards' commands: the gate checks every spec the backend claims."""
    assert "--spec" not in blocks("yaml", heading)

"""docs/ci.md cannot rot. The GitHub Actions workflow's own commands run here as a project that
installs specgate from its wheel would run them: the wheel built from this checkout and
installed outside it, every shard of the matrix in a directory of its own with a backend module
of its own, the artifacts handed over as the runners would, then the merge with torch and the
rest of the certify runtime unimportable (the merge job installs none of it). A shard's usage
error fails the shard, a failed check does not. The workflow's YAML holds together (permissions,
artifact names and paths, the guarded check run, what each job installs); the GitLab pipeline
says the same; the known-failures example names checks of the suite."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conformance.cli import build_parser
from conformance.run.known_failures import load_known
from tests.test_merge import A, B, cert_dir

DOC = Path(__file__).resolve().parent.parent / "docs" / "ci.md"
ROOT = DOC.parent.parent
SUITES = ROOT / "conformance" / "suites"
# what the test adds to the workflow's CERTIFY_ARGS: a backend claiming plain decoding alone
# (so the default --spec claimed certifies one spec), the random model, six quick checks
NARROW = ("--backend yourbackend:plain_only -n 0 "
          "-k 'test_max_new_tokens or test_stop_at_first_token'")
# what a shard's step adds after specgate's command: exit 1 passes, anything else fails
GO_ON = " || [ $? -eq 1 ]"
# the project's own backend, as `pip install .` would bring it: the reference engine claiming
# plain decoding alone
BACKEND = '''
from dataclasses import replace

from conformance.backends.refengine import RefEngineBackend


class PlainOnly(RefEngineBackend):
    def capabilities(self):
        return replace(super().capabilities(), algorithms=frozenset({"none"}))


def plain_only():
    return PlainOnly()
'''
# what specgate's runtime imports and the merge job does not install (it installs rich and
# matplotlib, which brings numpy): unimportable where the merge runs
NOT_IN_MERGE = ("torch", "scipy", "safetensors", "tokenizers", "pytest", "_pytest", "xdist",
                "hypothesis")
ENV = {"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Installed:
    """specgate's wheel, installed (without dependencies: this interpreter has them) into
    ``site``, its ``specgate`` executable in ``site/bin``."""

    wheel: Path
    site: Path

    def env(self, *paths: Path) -> dict[str, str]:
        """An environment whose ``specgate`` and ``import conformance`` are the installed
        ones, with ``paths`` before them on the import path; the checkout is on neither."""
        return {**os.environ, **ENV, "PATH": f"{self.site / 'bin'}:{os.environ['PATH']}",
                "PYTHONPATH": ":".join(str(p) for p in (*paths, self.site))}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel built from a copy of this checkout (setuptools writes into the tree it
    builds), installed outside it."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".tox", "__pycache__", "build", "dist", "*.egg-info", ".hypothesis",
        ".ruff_cache", "specgate-report*"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"),
                    str(source)], check=True, timeout=300)
    (wheel,) = (work / "dist").glob("specgate-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(work / "site"),
                    str(wheel)], check=True, timeout=300)
    return Installed(wheel, work / "site")


def blocks(language: str, heading: str) -> str:
    section = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)[0]


def github() -> dict[str, object]:
    return yaml.safe_load(blocks("yaml", "GitHub Actions"))


def substitute(text: str, values: dict[str, str]) -> str:
    """GitHub's ``${{ ... }}`` expressions, replaced as text before the shell reads the line."""
    def one(m: re.Match[str]) -> str:
        return values[m.group(1)]
    return re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", one, text)


def sh(line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A ``run:`` step as GitHub's runner runs it (``bash -e``)."""
    return subprocess.run(["bash", "-e", "-c", line], cwd=cwd, env=env, timeout=300,
                          capture_output=True, text=True)


def unimportable(where: Path, names: tuple[str, ...]) -> Path:
    """A directory that, first on the import path, makes each of ``names`` fail to import as a
    package that is not installed does."""
    for name in names:
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not installed here')\n")
    return where


def steps(job: dict[str, object], prefix: str) -> list[dict[str, object]]:
    return [s for s in job["steps"] if str(s.get("run", "")).startswith(prefix)]  # type: ignore[attr-defined]


def uses(job: dict[str, object], action: str) -> list[dict[str, object]]:
    return [s for s in job["steps"]  # type: ignore[attr-defined]
            if str(s.get("uses", "")).startswith(action)]


def pip_lines(job: dict[str, object]) -> list[str]:
    return [str(s["run"]) for s in steps(job, "pip install")]


def project(where: Path) -> Path:
    """A runner's checkout: the project's backend module and its known-failures file."""
    where.mkdir(parents=True)
    (where / "yourbackend.py").write_text(BACKEND)
    (where / ".specgate").mkdir()
    (where / ".specgate" / "known-failures.toml").write_text(blocks("toml", "Known failures"))
    return where


def certify_line(flow: dict[str, object], shard: int, narrow: str, model: Path) -> str:
    (step,) = steps(flow["jobs"]["certify"], "specgate ")  # type: ignore[index]
    args = f"{flow['env']['CERTIFY_ARGS']} {narrow} --model {model}"  # type: ignore[index]
    return substitute(str(step["run"]), {"matrix.shard": str(shard), "env.CERTIFY_ARGS": args})


def test_the_github_workflow_runs_from_the_installed_wheel(
        tmp_path: Path, random_model_dir: Path, installed: Installed) -> None:
    flow = github()
    certify, merge = flow["jobs"]["certify"], flow["jobs"]["merge"]  # type: ignore[index]
    artifacts = tmp_path / "artifacts"
    shards = certify["strategy"]["matrix"]["shard"]
    assert len(shards) > 1
    for shard in shards:
        runner = project(tmp_path / f"runner-{shard}")
        env = installed.env(runner)
        where = sh(f"{sys.executable} -c 'import conformance; print(conformance.__file__)'",
                   runner, env)
        assert where.stdout.startswith(str(installed.site)), where
        done = sh(certify_line(flow, shard, NARROW, random_model_dir), runner, env)
        assert done.returncode == 0, done.stderr
        assert f"summary: specgate-shard-{shard}/summary.md" in done.stdout
        for upload in uses(certify, "actions/upload-artifact"):
            values = {"matrix.shard": str(shard)}
            shutil.copytree(runner / substitute(upload["with"]["path"], values),  # type: ignore[index]
                            artifacts / substitute(upload["with"]["name"], values))  # type: ignore[index]
    runner = tmp_path / "runner-merge"
    runner.mkdir()
    (download,) = uses(merge, "actions/download-artifact")
    for found in sorted(artifacts.glob(download["with"]["pattern"])):  # type: ignore[index]
        shutil.copytree(found, runner / found.name)  # one directory per artifact, by name
    (step,) = steps(merge, "specgate ")
    env = installed.env(unimportable(tmp_path / "not-installed", NOT_IN_MERGE))
    done = sh(str(step["run"]), runner, env)
    assert done.returncode == 0, done.stderr
    (upload,) = uses(merge, "actions/upload-artifact")
    assert done.stdout.splitlines()[-1] == f"summary: {upload['with']['path']}/summary.md"  # type: ignore[index]
    certificate = runner / upload["with"]["path"]  # type: ignore[index]
    assert (certificate / "summary.md").exists() and (certificate / "none" / "report.md").exists()
    (junit,) = uses(merge, "mikepenz/action-junit-report")
    assert glob.glob(str(runner / junit["with"]["report_paths"]), recursive=True)  # type: ignore[index]
    md = (certificate / "none" / "report.md").read_text()
    assert "shard: `merged from 3 shards`" in md and "## Known failures" in md


def test_a_shards_usage_error_fails_it_a_failed_check_does_not(
        tmp_path: Path, random_model_dir: Path, installed: Installed) -> None:
    """Exit 2 (here: the known-failures file is missing) fails the shard's step, with
    specgate's line in its log; exit 1 (a check failed) lets the certificate go on to the
    merge."""
    flow = github()
    runner = project(tmp_path / "runner")
    (runner / ".specgate" / "known-failures.toml").write_text("[known-failures]\n")
    env = installed.env(runner)
    failing = ("--backend mutant:ignores_stop_token_ids --spec none -n 0 "
               "-k test_stop_at_first_token")
    done = sh(certify_line(flow, 1, failing, random_model_dir), runner, env)
    assert done.returncode == 0, done.stderr
    assert "FAILED test_lifecycle.py::test_stop_at_first_token" in done.stdout
    assert (runner / "specgate-shard-1" / "report.json").exists()
    (runner / ".specgate" / "known-failures.toml").unlink()
    done = sh(certify_line(flow, 2, NARROW, random_model_dir), runner, env)
    assert done.returncode != 0
    assert "specgate: error: --known-failures" in done.stderr
    assert not (runner / "specgate-shard-2").exists()


def github_if(expression: str, context: dict[str, str]) -> bool:
    """A step's ``if:`` as GitHub evaluates it, for the operators the workflow uses."""
    python = expression.replace("&&", " and ").replace("||", " or ").replace("always()", "True")
    python = re.sub(r"\bgithub(?:\.\w+)+", lambda m: repr(context[m.group(0)]), python)
    return bool(eval(python, {"__builtins__": {}}))


def test_the_github_workflow_holds_together() -> None:
    flow = github()
    certify, merge = flow["jobs"]["certify"], flow["jobs"]["merge"]  # type: ignore[index]
    parser = build_parser()
    # the merge runs once every shard job succeeded: a shard's usage error stops the run there
    assert merge["needs"] == "certify" and "if" not in merge
    # permissions replace the defaults: the checkout needs contents: read
    assert merge["permissions"] == {"contents": "read", "checks": "write"}
    shards = certify["strategy"]["matrix"]["shard"]
    (step,) = steps(certify, "specgate ")
    assert "continue-on-error" not in step and str(step["run"]).endswith(GO_ON)
    reports = [parser.parse_args(shlex.split(
        certify_line(flow, s, "", Path("m")).removesuffix(GO_ON))[1:]) for s in shards]
    assert [r.shard for r in reports] == [f"{s}/{len(shards)}" for s in shards]
    (upload,) = uses(certify, "actions/upload-artifact")
    assert upload["with"]["if-no-files-found"] == "error"  # type: ignore[index]
    names = [substitute(upload["with"]["name"], {"matrix.shard": str(s)}) for s in shards]  # type: ignore[index]
    paths = [substitute(upload["with"]["path"], {"matrix.shard": str(s)}) for s in shards]  # type: ignore[index]
    assert paths == [r.report for r in reports]
    (download,) = uses(merge, "actions/download-artifact")
    assert fnmatch.filter(names, download["with"]["pattern"]) == names  # type: ignore[index]
    (line,) = steps(merge, "specgate ")
    merged = parser.parse_args(shlex.split(str(line["run"]))[1:])
    assert merged.action == "merge" and all(fnmatch.filter(names, d) == names
                                            for d in merged.dirs)
    (final,) = uses(merge, "actions/upload-artifact")
    assert final["with"]["path"] == merged.out  # type: ignore[index]
    (junit,) = uses(merge, "mikepenz/action-junit-report")
    assert junit["with"]["report_paths"] == f"{merged.out}/**/junit.xml"  # type: ignore[index]
    repo = "me/backend"
    for event, head, writes in (("push", "", True), ("pull_request", repo, True),
                                ("pull_request", "fork/backend", False)):
        context = {"github.event_name": event, "github.repository": repo,
                   "github.event.pull_request.head.repo.full_name": head}
        assert github_if(str(junit["if"]), context) is writes, (event, head)


@pytest.mark.parametrize("heading", ["GitHub Actions", "GitLab CI"])
def test_what_each_job_installs(heading: str) -> None:
    """A shard: torch's CPU build, then specgate's wheel with the plot, then the project; the
    merge: the wheel without dependencies and none of what it runs without."""
    if heading == "GitHub Actions":
        flow = github()
        shard, merge = (pip_lines(flow["jobs"][j]) for j in ("certify", "merge"))  # type: ignore[index]
        wheel = str(flow["env"]["SPECGATE_WHEEL"])  # type: ignore[index]
    else:
        pipeline = yaml.safe_load(blocks("yaml", heading))
        shard, merge = (pipeline[j]["before_script"] for j in ("certify", "gate"))
        wheel = pipeline["variables"]["SPECGATE_WHEEL"]
    assert fnmatch.fnmatch(Path(wheel).name, "specgate-*-py3-none-any.whl")
    assert shard == ["pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
                     'pip install "${SPECGATE_WHEEL}[plots]"', "pip install ."]
    assert merge[0] == 'pip install --no-deps "${SPECGATE_WHEEL}"'
    assert not any(re.search(rf"\b{m}\b", line) for line in merge for m in NOT_IN_MERGE)


def test_the_wheel_the_workflows_name_is_the_one_built(installed: Installed) -> None:
    assert Path(str(github()["env"]["SPECGATE_WHEEL"])).name == installed.wheel.name  # type: ignore[index]


def test_merge_imports_no_torch(tmp_path: Path) -> None:
    """``specgate report merge`` through the CLI's own entry, torch and the rest of the certify
    runtime unimportable."""
    one = cert_dir(tmp_path / "s1", "none", A, shard="1/2")
    two = cert_dir(tmp_path / "s2", "none", B, shard="2/2")
    blocked = ", ".join(repr(m) for m in NOT_IN_MERGE)
    code = (f"import sys; sys.modules.update(dict.fromkeys(({blocked},)))\n"
            "from conformance.cli import main\n"
            f"sys.exit(main(['report', 'merge', {str(one)!r}, {str(two)!r}, '--out', "
            f"{str(tmp_path / 'out')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **ENV})
    assert done.returncode == 1, done.stderr  # test_a.py::two failed
    assert "Traceback" not in done.stderr and (tmp_path / "out" / "report.md").exists()


def test_the_gitlab_pipeline_says_the_same() -> None:
    pipeline = yaml.safe_load(blocks("yaml", "GitLab CI"))
    certify, gate = pipeline["certify"], pipeline["gate"]
    assert certify["allow_failure"] == {"exit_codes": [1]} and "when" not in gate
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
    assert gate["artifacts"]["reports"]["junit"] == f"{merge.out}/**/junit.xml"
    assert certify["artifacts"]["paths"] == merge.dirs


def test_the_known_failures_example_names_checks_of_the_suite(tmp_path: Path) -> None:
    (tmp_path / "kf.toml").write_text(blocks("toml", "Known failures"))
    entries = load_known(tmp_path / "kf.toml", SUITES)
    assert len(entries) == 2 and entries[1].spec == "eagle" and entries[1].expires is not None


@pytest.mark.parametrize("heading", ["GitHub Actions", "GitLab CI"])
def test_the_workflows_certify_every_claimed_spec(heading: str) -> None:
    """No --spec in the shards' commands: the gate checks every spec the backend claims."""
    assert "--spec" not in blocks("yaml", heading)

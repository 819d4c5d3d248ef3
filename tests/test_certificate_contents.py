"""The certificate says what was certified: backend and version, every configuration's
parameters, the declared precision, τ per configuration, near-ties, and acceptance.png."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conformance.contract import Capabilities
from conformance.plan.run_plan import RunPlan
from conformance.plan.specs import SPECS
from conformance.report.certificate import build_certificate
from conformance.report.certified import accept_histogram, config_of, config_record
from conformance.report.markdown import render_markdown, write_reports
from conformance.report.report_dir import ReportDir
from conformance.report.results import BackendIdentity, CheckRow, JsonValue, RunResults
from conformance.report.results_json import read_results
from conformance.run.suite import SuiteOptions, suite_args

CONFIGS = [config_record(c) for c in SPECS["eagle"].configs]


def check(nodeid: str, tier: str, **figures: JsonValue) -> CheckRow:
    return CheckRow(nodeid, tier, "passed", 0.5, "algorithm:eagle", "", figures)


RESULTS = RunResults(
    BackendIdentity("b", "2.1", "pkg:b"), Capabilities(algorithms=frozenset({"eagle"})),
    "eagle", "gate", configurations=tuple(CONFIGS), precision="bfloat16", case_timeout=300.0,
    checks=(
        check("test_lossless.py::test_greedy_matches_reference[chain-s3-n4-batch-1]", "lossless",
              tau=2.0, near_ties=["r1: index 5 (margin 2e-4)"]),
        check("test_lossless.py::test_greedy_matches_reference[chain-s3-n4-batch-4]", "lossless",
              tau=3.0),
        check("test_lossless.py::test_greedy_matches_reference[chain-s5-n6-batch-1]", "lossless",
              tau=4.5),
        check("test_golden.py::test_acceptance_matches_golden[chain-s3-n4]", "golden",
              mean_tau=2.5, golden_mean_tau=2.6, accept_hist={"1": 3, "2": 1, "4": 4},
              golden_accept_hist={"1": 2, "2": 2, "4": 4}),
        check("test_memory.py::test_invariants_under_pressure[1]", "memory", retractions=4),
    ))


def test_report_json_has_what_was_certified(tmp_path: Path) -> None:
    write_reports(build_certificate(RESULTS), tmp_path)
    cert = json.loads((tmp_path / "report.json").read_text())
    assert cert["backend"]["name"] == "b" and cert["backend"]["version"] == "2.1"
    assert cert["precision"] == "bfloat16" and cert["case_timeout"] == 300.0
    first, second = cert["configurations"]
    assert first["id"] == "chain-s3-n4" and first["parameters"] == {
        "algorithm": "eagle", "draft_model": "tiny-code-eagle", "num_steps": 3, "topk": 1,
        "num_draft_tokens": 4, "overlap": False}
    assert (first["tau"], first["tau_checks"]) == (2.5, 2)
    assert (first["golden_tau"], first["golden_reference_tau"]) == (2.5, 2.6)
    assert first["accept_hist"] == {"1": 3, "2": 1, "4": 4}
    assert (second["tau"], second["golden_tau"], second["accept_hist"]) == (4.5, None, {})
    assert cert["near_ties"] == [{"check": RESULTS.checks[0].nodeid,
                                  "near_tie": "r1: index 5 (margin 2e-4)"}]


def test_report_md_shows_it_and_acceptance_png_is_beside_it(tmp_path: Path) -> None:
    write_reports(build_certificate(RESULTS), tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "- backend: `b` version `2.1`" in md
    assert "- precision the backend declares: `bfloat16`" in md
    assert "- case timeout: 300 s per phase of a check" in md
    assert ("| `chain-s3-n4` | eagle | tiny-code-eagle | 3 | 1 | 4 | False | 2.5 (2) | "
            "2.5 / 2.6 |") in md
    assert "| `chain-s5-n6` | eagle | tiny-code-eagle | 5 | 1 | 6 | False | 4.5 (1) | — |" in md
    assert "- near-ties: 1" in md and "r1: index 5 (margin 2e-4)" in md
    assert ("![accept-length histogram and per-position acceptance, backend vs golden]"
            "(acceptance.png)") in md
    # shares per accept length 1..4, then per draft position 1..3 (S = 3): at least 1, 2, 3
    # drafts accepted of 8 verify steps, backend 5, 4, 4 and golden 6, 4, 4
    assert ("| `chain-s3-n4` | 8 / 8 | 0.38 0.12 0.00 0.50 | 0.25 0.25 0.00 0.50 | "
            "0.62 0.50 0.50 | 0.75 0.50 0.50 |") in md
    assert "| `test_memory.py::test_invariants_under_pressure[1]` | 4 |" in md
    assert "accept_hist" not in md  # shown as a chart, not a figure
    assert (tmp_path / "acceptance.png").read_bytes().startswith(b"\x89PNG")
    ReportDir(tmp_path).discard()  # a report directory holding acceptance.png is certify's own


def test_no_golden_tier_no_chart() -> None:
    cert = build_certificate(replace(RESULTS, checks=RESULTS.checks[:3]))
    assert not cert.acceptance_panels and cert.plot_skipped is None  # nothing to draw
    assert "No accept-length histogram: the golden tier did not run" in render_markdown(cert)


def test_without_matplotlib_the_plot_is_skipped_and_the_certificate_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    cert = build_certificate(RESULTS)
    assert cert.plot_skipped and "pip install 'specgate[plots]'" in cert.plot_skipped
    write_reports(cert, tmp_path)
    assert not (tmp_path / "acceptance.png").exists()
    md = (tmp_path / "report.md").read_text()
    (line,) = [m for m in md.splitlines() if m.startswith("`acceptance.png` skipped: ")]
    assert "matplotlib is not available" in line and "specgate[plots]" in line
    assert "](acceptance.png)" not in md
    assert "| `chain-s3-n4` | 8 / 8 | 0.38 0.12 0.00 0.50 |" in md  # the numbers stay
    assert json.loads((tmp_path / "report.json").read_text())["plot_skipped"] == cert.plot_skipped


def test_a_check_belongs_to_the_configuration_its_id_starts_with() -> None:
    ids = ["chain-s3-n4", "chain-s3-n4-v2", "tree-s3-k4-n8-v2"]
    assert config_of("t.py::f[chain-s3-n4-v2-batch-1]", ids) == "chain-s3-n4-v2"
    assert config_of("t.py::f[chain-s3-n4-1]", ids) == "chain-s3-n4"
    assert config_of("t.py::f[tree-s3-k4-n8-v2]", ids) == "tree-s3-k4-n8-v2"
    assert config_of("t.py::f[1]", ids) is None and config_of("t.py::f", ids) is None
    assert accept_histogram([[1, 4, 4], [2]]) == {"1": 1, "2": 1, "4": 2}


def test_the_plugin_records_the_configurations_and_precision(
        tmp_path: Path, random_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    results = tmp_path / "results.json"
    opts = SuiteOptions(RunPlan("refengine", ("none",), model=str(random_model_dir)))
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main([*suite_args(opts, results, None), "-k", "test_max_new_tokens"])
    written = json.loads(results.read_text())
    assert written["configurations"] == [{"id": "plain", "algorithm": "none"}]
    assert written["precision"] == "float32" and written["case_timeout"] == 300.0
    md = render_markdown(build_certificate(read_results(results)))
    assert "| `plain` | none | — | — | — | — | — | — | — |" in md


def test_the_environment_on_the_cpu(tmp_path: Path) -> None:
    """A CPU run records device "cpu", no CUDA or driver version, the dtype and torch's TF32
    settings, in report.json and report.md."""
    from conformance.report.environment import run_environment

    env = run_environment("cpu", "bfloat16", driver=lambda: pytest.fail("no driver on a CPU"))
    assert env["device"] == "cpu" and env["cuda"] is None and env["driver"] is None
    assert env["dtype"] == "bfloat16"
    assert isinstance(env["tf32_matmul"], bool) and isinstance(env["tf32_cudnn"], bool)
    assert env["float32_matmul_precision"] in ("highest", "high", "medium")
    write_reports(build_certificate(replace(RESULTS, device="cpu", environment=env)), tmp_path)
    cert = json.loads((tmp_path / "report.json").read_text())
    assert cert["device"] == "cpu"
    assert {k: cert["environment"][k] for k in env} == env
    assert cert["environment"]["threads per check"] == "unknown"  # the old entries stay
    md = (tmp_path / "report.md").read_text()
    assert "graphs: `off`, device: `cpu`" in md
    assert "- cuda: none" in md and "- driver: none" in md and "- dtype: bfloat16" in md


def test_the_environment_on_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from conformance.report.environment import run_environment

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU {device}")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    env = run_environment("cuda:0", "float32", driver=lambda: "570.1")
    assert (env["device"], env["cuda"], env["driver"]) == ("GPU cuda:0", "12.8", "570.1")


def test_the_driver_version_without_nvidia_smi() -> None:
    import subprocess

    from conformance.report.environment import driver_version

    def missing(*_: object, **__: object) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError("nvidia-smi")

    def answers(code: int, text: str):  # type: ignore[no-untyped-def]
        return lambda argv, **_: subprocess.CompletedProcess(argv, code, text, "")

    assert driver_version(missing) == "unknown"
    assert driver_version(answers(0, "570.124.06\n570.124.06\n")) == "570.124.06"
    assert driver_version(answers(9, "570.124.06\n")) == "unknown"
    assert driver_version(answers(0, "\n")) == "unknown"


def test_an_interrupted_run_marks_the_tiers_it_cut_short() -> None:
    """A tier whose checks did not all finish is "incomplete" with how many did not run, never
    "passed"; one that finished whole keeps its status; one that never started is listed."""
    from conformance.report.markdown import tier_table
    from tests.test_merge import results

    res = results("none", [("test_lossless.py::a", "passed", 1.0),
                           ("test_lossless.py::b", "passed", 1.0),
                           ("test_fuzz.py::c", "passed", 1.0)],
                  interrupted=True, collected={"lossless": 5, "fuzz": 1, "memory": 3})
    cert = build_certificate(res)
    status = {t.tier: t.status for t in cert.tiers}
    assert status == {"fuzz": "passed", "lossless": "incomplete", "memory": "incomplete"}
    lossless = next(t for t in cert.tiers if t.tier == "lossless")
    assert lossless.not_run == {"incomplete: the run was interrupted before they finished": 3}
    assert cert.status == "incomplete"
    assert "| lossless | 2 of 2 |" in tier_table(cert)
    # a run that was not interrupted ignores what was collected
    whole = build_certificate(replace(res, interrupted=False))
    assert {t.tier for t in whole.tiers} == {"fuzz", "lossless"}

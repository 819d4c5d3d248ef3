"""Long contexts: a backend that goes wrong only once a request's context passes 512 tokens
passes every short check and fails the checks that cross the boundary, and certify with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rewriting_backend import RewritingBackend
from test_plugin import run_suite

from conformance.cli import main
from conformance.contract import Request
from conformance.plan.prompts import long_prompt
from conformance.plan.requests import BOUNDARY_LEAD, context_limit, requests_across

pytest_plugins = ["pytester"]

BOUNDARY = 512


def wrong_past_512(req: Request, index: int, token: int) -> int:
    """Change the first output token that takes the context past ``BOUNDARY``."""
    return token + 1 if index == max(0, BOUNDARY - len(req.prompt_ids)) else token


def breaks_past_512() -> RewritingBackend:
    return RewritingBackend("breaks-past-512", wrong_past_512)


def test_long_prompts_are_deterministic_slices_of_the_bundled_prompts() -> None:
    whole = long_prompt(3000)
    assert long_prompt(3000) == whole and len(whole) == 3000
    assert long_prompt(100, offset=40) == whole[40:140]


def test_long_requests_cross_the_boundary_or_end_at_the_limit() -> None:
    limit = context_limit("tiny-code")
    crossing = requests_across("tiny-code", BOUNDARY)
    for prompt, params in crossing.values():
        assert len(prompt) < BOUNDARY < len(prompt) + params.max_new_tokens or (
            len(prompt) > BOUNDARY), (len(prompt), params.max_new_tokens)
    assert any(len(p) < BOUNDARY for p, _ in crossing.values())
    assert any(len(p) > BOUNDARY for p, _ in crossing.values())
    (prompt, params), = requests_across("tiny-code", limit).values()
    assert len(prompt) == limit - BOUNDARY_LEAD < limit < len(prompt) + params.max_new_tokens


def test_a_bug_past_512_tokens_fails_only_the_long_checks(pytester: pytest.Pytester) -> None:
    (pytester.path / "none.ini").write_text("[pytest]\n")
    _, results = run_suite(pytester, "tests.test_long_context:breaks_past_512", Path("tiny-code"),
                           "--specgate-profile", "gate", "-k",
                           "plain-batch-1 or plain-ctx512-no-retract")
    outcomes = {c["nodeid"].split("::")[1]: c["outcome"] for c in results["checks"]}
    long = {k: v for k, v in outcomes.items() if "past_context_boundary" in k}
    short = {k: v for k, v in outcomes.items() if k not in long}
    assert long and set(long.values()) == {"failed"}, outcomes
    assert short and set(short.values()) == {"passed"}, outcomes
    messages = [c["message"] for c in results["checks"] if c["outcome"] == "failed"]
    assert all("across-512" in m and "first divergence" in m for m in messages), messages


@pytest.mark.slow
def test_certify_gate_fails_a_bug_past_512_tokens(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    code = main(["certify", "--backend", "tests.test_long_context:breaks_past_512",
                 "--spec", "eagle", "--profile", "gate", "-n", "0", "--report", str(tmp_path)])
    capsys.readouterr()
    assert code == 1
    report = json.loads((tmp_path / "report.json").read_text())
    failed = [f["check"] for t in report["tiers"] for f in t["failures"]]
    assert failed and all("past_context_boundary" in f for f in failed), failed
    assert {f.split("::")[0] for f in failed} == {"test_lossless.py", "test_memory.py"}, failed

"""The suite's pytest options (``--specgate-*``) and markers, added by the plugin
(``conformance.run.plugin``), and the run plan a session takes from the options (``plan_of``).

``specgate certify`` and ``specgate mutants`` hand a session its plan whole, validated, as
``--specgate-plan FILE`` (``conformance.run.suite``); a plain pytest run gives the individual
options, which ``plan_of`` validates through the same ``build_plan``. Importing this module
imports no torch and no engine: the plugin adds these options to every pytest session of an
environment where specgate is installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conformance.plan.arguments import timeout_help
from conformance.plan.device import DEVICE_HELP
from conformance.plan.profiles import PROFILES
from conformance.plan.run_plan import RunPlan, build_plan
from conformance.plan.usage import UsageError

DEFAULT_BACKEND = "refengine"
# A check of the suite itself, reported apart from the backend's checks (its row's "self_check").
SELF_CHECK_MARK = "specgate_self_check"
_PLAN = pytest.StashKey[RunPlan]()


def add_suite_options(parser: pytest.Parser) -> None:
    from refengine.graph.executors import EXECUTORS

    group = parser.getgroup("specgate", "specgate conformance suite")
    group.addoption("--specgate-plan", default=None, metavar="FILE",
                    help="the run's plan as specgate certify writes it (JSON); it replaces "
                         "every run option below (backend to case timeout)")
    group.addoption("--specgate-backend", default=None,
                    help="backend under test: an entry-point name (refengine, hf, "
                         "ctranslate2) or module:factory; default $SPECGATE_BACKEND or refengine")
    group.addoption("--specgate-spec", default="none",
                    help="speculative configuration to certify (a spec name; all or claimed: "
                         "the first of those)")
    group.addoption("--specgate-profile", default="gate", choices=sorted(PROFILES),
                    help="gate: quick CI subset; full: every configuration")
    group.addoption("--specgate-model", default="tiny-code",
                    help="target model: a fixture name or an HF-format directory")
    group.addoption("--specgate-draft-model", default=None,
                    help="override the spec configurations' draft model (fixture or directory)")
    group.addoption("--specgate-graphs", default=None, choices=list(EXECUTORS),
                    help="run the backend's forwards through its graph runner with this "
                         "executor (backends claiming graph_runner)")
    group.addoption("--specgate-device", default="cpu", help=DEVICE_HELP)
    group.addoption("--specgate-case-timeout", default=None, type=float,
                    help="seconds each phase of a check may take before it fails (0: no "
                         f"limit); default by profile: {timeout_help('--specgate-graphs')}")
    group.addoption("--specgate-results", default=None,
                    help="write per-check results (JSON) here")
    group.addoption("--specgate-repro-dir", default=None,
                    help="a failing check writes its scenario to repro/<check-id>.json here "
                         "(the report directory); unset: no repro files")


def add_suite_markers(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "specgate_tier(name): the suite tier a check belongs to")
    config.addinivalue_line("markers", "specgate_requires(*capabilities): capabilities the "
                            "backend must claim (flags, or 'algorithm:<name>')")
    config.addinivalue_line("markers", "slow: long-running check")
    config.addinivalue_line("markers", f"{SELF_CHECK_MARK}: a check of the suite itself (its "
                            "power, its derivations) that exercises no part of the backend: "
                            "reported apart, never counted as the backend's pass")


def asks_for_suite(config: pytest.Config) -> bool:
    """Whether this session runs the suite by its options: a plan, a backend (the option or
    $SPECGATE_BACKEND) or a results file."""
    return bool(config.getoption("--specgate-plan") or config.getoption("--specgate-backend")
                or os.environ.get("SPECGATE_BACKEND") or config.getoption("--specgate-results"))


def _asked(config: pytest.Config) -> RunPlan:
    return RunPlan(config.getoption("--specgate-backend") or os.environ.get("SPECGATE_BACKEND")
                   or DEFAULT_BACKEND, profile=config.getoption("--specgate-profile"),
                   model=config.getoption("--specgate-model"),
                   draft_model=config.getoption("--specgate-draft-model") or None,
                   device=config.getoption("--specgate-device"),
                   case_timeout=config.getoption("--specgate-case-timeout"))


def plan_of(config: pytest.Config) -> RunPlan:
    """The session's run plan, once per process: the ``--specgate-plan`` file, or the plan the
    individual options make, validated (``build_plan``) and narrowed to its first spec."""
    plan = config.stash.get(_PLAN, None)
    if plan is None:
        path = config.getoption("--specgate-plan")
        try:
            plan = (RunPlan.load(Path(path)) if path else build_plan(
                _asked(config), config.getoption("--specgate-spec"),
                config.getoption("--specgate-graphs")))
        except (UsageError, ValueError) as err:
            raise pytest.UsageError(str(err)) from None
        plan = config.stash[_PLAN] = plan.for_spec(plan.specs[0])
    return plan

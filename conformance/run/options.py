"""The suite's pytest options (``--specgate-*``), added by the plugin (``conformance.run.plugin``).
``specgate certify`` passes its own options on as these (``conformance.run.suite``)."""

from __future__ import annotations

import pytest

from conformance.plan.profiles import PROFILES
from conformance.run.case_timeout import default_seconds
from conformance.run.device import DEVICE_HELP
from refengine.config import GRAPH_EXECUTORS


def add_suite_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("specgate", "specgate conformance suite")
    group.addoption("--specgate-backend", default=None,
                    help="backend under test: an entry-point name (refengine, hf, "
                         "ctranslate2) or module:factory; default $SPECGATE_BACKEND or refengine")
    group.addoption("--specgate-spec", default="none",
                    help="speculative configuration to certify (none, all)")
    group.addoption("--specgate-profile", default="gate", choices=sorted(PROFILES),
                    help="gate: quick CI subset; full: every configuration")
    group.addoption("--specgate-model", default="tiny-code",
                    help="target model: a fixture name or an HF-format directory")
    group.addoption("--specgate-draft-model", default=None,
                    help="override the spec configurations' draft model (fixture or directory)")
    group.addoption("--specgate-graphs", default=None, choices=GRAPH_EXECUTORS,
                    help="run the backend's forwards through its graph runner with this "
                         "executor (backends claiming graph_runner)")
    group.addoption("--specgate-device", default="cpu", help=DEVICE_HELP)
    group.addoption("--specgate-case-timeout", default=None, type=float,
                    help="seconds each phase of a check may take before it fails (0: no "
                         "limit); default by profile: " + ", ".join(
                             f"{p} {default_seconds(p, None):g}" for p in PROFILES)
                         + ", four times that with --specgate-graphs compiled or frozen")
    group.addoption("--specgate-results", default=None,
                    help="write per-check results (JSON) here")
    group.addoption("--specgate-repro-dir", default=None,
                    help="a failing check writes its scenario to repro/<check-id>.json here "
                         "(the report directory); unset: no repro files")

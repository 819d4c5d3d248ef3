"""The suite context every check receives (the ``sg`` fixture): the backend under test, its
claims, the spec, the profile, the oracle; built once per pytest process from the
``--specgate-*`` options and checked before any check runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import pytest

from conformance.checks.oracle import ReferenceOracle
from conformance.contract import Backend, Capabilities, OpenConfig, SpecConfig
from conformance.plan.profiles import PROFILES, Profile
from conformance.plan.prompts import PromptCase, load_prompt_set
from conformance.plan.registry import BackendError, load_backend
from conformance.plan.specs import SpecChoice, resolve_specs
from conformance.repro.record import RecordedRuns
from conformance.run.case_timeout import default_seconds
from conformance.run.device import device_problem

DEFAULT_BACKEND = "refengine"


@dataclass
class SuiteContext:
    """What every check needs: the backend, its claims, the spec, the profile and the oracle."""

    backend_name: str
    backend: Backend
    caps: Capabilities
    spec: SpecChoice
    profile: Profile
    model: str = "tiny-code"
    graph_executor: str | None = None  # --specgate-graphs
    device: str = "cpu"  # --specgate-device
    _oracle: ReferenceOracle | None = field(default=None, repr=False)
    _check: pytest.Item | None = field(default=None, repr=False)  # the suite check running now
    recorded: RecordedRuns = field(default_factory=RecordedRuns)  # its drivers, for a repro

    @property
    def prompts(self) -> tuple[PromptCase, ...]:
        return load_prompt_set(self.profile.prompt_set, self.model)

    def open_config(self, spec: SpecConfig | None, **limits: int) -> OpenConfig:
        """What every check opens the backend with: the model, ``spec``, the run's graph
        executor and device, and the check's own limits."""
        return replace(OpenConfig(model=self.model, spec=spec, graph_executor=self.graph_executor,
                                  device=self.device), **limits)

    @property
    def oracle(self) -> ReferenceOracle:
        if self._oracle is None:
            self._oracle = ReferenceOracle(self.model)
        return self._oracle

    def extend_property(self, name: str, entries: list[str]) -> None:
        """Add ``entries`` to the list property ``name`` of the running check (what pytest's
        ``record_property`` fixture writes), so helpers shared by the tiers record figures
        without every check handing the fixture down; calls within one check add up."""
        assert self._check is not None, "extend_property: no suite check is running"
        props = self._check.user_properties
        for i, (key, value) in enumerate(props):
            if key == name:
                props[i] = (name, [*value, *entries])
                return
        props.append((name, list(entries)))


def _backend_name(config: pytest.Config) -> str:
    return (config.getoption("--specgate-backend") or os.environ.get("SPECGATE_BACKEND")
            or DEFAULT_BACKEND)


def case_timeout(config: pytest.Config) -> float:
    chosen = config.getoption("--specgate-case-timeout")
    if chosen is not None:
        return float(chosen)
    return default_seconds(config.getoption("--specgate-profile"),
                           config.getoption("--specgate-graphs"))


def context(config: pytest.Config) -> SuiteContext:
    ctx = getattr(config, "_specgate_ctx", None)
    if ctx is None:
        name = _backend_name(config)
        try:
            backend = load_backend(name)
            spec = resolve_specs(config.getoption("--specgate-spec"))[0]
            draft = config.getoption("--specgate-draft-model")
            if draft:
                spec = spec.with_draft_model(draft)
        except (BackendError, ValueError) as err:
            raise pytest.UsageError(str(err)) from None
        caps = backend.capabilities()
        graphs = config.getoption("--specgate-graphs")
        if graphs and not caps.graph_runner:
            raise pytest.UsageError(f"--graphs: backend {name!r} does not claim graph_runner")
        device = config.getoption("--specgate-device")
        problem = device_problem(device, graphs)
        if problem:
            raise pytest.UsageError(problem)
        ctx = SuiteContext(name, backend, caps, spec,
                           PROFILES[config.getoption("--specgate-profile")],
                           config.getoption("--specgate-model"), graphs, device)
        config._specgate_ctx = ctx  # type: ignore[attr-defined]
    return ctx



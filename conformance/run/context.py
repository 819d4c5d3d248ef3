"""The suite context every check receives (the ``sg`` fixture): the run plan, the backend under
test and its claims, the spec, the profile, the oracle; built once per pytest process from the
session's plan (``conformance.run.options.plan_of``), which was validated where it was built:
nothing here checks it again."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from conformance.checks.oracle import ReferenceOracle
from conformance.contract import Backend, Capabilities, OpenConfig, SpecConfig
from conformance.plan.profiles import PROFILES, Profile
from conformance.plan.prompts import PromptCase, load_prompt_set
from conformance.plan.registry import BackendError, load_backend
from conformance.plan.run_plan import RunPlan
from conformance.plan.specs import SpecChoice
from conformance.repro.record import RecordedRuns
from conformance.run.case_timeout import default_seconds
from conformance.run.options import plan_of


@dataclass
class SuiteContext:
    """What every check needs: the plan, the backend, its claims, the spec (``--spec``'s choice,
    drafting with the plan's draft model), the profile and the oracle."""

    plan: RunPlan
    backend: Backend
    caps: Capabilities
    spec: SpecChoice
    profile: Profile
    _oracle: ReferenceOracle | None = field(default=None, repr=False)
    _check: pytest.Item | None = field(default=None, repr=False)  # the suite check running now
    recorded: RecordedRuns = field(default_factory=RecordedRuns)  # its drivers, for a repro

    @property
    def backend_name(self) -> str:
        """The backend as the run named it (entry point, module:factory, mutant:NAME)."""
        return self.plan.backend

    @property
    def model(self) -> str:
        return self.plan.model

    @property
    def draft_model(self) -> str | None:
        return self.plan.draft_model

    @property
    def graph_executor(self) -> str | None:
        return self.plan.graph_executor

    @property
    def device(self) -> str:
        return self.plan.device

    def with_executor(self, graph_executor: str) -> SuiteContext:
        """This context opening the backend through its graph runner with ``graph_executor``
        (a check that runs graphed in a run without ``--graphs``)."""
        return replace(self, plan=replace(self.plan, graph_executor=graph_executor))

    @property
    def prompts(self) -> tuple[PromptCase, ...]:
        return load_prompt_set(self.profile.prompt_set, self.model)

    def open_config(self, spec_config: SpecConfig | None, **limits: int) -> OpenConfig:
        """What every check opens the backend with: the model, ``spec_config``, the run's graph
        executor and device, and the check's own limits."""
        return replace(OpenConfig(model=self.model, spec=spec_config,
                                  graph_executor=self.graph_executor, device=self.device),
                       **limits)

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


def case_timeout(config: pytest.Config) -> float:
    """Seconds each phase of a suite check may take: the plan's, else the profile's default for
    its executor."""
    plan = plan_of(config)
    if plan.case_timeout is not None:
        return plan.case_timeout
    return default_seconds(plan.profile, plan.graph_executor)


_CONTEXT = pytest.StashKey[SuiteContext]()


def context(config: pytest.Config) -> SuiteContext:
    """The session's suite context, built once per process from its plan."""
    ctx = config.stash.get(_CONTEXT, None)
    if ctx is None:
        plan = plan_of(config)
        try:  # loaded once more in this process (an xdist worker) from the checked plan
            backend = load_backend(plan.backend)
        except BackendError as err:
            raise pytest.UsageError(str(err)) from None
        ctx = config.stash[_CONTEXT] = SuiteContext(plan, backend, backend.capabilities(),
                                                    plan.spec, PROFILES[plan.profile])
    return ctx

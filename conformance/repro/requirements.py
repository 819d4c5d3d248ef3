"""What a scenario needs of a backend: the capabilities each run asks for (its spec, its
config's test hooks, the actions it takes), and the one-line refusal of a backend that does not
claim them."""

from __future__ import annotations

from conformance.contract import Capabilities
from conformance.repro.scenario import Abort, CloseSession, OpenSession, Run, Scenario, Submit


class NotApplicable(ValueError):
    """The backend does not claim what the scenario needs; one line naming it."""


def requirements(run: Run) -> list[str]:
    """The capabilities a run needs of a backend (as ``Capabilities.claims`` names them)."""
    spec = run.config.spec
    needs = [f"algorithm:{spec.algorithm if spec else 'none'}"]
    if spec is not None and spec.topk > 1:
        needs.append("tree")
    if spec is not None and spec.overlap:
        needs.append("overlap")
    if run.config.retract_every:
        needs.append("forced_retract")
    if run.config.graph_executor:
        needs.append("graph_runner")
    ops = {type(a) for a in run.actions}
    if Abort in ops:
        needs.append("abort")
    if ops & {OpenSession, CloseSession}:
        needs.append("sessions")
    if any(isinstance(a, Submit) and a.accept_lens is not None for a in run.actions):
        needs += ["reference_draft", "acceptance_stats"]
    return needs


def check_applicable(scenario: Scenario, backend_name: str, caps: Capabilities) -> None:
    """``NotApplicable`` naming what a run of ``scenario`` needs and the backend lacks."""
    for run in scenario.runs:
        missing = [n for n in requirements(run) if not caps.claims(n)]
        if missing:
            raise NotApplicable(f"backend {backend_name!r} does not claim "
                                f"{', '.join(missing)}, which the scenario needs")

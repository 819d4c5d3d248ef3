"""The run plan: one run of the suite (a spec of ``specgate certify`` or ``specgate mutants``, or
a plain pytest session) as one frozen value, validated once before any work.

``build_plan`` is that validation, for the command line and the pytest options alike: spec
names, the backend (loaded, claiming ``graph_runner`` when an executor is asked for), the
device and the executor (``auto``/``none`` resolved through the executor registry), the model
and draft model directories, what the backend's contract version cannot express, and, for a
command, the backend's refusal of the model. The plan reaches a pytest session as one option,
``--specgate-plan FILE``, written and read by ``save``/``load``; loading checks every field's
type and known names, nothing more: the plan was validated where it was built.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from conformance.plan.usage import UsageError

if TYPE_CHECKING:
    from conformance.contract import Capabilities
    from conformance.plan.specs import SpecChoice

PLAN_VERSION = 1
PLAN_MAX_BYTES = 2**20  # a plan is a few hundred bytes; a bigger file is no plan


@dataclass(frozen=True)
class RunPlan:
    """Everything a suite run is, checked: ``build_plan`` fills ``specs`` and
    ``graph_executor`` from what was asked (``--spec``, ``--graphs``)."""

    backend: str                        # entry-point name, module:factory or mutant:NAME
    specs: tuple[str, ...] = ()         # spec names, each its own run and certificate
    profile: str = "gate"
    model: str = "tiny-code"            # fixture name or model directory
    draft_model: str | None = None      # overrides the specs' draft model
    device: str = "cpu"
    graph_executor: str | None = None   # a registered executor; None: eager forwards
    case_timeout: float | None = None   # seconds per phase of a check; None: the profile's
    workers: int = 0                    # pytest-xdist workers; 0: in-process
    only: tuple[str, ...] = ()          # node ids to run alone (--only)
    keyword: str | None = None          # pytest's -k expression
    shard: str | None = None            # "I/N"
    durations: str | None = None        # the table shards balance by; None: the bundled one
    known_failures: str | None = None   # the known-failures file
    strict_known: bool = False          # a stale known failure fails the gate
    require: str | None = None          # the coverage class the run must meet

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not _TYPES[str(field.type)](value):
                raise ValueError(f"plan field {field.name!r}: expected {field.type}, got "
                                 f"{value!r:.80}")

    @property
    def spec(self) -> SpecChoice:
        """The run's spec (its first, for a plan of several), drafting with ``draft_model``
        when one is given."""
        from conformance.plan.specs import SPECS

        choice = SPECS[self.specs[0]]
        return choice.with_draft_model(self.draft_model) if self.draft_model else choice

    def for_spec(self, name: str) -> RunPlan:
        """This plan narrowed to one of its specs: one pytest session's run."""
        return replace(self, specs=(name,))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"plan_version": PLAN_VERSION, **asdict(self)}, indent=1))

    @classmethod
    def load(cls, path: Path) -> RunPlan:
        """A plan ``save`` wrote; ValueError, one line naming the file, for anything else."""
        from specwire.untrusted import load_json

        data = load_json(path, str(path), PLAN_MAX_BYTES)
        if not isinstance(data, dict) or data.get("plan_version") != PLAN_VERSION:
            raise ValueError(f"{path}: not a specgate run plan of version {PLAN_VERSION}")
        given = {k: v for k, v in data.items() if k != "plan_version"}
        names = {f.name for f in fields(cls)}
        if set(given) != names:
            raise ValueError(f"{path}: plan fields missing {sorted(names - set(given))}, "
                             f"unknown {sorted(set(given) - names)}")
        try:
            plan = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
            plan._check_names()
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        return plan

    def _check_names(self) -> None:
        """The specs, profile and executor are ones this specgate knows (ValueError)."""
        from conformance.plan.profiles import PROFILES
        from conformance.plan.specs import SPECS
        from refengine.graph.executors import EXECUTORS

        unknown = [s for s in self.specs if s not in SPECS]
        if unknown or not self.specs:
            raise ValueError(f"plan specs: unknown {unknown} (known: {', '.join(SPECS)})")
        if self.profile not in PROFILES:
            raise ValueError(f"plan profile: unknown {self.profile!r}")
        if self.graph_executor is not None and self.graph_executor not in EXECUTORS:
            raise ValueError(f"plan graph_executor: unknown {self.graph_executor!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# A field's annotation -> the check of its value (the annotations are strings here).
_TYPES = {
    "str": lambda v: isinstance(v, str),
    "str | None": lambda v: v is None or isinstance(v, str),
    "tuple[str, ...]": lambda v: isinstance(v, tuple) and all(isinstance(s, str) for s in v),
    "float | None": lambda v: v is None or _is_number(v),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "bool": lambda v: isinstance(v, bool),
}


def claimed_specs(caps: Capabilities) -> list[SpecChoice]:
    """The specs a backend claims: their algorithm, and tree and overlap where they need it."""
    from conformance.plan.specs import SPECS

    return [s for s in SPECS.values() if caps.claims(f"algorithm:{s.algorithm}")
            and (caps.tree or not s.needs_tree) and (caps.overlap or not s.needs_overlap)]


def build_plan(asked: RunPlan, spec: str, graphs: str | None, probe_open: bool = False
               ) -> RunPlan:
    """``asked`` checked before any work, with its specs from ``spec`` (a spec name, ``all``
    or ``claimed``) and its executor from ``graphs`` (an executor, ``auto``, ``none`` or None);
    ``probe_open``: also open the backend once on the model (``refuses_model``), as a command
    does before its first check. UsageError (one line) for the first problem found."""
    from conformance.plan.device import best_graphs, device_problem
    from conformance.plan.preflight import contract_refusal, refuses_model, validate
    from conformance.plan.specs import resolve_specs

    executor = best_graphs(graphs, asked.device)
    problem = device_problem(asked.device, executor)
    if problem:
        raise UsageError(problem)
    (backend,) = validate("all" if spec == "claimed" else spec, [asked.backend], asked.model,
                          asked.draft_model)
    caps = backend.capabilities()
    if executor and not caps.graph_runner:
        raise UsageError(f"--graphs: backend {asked.backend!r} does not claim graph_runner")
    probe = contract_refusal(backend, asked.model, asked.device)
    if probe_open and not asked.backend.startswith("mutant:"):
        refuses_model(backend, probe)
    choices = claimed_specs(caps) if spec == "claimed" else resolve_specs(spec)
    if not choices:
        raise UsageError(f"--spec claimed: backend {asked.backend!r} claims no spec "
                         f"(algorithms: {sorted(caps.algorithms)})")
    if asked.strict_known and asked.known_failures is None:
        raise UsageError("--strict-known needs --known-failures FILE")
    return replace(asked, specs=tuple(c.name for c in choices), graph_executor=executor)

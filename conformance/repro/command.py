"""``specgate repro FILE``: replay a repro file against a backend, or emit it as a pytest module.

Exit codes: 0 the scenario ran clean, 1 it diverged (the failure reproduces: the divergence
block is printed), 2 a bad file, an unknown backend or one that does not claim what the
scenario needs (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from conformance.repro.scenario import ReproFileError, Scenario, load
from conformance.run.usage import UsageError

DEFAULT_BACKEND = "refengine"


def with_spec(scenario: Scenario, name: str) -> Scenario:
    """Every run under the first configuration of spec ``name`` instead of its own."""
    from conformance.run.specs import resolve_specs

    try:
        choices = resolve_specs(name)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if len(choices) != 1:
        raise UsageError(f"--spec {name}: a replay runs under one spec; name one")
    spec = choices[0].configs[0]
    return replace(scenario, runs=tuple(replace(r, config=replace(r.config, spec=spec))
                                        for r in scenario.runs))


def cmd_repro(args: argparse.Namespace) -> int:
    from conformance.repro.replay import NotApplicable, check_applicable, replay
    from conformance.run.registry import BackendError, load_backend

    try:
        scenario = load(Path(args.file))
    except ReproFileError as err:
        raise UsageError(str(err)) from None
    if args.spec:
        scenario = with_spec(scenario, args.spec)
    if args.emit_pytest:
        return _emit(scenario, Path(args.emit_pytest))
    name = args.backend or scenario.backend or DEFAULT_BACKEND
    try:
        backend = load_backend(name)
        check_applicable(scenario, name, backend.capabilities())
    except (BackendError, NotApplicable) as err:
        raise UsageError(str(err)) from None
    print(f"specgate repro: {args.file} ({scenario.check or 'no check named'}): "
          f"{len(scenario.runs)} run(s), {scenario.action_count} actions, on backend {name}",
          file=sys.stderr)
    found = replay(scenario, backend)
    if found is None:
        print(f"clean: backend {name} passes every check of the scenario")
        if scenario.failure:
            print(f"(it was recorded failing on {scenario.backend or 'another backend'}: "
                  f"{scenario.failure.splitlines()[0][:300]})")
        return 0
    print(f"reproduced on backend {name}:\n{found.describe()}")
    return 1


def _emit(scenario: Scenario, out: Path) -> int:
    from conformance.repro.emit import emit_pytest

    if out.suffix != ".py" or not out.name.startswith("test_"):
        raise UsageError(f"--emit-pytest {out}: name it test_<something>.py, so pytest "
                         "collects it")
    if out.exists():
        raise UsageError(f"--emit-pytest {out}: exists; give a new file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(emit_pytest(scenario, out.name))
    except OSError as err:
        raise UsageError(f"--emit-pytest {out}: cannot write ({err.strerror or err})") from None
    print(f"wrote {out}: run it with `pytest {out} --specgate-backend <backend>`")
    return 0

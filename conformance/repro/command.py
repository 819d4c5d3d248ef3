"""``specgate repro FILE``: replay a repro file against a backend, or emit it as a pytest module.

Exit codes: 0 the scenario ran clean, 1 it diverged (the failure reproduces: the divergence
block is printed), 2 a bad file, an unknown backend or one that does not claim what the
scenario needs (one line on stderr).

A repro file is data from a stranger: its ``backend`` field is a label. Replay runs on
``--backend`` or, without it, on the recorded backend only where that is one specgate knows by
name (a built-in, an installed entry point, a bug-zoo mutant); a ``module:factory`` named only
in a file is never imported. What the file asks of this machine (its models, their vocabulary,
the graph executor, the device) is checked before any engine opens, so a bad file is exit 2,
never a "reproduced" that blames a correct engine.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from conformance.plan.usage import UsageError
from conformance.repro.scenario import Action, ReproFileError, Scenario, Submit, load

DEFAULT_BACKEND = "refengine"


def with_spec(scenario: Scenario, name: str) -> Scenario:
    """Every run under the first configuration of spec ``name`` instead of its own; accept
    lengths recorded under another configuration are dropped (they say nothing of this one)."""
    from conformance.plan.specs import resolve_specs

    try:
        choices = resolve_specs(name)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if len(choices) != 1:
        raise UsageError(f"--spec {name}: a replay runs under one spec; name one")
    spec = choices[0].configs[0]
    return replace(scenario, runs=tuple(
        r if r.config.spec == spec else replace(r, config=replace(r.config, spec=spec),
                                                actions=tuple(map(_without_acceptance, r.actions)))
        for r in scenario.runs))


def _without_acceptance(action: Action) -> Action:
    return (replace(action, accept_lens=None)
            if isinstance(action, Submit) and action.accept_lens is not None else action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conformance.plan.specs import SPECS

    parser.add_argument("file", help="a repro file (docs/repro.md), e.g. "
                        "<report>/repro/<check-id>.json")
    parser.add_argument("--backend", default=None,
                        help="as for certify; unset: the backend the file was recorded on, if "
                             "specgate knows it by name (a module:factory in a file is never "
                             "imported)")
    parser.add_argument("--spec", default=None,
                        help=f"{' | '.join(SPECS)}: replay every run under this spec's first "
                             "configuration instead of the recorded one")
    parser.add_argument("--emit-pytest", default=None, metavar="test_NAME.py",
                        help="write the scenario as a standalone pytest module (run it with "
                             "pytest --specgate-backend B) instead of replaying it")


def cmd_repro(args: argparse.Namespace) -> int:
    from conformance.plan.registry import BackendError, load_backend
    from conformance.repro.replay import replay
    from conformance.repro.requirements import NotApplicable, check_applicable

    try:
        scenario = load(Path(args.file))
    except ReproFileError as err:
        raise UsageError(str(err)) from None
    if args.spec:
        recorded = scenario.version
        scenario = with_spec(scenario, args.spec)
        if scenario.version < recorded:
            print(f"specgate repro: --spec {args.spec}: the accept lengths recorded under "
                  "another configuration are not checked", file=sys.stderr)
    if args.emit_pytest:
        return _emit(scenario, Path(args.emit_pytest))
    name = args.backend or recorded_backend(scenario, str(args.file))
    check_runnable(scenario, str(args.file))
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


def recorded_backend(scenario: Scenario, source: str) -> str:
    """The backend a replay without ``--backend`` runs on: the recorded one where specgate
    knows it by name, else a UsageError saying to pass it (never an import from the file)."""
    from conformance.backends.mutants import MUTANTS
    from conformance.backends.mutants.source_patches import SOURCE_MUTANTS
    from conformance.plan.registry import known_backends

    label = scenario.backend or DEFAULT_BACKEND
    mutant = label.removeprefix("mutant:")
    if label in known_backends() or (label != mutant and (mutant in MUTANTS
                                                          or mutant in SOURCE_MUTANTS)):
        return label
    raise UsageError(f"{source}: recorded on backend {label!r:.120}, which specgate does not "
                     "know by name and never imports from a file; pass it with --backend")


def check_runnable(scenario: Scenario, source: str) -> None:
    """What the file asks of this machine, before any engine opens: every model and draft
    model loads, token ids fit the model's vocabulary, the graph executor exists, the device
    is here. A UsageError (one line) otherwise."""
    from conformance.plan.device import device_problem
    from refengine.config import GRAPH_EXECUTORS
    from refengine.data import resolve_model_dir
    from refengine.model.loader import check_draft_dir, check_model_dir, load_config

    for i, run in enumerate(scenario.runs):
        where, config = f"{source}: runs[{i}].config", scenario.runs[i].config
        if config.graph_executor is not None and config.graph_executor not in GRAPH_EXECUTORS:
            raise UsageError(f"{where}.graph_executor: {config.graph_executor!r:.40} is none of "
                             f"{', '.join(GRAPH_EXECUTORS)}")
        problem = device_problem(config.device, config.graph_executor)
        if problem:
            raise UsageError(f"{where}: {problem}")
        try:
            model = resolve_model_dir(config.model)
            check_model_dir(model)
            if config.spec is not None and config.spec.needs_draft_model:
                check_draft_dir(resolve_model_dir(config.spec.draft_model))
            vocab = load_config(model).vocab_size
        except (OSError, ValueError) as err:
            raise UsageError(f"{where}: {err}") from None
        for j, action in enumerate(run.actions):
            ids = [*getattr(action, "prompt_ids", ()),
                   *getattr(getattr(action, "params", None), "stop_token_ids", ())]
            if any(t >= vocab for t in ids):
                raise UsageError(f"{source}: runs[{i}].actions[{j}]: token id {max(ids)} is "
                                 f"outside the model's vocabulary of {vocab}")


def _emit(scenario: Scenario, out: Path) -> int:
    from conformance.repro.emit import MODULE_NAME, emit_pytest

    if not MODULE_NAME.fullmatch(out.name):
        raise UsageError(f"--emit-pytest {out}: name it test_<letters, digits, _>.py, so "
                         "pytest collects it")
    if out.exists():
        raise UsageError(f"--emit-pytest {out}: exists; give a new file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(emit_pytest(scenario, out.name))
    except OSError as err:
        raise UsageError(f"--emit-pytest {out}: cannot write ({err.strerror or err})") from None
    print(f"wrote {out}: run it with `pytest {out} --specgate-backend <backend>`")
    return 0

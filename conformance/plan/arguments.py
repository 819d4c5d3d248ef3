"""Argument types the ``specgate`` commands share (each command module adds its own arguments,
``conformance.cli``): a count, seconds, and ``--graphs``, whose choices are the executor
registry's names (``refengine.graph.executors``) and ``auto`` / ``none``; and the default case
timeouts as ``--help`` states them (the pytest options' too). Importing it imports no pytest."""

from __future__ import annotations

import argparse

GRAPHS_AUTO, GRAPHS_NONE = "auto", "none"  # the device's default executor; no graphs


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def timeout_help(graphs_option: str) -> str:
    """The default case timeouts, for a ``--help``: by profile, and the executor registry's
    factor for the executors that compile inside the checks."""
    from conformance.plan.profiles import PROFILES
    from refengine.graph.executors import EXECUTORS

    by_factor: dict[int, list[str]] = {}
    for name, info in EXECUTORS.items():
        if info.timeout_factor != 1:
            by_factor.setdefault(info.timeout_factor, []).append(name)
    longer = [f"{TIMES.get(factor, f'{factor} times')} that with {graphs_option} "
              + " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
              for factor, names in by_factor.items()]
    return ", ".join([*(f"{p.name} {p.case_timeout:g}" for p in PROFILES.values()), *longer])


TIMES = {2: "twice", 3: "three times", 4: "four times"}  # a factor, as the help says it


def graph_choices() -> tuple[str, ...]:
    """``--graphs`` values: every registered executor, then ``auto`` and ``none``."""
    from refengine.graph.executors import EXECUTORS

    return (*EXECUTORS, GRAPHS_AUTO, GRAPHS_NONE)


def add_graphs_argument(parser: argparse.ArgumentParser, default: str | None,
                        help: str) -> None:
    """``--graphs [EXECUTOR]``, the flag alone meaning ``auto``; ``help`` may name the choices
    as ``%(choices)s``."""
    parser.add_argument("--graphs", nargs="?", const=GRAPHS_AUTO, default=default,
                        choices=graph_choices(), metavar="EXECUTOR", help=help)

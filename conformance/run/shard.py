"""``--shard I/N``: a deterministic split of the suite's checks over N machines, balanced by
recorded durations.

A pytest plugin (loaded with the suite, ``conformance.run.suite.SUITE_PLUGINS``): with
``--specgate-shard I/N`` it keeps shard I's checks and deselects the rest. The split is the
longest-processing-time greedy: checks that will run come first, the longest first (ties by
node id), then the checks gated off as not claimed; each goes to the shard with the least
recorded time so far (ties: fewest checks, then lowest index). It depends only on the collected
node ids, the spec and the durations table, never on worker count or collection order, so every
shard (and every xdist worker of a shard) computes the same split.

The durations table (``durations.json`` beside this file, or ``--specgate-durations FILE``) maps
spec -> node id -> seconds; ``specgate report durations`` records one from report.json files. A
check it does not list weighs the median of its spec's entries (of every entry if the spec has
none; 1 s if the table is empty).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

from specwire.untrusted import MiB, UntrustedFileError, load_json

DURATIONS = Path(__file__).with_name("durations.json")
MAX_DURATIONS_BYTES = 64 * MiB


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based, as written on the command line
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``I/N`` with 1 <= I <= N; ValueError naming the problem otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None:
        raise ValueError(f"expected I/N (shard I of N, e.g. 1/4), got {text!r}")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1:
        raise ValueError(f"expected I/N with N >= 1, got {text!r}")
    if not 1 <= index <= count:
        raise ValueError(f"expected I/N with 1 <= I <= N, got {text!r}")
    return Shard(index, count)


def load_durations(path: Path) -> dict[str, dict[str, float]]:
    """spec -> node id -> seconds; ValueError naming the file if it is not such a table (read
    as untrusted data: a table may come from another machine's certificates)."""
    where = f"--durations {path}"
    try:
        table = load_json(path, where, MAX_DURATIONS_BYTES)
    except UntrustedFileError as err:
        raise ValueError(f"{err}: not a durations table") from None
    try:
        if not isinstance(table, dict):
            raise TypeError(f"a JSON {type(table).__name__}, not an object")
        checks = table["durations"]
        found = {str(spec): {str(n): float(s) for n, s in rows.items()}
                 for spec, rows in checks.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{where}: not a durations table ({type(err).__name__}: "
                         f"{str(err)[:200]})") from None
    if not all(math.isfinite(s) and s >= 0 for rows in found.values() for s in rows.values()):
        raise ValueError(f"{where}: a duration that is not a finite number of seconds >= 0")
    return found


def weights(nodeids: list[str], spec: str, table: dict[str, dict[str, float]]
            ) -> dict[str, float]:
    """Seconds per check: recorded, or the median of what is recorded."""
    known = table.get(spec) or {n: s for rows in table.values() for n, s in rows.items()}
    median = statistics.median(known.values()) if known else 1.0
    return {n: known.get(n, median) for n in nodeids}


def assign(nodeids: list[str], seconds: dict[str, float], count: int,
           gated: frozenset[str] = frozenset()) -> dict[str, int]:
    """Node id -> shard (0-based) by the greedy above; ``gated``: checks that will not run."""
    order = sorted(nodeids, key=lambda n: (n in gated, -seconds[n], n))
    load = [0.0] * count
    size = [0] * count
    placed = {}
    for nodeid in order:
        shard = min(range(count), key=lambda s: (load[s], size[s], s))
        placed[nodeid] = shard
        load[shard] += 0.0 if nodeid in gated else seconds[nodeid]
        size[shard] += 1
    return placed


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specgate", "specgate conformance suite")
    group.addoption("--specgate-shard", default=None,
                    help="I/N: run only shard I of N of the checks (balanced by durations)")
    group.addoption("--specgate-durations", default=str(DURATIONS),
                    help="the durations table the split is balanced by")


@pytest.hookimpl(trylast=True)  # after -k and after the specgate plugin's capability gating
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    text = config.getoption("--specgate-shard")
    if not text:
        return
    try:
        shard = parse_shard(text)
        table = load_durations(Path(config.getoption("--specgate-durations")))
    except ValueError as err:
        raise pytest.UsageError(f"--specgate-shard: {err}") from None
    from conformance.run.options import plan_of

    spec = plan_of(config).specs[0]  # from the session's plan, or the options that make one
    ids = [item.nodeid for item in items]
    gated = frozenset(i.nodeid for i in items if i.get_closest_marker("skip"))
    placed = assign(ids, weights(ids, spec, table), shard.count, gated)
    keep = [i for i in items if placed[i.nodeid] == shard.index - 1]
    dropped = [i for i in items if placed[i.nodeid] != shard.index - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep

"""A failing suite check leaves its scenario: ``repro/<check-id>.json`` in the report directory.

The plugin keeps the drivers a check opened (``RecordedRuns``); when the check fails, their
runs become one scenario, named after the check and carrying its failure message, and the
check's row in the results says where the file is (``repro``, relative to the report
directory) and whether replaying it against the same backend reproduces the failure
(``repro_reproduces``; None where it was not replayed, after a timeout): a check whose own
assertion (a statistic, a count) is not one of the scenario's generic checks records a
scenario that replays clean, and the certificate says so rather than offering a command that
proves nothing. An interrupted check (Ctrl-C) leaves nothing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from conformance.contract import Backend
from conformance.report.report_dir import REPRO_DIR
from conformance.repro.scenario import Scenario, save
from conformance.run.driver import Driver
from specwire.untrusted import contained

MAX_NAME = 120


def check_file_name(nodeid: str) -> str:
    """A file name for a check id: the node id in safe characters (long ones shortened, with
    a hash so two checks never share a file)."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "-", nodeid.replace(".py::", ".")).strip("-")
    if len(safe) > MAX_NAME:
        digest = hashlib.sha1(nodeid.encode()).hexdigest()[:10]
        safe = f"{safe[:MAX_NAME - 11]}-{digest}"
    return f"{safe}.json"


@dataclass
class RecordedRuns:
    """The drivers the running check opened, in order."""

    drivers: list[Driver] = field(default_factory=list)

    def clear(self) -> None:
        self.drivers.clear()

    def scenario(self, check: str, failure: str, backend: str) -> Scenario | None:
        runs = tuple(d.recorded() for d in self.drivers if d.actions)
        return Scenario(runs, check, failure, backend) if runs else None


def write_repro(runs: RecordedRuns, report_dir: Path, check: str, failure: str,
                backend_name: str, backend: Backend, replay_it: bool = True
                ) -> dict[str, object]:
    """Write the failing check's scenario; -> the properties its results row gets ({} when it
    drove no requests through the adapter). ``replay_it`` False (the check timed out: a replay
    could hang as long): reproduction is left unknown (None)."""
    from conformance.repro.replay import NotApplicable, replay

    scenario = runs.scenario(check, failure, backend_name)
    if scenario is None:
        return {}
    relative = f"{REPRO_DIR}/{check_file_name(check)}"
    save(scenario, contained(report_dir, REPRO_DIR, check_file_name(check)))
    reproduces: bool | None = None
    if replay_it:
        try:
            reproduces = replay(scenario, backend) is not None
        except NotApplicable:
            reproduces = False
    return {"specgate_repro": relative, "specgate_repro_reproduces": reproduces}

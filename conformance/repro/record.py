"""A failing suite check leaves its scenario: ``repro/<check-id>.json`` in the report directory.

The plugin keeps the drivers a check opened (``RecordedRuns``); when the check fails, their
runs become one scenario, named after the check and carrying its failure message, and the
check's row in the results says where the file is (``repro``, relative to the report
directory) and whether replaying it against the same backend reproduces the failure
(``repro_reproduces``): a check whose own assertion (a statistic, a count) is not one of the
scenario's generic checks records a scenario that replays clean, and the certificate says so
rather than offering a command that proves nothing. Where the replay did not run (the check
timed out, or the backend does not claim what the scenario needs) it is None and
``repro_not_replayed`` says why: a refused replay is no evidence either way. A check whose
assertion is acceptance (the golden tier's) says what accept lengths it wants per request
(``RecordedRuns.expect_acceptance``), and its scenario's submits carry them, so the replay
checks them too. An interrupted check (Ctrl-C) leaves nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypedDict

from conformance.contract import Backend
from conformance.report.report_dir import REPRO_DIR
from conformance.repro.driver import Driver
from conformance.repro.scenario import Run, Scenario, Submit, save
from specwire.untrusted import contained

MAX_NAME = 120
TIMED_OUT = "the check timed out, and so may a replay"


class ReproProperties(TypedDict, total=False):
    """What a failing check's results row gets from its scenario (none of it when the check
    drove no requests): the file, whether a replay reproduced the failure (None: unknown),
    and why it was not replayed."""

    specgate_repro: str
    specgate_repro_reproduces: bool | None
    specgate_repro_not_replayed: str


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
    """The drivers the running check opened, in order, and the accept lengths it wants of its
    requests (by request id, the first verify steps' each)."""

    drivers: list[Driver] = field(default_factory=list)
    acceptance: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def clear(self) -> None:
        self.drivers.clear()
        self.acceptance.clear()

    def expect_acceptance(self, lens: Mapping[str, Sequence[int]]) -> None:
        """The check compares these requests' first verify steps with ``lens``: its scenario
        records them, for the replay to check."""
        self.acceptance.update((rid, tuple(steps)) for rid, steps in lens.items() if steps)

    def _with_acceptance(self, run: Run) -> Run:
        if run.config.spec is None:
            return run
        return replace(run, actions=tuple(
            replace(a, accept_lens=self.acceptance[a.rid])
            if isinstance(a, Submit) and a.rid in self.acceptance and a.params.greedy else a
            for a in run.actions))

    def scenario(self, check: str, failure: str, backend: str) -> Scenario | None:
        runs = tuple(self._with_acceptance(d.recorded()) for d in self.drivers if d.actions)
        return Scenario(runs, check, failure, backend) if runs else None


def write_repro(runs: RecordedRuns, report_dir: Path, check: str, failure: str,
                backend_name: str, backend: Backend, replay_it: bool = True
                ) -> ReproProperties:
    """Write the failing check's scenario; -> the properties its results row gets ({} when it
    drove no requests through the adapter). ``replay_it`` False (the check timed out: a replay
    could hang as long) or a replay refused as not applicable: reproduction is left unknown
    (None), with the reason."""
    from conformance.repro.replay import replay
    from conformance.repro.requirements import NotApplicable

    scenario = runs.scenario(check, failure, backend_name)
    if scenario is None:
        return {}
    relative = f"{REPRO_DIR}/{check_file_name(check)}"
    save(scenario, contained(report_dir, REPRO_DIR, check_file_name(check)))
    found = ReproProperties(specgate_repro=relative, specgate_repro_reproduces=None)
    if not replay_it:
        found["specgate_repro_not_replayed"] = TIMED_OUT
        return found
    try:
        found["specgate_repro_reproduces"] = replay(scenario, backend) is not None
    except NotApplicable as err:
        found["specgate_repro_not_replayed"] = str(err)
    return found

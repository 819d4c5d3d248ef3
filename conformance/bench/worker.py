"""``python -m conformance.bench.worker JOB OUT``: one bench lane in a process of its own.

The parent (``conformance.bench.isolated``) starts this with its own interpreter, so one
engine's threads, allocator, kernels and process-wide state never touch another's. ``JOB`` is a
``LaneJob`` as JSON; the result goes to the file ``OUT`` (an engine may print to stdout and
stderr as it likes): ``{"result": <BenchResult as dataclasses.asdict gives it>}``, or
``{"error": "<one line>"}`` with exit status 2 when the backend cannot be loaded or refuses the
lane (a bad argument, as for ``specgate bench`` itself). Progress lines go to stderr prefixed
``specgate: ``, which the parent passes on.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conformance.bench.lanes import Lane, Workload
from conformance.bench.result import BenchResult
from conformance.report.progress import BACKEND_PROGRESS


@dataclass(frozen=True)
class LaneJob:
    """What a worker runs: one lane on the run's workload."""

    lane: Lane
    workload: Workload

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LaneJob:
        data: dict[str, Any] = json.loads(text)
        return cls(Lane.from_dict(data["lane"]), Workload.from_dict(data["workload"]))


class LineProgress:
    """A ``BenchProgress`` writing each event as a ``specgate: `` line on stderr."""

    def start(self, label: str) -> None:
        self.note(f"{label} ...")

    def note(self, text: str) -> None:
        print(f"{BACKEND_PROGRESS}{text}", file=sys.stderr, flush=True)

    def done(self, result: str) -> None:
        self.note(result)


def run_job(job: LaneJob) -> BenchResult:
    """Load the lane's backend, open it and time it (``measure.run_lanes``) in this process."""
    from conformance.bench.measure import run_lanes
    from conformance.plan.registry import load_backend

    return run_lanes([job.lane], job.workload, LineProgress(), load_backend)


def main(argv: list[str]) -> int:
    from conformance.plan.usage import USAGE_ERROR

    job, out = LaneJob.from_json(argv[0]), Path(argv[1])
    try:
        result = run_job(job)
    except (ValueError, FileNotFoundError) as err:  # BackendError is a ValueError
        out.write_text(json.dumps({"error": " ".join(str(err).split())}))
        return USAGE_ERROR
    out.write_text(json.dumps({"result": asdict(result)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

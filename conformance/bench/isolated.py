"""``specgate bench --spec chains``: every lane on every backend, each (backend, lane) in a
fresh process of its own (``python -m conformance.bench.worker``), one after another.

In one process, engines share threads, the allocator, kernel caches and process-wide state
(vLLM rebinds kernels and lowers torch's threads; a compiled graph keeps its pools), so one
lane's figures would carry another's. Here each lane runs alone: opened (its ``open`` wall time
is its start-up), warmed up and timed exactly as ``measure.run_lanes`` times any lane. The child
runs ``sys.executable``, the interpreter this command runs in, so every backend named must be
importable there (vLLM's own venv, which has specgate installed too, for ``--backends
refengine,vllm``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from conformance.bench.lanes import Lane, Workload
from conformance.bench.measure import BenchProgress
from conformance.bench.result import BenchResult
from conformance.bench.worker import LaneJob
from conformance.report.progress import BACKEND_PROGRESS

_LOG_TAIL = 30  # lines of a failed worker's output quoted in the error


@dataclass
class LaneRun:
    """One (backend, lane) as its worker measured it."""

    backend: str
    lane: str                  # the lane's label, e.g. "chain-s3-n4" or "plain+aot"
    result: BenchResult        # the worker's: this lane alone, a row per batch size


@dataclass
class IsolatedBench:
    """Everything ``compare.format_isolated`` prints; ``dataclasses.asdict`` gives plain JSON."""

    model: str
    max_new_tokens: int
    min_requests: int
    repeats: int
    batch_sizes: list[int]
    backends: list[str]
    reference: str             # the backend whose outputs every other lane is compared with
    eagle_head: str            # the EAGLE lanes' draft model, on every backend
    runs: list[LaneRun] = field(default_factory=list)


def run_worker(lane: Lane, workload: Workload, progress: BenchProgress) -> BenchResult:
    """Run ``lane`` in a fresh process; its ``specgate: `` lines go to ``progress.note``. A worker
    refusing the lane (exit 2: the backend cannot be loaded there, or refuses the lane) raises
    ValueError with its one line; any other failure RuntimeError with the end of its output."""
    with tempfile.TemporaryDirectory(prefix="specgate-bench-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "conformance.bench.worker",
                   LaneJob(lane, workload).to_json(), str(out)]
        tail: deque[str] = deque(maxlen=_LOG_TAIL)
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as child:
            assert child.stdout is not None
            for line in child.stdout:
                tail.append(line.rstrip("\n"))
                if line.startswith(BACKEND_PROGRESS):
                    progress.note(line.removeprefix(BACKEND_PROGRESS).rstrip())
        answer = json.loads(out.read_text()) if out.exists() else {}
    if "error" in answer:
        raise ValueError(f"backend {lane.backend!r} in its bench process: {answer['error']}")
    if child.returncode != 0 or "result" not in answer:
        raise RuntimeError(f"bench: the {lane.backend} {lane.label} process failed (exit "
                           f"{child.returncode}); its last lines:\n" + "\n".join(tail))
    return BenchResult.from_dict(answer["result"])


def run_isolated(lanes: list[Lane], workload: Workload, bench: IsolatedBench,
                 progress: BenchProgress) -> IsolatedBench:
    """Each lane in a process of its own, in order; ``progress`` gets a start and a done per
    lane and the worker's lines as notes in between."""
    for lane in lanes:
        progress.start(f"{lane.backend} {lane.label}")
        result = run_worker(lane, workload, progress)
        bench.runs.append(LaneRun(lane.backend, lane.label, result))
        progress.done(", ".join(
            f"batch {row.batch_size} {row.results[lane.label].tokens_per_s:,.1f} tok/s"
            for row in result.rows) + f"; open {result.open_seconds[lane.label]:.2f} s")
    return bench

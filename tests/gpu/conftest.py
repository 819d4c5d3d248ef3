"""The GPU tests share one machine's cores between xdist workers: torch's default (every core
in every process) has N workers' OpenMP threads spinning against each other on the host-side
work (the CPU oracle, each step's Python), which slowed a run on a 16-core GPU machine to a
crawl."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def share_the_cores() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

"""A certify run of one check against a bug-zoo mutant, for the tests of what a failure leaves
behind (its repro file, its commands)."""

from __future__ import annotations

import json
from pathlib import Path

from conformance.cli import main


def certify_failing(report: Path, backend: str, spec: str, check: str) -> Path:
    """Certify ``check`` alone on ``backend`` under ``spec`` into ``report``, which must fail."""
    code = main(["certify", "--backend", backend, "--spec", spec, "--only", check, "-n", "0",
                 "--report", str(report)])
    assert code == 1
    return report


def failed_row(report: Path, check: str) -> dict[str, object]:
    """``check``'s row in the certificate's report.json: failed, its repro reproducing."""
    row = next(c for c in json.loads((report / "report.json").read_text())["checks"]
               if c["nodeid"] == check)
    assert row["outcome"] == "failed" and row["repro_reproduces"] is True, row
    return row

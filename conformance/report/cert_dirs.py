"""Reading certificate directories back (for ``specgate report``): a single-spec directory
(report.json, junit.xml, repro/) or a multi-spec one (``<spec>/`` subdirectories of those, and
summary.md).

Certificates come from other machines (CI shards, a fork's artefacts), so report.json is read
as untrusted data (``specwire.untrusted``): bounded, its spec one specgate knows (it names
a directory the merge writes), its checks rows of the fields the readers use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conformance.plan.specs import SPECS
from conformance.report.report_dir import REPRO_DIR
from specwire.untrusted import MiB, UntrustedFileError, load_json

MAX_REPORT_BYTES = 256 * MiB
# what every row of report.json's checks must hold, for merge and durations to read it
ROW_FIELDS = {"nodeid": str, "outcome": str, "duration": (int, float)}


@dataclass(frozen=True)
class SpecFiles:
    """One spec's certificate as written: report.json loaded, and where its files are."""

    directory: Path
    report: dict[str, object]

    @property
    def junit(self) -> Path:
        return self.directory / "junit.xml"

    @property
    def repro_files(self) -> list[Path]:
        return sorted(p for p in (self.directory / REPRO_DIR).glob("*.json")
                      if p.is_file() and not p.is_symlink())


@dataclass(frozen=True)
class CertDir:
    path: Path
    multi: bool                     # per-spec subdirectories (certify --spec all|claimed)
    specs: dict[str, SpecFiles]     # spec -> its certificate


def _problem(report: object) -> str | None:
    """Why ``report`` is not a certificate's report.json, or None."""
    if not isinstance(report, dict) or not isinstance(report.get("checks"), list):
        return "no checks list"
    if not isinstance(report.get("spec"), str) or report["spec"] not in SPECS:
        return f"spec {report.get('spec')!r:.60} is none of {', '.join(SPECS)}"
    if not isinstance(report.get("shard"), (str, type(None))):
        return "shard is not a string"
    for i, row in enumerate(report["checks"]):
        if not isinstance(row, dict):
            return f"checks[{i}] is not an object"
        for name, kind in ROW_FIELDS.items():
            if not isinstance(row.get(name), kind) or isinstance(row.get(name), bool):
                return f"checks[{i}].{name} is missing or not a {name} value"
    return None


def _load(directory: Path) -> SpecFiles:
    path = directory / "report.json"
    try:
        report = load_json(path, str(path), MAX_REPORT_BYTES)
    except UntrustedFileError as err:
        raise ValueError(f"not a specgate certificate: {err}") from None
    problem = _problem(report)
    if problem:
        raise ValueError(f"{path}: not a specgate certificate ({problem})")
    assert isinstance(report, dict)
    return SpecFiles(directory, report)


def read_cert_dir(path: Path) -> CertDir:
    """ValueError (one line naming the path) if ``path`` holds no certificate."""
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    if (path / "report.json").exists():
        files = _load(path)
        return CertDir(path, False, {str(files.report["spec"]): files})
    subdirs = [d for d in sorted(path.iterdir()) if (d / "report.json").is_file()]
    if not subdirs:
        raise ValueError(f"{path}: holds no report.json (not a certificate directory)")
    specs = {}
    for d in subdirs:
        files = _load(d)
        specs[str(files.report["spec"])] = files
    return CertDir(path, True, specs)

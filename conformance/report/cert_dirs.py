"""Reading certificate directories back (for ``specgate report``): a single-spec directory
(report.json, junit.xml, repro/) or a multi-spec one (``<spec>/`` subdirectories of those, and
summary.md).

Certificates come from other machines (CI shards, a fork's artefacts), so report.json is read
as untrusted data (``specwire.untrusted``): bounded, every field the results are rebuilt from
of its type (``conformance.report.results_json.results_from_report``), its spec one specgate
knows (it names a directory the merge writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conformance.plan.specs import SPECS
from conformance.report.report_dir import REPRO_DIR
from conformance.report.results import RunResults
from conformance.report.results_json import results_from_report
from specwire.untrusted import MiB, UntrustedFileError, load_json

MAX_REPORT_BYTES = 256 * MiB


@dataclass(frozen=True)
class SpecFiles:
    """One spec's certificate as written: the results its report.json was built from, and
    where its files are."""

    directory: Path
    results: RunResults

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


def _load(directory: Path) -> SpecFiles:
    path = directory / "report.json"
    try:
        results = results_from_report(load_json(path, str(path), MAX_REPORT_BYTES))
    except UntrustedFileError as err:
        raise ValueError(f"not a specgate certificate: {err}") from None
    except ValueError as err:
        raise ValueError(f"{path}: not a specgate certificate ({err})") from None
    if results.spec not in SPECS:
        raise ValueError(f"{path}: not a specgate certificate (spec {results.spec!r:.60} is "
                         f"none of {', '.join(SPECS)})")
    return SpecFiles(directory, results)


def read_cert_dir(path: Path) -> CertDir:
    """ValueError (one line naming the path) if ``path`` holds no certificate."""
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    if (path / "report.json").exists():
        files = _load(path)
        return CertDir(path, False, {files.results.spec: files})
    subdirs = [d for d in sorted(path.iterdir()) if (d / "report.json").is_file()]
    if not subdirs:
        raise ValueError(f"{path}: holds no report.json (not a certificate directory)")
    specs = {}
    for d in subdirs:
        files = _load(d)
        specs[files.results.spec] = files
    return CertDir(path, True, specs)

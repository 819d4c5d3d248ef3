"""Reading certificate directories back (for ``specgate report``): a single-spec directory
(report.json, junit.xml, repro/) or a multi-spec one (``<spec>/`` subdirectories of those, and
summary.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from conformance.report.report_dir import REPRO_DIR


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
        return sorted((self.directory / REPRO_DIR).glob("*.json"))


@dataclass(frozen=True)
class CertDir:
    path: Path
    multi: bool                     # per-spec subdirectories (certify --spec all|claimed)
    specs: dict[str, SpecFiles]     # spec -> its certificate


def _load(directory: Path) -> SpecFiles:
    path = directory / "report.json"
    try:
        report = json.loads(path.read_text())
        if not isinstance(report, dict) or not isinstance(report.get("checks"), list):
            raise ValueError("no checks list")
        str(report["spec"])
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: not a specgate certificate ({err})") from None
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

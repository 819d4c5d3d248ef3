"""Where ``specgate certify`` writes its certificate, all or nothing.

A run writes into a staging directory beside the target and then swaps it into place, so the
report directory always holds the files of exactly one run: never a new junit.xml beside an
older report.md that still says PASSED. An interrupted run swaps in its (incomplete)
certificate too; a run that dies before writing one leaves the previous report untouched.

Everything is checked before any work starts: the target must be a directory or not exist yet,
its parent must be writable, and an existing directory may hold only what certify writes (the
swap replaces the whole directory, and must never delete a user's own files): the report files,
per-spec subdirectories of them, and ``repro/`` folders of repro files (``*.json``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

REPORT_FILES = frozenset({"report.md", "report.json", "junit.xml", "summary.md",
                          "acceptance.png"})
REPRO_DIR = "repro"  # the repro files failing checks leave, ``repro/<check>.json``


class ReportDirError(ValueError):
    """The report path cannot be used; the message is one line naming it and why."""


def _foreign_files(directory: Path) -> list[str]:
    """Entries of an existing report directory that certify did not write (per-spec
    subdirectories of a ``--spec all`` run hold the same report files)."""
    foreign = []
    for entry in sorted(directory.iterdir()):
        if entry.name == REPRO_DIR and entry.is_dir() and not entry.is_symlink():
            foreign += [f"{REPRO_DIR}/{p.name}" for p in sorted(entry.iterdir())
                        if p.suffix != ".json" or not p.is_file() or p.is_symlink()]
        elif entry.is_dir() and not entry.is_symlink():
            foreign += [f"{entry.name}/{name}" for name in _foreign_files(entry)]
        elif entry.name not in REPORT_FILES:
            foreign.append(entry.name)
    return foreign


class ReportDir:
    """``staging`` is where this run writes; ``commit()`` puts it in place of ``target``."""

    def __init__(self, target: Path, option: str = "--report") -> None:
        """``option``: how the command line named the directory, for the error messages."""
        self.target = target
        if target.exists() and not target.is_dir():
            raise ReportDirError(f"{option} {target}: exists and is not a directory")
        if target.is_dir():
            foreign = _foreign_files(target)
            if foreign:
                named = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
                raise ReportDirError(f"{option} {target}: holds files specgate did not write "
                                     f"({named}); give an empty or new directory")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self.staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".new",
                                                 dir=target.parent))
            umask = os.umask(0)
            os.umask(umask)
            self.staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would stick after the swap
        except OSError as err:
            raise ReportDirError(f"{option} {target}: cannot write there "
                                 f"({err.strerror or err})") from None

    def commit(self) -> None:
        """Replace the target with the staged files (two renames on one file system)."""
        old = None
        if self.target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".old",
                                        dir=self.target.parent))
            os.rename(self.target, old / "report")
        os.rename(self.staging, self.target)
        if old is not None:
            shutil.rmtree(old)

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

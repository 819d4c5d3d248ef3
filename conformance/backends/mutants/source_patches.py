"""Source-patch mutants: the reference engine with a bug planted in its source code.

A class mutant (``conformance.backends.mutants``) replaces an engine component with a subclass,
so the code every other user of ``refengine`` runs stays untouched, the oracle's included. A
source mutant instead edits files of a temporary copy of the ``refengine`` package, and the
whole suite run (backend, oracle, everything) imports that copy under the real name in a
subprocess: exactly what happens when specgate gates a change to refengine itself. A bug in a
path plain decoding shares with the oracle's engine is then invisible to any oracle that runs
the engine; the committed expected outputs (``conformance.checks.expected``) are what kill it.

An edit is a search/replace of text that must occur exactly once in its file; one that no
longer applies fails the run at once with one line naming mutant, file and text.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conformance.backends.refengine import RefEngineBackend

# Set in the subprocess that imports a patched copy: the mutant it carries.
MUTANT_ENV = "SPECGATE_SOURCE_MUTANT"
MARKER = ".specgate-source-mutant"  # in the patched package: the mutant's name


class PatchError(ValueError):
    """An edit of a source mutant does not apply to the current refengine source."""


@dataclass(frozen=True)
class SourceEdit:
    path: str      # inside the refengine package, e.g. "sampler.py"
    search: str    # must occur exactly once
    replace: str


@dataclass(frozen=True)
class SourceMutant:
    name: str
    bug_class: str
    edits: tuple[SourceEdit, ...]
    spec: str = "none"  # the --spec under which the bug is visible (and which runs it)
    killed_by: str | None = None  # the suite check meant to kill it (as ``Mutant.killed_by``)


SOURCE_MUTANTS: dict[str, SourceMutant] = {m.name: m for m in [
    SourceMutant(
        "greedy_argmax_bf16",
        "Greedy argmax taken over logits cast down to bfloat16 (the activation dtype), in the "
        "sampler plain decoding and the oracle's engine share: near the top, logits round "
        "together and the lowest token id wins.",
        (SourceEdit("sampler.py", "tokens = torch.argmax(logits, dim=-1).tolist()",
                    "tokens = torch.argmax(logits.to(torch.bfloat16), dim=-1).tolist()"),),
        killed_by="test_lossless.py::test_greedy_matches_reference[plain-batch-1]"),
    # One per bug class the class mutants plant as subclasses, here in the shared code itself:
    SourceMutant(
        "sampler_ignores_top_p",
        "Top-p ignored in the sampler plain decoding and verification share (sampling "
        "parameters): an oracle law built with the same sampler would agree with it, and the "
        "distribution tier would find no prompt with a small enough support and skip.",
        (SourceEdit("sampler.py", "    if params.top_p < 1.0:",
                    "    if params.top_p < 0.0:  # BUG: top-p never applied"),),
        spec="eagle",
        killed_by="test_distribution.py::test_sampled_tokens_follow_target_distribution[top-p]"),
    SourceMutant(
        "sampler_ignores_seed",
        "Every sampled draw is seeded as if the request's seed were 0 (reproducibility): draws "
        "stay correctly distributed per request, but distinct seeds give one stream.",
        (SourceEdit("sampler.py", "generator=draw_generator(seed, index)",
                    "generator=draw_generator(0, index)"),),
        spec="eagle",
        killed_by="test_distribution.py::test_sampled_tokens_follow_target_distribution[top-p]"),
    SourceMutant(
        "stop_string_one_token_late",
        "Stop strings are looked for in the text before the newest token (stop strings), in "
        "the finish check plain decoding and speculation share: a string is seen one token "
        "after the token that completed it.",
        (SourceEdit("stopping.py", "stop_string_cut(decode(output_ids), params.stop)",
                    "stop_string_cut(decode(output_ids[:-1]), params.stop)"),),
        spec="eagle",
        killed_by="test_lifecycle.py::test_stop_string_at_every_offset"),
    SourceMutant(
        "draft_steps_one_position_late",
        "The EAGLE draft loop places step-i nodes at s + i instead of s + i - 1 (acceptance "
        "regression): verification is untouched and output stays lossless; only acceptance "
        "drops, which only the golden traces see.",
        (SourceEdit("speculative/eagle.py", "positions = (seq[:, None] + (i - 1))",
                    "positions = (seq[:, None] + i)"),),
        spec="eagle",
        killed_by="test_golden.py::test_acceptance_matches_golden[chain-s3-n4]"),
]}


def apply_edits(mutant: SourceMutant, package: Path) -> None:
    """Apply ``mutant``'s edits to the package copy at ``package`` (PatchError, one line)."""
    for edit in mutant.edits:
        path = package / edit.path
        if not path.is_file():
            raise PatchError(f"source mutant {mutant.name}: refengine/{edit.path} does not exist")
        text = path.read_text()
        count = text.count(edit.search)
        if count != 1:
            raise PatchError(f"source mutant {mutant.name}: refengine/{edit.path}: the text to "
                             f"replace occurs {count} times, expected once: {edit.search!r}")
        path.write_text(text.replace(edit.search, edit.replace))
    (package / MARKER).write_text(mutant.name)


@contextmanager
def patched_refengine(mutant: SourceMutant) -> Iterator[Path]:
    """A temporary directory holding a patched copy of the installed ``refengine`` package,
    to put first on a subprocess's path; the bundled fixtures and golden traces are linked
    in, where the copy's ``refengine.data`` looks for them (checkout or wheel layout)."""
    import refengine
    from refengine.data import fixtures_root, golden_root

    source = Path(refengine.__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix=f"specgate-{mutant.name}-") as tmp:
        root = Path(tmp)
        package = root / "refengine"
        shutil.copytree(source, package, ignore=shutil.ignore_patterns(
            "__pycache__", "_fixtures", "_golden"))
        apply_edits(mutant, package)
        for link, target in (("fixtures", fixtures_root()), ("golden", golden_root())):
            (root / link).symlink_to(target, target_is_directory=True)
            (package / f"_{link}").symlink_to(target, target_is_directory=True)
        yield root


def run_patched(mutant: SourceMutant, args: list[str], python_path: tuple[Path, ...] = ()
                ) -> subprocess.CompletedProcess[str]:
    """``python -m pytest args`` with ``mutant``'s patched refengine imported under its real
    name (first on the path, and the working directory); ``python_path`` comes after it,
    before the current path. Plugin auto-loading is off, as in every suite run."""
    import conformance

    with patched_refengine(mutant) as root:
        here = Path(conformance.__file__).resolve().parent.parent  # where conformance lives
        path = [str(root), *map(str, python_path), str(here)]
        env = {**os.environ, MUTANT_ENV: mutant.name, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
               "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
        return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=root, env=env,
                              capture_output=True, text=True, check=False)


class SourceMutantBackend(RefEngineBackend):
    def __init__(self, mutant: SourceMutant) -> None:
        self.mutant = mutant
        self.name = f"mutant:{mutant.name}"


def source_mutant_backend(name: str, launcher: bool = False) -> SourceMutantBackend:
    """The backend of a source mutant: the patched reference engine this process imported.
    ``launcher``: the caller only checks it and runs the suite through
    ``conformance.run.suite``, which starts the patched process; the patch must apply
    (PatchError otherwise). Any other process that did not import the patched copy gets a
    ValueError: it would test the unpatched engine under the mutant's name."""
    import refengine

    mutant = SOURCE_MUTANTS[name]
    if launcher:
        with patched_refengine(mutant):
            return SourceMutantBackend(mutant)
    marker = Path(refengine.__file__).resolve().parent / MARKER
    carried = marker.read_text() if marker.exists() else None
    if os.environ.get(MUTANT_ENV) != name or carried != name:
        raise ValueError(f"mutant:{name} patches refengine's source: run it with specgate "
                         "certify or specgate mutants, which import the patched copy")
    return SourceMutantBackend(mutant)

"""What failed and what to do about it, for report.md and the console: each failure with its
message and the command that replays it (``specgate repro``, where the check left a repro
file), and what the known-failures file did (``conformance.run.known_failures``), each known
failure with its message and replay commands too."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from conformance.report.results import DEFAULT_MODEL, FLAT, KnownReport, Replay

NOT_REPLAYABLE = ("its scenario replays clean: what failed is this check's own assertion, not "
                  "one a replay checks")


@dataclass(frozen=True)
class Failure:
    """A failed check of a tier (``TierSummary.failures``): its message and what replays it."""

    check: str
    message: str
    replay: Replay | None = field(default=None, metadata=FLAT)


@dataclass(frozen=True)
class Rerun:
    """How the run was made, so one check can be run again exactly so: every option that
    changes what a check does, left out where it is certify's default."""

    backend: str
    spec: str
    profile: str = "gate"
    model: str = DEFAULT_MODEL
    draft_model: str | None = None
    graphs: str | None = None
    device: str = "cpu"

    def command(self, check: str) -> str:
        """``specgate certify --backend B --spec S ... --only '<id>'``, shell-quoted."""
        words = ["specgate", "certify", "--backend", self.backend, "--spec", self.spec]
        for option, value, default in (("--profile", self.profile, "gate"),
                                       ("--model", self.model, DEFAULT_MODEL),
                                       ("--draft-model", self.draft_model, None),
                                       ("--graphs", self.graphs, None),
                                       ("--device", self.device, "cpu")):
            if value != default:
                words += [option, str(value)]
        return " ".join(shlex.quote(w) for w in [*words, "--only", check])


def repro_command(backend: str, file: Path) -> str:
    """The exact command that replays a failure: its repro file (as the user can reach it),
    against the backend the run resolved. The file holds the spec configuration, so no
    ``--spec`` is needed."""
    return "specgate repro " + shlex.quote(str(file)) + " --backend " + shlex.quote(backend)


def _markdown(text: str) -> str:
    return f"`{text}`"


def _plain(text: str) -> str:
    return text


def replay_lines(replay: Replay | None, listed_repro: str | None, backend: str, where: Path,
                 code: Callable[[str], str] = _plain) -> list[str]:
    """What replays a failure, one line each (``code`` formats a command or a path): its repro
    file under the certificate directory ``where`` (or why it does not replay), the repro file a
    known-failures entry names (``listed_repro``)."""
    out = []
    if replay is not None and replay.repro_reproduces == "no":
        out.append(f"repro file {code(str(where / replay.repro))}: {NOT_REPLAYABLE}")
    elif replay is not None:
        why = replay.repro_not_replayed
        unknown = ((f" (not replayed: {why})" if why else " (not replayed)")
                   if replay.repro_reproduces == "not replayed" else "")
        out.append(f"replay: {code(repro_command(backend, where / replay.repro))}{unknown}")
    if listed_repro:
        out.append(f"listed repro: {code(repro_command(backend, Path(listed_repro)))}")
    return out


def first_line(message: object) -> str:
    """A message's first line, at most 200 characters: what the console shows of it."""
    text = str(message).strip()
    return text.splitlines()[0][:200] if text else ""


def failure_lines(failures: list[Failure], rerun: Rerun, where: Path) -> list[str]:
    """The "Failures" section of report.md (none if nothing failed): each failure with the
    command that reruns its check and, where its repro file reproduces it, the replay."""
    if not failures:
        return []
    out = ["## Failures", ""]
    for f in failures:
        out.append(f"- `{f.check}`: {f.message}")
        out.append(f"  - rerun: `{rerun.command(f.check)}`")
        out += [f"  - {line}" for line in replay_lines(f.replay, None, rerun.backend, where,
                                                       _markdown)]
    return [*out, ""]


# KnownReport's lists: key, what the console calls it, what report.md adds
_KINDS = (("known", "known failure", "failed, excused: they do not fail the gate"),
          ("stale", "stale", "listed, but passed: remove them from the file"),
          ("expired", "expired", "their date has passed: they excuse nothing"),
          ("not_run", "listed, did not run", "skipped or not claimed here"),
          ("unknown", "listed, no such check", "no check of this certificate has that id"))


def known_lines(known: KnownReport | None, backend: str, where: Path) -> list[str]:
    """The "Known failures" section of report.md (none without ``--known-failures``): each
    known failure with its message and what replays it (``backend``: the backend the run
    resolved; ``where``: the certificate directory)."""
    if known is None:
        return []
    out = ["## Known failures", "", f"From `{known.file}`"
           + (" (`--strict-known`: a stale entry fails the gate)." if known.strict else
              " (a stale entry is a warning; `--strict-known` makes it fail the gate)."), ""]
    for kind, name, why in _KINDS:
        items = known.kind(kind)
        if not items:
            continue
        out += [f"**{name}: {len(items)}** ({why})", ""]
        for item in items:
            until = f", until {item.expires}" if item.expires else ""
            now = f" (outcome: {item.outcome})" if item.outcome else ""
            out.append(f"- `{item.check}`: {item.reason}{until}{now}")
            if item.message:
                out.append(f"  - message: {' '.join(item.message.split())}")
            out += [f"  - {line}" for line in replay_lines(item.replay, item.listed_repro,
                                                           backend, where, _markdown)]
        out.append("")
    if not any(known.kind(kind) for kind, _, _ in _KINDS):
        out += ["No entry applies to this spec.", ""]
    return out


def console_lines(failures: list[Failure], rerun: Rerun, known: KnownReport | None,
                  where: Path) -> list[str]:
    """Plain lines under the console's tier table: each failure with the commands that rerun
    and replay it, and what the known-failures file did."""
    out = []
    for f in failures:
        out.append(f"  FAILED {f.check}: {first_line(f.message)}")
        out.append(f"    rerun: {rerun.command(f.check)}")
        out += [f"    {line}" for line in replay_lines(f.replay, None, rerun.backend, where)]
    if known is None:
        return out
    for kind, name, _ in _KINDS:
        for item in known.kind(kind):
            out.append(f"  {name}: {item.check}: {item.reason}")
            if item.message:
                out.append(f"    message: {first_line(item.message)}")
            out += [f"    {line}" for line in replay_lines(item.replay, item.listed_repro,
                                                           rerun.backend, where)]
    return out

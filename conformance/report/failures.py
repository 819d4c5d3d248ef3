"""What failed and what to do about it, for report.md and the console: each failure with its
message and the command that replays it (``specgate repro``, where the check left a repro
file), and what the known-failures file did (``conformance.run.known_failures``)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

Failure = dict[str, str]  # check, message[, repro, repro_reproduces] (``TierSummary.failures``)
NOT_REPLAYABLE = ("its scenario replays clean: what failed is this check's own assertion, not "
                  "one a replay checks")
Known = dict[str, object] | None    # ``KnownReport`` as report.json holds it
DEFAULT_MODEL = "tiny-code"         # certify's --model default


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


def repro_command(backend: str, where: Path, repro: str) -> str:
    """The exact command that replays a failure: the repro file under the certificate
    directory ``where`` (as the user named it), against the backend the run resolved. The
    file holds the spec configuration, so no ``--spec`` is needed."""
    return ("specgate repro " + shlex.quote(str(where / repro)) + " --backend "
            + shlex.quote(backend))


def failure_lines(failures: list[Failure], rerun: Rerun, where: Path) -> list[str]:
    """The "Failures" section of report.md (none if nothing failed): each failure with the
    command that reruns its check and, where its repro file reproduces it, the replay."""
    if not failures:
        return []
    out = ["## Failures", ""]
    for f in failures:
        out.append(f"- `{f['check']}`: {f['message']}")
        out.append(f"  - rerun: `{rerun.command(f['check'])}`")
        if f.get("repro") and f.get("repro_reproduces") == "no":
            out.append(f"  - repro file `{where / f['repro']}`: {NOT_REPLAYABLE}")
        elif f.get("repro"):
            unknown = (" (not replayed at the time: the check timed out, and so may a replay)"
                       if f.get("repro_reproduces") == "not replayed" else "")
            out.append(f"  - replay: `{repro_command(rerun.backend, where, f['repro'])}`"
                       f"{unknown}")
    return [*out, ""]


# KnownReport's lists: key, what the console calls it, what report.md adds
_KINDS = (("known", "known failure", "failed, excused: they do not fail the gate"),
          ("stale", "stale", "listed, but passed: remove them from the file"),
          ("expired", "expired", "their date has passed: they excuse nothing"),
          ("not_run", "listed, did not run", "skipped or not claimed here"),
          ("unknown", "listed, no such check", "no check of this certificate has that id"))


def known_lines(known: Known) -> list[str]:
    """The "Known failures" section of report.md (none without ``--known-failures``)."""
    if known is None:
        return []
    out = ["## Known failures", "", f"From `{known['file']}`"
           + (" (`--strict-known`: a stale entry fails the gate)." if known["strict"] else
              " (a stale entry is a warning; `--strict-known` makes it fail the gate)."), ""]
    for kind, name, why in _KINDS:
        items = known[kind]
        if not items:
            continue
        out += [f"**{name}: {len(items)}** ({why})", ""]
        for item in items:
            until = f", until {item['expires']}" if item["expires"] else ""
            now = f" (outcome: {item['outcome']})" if item["outcome"] else ""
            out.append(f"- `{item['check']}`: {item['reason']}{until}{now}")
        out.append("")
    if not any(known[kind] for kind, _, _ in _KINDS):
        out += ["No entry applies to this spec.", ""]
    return out


def console_lines(failures: list[Failure], rerun: Rerun, known: Known, where: Path
                  ) -> list[str]:
    """Plain lines under the console's tier table: each failure with the commands that rerun
    and replay it, and what the known-failures file did."""
    out = []
    for f in failures:
        first = f["message"].strip().splitlines()[0][:200] if f["message"].strip() else ""
        out.append(f"  FAILED {f['check']}: {first}")
        out.append(f"    rerun: {rerun.command(f['check'])}")
        if f.get("repro") and f.get("repro_reproduces") == "no":
            out.append(f"    repro file {where / f['repro']}: {NOT_REPLAYABLE}")
        elif f.get("repro"):
            out.append(f"    replay: {repro_command(rerun.backend, where, f['repro'])}")
    if known is not None:
        for kind, name, _ in _KINDS:
            out += [f"  {name}: {item['check']}: {item['reason']}" for item in known[kind]]
    return out

"""What failed and what to do about it, for report.md and the console: each failure with its
message and the command that replays it (``specgate repro``, where the check left a repro
file), and what the known-failures file did (``conformance.run.known_failures``)."""

from __future__ import annotations

import shlex
from pathlib import Path

Failure = dict[str, str]  # check, message[, repro, repro_reproduces] (``TierSummary.failures``)
NOT_REPLAYABLE = ("its scenario replays clean: what failed is this check's own assertion, not "
                  "one a replay checks; rerun the check alone with certify --only")
Known = dict[str, object] | None    # ``KnownReport`` as report.json holds it


def repro_command(backend: str, where: Path, repro: str) -> str:
    """The exact command that replays a failure: the repro file under the certificate
    directory ``where`` (as the user named it), against the backend the run resolved. The
    file holds the spec configuration, so no ``--spec`` is needed."""
    return ("specgate repro " + shlex.quote(str(where / repro)) + " --backend "
            + shlex.quote(backend))


def failure_lines(failures: list[Failure], backend: str, where: Path) -> list[str]:
    """The "Failures" section of report.md (none if nothing failed); ``backend``: what the
    run resolved the backend from."""
    if not failures:
        return []
    out = ["## Failures", ""]
    for f in failures:
        out.append(f"- `{f['check']}`: {f['message']}")
        if f.get("repro") and f.get("repro_reproduces") == "no":
            out.append(f"  - repro file `{where / f['repro']}`: {NOT_REPLAYABLE}")
        elif f.get("repro"):
            unknown = (" (not replayed at the time: the check timed out, and so may a replay)"
                       if f.get("repro_reproduces") == "not replayed" else "")
            out.append(f"  - replay: `{repro_command(backend, where, f['repro'])}`{unknown}")
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


def console_lines(failures: list[Failure], backend: str, known: Known, where: Path
                  ) -> list[str]:
    """Plain lines under the console's tier table: each failure with its replay command, and
    what the known-failures file did."""
    out = []
    for f in failures:
        first = f["message"].strip().splitlines()[0][:200] if f["message"].strip() else ""
        out.append(f"  FAILED {f['check']}: {first}")
        if f.get("repro") and f.get("repro_reproduces") == "no":
            out.append(f"    repro file {where / f['repro']}: {NOT_REPLAYABLE}")
        elif f.get("repro"):
            out.append(f"    replay: {repro_command(backend, where, f['repro'])}")
    if known is not None:
        for kind, name, _ in _KINDS:
            out += [f"  {name}: {item['check']}: {item['reason']}" for item in known[kind]]
    return out

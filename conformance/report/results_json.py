"""The JSON form of a run's results, written and read here only.

``dump_results`` / ``load_results``: the results file the plugin writes for ``specgate
certify``, versioned (``results_version``). ``results_from_report``: a certificate's report.json
read back as the results it was built from (``specgate report merge``; the shards' files come
from other machines and are read bounded by ``conformance.report.cert_dirs``). ``jsonable``:
any of the report's dataclasses as JSON values (report.json is written with it), its ``OMIT``
and ``FLAT`` fields as ``conformance.report.results`` says, capabilities as the contract writes
them.

Loading checks the type of every field: another version, a missing field, a wrong type or an
unknown outcome is a ValueError of one line naming the file, the field and the problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import TypeGuard, TypeVar

from conformance.contract import FLAG_NAMES, Capabilities
from conformance.report.results import (
    KNOWN_KINDS,
    BackendIdentity,
    CheckRow,
    ConfigRecord,
    JsonValue,
    KnownItem,
    KnownReport,
    Replay,
    RunResults,
    Scalar,
)
from conformance.report.verdict import OUTCOMES

RESULTS_VERSION = 1
_CAPABILITY_VALUES = ("algorithms", "precision", "page_multiple")  # the rest are flags
T = TypeVar("T")


def _shown(value: object) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def is_text(value: object) -> TypeGuard[str]:
    return isinstance(value, str)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # True is no count


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_flag(value: object) -> TypeGuard[bool]:
    return isinstance(value, bool)


def is_scalar(value: object) -> TypeGuard[Scalar]:
    return value is None or isinstance(value, (str, int, float, bool))


def is_json(value: object) -> TypeGuard[JsonValue]:
    if isinstance(value, list):
        return all(is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json(v) for k, v in value.items())
    return is_scalar(value)


def json_value(value: object, where: str) -> JsonValue:
    """``value`` (a check's figure) as a JSON value, a tuple as a list; ValueError naming
    ``where`` if it holds anything else."""
    if isinstance(value, (list, tuple)):
        return [json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: json_value(v, f"{where}.{k}") for k, v in value.items()}
    if is_scalar(value):
        return value
    raise ValueError(f"{where}: not a JSON value: {_shown(value)}")


class _Object:
    """A JSON object being read: each field taken with its type checked (``where``: its path in
    the document, "" at the top)."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise ValueError(f"{where or 'the document'}: expected an object, got "
                             f"{_shown(value)}")
        self.data: dict[str, object] = value
        self.where = where

    def at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _value(self, key: str, omittable: bool) -> object:
        if key in self.data:
            return self.data[key]
        if omittable:
            return None
        raise ValueError(f"{self.where or 'the document'}: missing field {key!r}")

    def _wrong(self, key: str, what: str, value: object) -> ValueError:
        return ValueError(f"{self.at(key)}: expected {what}, got {_shown(value)}")

    def take(self, key: str, ok: Callable[[object], TypeGuard[T]], what: str) -> T:
        value = self._value(key, False)
        if ok(value):
            return value
        raise self._wrong(key, what, value)

    def maybe(self, key: str, ok: Callable[[object], TypeGuard[T]], what: str,
              omittable: bool = False) -> T | None:
        """The field, or None where it is null (or, if ``omittable``, absent)."""
        value = self._value(key, omittable)
        if value is None:
            return None
        if ok(value):
            return value
        raise self._wrong(key, f"{what} or null", value)

    def array(self, key: str, omittable: bool = False) -> Iterator[tuple[object, str]]:
        """Each item of an array field with its path."""
        value = self._value(key, omittable)
        if value is None and omittable:
            return
        if not isinstance(value, list):
            raise self._wrong(key, "an array", value)
        yield from ((item, f"{self.at(key)}[{i}]") for i, item in enumerate(value))

    def items(self, key: str, ok: Callable[[object], TypeGuard[T]], what: str,
              omittable: bool = False) -> list[T]:
        found = []
        for item, where in self.array(key, omittable):
            if not ok(item):
                raise ValueError(f"{where}: expected {what}, got {_shown(item)}")
            found.append(item)
        return found

    def mapping(self, key: str, ok: Callable[[object], TypeGuard[T]], what: str
                ) -> dict[str, T]:
        inner = self.obj(key)
        return {name: inner.take(name, ok, what) for name in inner.data}

    def obj(self, key: str) -> _Object:
        return _Object(self._value(key, False), self.at(key))

    def obj_or_none(self, key: str) -> _Object | None:
        value = self._value(key, False)
        return None if value is None else _Object(value, self.at(key))


def _row(value: object, where: str) -> CheckRow:
    r = _Object(value, where)
    outcome = r.take("outcome", is_text, "a string")
    if outcome not in OUTCOMES:
        raise ValueError(f"{r.at('outcome')}: unknown outcome {outcome!r:.60} (known: "
                         f"{', '.join(OUTCOMES)})")
    return CheckRow(
        nodeid=r.take("nodeid", is_text, "a string"), tier=r.take("tier", is_text, "a string"),
        outcome=outcome, duration=float(r.take("duration", is_number, "a number")),
        requires=r.take("requires", is_text, "a string"),
        message=r.take("message", is_text, "a string"),
        figures=r.mapping("figures", is_json, "a JSON value"),
        self_check=bool(r.maybe("self_check", is_flag, "a boolean", omittable=True)),
        threads=r.maybe("threads", is_int, "an integer", omittable=True),
        repro=r.maybe("repro", is_text, "a string", omittable=True),
        repro_reproduces=r.maybe("repro_reproduces", is_flag, "a boolean", omittable=True),
        repro_not_replayed=r.maybe("repro_not_replayed", is_text, "a string", omittable=True),
        progress=tuple(r.items("progress", is_text, "a string", omittable=True)),
        known_reason=r.maybe("known_reason", is_text, "a string", omittable=True))


def _known_item(value: object, where: str) -> KnownItem:
    r = _Object(value, where)
    repro = r.maybe("repro", is_text, "a string", omittable=True)
    replay = None if repro is None else Replay(
        repro, r.take("repro_reproduces", is_text, "a string"),
        r.maybe("repro_not_replayed", is_text, "a string", omittable=True))
    return KnownItem(
        check=r.take("check", is_text, "a string"), reason=r.take("reason", is_text, "a string"),
        outcome=r.maybe("outcome", is_text, "a string"),
        expires=r.maybe("expires", is_text, "a string"),
        message=r.maybe("message", is_text, "a string", omittable=True), replay=replay,
        listed_repro=r.maybe("listed_repro", is_text, "a string", omittable=True))


def _known_report(r: _Object | None) -> KnownReport | None:
    if r is None:
        return None
    lists = {kind: tuple(_known_item(v, w) for v, w in r.array(kind)) for kind in KNOWN_KINDS}
    return KnownReport(r.take("file", is_text, "a string"), r.take("strict", is_flag, "a boolean"),
                       lists["known"], lists["stale"], lists["expired"], lists["not_run"],
                       lists["unknown"])


def _capabilities(r: _Object) -> Capabilities:
    unknown = sorted(set(r.data) - FLAG_NAMES - set(_CAPABILITY_VALUES))
    if unknown:
        raise ValueError(f"{r.where}: unknown capabilities {', '.join(unknown)}")
    flags = {name: r.take(name, is_flag, "a boolean") for name in r.data if name in FLAG_NAMES}
    try:
        declared = Capabilities(frozenset(r.items("algorithms", is_text, "a string")),
                                r.take("precision", is_text, "a string"),
                                page_multiple=r.take("page_multiple", is_int, "an integer"))
    except ValueError as err:
        raise ValueError(f"{r.where}: {err}") from None
    return replace(declared, **flags)


def _backend(r: _Object) -> BackendIdentity:
    return BackendIdentity(r.take("name", is_text, "a string"),
                           r.take("version", is_text, "a string"),
                           r.take("resolved_from", is_text, "a string"),
                           r.maybe("contract_version", is_int, "an integer"))


def _config(value: object, where: str) -> ConfigRecord:
    """A configuration as the results file writes it: its id beside its parameters."""
    r = _Object(value, where)
    return ConfigRecord(r.take("id", is_text, "a string"),
                        {k: r.take(k, is_scalar, "a JSON scalar") for k in r.data if k != "id"})


def _report_config(value: object, where: str) -> ConfigRecord:
    """A configuration as report.json writes it (``ConfigRun``): its id and parameters."""
    r = _Object(value, where)
    return ConfigRecord(r.take("id", is_text, "a string"),
                        r.mapping("parameters", is_scalar, "a JSON scalar"))


def _results(r: _Object, report: bool) -> RunResults:
    """RunResults from the results file or (``report``) a certificate's report.json: the same
    fields, but report.json names ``--require`` ``required``, writes each configuration with
    what was measured of it, and has no ``collected`` (only an interrupted run's tiers use it)."""
    config = _report_config if report else _config
    return RunResults(
        backend=_backend(r.obj("backend")), capabilities=_capabilities(r.obj("capabilities")),
        spec=r.take("spec", is_text, "a string"), profile=r.take("profile", is_text, "a string"),
        checks=tuple(_row(v, w) for v, w in r.array("checks")),
        unclaimed_reasons=r.mapping("unclaimed_reasons", is_text, "a string"),
        configurations=tuple(config(v, w) for v, w in r.array("configurations")),
        precision=r.take("precision", is_text, "a string"),
        case_timeout=r.maybe("case_timeout", is_number, "a number"),
        threads=tuple(r.items("threads", is_int, "an integer")),
        graphs=r.maybe("graphs", is_text, "a string"), device=r.take("device", is_text, "a string"),
        model=r.take("model", is_text, "a string"),
        draft_model=r.maybe("draft_model", is_text, "a string"),
        environment=r.mapping("environment", is_scalar, "a JSON scalar"),
        vacuous=r.maybe("vacuous", is_text, "a string"),
        collected={} if report else r.mapping("collected", is_int, "an integer"),
        interrupted=r.take("interrupted", is_flag, "a boolean"),
        specgate_version=r.take("specgate_version", is_text, "a string"),
        shard=r.maybe("shard", is_text, "a string"),
        selection=r.maybe("selection", is_text, "a string"),
        require=r.maybe("required" if report else "require", is_text, "a string"),
        known_failures=_known_report(r.obj_or_none("known_failures")))


def results_from_json(data: object, where: str) -> RunResults:
    """The results of a parsed results file; ValueError (one line, naming ``where``) if it is
    of another version or malformed."""
    try:
        r = _Object(data, "")
        version = r.take("results_version", is_int, "an integer")
        if version != RESULTS_VERSION:
            raise ValueError(f"results_version {version} is not {RESULTS_VERSION} (written by "
                             "another specgate)")
        return _results(r, report=False)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def load_results(text: str, where: str) -> RunResults:
    """The results in a results file's text (see ``results_from_json``)."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    return results_from_json(data, where)


def read_results(path: Path) -> RunResults:
    return load_results(path.read_text(), str(path))


def results_from_report(data: object) -> RunResults:
    """The results a certificate's report.json (already parsed) was built from; ValueError
    (one line naming the field) if it lacks one or holds the wrong type."""
    return _results(_Object(data, ""), report=True)


def fields_json(value: object) -> dict[str, JsonValue]:
    """A dataclass of the report (``value``) as a JSON object: an ``OMIT`` field left out while
    it holds its default, a ``FLAT`` one's fields written into this object."""
    if not is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"not a dataclass instance: {_shown(value)}")
    out: dict[str, JsonValue] = {}
    for f in fields(value):
        held = getattr(value, f.name)
        if f.metadata.get("omit") and held == f.default:
            continue
        encoded = jsonable(held)
        if not f.metadata.get("flat"):
            out[f.name] = encoded
        elif isinstance(encoded, dict):
            out.update(encoded)
    return out


def jsonable(value: object) -> JsonValue:
    """``value`` (a dataclass of the report, or what its fields hold) as JSON values."""
    if isinstance(value, Capabilities):
        return json_value(value.as_dict(), "capabilities")
    if is_dataclass(value):
        return fields_json(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return json_value(value, type(value).__name__)


def dump_results(results: RunResults) -> str:
    """The results file's text."""
    return json.dumps({"results_version": RESULTS_VERSION, **fields_json(results)}, indent=1)

"""The repro file: a deterministic scenario driven through the adapter, as versioned JSON.

A scenario is what one check did to a backend, with nothing of the check's own code: for every
engine instance it opened (a *run*), the ``OpenConfig`` and the driver's actions in order
(submit, step, abort, open/close a session; a session turn is a submit naming its session).
It holds token ids, not text, so any backend with the same tokenizer replays it. What replay
checks is fixed by the format (``docs/repro.md``): the driver's invariants after every step,
every greedy request's tokens against the reference as they stream, finish reasons, that each
run ends idle, and (for a backend claiming ``seeded_sampling``) that a seeded sampled request
comes out the same every time it runs, and (version 2) the accept lengths a submit records: a
golden-tier failure's, so replaying it shows the acceptance that failed. The file also names the
check it came from and how that check failed. A file is written in the lowest version that
holds it (one without accept lengths: version 1), laid out by ``compact_json`` (a list of
token ids on one line).

``load`` refuses an unknown version, an unknown or missing field and a bad value with one line
(``ReproFileError``) naming where in the file the problem is. A file is data from a stranger
(it travels in bug reports): besides the bounds every untrusted file gets
(``specwire.untrusted``), every count in it is bounded (``LIMITS``), so no file can ask a
replay for more steps, tokens or memory than a real check ever records, many times over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from conformance.contract import OpenConfig, SamplingParams, SpecConfig
from conformance.repro.compact_json import dumps
from specwire.untrusted import MiB, UntrustedFileError, parse_json, read_text

VERSION = 2  # the newest this specgate reads and writes
FORMAT_KEY = "specgate_repro"
# What replaying a file of each version checks; every file states its version's list, so a
# reader need not know the version's rules (``docs/repro.md``).
_CHECKS_V1 = ("invariants after every step",
              "greedy outputs against the reference as they stream", "finish reasons",
              "every run ends idle",
              "a seeded sampled request comes out the same every time it runs")
CHECKS = {1: _CHECKS_V1,
          2: (*_CHECKS_V1, "accept lengths per verify step where a submit records them")}


MAX_FILE_BYTES = 32 * MiB
# The most a file may ask for, far above anything the suite records (its largest pool is 65,536
# tokens, its longest step run a few thousand): enough for a hand-written repro, never a hang
# or a multi-GB allocation.
LIMITS = {"runs": 1_000, "actions": 100_000, "times": 100_000, "prompt_ids": 65_536,
          "max_new_tokens": 65_536, "stop_token_ids": 1_024, "stop": 64, "text": 1_024,
          "kv_pool_tokens": 2**20, "page_size": 4_096, "max_running_requests": 4_096,
          "max_prefill_tokens": 2**20, "retract_every": 2**20, "seed": 2**63 - 1,
          "token_id": 2**31 - 1, "name": 256, "steps": 100_000}
# OpenConfig's fields that are integers (the rest: model, spec, graph_executor, device)
_CONFIG_INTS = ("kv_pool_tokens", "page_size", "max_running_requests", "max_prefill_tokens",
                "seed", "retract_every")


class ReproFileError(ValueError):
    """A repro file that cannot be replayed; the message is one line naming where and why."""


@dataclass(frozen=True)
class Submit:
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None  # a session turn: the prompt holds only the turn's new tokens
    # tokens its first verify steps must emit, one entry per step (version 2; a greedy request
    # under speculation): what a golden check compared exactly
    accept_lens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Step:
    times: int = 1  # consecutive steps, kept as one action


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class OpenSession:
    session: str


@dataclass(frozen=True)
class CloseSession:
    session: str


Action = Submit | Step | Abort | OpenSession | CloseSession
OPS: dict[str, type[Action]] = {"submit": Submit, "step": Step, "abort": Abort,
                                "open_session": OpenSession, "close_session": CloseSession}
OP_OF = {cls: op for op, cls in OPS.items()}


def describe(action: Action) -> str:
    """One line, as the replay's divergence block shows it."""
    if isinstance(action, Submit):
        turn = f" as a turn of session {action.session!r}" if action.session else ""
        return (f"submit {action.rid!r}{turn}: {len(action.prompt_ids)}-token prompt, "
                f"{action.params}")
    if isinstance(action, Step):
        return "step" if action.times == 1 else f"step x{action.times}"
    if isinstance(action, Abort):
        return f"abort {action.rid!r}"
    return f"{OP_OF[type(action)].replace('_', ' ')} {action.session!r}"


@dataclass(frozen=True)
class Run:
    """One engine instance: opened with ``config``, driven by ``actions``, then run until every
    request it holds has finished."""

    config: OpenConfig
    actions: tuple[Action, ...]


@dataclass(frozen=True)
class Scenario:
    runs: tuple[Run, ...]
    check: str = ""          # the suite check (or fuzz example) it was recorded from
    failure: str = ""        # how that check failed, as it said
    backend: str = ""        # the backend it failed on, as named on the command line

    @property
    def action_count(self) -> int:
        return sum(len(r.actions) for r in self.runs)

    @property
    def version(self) -> int:
        """The lowest format version that holds it."""
        return 2 if any(isinstance(a, Submit) and a.accept_lens is not None
                        for r in self.runs for a in r.actions) else 1


# ---- writing ---------------------------------------------------------------------------------

def _action_json(action: Action) -> dict[str, Any]:
    body = {"op": OP_OF[type(action)], **asdict(action)}
    if isinstance(action, Submit):
        body["prompt_ids"] = list(action.prompt_ids)
        body["params"] = _params_json(action.params)
        for name in ("session", "accept_lens"):
            if body[name] is None:
                del body[name]
        if action.accept_lens is not None:
            body["accept_lens"] = list(action.accept_lens)
    return body


def _params_json(params: SamplingParams) -> dict[str, Any]:
    """Only what differs from the defaults: a short file, and new defaults stay explicit."""
    default = SamplingParams()
    return {f.name: (list(v) if isinstance(v, tuple) else v)
            for f in fields(params) if (v := getattr(params, f.name)) != getattr(default, f.name)}


def _config_json(config: OpenConfig) -> dict[str, Any]:
    body = asdict(config)
    body["spec"] = None if config.spec is None else asdict(config.spec)
    return body


def to_json(scenario: Scenario) -> str:
    version = scenario.version
    doc = {FORMAT_KEY: version, "checks": list(CHECKS[version]), "check": scenario.check,
           "failure": scenario.failure, "backend": scenario.backend,
           "runs": [{"config": _config_json(r.config),
                     "actions": [_action_json(a) for a in r.actions]} for r in scenario.runs]}
    return dumps(doc) + "\n"


def save(scenario: Scenario, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(scenario))


# ---- reading ---------------------------------------------------------------------------------

def _fields(where: str, body: object, cls: type, required: frozenset[str],
            extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``body`` as keyword arguments of ``cls``: a JSON object with only its fields."""
    if not isinstance(body, Mapping):
        raise ReproFileError(f"{where}: expected an object, got {type(body).__name__}")
    known = {f.name for f in fields(cls)} | extra
    unknown = sorted(set(body) - known)
    if unknown:
        raise ReproFileError(f"{where}: unknown field {unknown[0]!r:.80} (known: "
                             f"{', '.join(sorted(known))})")
    missing = sorted(required - set(body))
    if missing:
        raise ReproFileError(f"{where}: missing field {missing[0]!r}")
    return {k: v for k, v in body.items() if k not in extra}


def _build(where: str, cls: type, kwargs: dict[str, Any]) -> Any:
    """``cls(**kwargs)``, its ValueError (which names the field) as one line at ``where``."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise ReproFileError(f"{where}: {str(err)[:300]}") from None


def _string(where: str, value: object, limit: int = LIMITS["name"]) -> str:
    if not isinstance(value, str) or not value:
        raise ReproFileError(f"{where}: expected a non-empty string, got {value!r:.80}")
    if len(value) > limit:
        raise ReproFileError(f"{where}: longer than {limit} characters")
    return value


def _count(where: str, value: object, least: int, limit: int) -> int:
    """An integer in ``least..limit`` (a bool is not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= limit:
        raise ReproFileError(f"{where}: expected an integer from {least} to {limit}, "
                             f"got {value!r:.40}")
    return value


def _token_ids(where: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= LIMITS["token_id"]
            for t in value):
        raise ReproFileError(f"{where}: expected a non-empty list of token ids (integers >= 0)")
    if len(value) > LIMITS["prompt_ids"]:
        raise ReproFileError(f"{where}: more than {LIMITS['prompt_ids']} tokens")
    return tuple(value)


def _params(where: str, body: object) -> SamplingParams:
    kwargs = _fields(where, body, SamplingParams, frozenset())
    if "max_new_tokens" in kwargs:
        _count(f"{where}.max_new_tokens", kwargs["max_new_tokens"], 1, LIMITS["max_new_tokens"])
    if "seed" in kwargs and kwargs["seed"] is not None:
        _count(f"{where}.seed", kwargs["seed"], 0, LIMITS["seed"])
    for name in ("stop_token_ids", "stop"):
        items = kwargs.get(name, [])
        if isinstance(items, list) and len(items) > LIMITS[name]:
            raise ReproFileError(f"{where}.{name}: more than {LIMITS[name]} entries")
    for text in kwargs.get("stop", []) if isinstance(kwargs.get("stop"), list) else []:
        if isinstance(text, str) and len(text) > LIMITS["text"]:
            raise ReproFileError(f"{where}.stop: a stop string longer than {LIMITS['text']}")
    return _build(where, SamplingParams, kwargs)


def _accept_lens(where: str, value: object, spec: SpecConfig | None,
                 params: SamplingParams) -> tuple[int, ...]:
    """Tokens per verify step: each from 1 to the chain's depth plus the bonus token, fewer in
    all than the request's ``max_new_tokens`` (its first token comes from prefill), for a
    greedy request under speculation (where acceptance is determined)."""
    if spec is None or not params.greedy:
        raise ReproFileError(f"{where}: accept lengths are recorded for greedy requests under "
                             "speculation only")
    if not isinstance(value, list) or not value:
        raise ReproFileError(f"{where}: expected a non-empty list of integers")
    lens = tuple(_count(f"{where}[{i}]", n, 1, spec.num_steps + 1) for i, n in enumerate(value))
    if sum(lens) >= params.max_new_tokens:
        raise ReproFileError(f"{where}: {sum(lens)} tokens from verify steps, more than "
                             f"max_new_tokens {params.max_new_tokens} leaves after prefill's")
    return lens


def _action(where: str, body: object, version: int, spec: SpecConfig | None) -> Action:
    if not isinstance(body, Mapping) or not isinstance(body.get("op"), str) \
            or body["op"] not in OPS:
        op = body.get("op") if isinstance(body, Mapping) else body
        raise ReproFileError(f"{where}: unknown op {op!r:.80} (known: {', '.join(OPS)})")
    if version < 2 and "accept_lens" in body:
        raise ReproFileError(f"{where}: field 'accept_lens' needs format version 2, the file "
                             f"says {version}")
    cls = OPS[body["op"]]
    required = frozenset({"rid", "prompt_ids"} if cls is Submit else
                         set() if cls is Step else {f.name for f in fields(cls)})
    kwargs = _fields(where, body, cls, required, extra=frozenset({"op"}))
    if cls is Submit:
        kwargs["rid"] = _string(f"{where}.rid", kwargs["rid"])
        kwargs["prompt_ids"] = _token_ids(f"{where}.prompt_ids", kwargs["prompt_ids"])
        kwargs["params"] = _params(f"{where}.params", kwargs.get("params", {}))
        if kwargs.get("session") is not None:
            kwargs["session"] = _string(f"{where}.session", kwargs["session"])
        if kwargs.get("accept_lens") is not None:
            kwargs["accept_lens"] = _accept_lens(f"{where}.accept_lens", kwargs["accept_lens"],
                                                 spec, kwargs["params"])
    elif cls is Step:
        _count(f"{where}.times", kwargs.get("times", 1), 1, LIMITS["times"])
    else:
        for name, value in kwargs.items():
            kwargs[name] = _string(f"{where}.{name}", value)
    return _build(where, cls, kwargs)


def _config(where: str, body: object) -> OpenConfig:
    kwargs = _fields(where, body, OpenConfig, frozenset({"model"}))
    spec = kwargs.get("spec")
    if spec is not None:
        spec_kwargs = _fields(f"{where}.spec", spec, SpecConfig, frozenset())
        for name in ("num_steps", "topk", "num_draft_tokens"):
            if name in spec_kwargs:
                _count(f"{where}.spec.{name}", spec_kwargs[name], 1, LIMITS["name"])
        # "" names no draft (an n-gram config's); SpecConfig says where that is allowed.
        if spec_kwargs.get("draft_model", "") != "":
            _string(f"{where}.spec.draft_model", spec_kwargs["draft_model"], LIMITS["text"])
        kwargs["spec"] = _build(f"{where}.spec", SpecConfig, spec_kwargs)
    for name in _CONFIG_INTS:
        if kwargs.get(name) is not None:
            _count(f"{where}.{name}", kwargs[name], 0, LIMITS[name])
    for name in ("graph_executor", "device"):
        if kwargs.get(name) is not None:
            _string(f"{where}.{name}", kwargs[name])
    kwargs["model"] = _string(f"{where}.model", kwargs["model"], LIMITS["text"])
    return _build(where, OpenConfig, kwargs)


def parse(text: str, source: str = "repro file") -> Scenario:
    try:
        doc = parse_json(text, source)
    except UntrustedFileError as err:
        raise ReproFileError(str(err)) from None
    if not isinstance(doc, Mapping) or FORMAT_KEY not in doc:
        raise ReproFileError(f"{source}: not a specgate repro file (no {FORMAT_KEY!r} field)")
    version = doc[FORMAT_KEY]
    if not isinstance(version, int) or isinstance(version, bool) or version not in CHECKS:
        raise ReproFileError(f"{source}: repro format version {version!r:.40} is not "
                             f"supported (this specgate reads versions 1 to {VERSION})")
    top = _fields(source, doc, Scenario, frozenset({"runs"}),
                  extra=frozenset({FORMAT_KEY, "checks"}))
    if doc.get("checks", list(CHECKS[version])) != list(CHECKS[version]):
        raise ReproFileError(f"{source}: checks: version {version} replays exactly "
                             f"{list(CHECKS[version])}, the file asks for "
                             f"{doc['checks']!r:.200}")
    runs = top["runs"]
    if not isinstance(runs, list) or not runs or len(runs) > LIMITS["runs"]:
        raise ReproFileError(f"{source}: runs: expected a non-empty list of at most "
                             f"{LIMITS['runs']}")
    built = []
    for i, body in enumerate(runs):
        where = f"{source}: runs[{i}]"
        kwargs = _fields(where, body, Run, frozenset({"config", "actions"}))
        if not isinstance(kwargs["actions"], list) or len(kwargs["actions"]) > LIMITS["actions"]:
            raise ReproFileError(f"{where}.actions: expected a list of at most "
                                 f"{LIMITS['actions']}")
        config = _config(f"{where}.config", kwargs["config"])
        built.append(Run(config, tuple(_action(f"{where}.actions[{j}]", a, version, config.spec)
                                       for j, a in enumerate(kwargs["actions"]))))
    steps = sum(a.times for r in built for a in r.actions if isinstance(a, Step))
    if steps > LIMITS["steps"]:
        raise ReproFileError(f"{source}: asks for {steps} steps in all, more than "
                             f"{LIMITS['steps']}")
    for name in ("check", "failure", "backend"):
        if not isinstance(top.get(name, ""), str):
            raise ReproFileError(f"{source}: {name}: expected a string")
    return Scenario(tuple(built), top.get("check", ""), top.get("failure", ""),
                    top.get("backend", ""))


def load(path: Path) -> Scenario:
    try:
        text = read_text(path, str(path), MAX_FILE_BYTES)
    except UntrustedFileError as err:
        raise ReproFileError(str(err)) from None
    return parse(text, str(path))

"""Golden acceptance traces: record, load, compare.

``golden/<config>[@<draft model>]/<trace>.json`` holds, per request, the greedy output, the
tokens emitted per verify step (``accept_lens``) and ``fragile_from``: the first output index
where the target's top-2 logit margin is below ``FRAGILE_MARGIN`` — from there on a
numerically different (but correct) implementation may legitimately choose the other token.
Traces catch draft-side regressions that output checks cannot see: a worse draft is still
lossless, only slower.
A prompt set has a trace per scenario (``golden_scenarios``): the set in one batch, its long
prompts under chunked prefill (the trace's ``max_prefill_tokens``), two-turn sessions
(a turn's ``session_id``; its ``prompt_ids`` are the turn's new tokens), and a batch under
forced retraction (the trace's ``retract_every``; each request's ``retractions``). A session
turn after one with a fragile position is fragile from 0: its context may legitimately differ.

A configuration drafting with the draft model the suite's specs name for its algorithm
(``tiny-code-eagle`` for EAGLE) keeps its traces under ``<config>``; one drafting with another
bundled head (``certify|golden --draft-model``, e.g. ``tiny-code-eagle-vllm``) under
``<config>@<draft model>``, beside them, so a backend running that head is held to that head's
traces and never to another's.

Files are written only by ``specgate golden record`` (serially, in one process). The engine's
own tests compare exactly (syrupy, ``GoldenExtension``); other backends that claim
``reference_draft`` are compared tolerantly (``compare``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar

from conformance.checks.golden_scenarios import PLAIN, Planned, Scenario, sessions_of, waves
from conformance.checks.oracle import top2_margins
from conformance.plan.prompts import load_prompt_set
from conformance.plan.specs import SPECS, config_id
from refengine import Engine, EngineConfig, FinishEvent, RetractEvent, SamplingParams, SpecConfig
from refengine.data import fixture_names, fixtures_root, golden_root

if TYPE_CHECKING:
    from syrupy.data import SnapshotCollection
    from syrupy.extensions.json import JSONSnapshotExtension
    from syrupy.location import PyTestLocation
    from syrupy.types import (
        PropertyFilter,
        PropertyMatcher,
        SerializableData,
        SerializedData,
        SnapshotIndex,
    )

SCHEMA_VERSION = 1
FRAGILE_MARGIN = 1e-3     # logits: a closer top-2 is a near-tie
TAU_RTOL = 0.05           # mean tau of another backend within 5% of the golden one
RECORD_MAX_NEW_TOKENS = 128
# Fields a trace leaves out of its file when unset, so traces without them keep their bytes.
UNSET_OMITTED = ("session_id", "max_prefill_tokens", "retractions", "retract_every")
V = TypeVar("V")


class AcceptanceSummary(TypedDict):
    """``summarize``: mean tau (None without verify steps), the verify steps it is over, and
    per-position acceptance."""

    mean_tau: float | None
    verify_steps: int
    per_position_acceptance: list[float]


@dataclass
class GoldenRequest:
    id: str
    prompt_ids: list[int]
    output_ids: list[int]
    accept_lens: list[int]
    fragile_from: int | None
    session_id: str | None = None  # a session's turn, after the session's earlier turns
    retractions: int | None = None  # times the forced-retraction hook retracted it (None: off)

    def exact_upto(self, produced: int) -> int:
        """The output indices a run that produced ``produced`` of its tokens must match
        exactly: those before its first fragile position."""
        return min(produced, len(self.output_ids) if self.fragile_from is None
                   else self.fragile_from)

    def steps_within(self, lens: list[int], upto: int) -> int:
        """``comparable_steps`` of ``lens`` (its own or a run's) for this request: a
        retraction's re-prefill emits a token of no verify step, and where it fell is not
        recorded, so each one takes a token off ``upto``."""
        return comparable_steps(lens, upto - (self.retractions or 0))

    def exact_steps(self, produced: int) -> int:
        """How many of its leading verify steps such a run must match exactly."""
        return self.steps_within(self.accept_lens, self.exact_upto(produced))


@dataclass
class GoldenTrace:
    schema_version: int
    fixtures: dict[str, str]
    spec: SpecConfig
    sampling: SamplingParams
    prompt_set: str
    requests: list[GoldenRequest]
    summary: AcceptanceSummary
    max_prefill_tokens: int | None = None  # the prefill budget it ran under (None: default)
    retract_every: int | None = None  # the forced-retraction hook it ran under (None: off)

    def to_json(self) -> str:
        raw = _without_unset(asdict(self))
        raw["requests"] = [_without_unset(r) for r in raw["requests"]]
        return json.dumps(raw, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> GoldenTrace:
        raw = json.loads(text)
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"golden trace schema {raw.get('schema_version')} != {SCHEMA_VERSION}")
        raw["requests"] = [GoldenRequest(**r) for r in raw["requests"]]
        raw["spec"] = SpecConfig(**raw["spec"])
        raw["sampling"] = SamplingParams(**raw["sampling"])
        return cls(**raw)


def _without_unset(raw: dict[str, V]) -> dict[str, V]:
    return {k: v for k, v in raw.items() if not (k in UNSET_OMITTED and v is None)}


def summarize(accept_lens: list[list[int]], num_steps: int) -> AcceptanceSummary:
    """Mean tau (tokens per verify, bonus included) and per-position acceptance: the share of
    verify steps whose j-th draft token was accepted, j = 1..num_steps."""
    steps = [n for lens in accept_lens for n in lens]
    if not steps:
        return {"mean_tau": None, "verify_steps": 0, "per_position_acceptance": []}
    return {"mean_tau": round(sum(steps) / len(steps), 4), "verify_steps": len(steps),
            "per_position_acceptance": [round(sum(n - 1 >= j for n in steps) / len(steps), 4)
                                        for j in range(1, num_steps + 1)]}


def fragile_from(engine: Engine, prompt_ids: list[int], output_ids: list[int]) -> int | None:
    """First output index whose greedy choice is a near-tie for the target."""
    if len(output_ids) < 2:
        return None
    logits = engine.prompt_logits(prompt_ids + output_ids[:-1])[len(prompt_ids) - 1:]
    close = (top2_margins(logits) < FRAGILE_MARGIN).nonzero()
    return int(close[0, 0]) if len(close) else None


def fixture_hashes(config: SpecConfig, model: str) -> dict[str, str]:
    manifest = json.loads((fixtures_root() / "MANIFEST.json").read_text())
    wanted = (f"{model}/model.safetensors",
              *([f"{config.draft_model}/model.safetensors"] if config.needs_draft_model else []))
    return {k: manifest[k] for k in wanted if k in manifest}


def run_waves(engine: Engine, planned: Sequence[Planned | GoldenRequest],
              params: SamplingParams, retracted: Counter[str] | None = None
              ) -> dict[str, FinishEvent]:
    """Each wave of ``planned`` (a trace's requests, before or after recording) submitted at
    once and run to completion (``waves``), its sessions opened first; the finish of every
    request. ``retracted``: counts each request's retractions."""
    for session in sessions_of(planned):
        engine.open_session(session)
    done: dict[str, FinishEvent] = {}
    for wave in waves(planned):
        for p in wave:
            engine.add_request(p.id, p.prompt_ids, params, p.session_id)
        while any(p.id not in done for p in wave):
            for ev in engine.step():
                if isinstance(ev, FinishEvent):
                    done[ev.rid] = ev
                elif isinstance(ev, RetractEvent) and retracted is not None:
                    retracted[ev.rid] += 1
    return done


def record(config: SpecConfig, prompt_set: str, model: str = "tiny-code",
           max_new_tokens: int = RECORD_MAX_NEW_TOKENS, scenario: Scenario = PLAIN
           ) -> GoldenTrace:
    """Run the reference engine on the scenario's requests of the prompt set, wave by wave
    (the plain, chunked and retraction traces: one batch), and trace them."""
    planned = scenario.plan(load_prompt_set(prompt_set, model))
    params = SamplingParams(max_new_tokens=scenario.max_new_tokens or max_new_tokens,
                            temperature=0.0, ignore_eos=True)
    budget = ({} if scenario.max_prefill_tokens is None
              else {"max_prefill_tokens": scenario.max_prefill_tokens})
    engine = Engine(EngineConfig(model=model, spec=config, kv_pool_tokens=65536,
                                 max_running_requests=max(64, len(planned)),
                                 retract_every=scenario.retract_every, **budget))
    retracted: Counter[str] = Counter()
    done = run_waves(engine, planned, params, retracted)
    scorer = Engine(EngineConfig(model=model, kv_pool_tokens=8192, max_running_requests=4))
    contexts: dict[str | None, list[int]] = {}
    unsettled: set[str | None] = set()  # sessions with a fragile turn: later ones may differ
    requests = []
    for p in planned:
        output = list(done[p.id].output_ids)
        context = contexts.get(p.session_id, []) + p.prompt_ids
        fragile = 0 if p.session_id in unsettled else fragile_from(scorer, context, output)
        if p.session_id is not None:
            contexts[p.session_id] = context + output
            if fragile is not None:
                unsettled.add(p.session_id)
        requests.append(GoldenRequest(p.id, p.prompt_ids, output,
                                      list(done[p.id].accept_lens), fragile, p.session_id,
                                      retracted[p.id] if scenario.retract_every else None))
    return GoldenTrace(SCHEMA_VERSION, fixture_hashes(config, model), config, params,
                       prompt_set, requests,
                       summarize([r.accept_lens for r in requests], config.num_steps),
                       scenario.max_prefill_tokens, scenario.retract_every or None)


def suite_draft_model(algorithm: str) -> str:
    """The draft model the suite's spec configurations name for ``algorithm`` ("" if none)."""
    return next((c.draft_model for choice in SPECS.values() for c in choice.configs
                 if c is not None and c.algorithm == algorithm), "")


def trace_dir_name(config: SpecConfig) -> str:
    """The directory of ``config``'s traces: its sequential twin's id (overlap scheduling
    changes when a step's result is applied, not what is drafted or accepted), with
    ``@<draft model>`` when it drafts with another bundled model than the suite's own.
    ValueError for a draft model that is not a bundled fixture: traces name their head."""
    name = config_id(replace(config, overlap=False))
    draft = config.draft_model
    if not config.needs_draft_model or draft == suite_draft_model(config.algorithm):
        return name
    if draft not in fixture_names():
        raise ValueError(f"draft model {draft!r}: golden traces are kept for bundled fixtures "
                         f"only (known: {', '.join(fixture_names())})")
    return f"{name}@{draft}"


def golden_path(config: SpecConfig, name: str, root: Path | None = None) -> Path:
    """``name``: a trace's (``Scenario.trace_name``), under ``trace_dir_name(config)``."""
    return (root or golden_root()) / trace_dir_name(config) / f"{name}.json"


def load(config: SpecConfig, name: str) -> GoldenTrace:
    """The trace of ``config`` (FileNotFoundError if none was recorded; ValueError if the file
    there was recorded with another draft model than ``config``'s)."""
    path = golden_path(config, name)
    if not path.exists():
        raise FileNotFoundError(f"no golden trace {path} (record it with `specgate golden "
                                "record`)")
    trace = GoldenTrace.from_json(path.read_text())
    recorded = trace.spec.draft_model
    if config.needs_draft_model and recorded != config.draft_model:
        raise ValueError(f"golden trace {path} was recorded with draft model {recorded!r}, "
                         f"not {config.draft_model!r}")
    return trace


def comparable_steps(accept_lens: list[int], upto: int) -> int:
    """How many leading verify steps emit only output indices before ``upto`` (index 0 comes
    from prefill, verify step j emits the ``accept_lens[j]`` indices after the previous
    ones): up to there acceptance is determined by tokens both runs must agree on."""
    end, steps = 1, 0
    for n in accept_lens:
        end += n
        if end > upto:
            break
        steps += 1
    return steps


def expected_acceptance(golden: GoldenTrace, tokens: int) -> dict[str, list[int]]:
    """Per request, the accept lengths ``compare`` holds a run of ``tokens`` per request to
    exactly (requests with none left out): what a golden failure's repro file replays."""
    found = {r.id: r.accept_lens[:r.exact_steps(tokens)] for r in golden.requests}
    return {rid: lens for rid, lens in found.items() if lens}


def compare(golden: GoldenTrace, outputs: dict[str, list[int]],
            accept_lens: dict[str, list[int]], num_steps: int,
            retracted: Mapping[str, int] | None = None) -> list[str]:
    """Per request: the output exact up to its first fragile position, and its accept length
    at every verify step before that position exact too (a draft that got worse at one
    position shows here even when the mean hides it); over all requests: mean tau within
    ``TAU_RTOL`` of the golden mean. A run may stop before the trace's length (``outputs``
    shorter): everything is compared over the tokens it produced. ``retracted``: how often
    the run retracted each request, which must be the trace's where it records that (the
    hook retracts the same requests wherever it is honoured). Returns problems."""
    problems = []
    tau_got: list[list[int]] = []
    tau_want: list[list[int]] = []
    for req in golden.requests:
        if req.id not in outputs:
            continue
        produced = len(outputs[req.id])
        times = None if retracted is None else retracted.get(req.id, 0)
        if req.retractions not in (None, times) and produced == len(req.output_ids):
            problems.append(f"{req.id}: retracted {times} times, golden {req.retractions} "
                            f"(retract_every {golden.retract_every})")
        upto = req.exact_upto(produced)
        got, want = outputs[req.id][:upto], req.output_ids[:upto]
        # Mean tau over the verify steps both runs completed inside the produced tokens.
        lens = accept_lens.get(req.id, [])
        span = min(req.steps_within(req.accept_lens, produced), req.steps_within(lens, produced))
        tau_got.append(lens[:span])
        tau_want.append(req.accept_lens[:span])
        if got != want:
            mismatch = [i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b]
            first = mismatch[0] if mismatch else min(len(got), len(want))
            problems.append(f"{req.id}: output differs from golden at index {first} "
                            f"(before its first fragile position {upto})")
            continue
        steps = req.exact_steps(produced)
        got_lens, want_lens = lens[:steps], req.accept_lens[:steps]
        if got_lens != want_lens:
            step = next((j for j, (a, b) in enumerate(zip(got_lens, want_lens, strict=False))
                         if a != b), min(len(got_lens), len(want_lens)))
            problems.append(
                f"{req.id}: verify step {step} accepted "
                f"{got_lens[step] if step < len(got_lens) else None} tokens, golden "
                f"{want_lens[step] if step < len(want_lens) else None} (steps compared "
                f"exactly: {steps}, before output index {upto})")
    want_tau = summarize(tau_want, num_steps)["mean_tau"]
    got_tau = summarize(tau_got, num_steps)["mean_tau"]
    if want_tau is not None and (got_tau is None or abs(got_tau - want_tau) > TAU_RTOL * want_tau):
        problems.append(f"mean tau {got_tau} is outside {TAU_RTOL:.0%} of the golden {want_tau}")
    return problems


def syrupy_extension(trace_name: str = "default") -> type[JSONSnapshotExtension]:
    """A syrupy extension that compares a ``GoldenTrace`` with
    ``golden/<config>/<trace_name>.json``.

    The test's parameter id is the config id and the snapshot name is the trace's. It never
    writes: ``--snapshot-update`` raises, because golden files come only from
    ``specgate golden record`` (reviewed in the commit that changes them).
    """
    from syrupy.extensions.json import JSONSnapshotExtension

    class GoldenExtension(JSONSnapshotExtension):
        prompt_set = trace_name

        @classmethod
        def dirname(cls, *, test_location: PyTestLocation) -> str:
            # syrupy (7+) also asks for the directory of every other collected test file, to
            # find orphaned snapshots; an unparametrized test has no config, hence no traces.
            name = test_location.nodename
            if "[" not in name:
                return str(golden_root() / "no-config" / name)
            return str(golden_root() / name.split("[", 1)[1].rstrip("]"))

        @classmethod
        def get_snapshot_name(cls, *, test_location: PyTestLocation, index: SnapshotIndex = 0
                              ) -> str:
            return cls.prompt_set

        def serialize(self, data: SerializableData, *, exclude: PropertyFilter | None = None,
                      include: PropertyFilter | None = None,
                      matcher: PropertyMatcher | None = None) -> SerializedData:
            return data.to_json() if isinstance(data, GoldenTrace) else str(data)

        @classmethod
        def write_snapshot_collection(cls, *, snapshot_collection: SnapshotCollection,
                                      name_order: dict[str, int] | None = None) -> None:
            raise RuntimeError("golden traces are written only by `specgate golden record`")

    return GoldenExtension

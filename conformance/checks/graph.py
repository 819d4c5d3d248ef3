"""The graph tier's properties, over any ``GraphProbe`` (``conformance/contract/graph_probe.py``).

Each check runs one property for one kind over every raw batch size 1..``max_batch`` (not
only the buckets: the padded sizes are the point) and raises ``AssertionError`` naming the
kind, the raw size, the bucket and the numbers. The suite's graph tier runs them through the
adapter; ``tests/test_graph_runner.py`` runs the same functions on the reference engine's probe
over a small random model, so the properties have one statement.

Every run goes through a ``Recorder``, which also checks on every graph run that the static
buffers have not moved since the kind's first graph run, and refuses a run that reports no
outputs (empty outputs would compare equal to anything empty). A probe that lists its key widths
(``KeyWidthProbe``) also gets cases either side of every width (``check_key_width_boundaries``).

What a probe reports is bounded, so a report cannot make a check vacuous: its max batch lies
between 1 and the requests the engine was opened for, and within its buckets
(``check_probe_bounds``); its float tolerance is finite and at most ``TOLERANCE_CAP`` for the
backend's declared precision (``checked_tolerance``). A check that on a given probe would run
nothing (no raw size runs padded; no key length of a kind reaches a width) raises
``NotApplicable`` with the reason, which the tier reports as not applicable, never as passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from conformance.contract.graph_probe import (
    PADDED_FIELDS,
    STATE_DIGESTS,
    GraphCase,
    GraphProbe,
    GraphRun,
    KeyWidthProbe,
)

# The largest float tolerance a probe may report, by the backend's declared precision. float32:
# ten times the reference probe's own (1e-4, itself about nine times the largest graph-vs-eager
# difference it shows); float16 and bfloat16: about twice the largest logit change their
# rounding makes in the reference (the near-tie ceilings, docs/decisions.md "Near-ties"). A
# graph-only bug (a padded row reading a request's keys, a key width one too narrow) moves
# outputs by more.
TOLERANCE_CAP: dict[str, float] = {"float32": 1e-3, "float16": 0.1, "bfloat16": 1.0}


class NotApplicable(Exception):
    """A check that on this probe would run nothing; the message says why."""


def check_probe_bounds(probe: GraphProbe, max_requests: int) -> None:
    """What every check relies on: the probe replays some kind, its buckets ascend from 1,
    and its max batch is at least 1, at most the requests the engine was opened for
    (``max_requests``: no replay holds more) and held by its largest bucket."""
    kinds, buckets, top = probe.kinds(), probe.buckets(), probe.max_batch()
    assert kinds, "the probe replays no kind"
    assert buckets and list(buckets) == sorted(set(buckets)) and buckets[0] >= 1, (
        f"buckets {buckets} are not ascending from at least 1")
    assert 1 <= top <= max_requests, (
        f"max_batch() {top}: must be 1 to {max_requests}, the requests the engine was opened "
        "for (the tier runs every raw size up to it)")
    assert top <= buckets[-1], f"max_batch() {top} is past the largest bucket {buckets[-1]}"


def checked_tolerance(probe: GraphProbe, precision: str) -> float:
    """The probe's ``float_tolerance()``, refused unless finite, non-negative and at most
    ``TOLERANCE_CAP[precision]`` (an infinite one would let any difference pass)."""
    tolerance, cap = probe.float_tolerance(), TOLERANCE_CAP[precision]
    assert isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and (
        0 <= tolerance <= cap), (
        f"float_tolerance() {tolerance!r}: must be finite, from 0 to {cap:g} (the cap for a "
        f"{precision} backend): graph vs eager is compared within it")
    return float(tolerance)


def padded_sizes(probe: GraphProbe) -> list[int]:
    """The raw sizes 1..max_batch that run padded (on a bucket bigger than themselves)."""
    return [raw for raw in range(1, probe.max_batch() + 1)
            if expected_bucket(probe, raw) not in (raw, None)]


def require_padding(probe: GraphProbe) -> None:
    """``NotApplicable`` when no raw size runs padded (``padded_sizes``)."""
    if not padded_sizes(probe):
        raise NotApplicable(f"no raw size 1..{probe.max_batch()} runs padded (buckets "
                            f"{tuple(probe.buckets())}): there is no padded row to check")


def where(run: GraphRun) -> str:
    """The failure-message prefix: which case, on which bucket (and key width)."""
    at = f"kind={run.case.kind} raw={run.case.raw} bucket={run.bucket} seed={run.case.seed}"
    if run.case.context is not None:
        at += f" context={run.case.context} key_width={run.key_width}"
    return at


def expected_bucket(probe: GraphProbe, raw: int) -> int | None:
    """The smallest bucket that holds ``raw`` requests (None: no bucket does)."""
    return next((b for b in probe.buckets() if b >= raw), None)


@dataclass
class Recorder:
    """Runs cases on a probe; checks each report's shape and that every graph run of a kind
    used the same static buffers (a replayed graph reads fixed addresses: a buffer that moved
    would be read stale)."""

    probe: GraphProbe
    precision: str = "float32"  # the backend's declared precision: bounds its tolerance
    pointers: dict[str, dict[str, int]] = field(default_factory=dict)

    def run(self, kind: str, raw: int, mode: Literal["eager", "graph"], seed: int = 0,
            poison: bool = False, context: int | None = None) -> GraphRun:
        run = self.probe.run(GraphCase(kind, raw, seed, context), mode, poison)
        at = where(run)
        assert set(run.state) == set(run.initial) == set(STATE_DIGESTS), (
            f"{at} {mode}: state digests {sorted(run.state)} / {sorted(run.initial)}, "
            f"expected {list(STATE_DIGESTS)}")
        empty = [name for name, t in run.outputs.items() if t.numel() == 0]
        assert run.outputs and not empty, (
            f"{at} {mode}: reported {'no outputs' if not run.outputs else f'empty {empty}'} "
            f"for {raw} real rows: nothing to compare")
        if mode == "eager":
            return run
        want = expected_bucket(self.probe, raw)
        assert run.bucket == want, (
            f"{at}: ran on bucket {run.bucket}, the smallest bucket >= {raw} is {want} "
            f"(buckets {self.probe.buckets()})")
        assert run.buffers, f"{at}: a graph run reported no static buffers"
        first = self.pointers.setdefault(kind, dict(run.buffers))
        moved = {name: (first.get(name), ptr) for name, ptr in run.buffers.items()
                 if first.get(name) != ptr}
        moved.update({name: (ptr, None) for name, ptr in first.items()
                      if name not in run.buffers})
        assert not moved, (f"{at}: static buffers moved since the kind's first graph run "
                           f"(name: (first, now)): {moved}")
        return run


# An integer output that is the argmax of the run's "logits" (the probe's greedy tokens).
GREEDY_TOKENS = "next_tokens"


def near_tie_flips(got: GraphRun, want: GraphRun, tolerance: float) -> bool:
    """Whether every entry where the two runs' greedy tokens differ is a near-tie that logits
    within ``tolerance`` of each other may flip: ``want``'s logits put the two tokens within
    ``2 * tolerance`` (got's token wins got's argmax, so ``want[g] + tol >= want[w] - tol``).
    A flip past that is no rounding: the logits themselves would fail the comparison."""
    logits = want.outputs.get("logits")
    g, w = got.outputs[GREEDY_TOKENS], want.outputs[GREEDY_TOKENS]
    if tolerance == 0 or logits is None or logits.shape[:-1] != w.shape:
        return False
    rows = (g != w).nonzero()[:, 0]
    gap = logits[rows, w[rows]].double() - logits[rows, g[rows]].double()
    return bool((gap <= 2 * tolerance).all())


def compare_outputs(got: GraphRun, want: GraphRun, tolerance: float, what: str) -> None:
    """``got``'s outputs against ``want``'s: same names, shapes and dtypes; integers exactly
    (the greedy tokens up to near-tie flips, ``near_tie_flips``), floats within ``tolerance``
    (0: bitwise), an infinity only by the same one (an EAGLE-3 head's logits are ``-inf`` off
    its vocabulary); NaN never matches."""
    at = where(got)
    assert set(got.outputs) == set(want.outputs), (
        f"{at}: outputs {sorted(got.outputs)} vs {sorted(want.outputs)} ({what})")
    for name, w in want.outputs.items():
        g = got.outputs[name]
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{at}: output {name!r} is {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} "
            f"{w.dtype} ({what})")
        if tolerance == 0 or not w.dtype.is_floating_point:
            if torch.equal(g, w) or (name == GREEDY_TOKENS
                                     and near_tie_flips(got, want, tolerance)):
                continue
            bad = (g != w).nonzero()
            first = tuple(bad[0].tolist())
            raise AssertionError(
                f"{at}: output {name!r} differs at {bad.shape[0]} of {w.numel()} entries, "
                f"first {first}: {g[first].item()} vs {w[first].item()} ({what})")
        diff = torch.where(g == w, 0.0, (g.double() - w.double()).abs())
        nan = diff.isnan()
        worst = float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0
        assert not nan.any() and worst <= tolerance, (
            f"{at}: output {name!r} differs by {worst:.3g} (tolerance {tolerance:g}, "
            f"{int(nan.sum())} NaN) ({what})")


def compare_state(run: GraphRun, other: dict[str, str], label: str, why: str) -> None:
    changed = [k for k in STATE_DIGESTS if run.state[k] != other[k]]
    assert not changed, f"{where(run)} {run.mode}: digests {changed} differ from {label}: {why}"


def check_state_untouched(probe: GraphProbe, run: GraphRun) -> None:
    """A forward changes no state but its real rows' own KV writes (and the dummy page)."""
    if probe.writes_kv(run.case.kind):
        why = ("the forward changed KV outside the real rows' target slots and the dummy page, "
               "the row table or the allocator")
    else:
        why = "a kind that writes no KV changed the KV pool, the row table or the allocator"
    compare_state(run, run.initial, "before the forward", why)


def graph_against_eager(rec: Recorder, kind: str, raw: int, seed: int = 0,
                        context: int | None = None) -> GraphRun:
    """One case eager and graph: same starting state, graph outputs == eager (the probe's
    tolerance), neither changes state outside the real rows' KV, and the padded rows changed
    nothing the eager run did not. -> the graph run."""
    eager = rec.run(kind, raw, "eager", seed, context=context)
    graph = rec.run(kind, raw, "graph", seed, context=context)
    assert graph.initial == eager.initial, (
        f"{where(graph)}: the graph run started from other state than the eager run "
        f"(digests {[k for k in STATE_DIGESTS if graph.initial[k] != eager.initial[k]]}); "
        "the probe must reset per run")
    compare_outputs(graph, eager, checked_tolerance(rec.probe, rec.precision),
                    "graph vs eager")
    check_state_untouched(rec.probe, eager)
    check_state_untouched(rec.probe, graph)
    compare_state(graph, eager.state, "the eager run's", "padded rows wrote state a "
                  "request owns")
    return graph


def check_graph_matches_eager(probe: GraphProbe, kind: str, seed: int = 0,
                              precision: str = "float32") -> Recorder:
    """Every raw size: graph outputs == eager (tolerance for floats, ``checked_tolerance``),
    both start from the same state, and neither changes anything but the real rows' KV (and
    the dummy page)."""
    rec = Recorder(probe, precision)
    for raw in range(1, probe.max_batch() + 1):
        graph_against_eager(rec, kind, raw, seed)
    return rec


def width_contexts(probe: KeyWidthProbe, kind: str, up_to: int | None = None) -> list[int]:
    """Key lengths either side of every key width ``w`` of ``kind``: ``w - 1``, ``w`` and
    ``w + 1``, those the kind can reach (``max_context``) up to ``up_to``."""
    top = probe.max_context(kind) if up_to is None else min(probe.max_context(kind), up_to)
    return sorted({n for w in probe.key_widths(kind) for n in (w - 1, w, w + 1)
                   if 1 <= n <= top})


def check_key_width_boundaries(probe: GraphProbe, kind: str, raw: int, seed: int = 0,
                               up_to: int | None = None, precision: str = "float32"
                               ) -> Recorder:
    """``raw`` requests whose longest key length sits either side of every key width, up to
    ``up_to`` (``width_contexts``): graph == eager as in ``check_graph_matches_eager``, and
    the width the graph run reports (if it does) is the smallest that holds the key length. A
    width one too narrow drops the newest keys; one too wide costs time only, but says the
    choice is off by one. ``NotApplicable`` when no key length of ``kind`` in reach sits by a
    width."""
    assert isinstance(probe, KeyWidthProbe), "the probe lists no key widths"
    rec = Recorder(probe, precision)
    widths = probe.key_widths(kind)
    assert widths and list(widths) == sorted(set(widths)) and widths[0] >= 1, (
        f"kind={kind}: key widths {widths} are not ascending and positive")
    contexts = width_contexts(probe, kind, up_to)
    if not contexts:
        raise NotApplicable(
            f"kind={kind}: no key length in reach sits by a key width (widths {widths}, "
            f"max_context {probe.max_context(kind)}"
            f"{'' if up_to is None else f', checked up to {up_to}'})")
    for context in contexts:
        graph = graph_against_eager(rec, kind, raw, seed, context)
        want = next(w for w in widths if w >= context)
        assert graph.key_width in (None, want), (
            f"{where(graph)}: replayed on key width {graph.key_width}, the smallest of "
            f"{widths} that holds {context} key columns is {want}")
    return rec


def check_padding_policy(probe: GraphProbe, kind: str, seed: int = 0) -> Recorder:
    """After the largest batch filled every static row with real values, every raw size's
    padded rows hold the policy's values: the reserved row and slot, in-range token ids and
    positions, the fill length. A tail left from the larger batch would read (or write) a
    real request's KV, invisibly in the outputs. ``NotApplicable`` when no raw size runs
    padded."""
    require_padding(probe)
    rec = Recorder(probe)
    policy = probe.padding_policy(kind)
    top = probe.max_batch()
    rec.run(kind, top, "graph", seed)
    for raw in range(1, top + 1):
        run = rec.run(kind, raw, "graph", seed)
        at = where(run)
        unknown = set(run.padded) - set(PADDED_FIELDS)
        assert not unknown, f"{at}: unknown padded fields {sorted(unknown)} ({PADDED_FIELDS})"
        pad = run.bucket - raw
        if pad:
            assert run.padded, f"{at}: {pad} padded rows, but no padded fields reported"
        for name, values in run.padded.items():
            assert values.shape[:1] == (pad,), (
                f"{at}: padded {name} has {tuple(values.shape)} rows, expected {pad}")
            flat = values.reshape(-1)
            if name == "request_rows":
                bad = flat != policy.dummy_row
                rule = f"== dummy row {policy.dummy_row} (else it reads a real request's KV)"
            elif name == "out_slots":
                bad = flat != policy.dummy_slot
                rule = f"== dummy slot {policy.dummy_slot} (else it writes a real request's KV)"
            elif name == "token_ids":
                bad = (flat < 0) | (flat >= policy.vocab_size)
                rule = f"in [0, {policy.vocab_size})"
            elif name == "positions":
                bad = (flat < 0) | (flat >= policy.max_position)
                rule = f"in [0, {policy.max_position})"
            else:
                bad = flat != policy.length_fill
                rule = f"== length fill {policy.length_fill}"
            assert not bad.any(), (
                f"{at}: padded {name} {values.tolist()} must be {rule}; a staging step left "
                "an earlier batch's values in the padded rows")
    return rec


def check_poisoned_padding(probe: GraphProbe, kind: str, seed: int = 0) -> Recorder:
    """Every raw size: hostile values in the padded tail of every static buffer before
    staging change nothing -- outputs bitwise, state digests, the staged padding.
    ``NotApplicable`` when no raw size runs padded (no tail to poison)."""
    require_padding(probe)
    rec = Recorder(probe)
    for raw in range(1, probe.max_batch() + 1):
        clean = rec.run(kind, raw, "graph", seed)
        poisoned = rec.run(kind, raw, "graph", seed, poison=True)
        compare_outputs(poisoned, clean, 0, "poisoned padding vs clean")
        compare_state(poisoned, clean.state, "the clean run's", "poisoned padding changed "
                      "state")
        check_state_untouched(probe, poisoned)
        for name, values in clean.padded.items():
            assert torch.equal(poisoned.padded.get(name, torch.empty(0)), values), (
                f"{where(poisoned)}: padded {name} staged as "
                f"{poisoned.padded.get(name, torch.empty(0)).tolist()} after poisoning, "
                f"{values.tolist()} clean: staging kept the poison")
    return rec


def check_no_history_dependence(probe: GraphProbe, kind: str, seed: int = 0) -> Recorder:
    """Every padded raw size (every raw size where the buckets leave none padded: the check
    always probes): its result, fresh, equals (bitwise) its result after the largest batch,
    after a batch on another bucket and after a poisoned run of a smaller bucket (whose
    hostile tail lies inside this one's bucket); and the first result's tensors are not
    overwritten by the runs after it (outputs are fresh memory)."""
    rec = Recorder(probe)
    top = probe.max_batch()
    buckets = probe.buckets()
    for raw in padded_sizes(probe) or range(1, top + 1):
        first = rec.run(kind, raw, "graph", seed)
        kept = {name: t.clone() for name, t in first.outputs.items()}
        others = [b for b in buckets if b not in (first.bucket, top)]
        other = others[-1] if others else 1
        preludes = {"after the largest batch": (top, False),
                    f"after a batch of {other} (another bucket)": (other, False),
                    "after a poisoned batch of 1": (1, True)}
        for label, (size, poison) in preludes.items():
            rec.run(kind, size, "graph", seed, poison=poison)
            again = rec.run(kind, raw, "graph", seed)
            compare_outputs(again, first, 0, label)
            compare_state(again, first.state, "the first run's", label)
        for name, t in first.outputs.items():
            assert torch.equal(t, kept[name]), (
                f"{where(first)}: output {name!r} of the first run changed after later runs: "
                "outputs alias memory a replay overwrites")
    return rec


def check_static_buffers_and_fresh_outputs(probe: GraphProbe, seed: int = 0) -> Recorder:
    """Every kind interleaved at a few sizes: static buffers never move (the recorder), every
    run's outputs are new memory (no output shares an address with another run's or with a
    static buffer) and keep their values after later runs."""
    rec = Recorder(probe)
    top = probe.max_batch()
    sizes = list(dict.fromkeys(min(raw, top) for raw in (1, 3, top, 2)))
    runs: list[tuple[GraphRun, dict[str, torch.Tensor]]] = []
    for raw in sizes:
        for kind in probe.kinds():
            run = rec.run(kind, raw, "graph", seed)
            runs.append((run, {n: t.clone() for n, t in run.outputs.items()}))
    statics = {ptr for ptrs in rec.pointers.values() for ptr in ptrs.values()}
    seen: dict[int, str] = {}
    for run, copies in runs:
        for name, t in run.outputs.items():
            at = f"{where(run)} output {name!r}"
            assert torch.equal(t, copies[name]), f"{at}: changed by a later run"
            if t.numel() == 0:
                continue
            ptr = t.data_ptr()
            assert ptr not in statics, f"{at}: is a static buffer's memory"
            assert ptr not in seen, f"{at}: shares memory with {seen[ptr]}"
            seen[ptr] = at
    return rec

"""Tier worker (white-box): the speculative state machine under forced verify outcomes.

Through ``worker_hooks`` the suite sees what every phase produced and decides how many drafts
each verify accepts, so the edges happen on demand: every request finishing inside one verify
(all-finish-in-verify), an idle draft state merged with a new prefill, a batch filtered to
zero rows. Kinds and shapes: the state between steps is EAGLE's DraftInput ``[b, k]``/
``[b, H]`` or Frozen-KV MTP's SeedInput ``[b]``/``[b, H]`` (a draft that keeps no KV carries
only the root token and the target's feature) or a standalone draft model's CatchUpInput
``[b]``/``[b]`` (the root and how many positions its draft KV lacks) or n-gram lookup's
NgramInput ``[b]``/``[b, W]`` (the root and the context it looks up), VerifyInput ``[b, N]``,
DraftExtendInput ragged
``[sum(accepted + 1), H]``.
"""

from __future__ import annotations

import pytest

from conformance.contract import PhaseRecord, SpecConfig
from conformance.run.context import SuiteContext
from conformance.suites.support import assert_matches_oracle, greedy, open_driver, run_all
from conformance.suites.support_extras import worker_hooks_handle

pytestmark = [pytest.mark.specgate_tier("worker"),
              pytest.mark.specgate_requires("worker_hooks", "stepwise")]


def _spec(sg: SuiteContext) -> SpecConfig:
    config = sg.spec.configs[0]
    if config is None:
        pytest.skip("plain decoding has no speculative worker")
    return config


STATE_KINDS = {"eagle": "DraftInput", "eagle3": "DraftInput", "frozen_kv_mtp": "SeedInput",
               "draft_model": "CatchUpInput", "ngram": "NgramInput"}


def _check_draft_input(rec: PhaseRecord, rows: int, spec: SpecConfig, hidden: int | None
                       ) -> None:
    """The per-request state left between steps, with ``rows`` rows."""
    assert rec.kind == STATE_KINDS[spec.algorithm], rec
    if spec.algorithm == "frozen_kv_mtp":
        assert rec.shapes == {"bonus_tokens": (rows,), "hidden_states": (rows, hidden)}, rec
        assert rec.dtypes["bonus_tokens"] == "int64", rec
        return
    if spec.algorithm == "draft_model":  # the root and the positions its draft KV lacks
        assert rec.shapes == {"verified_id": (rows,), "behind": (rows,)}, rec
        assert set(rec.dtypes.values()) == {"int64"}, rec
        return
    if spec.algorithm == "ngram":  # the root and its context, one token row per request
        assert set(rec.shapes) == {"verified_id", "tokens"}, rec
        assert rec.shapes["verified_id"] == (rows,) and rec.shapes["tokens"][0] == rows, rec
        assert set(rec.dtypes.values()) == {"int64"}, rec
        return
    assert rec.shapes == {"topk_p": (rows, spec.topk), "topk_index": (rows, spec.topk),
                          "hidden_states": (rows, hidden), "verified_id": (rows,)}, rec
    assert rec.dtypes["topk_p"] == "float32" and rec.dtypes["topk_index"] == "int64", rec


def _hidden(trace: list[PhaseRecord]) -> int | None:
    """The target's width, from any phase that carries features; None if none did (a
    standalone draft model's state carries none)."""
    return next((r.shapes["hidden_states"][1] for r in trace
                 if r.shapes.get("hidden_states", (0,))[0] > 0), None)


def test_phase_kinds_and_shapes(sg: SuiteContext) -> None:
    spec = _spec(sg)
    requests = {c.id: (list(c.ids), greedy(10)) for c in sg.prompts[:3]}
    with open_driver(sg, spec) as driver:
        hooks = worker_hooks_handle(driver.handle).worker_hooks()
        outcomes = run_all(driver, requests)
    trace = hooks.trace
    hidden = _hidden(trace)
    phases = [r.phase for r in trace]
    assert {"prefill", "draft", "verify", "install"} <= set(phases), phases
    for rec in trace:
        if rec.phase in ("prefill", "install"):
            _check_draft_input(rec, len(rec.rids), spec, hidden)
        elif rec.phase == "draft":
            b, n = len(rec.rids), spec.num_draft_tokens
            assert rec.kind == "VerifyInput" and rec.shapes["draft_tokens"] == (b, n), rec
            assert rec.shapes["tree_mask"] == (b, n, n), rec
        else:
            assert rec.kind == "DraftExtendInput", rec
            total = rec.shapes["input_ids"][0]
            assert rec.shapes["hidden_states"] == (total, hidden), rec
    assert_matches_oracle(sg, outcomes, requests)


def test_all_finish_inside_verify_installs_idle_then_merges(sg: SuiteContext) -> None:
    """Forced full acceptance with max_new_tokens=3: the first verify finishes every request;
    the state installed must be an idle (zero-row) state, and a new prefill must merge into it.
    Under overlap scheduling the step is launched (and its DraftInput installed, one row per
    request) before anyone knows the requests finish; resolution then drops those rows, and
    the new prefill must merge into what is left."""
    spec = _spec(sg)
    first = {f"{c.id}-a": (list(c.ids), greedy(3)) for c in sg.prompts[:3]}
    later = {f"{c.id}-b": (list(c.ids), greedy(4)) for c in sg.prompts[3:5]}
    with open_driver(sg, spec) as driver:
        hooks = worker_hooks_handle(driver.handle).worker_hooks()
        for rid in first:
            hooks.force_accept(rid, spec.num_steps)
        run_all(driver, first)
        installs = [r for r in hooks.trace if r.phase == "install"]
        assert installs, "no verify ran"
        hidden = _hidden(hooks.trace)
        rows = len(first) if spec.overlap else 0            # V1: idle, zero rows
        _check_draft_input(installs[-1], rows, spec, hidden)
        mark = len(hooks.trace)
        outcomes = run_all(driver, later)                   # merge(idle, prefill rows)
    after = hooks.trace[mark:]
    assert after and after[0].phase == "prefill", after[:2]
    assert_matches_oracle(sg, outcomes, later)


@pytest.mark.specgate_requires("abort")
def test_filter_to_zero_rows_then_new_arrivals(sg: SuiteContext) -> None:
    """Abort every decoding request: the draft state is filtered to zero rows; the engine
    must then serve new arrivals. Requires: abort (how the rows are emptied)."""
    spec = _spec(sg)
    doomed = {f"{c.id}-x": (list(c.ids), greedy(30)) for c in sg.prompts[:3]}
    later = {f"{c.id}-y": (list(c.ids), greedy(6)) for c in sg.prompts[1:3]}
    with open_driver(sg, spec) as driver:
        for rid, (prompt, params) in doomed.items():
            driver.submit(rid, prompt, params)
        driver.step_until(lambda: all(driver.streamed[r] for r in doomed), 1000,
                          lambda: "no token streamed for every doomed request")
        driver.step()
        for rid in doomed:
            driver.abort(rid)
        driver.run(1000)
        outcomes = run_all(driver, later)
    wrong = {r: driver.outcomes[r].reason for r in doomed if driver.outcomes[r].reason != "abort"}
    assert not wrong, f"step {driver.steps}: aborted requests finished otherwise: {wrong}"
    assert_matches_oracle(sg, outcomes, later)


@pytest.mark.specgate_requires("acceptance_stats")
@pytest.mark.parametrize("drafts", [0, 1, "max"])
def test_forced_acceptance_keeps_accounting(sg: SuiteContext, drafts: int | str) -> None:
    """Whatever a verify accepts, KV accounting holds after every step (the driver checks
    M1-M3) and the reported per-verify counts equal accepted drafts + 1. ("max" follows the
    tree's first-child chain, which in a tree may end before depth S.) Requires:
    acceptance_stats (the per-verify counts it compares)."""
    spec = _spec(sg)
    n = spec.num_steps if drafts == "max" else int(drafts)
    requests = {c.id: (list(c.ids), greedy(13)) for c in sg.prompts[:4]}
    with open_driver(sg, spec, page_size=4) as driver:
        hooks = worker_hooks_handle(driver.handle).worker_hooks()
        for rid in requests:
            hooks.force_accept(rid, n)
        outcomes = run_all(driver, requests)
    for rid, o in outcomes.items():
        assert len(o.output_ids) == 13, (rid, o)
        ran = o.accept_lens[:-1]  # the last verify may be cut by max_new_tokens
        # 13 tokens at most n + 1 per verify: some verify ran whole before the last one
        assert ran, f"{rid}: {len(o.accept_lens)} verify steps reported for 13 tokens"
        if drafts == "max":
            assert all(2 <= a <= n + 1 for a in ran), (rid, o.accept_lens)
            assert spec.topk > 1 or all(a == n + 1 for a in ran), (rid, o.accept_lens)
        else:
            assert all(a == n + 1 for a in ran), (rid, o.accept_lens)

"""Tier golden: acceptance traces against `golden/` for backends that run the reference draft
algorithm on the fixture weights (``reference_draft``) and report per-verify counts
(``acceptance_stats``). Outputs, and the accept length of every verify step, must match
exactly up to each request's first fragile position; mean tau must stay within
``golden.TAU_RTOL``. A draft that got worse is still lossless — this is the tier that notices.

Four traces per configuration (``checks/golden_scenarios.py``): the golden set in one batch
(every request; ``full`` for the trace's whole length, ``gate`` for its first ``GATE_TOKENS``
tokens: the runs are greedy and batched, so 40 requests cost little more than a few run one at
a time); its long prompts under chunked prefill (backends that honour ``max_prefill_tokens``:
``chunked_prefill``), where a drafter that follows only a prompt's last chunk accepts less;
two-turn sessions (``stepwise``, ``sessions``), where a drafter that loses the inherited
context accepts less on the second turn; and a batch under forced retraction
(``forced_retract``; sequential configurations: under overlap scheduling a step's result lands
a step late, so the hook's decode-step count retracts other requests than the trace's), where
a drafter that does not go on from a re-prefilled context accepts less after each retraction
(the backend must retract the requests the trace did). The last three are short and run
whole; in ``gate`` on the spec's first configuration only (what they check, the drafter's
prefill, the KV a session keeps and a re-prefill, does not depend on the draft's shape), in
``full`` on every one.

A failing check's repro file carries the accept lengths of the steps compared exactly, so
``specgate repro`` replays the acceptance failure, not only the outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conformance.checks import golden
from conformance.checks.golden_scenarios import (
    CHUNKED,
    PLAIN,
    RETRACTED,
    SESSION_TURNS,
    Scenario,
    sessions_of,
    waves,
)
from conformance.contract import SpecConfig
from conformance.report.certified import accept_histogram
from conformance.repro.driver import Driver, step_budget
from conformance.run.context import SuiteContext
from conformance.suites.support import greedy, open_driver, parametrize_spec_configs

pytestmark = [pytest.mark.specgate_tier("golden"),
              pytest.mark.specgate_requires("reference_draft", "acceptance_stats")]
GOLDEN_SET = "default"
GATE_TOKENS = 64  # of the trace's 128 per request: every request, half the length, in gate

Record = Callable[[str, object], None]
FIRST_CONFIG_IN_GATE = ("test_chunked_acceptance_matches_golden",
                        "test_session_acceptance_matches_golden",
                        "test_retraction_acceptance_matches_golden")


def _first_in_gate(sg: SuiteContext) -> tuple[SpecConfig | None, ...]:
    return sg.spec.configs if sg.profile.name == "full" else sg.spec.configs[:1]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_spec_configs(metafunc, _first_in_gate if metafunc.function.__name__
                             in FIRST_CONFIG_IN_GATE else None)


def _trace(spec_config: SpecConfig | None, scenario: Scenario) -> golden.GoldenTrace:
    if spec_config is None:
        pytest.skip("plain decoding has no acceptance trace")
    return golden.load(spec_config, scenario.trace_name(GOLDEN_SET))


def _run(sg: SuiteContext, spec_config: SpecConfig, trace: golden.GoldenTrace, tokens: int
         ) -> Driver:
    """The trace's requests, greedy for ``tokens`` each, in its waves (sessions opened first
    and closed after), under its prefill budget and forced-retraction hook. A failing check's
    repro holds the accept lengths the comparison wants."""
    params = greedy(tokens)
    limits = {name: value for name, value in (("max_prefill_tokens", trace.max_prefill_tokens),
                                              ("retract_every", trace.retract_every))
              if value is not None}
    sg.recorded.expect_acceptance(golden.expected_acceptance(trace, tokens))
    sessions = sessions_of(trace.requests)
    with open_driver(sg, spec_config, max_running_requests=max(64, len(trace.requests)),
                     kv_pool_tokens=65536, **limits) as driver:
        for session in sessions:
            driver.open_session(session)
        for wave in waves(trace.requests):
            for r in wave:
                driver.submit(r.id, r.prompt_ids, params, session_id=r.session_id)
            driver.run(step_budget([(r.prompt_ids, params) for r in wave]))
        for session in sessions:
            driver.close_session(session)
    return driver


def _compare(trace: golden.GoldenTrace, driver: Driver, spec_config: SpecConfig) -> list[str]:
    outcomes = driver.outcomes
    return golden.compare(trace, {k: o.output_ids for k, o in outcomes.items()},
                          {k: o.accept_lens for k, o in outcomes.items()}, spec_config.num_steps,
                          driver.retracted)


def test_acceptance_matches_golden(sg: SuiteContext, spec_config: SpecConfig | None,
                                   record_property: Record) -> None:
    trace = _trace(spec_config, PLAIN)
    assert spec_config is not None
    recorded = trace.sampling.max_new_tokens
    tokens = recorded if sg.profile.name == "full" else min(GATE_TOKENS, recorded)
    driver = _run(sg, spec_config, trace, tokens)
    outcomes = driver.outcomes
    problems = _compare(trace, driver, spec_config)

    def run_steps(lens: list[int]) -> list[int]:
        """The verify steps that end before this run's last token: the step that reaches it
        may be cut short by max_new_tokens here and not in the longer trace, which would
        count a short step on one side only."""
        return lens[:golden.comparable_steps(lens, tokens - 1)]

    backend_lens = [run_steps(o.accept_lens) for o in outcomes.values()]
    golden_lens = [run_steps(r.accept_lens) for r in trace.requests]
    got = golden.summarize(backend_lens, spec_config.num_steps)
    want = golden.summarize(golden_lens, spec_config.num_steps)
    record_property("mean_tau", got["mean_tau"])
    record_property("golden_mean_tau", want["mean_tau"])
    record_property("per_position_acceptance", got["per_position_acceptance"])
    record_property("golden_per_position_acceptance", want["per_position_acceptance"])
    # the certificate's acceptance.png: the backend's histogram beside the trace's, same requests
    record_property("accept_hist", accept_histogram(backend_lens))
    record_property("golden_accept_hist", accept_histogram(golden_lens))
    assert not problems, f"{len(problems)} golden mismatches: {problems[:5]}"


def _check_whole(sg: SuiteContext, spec_config: SpecConfig | None, scenario: Scenario,
                 record_property: Record) -> None:
    """A short trace run whole; its mean tau beside the trace's as ``trace_tau`` and
    ``golden_trace_tau`` (the certificate's golden τ and histograms stay the plain trace's)."""
    trace = _trace(spec_config, scenario)
    assert spec_config is not None
    driver = _run(sg, spec_config, trace, trace.sampling.max_new_tokens)
    problems = _compare(trace, driver, spec_config)
    record_property("trace_tau", golden.summarize(
        [o.accept_lens for o in driver.outcomes.values()], spec_config.num_steps)["mean_tau"])
    record_property("golden_trace_tau", trace.summary["mean_tau"])
    if trace.retract_every is not None:
        record_property("retractions", driver.retractions)
    assert not problems, f"{len(problems)} golden mismatches: {problems[:5]}"


@pytest.mark.specgate_requires("chunked_prefill")
def test_chunked_acceptance_matches_golden(sg: SuiteContext, spec_config: SpecConfig | None,
                                           record_property: Record) -> None:
    _check_whole(sg, spec_config, CHUNKED, record_property)


@pytest.mark.specgate_requires("stepwise", "sessions")
def test_session_acceptance_matches_golden(sg: SuiteContext, spec_config: SpecConfig | None,
                                           record_property: Record) -> None:
    _check_whole(sg, spec_config, SESSION_TURNS, record_property)


@pytest.mark.specgate_requires("forced_retract")
def test_retraction_acceptance_matches_golden(sg: SuiteContext, spec_config: SpecConfig | None,
                                              record_property: Record) -> None:
    if spec_config is not None and spec_config.overlap:
        pytest.skip("not applicable: under overlap scheduling a step's result is applied a step "
                    "late, so the forced-retraction hook retracts other requests, at other "
                    "points, than the sequential trace recorded")
    _check_whole(sg, spec_config, RETRACTED, record_property)

"""Tier golden: acceptance traces against `golden/` for backends that run the reference draft
algorithm on the fixture weights (``reference_draft``) and report per-verify counts
(``acceptance_stats``), every request of the golden set in every profile: ``full`` for the
trace's whole length, ``gate`` for its first ``GATE_TOKENS`` tokens (the runs are greedy and
batched, so 40 requests cost little more than a few run one at a time). Outputs,
and the accept length of every verify step, must match exactly up to each request's first
fragile position; mean tau must stay within ``golden.TAU_RTOL``. A draft that got worse is still
lossless — this is the tier that notices."""

from __future__ import annotations

import pytest

from conformance.checks import golden
from conformance.contract import SpecConfig
from conformance.report.certified import accept_histogram
from conformance.run.plugin import SuiteContext
from conformance.suites.support import greedy, open_driver, parametrize_spec_configs, run_all

pytestmark = [pytest.mark.specgate_tier("golden"),
              pytest.mark.specgate_requires("reference_draft", "acceptance_stats")]
GOLDEN_SET = "default"
GATE_TOKENS = 64  # of the trace's 128 per request: every request, half the length, in gate


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_spec_configs(metafunc)


def test_acceptance_matches_golden(sg: SuiteContext, spec_config: SpecConfig | None,
                                   record_property) -> None:
    if spec_config is None:
        pytest.skip("plain decoding has no acceptance trace")
    trace = golden.load(spec_config, GOLDEN_SET)
    chosen = trace.requests
    recorded = int(trace.sampling["max_new_tokens"])
    params = greedy(recorded if sg.profile.name == "full" else min(GATE_TOKENS, recorded))
    requests = {r.id: (r.prompt_ids, params) for r in chosen}
    with open_driver(sg, spec_config, max_running_requests=max(64, len(requests)),
                     kv_pool_tokens=65536) as driver:
        outcomes = run_all(driver, requests)
    problems = golden.compare(trace, {k: o.output_ids for k, o in outcomes.items()},
                              {k: o.accept_lens for k, o in outcomes.items()},
                              spec_config.num_steps)
    def run_steps(lens: list[int]) -> list[int]:  # the verify steps inside this run's length
        return lens[:golden.comparable_steps(lens, params.max_new_tokens)]

    backend_lens = [run_steps(o.accept_lens) for o in outcomes.values()]
    golden_lens = [run_steps(r.accept_lens) for r in chosen]
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

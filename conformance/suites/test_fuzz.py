"""Tier fuzz: a Hypothesis state machine drives the backend as a client would
(``conformance.repro.fuzz``): submits of every length and sampling setting, steps, aborts in
every phase, session turns, rollbacks and closes, under pool pressure and forced retraction
where claimed; the strict invariants after every step and the reference at every token of a
greedy request. No case in it is written by hand.

Deterministic: Hypothesis runs derandomized (its seed is fixed by the test, not the clock) with
no example database, so a profile always runs the same examples; the certificate records the
settings. A failure is shrunk by Hypothesis, and the check's repro file is the shrunk scenario.

Requires only the spec's algorithm: a run-to-completion backend takes submits between its steps
too. What else the machine does depends on what the backend claims (abort, sessions, sampling,
memory_view, forced_retract).
"""

from __future__ import annotations

from functools import partial

import hypothesis
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from conformance.repro.fuzz import PAGE_SIZES, FuzzTarget, machine_for, shrink_budget
from conformance.run.context import SuiteContext
from conformance.suites.support import page_for

pytestmark = pytest.mark.specgate_tier("fuzz")

STEPS_PER_EXAMPLE = 16  # rules per example at most


def test_state_machine(sg: SuiteContext, record_property) -> None:
    spec = sg.spec.configs[0]
    # page sizes are asked only of a backend claiming memory_view (the machine's open_engine)
    pages = (tuple(sorted({page_for(sg, p) for p in PAGE_SIZES})) if sg.caps.memory_view
             else PAGE_SIZES)
    target = FuzzTarget(sg.backend, sg.caps, partial(sg.open_config, spec), sg.oracle,
                        sg.prompts, sg.recorded,
                        step_tokens=1 if spec is None else spec.num_draft_tokens,
                        page_sizes=pages)
    chosen = settings(max_examples=sg.profile.fuzz_examples,
                      stateful_step_count=STEPS_PER_EXAMPLE, derandomize=True, database=None,
                      deadline=None, print_blob=False, report_multiple_bugs=False,
                      phases=(Phase.generate, Phase.shrink),
                      suppress_health_check=list(HealthCheck))
    record_property("fuzz", f"hypothesis {hypothesis.__version__}, derandomized, "
                            f"{sg.profile.fuzz_examples} examples of at most "
                            f"{STEPS_PER_EXAMPLE} rules, shrinking for at most "
                            f"{sg.profile.fuzz_shrink_seconds:g} s")
    with shrink_budget(sg.profile.fuzz_shrink_seconds):
        run_state_machine_as_test(machine_for(target), settings=chosen)

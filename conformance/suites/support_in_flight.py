"""Acting on a request while a launched step of it is unresolved (overlap scheduling): the
handle's view of those steps, and the acceptance count a stale result must not change."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conformance.repro.driver import Driver, Outcome
from conformance.suites.support_extras import in_flight_handle

InFlight = Callable[[], frozenset[str]]


def in_flight_of(driver: Driver) -> InFlight:
    """The handle's view of launched, unresolved steps; a configuration without overlap
    scheduling resolves every step before the next, so these cases do not apply to it."""
    if not driver.overlap:
        pytest.skip("not applicable: this configuration resolves every step before the next")
    return in_flight_handle(driver.handle).in_flight


def assert_acceptance_accounts(driver: Driver, rid: str, outcome: Outcome) -> None:
    """Every token came from a prefill (one per prefill, re-prefills after retraction too) or
    from a verify step counted in accept_lens: a stale result counted as acceptance breaks it."""
    if not driver.caps.acceptance_stats:
        return
    prefills = 1 + driver.retracted[rid]
    assert len(outcome.output_ids) == prefills + sum(outcome.accept_lens), (
        f"{rid}: {len(outcome.output_ids)} tokens, but {prefills} prefill(s) and verify steps "
        f"accepting {sum(outcome.accept_lens)} ({outcome.accept_lens}) account for "
        f"{prefills + sum(outcome.accept_lens)}")

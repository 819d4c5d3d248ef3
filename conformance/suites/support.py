"""Helpers shared by the suite's tiers: open a backend, run request mixes, compare outputs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import pytest

from conformance.adapter import SamplingParams, SpecConfig
from conformance.driver import Driver, Outcome, backend_call, step_budget
from conformance.plugin import SuiteContext, context
from conformance.specs import config_id


def parametrize_spec_configs(metafunc: pytest.Metafunc) -> None:
    """For a suite module's ``pytest_generate_tests``: one case per configuration of the spec
    being certified (``spec_config`` argument)."""
    if "spec_config" in metafunc.fixturenames:
        configs = context(metafunc.config).spec.configs
        metafunc.parametrize("spec_config", configs, ids=[config_id(c) for c in configs])


@contextmanager
def open_driver(sg: SuiteContext, spec: SpecConfig | Literal["first"] | None = "first",
                **limits: int) -> Iterator[Driver]:
    """A fresh engine instance of the backend under test. ``spec``: a configuration of the
    spec being certified; by default its first one."""
    chosen = sg.spec.configs[0] if spec == "first" else spec
    with backend_call("backend.open()"):
        handle = sg.backend.open(sg.open_config(chosen, **limits))
    try:
        yield Driver(handle, sg.caps, overlap=chosen is not None and chosen.overlap)
    finally:
        with backend_call("handle.close()"):
            handle.close()


def greedy(max_new_tokens: int, **kw: object) -> SamplingParams:
    """Greedy with ``ignore_eos`` by default, so every output has a known length."""
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)


def run_all(driver: Driver, requests: dict[str, tuple[list[int], SamplingParams]]
            ) -> dict[str, Outcome]:
    for rid, (prompt, params) in requests.items():
        driver.submit(rid, prompt, params)
    return driver.run(step_budget(list(requests.values())))


def first_divergence(got: list[int], want: list[int]) -> str:
    """Where two token sequences first differ, for a failure message."""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return f"first divergence at output index {i}: got {g}, expected {w}"
    return f"lengths differ: got {len(got)} tokens, expected {len(want)}"


def assert_matches_oracle(sg: SuiteContext, outcomes: dict[str, Outcome],
                          requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
    bad = []
    for rid, (prompt, params) in requests.items():
        want = sg.oracle.greedy(tuple(prompt), params)
        got = outcomes[rid].output_ids
        if got != want:
            bad.append(f"{rid}: {first_divergence(got, want)}")
    assert not bad, f"{len(bad)}/{len(requests)} outputs differ from the reference: {bad[:5]}"

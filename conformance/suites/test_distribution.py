"""Tier distribution: sampled tokens follow the target distribution exactly.

Speculative sampling must be lossless: whatever the draft proposes, every emitted token is
distributed as the target model says. Greedy identity (the lossless tier) cannot see a biased
sampler, so this tier compares emitted tokens with exact float64 target probabilities in a
hypothesis test with a fixed false-alarm budget (``stats.ALPHA`` = 1e-6 per test), and proves
the test has teeth with a negative control whose rejection power is computed, not hoped for.

Design:
* One prompt (the shortest of the profile's set), ``SAMPLES`` requests differing only in their
  seed, each ``TOKENS`` = 3 tokens: t1 comes from the prefill (the plain path); under EAGLE,
  t2 and t3 come from the first verify (t2 at depth 0 of the tree rooted at t1; t3 at depth 1
  when t2 was an accepted draft, otherwise from the next verify, rooted at t2).
* Restricted support: ``top_k`` = 4, so the joint law of (t1, t2, t3) lives on at most 64
  cells, each with an exact probability ``p(t1) p(t2 | t1) p(t3 | t1, t2)`` from the reference
  oracle (an unmodified engine's scoring prefill, float64 after temperature / top-k). The whole
  joint is tested at once, so every request counts (conditioning on one t1 would waste most of
  them), and the first-token (plain) law is checked with the speculative ones. The temperature
  is not 1, so a verifier that ignores it or applies it twice is caught as well.
* Statistic: the G-test, cells with expected count < ``stats.MIN_EXPECTED`` pooled (the
  pooling depends on the null only); any draw outside the support rejects outright.
* Independence: every request has its own seed; the reference engine derives one generator per
  (seed, output position), so draws do not depend on batching.
* Negative control: the same procedure against the reference engine's ``biased_verify_sampler``
  mutant (bonus drawn from ``p`` instead of the residual), on the same model and spec. Its exact
  output law follows from the draft trees it verified (it records them), which gives its
  rejection power at ``SAMPLES`` by Monte Carlo; the tier requires power >= ``MIN_POWER`` and
  that the actual control run is rejected. Under ``--spec none`` the control uses the default
  EAGLE chain configuration (with ``--specgate-draft-model`` if given).

Everything is seeded, so the outcome is reproducible run to run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from conformance import stats
from conformance.adapter import Backend, OpenConfig, SamplingParams, SpecConfig
from conformance.backends.mutants import DraftTree, mutant_backend
from conformance.driver import Driver
from conformance.plugin import SuiteContext
from conformance.specs import SPECS

pytestmark = [pytest.mark.specgate_tier("distribution"),
              pytest.mark.specgate_requires("sampling", "stepwise")]

SAMPLES = 2048            # requests per run (the backend under test; the negative control)
BATCH = 512               # max_running_requests: large batches keep the run within budget
TOKENS = 3                # t1 (prefill), t2 and t3 (verify)
TOP_K = 4                 # restricted support: at most TOP_K ** TOKENS cells
TEMPERATURE = 1.3
NEGATIVE_CONTROL = "biased_verify_sampler"
MIN_POWER = 0.99
POWER_TRIALS = 4000

Cell = tuple[int, ...]


def sampling_params(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=TOKENS, temperature=TEMPERATURE, top_k=TOP_K,
                          ignore_eos=True, seed=seed)


def shortest_prompt(sg: SuiteContext) -> tuple[int, ...]:
    """The shortest prompt of the set: prefill is most of the cost, and one prompt suffices."""
    return min(sg.prompts, key=lambda c: (len(c.ids), c.id)).ids


# --- the null: the exact joint law ---------------------------------------------------------

@dataclass(frozen=True)
class JointLaw:
    """The exact law of the first ``TOKENS`` tokens on its support (every cell of positive
    probability, in lexicographic order), and the per-prefix next-token distributions."""

    prompt: tuple[int, ...]
    cells: tuple[Cell, ...]
    probs: np.ndarray                              # float64, sums to 1
    next_probs: dict[tuple[int, ...], torch.Tensor]  # output prefix -> [vocab] float64

    def counts(self, outputs: Iterable[list[int]]) -> tuple[np.ndarray, int]:
        """Counts per cell, plus one last cell for draws outside the support (probability 0:
        a single one rejects)."""
        index = {c: i for i, c in enumerate(self.cells)}
        counts = np.zeros(len(self.cells) + 1)
        for out in outputs:
            counts[index.get(tuple(out[:TOKENS]), len(self.cells))] += 1
        return counts, int(counts[-1])

    @property
    def probs_with_outside(self) -> np.ndarray:
        return np.append(self.probs, 0.0)


def exact_law(sg: SuiteContext, prompt: tuple[int, ...]) -> JointLaw:
    """Walk the support tree: ``1 + k + k^2`` scoring prefills of the reference oracle."""
    params = sampling_params(0)
    next_probs: dict[tuple[int, ...], torch.Tensor] = {}
    cells: list[Cell] = []
    probs: list[float] = []

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == TOKENS:
            cells.append(prefix)
            probs.append(mass)
            return
        p = sg.oracle.next_token_probs(prompt + prefix, params)
        next_probs[prefix] = p
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk((*prefix, t), mass * float(p[t]))

    walk((), 1.0)
    return JointLaw(prompt, tuple(cells), np.array(probs), next_probs)


# --- one run -----------------------------------------------------------------------------

@dataclass
class Run:
    outputs: list[list[int]]
    seconds: float
    steps: int


def sample(backend: Backend, sg: SuiteContext, spec: SpecConfig | None,
           prompt: tuple[int, ...], inspect: Callable[[object], None] | None = None) -> Run:
    """``SAMPLES`` seeded requests through the Driver (event-stream and memory checks on)."""
    cfg = OpenConfig(model=sg.model, spec=spec, max_running_requests=BATCH,
                     kv_pool_tokens=BATCH * (len(prompt) + 64),
                     max_prefill_tokens=max(2048, BATCH * len(prompt)))
    start = time.perf_counter()
    handle = backend.open(cfg)
    try:
        driver = Driver(handle, backend.capabilities())
        for i in range(SAMPLES):
            driver.submit(f"d{i}", list(prompt), sampling_params(i))
        outcomes = driver.run(64 + SAMPLES * (TOKENS + 2))
        if inspect is not None:
            inspect(handle)
    finally:
        handle.close()
    outputs = [outcomes[f"d{i}"].output_ids for i in range(SAMPLES)]
    bad = [(i, o) for i, o in enumerate(outputs) if len(o) != TOKENS]
    assert not bad, f"{len(bad)} requests did not emit {TOKENS} tokens: {bad[:3]}"
    return Run(outputs, time.perf_counter() - start, driver.steps)


def check(law: JointLaw, run: Run) -> stats.GofResult:
    counts, _ = law.counts(run.outputs)
    return stats.gof_test(counts, law.probs_with_outside)


def _figures(record_property, prefix: str, law: JointLaw, run: Run,
             result: stats.GofResult) -> None:
    record_property(f"{prefix}samples", SAMPLES)
    record_property(f"{prefix}support_cells", len(law.cells))
    record_property(f"{prefix}tested_cells", result.cells)
    record_property(f"{prefix}statistic", round(result.statistic, 3))
    record_property(f"{prefix}df", result.df)
    record_property(f"{prefix}p_value", float(f"{result.p_value:.4g}"))
    record_property(f"{prefix}outside_support", result.impossible_hits)
    record_property(f"{prefix}sample_seconds", round(run.seconds, 2))
    record_property(f"{prefix}steps", run.steps)


@pytest.fixture(scope="module")
def law(sg: SuiteContext) -> JointLaw:
    return exact_law(sg, shortest_prompt(sg))


def test_sampled_tokens_follow_target_distribution(sg: SuiteContext, law: JointLaw,
                                                   record_property) -> None:
    run = sample(sg.backend, sg, sg.spec.configs[0], law.prompt)
    result = check(law, run)
    _figures(record_property, "", law, run, result)
    record_property("alpha", stats.ALPHA)
    assert not result.rejected, (
        f"emitted tokens do not follow the target distribution: {result.summary()}; "
        f"worst cells: {worst_cells(law, run)}")


def worst_cells(law: JointLaw, run: Run, top: int = 3) -> str:
    """The cells contributing most to the G statistic, for a failure message."""
    counts, outside = law.counts(run.outputs)
    expected = SAMPLES * law.probs
    with np.errstate(divide="ignore", invalid="ignore"):
        contrib = np.where(counts[:-1] > 0,
                           counts[:-1] * np.log(counts[:-1] / expected), 0.0) - (
            counts[:-1] - expected)
    order = np.argsort(-np.abs(contrib))[:top]
    cells = ", ".join(f"{law.cells[i]}: {int(counts[i])} vs {expected[i]:.1f}" for i in order)
    return cells + (f"; {outside} outside the support" if outside else "")


# --- the negative control -----------------------------------------------------------------

NodeLaw = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


def reference_bonus(p: torch.Tensor, children: tuple[int, ...]) -> torch.Tensor:
    """The correct bonus law after every child is rejected: ``p`` without the children."""
    residual = p.clone()
    residual[list(children)] = 0.0
    total = float(residual.sum())
    return residual / total if total > 0 else residual


def biased_bonus(p: torch.Tensor, children: tuple[int, ...]) -> torch.Tensor:
    """The negative control's bonus law: ``p`` itself, rejected children included."""
    return p


def _emission(p: torch.Tensor, children: tuple[int, ...], bonus: NodeLaw
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted, bonus) parts of one node's emission law: child ``c`` is accepted with
    probability ``p(c)``; otherwise (``1 - p(children)``) the bonus law is drawn."""
    accepted = torch.zeros_like(p)
    if children:
        accepted[list(children)] = p[list(children)]
    rest = 1.0 - float(accepted.sum())
    return accepted, rest * bonus(p, children)


def _children(tree: DraftTree, path: tuple[int, ...], depth: int, max_depth: int
              ) -> tuple[int, ...]:
    if depth >= max_depth:
        return ()
    return dict(tree).get(path, ())


def _variants(trees: dict[tuple[int, ...], Counter[DraftTree]], root: tuple[int, ...]
              ) -> list[tuple[DraftTree, float]]:
    """The trees verified at ``root`` with their frequencies; none recorded: no drafts."""
    seen = trees.get(root)
    if not seen:
        return [((), 1.0)]
    total = sum(seen.values())
    return [(tree, n / total) for tree, n in seen.items()]


def speculative_law(law: JointLaw, trees: dict[tuple[int, ...], Counter[DraftTree]],
                    bonus: NodeLaw, max_depth: int) -> np.ndarray:
    """The exact law of (t1, t2, t3) for the tree sampling scheme with ``bonus`` as its
    after-rejection law, given the draft trees the engine verified (per root sequence).
    With ``reference_bonus`` it is the target law whatever the trees (a self-check).

    t1 is plain; t2 is emitted at the root of the tree at (prompt, t1); t3 at t2's node of
    that tree if t2 was an accepted child, else at the root of the tree at (prompt, t1, t2).
    A root never recorded is taken to have had no drafts (its law is then ``p`` for either
    scheme), which can only understate the control's bias."""
    if TOKENS != 3:
        raise NotImplementedError("the control law is derived for three tokens")
    out = np.zeros(len(law.cells))
    for i, (t1, t2, t3) in enumerate(law.cells):
        p0, p1, p2 = law.next_probs[()], law.next_probs[(t1,)], law.next_probs[(t1, t2)]
        total = 0.0
        for tree, w in _variants(trees, (*law.prompt, t1)):
            acc, rest = _emission(p1, _children(tree, (), 0, max_depth), bonus)
            if acc[t2] > 0:  # t2 was an accepted draft: t3 from its node, same tree
                a3, r3 = _emission(p2, _children(tree, (t2,), 1, max_depth), bonus)
                total += w * float(acc[t2]) * float(a3[t3] + r3[t3])
            if rest[t2] > 0:  # t2 was the bonus: t3 from the next verify, rooted at t2
                nxt = 0.0
                for tree2, w2 in _variants(trees, (*law.prompt, t1, t2)):
                    a3, r3 = _emission(p2, _children(tree2, (), 0, max_depth), bonus)
                    nxt += w2 * float(a3[t3] + r3[t3])
                total += w * float(rest[t2]) * nxt
        out[i] = float(p0[t1]) * total
    return out


def smallest_powerful_n(p_null: np.ndarray, p_alt: np.ndarray) -> int:
    """The smallest power-of-two sample size at which the control is rejected with power
    ``MIN_POWER``: how much margin ``SAMPLES`` has."""
    n = 16
    while n < SAMPLES and stats.power(p_null, p_alt, n, trials=POWER_TRIALS,
                                      rng=np.random.default_rng(1)) < MIN_POWER:
        n *= 2
    return n


def control_spec(sg: SuiteContext, request: pytest.FixtureRequest) -> SpecConfig:
    spec = sg.spec.configs[0]
    if spec is not None:
        return spec
    default = SPECS["eagle"].configs[0]
    assert default is not None
    draft = request.config.getoption("--specgate-draft-model")
    return replace(default, draft_model=draft) if draft else default


def test_negative_control_is_rejected(sg: SuiteContext, law: JointLaw, record_property,
                                      request: pytest.FixtureRequest) -> None:
    """The same procedure must reject a subtly biased verifier, with power >= MIN_POWER."""
    spec = control_spec(sg, request)
    trees: dict[tuple[int, ...], Counter[DraftTree]] = {}

    def grab_trees(handle: object) -> None:  # the reference engine's mutant records them
        trees.update(handle.engine.worker.trees)  # type: ignore[attr-defined]

    run = sample(mutant_backend(NEGATIVE_CONTROL), sg, spec, law.prompt, grab_trees)
    result = check(law, run)
    _figures(record_property, "control_", law, run, result)

    lossless = speculative_law(law, trees, reference_bonus, spec.num_steps)
    np.testing.assert_allclose(lossless, law.probs, rtol=1e-9, atol=1e-12,
                               err_msg="control law derivation broken: the reference scheme "
                                       "must give the target law")
    p_alt = speculative_law(law, trees, biased_bonus, spec.num_steps)
    assert abs(p_alt.sum() - 1.0) < 1e-9, f"control law sums to {p_alt.sum()}"
    power = stats.power(law.probs, p_alt, SAMPLES, stats.ALPHA, POWER_TRIALS,
                        np.random.default_rng(0))
    accept = sum(float(law.next_probs[()][t1]) * w * float(law.next_probs[(t1,)][
        list(_children(tree, (), 0, spec.num_steps))].sum())
        for t1 in {c[0] for c in law.cells}
        for tree, w in _variants(trees, (*law.prompt, t1)))
    record_property("control_power", power)
    record_property("control_power_trials", POWER_TRIALS)
    record_property("control_n_for_power", smallest_powerful_n(law.probs, p_alt))
    record_property("control_tv_distance", round(0.5 * float(np.abs(p_alt - law.probs).sum()),
                                                 4))
    record_property("control_first_draft_accept_rate", round(accept, 4))
    assert power >= MIN_POWER, (f"the tier is too weak: it rejects the {NEGATIVE_CONTROL} "
                                f"control with power {power:.3f} < {MIN_POWER} at n={SAMPLES}")
    assert result.rejected, (f"the {NEGATIVE_CONTROL} control was not rejected "
                             f"(power {power:.3f}): {result.summary()}")


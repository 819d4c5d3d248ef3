"""Lossless draft regressions the golden tier must catch through per-step acceptance, where a
mean-tau tolerance alone lets them through (bug-zoo mutants ``draft_position_shift``,
``tree_wrong_parent``, ``extend_padding_not_restaged``)."""

from __future__ import annotations

from conformance.backends.mutants import MUTANTS
from conformance.checks import golden
from conformance.run.specs import SPECS
from refengine import EngineConfig, SamplingParams

TOKENS = 64  # the gate profile's golden length


def golden_problems(mutant_name: str) -> list[str]:
    """The mutant on its spec's first configuration over the whole golden set (checked to be
    lossless), compared with the golden trace."""
    mutant = MUTANTS[mutant_name]
    config = SPECS[mutant.spec].configs[0]
    assert config is not None
    trace = golden.load(config, "default")
    engine = mutant.engine_class(EngineConfig(model="tiny-code", spec=config,
                                              kv_pool_tokens=65536, max_running_requests=64,
                                              cuda_graph=mutant.graphs is not None,
                                              graph_executor=mutant.graphs or "compiled"))
    outs = engine.generate([r.prompt_ids for r in trace.requests],
                           SamplingParams(max_new_tokens=TOKENS, temperature=0.0,
                                          ignore_eos=True))
    pairs = list(zip(trace.requests, outs, strict=True))
    assert all(o.output_ids == r.output_ids[:TOKENS] for r, o in pairs), "the bug is lossless"
    return golden.compare(trace, {r.id: o.output_ids for r, o in pairs},
                          {r.id: o.accept_lens for r, o in pairs}, config.num_steps)


def test_one_position_draft_shift_is_caught_although_mean_tau_is_within_tolerance() -> None:
    problems = golden_problems("draft_position_shift")
    assert any("verify step" in p for p in problems)
    assert not any(p.startswith("mean tau") for p in problems)  # 0.9% off: inside 5%


def test_wrong_parent_tree_is_caught_per_step() -> None:
    problems = golden_problems("tree_wrong_parent")
    assert sum("verify step" in p for p in problems) >= 10


def test_stale_extend_padding_is_lossless_but_caught_per_step() -> None:
    """The graphed draft-extend's padded columns write the head's KV into stale slots: every
    token is still the target's, the acceptance is not."""
    problems = golden_problems("extend_padding_not_restaged")
    assert any("verify step" in p for p in problems)

"""Request builders shared by the tiers and by the expected outputs' recorder: greedy params,
the context lengths a profile's long requests reach, the long-context requests that cross them,
and the requests a reduced precision's near-tie allowance is calibrated on."""

from __future__ import annotations

from functools import cache

from conformance.contract import SamplingParams
from conformance.plan.profiles import Profile
from conformance.plan.prompts import load_prompt_set, long_prompt
from refengine.data import resolve_model_dir
from refengine.model.loader import load_config

BOUNDARY_LEAD = 24      # a long request's context runs this many tokens either side of a boundary
# The longest context limit a to-limit request runs to whatever the profile's lengths (a model
# with a longer one would prefill its whole context; the full profile's boundaries stop there too).
REACH_LIMIT_MAX = 2048

Requests = tuple[tuple[tuple[int, ...], SamplingParams], ...]


@cache
def context_limit(model: str) -> int:
    """The model's maximum positions: no request's prompt + output may exceed them."""
    return load_config(resolve_model_dir(model)).max_position_embeddings


def context_lengths(model: str, boundaries: tuple[int, ...], reach_limit: bool = False
                    ) -> list[int]:
    """The context lengths of ``boundaries`` the model reaches, ascending; those at or past its
    context limit collapse into the limit. ``reach_limit``: the limit too, whatever the
    boundaries, for a limit up to ``REACH_LIMIT_MAX``."""
    limit = context_limit(model)
    return sorted({min(b, limit) for b in boundaries}
                  | ({limit} if reach_limit and limit <= REACH_LIMIT_MAX else set()))


def greedy(max_new_tokens: int, **kw: object) -> SamplingParams:
    """Greedy with ``ignore_eos`` by default, so every output has a known length."""
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)


def requests_across(model: str, boundary: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Requests whose context crosses ``boundary`` tokens: one while decoding (speculation
    across it), one inside its prompt (a prefill chunk across it). At the model's context limit
    instead one request whose prompt ends ``BOUNDARY_LEAD`` short of it and that asks for twice
    that: it must end there, by length. Prompts are the bundled prompts laid end to end."""
    limit = context_limit(model)
    if boundary >= limit:
        return {f"to-limit-{limit}": (list(long_prompt(limit - BOUNDARY_LEAD, model=model)),
                                      greedy(2 * BOUNDARY_LEAD))}
    return {f"decode-across-{boundary}": (
                list(long_prompt(boundary - BOUNDARY_LEAD, model=model)),
                greedy(2 * BOUNDARY_LEAD)),
            f"prefill-across-{boundary}": (
                list(long_prompt(boundary + BOUNDARY_LEAD, offset=boundary, model=model)),
                greedy(BOUNDARY_LEAD))}


@cache
def calibration_requests(model: str, profile: Profile) -> Requests:
    """What a reduced precision's near-tie allowance is calibrated on
    (``conformance.checks.calibration``): the profile's prompts at its greedy length and the
    long-context requests of every context length the lossless and memory tiers reach, the
    context limit included."""
    prompts = [(c.ids, greedy(profile.max_new_tokens))
               for c in load_prompt_set(profile.prompt_set, model)]
    long = [(tuple(prompt), params)
            for n in context_lengths(model, profile.context_boundaries, reach_limit=True)
            for prompt, params in requests_across(model, n).values()]
    return tuple(prompts + long)

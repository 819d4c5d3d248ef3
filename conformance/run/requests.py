"""Request builders shared by the tiers and by the expected outputs' recorder: greedy params
and the long-context requests that cross a profile's context boundaries."""

from __future__ import annotations

from functools import cache

from conformance.contract import SamplingParams
from conformance.run.prompts import long_prompt
from refengine.data import resolve_model_dir
from refengine.model.loader import load_config

BOUNDARY_LEAD = 24      # a long request's context runs this many tokens either side of a boundary


@cache
def context_limit(model: str) -> int:
    """The model's maximum positions: no request's prompt + output may exceed them."""
    return load_config(resolve_model_dir(model)).max_position_embeddings


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

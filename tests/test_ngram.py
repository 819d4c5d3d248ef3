"""N-gram speculation: the lookup on hand-made contexts and against a brute-force reference
(Hypothesis), and the engine on the tiny-code fixture: greedy output equals plain decoding
(N=4 and N=6, page 1 and 4, chunked prefill, forced retraction), overlap (V2) equals V1 token
for token and step for step, a repetitive prompt gets more than one token per step, nothing
is held afterwards and no draft pool exists, and a tree is refused."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.plan.prompts import load_prompt_set
from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.config import NGRAM_MAX, NGRAM_MIN
from refengine.memory.view import idle_error
from refengine.request import Req
from refengine.speculative.inputs import NgramInput, VerifyInput
from refengine.speculative.ngram_lookup import propose

GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=11,
                         ignore_eos=True)
REPETITIVE = "def add(a, b):\n    return a + b\n\n" * 6

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference(context: Sequence[int], steps: int, shortest: int = NGRAM_MIN,
              longest: int = NGRAM_MAX) -> list[int]:
    """The lookup spelled out: the longest suffix with an earlier occurrence, its latest one,
    and the tokens after it copied forward one by one (over the proposal itself past the
    root); no match at all: the root repeated."""
    out = list(context)
    end = len(context)
    for n in range(longest, shortest - 1, -1):
        found = [i for i in range(end - n) if out[i:i + n] == out[end - n:end]]
        if found:
            source = found[-1] + n
            break
    else:
        source = end - 1
    for j in range(steps):
        out.append(out[source + j])
    return out[end:]


def lookup(context: list[int], steps: int = 3) -> list[int]:
    """``propose`` on one context."""
    row = torch.tensor([context])
    found: list[int] = propose(row, torch.tensor([len(context)]), steps, NGRAM_MIN,
                               NGRAM_MAX)[0].tolist()
    return found


@pytest.mark.parametrize(("context", "want"), [
    # (7, 8, 9) occurs twice before the suffix: the latest occurrence's continuation wins
    ([7, 8, 9, 1, 7, 8, 9, 2, 5, 7, 8, 9], [2, 5, 7]),
    # the 3-token suffix's match (early) beats the 1-token suffix's (later)
    ([4, 5, 6, 1, 2, 6, 3, 4, 5, 6], [1, 2, 6]),
    # no earlier occurrence of any suffix: the root repeated
    ([1, 2, 3, 4], [4, 4, 4]),
    # the suffix itself is no match (the only 7 is the root)
    ([5, 6, 7], [7, 7, 7]),
    # an occurrence may overlap the suffix; past the root the copy goes on over the proposal
    ([2, 2, 2], [2, 2, 2]),
    ([1, 2, 1, 2], [1, 2, 1]),
    # a single-token context has nothing before its root
    ([9], [9, 9, 9]),
])
def test_lookup_on_hand_made_contexts(context: list[int], want: list[int]) -> None:
    assert lookup(context) == want == reference(context, 3)


def test_lookup_reads_nothing_past_each_context() -> None:
    """Rows of different lengths in one batch; what lies past a row's context (here tokens
    that would match) changes nothing."""
    contexts = [[3, 1, 2, 3], [1, 2, 1, 2, 1], [5]]
    tokens = torch.full((3, 8), 3)
    for i, ctx in enumerate(contexts):
        tokens[i, :len(ctx)] = torch.tensor(ctx)
    found = propose(tokens, torch.tensor([len(c) for c in contexts]), 4, NGRAM_MIN, NGRAM_MAX)
    assert found.tolist() == [reference(c, 4) for c in contexts]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=4),
       st.integers(1, 6), st.integers(1, 3), st.integers(0, 2), st.integers(0, 2**31 - 1))
def test_lookup_matches_brute_force(contexts: list[list[int]], steps: int, shortest: int,
                                    extra: int, seed: int) -> None:
    longest = shortest + extra
    width = max(len(c) for c in contexts) + 3
    tokens = torch.randint(0, 4, (len(contexts), width),
                           generator=torch.Generator().manual_seed(seed))  # random padding
    for i, ctx in enumerate(contexts):
        tokens[i, :len(ctx)] = torch.tensor(ctx)
    found = propose(tokens, torch.tensor([len(c) for c in contexts]), steps, shortest, longest)
    assert found.tolist() == [reference(c, steps, shortest, longest) for c in contexts]


# --- the engine on the fixture --------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """The fixture's small prompt set (8 prompts, 10 to 177 tokens)."""
    return [list(c.ids) for c in load_prompt_set("small", "tiny-code")]


def ngram_engine(n: int | None = 4, overlap: bool = False, **kw: object) -> Engine:
    spec = None if n is None else SpecConfig(algorithm="ngram", num_steps=n - 1,
                                             num_draft_tokens=n, overlap=overlap)
    return Engine(EngineConfig(model="tiny-code", spec=spec,
                               **{"kv_pool_tokens": 8192, "strict_mem_check": True, **kw}))


@pytest.fixture(scope="module")
def plain(prompts: list[list[int]]) -> list[list[int]]:
    return [o.output_ids for o in ngram_engine(None).generate(prompts, GREEDY)]


@pytest.mark.parametrize(("n", "page_size", "extra"), [
    (4, 1, {}), (6, 4, {}), (4, 4, {"max_prefill_tokens": 16}), (4, 1, {"retract_every": 3})])
def test_greedy_equals_plain(prompts: list[list[int]], plain: list[list[int]], n: int,
                             page_size: int, extra: dict[str, int]) -> None:
    engine = ngram_engine(n, page_size=page_size, **extra)
    outs = engine.generate(prompts, GREEDY)
    assert [o.output_ids for o in outs] == plain
    prefills = 1 if not extra.get("retract_every") else None  # a re-prefill emits one more
    for o in outs:  # every prefill emits one token, every verify 1..N
        assert prefills is None or prefills + sum(o.accept_lens) == len(o.output_ids)
        assert min(o.accept_lens) >= 1 and max(o.accept_lens) <= n
    assert idle_error(engine.memory()) is None
    assert engine.kv.draft_pool is None  # no model, no KV of its own


@pytest.mark.parametrize("extra", [{}, {"max_prefill_tokens": 16, "retract_every": 3}],
                         ids=["plain", "chunked-retracted"])
def test_each_step_proposes_the_lookup_over_the_request_context(
        prompts: list[list[int]], extra: dict[str, int]) -> None:
    """The context the drafter carries from step to step is the request's own (prompt and
    output up to the root): every chain is the lookup over it, whatever the chunking and
    retractions before."""
    engine = ngram_engine(**extra)
    worker = engine.worker
    assert worker is not None
    draft = worker.draft
    seen: list[tuple[list[int], list[int]]] = []

    def recording(reqs: list[Req], state: NgramInput) -> VerifyInput:
        found = draft(reqs, state)
        seen.extend((r.fill_ids, found.draft_tokens[i, 1:].tolist())
                    for i, r in enumerate(reqs))
        return found

    worker.draft = recording  # type: ignore[method-assign]
    engine.generate(prompts, GREEDY)
    assert seen
    assert all(chain == reference(context, 3) for context, chain in seen)


def test_chunked_prefill_drafts_from_the_whole_prompt(prompts: list[list[int]]) -> None:
    """The context holds every chunk: the same proposals, so the same accept lengths."""
    whole = ngram_engine().generate(prompts, GREEDY)
    chunked = ngram_engine(max_prefill_tokens=16).generate(prompts, GREEDY)
    assert [o.accept_lens for o in chunked] == [o.accept_lens for o in whole]


@pytest.mark.parametrize("thread", [False, True], ids=["one-thread", "launch-thread"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_overlap_equals_sequential(prompts: list[list[int]], params: SamplingParams,
                                   thread: bool) -> None:
    """V2 drafts from the contexts its launches carried forward (never from the request's
    lagging output, which the launch thread races): V1's tokens and accept lengths exactly,
    greedy and seeded sampled alike."""
    v1 = ngram_engine().generate(prompts, params)
    engine = ngram_engine(overlap=True, overlap_thread=thread)
    v2 = engine.generate(prompts, params)
    assert [(o.output_ids, o.accept_lens) for o in v2] == \
        [(o.output_ids, o.accept_lens) for o in v1]
    assert idle_error(engine.memory()) is None


def test_sampled_output_does_not_depend_on_the_batch(prompts: list[list[int]]) -> None:
    together = ngram_engine().generate(prompts, SAMPLED)
    alone = ngram_engine().generate(prompts[3:4], SAMPLED)
    assert alone[0].output_ids == together[3].output_ids


def test_a_repetitive_prompt_gets_more_than_one_token_per_step() -> None:
    engine = ngram_engine()
    (out,) = engine.generate(REPETITIVE, GREEDY)
    assert sum(out.accept_lens) / len(out.accept_lens) > 1.5, out.accept_lens
    assert idle_error(engine.memory()) is None


def test_config() -> None:
    """A tree is refused (one ValueError naming ``topk``); the draft model is ignored."""
    with pytest.raises(ValueError, match=r"^topk: ngram speculation drafts a chain"):
        SpecConfig(algorithm="ngram", num_steps=3, topk=4, num_draft_tokens=8)
    assert SpecConfig(algorithm="ngram", draft_model="tiny-code-eagle").draft_model == ""
    assert SpecConfig(algorithm="ngram", overlap=True).overlap

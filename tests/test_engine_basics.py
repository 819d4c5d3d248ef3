"""Engine basics on the random model: greedy == transformers (tokens and logits), stop
conditions, chunked prefill, seeded sampling, abort in every phase, idle -> busy, no leaks."""

from __future__ import annotations

import gc
import random
import weakref
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    LogitsRecorder,
    Run,
    drive,
    has_work,
    hf_greedy,
    max_logit_diff,
    model_with_eos,
)

from refengine import Engine, EngineConfig, FinishEvent, SamplingParams, TokenEvent
from refengine.memory.view import bounds_error, conservation_error, idle_error
from refengine.sampler import sampling_probs

NEW = 24
LOGITS_TOL = 1e-4
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 2048) for _ in range(length)]


_rng = random.Random(1234)
PROMPTS: list[list[int]] = [random_prompt(_rng, n) for n in (1, 3, 8, 17, 40, 63)]


@pytest.fixture(scope="module")
def reference(hf_random_model: torch.nn.Module) -> list[tuple[list[int], torch.Tensor]]:
    """transformers greedy tokens and logits for every prompt in PROMPTS."""
    return [hf_greedy(hf_random_model, p, NEW) for p in PROMPTS]


def make_engine(model_dir: Path, **kwargs: object) -> Engine:
    kwargs.setdefault("kv_pool_tokens", 2048)
    return Engine(EngineConfig(model=str(model_dir), **kwargs))  # type: ignore[arg-type]


def assert_idle(engine: Engine) -> None:
    assert not has_work(engine)
    assert idle_error(engine.memory()) is None


def assert_matches_reference(run: Run, i: int,
                             reference: list[tuple[list[int], torch.Tensor]]) -> None:
    """Request ``r{i}`` of ``run`` emitted transformers' greedy tokens, with matching logits."""
    tokens, logits = reference[i]
    assert run.tokens[f"r{i}"] == tokens, f"prompt {i}"
    assert max_logit_diff(run.logits[f"r{i}"], logits) < LOGITS_TOL


# --- greedy == transformers -------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_matches_transformers_one_at_a_time(
        random_model_dir: Path, reference: list[tuple[list[int], torch.Tensor]],
        page_size: int) -> None:
    engine = make_engine(random_model_dir, page_size=page_size)
    recorder = LogitsRecorder(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
        run = drive(engine, recorder)
        assert_matches_reference(run, i, reference)
        assert run.finishes[f"r{i}"].reason == "length"
        assert_idle(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_matches_transformers_all_at_once(
        random_model_dir: Path, reference: list[tuple[list[int], torch.Tensor]],
        page_size: int) -> None:
    engine = make_engine(random_model_dir, page_size=page_size)
    recorder = LogitsRecorder(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    run = drive(engine, recorder)
    assert run.steps == NEW  # one prefill step for the whole batch, then NEW - 1 decode steps
    for i in range(len(PROMPTS)):
        assert_matches_reference(run, i, reference)
    assert_idle(engine)


def test_greedy_with_staggered_arrivals(random_model_dir: Path,
                                        reference: list[tuple[list[int], torch.Tensor]]) -> None:
    """Requests joining a running batch (prefill steps between decode steps) change nothing."""
    engine = make_engine(random_model_dir, page_size=4)
    arrivals = {0: [0, 3], 2: [5], 5: [1, 4], 11: [2]}

    def add(step: int) -> None:
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], GREEDY)

    add(0)
    run = drive(engine, before_step=lambda s: add(s) if s else None)
    assert {rid: run.tokens[rid] for rid in run.tokens} == \
        {f"r{i}": reference[i][0] for i in range(len(PROMPTS))}
    assert_idle(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_next_token_logits_match_transformers(
        random_model_dir: Path, reference: list[tuple[list[int], torch.Tensor]],
        page_size: int) -> None:
    """The scoring API: last-position logits of each prompt, engine left as it was."""
    engine = make_engine(random_model_dir, page_size=page_size)
    engine.add_request("busy", PROMPTS[2], GREEDY)  # scoring works beside a live request
    run = Run()
    run.step(engine)
    before = engine.memory()
    for prompt, (_, logits) in zip(PROMPTS, reference, strict=True):
        ours = engine.next_token_logits(prompt)
        assert float((ours - logits[0]).abs().max()) < LOGITS_TOL
    assert engine.memory() == before
    drive(engine, run=run)
    assert run.tokens["busy"] == reference[2][0]  # the live request was not disturbed
    assert_idle(engine)


def test_generate_api_text_and_ids(random_model_dir: Path,
                                   hf_random_model: torch.nn.Module) -> None:
    engine = make_engine(random_model_dir)
    text = "def fib(n):\n    return"
    ids = engine.tokenize(text)
    outs = engine.generate([text, ids, PROMPTS[2]], SamplingParams(max_new_tokens=5,
                                                                  ignore_eos=True))
    assert [o.prompt_ids for o in outs] == [ids, ids, PROMPTS[2]]
    expected = hf_greedy(hf_random_model, ids, 5)[0]
    assert outs[0].output_ids == outs[1].output_ids == expected
    assert outs[0].text == engine.tokenizer.decode(expected)
    assert all(o.finish_reason == "length" and o.accept_lens == [] for o in outs)
    single = engine.generate(ids, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [o.output_ids for o in single] == [expected]
    assert_idle(engine)


# --- stop conditions --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_new_tokens_exact(random_model_dir: Path,
                              reference: list[tuple[list[int], torch.Tensor]], n: int) -> None:
    engine = make_engine(random_model_dir)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True))
    for out, (tokens, _) in zip(outs, reference, strict=True):
        assert out.output_ids == tokens[:n]
        assert out.finish_reason == "length"
    assert_idle(engine)


def first_new_index(tokens: list[int], start: int) -> int:
    """Smallest index >= start whose token does not occur earlier in ``tokens``."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


@pytest.fixture(scope="module")
def eos_case(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
             reference: list[tuple[list[int], torch.Tensor]]) -> tuple[Path, int, int]:
    """A copy of the random model whose EOS is the token greedy emits at position k of
    PROMPTS[3] (and nowhere before): (model dir, eos id, k)."""
    tokens = reference[3][0]
    k = first_new_index(tokens, 4)
    model = model_with_eos(random_model_dir, tmp_path_factory.mktemp("eos") / "m", tokens[k])
    return model, tokens[k], k


def test_eos_stops(eos_case: tuple[Path, int, int], hf_random_model: torch.nn.Module,
                   reference: list[tuple[list[int], torch.Tensor]]) -> None:
    model, eos, k = eos_case
    engine = make_engine(model)
    out = engine.generate(PROMPTS[3], SamplingParams(max_new_tokens=NEW))[0]
    assert out.output_ids == reference[3][0][:k + 1]  # the EOS token is part of the output
    assert out.finish_reason == "stop"
    hf_tokens, _ = hf_greedy(hf_random_model, PROMPTS[3], NEW, eos_token_id=eos)
    assert out.output_ids == hf_tokens
    assert_idle(engine)


def test_ignore_eos_runs_to_length(eos_case: tuple[Path, int, int],
                                   reference: list[tuple[list[int], torch.Tensor]]) -> None:
    model, _, _ = eos_case
    engine = make_engine(model)
    out = engine.generate(PROMPTS[3], GREEDY)[0]
    assert out.output_ids == reference[3][0]
    assert out.finish_reason == "length"


def test_stop_token_ids(random_model_dir: Path,
                        reference: list[tuple[list[int], torch.Tensor]]) -> None:
    tokens = reference[4][0]
    k1 = first_new_index(tokens, 3)
    k2 = first_new_index(tokens, k1 + 1)
    engine = make_engine(random_model_dir)
    # The earliest of several stop ids wins, and ignore_eos does not disable stop_token_ids.
    params = SamplingParams(max_new_tokens=NEW, stop_token_ids=[tokens[k2], tokens[k1]],
                            ignore_eos=True)
    out = engine.generate(PROMPTS[4], params)[0]
    assert out.output_ids == tokens[:k1 + 1]
    assert out.finish_reason == "stop"
    other = engine.generate(PROMPTS[4], SamplingParams(max_new_tokens=k1 + 1,
                                                       stop_token_ids=[tokens[k2]]))[0]
    assert other.output_ids == tokens[:k1 + 1]
    assert other.finish_reason == "length"  # max_new_tokens reached before the stop id
    assert_idle(engine)


def expected_stop(decode: object, tokens: list[int], stops: list[str]) -> tuple[int, str]:
    """(output length, emitted text) for stop strings: the first token count whose decoded
    text contains a stop string, the text cut before the earliest match."""
    for m in range(1, len(tokens) + 1):
        text = decode(tokens[:m])  # type: ignore[operator]
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return m, text[:min(hits)]
    raise AssertionError("no stop string in the output")


def test_stop_strings_cut_text(random_model_dir: Path,
                               reference: list[tuple[list[int], torch.Tensor]]) -> None:
    engine = make_engine(random_model_dir)
    decode = engine.tokenizer.decode
    tokens = reference[5][0]
    full = decode(tokens)
    # A stop string spanning the boundary between two generated tokens in the middle.
    head, tail = decode(tokens[:10]), decode(tokens[:12])
    assert tail.startswith(head) and len(tail) - len(head) >= 2
    spanning = tail[len(head) - 1:len(head) + 1]
    for stops in ([spanning], [tail[len(head):]], ["\x00never\x00", spanning]):
        m, text = expected_stop(decode, tokens, stops)
        assert m < len(tokens)
        out = engine.generate(PROMPTS[5], SamplingParams(max_new_tokens=NEW, stop=stops,
                                                         ignore_eos=True))[0]
        assert out.finish_reason == "stop", stops
        assert out.output_ids == tokens[:m]
        assert out.text == text
        assert not any(s in out.text for s in stops)
        assert full.startswith(out.text)
    assert_idle(engine)


def test_stop_string_absent_runs_to_length(random_model_dir: Path,
                                           reference: list[tuple[list[int], torch.Tensor]]
                                           ) -> None:
    engine = make_engine(random_model_dir)
    out = engine.generate(PROMPTS[5], SamplingParams(max_new_tokens=NEW, stop=["\x00never"],
                                                     ignore_eos=True))[0]
    assert out.output_ids == reference[5][0]
    assert out.finish_reason == "length"
    assert out.text == engine.tokenizer.decode(reference[5][0])


def test_context_length_finishes(random_model_dir: Path) -> None:
    engine = make_engine(random_model_dir)
    out = engine.generate([[9] * 509], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert len(out.output_ids) == 3  # 509 + 3 = 512 positions: the context is full
    assert out.finish_reason == "length"
    assert_idle(engine)


# --- chunked prefill --------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_same_output(random_model_dir: Path, hf_random_model: torch.nn.Module,
                                     page_size: int) -> None:
    prompt = PROMPTS[4]
    assert len(prompt) == 40
    tokens, logits = hf_greedy(hf_random_model, prompt, NEW)
    engine = make_engine(random_model_dir, page_size=page_size, max_prefill_tokens=8)
    recorder = LogitsRecorder(engine)
    engine.add_request("c", prompt, GREEDY)
    committed: list[tuple[str, int]] = []

    def watch(step: int, events: list[object]) -> None:
        req = engine.memory().requests.get("c")
        if req is not None and req.phase == "prefill":
            committed.append((req.phase, req.committed))

    run = drive(engine, recorder, after_step=watch)
    assert committed == [("prefill", 8), ("prefill", 16), ("prefill", 24), ("prefill", 32)]
    assert run.steps == 5 + NEW - 1
    assert run.tokens["c"] == tokens
    assert max_logit_diff(run.logits["c"], logits) < LOGITS_TOL
    assert_idle(engine)


def test_chunked_prefill_batch(random_model_dir: Path,
                               reference: list[tuple[list[int], torch.Tensor]]) -> None:
    engine = make_engine(random_model_dir, page_size=4, max_prefill_tokens=8)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    run = drive(engine)
    for i in range(len(PROMPTS)):
        assert run.tokens[f"r{i}"] == reference[i][0], f"prompt {i}"
    assert_idle(engine)


# --- seeded sampling --------------------------------------------------------------------------

SAMPLED = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


def sample_alone(model_dir: Path, prompt: list[int], params: SamplingParams, rid: str = "s",
                 seed: int = 0) -> list[int]:
    engine = make_engine(model_dir, seed=seed)
    engine.add_request(rid, prompt, params)
    return drive(engine).tokens[rid]


def test_same_seed_same_tokens(random_model_dir: Path) -> None:
    first = sample_alone(random_model_dir, PROMPTS[2], SAMPLED)
    assert sample_alone(random_model_dir, PROMPTS[2], SAMPLED) == first
    other = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=8,
                           ignore_eos=True)
    assert sample_alone(random_model_dir, PROMPTS[2], other) != first


def test_sampling_independent_of_batch(random_model_dir: Path) -> None:
    alone = sample_alone(random_model_dir, PROMPTS[2], SAMPLED)
    engine = make_engine(random_model_dir, page_size=4, max_prefill_tokens=16)
    for i in (5, 0, 3):
        engine.add_request(f"x{i}", PROMPTS[i], SamplingParams(max_new_tokens=20, temperature=1.0,
                                                               seed=i, ignore_eos=True))
    run = Run()
    run.step(engine)
    engine.add_request("s", PROMPTS[2], SAMPLED)  # joins mid-run, in a different batch
    assert drive(engine, run=run).tokens["s"] == alone


def test_seed_derived_from_engine_seed_and_rid(random_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    base = sample_alone(random_model_dir, PROMPTS[1], params, rid="a", seed=5)
    assert sample_alone(random_model_dir, PROMPTS[1], params, rid="a", seed=5) == base
    assert sample_alone(random_model_dir, PROMPTS[1], params, rid="b", seed=5) != base
    assert sample_alone(random_model_dir, PROMPTS[1], params, rid="a", seed=6) != base


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=NEW, temperature=1.5, top_k=1, seed=3, ignore_eos=True),
    SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=1e-9, seed=3, ignore_eos=True),
    SamplingParams(max_new_tokens=NEW, temperature=1e-4, seed=3, ignore_eos=True),
], ids=["top_k=1", "top_p=tiny", "temperature=tiny"])
def test_degenerate_sampling_equals_greedy(random_model_dir: Path,
                                           reference: list[tuple[list[int], torch.Tensor]],
                                           params: SamplingParams) -> None:
    assert sample_alone(random_model_dir, PROMPTS[3], params) == reference[3][0]
    # ... while the same temperature without truncation does not follow greedy.
    loose = SamplingParams(max_new_tokens=NEW, temperature=1.5, seed=3, ignore_eos=True)
    assert sample_alone(random_model_dir, PROMPTS[3], loose) != reference[3][0]


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=40, temperature=2.0, top_k=3, seed=11, ignore_eos=True),
    SamplingParams(max_new_tokens=40, temperature=2.0, top_p=0.05, seed=11, ignore_eos=True),
    SamplingParams(max_new_tokens=40, temperature=2.0, top_k=50, top_p=0.1, seed=11,
                   ignore_eos=True),
], ids=["top_k", "top_p", "top_k+top_p"])
def test_truncation_is_honoured(random_model_dir: Path, params: SamplingParams) -> None:
    """Every sampled token lies inside the truncated distribution of the logits it came from,
    and the draws are not all the argmax (so the check has teeth)."""
    engine = make_engine(random_model_dir)
    recorder = LogitsRecorder(engine)
    engine.add_request("t", PROMPTS[1], params)
    run = drive(engine, recorder)
    not_argmax = 0
    for token, row in zip(run.tokens["t"], run.logits["t"], strict=True):
        probs = sampling_probs(row, params)
        assert probs[token] > 0
        allowed = int((probs > 0).sum())
        if params.top_k > 0:
            assert allowed <= params.top_k
            assert int((row > row[token]).sum()) < params.top_k  # token ranks within top k
        if params.top_p < 1:
            full = torch.softmax(row.double() / params.temperature, dim=-1)
            mass_above = float(full[full > full[token]].sum())
            assert mass_above < params.top_p  # token is inside the nucleus
        not_argmax += token != int(row.argmax())
    assert not_argmax > 0


# --- abort ------------------------------------------------------------------------------------


def finish_of(events: list[object], rid: str) -> FinishEvent:
    found = [e for e in events if isinstance(e, FinishEvent) and e.rid == rid]
    assert len(found) == 1
    return found[0]


def test_abort_queued_before_any_step(random_model_dir: Path) -> None:
    engine = make_engine(random_model_dir)
    engine.add_request("q", PROMPTS[2], GREEDY)
    engine.abort("q")
    engine.abort("q")  # idempotent
    engine.abort("never-added")
    events = engine.step()
    assert events == [FinishEvent("q", "abort", (), "")]
    assert_idle(engine)
    assert engine.step() == []


def assert_aborted_unborn_and_survivor_intact(engine: Engine, run: Run, victim: str,
                                              survivor: str, want: list[int]) -> None:
    """``victim`` was aborted before emitting a token: its finish comes with the next step and
    carries no output; the survivor then finishes exactly as unconstrained; nothing leaks."""
    events = run.step(engine)
    assert finish_of(events, victim).reason == "abort"
    assert finish_of(events, victim).output_ids == ()
    drive(engine, run=run)
    assert victim not in run.tokens
    assert run.tokens[survivor] == want
    assert_idle(engine)


def test_abort_queued_behind_running(random_model_dir: Path,
                                     reference: list[tuple[list[int], torch.Tensor]]) -> None:
    engine = make_engine(random_model_dir, max_running_requests=1)
    engine.add_request("run", PROMPTS[1], GREEDY)
    engine.add_request("wait", PROMPTS[2], GREEDY)
    run = Run()
    for _ in range(3):
        run.step(engine)
    assert "wait" not in engine.memory().requests  # still queued: no row, no KV
    engine.abort("wait")
    assert_aborted_unborn_and_survivor_intact(engine, run, "wait", "run", reference[1][0])


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_mid_chunked_prefill(random_model_dir: Path, page_size: int,
                                   reference: list[tuple[list[int], torch.Tensor]]) -> None:
    engine = make_engine(random_model_dir, page_size=page_size, max_prefill_tokens=8)
    engine.add_request("long", PROMPTS[4], GREEDY)
    engine.add_request("short", PROMPTS[0], GREEDY)
    run = Run()
    assert run.step(engine) == [] and run.step(engine) == []  # "short" waits behind the chunk
    view = engine.memory()
    assert view.requests["long"].phase == "prefill"
    assert view.requests["long"].committed == 16
    engine.abort("long")
    view = engine.memory()
    assert "long" not in view.requests
    assert conservation_error(view) is None and bounds_error(view) is None
    assert_aborted_unborn_and_survivor_intact(engine, run, "long", "short", reference[0][0])


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_while_decoding(random_model_dir: Path, page_size: int,
                              reference: list[tuple[list[int], torch.Tensor]]) -> None:
    engine = make_engine(random_model_dir, page_size=page_size)
    engine.add_request("a", PROMPTS[3], GREEDY)
    engine.add_request("b", PROMPTS[5], GREEDY)
    run = Run()
    for _ in range(5):
        run.step(engine)
    assert engine.memory().requests["a"].phase == "decode"
    engine.abort("a")
    events = run.step(engine)
    fin = finish_of(events, "a")
    assert fin.reason == "abort"
    assert list(fin.output_ids) == reference[3][0][:5]
    assert not any(isinstance(e, TokenEvent) and e.rid == "a" for e in events)
    drive(engine, run=run)
    assert run.tokens["b"] == reference[5][0]
    assert_idle(engine)


def test_abort_after_finish_is_a_no_op(random_model_dir: Path) -> None:
    engine = make_engine(random_model_dir)
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True))[0]
    engine.abort(out.rid)
    assert engine.step() == []
    assert_idle(engine)


# --- idle -> busy, lifetime -------------------------------------------------------------------


def test_idle_step_then_busy(random_model_dir: Path,
                             reference: list[tuple[list[int], torch.Tensor]]) -> None:
    engine = make_engine(random_model_dir)
    assert engine.step() == [] and engine.step() == []
    assert_idle(engine)
    for round_ in range(2):
        engine.add_request(f"r{round_}", PROMPTS[2], GREEDY)
        assert drive(engine).tokens[f"r{round_}"] == reference[2][0]
        assert engine.step() == []
        assert_idle(engine)


@pytest.mark.parametrize("how", ["finish", "abort_queued", "abort_decoding", "stop"])
def test_finished_requests_are_not_kept_alive(random_model_dir: Path, how: str) -> None:
    engine = make_engine(random_model_dir)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True,
                            stop_token_ids=[] if how != "stop" else [0, *range(1, 2048)])
    engine.add_request("w", PROMPTS[2], params)
    ref = weakref.ref(engine._live["w"])
    run = Run()
    if how == "abort_queued":
        engine.abort("w")
    elif how == "abort_decoding":
        run.step(engine)
        run.step(engine)
        engine.abort("w")
    drive(engine, run=run)
    expected = {"finish": "length", "stop": "stop"}.get(how, "abort")
    assert run.finishes["w"].reason == expected
    del run
    gc.collect()
    assert ref() is None, "the engine keeps a finished Req alive"
    assert_idle(engine)

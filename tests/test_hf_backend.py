"""The hf backend against refengine on the random tiny Llama (``random_model_dir``, conftest).

Both backends load the same HF directory, so greedy outputs must agree token for token, and
seeded sampling must agree draw for draw (hf reuses refengine's distribution and seeded draws).
The finish conditions are checked against expectations derived independently from a long greedy
run, not only against refengine, so a bug shared by both would still show.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import model_with_eos
from tokenizers import Tokenizer

from conformance.backends.hf import HFBackend, HFHandle, backend
from conformance.backends.refengine import backend as refengine_backend
from conformance.contract import (
    EngineHandle,
    FinishEvent,
    OpenConfig,
    Request,
    SamplingParams,
    SpecConfig,
    TokenEvent,
    unclaimed_reasons,
)
from refengine.data import fixtures_root

LONG = 24  # tokens of the reference greedy run the finish tests derive expectations from


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(random_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(random_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """Six default prompts of different lengths, so a batch is really left-padded."""
    lines = (fixtures_root() / "prompts" / "default.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines[:6]]
    ids = [tuple(tokenizer.encode(t).ids) for t in texts]
    assert len({len(p) for p in ids}) > 2
    return ids


@pytest.fixture(scope="module")
def hf(random_model_dir: Path) -> Iterator[HFHandle]:
    handle = backend().open(OpenConfig(model=str(random_model_dir)))
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def ref(random_model_dir: Path) -> Iterator[EngineHandle]:
    handle = refengine_backend().open(OpenConfig(model=str(random_model_dir)))
    yield handle
    handle.close()


def run(handle: EngineHandle, reqs: list[Request]) -> dict[str, FinishEvent]:
    """Submit ``reqs`` and step until each has its FinishEvent."""
    for r in reqs:
        handle.submit(r)
    done: dict[str, FinishEvent] = {}
    for _ in range(10_000):
        for ev in handle.step():
            if isinstance(ev, FinishEvent):
                done[ev.rid] = ev
        if len(done) == len(reqs):
            return done
    raise AssertionError(f"unfinished: {sorted({r.rid for r in reqs} - done.keys())}")


def both(hf: HFHandle, ref: EngineHandle, reqs: list[Request]) -> dict[str, FinishEvent]:
    """Run ``reqs`` on both backends, assert identical finishes, return hf's."""
    got, want = run(hf, reqs), run(ref, reqs)
    for r in reqs:
        assert got[r.rid] == want[r.rid], r.rid
    return got


@pytest.fixture(scope="module")
def greedy_long(hf: HFHandle, ref: EngineHandle,
                prompts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Greedy continuations of every prompt, LONG tokens, ignoring EOS (checked equal)."""
    params = SamplingParams(max_new_tokens=LONG, ignore_eos=True)
    out = both(hf, ref, [Request(f"long-{i}", p, params) for i, p in enumerate(prompts)])
    return [out[f"long-{i}"].output_ids for i in range(len(prompts))]


# --- identity and refusals ------------------------------------------------------------------


def test_identity_and_capabilities() -> None:
    b = backend()
    assert isinstance(b, HFBackend)
    assert b.name == "hf"
    assert b.version.startswith("transformers ")
    caps = b.capabilities()
    assert caps.algorithms == frozenset({"none", "draft_model"})
    assert caps.sampling and caps.acceptance_stats and caps.reference_draft
    assert not any(caps.claims(flag) for flag in
                   ("stepwise", "abort", "sessions", "memory_view", "tree", "overlap"))


def test_unclaimed_algorithms_say_why() -> None:
    """The certificate's reasons for what hf does not claim: valid keys, none claimed, one
    line each, EAGLE-3 among them (transformers has no such head)."""
    reasons = unclaimed_reasons(backend())  # raises on a claimed or unknown key
    assert set(reasons) == {"algorithm:ngram", "algorithm:eagle3"}
    assert "no EAGLE-3 head" in reasons["algorithm:eagle3"]


def test_registry_resolves_hf() -> None:
    from conformance.plan.registry import load_backend

    assert isinstance(load_backend("hf"), HFBackend)


def test_spec_rejected(random_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^spec: the hf backend supports plain decoding and "
                                         r"draft_model only, got 'eagle'"):
        backend().open(OpenConfig(model=str(random_model_dir), spec=SpecConfig()))


def test_empty_step(hf: HFHandle) -> None:
    assert hf.step() == []


def test_unsupported_operations(hf: HFHandle, prompts: list[tuple[int, ...]]) -> None:
    for call in (lambda: hf.abort("x"), hf.memory, lambda: hf.open_session("s"),
                 lambda: hf.close_session("s")):
        with pytest.raises(NotImplementedError):
            call()
    with pytest.raises(ValueError, match=r"^session_id"):
        hf.submit(Request("sess", prompts[0], session_id="s"))
    with pytest.raises(ValueError, match=r"^prompt"):
        hf.submit(Request("empty", ()))
    with pytest.raises(ValueError, match=r"^prompt"):
        hf.submit(Request("oov", (5, 2048)))
    hf.submit(Request("dup", prompts[0], SamplingParams(max_new_tokens=1)))
    with pytest.raises(ValueError, match=r"^rid"):
        hf.submit(Request("dup", prompts[1]))
    assert [type(ev) for ev in hf.step()] == [TokenEvent, FinishEvent]


def test_closed_handle_refuses(random_model_dir: Path) -> None:
    handle = backend().open(OpenConfig(model=str(random_model_dir)))
    handle.close()
    with pytest.raises(RuntimeError, match="closed"):
        handle.step()


# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_greedy_equals_refengine(hf: HFHandle, ref: EngineHandle,
                                 prompts: list[tuple[int, ...]], ignore_eos: bool) -> None:
    params = SamplingParams(max_new_tokens=16, ignore_eos=ignore_eos)
    reqs = [Request(f"g{ignore_eos}-{i}", p, params) for i, p in enumerate(prompts)]
    out = both(hf, ref, reqs)
    assert all(len(out[r.rid].output_ids) >= 1 for r in reqs)


def test_batched_equals_one_at_a_time(hf: HFHandle, prompts: list[tuple[int, ...]],
                                      greedy_long: list[tuple[int, ...]]) -> None:
    params = SamplingParams(max_new_tokens=LONG, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        assert run(hf, [Request(f"solo-{i}", p, params)])[f"solo-{i}"].output_ids \
            == greedy_long[i]


def test_events_shape(hf: HFHandle, prompts: list[tuple[int, ...]]) -> None:
    """Per request, in submission order: one TokenEvent with everything, then its finish."""
    params = [SamplingParams(max_new_tokens=n) for n in (3, 1, 5)]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=False)):
        hf.submit(Request(f"ev-{i}", p, sp))
    events = hf.step()
    assert [type(ev) for ev in events] == [TokenEvent, FinishEvent] * 3
    for i in range(3):
        tok, fin = events[2 * i], events[2 * i + 1]
        assert tok.rid == fin.rid == f"ev-{i}"
        assert tok.token_ids == fin.output_ids
    assert hf.step() == []


def test_eos_stops_unless_ignored(tmp_path: Path, random_model_dir: Path,
                                  prompts: list[tuple[int, ...]],
                                  greedy_long: list[tuple[int, ...]]) -> None:
    """Make the greedy 2nd token of prompt 0 the EOS: plain decoding stops there."""
    eos = greedy_long[0][1]
    assert eos not in greedy_long[0][:1]
    model_dir = model_with_eos(random_model_dir, tmp_path / "eos-model", eos)
    cfg_open = OpenConfig(model=str(model_dir))
    hf2, ref2 = backend().open(cfg_open), refengine_backend().open(cfg_open)
    try:
        stop = both(hf2, ref2, [Request("eos", prompts[0], SamplingParams(max_new_tokens=8))])
        assert stop["eos"].reason == "stop"
        assert stop["eos"].output_ids == greedy_long[0][:2]
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        kept = both(hf2, ref2, [Request("eos", prompts[0], params)])
        assert kept["eos"].reason == "length"
        assert kept["eos"].output_ids == greedy_long[0][:8]
    finally:
        hf2.close()
        ref2.close()


# --- finish conditions --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_new_tokens_exact(hf: HFHandle, ref: EngineHandle, prompts: list[tuple[int, ...]],
                              greedy_long: list[tuple[int, ...]], n: int) -> None:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    out = both(hf, ref, [Request(f"len{n}-{i}", p, params) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        fin = out[f"len{n}-{i}"]
        assert fin.reason == "length"
        assert fin.output_ids == greedy_long[i][:n]


def test_stop_token_ids(hf: HFHandle, ref: EngineHandle, prompts: list[tuple[int, ...]],
                        greedy_long: list[tuple[int, ...]]) -> None:
    # A prompt whose greedy 3rd token does not already occur among the first two.
    i = next(k for k, out in enumerate(greedy_long) if out[2] not in out[:2])
    params = SamplingParams(max_new_tokens=LONG, ignore_eos=True,
                            stop_token_ids=(greedy_long[i][2],))
    fin = both(hf, ref, [Request("stopid", prompts[i], params)])["stopid"]
    assert fin.reason == "stop"
    assert len(fin.output_ids) == 3
    assert fin.output_ids == greedy_long[i][:3]


def test_stop_strings_cut_text(hf: HFHandle, ref: EngineHandle, tokenizer: Tokenizer,
                               prompts: list[tuple[int, ...]],
                               greedy_long: list[tuple[int, ...]]) -> None:
    """Stop on a 2-character piece of the greedy text: text ends right before it, output_ids
    end with the token that completed it (derived here from the long greedy run)."""
    i = 1
    full = greedy_long[i]
    text = tokenizer.decode(list(full))
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    m = next(k for k in range(1, len(full) + 1) if stop in tokenizer.decode(list(full[:k])))
    partial = tokenizer.decode(list(full[:m]))
    params = SamplingParams(max_new_tokens=LONG, ignore_eos=True, stop=("\x00never", stop))
    fin = both(hf, ref, [Request("stopstr", prompts[i], params)])["stopstr"]
    assert fin.reason == "stop"
    assert fin.output_ids == full[:m]
    assert fin.text == partial[:partial.index(stop)]
    assert stop not in fin.text


# --- sampling -----------------------------------------------------------------------------------


def test_seeded_sampling_reproducible_and_equals_refengine(
        hf: HFHandle, ref: EngineHandle, prompts: list[tuple[int, ...]]) -> None:
    def reqs(seed: int) -> list[Request]:
        params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=64, top_p=0.95,
                                seed=seed, ignore_eos=True)
        return [Request(f"s{seed}-{i}", p, params) for i, p in enumerate(prompts[:4])]

    first = both(hf, ref, reqs(7))
    again = run(hf, reqs(7))
    other = run(hf, reqs(8))
    assert all(first[k].output_ids == again[k].output_ids for k in first)
    assert any(first[f"s7-{i}"].output_ids != other[f"s8-{i}"].output_ids for i in range(4))


def test_unseeded_sampling_uses_refengine_seed_derivation(
        hf: HFHandle, ref: EngineHandle, prompts: list[tuple[int, ...]]) -> None:
    """No seed: both derive it from (engine seed, rid), so the same rid draws the same."""
    params = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    both(hf, ref, [Request(f"u-{i}", p, params) for i, p in enumerate(prompts[:3])])


def test_mixed_greedy_and_sampled_batch(hf: HFHandle, ref: EngineHandle,
                                        prompts: list[tuple[int, ...]],
                                        greedy_long: list[tuple[int, ...]]) -> None:
    """Rows finishing at different steps (cache pruned) and mixed selection in one batch."""
    reqs = [Request(f"mix-{i}", p, SamplingParams(
        max_new_tokens=2 + 3 * i, temperature=0.0 if i % 2 == 0 else 1.0, seed=i,
        ignore_eos=True)) for i, p in enumerate(prompts)]
    out = both(hf, ref, reqs)
    for i in range(0, len(prompts), 2):
        assert out[f"mix-{i}"].output_ids == greedy_long[i][:2 + 3 * i]

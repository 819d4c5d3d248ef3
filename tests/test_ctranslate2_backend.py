"""The ctranslate2 backend: a C++ engine certified through the adapter.

Fast tests run it on the random tiny Llama (``random_model_dir``, conftest) against refengine
on the same directory: greedy outputs equal token for token, finish conditions checked against
expectations derived from a long greedy run; the conversion cache; the honest capabilities and
their reasons; and ``specgate certify`` end to end on the random model, in-process. The same
certification on the bundled fixture runs in-process in the default run; with the CLI's
default two xdist workers it is slow.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import model_with_eos
from tokenizers import Tokenizer

from conformance.backends.ctranslate2 import convert as ctranslate2_convert
from conformance.backends.ctranslate2.backend import THREADS_ENV, CT2Backend, CT2Handle, backend
from conformance.backends.refengine import backend as refengine_backend
from conformance.cli import main
from conformance.contract import (
    ALGORITHMS,
    FLAG_NAMES,
    Capabilities,
    EngineHandle,
    OpenConfig,
    SamplingParams,
    SpecConfig,
    unclaimed_reasons,
)
from conformance.plan import registry
from conformance.repro.driver import Driver, Outcome
from refengine.data import fixtures_root

LONG = 24  # tokens of the reference greedy run the finish tests derive expectations from
CT2_CAPS = backend().capabilities()

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A conversion cache of this module's own (not the user's), for every test here."""
    path = tmp_path_factory.mktemp("ct2-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ctranslate2_convert.CACHE_ENV, str(path))
        yield path


@pytest.fixture(scope="module")
def tokenizer(random_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(random_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """Six default prompts of different lengths, so a batch really mixes lengths."""
    lines = (fixtures_root() / "prompts" / "default.jsonl").read_text().splitlines()
    ids = [tokenizer.encode(json.loads(line)["text"]).ids for line in lines[:6]]
    assert len({len(p) for p in ids}) > 2
    return ids


def open_pair(model: Path, **limits: int) -> tuple[CT2Handle, EngineHandle]:
    cfg = OpenConfig(model=str(model), **limits)
    return backend().open(cfg), refengine_backend().open(cfg)


@pytest.fixture(scope="module")
def pair(random_model_dir: Path, cache_dir: Path) -> Iterator[tuple[CT2Handle, EngineHandle]]:
    ct2, ref = open_pair(random_model_dir)
    yield ct2, ref
    ct2.close()
    ref.close()


def run(handle: EngineHandle, caps: Capabilities,
        reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, Outcome]:
    """Through the suite's Driver, which checks the event stream as it goes."""
    driver = Driver(handle, caps)
    for rid, ids, params in reqs:
        driver.submit(rid, ids, params)
    return driver.run()


def both(pair: tuple[CT2Handle, EngineHandle],
         reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, Outcome]:
    """``reqs`` on both backends: identical outcomes; returns ctranslate2's."""
    ct2, ref = pair
    got = run(ct2, CT2_CAPS, reqs)
    want = run(ref, refengine_backend().capabilities(), reqs)
    for rid, *_ in reqs:
        assert got[rid] == want[rid], rid
    return got


@pytest.fixture(scope="module")
def greedy_long(pair: tuple[CT2Handle, EngineHandle], prompts: list[list[int]]
                ) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=LONG, ignore_eos=True)
    out = both(pair, [(f"long-{i}", p, params) for i, p in enumerate(prompts)])
    return [out[f"long-{i}"].output_ids for i in range(len(prompts))]


# --- identity, honest capabilities, registry ------------------------------------------------


def test_claims_plain_decoding_only_and_says_why_not_the_rest() -> None:
    b = backend()
    caps = b.capabilities()
    assert caps.algorithms == frozenset({"none"})
    unclaimed = ({f for f in FLAG_NAMES if not caps.claims(f)}
                 | {f"algorithm:{a}" for a in ALGORITHMS - caps.algorithms})
    reasons = unclaimed_reasons(b)
    assert set(reasons) == unclaimed
    assert "seed" in reasons["sampling"]


@pytest.mark.parametrize("bad, needle", [
    ({"stepwise": "a\nb"}, "one-line"),
    ({"algorithm:none": "x"}, "is claimed"),
    ({"warp_drive": "x"}, "not a capability"),
])
def test_registry_refuses_bad_reasons(monkeypatch: pytest.MonkeyPatch, bad: dict[str, str],
                                      needle: str) -> None:
    monkeypatch.setattr(CT2Backend, "unclaimed_reasons", lambda self: bad)
    with pytest.raises(registry.BackendError, match=needle):
        registry.load_backend("ctranslate2")


def test_without_ctranslate2_the_cli_names_the_extra(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "conformance.backends.ctranslate2.backend", raising=False)
    code = main(["certify", "--backend", "ctranslate2", "--model", str(random_model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "specgate[ctranslate2]" in err[0], err


def test_refusals(pair: tuple[CT2Handle, EngineHandle], prompts: list[list[int]],
                  random_model_dir: Path) -> None:
    ct2, _ = pair
    with pytest.raises(ValueError, match=r"^spec: "):
        backend().open(OpenConfig(model=str(random_model_dir), spec=SpecConfig()))
    with pytest.raises(ValueError, match=r"^seed: "):
        run(ct2, CT2_CAPS,
            [("seeded", prompts[0], SamplingParams(temperature=1.0, seed=3))])
    for call in (lambda: ct2.abort("x"), ct2.memory, lambda: ct2.open_session("s")):
        with pytest.raises(NotImplementedError):
            call()
    assert ct2.step() == []
    closed = backend().open(OpenConfig(model=str(random_model_dir)))
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.step()


# --- greedy and finish conditions against refengine -----------------------------------------


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_greedy_equals_refengine(pair: tuple[CT2Handle, EngineHandle], prompts: list[list[int]],
                                 ignore_eos: bool) -> None:
    params = SamplingParams(max_new_tokens=16, ignore_eos=ignore_eos)
    both(pair, [(f"g{ignore_eos}-{i}", p, params) for i, p in enumerate(prompts)])


def test_a_one_token_prompt_beside_longer_ones(pair: tuple[CT2Handle, EngineHandle],
                                              prompts: list[list[int]]) -> None:
    """Found by the fuzz tier: a generate_batch call mixing a one-token prompt with longer ones
    handed the longer rows' prompt tokens to the callback as if generated."""
    params = SamplingParams(max_new_tokens=4)
    both(pair, [("long", prompts[0], params), ("one", prompts[1][:1], params),
                ("other", prompts[2], params)])


def test_batches_split_by_max_running_requests(random_model_dir: Path, prompts: list[list[int]],
                                               greedy_long: list[list[int]]) -> None:
    ct2 = backend().open(OpenConfig(model=str(random_model_dir), max_running_requests=2))
    params = SamplingParams(max_new_tokens=LONG, ignore_eos=True)
    out = run(ct2, CT2_CAPS, [(f"b-{i}", p, params) for i, p in enumerate(prompts)])
    assert [out[f"b-{i}"].output_ids for i in range(len(prompts))] == greedy_long


def test_opening_leaves_torch_threads_alone(random_model_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A Generator built with other intra-op threads than torch's must not change torch's
    count: every torch lane beside it (bench) would silently run at CTranslate2's setting, and
    a compiled graph key would meet a global state it was not built under."""
    monkeypatch.setenv(THREADS_ENV, "1")
    torch.set_num_threads(2)
    try:
        handle = backend().open(OpenConfig(model=str(random_model_dir)))
        assert torch.get_num_threads() == 2
        handle.close()
    finally:
        torch.set_num_threads(1)  # the module's one_torch_thread setting


@pytest.mark.parametrize("n", [1, 3])
def test_max_new_tokens_exact(pair: tuple[CT2Handle, EngineHandle], prompts: list[list[int]],
                              greedy_long: list[list[int]], n: int) -> None:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    out = both(pair, [(f"len{n}-{i}", p, params) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert (out[f"len{n}-{i}"].reason, out[f"len{n}-{i}"].output_ids) == \
            ("length", greedy_long[i][:n])


def test_context_limit_is_length(pair: tuple[CT2Handle, EngineHandle],
                                 prompts: list[list[int]]) -> None:
    """A prompt 2 tokens short of the context (512): two tokens, then "length"."""
    long_prompt = (prompts[0] * 512)[:510]
    out = both(pair, [("ctx", long_prompt, SamplingParams(max_new_tokens=64, ignore_eos=True))])
    assert (out["ctx"].reason, len(out["ctx"].output_ids)) == ("length", 2)


def test_stop_token_ids(pair: tuple[CT2Handle, EngineHandle], prompts: list[list[int]],
                        greedy_long: list[list[int]]) -> None:
    i = next(k for k, out in enumerate(greedy_long) if out[2] not in out[:2])
    params = SamplingParams(max_new_tokens=LONG, ignore_eos=True,
                            stop_token_ids=(greedy_long[i][2],))
    out = both(pair, [("stopid", prompts[i], params)])["stopid"]
    assert (out.reason, out.output_ids) == ("stop", greedy_long[i][:3])


def test_stop_strings_cut_text(pair: tuple[CT2Handle, EngineHandle], tokenizer: Tokenizer,
                               prompts: list[list[int]], greedy_long: list[list[int]]) -> None:
    """Stop on a 2-character piece of the greedy text: the text ends right before it, the
    output ends with the token that completed it."""
    full = greedy_long[1]
    text = tokenizer.decode(full)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    m = next(k for k in range(1, len(full) + 1) if stop in tokenizer.decode(full[:k]))
    partial = tokenizer.decode(full[:m])
    params = SamplingParams(max_new_tokens=LONG, ignore_eos=True, stop=("\x00never", stop))
    out = both(pair, [("stopstr", prompts[1], params)])["stopstr"]
    assert (out.reason, out.output_ids) == ("stop", full[:m])
    assert out.text == partial[:partial.index(stop)]


def test_eos_stops_unless_ignored(tmp_path: Path, random_model_dir: Path,
                                  prompts: list[list[int]], greedy_long: list[list[int]]) -> None:
    """Make the greedy 2nd token of prompt 0 the EOS (config.json, as refengine reads it)."""
    eos = greedy_long[0][1]
    assert eos not in greedy_long[0][:1]
    model_dir = model_with_eos(random_model_dir, tmp_path / "eos-model", eos)
    handles = open_pair(model_dir)
    try:
        stop = both(handles, [("eos", prompts[0], SamplingParams(max_new_tokens=8))])["eos"]
        assert (stop.reason, stop.output_ids) == ("stop", greedy_long[0][:2])
        kept = both(handles, [("eos", prompts[0],
                               SamplingParams(max_new_tokens=8, ignore_eos=True))])["eos"]
        assert (kept.reason, kept.output_ids) == ("length", greedy_long[0][:8])
    finally:
        for handle in handles:
            handle.close()


def test_unseeded_sampling_runs_with_its_own_options(pair: tuple[CT2Handle, EngineHandle],
                                                     prompts: list[list[int]],
                                                     greedy_long: list[list[int]]) -> None:
    """Sampled rows are grouped by their options (one generate_batch each): top-k 1 at any
    temperature is greedy, whatever else is in the step."""
    ct2, _ = pair
    reqs = [(f"mix-{i}", p, SamplingParams(max_new_tokens=LONG, ignore_eos=True,
                                           temperature=(0.0, 0.7, 1.5)[i % 3], top_k=1))
            for i, p in enumerate(prompts)]
    out = run(ct2, CT2_CAPS, reqs)
    assert [out[f"mix-{i}"].output_ids for i in range(len(prompts))] == greedy_long


# --- the conversion cache -------------------------------------------------------------------


def test_converts_once_and_keys_on_content(tmp_path: Path, random_model_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ctranslate2_convert.CACHE_ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    real = ctranslate2_convert._convert
    monkeypatch.setattr(ctranslate2_convert, "_convert",
                        lambda src, out: (calls.append(src), real(src, out)))
    first = ctranslate2_convert.converted_model_dir(random_model_dir)
    assert ctranslate2_convert.converted_model_dir(random_model_dir) == first
    assert len(calls) == 1 and (first / "model.bin").exists()
    changed = tmp_path / "changed"
    shutil.copytree(random_model_dir, changed)
    (changed / "generation_config.json").write_text("{}")
    assert ctranslate2_convert.converted_model_dir(changed) != first
    assert len(calls) == 2
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(
        [first.name, ctranslate2_convert.content_key(changed)])  # no staging left behind


def test_a_lost_race_keeps_the_winners_conversion(tmp_path: Path, random_model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process renames its conversion into place while ours runs: ours is dropped."""
    monkeypatch.setenv(ctranslate2_convert.CACHE_ENV, str(tmp_path))
    target = ctranslate2_convert.cache_root() / ctranslate2_convert.content_key(random_model_dir)

    def racing(src: Path, out: Path) -> None:
        target.mkdir()
        (target / "model.bin").write_text("winner")
        (out / "model.bin").write_text("loser")

    monkeypatch.setattr(ctranslate2_convert, "_convert", racing)
    assert ctranslate2_convert.converted_model_dir(random_model_dir) == target
    assert (target / "model.bin").read_text() == "winner"
    assert [p.name for p in target.parent.iterdir()] == [target.name]


# --- certified end to end -------------------------------------------------------------------


def certify(tmp_path: Path, *argv: str) -> dict[str, object]:
    code = main(["certify", "--backend", "ctranslate2", "--spec", "none", "--profile", "gate",
                 "--report", str(tmp_path), *argv])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0, report["tiers"]
    assert report["status"] == "passed"
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert tiers["lossless"]["counts"]["passed"] > 0 and tiers["lifecycle"]["counts"]["passed"] > 0
    markdown = (tmp_path / "report.md").read_text()
    section = markdown.split("## Not claimed, and why", 1)[1].split("\n## ", 1)[0]
    for cap, why in unclaimed_reasons(backend()).items():
        assert f"- `{cap}`: {why}" in section, cap
    return report


def test_certify_on_the_random_model(tmp_path: Path, random_model_dir: Path) -> None:
    certify(tmp_path, "--model", str(random_model_dir), "-n", "0")


def test_certify_on_the_fixture(tmp_path: Path) -> None:
    """``specgate certify --backend ctranslate2`` on the bundled fixture, in-process (about 9 s
    with the conversion cached, 5-7 s more to convert): CI certifies the real engine on the real
    fixture in every run."""
    certify(tmp_path, "-n", "0")


@pytest.mark.slow
def test_certify_on_the_fixture_with_default_workers(tmp_path: Path) -> None:
    """What a user runs: the bundled fixture, the CLI's default workers."""
    certify(tmp_path)


def test_thread_count_follows_torch_unless_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.backends.ctranslate2.backend import THREADS_ENV, intra_threads

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert intra_threads() == 1
    monkeypatch.setenv(THREADS_ENV, "2")
    assert intra_threads() == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=THREADS_ENV):
            intra_threads()

"""The vllm backend (conformance/backends/vllm, docs/backends/vllm.md).

The layout and factory tests run everywhere; the engine tests need vLLM's CPU build in the
running interpreter (a separate venv, docs/backends/vllm.md) and skip without it, so the
project's normal run stays green.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest

from conformance.backends import vllm as vllm_pkg
from conformance.backends.vllm import layout
from conformance.contract import (
    FinishEvent,
    OpenConfig,
    Request,
    TokenEvent,
    unclaimed_reasons,
    unclaimed_under,
)
from refengine.data import resolve_model_dir
from specwire import SamplingParams, SpecConfig

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (CPU build: "
                                "docs/backends/vllm.md)")


# --- without vLLM ----------------------------------------------------------------------------

def test_factory_without_vllm_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(vllm_pkg.VllmNotInstalled) as err:
        vllm_pkg.backend()
    message = str(err.value)
    assert "\n" not in message and "specgate[vllm]" in message and "torchcodec" in message


def test_registered_under_its_name():
    from conformance.plan import registry

    assert registry.BUILTIN["vllm"] == "conformance.backends.vllm:backend"
    assert registry.EXTRAS["vllm"] == "vllm"
    assert "vllm" in registry.known_backends()


def test_certify_without_vllm_exits_2_naming_the_install(monkeypatch, capsys):
    from conformance.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    code = main(["certify", "--backend", "vllm", "--spec", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    for needle in ("backend 'vllm'", "pip install 'specgate[vllm]'",
                   "download.pytorch.org/whl/cpu",
                   "pip uninstall -y torchvision torchaudio torchcodec"):
        assert needle in err[0], err


def test_eagle_head_conversion_is_vllm_layout_and_cached(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path))
    source = resolve_model_dir("tiny-code-eagle")
    out = layout.eagle_dir(source)
    assert out.parent == tmp_path / "vllm" and out.name.startswith("tiny-code-eagle-")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [layout.EAGLE_VLLM_ARCH]
    with safe_open(str(out / "model.safetensors"), "pt") as f, \
            safe_open(str(source / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys()) - set(layout.EAGLE_DROPPED)
        assert (f.get_tensor("fc.weight") == g.get_tensor("fc.weight")).all()
    assert layout.eagle_dir(source) == out          # cached: same key, no second copy
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_eagle_conversion_refuses_a_non_eagle_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"^draft_model: "):
        layout.eagle_dir(resolve_model_dir("tiny-code-draft"))


def test_eagle3_head_is_passed_as_it_is():
    head = resolve_model_dir("tiny-code-eagle3")
    assert layout.eagle3_dir(head) == head
    assert layout.eagle3_variants(head) == []
    for other in ("tiny-code-eagle", "tiny-code-draft"):
        with pytest.raises(ValueError, match=r"^draft_model: .* is not an EAGLE-3 head"):
            layout.eagle3_dir(resolve_model_dir(other))


def _eagle3_config(tmp_path, **changes):
    config = json.loads((resolve_model_dir("tiny-code-eagle3") / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("changes,named", [
    ({"norm_before_residual": True}, ["norm_before_residual"]),
    ({"norm_output": True, "fc_norm": True}, ["norm_output", "fc_norm"]),
    ({"eagle_config": {"use_aux_hidden_state": False, "norm_before_fc": True}},
     ["eagle_config.norm_before_fc", "eagle_config.use_aux_hidden_state"]),
    ({"eagle_aux_hidden_state_layer_ids": None,
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}},
     ["eagle_config.eagle_aux_hidden_state_layer_ids"]),
    ({"norm_output": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 6, 11]}},
     []),   # defaults spelled out, and taps vLLM reads at the top level first
], ids=["residual", "output-fc", "eagle-config", "nested-taps", "plain"])
def test_eagle3_variants_vllm_reads_and_refengine_does_not(tmp_path, changes, named):
    assert layout.eagle3_variants(_eagle3_config(tmp_path, **changes)) == named


def test_cache_root_follows_specgate_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "c"))
    assert layout.cache_root() == tmp_path / "c" / "vllm"
    monkeypatch.delenv("SPECGATE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert layout.cache_root() == tmp_path / "x" / "specgate" / "vllm"


# --- with vLLM -------------------------------------------------------------------------------

PROMPT = (481, 368, 394, 63, 940, 63, 70, 1576, 63, 70, 1576, 8)


def _drain(handle, limit=500):
    tokens: dict[str, list[int]] = {}
    finishes: dict[str, FinishEvent] = {}
    for _ in range(limit):
        events = handle.step()
        for e in events:
            if isinstance(e, TokenEvent):
                tokens.setdefault(e.rid, []).extend(e.token_ids)
            elif isinstance(e, FinishEvent):
                finishes[e.rid] = e
        if not events and not handle.live and not handle.pending:
            return tokens, finishes
    raise AssertionError("requests did not finish")


@pytest.fixture(scope="module")
def vllm_backend():
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (CPU build: docs/backends/vllm.md)")
    return vllm_pkg.backend()


@pytest.fixture(scope="module")
def oracle():
    from conformance.checks.oracle import ReferenceOracle
    return ReferenceOracle("tiny-code")


@needs_vllm
def test_capabilities_and_reasons_are_consistent(vllm_backend):
    reasons = unclaimed_reasons(vllm_backend)   # raises on a claimed or unknown key
    caps = vllm_backend.capabilities()
    assert caps.stepwise and caps.abort and caps.memory_view and caps.page_multiple == 32
    assert "algorithm:frozen_kv_mtp" in reasons and "memory_view" not in reasons


@needs_vllm
@pytest.mark.parametrize("spec", [
    None,
    SpecConfig(algorithm="eagle", draft_model="tiny-code-eagle", num_steps=3, topk=1,
               num_draft_tokens=4),
    SpecConfig(algorithm="draft_model", draft_model="tiny-code-draft", num_steps=3, topk=1,
               num_draft_tokens=4),
    SpecConfig(algorithm="ngram", num_steps=3, topk=1, num_draft_tokens=4),
    SpecConfig(algorithm="eagle3", draft_model="tiny-code-eagle3", num_steps=3, topk=1,
               num_draft_tokens=4),
], ids=["plain", "eagle", "draft_model", "ngram", "eagle3"])
def test_greedy_equals_reference(vllm_backend, oracle, spec, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    handle = vllm_backend.open(OpenConfig(spec=spec, max_running_requests=4))
    try:
        handle.submit(Request("a", PROMPT, params))
        handle.submit(Request("b", PROMPT[:5], params))
        tokens, finishes = _drain(handle)
    finally:
        handle.close()
    for rid, prompt in (("a", PROMPT), ("b", PROMPT[:5])):
        assert list(finishes[rid].output_ids) == tokens[rid] == oracle.greedy(prompt, params)
        assert finishes[rid].reason == "length"
        if spec is None:
            assert finishes[rid].accept_lens == ()
        else:   # every verify step's tokens; the first token came from prefill
            assert sum(finishes[rid].accept_lens) + 1 == len(tokens[rid])
            assert all(1 <= n <= spec.num_steps + 1 for n in finishes[rid].accept_lens)


@needs_vllm
def test_abort_stop_token_and_refusals(vllm_backend, oracle):
    handle = vllm_backend.open(OpenConfig(max_running_requests=2))
    try:
        expected = oracle.greedy(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
        stop = expected[3]
        first = expected.index(stop)
        handle.submit(Request("s", PROMPT, SamplingParams(max_new_tokens=8,
                                                          stop_token_ids=(stop,))))
        handle.submit(Request("x", PROMPT, SamplingParams(max_new_tokens=50, ignore_eos=True)))
        with pytest.raises(ValueError, match=r"^rid: "):
            handle.submit(Request("x", PROMPT))
        with pytest.raises(ValueError, match=r"^session_id: "):
            handle.submit(Request("y", PROMPT, session_id="s1"))
        handle.step()
        handle.abort("x")
        _, finishes = _drain(handle)
        assert finishes["s"].reason == "stop"
        assert list(finishes["s"].output_ids) == expected[:first + 1]
        assert finishes["x"].reason == "abort"
        assert len(finishes["x"].output_ids) >= 1
    finally:
        handle.close()


@needs_vllm
def test_refuses_what_it_cannot_run(vllm_backend):
    for algorithm, head in (("eagle", "tiny-code-eagle"), ("eagle3", "tiny-code-eagle3")):
        tree = SpecConfig(algorithm=algorithm, draft_model=head, num_steps=3, topk=4,
                          num_draft_tokens=8)
        with pytest.raises(ValueError, match=r"^topk: "):
            vllm_backend.open(OpenConfig(spec=tree))
    wrong_head = SpecConfig(algorithm="eagle3", draft_model="tiny-code-eagle", num_steps=3,
                            topk=1, num_draft_tokens=4)
    with pytest.raises(ValueError, match=r"^draft_model: "):
        vllm_backend.open(OpenConfig(spec=wrong_head))
    mtp = SpecConfig(algorithm="frozen_kv_mtp", draft_model="tiny-code-mtp", num_steps=3,
                     topk=1, num_draft_tokens=4)
    with pytest.raises(ValueError, match=r"^algorithm: "):
        vllm_backend.open(OpenConfig(spec=mtp))
    with pytest.raises(ValueError, match=r"^device: "):
        vllm_backend.open(OpenConfig(device="cuda"))


@needs_vllm
def test_page_size_is_a_block_size_of_a_multiple_of_32():
    """The suite asks only multiples of ``page_multiple``; anything else is refused, naming
    ``page_size``, before vLLM starts."""
    from conformance.backends.vllm.engine_config import engine_args

    assert engine_args(OpenConfig())[0].block_size == 32
    assert engine_args(OpenConfig(page_size=64, kv_pool_tokens=100))[0].block_size == 64
    for page in (1, 4, 48):
        with pytest.raises(ValueError, match=r"^page_size: .*multiples of 32 only, not "):
            engine_args(OpenConfig(page_size=page))


@needs_vllm
def test_ngram_maps_to_vllm_prompt_lookup():
    from conformance.backends.vllm.engine_config import speculative_config
    from specwire.params import NGRAM_MAX, NGRAM_MIN

    spec = SpecConfig(algorithm="ngram", num_steps=5, topk=1, num_draft_tokens=6)
    assert speculative_config(OpenConfig(spec=spec)) == {
        "method": "ngram", "num_speculative_tokens": 5,
        "prompt_lookup_max": NGRAM_MAX, "prompt_lookup_min": NGRAM_MIN}


@needs_vllm
def test_eagle3_maps_to_vllm_eagle3_with_the_head_as_it_is():
    from conformance.backends.vllm.engine_config import speculative_config

    spec = SpecConfig(algorithm="eagle3", draft_model="tiny-code-eagle3", num_steps=5, topk=1,
                      num_draft_tokens=6)
    assert speculative_config(OpenConfig(spec=spec)) == {
        "method": "eagle3", "model": str(resolve_model_dir("tiny-code-eagle3")),
        "num_speculative_tokens": 5}


@needs_vllm
def test_eagle3_golden_tier_applies_unless_the_head_is_a_vllm_variant(vllm_backend, tmp_path):
    """The bundled EAGLE-3 head drafts in vLLM with refengine's math (reference_draft holds);
    a head turning on a variant vLLM reads and refengine does not is excepted, by name."""
    plain = SpecConfig(algorithm="eagle3", draft_model="tiny-code-eagle3", num_steps=3, topk=1,
                       num_draft_tokens=4)
    assert unclaimed_under(vllm_backend, plain) == {}
    variant = _eagle3_config(tmp_path, norm_output=True)
    reasons = unclaimed_under(vllm_backend, replace(plain, draft_model=str(variant)))
    assert list(reasons) == ["reference_draft"] and "norm_output" in reasons["reference_draft"]


@needs_vllm
def test_an_engine_opens_after_an_ngram_engine(vllm_backend, oracle):
    """numba (vLLM's n-gram proposer) loads llvmlite, which broke vLLM's kernel-override scan
    at every later engine start in the process; the adapter registers the overrides once."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ngram = SpecConfig(algorithm="ngram", num_steps=3, topk=1, num_draft_tokens=4)
    for spec in (ngram, None):
        handle = vllm_backend.open(OpenConfig(spec=spec, max_running_requests=1))
        try:
            handle.submit(Request("a", PROMPT, params))
            _, finishes = _drain(handle)
        finally:
            handle.close()
        assert list(finishes["a"].output_ids) == oracle.greedy(PROMPT, params)


def _broken_model(tmp_path, name, edit):
    import shutil

    target = tmp_path / name
    shutil.copytree(resolve_model_dir("tiny-code"), target)
    edit(target)
    return target


def _architecture(path):
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))


@needs_vllm
@pytest.mark.parametrize("name,edit,says", [
    ("architecture", _architecture, "not supported"),
    ("tokenizer", lambda p: (p / "tokenizer.json").write_text("{not json"), "JSONDecodeError"),
])
def test_a_model_vllm_cannot_load_is_refused_in_one_line(vllm_backend, tmp_path, name, edit,
                                                        says):
    model = _broken_model(tmp_path, name, edit)
    with pytest.raises(ValueError) as err:
        vllm_backend.open(OpenConfig(model=str(model)))
    message = str(err.value)
    assert message.startswith("model: vLLM") and str(model) in message
    assert "\n" not in message and says in message


@needs_vllm
def test_certify_on_a_model_vllm_refuses_exits_2_before_any_check(tmp_path, capsys):
    """specgate's own model checks accept the copy (its files are whole); vLLM does not know
    the architecture. certify opens the backend once first, so this is one line and exit 2,
    with nothing written, rather than every check failing with the same line."""
    from conformance.cli import main

    model = _broken_model(tmp_path, "architecture", _architecture)
    report = tmp_path / "report"
    code = main(["certify", "--backend", "vllm", "--spec", "none", "-n", "0",
                 "--model", str(model), "--report", str(report)])
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("specgate")]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("specgate: error: --model "), lines
    assert "backend 'vllm' refuses it: model: vLLM refuses" in lines[0]
    assert "not supported" in lines[0]
    assert not report.exists()

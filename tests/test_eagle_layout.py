"""An EAGLE head's layout (``EagleLayout``): which RMSNorms it has around its one decoder layer.

specgate's head normalises the layer's input and its output; vLLM's EAGLE-1 Llama head
(``EagleLlamaForCausalLM``) has neither. The head reads its layout from config.json, and every
path that runs it (the eager forward, the graph runner's draft loops, the loader's checks)
follows it. The math is checked against transformers' own Llama decoder layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_random_model
from engine_helpers import SPEC_PROMPTS, spec_engine

from refengine import SamplingParams
from refengine.data import resolve_model_dir
from refengine.graph.compile import InPlaceKV
from refengine.memory.kv_pool import KVPool
from refengine.model.attention import AttentionMetadata
from refengine.model.configs import EAGLE_VLLM_ARCHITECTURE, EagleLayout
from refengine.model.eagle import EagleDraftModel
from refengine.model.llama import ForwardBatch, LlamaForCausalLM
from refengine.model.loader import check_draft_dir

NORMS = {"input_norm": "layers.0.input_layernorm.weight", "final_norm": "norm.weight"}
LAYOUTS = {"both": EagleLayout(), "none": EagleLayout(False, False),
           "input-only": EagleLayout(True, False), "final-only": EagleLayout(False, True)}
SLOTS = 64


def write_head(target_dir: Path, out: Path, layout: EagleLayout, seed: int = 7,
               architecture: str = "LlamaForCausalLMEagle", flags: bool = True,
               extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A random EAGLE head for the target in ``target_dir`` with ``layout``'s weights (norm
    weights away from 1, so a norm that is skipped or applied twice shows), and its config
    (``flags``: the layout keys written; ``extra``: tensors stored besides)."""
    from safetensors.torch import save_file

    cfg = json.loads((target_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    weights = {"fc.weight": rand(h, 2 * h, scale=0.2),
               "layers.0.self_attn.q_proj.weight": rand(heads * d, h),
               "layers.0.self_attn.k_proj.weight": rand(kv_heads * d, h),
               "layers.0.self_attn.v_proj.weight": rand(kv_heads * d, h),
               "layers.0.self_attn.o_proj.weight": rand(h, heads * d),
               "layers.0.mlp.gate_proj.weight": rand(inter, h),
               "layers.0.mlp.up_proj.weight": rand(inter, h),
               "layers.0.mlp.down_proj.weight": rand(h, inter),
               "layers.0.post_attention_layernorm.weight": 1 + rand(h, scale=0.3)}
    for field, name in NORMS.items():
        if getattr(layout, field):
            weights[name] = 1 + rand(h, scale=0.3)
    weights.update(extra or {})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    config = {**cfg, "architectures": [architecture], "num_hidden_layers": 1}
    if flags:
        config.update({"eagle_input_norm": layout.input_norm,
                       "eagle_final_norm": layout.final_norm})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("layout-target"), layers=1, seed=4)


@pytest.fixture(scope="module")
def target(target_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.load(target_dir, torch.float32, "cpu")


# --- config.json ------------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "want"), [
    ({"architectures": ["LlamaForCausalLMEagle"]}, EagleLayout(True, True)),
    ({"architectures": ["LlamaForCausalLMEagle"], "eagle_input_norm": False},
     EagleLayout(False, True)),
    ({"architectures": ["LlamaForCausalLMEagle"], "eagle_input_norm": False,
      "eagle_final_norm": False}, EagleLayout(False, False)),
    ({"architectures": [EAGLE_VLLM_ARCHITECTURE]}, EagleLayout(False, False)),
    ({"architectures": [EAGLE_VLLM_ARCHITECTURE], "eagle_input_norm": False,
      "eagle_final_norm": False}, EagleLayout(False, False)),
    ({}, EagleLayout(True, True)),
])
def test_layout_from_config(raw: dict, want: EagleLayout) -> None:
    assert EagleLayout.from_dict(raw, Path("config.json")) == want


@pytest.mark.parametrize(("raw", "words"), [
    ({"architectures": [EAGLE_VLLM_ARCHITECTURE], "eagle_final_norm": True},
     "eagle_final_norm is true, but architecture 'EagleLlamaForCausalLM'"),
    ({"architectures": ["LlamaForCausalLMEagle"], "eagle_input_norm": "no"},
     "eagle_input_norm must be true or false, got 'no'"),
    ({"eagle_final_norm": 0}, "eagle_final_norm must be true or false, got 0"),
])
def test_bad_layout_is_one_line_naming_the_key(raw: dict, words: str) -> None:
    with pytest.raises(ValueError) as err:
        EagleLayout.from_dict(raw, Path("/x/config.json"))
    assert str(err.value).startswith("/x/config.json: ") and words in str(err.value)
    assert "\n" not in str(err.value)


# --- the math ---------------------------------------------------------------------------------

def hf_head_forward(target_dir: Path, head_dir: Path, layout: EagleLayout,
                    ids: torch.Tensor, features: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head as the math says, on transformers' Llama decoder layer (a causal sequence at
    positions 0..T-1): fc over [embedding; feature], the layer (its input norm an identity
    without ``input_norm``), the final norm (none without ``final_norm``), the target's LM
    head. -> (logits, predicted features)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cfg = LlamaConfig.from_pretrained(head_dir)
    cfg._attn_implementation = "sdpa"
    weights = load_file(str(head_dir / "model.safetensors"))
    layer = LlamaDecoderLayer(cfg, 0).eval()
    if not layout.input_norm:
        layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in weights.items()
                           if k.startswith("layers.0.")})
    norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    if layout.final_norm:
        norm.load_state_dict({"weight": weights["norm.weight"]})
    with torch.no_grad():
        x = torch.cat([hf.model.embed_tokens(ids), features], -1) @ weights["fc.weight"].T
        positions = torch.arange(len(ids))[None]
        rope = LlamaRotaryEmbedding(cfg)(x[None], positions)
        x = layer(x[None], attention_mask=None, position_ids=positions,
                  position_embeddings=rope)[0]
        predicted = norm(x) if layout.final_norm else x
        return hf.lm_head(predicted), predicted


def run_head(head: EagleDraftModel, ids: torch.Tensor, features: torch.Tensor,
             graph_pieces: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """refengine's head over a prompt at positions 0..T-1, its KV at scattered slots: the eager
    forward, or what the draft loops run (``compute``, its KV written through the graphs'
    write op)."""
    n = len(ids)
    cfg = head.config
    pool = KVPool(SLOTS, 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    table = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(3))[None]
    meta = AttentionMetadata.build(table, torch.tensor([0]), [n], [n])
    if graph_pieces:
        with torch.inference_mode():
            return head.compute(ids, features, torch.arange(n), meta, table[0, :n],
                                InPlaceKV(pool.k, pool.v))
    return head(ForwardBatch(ids, torch.arange(n), table[0, :n], meta), features, pool)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_head_computes_what_its_layout_says(name: str, target_dir: Path,
                                            target: LlamaForCausalLM, tmp_path: Path) -> None:
    """Each layout against transformers' decoder layer with the same norms: the eager forward
    and the graph's pieces alike."""
    layout = LAYOUTS[name]
    head_dir = write_head(target_dir, tmp_path / name, layout)
    head = EagleDraftModel.load(head_dir, target, torch.float32, "cpu")
    assert head.layout == layout
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 2048, (12,), generator=gen)
    features = torch.randn((12, target.config.hidden_size), generator=gen)
    want_logits, want_predicted = hf_head_forward(target_dir, head_dir, layout, ids, features)
    for graph_pieces in (False, True):
        logits, predicted = run_head(head, ids, features, graph_pieces)
        torch.testing.assert_close(predicted, want_predicted, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_head_without_norms_in_pieces(target_dir: Path, target: LlamaForCausalLM,
                                      tmp_path: Path) -> None:
    """vLLM's layout: no norm weights in the state dict; the layer's projection reads its
    input as it is; the prediction is the layer's output itself, read by the LM head."""
    head_dir = write_head(target_dir, tmp_path / "vllm", LAYOUTS["none"],
                          architecture=EAGLE_VLLM_ARCHITECTURE, flags=False)
    head = EagleDraftModel.load(head_dir, target, torch.float32, "cpu")
    assert head.layout == EagleLayout(False, False)
    assert not set(NORMS.values()) & set(head.state_dict())
    x = torch.randn((5, target.config.hidden_size), generator=torch.Generator().manual_seed(2))
    logits, predicted = head.predict(x)
    assert torch.equal(predicted, x)
    torch.testing.assert_close(logits, target.lm_head(x).float())
    rope = target.rotary.at(torch.arange(5), x.dtype)
    for got, want in zip(head.layer.project(x, rope), head.layer.self_attn.project(x, rope),
                         strict=True):
        assert torch.equal(got, want)


# --- the loader's checks ----------------------------------------------------------------------

@pytest.mark.parametrize(("layout", "extra", "words"), [
    (EagleLayout(False, False), {"norm.weight": torch.ones(64)}, "stores norm.weight"),
    (EagleLayout(False, True), {"layers.0.input_layernorm.weight": torch.ones(64)},
     "stores layers.0.input_layernorm.weight"),
])
def test_norm_weights_must_match_the_declared_layout(layout: EagleLayout, extra: dict,
                                                     words: str, target_dir: Path,
                                                     target: LlamaForCausalLM,
                                                     tmp_path: Path) -> None:
    """A head converted without its config.json saying so fails fast (the header alone) and
    at load, one line each, naming the file."""
    head_dir = write_head(target_dir, tmp_path / "head", layout, extra=extra)
    with pytest.raises(ValueError) as err:
        check_draft_dir(head_dir)
    message = str(err.value)
    assert message.startswith(str(head_dir / "model.safetensors")) and words in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"not an EAGLE head of the layout config\.json declares"):
        EagleDraftModel.load(head_dir, target, torch.float32, "cpu")


def test_missing_norm_weight_is_refused(target_dir: Path, target: LlamaForCausalLM,
                                        tmp_path: Path) -> None:
    head_dir = write_head(target_dir, tmp_path / "head", EagleLayout(False, False), flags=False)
    with pytest.raises(ValueError, match=r"lacks layers\.0\.input_layernorm\.weight"):
        check_draft_dir(head_dir)  # specgate's architecture, no keys: both norms expected
    with pytest.raises(ValueError, match=r"missing \[.layers\.0\.input_layernorm\.weight."):
        EagleDraftModel.load(head_dir, target, torch.float32, "cpu")


# --- the engine -------------------------------------------------------------------------------

@pytest.mark.parametrize("config", ["chain-s3-n4", "tree-s3-k4-n8"])
def test_engine_with_a_head_without_norms(config: str, target_dir: Path, tmp_path: Path
                                          ) -> None:
    """Lossless against plain decoding, and the graph runner's draft loops and extend graph
    (replay executor) draft exactly what the eager head drafts."""
    head_dir = write_head(target_dir, tmp_path / "vllm", LAYOUTS["none"],
                          architecture=EAGLE_VLLM_ARCHITECTURE)
    pair = (target_dir, head_dir)
    params = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(SPEC_PROMPTS))]
    plain = spec_engine(pair, None).generate(SPEC_PROMPTS, params)
    eager = spec_engine(pair, config, max_running_requests=8).generate(SPEC_PROMPTS, params)
    graphed = spec_engine(pair, config, max_running_requests=8, cuda_graph=True,
                          graph_executor="replay").generate(SPEC_PROMPTS, params)
    assert [o.output_ids for o in eager] == [o.output_ids for o in plain]
    assert [o.output_ids for o in graphed] == [o.output_ids for o in plain]
    assert [o.accept_lens for o in graphed] == [o.accept_lens for o in eager]


# --- the bundled head in vLLM's layout --------------------------------------------------------

def test_bundled_vllm_layout_head(target: LlamaForCausalLM) -> None:
    """``tiny-code-eagle-vllm``: manifest-checked, vLLM's architecture and layout, loads on
    tiny-code; vLLM's backend uses it as it is (nothing dropped), the original head converted."""
    from conformance.backends.vllm import layout

    head_dir = resolve_model_dir("tiny-code-eagle-vllm")
    check_draft_dir(head_dir)
    raw = json.loads((head_dir / "config.json").read_text())
    assert raw["architectures"] == [EAGLE_VLLM_ARCHITECTURE] and raw["target"] == "tiny-code"
    tiny = LlamaForCausalLM.load(resolve_model_dir("tiny-code"), torch.float32, "cpu")
    head = EagleDraftModel.load(head_dir, tiny, torch.float32, "cpu")
    assert head.layout == EagleLayout(False, False)
    assert layout.drafts_as_refengine(head_dir) and layout.eagle_dir(head_dir) == head_dir
    assert not layout.drafts_as_refengine(resolve_model_dir("tiny-code-eagle"))


def test_vllm_layout_under_specgate_name_is_only_renamed(target_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A head without norms under specgate's architecture name: vLLM's copy renames the
    architecture and keeps every tensor; one under vLLM's name with a norm is refused."""
    from safetensors import safe_open

    from conformance.backends.vllm import layout

    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "cache"))
    head_dir = write_head(target_dir, tmp_path / "head", LAYOUTS["none"])
    out = layout.eagle_dir(head_dir)
    assert out != head_dir and out.parent == tmp_path / "cache" / "vllm"
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        EAGLE_VLLM_ARCHITECTURE]
    with safe_open(str(out / "model.safetensors"), "pt") as f, \
            safe_open(str(head_dir / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
    bad = write_head(target_dir, tmp_path / "bad", LAYOUTS["final-only"],
                     architecture=EAGLE_VLLM_ARCHITECTURE)
    with pytest.raises(ValueError, match=r"^draft_model: .*eagle_final_norm is true"):
        layout.eagle_dir(bad)

"""The ``tiny-code-eagle3`` fixture (EAGLE-3 head of ``tiny-code``, vLLM's checkpoint layout): it
loads through refengine's runtime class, the target's tap computes the features the training
module fuses, each training pass computes what the head computes at that step of a draft
chain (the first on those features, a later one on its own pre-norm output), its logits land on
the target ids ``d2t`` names, and the loader refuses configs and vocabulary maps that do not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

from refengine.data import resolve_model_dir
from refengine.memory.kv_pool import KVPool
from refengine.model.attention import AttentionMetadata
from refengine.model.eagle3 import Eagle3DraftModel
from refengine.model.llama import ForwardBatch, LlamaForCausalLM
from refengine.model.loader import load_weights

PROMPT_LEN = 48
SLOTS = 96

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def head_dir() -> Path:
    return resolve_model_dir("tiny-code-eagle3")  # also checks the files against MANIFEST.json


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return LlamaForCausalLM.load(resolve_model_dir("tiny-code"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def head(head_dir: Path, target: LlamaForCausalLM) -> Eagle3DraftModel:
    return Eagle3DraftModel.load(head_dir, target, torch.float32, "cpu")


@pytest.fixture(scope="module")
def window() -> torch.Tensor:
    return torch.randint(1, 2048, (PROMPT_LEN + 1,), generator=torch.Generator().manual_seed(5))


def target_features(target: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """refengine's target over ``ids`` (its KV at scattered slots): what it hands the drafter."""
    cfg = target.config
    kv = KVPool(SLOTS, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                torch.float32, "cpu")
    table = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(6))[None]
    n = len(ids)
    meta = AttentionMetadata.build(table, torch.tensor([0]), [n], [n])
    return target(ForwardBatch(ids, torch.arange(n), table[0, :n], meta), kv).features


def head_over(head: Eagle3DraftModel, tokens: torch.Tensor, features: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over one window, a row per position (a draft prefill with every row wanted),
    its KV at scattered slots of a pool of its own."""
    cfg = head.config
    kv = KVPool(SLOTS, 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    table = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(8))[None]
    n = len(tokens)
    meta = AttentionMetadata.build(table, torch.tensor([0]), [n], [n])
    return head(ForwardBatch(tokens, torch.arange(n), table[0, :n], meta), features, kv)


def test_config_and_loader(build: ModuleType, head: Eagle3DraftModel, head_dir: Path) -> None:
    raw = json.loads((head_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["target"] == "tiny-code"
    plan = build.EAGLE3_PLAN
    assert head.eagle3.aux_layers == plan.aux_layers
    assert head.eagle3.draft_vocab_size == plan.draft_vocab_size < 2048
    assert head.fc.weight.shape == (192, 3 * 192)
    assert head.midlayer.self_attn.q_proj.weight.shape == (192, 2 * 192)
    stored = load_weights(head_dir, torch.bfloat16)
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert stored["lm_head.weight"].dtype == torch.bfloat16
    assert not [n for n in stored if "embed" in n]  # the target's embedding, shared


def test_tap_gives_the_training_modules_fused_features(
        build: ModuleType, head: Eagle3DraftModel, target: LlamaForCausalLM,
        window: torch.Tensor) -> None:
    """transformers' target, tapped as the training tapped it, fused by the head's fc, against
    the features refengine's target hands the drafter; without the tap they are the
    final-norm output again."""
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(resolve_model_dir("tiny-code"), dtype=torch.float32).eval()
    taps, finals = build.target_taps(hf, window[None], head.eagle3.aux_layers, torch.float32)
    target.use_feature_tap(head.tap)
    try:
        tapped = target_features(target, window)
    finally:
        target.use_feature_tap(None)
    with torch.no_grad():
        want = head.fc(taps[0])
    torch.testing.assert_close(tapped, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(target_features(target, window), finals[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("start", [0, 5, PROMPT_LEN - 4])
def test_every_training_pass_is_the_runtime_draft_chain(
        build: ModuleType, head_dir: Path, head: Eagle3DraftModel, target: LlamaForCausalLM,
        window: torch.Tensor, start: int) -> None:
    """The training module's pass k at position ``start + k`` against refengine's head over
    the rows drafting gives it: positions 0..start with the fed features (the draft-extend's
    context), then one row per earlier draft step, each fed the previous step's pre-norm
    output, its KV kept. Their logits land on the target ids ``d2t`` names, -inf elsewhere."""
    raw = json.loads((head_dir / "config.json").read_text())
    from transformers import LlamaConfig

    vocab = raw["draft_vocab_size"]
    module = build.Eagle3Head(LlamaConfig(**{**raw, "_attn_implementation": "sdpa"}), 3, vocab)
    weights = load_weights(head_dir, torch.float32)
    module.load_state_dict({k: v for k, v in weights.items() if k not in ("d2t", "t2d")},
                           strict=False)
    ids = torch.arange(vocab) + weights["d2t"]
    off = torch.ones(2048, dtype=torch.bool)
    off[ids] = False
    tokens = window[1:]
    features = torch.randn(PROMPT_LEN, 192, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        embeds = target.model.embed_tokens(tokens)[None]
        hidden = features[None]
        earlier: list[tuple[torch.Tensor, torch.Tensor]] = []
        chain_inputs = [features[:start + 1]]
        for k in range(build.EAGLE3_PLAN.unroll):
            want_logits, prenorm, kv = module(embeds, hidden, earlier)
            earlier.append(kv)
            j = start + k
            logits, predicted = head_over(head, tokens[:j + 1], torch.cat(chain_inputs))
            torch.testing.assert_close(predicted[j], prenorm[0, j], rtol=0, atol=1e-4)
            torch.testing.assert_close(logits[j, ids], want_logits[0, j], rtol=0, atol=1e-4)
            assert bool((logits[j, off] == float("-inf")).all())
            chain_inputs.append(prenorm[0, j:j + 1])
            hidden = torch.cat([hidden[:, :1], prenorm[:, :-1]], dim=1)


def test_loader_rejects_mismatches(head_dir: Path, target: LlamaForCausalLM,
                                   tmp_path: Path) -> None:
    bad = Path(shutil.copytree(head_dir, tmp_path / "eagle3"))
    raw = json.loads((bad / "config.json").read_text())
    weights = load_file(str(head_dir / "model.safetensors"))

    def load_with(config: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        (bad / "config.json").write_text(json.dumps(config))
        save_file(tensors if tensors is not None else weights, str(bad / "model.safetensors"))
        Eagle3DraftModel.load(bad, target, torch.float32, "cpu")

    with pytest.raises(ValueError, match="architectures must include"):
        load_with({**raw, "architectures": ["LlamaForCausalLMEagle"]})
    for layers in ([2, 6, 13], [2, 2, 6], [], "2,6,11", [2, 6.0, 11]):
        with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids must be"):
            load_with({**raw, "eagle_aux_hidden_state_layer_ids": layers})
    with pytest.raises(ValueError, match="wrong shape"):  # fc reads three taps, not two
        load_with({**raw, "eagle_aux_hidden_state_layer_ids": [2, 6]})
    with pytest.raises(ValueError, match="draft_vocab_size must be"):
        load_with({**raw, "draft_vocab_size": 4096})
    with pytest.raises(ValueError, match="wrong shape"):
        load_with({**raw, "draft_vocab_size": 512})
    twice = weights["d2t"].clone()
    twice[1] = twice[0] - 1  # draft ids 0 and 1 on one target id
    with pytest.raises(ValueError, match="two onto one target id"):
        load_with(raw, {**weights, "d2t": twice})
    past = weights["d2t"].clone()
    past[-1] = 2048
    with pytest.raises(ValueError, match="outside"):
        load_with(raw, {**weights, "d2t": past})
    flipped = weights["t2d"].clone()
    flipped[int(torch.nonzero(~flipped)[0])] = True
    with pytest.raises(ValueError, match=f"t2d marks {raw['draft_vocab_size'] + 1} target ids"):
        load_with(raw, {**weights, "t2d": flipped})
    with pytest.raises(ValueError, match="d2t must be int64"):
        load_with(raw, {**weights, "d2t": weights["d2t"].to(torch.int32)})

"""The ``tiny-code-mtp`` fixture (Frozen-KV MTP assistant of ``tiny-code``): it loads through
refengine's runtime class, that class computes what the training module in
``fixtures/build.py`` computes on the same inputs, its queries see exactly the committed prefix
``[0, seq_len)`` of the target's last-layer KV, and it never writes the KV pool it reads."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch

from refengine.data import resolve_model_dir
from refengine.memory.kv_pool import KVPool
from refengine.model.attention import AttentionMetadata
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import ForwardBatch, LlamaForCausalLM
from refengine.model.loader import load_weights

PROMPT_LEN = 40
SLOTS = 96
SEQ_LENS = [1, 2, 9, 23, PROMPT_LEN]  # committed lengths of the draft rows, one request each

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mtp_dir() -> Path:
    return resolve_model_dir("tiny-code-mtp")  # also checks the files against MANIFEST.json


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return LlamaForCausalLM.load(resolve_model_dir("tiny-code"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def assistant(mtp_dir: Path, target: LlamaForCausalLM) -> FrozenKVMTPDraftModel:
    return FrozenKVMTPDraftModel.load(mtp_dir, target, torch.float32, "cpu")


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(1, 2048, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def prefilled(target: LlamaForCausalLM, prompt: torch.Tensor
              ) -> tuple[KVPool, torch.Tensor, torch.Tensor]:
    """refengine's target run over ``prompt``: the pool holding its KV at scattered slots (so a
    wrong slot lookup shows), the request's row table [1, SLOTS], and the target's features."""
    cfg = target.config
    kv = KVPool(SLOTS, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                torch.float32, "cpu")
    table = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(6))[None]
    n = PROMPT_LEN
    meta = AttentionMetadata.build(table, torch.tensor([0]), [n], [n])
    out = target(ForwardBatch(prompt, torch.arange(n), table[0, :n], meta), kv)
    return kv, table, out.features


def draft_step(assistant: FrozenKVMTPDraftModel, kv: KVPool, table: torch.Tensor,
               tokens: torch.Tensor, hidden: torch.Tensor, seq_lens: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration for rows of request 0 at the given committed lengths, as a drafting
    caller sets it up: a query at ``seq_len - 1`` over ``[0, seq_len)``."""
    rows = torch.zeros(len(seq_lens), dtype=torch.int64)
    meta = AttentionMetadata.build(table, rows, [1] * len(seq_lens), seq_lens)
    positions = torch.tensor(seq_lens) - 1
    return assistant(tokens, hidden, positions, meta, kv)


def test_config_and_loader(assistant: FrozenKVMTPDraftModel, mtp_dir: Path,
                           target: LlamaForCausalLM) -> None:
    raw = json.loads((mtp_dir / "config.json").read_text())
    assert raw["architectures"] == ["FrozenKVMTPAssistant"] and raw["target"] == "tiny-code"
    cfg = assistant.config
    assert (cfg.target_hidden_size, cfg.vocab_size) == (target.config.hidden_size,
                                                        target.config.vocab_size)
    assert cfg.kv_layer == target.config.num_hidden_layers - 1
    assert len(assistant.layers) == cfg.num_hidden_layers
    # No K/V projections anywhere: the assistant has nothing it could write to a cache.
    names = list(assistant.state_dict())
    assert not [n for n in names if "k_proj" in n or "v_proj" in n]
    # The embedding and rotary tables are the target's, not stored twice.
    assert not [n for n in names if "embed" in n]
    assert load_weights(mtp_dir, torch.bfloat16)["lm_head.weight"].dtype == torch.bfloat16


def test_loader_rejects_mismatches(mtp_dir: Path, target: LlamaForCausalLM,
                                   tmp_path: Path) -> None:
    bad = Path(shutil.copytree(mtp_dir, tmp_path / "mtp"))
    raw = json.loads((bad / "config.json").read_text())

    def load_with(config: dict) -> None:
        (bad / "config.json").write_text(json.dumps(config))
        FrozenKVMTPDraftModel.load(bad, target, torch.float32, "cpu")

    with pytest.raises(ValueError, match="architectures must include"):
        load_with({**raw, "architectures": ["LlamaForCausalLMEagle"]})
    with pytest.raises(ValueError, match="kv_layer 12 is not a layer"):
        load_with({**raw, "kv_layer": 12})
    with pytest.raises(ValueError, match="do not match the target"):
        load_with({**raw, "target_hidden_size": 128})
    with pytest.raises(ValueError, match="missing field 'kv_layer'"):
        load_with({k: v for k, v in raw.items() if k != "kv_layer"})
    with pytest.raises(ValueError, match="wrong shape"):
        load_with({**raw, "intermediate_size": raw["intermediate_size"] + 1})
    with pytest.raises(ValueError, match="unexpected"):
        load_with({**raw, "num_hidden_layers": raw["num_hidden_layers"] - 1})
    (bad / "config.json").write_text(json.dumps(raw))
    (bad / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing model\.safetensors"):
        FrozenKVMTPDraftModel.load(bad, target, torch.float32, "cpu")


def test_runtime_matches_the_training_module(
        build: ModuleType, mtp_dir: Path, assistant: FrozenKVMTPDraftModel,
        prompt: torch.Tensor, prefilled: tuple[KVPool, torch.Tensor, torch.Tensor]) -> None:
    """Two unrolled iterations of the training module (transformers' target states, its own
    attention over the whole window) against refengine's forward at the rows' positions."""
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(resolve_model_dir("tiny-code"), dtype=torch.float32).eval()
    plan = build.MtpPlan(**{k: v for k, v in json.loads((mtp_dir / "config.json").read_text())
                            .items() if k in ("hidden_size", "intermediate_size",
                                              "num_hidden_layers", "kv_layer")})
    module = build.MtpAssistant(plan, hf.config)
    module.load_state_dict(load_weights(mtp_dir, torch.float32), strict=True)
    feats, keys, values = build.target_states(hf, prompt[None], plan.kv_layer, torch.float32)
    rope = build.mtp_rope(hf.config, PROMPT_LEN)
    # Iteration k's token at query position t: any token will do, distinct per k and t.
    tokens = torch.randint(1, 2048, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    kv, table, features = prefilled
    torch.testing.assert_close(features, feats[0], rtol=0, atol=1e-5)  # same target states
    at = torch.tensor(SEQ_LENS) - 1
    state, hidden = feats, features[at]
    with torch.no_grad():
        for k in range(2):
            state = module(hf.model.embed_tokens(tokens[k])[None], state, *rope, keys, values)
            want_logits = module.lm_head(state)[0, at]
            logits, hidden = draft_step(assistant, kv, table, tokens[k, at], hidden, SEQ_LENS)
            assert logits.dtype == torch.float32 and logits.shape == (len(SEQ_LENS), 2048)
            torch.testing.assert_close(hidden, state[0, at], rtol=0, atol=1e-4)
            torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4)


def test_forward_never_writes_the_pool(
        assistant: FrozenKVMTPDraftModel,
        prefilled: tuple[KVPool, torch.Tensor, torch.Tensor]) -> None:
    kv, table, features = prefilled
    before = kv.k.clone(), kv.v.clone()
    at = torch.tensor(SEQ_LENS) - 1
    draft_step(assistant, kv, table, torch.full((len(SEQ_LENS),), 7), features[at], SEQ_LENS)
    assert torch.equal(kv.k, before[0]) and torch.equal(kv.v, before[1])


def test_query_sees_exactly_the_committed_prefix(
        assistant: FrozenKVMTPDraftModel,
        prefilled: tuple[KVPool, torch.Tensor, torch.Tensor]) -> None:
    """A row with committed length s reads the target's kv_layer at positions [0, s) and
    nothing else: changing any other position, or any other layer, leaves its output alone;
    changing position s-1 or position 0 of kv_layer does not."""
    kv, table, features = prefilled
    s, layer = 23, assistant.config.kv_layer
    tokens, hidden = torch.tensor([11]), features[s - 1:s]
    want, _ = draft_step(assistant, kv, table, tokens, hidden, [s])

    def with_changed(layers: slice | int, positions: slice | int) -> torch.Tensor:
        work = copy.copy(kv)
        work.k, work.v = kv.k.clone(), kv.v.clone()
        slots = table[0, positions]
        work.k[layers, slots] += 1.0
        work.v[layers, slots] -= 1.0
        return draft_step(assistant, work, table, tokens, hidden, [s])[0]

    assert torch.equal(with_changed(layer, slice(s, PROMPT_LEN)), want)
    assert torch.equal(with_changed(slice(0, layer), slice(0, PROMPT_LEN)), want)
    assert not torch.allclose(with_changed(layer, s - 1), want, atol=1e-3)
    assert not torch.allclose(with_changed(layer, 0), want, atol=1e-3)

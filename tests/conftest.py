"""Shared fixtures for the project's own tests.

``random_model_dir``: a tiny randomly initialised Llama in HF format (2 layers, 64 wide, vocab
2048, context 512) with the bundled tokenizer, built once per session. Fast tests run the engine
on it; ``transformers`` loads the same directory as the outside oracle.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "fixtures" / "tokenizer"
BUILD_PY = REPO / "fixtures" / "build.py"

RANDOM_VOCAB = 2048
RANDOM_CONTEXT = 512


@pytest.fixture(scope="session", autouse=True)
def private_package_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tests' compiled packages (the "aot" executor, and the commands they run in
    subprocesses) go to a directory of the session's, never the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECGATE_CACHE_DIR", str(tmp_path_factory.mktemp("specgate-cache")))
        yield


def build_random_model(out: Path, layers: int = 2, seed: int = 0) -> Path:
    """Write a random Llama (seeded, so every session builds the same weights) to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=RANDOM_VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=RANDOM_CONTEXT, tie_word_embeddings=False,
                      eos_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, out / name)
    return out


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module: the tiny models gain nothing from more, and xdist
    workers share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the random model; read-only for tests (copy it before changing files)."""
    return build_random_model(tmp_path_factory.mktemp("random-llama"))


@pytest.fixture(scope="session")
def hf_random_model(random_model_dir: Path) -> torch.nn.Module:
    """The random model as ``transformers`` loads it, in float32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    return model.eval()


def build_mimic_eagle(target_dir: Path, out: Path) -> Path:
    """An EAGLE head that nearly mimics a ONE-layer target: ``fc`` passes the token embedding
    through, the decoder layer and norm are the target's. It sees each token one position
    early (RoPE is shift-invariant, so only the missing first token differs), which makes its
    drafts mostly right: acceptance paths of every length occur on a random model."""
    import json

    from safetensors.torch import load_file, save_file

    cfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1, "the mimic head copies a one-layer target"
    weights = load_file(str(target_dir / "model.safetensors"))
    hidden = cfg["hidden_size"]
    head = {"fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
            "norm.weight": weights["model.norm.weight"]}
    head.update({k.removeprefix("model."): v for k, v in weights.items()
                 if k.startswith("model.layers.0.")})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg,
                                                 "architectures": ["LlamaForCausalLMEagle"]}))
    return out


def build_random_mtp(target_dir: Path, out: Path, seed: int = 3) -> Path:
    """A randomly initialised Frozen-KV MTP assistant for the target in ``target_dir`` (two
    layers, width 48, reading the target's last layer): its drafts are poor, which is all a
    lossless check needs, and it exercises every shape the trained one has."""
    import json

    from safetensors.torch import save_file

    target = json.loads((target_dir / "config.json").read_text())
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    head_dim = hidden // heads
    cfg = {"architectures": ["FrozenKVMTPAssistant"], "model_type": "frozen_kv_mtp",
           "hidden_size": 48, "target_hidden_size": hidden, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": heads,
           "num_key_value_heads": target["num_key_value_heads"], "head_dim": head_dim,
           "kv_layer": target["num_hidden_layers"] - 1, "vocab_size": target["vocab_size"],
           "rms_norm_eps": 1e-5}
    gen = torch.Generator().manual_seed(seed)
    shapes = {"pre_projection.weight": (48, 2 * hidden), "norm.weight": (48,),
              "post_projection.weight": (hidden, 48), "lm_head.weight": (cfg["vocab_size"], hidden)}
    for i in range(2):
        shapes.update({f"layers.{i}.input_layernorm.weight": (48,),
                       f"layers.{i}.post_attention_layernorm.weight": (48,),
                       f"layers.{i}.self_attn.q_proj.weight": (heads * head_dim, 48),
                       f"layers.{i}.self_attn.o_proj.weight": (48, heads * head_dim),
                       f"layers.{i}.mlp.gate_proj.weight": (96, 48),
                       f"layers.{i}.mlp.up_proj.weight": (96, 48),
                       f"layers.{i}.mlp.down_proj.weight": (48, 96)})
    weights = {name: (torch.ones(shape) if name.endswith("norm.weight")
                      else torch.randn(shape, generator=gen) * 0.1)
               for name, shape in shapes.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="session")
def mtp_dir(spec_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Frozen-KV MTP assistant for ``spec_pair``'s target."""
    return build_random_mtp(spec_pair[0], tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="session")
def spec_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(one-layer random target directory, mimic EAGLE head directory)."""
    root = tmp_path_factory.mktemp("spec-pair")
    target = build_random_model(root / "target", layers=1, seed=1)
    return target, build_mimic_eagle(target, root / "eagle")


@pytest.fixture(scope="session")
def build() -> ModuleType:
    """fixtures/build.py as a module (a script in the checkout, not a package member): its
    training modules are what the runtime heads are checked against."""
    if not BUILD_PY.is_file():
        pytest.skip("fixtures/build.py is not shipped in an installed wheel")
    spec = importlib.util.spec_from_file_location("specgate_fixture_build", BUILD_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module

"""SamplingParams / SpecConfig / EngineConfig validation: a bad value raises ValueError whose
message starts with the field's name."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from refengine.config import EngineConfig, SamplingParams, SpecConfig

SAMPLING_BAD: list[tuple[str, Any]] = [
    ("max_new_tokens", 0), ("max_new_tokens", -3), ("max_new_tokens", 2.0),
    ("max_new_tokens", True), ("max_new_tokens", "8"), ("max_new_tokens", None),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1.0"), ("temperature", None), ("temperature", True),
    ("top_k", 0), ("top_k", -2), ("top_k", 5.0), ("top_k", True), ("top_k", None),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", math.nan), ("top_p", "0.9"),
    ("top_p", None), ("top_p", True),
    ("seed", -1), ("seed", 1.5), ("seed", True), ("seed", "7"),
    ("stop_token_ids", (-1,)), ("stop_token_ids", (3, 2.0)), ("stop_token_ids", (True,)),
    ("stop_token_ids", ("5",)), ("stop_token_ids", None), ("stop_token_ids", 5),
    ("stop", ("",)), ("stop", ""), ("stop", ("ok", 3)), ("stop", None), ("stop", 5),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
]

SPEC_BAD: list[tuple[str, Any]] = [
    ("algorithm", "medusa"), ("algorithm", ""), ("algorithm", None),
    ("draft_model", ""), ("draft_model", None), ("draft_model", 3),
    ("num_steps", 0), ("num_steps", -1), ("num_steps", 2.0), ("num_steps", True),
    ("topk", 0), ("topk", 1.0), ("topk", None),
    ("num_draft_tokens", 1), ("num_draft_tokens", 4.0),
    ("overlap", 1), ("overlap", "false"), ("overlap", None),
]

ENGINE_BAD: list[tuple[str, Any]] = [
    ("model", ""), ("model", None), ("model", 3),
    ("kv_pool_tokens", 0), ("kv_pool_tokens", -16), ("kv_pool_tokens", 64.0),
    ("kv_pool_tokens", None),
    ("page_size", 0), ("page_size", -4), ("page_size", 2.0), ("page_size", True),
    ("max_running_requests", 0), ("max_running_requests", 1.0), ("max_running_requests", None),
    ("max_prefill_tokens", 0), ("max_prefill_tokens", -1), ("max_prefill_tokens", 8.0),
    ("device", "tpu"), ("device", ""), ("device", None), ("device", 0),
    ("dtype", "float64"), ("dtype", "fp32"), ("dtype", None),
    ("strict_mem_check", 1), ("strict_mem_check", "yes"), ("strict_mem_check", None),
    ("cuda_graph", 1), ("cuda_graph", "yes"), ("graph_executor", "cuda"),
    ("graph_executor", "tensorrt"), ("graph_executor", 1),
    ("overlap_thread", 1), ("overlap_thread", "yes"),
    ("seed", -1), ("seed", 0.5), ("seed", False), ("seed", None),
]


def assert_names_field(err: pytest.ExceptionInfo[ValueError], field: str) -> None:
    assert re.match(rf"{field}: \S", str(err.value)), str(err.value)


@pytest.mark.parametrize(("field", "value"), SAMPLING_BAD)
def test_sampling_params_rejects(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert_names_field(err, field)


@pytest.mark.parametrize(("field", "value"), SPEC_BAD)
def test_spec_config_rejects(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as err:
        SpecConfig(**{field: value})
    assert_names_field(err, field)


@pytest.mark.parametrize(("field", "value"), ENGINE_BAD)
def test_engine_config_rejects(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(**{field: value})
    assert_names_field(err, field)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_steps": 3, "topk": 1, "num_draft_tokens": 5}, "num_draft_tokens"),   # chain: S + 1
    ({"num_steps": 3, "topk": 1, "num_draft_tokens": 3}, "num_draft_tokens"),
    ({"num_steps": 2, "topk": 2, "num_draft_tokens": 6}, "num_draft_tokens"),   # > 1 + k*S
    ({"num_steps": 1, "topk": 4, "num_draft_tokens": 6}, "num_draft_tokens"),
])
def test_spec_config_tree_shape(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError) as err:
        SpecConfig(**kwargs)
    assert_names_field(err, field)


def test_kv_pool_smaller_than_a_page() -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(kv_pool_tokens=3, page_size=4)
    assert_names_field(err, "kv_pool_tokens")
    assert EngineConfig(kv_pool_tokens=4, page_size=4).kv_pool_tokens == 4


def test_valid_values_are_accepted_and_normalised() -> None:
    p = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=1, top_p=1, seed=0,
                       stop_token_ids=[3, 4], stop="\n\n", ignore_eos=True)
    assert p.stop_token_ids == (3, 4) and p.stop == ("\n\n",)
    assert not p.greedy and SamplingParams().greedy
    hash(p)  # lists were turned into tuples: params stay hashable
    assert SpecConfig(num_steps=3, topk=2, num_draft_tokens=7).num_draft_tokens == 7
    assert SpecConfig(algorithm="frozen_kv_mtp", overlap=True).overlap
    cfg = EngineConfig(model="some/dir", kv_pool_tokens=64, page_size=16, device="cuda:1",
                       dtype="bfloat16", strict_mem_check=False, seed=3)
    assert cfg.page_size == 16 and cfg.device == "cuda:1"


def test_configs_are_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.max_new_tokens = 3  # type: ignore[misc]


def test_overlap_thread_defaults_to_the_device() -> None:
    """The launch thread where launches are asynchronous (CUDA), one thread on the CPU."""
    assert EngineConfig().overlap_thread is False
    assert EngineConfig(device="cuda").overlap_thread is True
    assert EngineConfig(overlap_thread=True).overlap_thread is True

"""Host round-trips per steady-state decode step, counted on the CPU and pinned per algorithm.

On a GPU every read of a device tensor's values from the host (``.item()``, ``.tolist()``,
``.cpu()``, ``.numpy()``, ``int()``/``float()``/``bool()``/``__index__`` of a tensor, ``.to()``
the CPU) waits for the device to drain: a step that makes many of them is launch-bound however
fast its kernels are. On the CPU the same calls cost nothing, so they are counted with a
``TorchFunctionMode`` instead: one greedy batch of four requests, one decode step once every
request decodes, every such call during ``engine.step()``. The counts must equal ``EXPECTED``
exactly (a new round-trip, or one removed, changes the table on purpose); each entry says which
reads the design needs. The engine runs on the CPU here, so a host-only tensor would count too:
the engine keeps its host bookkeeping in Python values (the row table's host copy included),
so none does.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from refengine import Engine, EngineConfig, FinishEvent, SamplingParams, SpecConfig

SYNC_METHODS = frozenset({"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__",
                          "__index__"})
ENGINE_ROOT = Path(__file__).resolve().parent.parent / "refengine"


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``Tensor.to(...)`` whose target device is the CPU."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
        if isinstance(value, (str, torch.device)):
            return torch.device(value).type == "cpu"
    return False


def _where() -> str:
    """The innermost engine frame making the call: ``path:function``."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(ENGINE_ROOT):
            return f"{path.relative_to(ENGINE_ROOT.parent)}:{frame.name}"
    return "outside refengine"


class SyncCounter(TorchFunctionMode):
    """Counts host round-trips by where in the engine they are made."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS or (name == "to" and _to_host(args, kwargs)):
            self.calls[f"{_where()} {name}"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


PROMPTS = ["def fib(n):", "import os\nimport sys", "class A:\n    def", "x = [1, 2"]
MTP = {"algorithm": "frozen_kv_mtp", "draft_model": "tiny-code-mtp"}
CONFIGS: dict[str, EngineConfig] = {
    "plain": EngineConfig(),
    "eagle-chain": EngineConfig(spec=SpecConfig()),
    "eagle-tree": EngineConfig(spec=SpecConfig(topk=2, num_steps=3, num_draft_tokens=6)),
    "eagle-overlap": EngineConfig(spec=SpecConfig(overlap=True), overlap_thread=False),
    "mtp": EngineConfig(spec=SpecConfig(**MTP)),
    "draft-model": EngineConfig(spec=SpecConfig(algorithm="draft_model",
                                                draft_model="tiny-code-draft")),
    "ngram": EngineConfig(spec=SpecConfig(algorithm="ngram")),
    "ngram-overlap": EngineConfig(spec=SpecConfig(algorithm="ngram", overlap=True),
                                  overlap_thread=False),
}
# The same steps through the graph runner (its staging and key choice, the draft loops and
# EAGLE's extend graph): choosing a key reads lengths the host holds, never the device.
GRAPHED = {f"{name}+graphs": replace(CONFIGS[name], cuda_graph=True, graph_executor="replay")
           for name in ("plain", "eagle-chain", "eagle-tree", "mtp", "ngram")}
CONFIGS.update(GRAPHED)

# Per algorithm: host round-trips in one steady-state decode step of four greedy requests, and
# which reads they are. "accepted": the accepted tokens, once, with the tree's tokens
# (``kernels.dispatch.greedy_verify_lists``). Everything else the host needs (roots, accepted
# lengths, the row table) it already holds: the verify tree and the draft-extend input carry
# host copies, the row table has one.
EXPECTED: dict[str, tuple[int, str]] = {
    "plain": (1, "the sampled tokens, once"),
    "eagle-chain": (1, "accepted"),
    "eagle-tree": (2, "accepted; the tree build's index lists, once (the reference build; on "
                      "a GPU the Triton build, whose orphan check is one read)"),
    "eagle-overlap": (1, "accepted (on the launch side; resolve reads none)"),
    "mtp": (1, "accepted"),
    "draft-model": (2, "accepted; the catch-up state (root tokens and lags, once: the draft's "
                       "first batch is built from the fill tokens they name)"),
    "ngram": (1, "accepted (the lookup is tensor work from host-held roots)"),
    "ngram-overlap": (1, "accepted"),
}
EXPECTED.update({name: EXPECTED[name.removesuffix("+graphs")] for name in GRAPHED})


def step_syncs(config: EngineConfig, warmup: int = 3) -> SyncCounter:
    """Round-trips of decode step ``warmup + 1`` after the prefill, every request decoding."""
    engine = Engine(config)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=64))
    for _ in range(1 + warmup):  # the prefill (one step: the prompts fit its budget), warm-up
        engine.step()
    assert len(engine.scheduler.running) == len(PROMPTS)
    counter = SyncCounter()
    with counter:
        events = engine.step()
    assert not any(isinstance(e, FinishEvent) for e in events), "a request finished"
    return counter


@pytest.mark.parametrize("name", list(CONFIGS))
def test_host_syncs_per_decode_step(name: str) -> None:
    counter = step_syncs(CONFIGS[name])
    assert counter.total == EXPECTED[name][0], "\n".join(
        f"{n:3d}  {where}" for where, n in sorted(counter.calls.items()))


def test_the_row_tables_host_copy_matches_the_table() -> None:
    """The scheduler reads the row table's host copy: it must equal the table after a run that
    allocates, frees, retracts and pages (page size 4)."""
    engine = Engine(EngineConfig(spec=SpecConfig(), page_size=4, retract_every=3))
    engine.generate(PROMPTS, [SamplingParams(max_new_tokens=24)] * len(PROMPTS))
    rows = engine.kv.rows
    assert rows.table.tolist() == [list(row) for row in rows.host]
    assert rows.table.any()

"""The vLLM backend's memory view (conformance/backends/vllm/memory.py, docs/backends/vllm.md,
"Memory view"), shown both ways: a clean vLLM run passes M1-M5 after every step of the suite's
driver, and the same run with one block leaked in vLLM's KV-cache manager (patched in this
process only) fails naming the invariant.

The mapping tests run on stand-ins for vLLM's scheduler and need no vLLM; the engine tests need
vLLM's CPU build in the running interpreter (docs/backends/vllm.md) and skip without it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from conformance.backends.vllm.memory import PoolShape, PreemptionWatch, pool_shape, read_view
from conformance.checks.invariants import InvariantError
from conformance.contract import OpenConfig, ReqKV, Request
from conformance.repro.driver import Driver
from specwire import SamplingParams, SpecConfig

# --- stand-ins for vLLM's scheduler (the attributes memory.py reads) -------------------------


@dataclass
class _Block:
    block_id: int
    is_null: bool = False


@dataclass
class _Req:
    num_computed_tokens: int
    num_tokens: int
    num_preemptions: int = 0


@dataclass
class _Spec:
    block_size: int


@dataclass
class _Group:
    kv_cache_spec: _Spec


@dataclass
class _Config:
    kv_cache_groups: list[_Group]


@dataclass
class _Pool:
    num_gpu_blocks: int
    free: int

    def get_num_free_blocks(self) -> int:
        return self.free


@dataclass
class _Coordinator:
    blocks: dict[str, list[_Block]]

    def get_blocks(self, request_id: str) -> tuple[list[_Block], ...]:
        return (self.blocks.get(request_id) or [],)


@dataclass
class _Manager:
    kv_cache_config: _Config
    block_pool: _Pool
    coordinator: _Coordinator


@dataclass
class _Scheduler:
    kv_cache_manager: _Manager
    requests: dict[str, _Req] = field(default_factory=dict)
    num_spec_tokens: int = 0
    num_lookahead_tokens: int = 0


def _scheduler(blocks: dict[str, list[_Block]], free: int, total: int = 11,
               block_size: int = 32, groups: int = 1, **spec: int) -> _Scheduler:
    manager = _Manager(_Config([_Group(_Spec(block_size))] * groups), _Pool(total, free),
                       _Coordinator(blocks))
    return _Scheduler(manager, **spec)


def test_view_excludes_the_null_block_and_queued_requests():
    """10 usable blocks of 32 (11 less the null block); a decoding request with 2 blocks, a
    prefilling one with 1 (and a null entry, not owned), a queued one with none."""
    sched = _scheduler({"a#x": [_Block(3), _Block(4)], "b#y": [_Block(0, True), _Block(5)]},
                       free=7)
    sched.requests = {"a#x": _Req(40, 41), "b#y": _Req(16, 30), "c#z": _Req(0, 9)}
    view = read_view(sched, {"a": "a#x", "b": "b#y", "c": "c#z"})
    assert (view.capacity, view.free, view.held, view.page_size) == (320, 224, 0, 32)
    assert view.requests == {"a": ReqKV(40, 64, "decode"), "b": ReqKV(16, 32, "prefill")}
    assert view.reserve_bound == 31
    assert (view.rows_capacity, view.rows_free, view.rows_held) == (0, 0, 0)


def test_reserve_bound_adds_the_drafts_and_the_lookahead():
    shape = pool_shape(_scheduler({}, free=10, num_spec_tokens=3, num_lookahead_tokens=3))
    assert shape == PoolShape(block_size=32, usable_blocks=10, reserve_bound=31 + 3 + 3)


def test_more_than_one_kv_cache_group_is_refused():
    with pytest.raises(RuntimeError, match="2 KV-cache groups"):
        pool_shape(_scheduler({}, free=10, groups=2))


def test_preemptions_become_one_retraction_each_and_finished_rids_are_forgotten():
    sched = _scheduler({}, free=10)
    sched.requests = {"a#x": _Req(0, 9), "b#y": _Req(0, 9)}
    watch = PreemptionWatch({})
    live = {"a": "a#x", "b": "b#y"}
    assert watch.retracted(sched, live) == []
    sched.requests["b#y"].num_preemptions = 1
    assert watch.retracted(sched, live) == ["b"]
    assert watch.retracted(sched, live) == []
    sched.requests["a#x"].num_preemptions = 2
    assert watch.retracted(sched, live) == ["a", "a"]
    assert watch.retracted(sched, {"b": "b#y"}) == [] and set(watch.seen) == {"b"}


# --- with vLLM ---------------------------------------------------------------------------------

PLAIN_POOL = 400          # 13 blocks of 32: 416 tokens, far below the model's 2048
EAGLE = SpecConfig(algorithm="eagle", draft_model="tiny-code-eagle", num_steps=3, topk=1,
                   num_draft_tokens=4)


@pytest.fixture
def vllm_backend(tmp_path, monkeypatch):
    """The backend, with vLLM's own cache and config roots in this test's tmp dir (vLLM caches
    its environment after an engine starts; the cache is dropped around the test so it reads
    these)."""
    pytest.importorskip("vllm")
    import vllm.envs

    from conformance.backends.vllm import backend

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.setenv("VLLM_CONFIG_ROOT", str(tmp_path / "vllm-config"))
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "specgate"))
    vllm.envs.disable_envs_cache()
    yield backend()
    vllm.envs.disable_envs_cache()


def _leak_one_block(monkeypatch) -> list[object]:
    """Patch vLLM's ``KVCacheManager.free`` (in this process, for this test) so that the
    first request to finish keeps a reference on its last block: the block is never returned
    to the free pool. Returns the leaked blocks."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    real_free = KVCacheManager.free
    leaked: list[object] = []

    def leaky_free(self, request) -> None:
        if request.is_finished() and not leaked:
            (blocks,) = self.coordinator.get_blocks(request.request_id)
            blocks[-1].ref_cnt += 1
            leaked.append(blocks[-1])
        real_free(self, request)

    monkeypatch.setattr(KVCacheManager, "free", leaky_free)
    return leaked


def _drive(backend, spec: SpecConfig | None) -> Driver:
    """Ten requests of growing length through the suite's driver, in a pool that holds about
    three of them: M1-M3 after every step, M4/M5 once idle."""
    config = OpenConfig(spec=spec, kv_pool_tokens=PLAIN_POOL, page_size=32,
                        max_running_requests=16)
    handle = backend.open(config)
    driver = Driver(handle, backend.capabilities(), config=config)
    try:
        # the pool lowers vLLM's max_model_len to 416: a request that could outgrow it is
        # refused at submit, naming the pool, rather than cut short by length
        with pytest.raises(ValueError, match=r"^kv_pool_tokens: request 'big' needs up to 430"):
            handle.submit(Request("big", (7,) * 30, SamplingParams(max_new_tokens=400)))
        rng = random.Random(1)
        for i in range(10):
            driver.submit(f"r{i}", [rng.randrange(5, 500) for _ in range(10 + 9 * i)],
                          SamplingParams(max_new_tokens=40 + 4 * i, ignore_eos=True))
        driver.run(max_steps=2_000)
    finally:
        handle.close()
    return driver


@pytest.mark.parametrize("leak", [False, True], ids=["clean", "one-block-leaked"])
def test_memory_view_under_pressure_clean_and_with_a_leaked_block(vllm_backend, monkeypatch,
                                                                  leak):
    leaked = _leak_one_block(monkeypatch) if leak else []
    if leak:
        with pytest.raises(InvariantError, match=r"M1 conservation: free \d+ \+ held 0 \+ "
                                                 r"owned \d+ != capacity 416") as err:
            _drive(vllm_backend, None)
        assert len(leaked) == 1, err.value
        return
    driver = _drive(vllm_backend, None)
    assert driver.retractions > 0   # vLLM preempted (recompute): each one a RetractEvent
    assert all(o.reason == "length" and len(o.output_ids) == 40 + 4 * int(rid[1:])
               for rid, o in driver.outcomes.items())
    view = driver.view
    assert view is not None and view.free == view.capacity == 416 and not view.requests


def test_memory_view_under_eagle_stays_within_its_reserve_bound(vllm_backend):
    """EAGLE (3 drafts): blocks run ahead of the computed positions by up to a block less one,
    plus the drafts and the drafter's lookahead, and no further (M2 after every step)."""
    driver = _drive(vllm_backend, EAGLE)
    assert driver.view is not None and driver.view.reserve_bound == 31 + 3 + 3
    assert driver.retractions > 0
    assert all(o.reason == "length" for o in driver.outcomes.values())

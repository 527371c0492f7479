"""The runner's request lifecycle, told to every KVarN side pool of this worker.

Model Runner V2 calls ``observe_step`` once per real step, after it has applied the
scheduler's output (the kvarn-lifecycle topic's hook), so each pool learns which slots
were released (finished or preempted requests) and which requests were admitted (with
the cache block of their logical block 0 and their prefix-hit length) before its
builder plans the step. Dummy runs (profiling, warm-up, CUDA-graph capture) are never
observed, which is how a builder tells them from real steps.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.kvarn.sidepool import SidePool

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass
class _Registered:
    pool: weakref.ref[SidePool]  # a discarded builder's pool leaves by itself
    layer_name: str
    manager_block_size: int
    group_index: int | None = None  # found in the runner's KV cache config on first use


_pools: list[_Registered] = []
_slot_of: dict[str, int] = {}
_step = 0


def register(pool: SidePool, layer_names: list[str], manager_block_size: int) -> None:
    """A builder's side pool joins; its KV-cache group is the one holding its layers."""
    _pools.append(_Registered(weakref.ref(pool), layer_names[0], manager_block_size))


def current_step() -> int:
    """How many real steps the runner has announced."""
    return _step


def observe_step(scheduler_output: SchedulerOutput, req_id_to_index: Mapping[str, int],
                 kv_cache_config: KVCacheConfig) -> None:
    global _step
    _step += 1
    _pools[:] = [entry for entry in _pools if entry.pool() is not None]
    if not _pools:
        return
    for entry in _pools:
        if entry.group_index is None:
            entry.group_index = _group_of(entry.layer_name, kv_cache_config)
    for req_id in (scheduler_output.finished_req_ids
                   | (scheduler_output.preempted_req_ids or set())):
        _release(req_id)
    for new in scheduler_output.scheduled_new_reqs:
        _release(new.req_id)  # a streamed prompt update re-adds a live request
        slot = req_id_to_index[new.req_id]
        _slot_of[new.req_id] = slot
        for entry in _pools:
            pool = entry.pool()
            blocks = new.block_ids[entry.group_index]
            ratio = entry.manager_block_size // pool.group
            pool.admit(slot, blocks[0] * ratio, new.num_computed_tokens)


def _release(req_id: str) -> None:
    slot = _slot_of.pop(req_id, None)
    if slot is not None:
        for entry in _pools:
            entry.pool().release(slot)


def _group_of(layer_name: str, kv_cache_config: KVCacheConfig) -> int:
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if layer_name in group.layer_names:
            return index
    raise RuntimeError(f"KVarN: layer {layer_name} is in no KV cache group")

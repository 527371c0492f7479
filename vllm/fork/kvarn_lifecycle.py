"""The runner's request lifecycle, told to the KVarN side pools of this worker.

Each KVarN metadata builder owns a ``SidePoolLifecycle`` for its side pool. Model Runner
V2 calls ``observe_step`` once per real step, after it has applied the scheduler's output
(the kvarn-lifecycle topic's hook), and every live lifecycle learns which slots were
released (finished or preempted requests) and which requests were admitted (with the
cache block of their logical block 0, in its layer's KV-cache group, and their
prefix-hit length) before its builder plans the step. Dummy runs (profiling, warm-up,
CUDA-graph capture) are never observed: a builder tells them from real steps by its
lifecycle's step count.

The hook passes nothing that leads to the builders, so lifecycles are found through a
set of weak references (a discarded builder's leaves by itself); all state is on them.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllm.kvarn.sidepool import SidePool

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig


class SidePoolLifecycle:
    """What one side pool learns of the request lifecycle: admissions and releases by
    request slot, and how many real steps were announced."""

    def __init__(self, pool: SidePool, layer_names: list[str], manager_block_size: int):
        self.pool = pool
        self.layer_name = layer_names[0]  # its KV-cache group is the one holding its layers
        self.manager_block_size = manager_block_size
        self.group_index: int | None = None  # found in the runner's KV cache config
        self.slot_of: dict[str, int] = {}
        self.steps = 0
        _LIVE.add(self)

    def observe(self, scheduler_output: SchedulerOutput, req_id_to_index: Mapping[str, int],
                kv_cache_config: KVCacheConfig) -> None:
        """One real step of the runner: releases first, then admissions."""
        self.steps += 1
        if self.group_index is None:
            self.group_index = _group_of(self.layer_name, kv_cache_config)
        for req_id in (scheduler_output.finished_req_ids
                       | (scheduler_output.preempted_req_ids or set())):
            self._release(req_id)
        ratio = self.manager_block_size // self.pool.group
        for new in scheduler_output.scheduled_new_reqs:
            self._release(new.req_id)  # a streamed prompt update re-adds a live request
            slot = req_id_to_index[new.req_id]
            self.slot_of[new.req_id] = slot
            blocks = new.block_ids[self.group_index]
            self.pool.admit(slot, blocks[0] * ratio, new.num_computed_tokens)

    def _release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.pool.release(slot)


_LIVE: weakref.WeakSet[SidePoolLifecycle] = weakref.WeakSet()


def observe_step(scheduler_output: SchedulerOutput, req_id_to_index: Mapping[str, int],
                 kv_cache_config: KVCacheConfig) -> None:
    """The runner's hook (signature fixed by the kvarn-lifecycle topic)."""
    for lifecycle in list(_LIVE):
        lifecycle.observe(scheduler_output, req_id_to_index, kv_cache_config)


def _group_of(layer_name: str, kv_cache_config: KVCacheConfig) -> int:
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if layer_name in group.layer_names:
            return index
    raise RuntimeError(f"KVarN: layer {layer_name} is in no KV cache group")

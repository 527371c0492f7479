"""The runner's request lifecycle, told to the KVarN side pools of this worker.

Each KVarN metadata builder owns a ``SidePoolLifecycle`` for its side pool. Model Runner
V2 calls ``observe_step`` once per real step, after it has applied the scheduler's output
(the kvarn-lifecycle topic's hook), and every live lifecycle learns which slots were
released (finished or preempted requests) and which requests were admitted (with the
cache block of their logical block 0, in its layer's KV-cache group, and their
prefix-hit length) before its builder plans the step. Dummy runs (profiling, warm-up,
CUDA-graph capture) are never observed: a builder tells them from real steps by its
lifecycle's step count.

The hook passes the runner's attention groups, whose metadata builders own the
lifecycles, so no module state is needed: a discarded builder's lifecycle goes with it.
A speculator's own attention groups are not passed: KVarN takes only the draft-free
speculative methods (vllm/fork/kvarn_config.py), so no drafter layer has a side pool.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from vllm.kvarn.sidepool import SidePool

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.utils import AttentionGroup


class SidePoolLifecycle:
    """What one side pool learns of the request lifecycle: admissions and releases by
    request slot, and how many real steps were announced."""

    def __init__(self, pool: SidePool, manager_block_size: int):
        self.pool = pool
        self.manager_block_size = manager_block_size
        self.slot_of: dict[str, int] = {}
        self.steps = 0

    def observe(self, scheduler_output: SchedulerOutput, req_id_to_index: Mapping[str, int],
                group_index: int) -> None:
        """One real step of the runner: releases first, then admissions. ``group_index``
        is the KV-cache group of the pool's layers (its blocks are in the requests'
        ``block_ids[group_index]``)."""
        self.steps += 1
        for req_id in (scheduler_output.finished_req_ids
                       | (scheduler_output.preempted_req_ids or set())):
            self._release(req_id)
        ratio = self.manager_block_size // self.pool.group
        for new in scheduler_output.scheduled_new_reqs:
            self._release(new.req_id)  # a streamed prompt update re-adds a live request
            slot = req_id_to_index[new.req_id]
            self.slot_of[new.req_id] = slot
            blocks = new.block_ids[group_index]
            self.pool.admit(slot, blocks[0] * ratio, new.num_computed_tokens)

    def _release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.pool.release(slot)


def observe_step(scheduler_output: SchedulerOutput, req_id_to_index: Mapping[str, int],
                 attn_groups: Iterable[Iterable[AttentionGroup]]) -> None:
    """The runner's hook (signature fixed by the kvarn-lifecycle topic): every side-pool
    lifecycle among the builders of the runner's attention groups observes the step."""
    for groups in attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                lifecycle = getattr(builder, "lifecycle", None)  # KVarN's builders only
                if isinstance(lifecycle, SidePoolLifecycle):
                    lifecycle.observe(scheduler_output, req_id_to_index,
                                      group.kv_cache_group_id)

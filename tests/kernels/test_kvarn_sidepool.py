"""The KVarN side pool's host bookkeeping, one lifecycle event at a time and in long
randomized runs of a simulated engine (sidepool_sim) that checks every read."""
from __future__ import annotations

import pytest
from sidepool_sim import Sim, SimConfig

from kvarn.sidepool import SidePool, SidePoolExhausted, cdiv, required_side_blocks

G = 4


def _pool(seats: int = 2, budget: int = 8) -> SidePool:
    return SidePool(required_side_blocks(seats, budget, G), G)


def test_fresh_prefill_then_decode():
    pool = _pool()
    pool.admit(slot=0, sink_block=7, num_computed=0)
    pool.begin_step()
    plan = pool.plan_row(0, seq_len=10, query_len=10)  # blocks 0, 1 full; 2 partial
    assert plan.tail_start == 1 and plan.hit_end == 0 and plan.restore is None
    assert len(plan.side_blocks) == 3 and len(set(plan.side_blocks)) == 3
    assert [i for _, i in plan.flush] == [0, 1]  # block 0 is recorded too
    pool.begin_step()  # block 1 became final in that step: its side block comes back
    assert pool.held_by(0) == 2
    plan = pool.plan_row(0, seq_len=11, query_len=1)
    assert plan.tail_start == 2 and len(plan.side_blocks) == 2
    assert plan.flush == ()


def test_finish_releases_tail_and_keeps_a_full_sink_idle():
    pool = _pool()
    total = pool.num_free
    pool.admit(0, sink_block=3, num_computed=0)
    pool.begin_step()
    pool.plan_row(0, seq_len=6, query_len=6)
    pool.release(0)
    assert pool.num_free == total - 1 and pool.num_idle_sinks == 1
    pool.admit(1, sink_block=9, num_computed=0)
    pool.begin_step()
    pool.plan_row(1, seq_len=2, query_len=2)  # a partial sink is never hit: freed
    pool.release(1)
    assert pool.num_free == total - 1


def test_prefix_hit_adopts_a_live_or_idle_sink():
    pool = _pool()
    pool.admit(0, sink_block=5, num_computed=0)
    pool.begin_step()
    first = pool.plan_row(0, seq_len=8, query_len=8)
    pool.admit(1, sink_block=5, num_computed=4)  # hit on block 0 while 0 runs
    pool.begin_step()
    hit = pool.plan_row(1, seq_len=8, query_len=4)
    assert hit.side_blocks[0] == first.side_blocks[0] and hit.restore is None
    assert hit.hit_end == 4 and hit.tail_start == 1
    pool.release(0)
    pool.release(1)
    assert pool.num_idle_sinks == 1
    pool.admit(2, sink_block=5, num_computed=8)
    pool.begin_step()
    again = pool.plan_row(2, seq_len=9, query_len=1)
    assert again.side_blocks[0] == first.side_blocks[0] and again.restore is None
    assert again.tail_start == 2  # blocks 1 is a hit record


def test_hit_on_an_evicted_sink_restores_it_from_its_record():
    pool = SidePool(3, G)
    pool.admit(0, sink_block=5, num_computed=0)
    pool.begin_step()
    pool.plan_row(0, seq_len=4, query_len=4)
    pool.release(0)
    pool.admit(1, sink_block=6, num_computed=0)  # needs all 3 blocks: evicts sink 5
    pool.begin_step()
    pool.plan_row(1, seq_len=12, query_len=12)
    assert pool.num_idle_sinks == 0
    pool.release(1)
    pool.admit(2, sink_block=5, num_computed=4)
    pool.begin_step()
    plan = pool.plan_row(2, seq_len=5, query_len=1)
    assert plan.restore == plan.side_blocks[0]


def test_fresh_sink_on_a_reallocated_page_drops_the_idle_one():
    pool = _pool()
    pool.admit(0, sink_block=5, num_computed=0)
    pool.begin_step()
    old = pool.plan_row(0, seq_len=4, query_len=4).side_blocks[0]
    pool.release(0)
    pool.admit(1, sink_block=5, num_computed=0)  # page 5 now holds other tokens
    pool.begin_step()
    pool.plan_row(1, seq_len=4, query_len=4)
    pool.release(1)
    pool.admit(2, sink_block=5, num_computed=4)
    pool.begin_step()
    plan = pool.plan_row(2, seq_len=5, query_len=1)
    assert plan.restore is None and pool.num_idle_sinks == 0
    assert old not in plan.side_blocks or plan.side_blocks[0] == old  # reused, not duplicated


def test_unscheduled_request_gives_back_final_blocks():
    pool = _pool(budget=16)
    pool.admit(0, sink_block=1, num_computed=0)
    pool.begin_step()
    pool.plan_row(0, seq_len=14, query_len=14)
    assert pool.held_by(0) == 4
    pool.begin_step()  # not scheduled this step
    assert pool.held_by(0) == 2  # sink + the partial block 3


def test_speculative_rows_keep_draft_blocks_until_committed():
    pool = _pool()
    pool.admit(0, sink_block=1, num_computed=0)
    pool.begin_step()
    pool.plan_row(0, seq_len=6, query_len=6)
    pool.begin_step()
    # Decode at position 6 with drafts at 7, 8, 9: a draft fills block 1.
    plan = pool.plan_row(0, seq_len=10, query_len=4, spec_decode=True)
    assert (plan.side_blocks[1], 1) in plan.flush
    pool.begin_step()
    assert pool.held_by(0) == 3  # block 1 may still be rewritten
    # One draft accepted: 8 committed, so block 1's last record is final.
    plan = pool.plan_row(0, seq_len=12, query_len=4, spec_decode=True)
    assert plan.tail_start == 2 and pool.held_by(0) == 2


def test_slack_keeps_blocks_the_host_cannot_prove_final():
    pool = _pool()
    pool.admit(0, sink_block=1, num_computed=0)
    pool.begin_step()
    pool.plan_row(0, seq_len=6, query_len=6)
    pool.begin_step()
    first = pool.plan_row(0, seq_len=10, query_len=4, spec_decode=True)
    pool.begin_step()
    # The host assumes all 3 drafts were accepted; with slack 3, as few as 7 tokens
    # may be committed, so block 1 keeps its side rows.
    plan = pool.plan_row(0, seq_len=14, query_len=4, slack=3, spec_decode=True)
    assert plan.tail_start == 1 and plan.side_blocks[1] == first.side_blocks[1]


def test_unknown_slot_and_exhaustion_are_named():
    pool = SidePool(2, G)
    with pytest.raises(KeyError, match="slot 3"):
        pool.plan_row(3, 4, 4)
    pool.admit(0, sink_block=1, num_computed=0)
    pool.begin_step()
    with pytest.raises(SidePoolExhausted, match="all 2 side blocks"):
        pool.plan_row(0, seq_len=12, query_len=12)


def test_required_blocks_formula():
    assert required_side_blocks(4, 512, 128) == 4 * 3 + 4
    assert required_side_blocks(4, 512, 128, spec_tokens=3, slack=3) == 4 * 4 + 4
    assert cdiv(129, 128) == 2


@pytest.mark.parametrize("cfg", [
    SimConfig(seed=1),
    SimConfig(seed=2, budget=6, prompts=(10, 40)),  # chunked prefill over records
    SimConfig(seed=3, spec_tokens=3, accept=0.6),
    SimConfig(seed=4, preempt=0.03, num_blocks=24),
    SimConfig(seed=5, other_group=0.3, num_blocks=20, prompts=(1, 16)),
    SimConfig(seed=6, spec_tokens=2, preempt=0.02, other_group=0.2, num_blocks=28,
              budget=10),
], ids=["plain", "chunked", "spec", "preempt", "recycled", "all"])
def test_simulated_engine_reads_exact_tokens(cfg):
    sim = Sim(cfg)
    sim.run(1500)
    sim.drain()
    assert sim.finished >= 20 * cfg.seats
    assert sim.reads > 1000
    # Every request is gone: only idle sinks may still hold side blocks.
    assert sim.pool.num_free + sim.pool.num_idle_sinks == sim.pool_blocks


def test_simulation_reaches_every_lifecycle_event():
    # KV pages outlive idle sinks here, so some hits find their sink evicted.
    cfg = SimConfig(seed=7, spec_tokens=2, preempt=0.02, other_group=0.3, num_blocks=200,
                    budget=8, prompts=(4, 30), vocab=3)
    sim = Sim(cfg)
    sim.run(3000)
    sim.drain()
    assert sim.hits > 50, "prefix hits"
    assert sim.sink_restores > 0, "a hit on an evicted sink"
    assert sim.preempted > 10
    assert sim.blocks.evictions > 50, "cached pages recycled"


def test_simulation_catches_a_leak():
    """The check is real: a pool that forgets finished requests without giving their
    side blocks back (the bug the GPU run showed) runs out."""
    sim = Sim(SimConfig(seed=8))
    sim.pool.release = lambda slot: sim.pool._requests.pop(slot, None)
    with pytest.raises(SidePoolExhausted):
        sim.run(1500)
        sim.drain()

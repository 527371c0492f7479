"""A small engine that drives kvarn.sidepool the way vLLM's scheduler and runner do,
and checks every read against the truth.

Memory holds token ids instead of K/V: a side block is G cells, a record is the G
cells a flush copied out of a side block. Each step the simulated device restores
hit sinks, stages the step's tokens, checks that every query token reads exactly the
tokens before it (sink and tail from the side pool, blocks 1..F from records), then
flushes the blocks the device finds full. The block allocator follows vLLM's: full
blocks are cached by their token prefix, freed blocks stay cached until evicted
(oldest first), and hits are whole blocks below the prompt's last token. A second
KV group shares the block pool and scribbles over the pages it gets, as a Mamba
group's state writes would.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from kvarn.sidepool import SidePool, required_side_blocks

SCRIBBLE = -1  # what another KV group leaves in a page


@dataclass
class Req:
    rid: int
    prompt: list[int]
    max_out: int
    slot: int = -1
    tokens: list[int] = field(default_factory=list)  # committed tokens
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV rows are written and committed
    drafts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)


class BlockPool:
    """vLLM's allocator in miniature: free blocks stay prefix-cached until evicted."""

    def __init__(self, num_blocks: int, group: int) -> None:
        self.g = group
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, tuple] = {}
        self.cached: dict[tuple, int] = {}
        self.evictions = 0

    def allocate(self) -> int | None:
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        key = self.hash_of.pop(block, None)
        if key is not None:
            del self.cached[key]
            self.evictions += 1
        self.refs[block] = 1
        return block

    def touch(self, block: int) -> None:
        self.free.pop(block, None)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None

    def cache(self, block: int, key: tuple) -> None:
        if block not in self.hash_of and key not in self.cached:
            self.hash_of[block] = key
            self.cached[key] = block


@dataclass
class SimConfig:
    seats: int = 4
    group: int = 4
    num_blocks: int = 64
    budget: int = 24  # tokens per step
    spec_tokens: int = 0
    accept: float = 0.7
    preempt: float = 0.0
    other_group: float = 0.0  # chance per step that the other group takes a block
    prompts: tuple[int, int] = (1, 40)
    outputs: tuple[int, int] = (1, 20)
    vocab: int = 5  # few tokens: prompts share prefixes, so hits are common
    seed: int = 0


class Sim:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        g = cfg.group
        self.pool_blocks = required_side_blocks(cfg.seats, cfg.budget, g, cfg.spec_tokens)
        self.pool = SidePool(self.pool_blocks, g)
        self.blocks = BlockPool(cfg.num_blocks, g)
        self.side: list[list[int | None]] = [[None] * g for _ in range(self.pool_blocks)]
        self.records: dict[int, tuple] = {}
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.free_slots = list(range(cfg.seats - 1, -1, -1))
        self.other: list[int] = []  # blocks the other KV group holds
        self.finished = 0
        self.preempted = 0
        self.hits = 0
        self.sink_restores = 0
        self.reads = 0
        self.next_rid = 0

    def add(self, prompt: list[int], max_out: int) -> Req:
        req = Req(self.next_rid, prompt, max_out)
        self.next_rid += 1
        self.waiting.append(req)
        return req

    def add_random(self) -> None:
        lo, hi = self.cfg.prompts
        prompt = [self.rng.randrange(self.cfg.vocab) for _ in range(self.rng.randint(lo, hi))]
        self.add(prompt, self.rng.randint(*self.cfg.outputs))

    # -- scheduler -------------------------------------------------------------------

    def _grow(self, req: Req, upto: int) -> bool:
        while len(req.blocks) * self.cfg.group < upto:
            block = self.blocks.allocate()
            if block is None:
                return False
            req.blocks.append(block)
        return True

    def _free_req(self, req: Req) -> None:
        for block in req.blocks:
            self.blocks.release(block)
        req.blocks = []
        self.pool.release(req.slot)
        self.free_slots.append(req.slot)
        req.slot = -1

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._free_req(req)
        req.computed = 0
        req.drafts = []
        self.waiting.insert(0, req)
        self.preempted += 1

    def _admit(self, req: Req) -> bool:
        g = self.cfg.group
        n = len(req.tokens)
        hit = 0
        hit_blocks = []
        for i in range((n - 1) // g):
            block = self.blocks.cached.get(tuple(req.tokens[: (i + 1) * g]))
            if block is None:
                break
            hit_blocks.append(block)
            hit = (i + 1) * g
        for block in hit_blocks:
            self.blocks.touch(block)
        req.blocks = hit_blocks
        if not self._grow(req, hit + 1):
            for block in req.blocks:
                self.blocks.release(block)
            req.blocks = []
            return False
        req.computed = hit
        req.slot = self.free_slots.pop()
        self.pool.admit(req.slot, req.blocks[0], hit)
        self.hits += bool(hit)
        return True

    def _other_group(self) -> None:
        if self.rng.random() < self.cfg.other_group:
            block = self.blocks.allocate()
            if block is not None:
                self.records[block] = (SCRIBBLE,) * self.cfg.group
                self.side_scribble_check(block)
                self.other.append(block)
        if self.other and self.rng.random() < self.cfg.other_group:
            self.blocks.release(self.other.pop(self.rng.randrange(len(self.other))))

    def side_scribble_check(self, block: int) -> None:
        """Nothing running may still use a page the other group took."""
        for req in self.running:
            assert block not in req.blocks

    def schedule(self) -> list[tuple[Req, int, list[int]]]:
        """[(request, query tokens, drafts)] in batch order, like vLLM's scheduler."""
        cfg = self.cfg
        budget = cfg.budget
        batch = []
        for req in list(self.running):
            if budget <= 0:
                break  # a running request left unscheduled this step
            if self.rng.random() < cfg.preempt:
                self._preempt(req)
                continue
            n_new = len(req.tokens) - req.computed
            drafts = []
            if n_new == 1 and cfg.spec_tokens:
                drafts = [self.rng.randrange(cfg.vocab) for _ in range(cfg.spec_tokens)]
            q = min(n_new + len(drafts), budget)
            drafts = drafts[: max(0, q - n_new)]
            if not self._grow(req, req.computed + q):
                self._preempt(req)
                continue
            batch.append((req, q, drafts))
            budget -= q
        while self.waiting and self.free_slots and budget > 0:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.pop(0)
            q = min(len(req.tokens) - req.computed, budget)
            if not self._grow(req, req.computed + q):
                self._preempt_new(req)
                break
            self.running.append(req)
            batch.append((req, q, []))
            budget -= q
        # Decodes first, as KVarN's reorder threshold sorts them.
        batch.sort(key=lambda item: item[1] > 1 + cfg.spec_tokens)
        return batch

    def _preempt_new(self, req: Req) -> None:
        self._free_req(req)
        req.computed = 0
        self.waiting.insert(0, req)

    # -- one engine step ------------------------------------------------------------

    def step(self) -> None:
        self._other_group()
        batch = self.schedule()
        self.pool.begin_step()
        plans = []
        for req, q, drafts in batch:
            seq_len = req.computed + q
            plans.append(self.pool.plan_row(req.slot, seq_len, q,
                                            spec_decode=bool(drafts)))
        for (req, q, drafts), plan in zip(batch, plans):
            self._device_row(req, q, drafts, plan)
        for (req, q, _), plan in zip(batch, plans):
            self._flush_row(req, q, plan)
        for req, q, drafts in batch:
            self._commit(req, q, drafts)

    def _row_tokens(self, req: Req, q: int, drafts: list[int]) -> list[int]:
        seq = req.tokens[: req.computed + q - len(drafts)] + drafts
        return seq[: req.computed + q]

    def _device_row(self, req: Req, q: int, drafts: list[int], plan) -> None:
        g = self.cfg.group
        seq = self._row_tokens(req, q, drafts)
        if plan.restore is not None:
            rec = self.records.get(req.blocks[0])
            assert rec is not None and SCRIBBLE not in rec, "restore from a missing record"
            self.side[plan.restore] = list(rec)
            self.sink_restores += 1
        c = req.computed
        for p in range(c, c + q):
            if p < plan.hit_end:
                continue
            i = p // g
            side = plan.side_blocks[0] if i == 0 else plan.side_blocks[1 + i - plan.tail_start]
            self.side[side][p % g] = seq[p]
        # Every query token reads positions 0..p exactly as the kernels do.
        F = plan.tail_start - 1
        length = c + q
        for p in range(c, c + q):
            for j in range(p + 1):
                i = j // g
                if i == 0:
                    got = self.side[plan.side_blocks[0]][j % g]
                elif i <= F:
                    got = self.records.get(req.blocks[i], (None,) * g)[j % g]
                else:
                    got = self.side[plan.side_blocks[1 + i - plan.tail_start]][j % g]
                assert got == seq[j], (
                    f"request {req.rid} slot {req.slot}: query position {p} read {got} at "
                    f"position {j} (logical block {i}, F={F}), expected {seq[j]}")
            self.reads += 1
        assert len(plan.side_blocks) >= -(-length // g) - F

    def _flush_row(self, req: Req, q: int, plan) -> None:
        g = self.cfg.group
        c = req.computed
        length = c + q
        for side, i in plan.flush:
            # The device's own check: full, and given new rows this step.
            if (i + 1) * g <= length and (i + 1) * g > max(c, plan.hit_end):
                assert None not in self.side[side]
                self.records[req.blocks[i]] = tuple(self.side[side])

    def _commit(self, req: Req, q: int, drafts: list[int]) -> None:
        g = self.cfg.group
        n_real = q - len(drafts)
        computed = req.computed + n_real
        if len(req.tokens) == computed:  # a sampled token, then accepted drafts
            sampled = self.rng.randrange(self.cfg.vocab)
            accepted = 0
            for _ in drafts:
                if self.rng.random() > self.cfg.accept:
                    break
                accepted += 1
            # Accepted drafts' rows are valid: they become committed tokens.
            req.tokens.extend(drafts[:accepted])
            computed += accepted
            req.tokens.append(sampled)
        req.computed = computed
        for i in range(req.computed // g):
            self.blocks.cache(req.blocks[i], tuple(req.tokens[: (i + 1) * g]))
        if len(req.tokens) - len(req.prompt) >= req.max_out:
            self.running.remove(req)
            self._free_req(req)
            self.finished += 1

    def run(self, steps: int, arrivals: float = 0.5) -> None:
        for _ in range(steps):
            if self.rng.random() < arrivals or not (self.waiting or self.running):
                self.add_random()
            self.step()

    def drain(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not (self.waiting or self.running):
                return
            self.step()
        raise AssertionError("the simulation did not drain")

"""Host bookkeeping of the KVarN side pool: which fp16 side block holds which rows.

Plain Python, no tensors: the serving backend turns a step's ``RowPlan``s into the
tables the kernels read. One ``SidePool`` serves one KV-cache group (its layers' side
pools are indexed alike).

Requests are known by their slot in the runner's request table. The runner reports
``admit`` (a request enters a slot: the cache block of its logical block 0 and the
tokens it starts with computed, i.e. its prefix-cache hit) and ``release`` (finish or
preemption). Each step, ``plan_row`` is called once per scheduled row.

The rules that keep every row readable and the pool bounded:

* Every block that is full after a step is flushed to a record at the end of that
  step, block 0 included, drafts included (the device skips a block whose exact
  length says it is not full). A block whose rows may still change (speculative
  tokens) keeps its side rows until its tokens are committed, and is flushed again
  whenever it is full after a step, so its last record always holds its last rows.
* Blocks that are full and committed after a step ("final") give their side block
  back at the start of the next ``begin_step``, scheduled or not.
* Block 0, the attention sink, stays fp16 for the request's life. Sinks are shared
  by cache block id: a prefix hit adopts the sink rows another request wrote; an idle
  sink stays cached until its side block is needed (oldest first), and a hit on an
  evicted sink restores its rows from the sink's record.
* Host lengths may overstate a row by ``slack`` tokens (drafts assumed accepted under
  asynchronous speculative decoding), so every decision uses lower bounds and the
  device checks exact lengths itself.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def required_side_blocks(seats: int, tokens_per_step: int, group: int,
                         spec_tokens: int = 0, slack: int = 0) -> int:
    """Side blocks that always suffice: per running request its sink, its partial
    block, the blocks its drafts and the host's slack can reach, and one block where a
    chunk straddles a boundary; plus the blocks one step's new tokens fill."""
    per_seat = 3 + cdiv(spec_tokens + slack, group)
    return seats * per_seat + cdiv(tokens_per_step, group)


class SidePoolExhausted(RuntimeError):
    """More side blocks are live than the pool holds (the sizing rule was broken)."""


@dataclass(frozen=True)
class RowPlan:
    """What the kernels need for one scheduled row this step."""

    side_blocks: tuple[int, ...]  # the sink's side block, then tail blocks from tail_start
    tail_start: int  # first logical block read from the side pool (>= 1); 1..tail_start-1 are records
    hit_end: int  # positions below it are held by prefix-hit records: never staged
    flush: tuple[tuple[int, int], ...]  # (side block, logical block) that may be full after this step
    restore: int | None  # side block to fill from the sink's record before the step


@dataclass
class _Sink:
    side: int
    refs: int
    full: bool = False  # all G rows written at least once: a later hit may adopt it


@dataclass
class _Request:
    sink_block: int
    hit_end: int
    tail_start: int
    tail: dict[int, int] = field(default_factory=dict)  # logical block -> side block
    sink: _Sink | None = None
    final_after_step: int = 0  # blocks below it are final once this step has run


class SidePool:
    def __init__(self, num_blocks: int, group: int) -> None:
        self.num_blocks = num_blocks
        self.group = group
        self._free = list(range(num_blocks - 1, -1, -1))
        self._requests: dict[int, _Request] = {}
        self._sinks: OrderedDict[int, _Sink] = OrderedDict()  # idle ones oldest first

    # -- lifecycle ------------------------------------------------------------------

    def admit(self, slot: int, sink_block: int, num_computed: int) -> None:
        """A request enters ``slot``; its logical block 0 is cache block ``sink_block``
        and its first ``num_computed`` tokens come from prefix-cache hits (whole
        blocks; the last one may be recomputed, hence the rounding up)."""
        if slot in self._requests:
            self.release(slot)
        g = self.group
        hit_end = cdiv(num_computed, g) * g
        self._requests[slot] = _Request(sink_block, hit_end, max(1, hit_end // g))

    def release(self, slot: int) -> None:
        """The request in ``slot`` finished or was preempted."""
        req = self._requests.pop(slot, None)
        if req is None:
            return
        self._free.extend(req.tail.values())
        sink = req.sink
        if sink is None:
            return
        sink.refs -= 1
        if sink.refs > 0:
            return
        if sink.full:
            self._sinks.move_to_end(req.sink_block)  # idle, newest last
        else:
            del self._sinks[req.sink_block]
            self._free.append(sink.side)

    def begin_step(self) -> None:
        """Give back the side blocks of blocks that became final in the last step."""
        for req in self._requests.values():
            final = req.final_after_step
            if final > req.tail_start:
                for logical in range(req.tail_start, final):
                    side = req.tail.pop(logical, None)
                    if side is not None:
                        self._free.append(side)
                req.tail_start = final

    # -- one scheduled row ------------------------------------------------------------

    def plan_row(self, slot: int, seq_len: int, query_len: int, slack: int = 0,
                 spec_decode: bool = False) -> RowPlan:
        """Plan one row: ``seq_len`` (an upper bound, over by at most ``slack``) counts
        this step's ``query_len`` tokens; ``spec_decode``: tokens after the row's first
        are drafts that may be rejected."""
        req = self._requests.get(slot)
        if req is None:
            raise KeyError(f"KVarN: slot {slot} was scheduled but never admitted")
        g = self.group
        committed_low = max(0, seq_len - query_len - slack)
        restore = self._plan_sink(req, committed_low) if req.sink is None else None
        sink = req.sink
        assert sink is not None
        req.tail_start = max(req.tail_start, committed_low // g)
        for logical in [i for i in req.tail if i < req.tail_start]:
            self._free.append(req.tail.pop(logical))
        last = (seq_len - 1) // g
        tail = []
        for logical in range(req.tail_start, last + 1):
            side = req.tail.get(logical)
            if side is None:
                if logical * g < committed_low:
                    raise RuntimeError(
                        f"KVarN: slot {slot} has committed rows in logical block {logical} "
                        f"(committed >= {committed_low}) that no side block holds")
                side = req.tail[logical] = self._allocate()
            tail.append(side)
        if seq_len >= g:
            sink.full = True
        # Blocks this step may fill: from the block holding the first new row on.
        first_new = max(committed_low, req.hit_end) // g
        full = range(max(first_new, req.tail_start), seq_len // g)
        flush = ((sink.side, 0),) if first_new == 0 and seq_len >= g else ()
        flush += tuple((req.tail[i], i) for i in full)
        committed_after = committed_low + (1 if spec_decode else query_len)
        req.final_after_step = max(req.final_after_step, committed_after // g)
        return RowPlan((sink.side, *tail), req.tail_start, req.hit_end, flush, restore)

    def _plan_sink(self, req: _Request, committed_low: int) -> int | None:
        """Give a request its sink on its first step; return a side block to restore
        from the sink's record when a prefix hit finds the sink evicted."""
        hit = req.hit_end > 0
        cached = self._sinks.get(req.sink_block)
        if cached is not None and (hit or cached.refs == 0):
            if hit:
                cached.refs += 1
                self._sinks.move_to_end(req.sink_block)
                req.sink = cached
                return None
            # A fresh block 0 on a cache block whose old sink is idle: the page was
            # reallocated, so those rows are someone else's.
            del self._sinks[req.sink_block]
            self._free.append(cached.side)
        elif cached is not None:
            raise RuntimeError(
                f"KVarN: cache block {req.sink_block} is computed afresh as a sink while "
                f"{cached.refs} running request(s) read it")
        sink = _Sink(self._allocate(), refs=1, full=hit)
        self._sinks[req.sink_block] = sink
        req.sink = sink
        return sink.side if hit else None

    # -- allocation -----------------------------------------------------------------

    def _allocate(self) -> int:
        if not self._free:
            self._evict_idle_sink()
        return self._free.pop()

    def _evict_idle_sink(self) -> None:
        for block, sink in self._sinks.items():
            if sink.refs == 0:
                del self._sinks[block]
                self._free.append(sink.side)
                return
        raise SidePoolExhausted(
            f"KVarN: all {self.num_blocks} side blocks are held by running requests "
            f"({len(self._requests)} admitted); the pool was sized too small")

    # -- introspection (tests, logs) -------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_idle_sinks(self) -> int:
        return sum(1 for s in self._sinks.values() if s.refs == 0)

    def held_by(self, slot: int) -> int:
        """Side blocks the request in ``slot`` holds (its sink counted once)."""
        req = self._requests[slot]
        return len(req.tail) + (req.sink is not None)

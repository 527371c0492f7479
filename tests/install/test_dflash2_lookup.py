"""The DFlash2 verify block's history logic (vllm/fork/spec_lookup.py) on CPU.

Each function is checked against a small reference written here from its definition
(plain Python loops, the chain fed back token by token), on random histories with
planted repeats, and the adaptive length through every lifecycle event. The copy
model (kiln tiny-model --copy) then runs in transformers and the lookup drafts its
real greedy continuation: k + 1 tokens per step once the chain is trusted.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm.fork import spec_lookup
from vllm.fork.dflash2_config import verify_count
from vllm.fork.spec_lookup import TrustState


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


# -- n-gram matching --------------------------------------------------------------


def ref_match(seq: list[int], min_n: int, max_n: int, width: int) -> tuple[int, int]:
    """(n, start): longest n, then most recent occurrence [j, j + n) inside the last
    ``width`` positions with a continuation before the end; (0, len) if none."""
    T = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if n >= width or n + 1 > T:
            continue
        suffix = seq[T - n:]
        for j in range(T - n - 1, max(0, T - width) - 1, -1):
            if seq[j:j + n] == suffix:
                return n, j + n
    return 0, T


def ref_continuation(seq: list[int], n: int, start: int, num: int, chain: bool) -> list:
    """The tokens after the match, a chain appending each draft before the next."""
    if n == 0:
        return [None] * num
    ext = list(seq)
    out = []
    for i in range(num):
        p = start + i
        if p < len(seq) or (chain and p < len(ext)):
            out.append(ext[p])
            if chain:
                ext.append(ext[p])
        else:
            out.append(None)
    return out


def _batch(seqs: list[list[int]], capacity: int):
    tokens = torch.full((len(seqs) + 2, capacity), 7, dtype=torch.int32)
    rows = torch.arange(2, len(seqs) + 2)  # request slots are not batch rows
    for r, s in zip(rows.tolist(), seqs):
        tokens[r, : len(s)] = torch.tensor(s, dtype=torch.int32)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    return tokens, rows, lengths


def _random_history(rng: random.Random, vocab: int) -> list[int]:
    n = rng.randint(1, 60)
    seq = [rng.randrange(vocab) for _ in range(n)]
    for _ in range(rng.randint(0, 3)):  # plant repeats of earlier spans
        if len(seq) > 2:
            a = rng.randrange(len(seq) - 1)
            b = rng.randint(a + 1, min(len(seq), a + 8))
            seq += seq[a:b]
    return seq[-rng.randint(1, len(seq)):] if rng.random() < 0.3 else seq


@pytest.mark.parametrize("seed", range(6))
def test_match_and_continuation_agree_with_the_reference(seed):
    rng = random.Random(seed)
    seqs = [_random_history(rng, rng.choice([2, 3, 5, 50])) for _ in range(24)]
    capacity = max(map(len, seqs)) + 5
    tokens, rows, lengths = _batch(seqs, capacity)
    for min_n, max_n, window in [(1, 1, 64), (2, 5, 64), (3, 3, 10), (1, 4, 6), (2, 2, 3)]:
        match = spec_lookup.match_history(tokens, rows, lengths, min_n, max_n, window)
        width = min(window, capacity)
        chain = torch.tensor([i % 2 == 0 for i in range(len(seqs))])
        got, ok = spec_lookup.continuation(tokens, rows, match, 9, chain)
        for b, seq in enumerate(seqs):
            n, start = ref_match(seq, min_n, max_n, width)
            assert (match.n[b].item(), match.start[b].item()) == (n, start), (seq, min_n,
                                                                              max_n, window)
            assert match.distance[b].item() == len(seq) - start
            want = ref_continuation(seq, n, start, 9, bool(chain[b]))
            assert [t if o else None for t, o in zip(got[b].tolist(), ok[b].tolist())] == want


def test_longest_n_beats_a_more_recent_shorter_match_and_recency_breaks_ties():
    # "1 2 3" occurs at 0; "2 3" also at 5 (more recent); the 3-gram wins.
    seq = [1, 2, 3, 9, 8, 2, 3, 4, 1, 2, 3]
    tokens, rows, lengths = _batch([seq], 16)
    match = spec_lookup.match_history(tokens, rows, lengths, 2, 3, 64)
    assert (match.n.item(), match.start.item()) == (3, 3)
    # Two occurrences of the 2-gram "5 6": the later one (continuing with 8) wins.
    seq = [5, 6, 7, 5, 6, 8, 5, 6]
    tokens, rows, lengths = _batch([seq], 16)
    match = spec_lookup.match_history(tokens, rows, lengths, 2, 2, 64)
    assert (match.n.item(), match.start.item()) == (2, 5)
    got, _ = spec_lookup.continuation(tokens, rows, match, 4, torch.tensor([True]))
    assert got[0].tolist() == [8, 5, 6, 8]


def test_window_bounds_how_far_back_the_lookup_searches():
    seq = [4, 5, 6] + list(range(10, 30)) + [4, 5]
    tokens, rows, lengths = _batch([seq], 32)
    far = spec_lookup.match_history(tokens, rows, lengths, 2, 2, len(seq))
    assert (far.n.item(), far.start.item()) == (2, 2)
    near = spec_lookup.match_history(tokens, rows, lengths, 2, 2, len(seq) - 1)
    assert near.n.item() == 0


# -- the adaptive length ----------------------------------------------------------


class RefTrust:
    """The adaptive length of one request, from its definition."""

    def __init__(self, verify_len: int):
        self.V = verify_len
        self.trust, self.streak = verify_len, 0
        self.pred: list[int] = []
        self.base = 0
        self.proposed = 0

    def reset(self):
        self.trust, self.streak, self.pred, self.proposed = self.V, 0, [], 0

    def observe(self, history: list[int], emitted: int):
        if not self.pred or emitted < 1 or self.base + emitted != len(history):
            return
        out = history[self.base:self.base + emitted]
        comparable = min(emitted, len(self.pred))
        agree = 0
        while agree < comparable and out[agree] == self.pred[agree]:
            agree += 1
        if agree < comparable:
            self.trust, self.streak = agree, 0
            return
        grown = max(self.trust, agree)
        if self.proposed > 0 and emitted == self.proposed + 1:
            self.streak += 1
            if self.streak >= spec_lookup.GROW_STREAK:
                grown, self.streak = 2 * max(grown, 1), 0
        else:
            self.streak = 0
        self.trust = min(self.V, grown)

    def record(self, history: list[int], pred: list[int | None], proposed: int):
        run = []
        for t in pred:
            if t is None:
                break
            run.append(t)
        self.pred, self.base, self.proposed = run, len(history), proposed


def _trust_step(state: TrustState, tokens, slot: int, history: list[int], emitted: int):
    tokens[slot, : len(history)] = torch.tensor(history, dtype=torch.int32)
    state.observe(tokens, torch.tensor([slot]), torch.tensor([len(history)]),
                  torch.tensor([emitted], dtype=torch.int32))


def _trust_record(state: TrustState, slot: int, history: list[int], pred: list, proposed: int):
    V = state.verify_len
    ok = torch.tensor([[t is not None for t in pred]])
    values = torch.tensor([[t if t is not None else 0 for t in pred]])
    state.record(torch.tensor([slot]), torch.tensor([len(history)]), values[:, :V], ok[:, :V],
                 torch.tensor([proposed]))


def test_adaptive_length_counts_emitted_tokens_not_slots():
    V = 6
    state = TrustState(4, V, torch.device("cpu"))
    tokens = torch.zeros(4, 64, dtype=torch.int32)
    h = [1, 2, 3, 4]
    _trust_record(state, 1, h, [5, 6, 7, 8, 9, 10], proposed=6)
    # The step verified 6 slots but emitted only 6 tokens (5 accepted + the bonus):
    # not a full step, even though emitted == proposed.
    h = h + [5, 6, 7, 8, 9, 11]
    _trust_step(state, tokens, 1, h, emitted=6)
    # The lookup called 5 of the 6 emitted tokens, then missed: trusted length 5.
    assert state.trust[1].item() == 5 and state.streak[1].item() == 0
    # The drafter's slots were rejected after 2 tokens, but the lookup predicted both
    # emitted tokens: that is no evidence against it, so the length does not drop.
    _trust_record(state, 1, h, [20, 21, 22, 23, 24, 25], proposed=6)
    h = h + [20, 21]
    _trust_step(state, tokens, 1, h, emitted=2)
    assert state.trust[1].item() == 5 and state.streak[1].item() == 0
    # Steps emitting as many tokens as they verified slots lost one slot each time:
    # they never count as fully accepted, so no streak builds and nothing doubles.
    for step in range(3):
        nxt = [40 + 2 * step, 41 + 2 * step]
        _trust_record(state, 1, h, nxt + [None] * 4, proposed=2)
        h = h + nxt
        _trust_step(state, tokens, 1, h, emitted=2)
        assert state.trust[1].item() == 5 and state.streak[1].item() == 0


def test_adaptive_length_grows_on_full_streaks_and_cuts_after_a_miss():
    V = 8
    state = TrustState(2, V, torch.device("cpu"))
    tokens = torch.zeros(2, 128, dtype=torch.int32)
    h = [3, 3, 3]
    # A miss on the very first emitted token: nothing trusted.
    _trust_record(state, 0, h, [9] * 8, proposed=4)
    h = h + [4]
    _trust_step(state, tokens, 0, h, emitted=1)
    assert state.trust[0].item() == 0
    # Fully accepted steps (emitted = proposed + 1) the lookup predicted: the length
    # takes what the lookup got right, and every second full step doubles it.
    expected = []
    for step in range(4):
        nxt = list(range(100 + 10 * step, 100 + 10 * step + 3))
        _trust_record(state, 0, h, nxt + [None] * 5, proposed=2)
        h = h + nxt
        _trust_step(state, tokens, 0, h, emitted=3)
        expected.append(state.trust[0].item())
    assert expected == [3, 6, 6, 8]
    # One mispredicted token cuts it to the agreeing prefix.
    _trust_record(state, 0, h, [1, 2, 3, 4, 5, 6, 7, 8], proposed=8)
    h = h + [1, 2, 0]
    _trust_step(state, tokens, 0, h, emitted=3)
    assert state.trust[0].item() == 2 and state.streak[0].item() == 0


def test_lifecycle_new_preempted_finished_and_reused_slots():
    V = 4
    state = TrustState(3, V, torch.device("cpu"))
    tokens = torch.zeros(3, 64, dtype=torch.int32)
    h = [1, 2, 3]
    _trust_record(state, 2, h, [7, 7, 7, 7], proposed=4)
    h = h + [8]
    _trust_step(state, tokens, 2, h, emitted=1)
    assert state.trust[2].item() == 0
    # Preempted and resumed: its history is recomputed and no longer continues the
    # recorded one (base + emitted != length), so the stale prediction is not graded.
    _trust_record(state, 2, h, [9, 9, 9, 9], proposed=4)
    resumed = h + [5, 6]
    _trust_step(state, tokens, 2, resumed, emitted=1)
    assert state.trust[2].item() == 0
    # The request finished; a new one is admitted into slot 2 and prefills: reset.
    state.reset(torch.tensor([2]))
    assert state.trust[2].item() == V and state.pred_len[2].item() == 0
    # An ungraded slot (nothing recorded yet) keeps its length whatever is emitted.
    _trust_step(state, tokens, 2, [4, 4, 4, 4, 4], emitted=2)
    assert state.trust[2].item() == V
    # Other slots are untouched throughout.
    assert state.trust[0].item() == V and state.trust[1].item() == V


@pytest.mark.parametrize("seed", range(4))
def test_trust_state_matches_the_reference_over_random_lifecycles(seed):
    rng = random.Random(seed)
    V, slots = 5, 3
    state = TrustState(slots, V, torch.device("cpu"))
    tokens = torch.zeros(slots, 512, dtype=torch.int32)
    refs = [RefTrust(V) for _ in range(slots)]
    hist = [[rng.randrange(4) for _ in range(3)] for _ in range(slots)]
    for _ in range(120):
        s = rng.randrange(slots)
        event = rng.random()
        if event < 0.1:  # finished, slot reused by a new (prefilling) request
            hist[s] = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            state.reset(torch.tensor([s]))
            refs[s].reset()
            continue
        if event < 0.15:  # preempted and recomputed: history jumps
            hist[s] = hist[s] + [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        pred = [rng.randrange(4) if rng.random() < 0.9 else None for _ in range(V)]
        proposed = rng.randint(0, V)
        _trust_record(state, s, hist[s], pred, proposed)
        refs[s].record(hist[s], pred, proposed)
        emitted = rng.randint(1, proposed + 1)
        # Mostly emit what was predicted, sometimes diverge.
        new = [t if (t is not None and rng.random() < 0.8) else rng.randrange(4)
               for t in (pred + [None])[:emitted]]
        hist[s] = hist[s] + new
        if len(hist[s]) > 400:
            hist[s] = hist[s][-50:]
            state.reset(torch.tensor([s]))
            refs[s].reset()
            continue
        _trust_step(state, tokens, s, hist[s], emitted)
        refs[s].observe(hist[s], emitted)
        for i in range(slots):
            assert (state.trust[i].item(), state.streak[i].item()) == (refs[i].trust,
                                                                      refs[i].streak)


# -- assembling the verify block --------------------------------------------------


def test_assemble_prefers_trusted_lookup_then_drafter_then_lookup_then_pad():
    lookup = torch.tensor([[10, 11, 12, 13, 14, 15]] * 3)
    ok = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]).bool()
    trust = torch.tensor([2, 0, 6])
    drafter = torch.tensor([[20, 21, 22], [30, 31, 32], [40, 41, 42]])
    pad = torch.tensor([7, 8, 9])
    out = spec_lookup.assemble(lookup, ok, trust, drafter, pad)
    assert out.tolist() == [[10, 11, 22, 13, 7, 7], [30, 31, 32, 13, 14, 15],
                            [40, 41, 42, 9, 9, 9]]
    # The drafter skipped: its slots fall to the untrusted lookup, then the pad.
    out = spec_lookup.assemble(lookup, ok, trust, None, pad)
    assert out.tolist() == [[10, 11, 12, 13, 7, 7], [10, 11, 12, 13, 14, 15], [9] * 6]


def test_chain_covers_only_trusted_greedy_matches():
    match = spec_lookup.HistoryMatch(n=torch.tensor([3, 3, 0, 2]), start=torch.zeros(4),
                                     distance=torch.ones(4))
    chain = torch.tensor([True, True, True, False])
    trust = torch.tensor([7, 6, 7, 7])
    assert spec_lookup.chain_covers(match, chain, trust, 7).tolist() == [True, False, False,
                                                                         False]
    assert spec_lookup.chain_covers(match, chain, trust, 0).tolist() == [True, True, False,
                                                                         False]
    assert spec_lookup.is_greedy(torch.tensor([0.0, 1e-6, 0.7])).tolist() == [True, True,
                                                                              False]


def test_count_none_falls_back_to_the_verify_block():
    assert verify_count(None, 15) == 15
    assert [verify_count(n, 15) for n in (0, 3, 15, 20)] == [0, 3, 15, 15]


# -- prewarm: every BLOCK_SIZE upstream's input kernel can launch with -------------


@pytest.mark.parametrize("num_query_per_req", [2, 4, 8, 16, 200, 300])
@pytest.mark.parametrize("max_query_len", [1, 2, 7, 100, 127, 128, 2048, 8192])
def test_prewarm_covers_exactly_upstreams_block_sizes(max_query_len, num_query_per_req):
    # prepare_dflash_inputs: BLOCK_SIZE = min(256, next_pow2(max(1, q + 1 + k))).
    upstream = sorted({min(256, _next_pow2(max(1, q + num_query_per_req)))
                       for q in range(1, max_query_len + 1)})
    assert spec_lookup.dflash_input_block_sizes(max_query_len, num_query_per_req) == upstream
    plan = spec_lookup.dflash_prewarm_plan(max_query_len, num_query_per_req)
    assert [size for size, _ in plan] == upstream
    for size, q in plan:
        assert 1 <= q <= max_query_len
        assert min(256, _next_pow2(q + num_query_per_req)) == size
        assert q == 1 or min(256, _next_pow2(q - 1 + num_query_per_req)) < size


def test_prewarm_plan_at_the_gpu_scenarios_sizes():
    # 1 + k for k = 3, 7, 15 and a 1024-token step budget: 5 to 8 variants each.
    assert [len(spec_lookup.dflash_input_block_sizes(1024, 1 + k)) for k in (3, 7, 15)] \
        == [6, 5, 4]

"""The device side of a step's plan (kvarn.plan), the sink restore, and flush tables
with skipped entries: each kernel against its reference."""
from __future__ import annotations

import torch
from kvarn_cases import DEVICE, rotated_rows

from kvarn import PagedKV, Preset
from kvarn import reference as ref
from kvarn.dequant import restore_sinks
from kvarn.flush import flush
from kvarn.plan import flush_targets, flush_targets_reference, stage_slots, stage_slots_reference


def _rows(gen, g, num_rows):
    """Random rows: (seq_len, query_len, tail_start, hit_end) with consistent tables."""
    rows = []
    for _ in range(num_rows):
        q = int(torch.randint(1, 3 * g, (1,), generator=gen))
        committed = int(torch.randint(0, 5 * g, (1,), generator=gen))
        # No hit, a hit below the committed rows, or one the query starts inside (a
        # hit's last token recomputed).
        hit_end = [0, committed // g * g, -(-committed // g) * g][
            int(torch.randint(0, 3, (1,), generator=gen))]
        tail_start = max(1, committed // g, hit_end // g)
        rows.append((committed + q, q, tail_start, hit_end))
    return rows


def test_stage_slots_match_reference():
    gen = torch.Generator().manual_seed(0)
    g = 16
    rows = _rows(gen, g, 7)
    qsl = torch.tensor([0] + [q for _, q, _, _ in rows]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(L - q, L) for L, q, _, _ in rows]).to(torch.int64)
    width = max(L // g + 2 for L, *_ in rows)
    side_table = torch.randint(0, 1000, (len(rows) + 2, width), generator=gen,
                               dtype=torch.int32)
    tail = torch.tensor([r[2] for r in rows] + [1, 1], dtype=torch.int32)
    hit = torch.tensor([r[3] for r in rows] + [0, 0], dtype=torch.int32)
    length = int(qsl[-1]) + 37  # padding tokens past the step's last
    out = torch.full((length,), 123, dtype=torch.int64, device=DEVICE)
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    stage_slots(dev(positions), dev(qsl), len(rows), dev(side_table), dev(tail), dev(hit),
                g, out)
    want = stage_slots_reference(positions, qsl, len(rows), side_table, tail, hit, g, length)
    assert torch.equal(out.cpu(), want)
    assert (want[: int(qsl[-1])] == -1).any(), "some rows start inside a hit"
    assert (want[int(qsl[-1]):] == -1).all()


def test_flush_targets_match_reference():
    gen = torch.Generator().manual_seed(1)
    g = 16
    rows = _rows(gen, g, 9)
    qsl = torch.tensor([0] + [q for _, q, _, _ in rows]).cumsum(0).to(torch.int32)
    seq = torch.tensor([L for L, *_ in rows], dtype=torch.int32)
    hit = torch.tensor([r[3] for r in rows], dtype=torch.int32)
    block_table = torch.randint(0, 500, (len(rows), 16), generator=gen, dtype=torch.int32)
    cand_rows, cand_logical = [], []
    for b, (L, q, _, _) in enumerate(rows):
        for i in range(max(0, (L - q - 5) // g), L // g + 2):  # over-asked, as with slack
            cand_rows.append(b)
            cand_logical.append(i)
    n = len(cand_rows)
    r = torch.tensor(cand_rows + [0] * 5, dtype=torch.int32)
    lg = torch.tensor(cand_logical + [0] * 5, dtype=torch.int32)
    out = torch.zeros(n + 5, dtype=torch.int64, device=DEVICE)
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    flush_targets(dev(r), dev(lg), n, dev(seq), dev(qsl), dev(hit), dev(block_table), g, out)
    want = flush_targets_reference(r, lg, n, seq, qsl, hit, block_table, g, n + 5)
    assert torch.equal(out.cpu(), want)
    assert (want >= 0).sum() > 3 and (want[:n] == -1).sum() > 3


def test_restore_writes_the_records_rows_into_the_side_block():
    p = Preset.parse("kvarn_k4v2_g64")
    d, h = 64, 2
    gen = torch.Generator().manual_seed(2)
    kv = PagedKV.allocate(p, d, h, num_blocks=6, num_side_blocks=4, device=DEVICE)
    k = rotated_rows(p.group, h, d, gen).transpose(0, 1)[None]  # [1, H, G, D]
    v = rotated_rows(p.group, h, d, gen).transpose(0, 1)[None]
    kv.cache[4] = ref.encode_tiles(k.to(DEVICE), v.to(DEVICE), p)[0]
    block_table = torch.tensor([[0, 1], [4, 5]], dtype=torch.int32, device=DEVICE)
    before = kv.side.clone()
    dst = torch.tensor([-1, 2, -1], dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([0, 1, 0], dtype=torch.int32, device=DEVICE)
    restore_sinks(kv, dst, rows, block_table)
    kd, vd = ref.decode_tiles(kv.cache[4].cpu(), p, d)  # [H, G, D]
    assert torch.allclose(kv.side[2, 0].cpu().float(), kd, atol=1e-3, rtol=1e-3)
    assert torch.allclose(kv.side[2, 1].cpu().float(), vd, atol=1e-3, rtol=1e-3)
    untouched = [0, 1, 3]
    assert torch.equal(kv.side[untouched], before[untouched])


def test_flush_skips_negative_targets():
    p = Preset.parse("kvarn_k4v4_g64")
    d, h = 64, 1
    gen = torch.Generator().manual_seed(3)
    kv = PagedKV.allocate(p, d, h, num_blocks=4, num_side_blocks=3, device=DEVICE)
    kv.side.copy_(rotated_rows(3 * 2 * p.group, h, d, gen)
                  .reshape(3, 2, p.group, h, d).transpose(2, 3).to(DEVICE))
    kv.cache.fill_(7)
    src = torch.tensor([0, 1, 2], dtype=torch.int64, device=DEVICE)
    dst = torch.tensor([-1, 3, -1], dtype=torch.int64, device=DEVICE)
    flush(kv, src, dst)
    want = ref.encode_tiles(kv.side[1:2, 0].cpu().float(), kv.side[1:2, 1].cpu().float(), p)
    assert torch.equal(kv.cache[3].cpu(), want[0])
    assert (kv.cache[:3] == 7).all()


def test_materialize_rows_matches_the_reference_view():
    from kvarn_cases import make_state

    from kvarn.dequant import materialize_rows

    p = Preset.parse("kvarn_k4v2_g64")
    d, h, g = 64, 2, 64
    lens = [300, 64, 1, 129, 200]
    st = make_state(p, d, h, lens, query_len=5, seed=4)
    nblk = [-(-L // g) for L in lens]
    off = torch.tensor([0] + nblk[:-1]).cumsum(0).to(torch.int32).to(DEVICE)
    k = torch.full((sum(nblk) + 1, g, h, d), float("nan"), dtype=torch.float16, device=DEVICE)
    v = k.clone()
    first = 1  # a pack that starts mid-batch
    materialize_rows(st.kv, first, len(lens) - first, max(nblk), st.block_table,
                     st.side_table, st.num_flushed, st.seq_lens, off, k, v)
    for b in range(first, len(lens)):
        want_k, want_v = ref.gather_request(st.kv, b, st.block_table, st.side_table,
                                            lens[b], int(st.num_flushed[b]))
        o = int(off[b])
        got_k = k[o:o + nblk[b]].reshape(-1, h, d)[: lens[b]].float().cpu()
        got_v = v[o:o + nblk[b]].reshape(-1, h, d)[: lens[b]].float().cpu()
        assert torch.allclose(got_k, want_k.cpu(), atol=2e-3, rtol=2e-3)
        assert torch.allclose(got_v, want_v.cpu(), atol=2e-3, rtol=2e-3)
    assert torch.isnan(k[: int(off[first])]).all(), "rows outside the pack are untouched"


def test_prefill_attention_matches_reference():
    from kvarn.prefill import prefill_attention, prefill_attention_reference

    gen = torch.Generator().manual_seed(6)
    hq, h, d = 4, 2, 64
    rows = [(300, 100), (64, 64), (129, 1), (70, 17)]  # (seq_len, query_len)
    qsl = torch.tensor([0] + [q for _, q in rows]).cumsum(0).to(torch.int32)
    seq = torch.tensor([L for L, _ in rows], dtype=torch.int32)
    start = torch.tensor([0, 310, 380, 520], dtype=torch.int32)  # gaps between rows
    k = torch.randn(600, h, d, generator=gen).half()
    v = torch.randn(600, h, d, generator=gen).half()
    q = torch.randn(int(qsl[-1]), hq, d, generator=gen).half()
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    got = prefill_attention(dev(q), dev(k), dev(v), dev(qsl), dev(seq), dev(start),
                            max(q for _, q in rows), d**-0.5)
    want = prefill_attention_reference(q, k, v, qsl, seq, start, d**-0.5)
    assert torch.allclose(got.float().cpu(), want, atol=3e-3, rtol=3e-3)

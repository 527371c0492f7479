"""Properties of the torch reference: normalizer, reconstruction error, bad input,
paged attention."""
import pytest
import torch
from kvarn_cases import make_state

from kvarn import Preset
from kvarn import reference as ref

P128 = Preset.parse("kvarn_k4v2_g128")


def nmse(a, b):
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def test_normalizer_keeps_best_iteration_even_when_last_is_worse():
    gen = torch.Generator().manual_seed(1)
    # Sparse tiles are best left alone (identity): every iteration makes them worse.
    sparse = torch.randn(8, 64, 64, generator=gen) * (torch.rand(8, 64, 64, generator=gen) < 0.05)
    rows = torch.randn(32, 64, 64, generator=gen) * torch.exp(4 * torch.randn(32, 64, 1, generator=gen))
    x = torch.cat([sparse, rows])
    n = ref.normalize(x)
    for tr, best in zip(n.trace, n.best_iter):  # the best-so-far rule, from the trace
        b = 0
        for it in range(1, tr.shape[0]):
            if tr[it] <= tr[b] * (1 + ref.TIE_RTOL):
                b = it
        assert int(best) == b
        assert tr[b] <= tr.min() * (1 + ref.TIE_RTOL)
    worse_last = n.trace[:, -1] > n.trace.min(-1).values * 1.01
    assert (worse_last[:8] & (n.best_iter[:8] == 0)).all()
    assert (n.log_row[:8] == 0).all() and (n.log_col[:8] == 0).all()
    t = 8 + int((n.best_iter[8:] > 0).nonzero()[0])
    again = ref.normalize(x[t], iters=int(n.best_iter[t]))  # scales of the chosen iteration
    assert torch.equal(again.log_row, n.log_row[t]) and torch.equal(again.log_col, n.log_col[t])


def test_balanced_tile_scores_two():
    assert abs(float(ref.imbalance(torch.ones(4, 4) + torch.eye(4))) - 2.0) < 1e-6


@pytest.mark.parametrize("vb,k_nmse,v_nmse", [(2, 0.010, 0.25), (4, 0.010, 0.010)])
def test_gaussian_nmse_within_10pct_of_theory(vb, k_nmse, v_nmse):
    p = Preset.parse(f"kvarn_k4v{vb}_g128")
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(16, 128, 128, generator=gen)
    v = torch.randn(16, 128, 128, generator=gen)
    kd, vd = ref.decode_tiles(ref.encode_tiles(k, v, p), p, 128)
    assert abs(nmse(kd, k) - k_nmse) <= 0.1 * k_nmse
    assert abs(nmse(vd, v) - v_nmse) <= 0.1 * v_nmse


def test_lognormal_keys_beat_plain_per_channel_rounding():
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(16, 128, 128, generator=gen)
         * torch.exp(torch.randn(16, 128, 1, generator=gen))
         * torch.exp(torch.randn(16, 1, 128, generator=gen)))
    kd, _ = ref.decode_tiles(ref.encode_tiles(k, k, P128), P128, 128)
    codes, step, zero = ref.quantize_rows(k.transpose(-1, -2), 4)
    plain = (codes * step[..., None] + zero[..., None]).transpose(-1, -2)
    assert nmse(kd, k) <= 0.011
    assert nmse(plain, k) >= 3 * nmse(kd, k)


def test_zero_rows_and_columns_reconstruct_exactly():
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(128, 128, generator=gen)
    v = torch.randn(128, 128, generator=gen)
    k[5] = 0  # a zero token: a column of the K tile
    k[:, 9] = 0  # a zero channel: a row of the K tile
    v[7] = 0  # a zero token: a row of the V tile
    v[:, 3] = 0  # a zero channel: a column of the V tile
    kd, vd = ref.decode_tile(ref.encode_tile(k, v, P128), P128, 128)
    assert torch.isfinite(kd).all() and torch.isfinite(vd).all()
    assert (kd[5] == 0).all() and (kd[:, 9] == 0).all()
    assert (vd[7] == 0).all() and (vd[:, 3] == 0).all()
    assert nmse(kd, k) < 0.02 and nmse(vd, v) < 0.3


def test_all_zero_and_constant_tiles():
    z = torch.zeros(128, 128)
    kd, vd = ref.decode_tile(ref.encode_tile(z, z, P128), P128, 128)
    assert (kd == 0).all() and (vd == 0).all()
    # every row of each oriented tile constant (K: per channel, V: per token)
    chan = torch.linspace(-3, 5, 128)
    k = chan[None, :].expand(128, 128).clone()
    v = chan[:, None].expand(128, 128).clone()
    kd, vd = ref.decode_tile(ref.encode_tile(k, v, P128), P128, 128)
    # exact up to the fp16 rounding of the two scales that multiply (2 * 2^-11)
    assert torch.allclose(kd, k, rtol=2.5e-3, atol=1e-6)
    assert torch.allclose(vd, v, rtol=2.5e-3, atol=1e-6)


def test_constant_row_in_random_tile_stays_finite_and_close():
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(128, 128, generator=gen)
    v[11] = 2.5
    k = v.clone()
    k[:, 11] = -1.25
    kd, vd = ref.decode_tile(ref.encode_tile(k, v, Preset.parse("kvarn_k4v4_g128")),
                             Preset.parse("kvarn_k4v4_g128"), 128)
    assert torch.isfinite(kd).all() and torch.isfinite(vd).all()
    assert (vd[11] - 2.5).abs().max() < 0.3 and (kd[:, 11] + 1.25).abs().max() < 0.3


def test_encode_refuses_non_finite_and_stage_clamps_and_counts():
    x = torch.randn(128, 128)
    x[3, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        ref.encode_tile(x, torch.zeros(128, 128), P128)
    raw = torch.randn(128, 128).to(torch.bfloat16)
    raw[0, 0] = float("nan")
    raw[1, 1] = float("inf")
    raw[2, 2] = 1e6  # representable in bf16, beyond fp16
    rows, count = ref.rotate_rows(raw)
    assert count == 3 and torch.isfinite(rows).all()
    kd, _ = ref.decode_tile(ref.encode_tile(rows, rows, P128), P128, 128)
    assert torch.isfinite(kd).all()
    # untouched tokens keep their accuracy: the bad elements do not spread
    clean = ref.rotate_rows(raw[3:].float())[0].float()
    assert nmse(kd[3:], clean) < 0.05


def test_reference_attention_matches_dense_attention_over_fp16_rows():
    # No flushed blocks: everything is fp16 in the side pool, so the reference must
    # equal plain causal attention over the staged rows.
    st = make_state(Preset.parse("kvarn_k4v2_g64"), 64, 2, [70, 5], 3, device="cpu")
    assert int(st.num_flushed.sum()) == 0
    q = torch.randn(2, 3, 4, 64)
    out = ref.paged_attention(q, st.kv, st.block_table, st.side_table, st.seq_lens,
                              st.num_flushed)
    for b in range(2):
        L = int(st.seq_lens[b])
        k, v = ref.gather_request(st.kv, b, st.block_table, st.side_table, L, 0)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        for i in range(3):
            n = L - 3 + i + 1
            s = torch.einsum("hd,lhd->hl", q[b, i], k[:n]) / 8.0
            want = torch.einsum("hl,lhd->hd", s.softmax(-1), v[:n])
            assert torch.allclose(out[b, i], want, atol=1e-5)


def test_reference_catches_bad_tables():
    p = Preset.parse("kvarn_k4v2_g64")
    st = make_state(p, 64, 1, [300], 1, device="cpu")
    q = torch.randn(1, 1, 1, 64)
    args = (st.kv, st.block_table, st.side_table, st.seq_lens, st.num_flushed)
    bt = st.block_table.clone()
    bt[0, 2] = st.kv.cache.shape[0]
    with pytest.raises(IndexError, match="block table entry"):
        ref.paged_attention(q, st.kv, bt, *args[2:])
    nf = st.num_flushed + 1  # a record past the row's last position
    with pytest.raises(ValueError, match="flushed blocks cover"):
        ref.paged_attention(q, *args[:4], nf)
    with pytest.raises(IndexError, match="side block"):
        ref.flush(st.kv, torch.tensor([-1]), torch.tensor([0]))

"""Rotate-and-stage and flush kernels against the reference."""
import pytest
import torch
from kvarn_cases import DEVICE, ON_GPU, rotated_rows

from kvarn import PagedKV, Preset
from kvarn import reference as ref
from kvarn.flush import flush
from kvarn.rotate import rotate, rotate_and_stage

# Full shapes on a GPU, small ones under the CPU interpreter.
PRESETS = Preset.names() if ON_GPU else ("kvarn_k4v2_g64", "kvarn_k4v4_g64")
D = 128 if ON_GPU else 64
HEADS = 8 if ON_GPU else 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rotate_and_stage_matches_reference_and_clamps(dtype):
    p = Preset.parse(PRESETS[0])
    kv = PagedKV.allocate(p, D, HEADS, 1, 4, device=DEVICE)
    kv.side.fill_(-1.0)
    gen = torch.Generator().manual_seed(0)
    t = 40
    key = (3 * torch.randn(t, HEADS, D, generator=gen)).to(dtype)
    val = torch.randn(t, HEADS, D, generator=gen).to(dtype)
    key[0, 0, 0] = float("nan")
    val[1, 1, 2] = float("-inf")
    if dtype != torch.float16:
        key[2, 0, 3] = 1e6  # beyond fp16: bf16/fp32 activations can carry it
    slots = torch.randperm(4 * p.group, generator=gen)[:t]
    slots[5] = -1  # padding token: skipped
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    rotate_and_stage(key.to(DEVICE), val.to(DEVICE), kv, slots.to(DEVICE), count)
    want_k, nk = ref.rotate_rows(key)
    want_v, nv = ref.rotate_rows(val)
    assert int(count) == nk + nv == (3 if dtype != torch.float16 else 2)
    side = kv.side.cpu()
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        got_k = side[s // p.group, 0, :, s % p.group]
        got_v = side[s // p.group, 1, :, s % p.group]
        assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
        # identical up to fp32 summation order: one fp16 ulp at most
        assert torch.allclose(got_k.float(), want_k[i].float(), rtol=1e-3, atol=1e-3)
        assert torch.allclose(got_v.float(), want_v[i].float(), rtol=1e-3, atol=1e-3)
    untouched = torch.ones(4 * p.group, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    flat = side.permute(0, 3, 1, 2, 4).reshape(4 * p.group, 2, HEADS, D)
    assert (flat[untouched] == -1).all()


def test_rotate_round_trip_fp32():
    x = torch.randn(33, 4, D, device=DEVICE)
    y = rotate(x, torch.float32)
    assert torch.allclose(y.cpu(), x.cpu() @ ref.hadamard(D), atol=1e-5)
    assert torch.allclose(rotate(y, torch.float32), x, atol=1e-5)


def _fields(rec, lay):
    names = ["k_codes", "k_col_scale", "k_zero", "k_row_scale", "v_codes", "v_col_scale",
             "v_row_scale", "v_zero", "total"]
    offs = [getattr(lay, n) for n in names]
    return {n: rec[..., a:b] for n, a, b in zip(names, offs, offs[1:])}


@pytest.mark.parametrize("name", PRESETS)
def test_flush_matches_reference(name):
    p = Preset.parse(name)
    n_tiles = 6 if ON_GPU else 2
    kv = PagedKV.allocate(p, D, HEADS, n_tiles + 2, n_tiles + 1, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    kv.side.copy_(rotated_rows((n_tiles + 1) * 2 * p.group, HEADS, D, gen)
                  .reshape(n_tiles + 1, 2, p.group, HEADS, D).transpose(2, 3))
    src = torch.randperm(n_tiles + 1, generator=gen)[:n_tiles].to(DEVICE)
    kv.side[src[0], 0, 0, 5] = 0  # a zero token in the first flushed tile
    kv.side[src[0], 1, 0, :, 7] = 0  # a zero channel
    dst = torch.randperm(n_tiles + 2, generator=gen)[:n_tiles].to(DEVICE)
    flush(kv, src, dst, debug=True)
    got = kv.cache[dst].cpu()
    want = ref.encode_tiles(kv.side[src, 0].cpu(), kv.side[src, 1].cpu(), p)
    lay = p.layout(D)
    g, w = _fields(got, lay), _fields(want, lay)
    for f in ("k_col_scale", "k_zero", "k_row_scale", "v_col_scale", "v_row_scale", "v_zero"):
        a = g[f].contiguous().view(torch.float16).float()
        b = w[f].contiguous().view(torch.float16).float()
        # identical fp16 scales unless fp32 noise (1e-5 rel.) crosses an fp16 rounding edge
        assert ((a - b).abs() <= 1e-5 * b.abs() + (b.abs() * 2.0 ** -10)).all(), f
        assert (a == b).float().mean() >= 0.99, f
    for f, bits in (("k_codes", p.key_bits), ("v_codes", p.value_bits)):
        ca, cb = ref.unpack_bits(g[f], bits), ref.unpack_bits(w[f], bits)
        assert (ca - cb).abs().max() <= 1 and (ca != cb).float().mean() < 1e-3, f
    k, v = ref.decode_tiles(got, p, D)
    assert (k[0, 0, 5] == 0).all() and (v[0, 0, :, 7] == 0).all()


def test_flush_batch_equals_alone():
    p = Preset.parse(PRESETS[0])
    kv = PagedKV.allocate(p, D, HEADS, 6, 3, device=DEVICE)
    kv.side.copy_(rotated_rows(3 * 2 * p.group, HEADS, D, torch.Generator().manual_seed(2))
                  .reshape(3, 2, p.group, HEADS, D).transpose(2, 3))
    flush(kv, torch.tensor([0, 1, 2], device=DEVICE), torch.tensor([0, 1, 2], device=DEVICE))
    flush(kv, torch.tensor([1], device=DEVICE), torch.tensor([4], device=DEVICE))
    assert torch.equal(kv.cache[1], kv.cache[4])


def test_flush_debug_catches_bad_ids():
    p = Preset.parse(PRESETS[0])
    kv = PagedKV.allocate(p, D, 1, 2, 2, device=DEVICE)
    with pytest.raises(IndexError, match="cache block 2"):
        flush(kv, torch.tensor([0], device=DEVICE), torch.tensor([2], device=DEVICE), debug=True)
    with pytest.raises(IndexError, match="side block -1"):
        flush(kv, torch.tensor([-1], device=DEVICE), torch.tensor([0], device=DEVICE), debug=True)

"""KVarN format: presets, record layout, bit packing, Hadamard matrix."""
import pytest
import torch

from kvarn import HEAD_DIMS, Preset
from kvarn import reference as ref


def test_parse_presets_and_attributes():
    assert Preset.names()[0] == "kvarn_k4v2_g128"
    for name, bits in [("kvarn_k4v2_g128", (4, 2, 128)), ("kvarn_k4v4_g128", (4, 4, 128)),
                       ("kvarn_k4v2_g64", (4, 2, 64)), ("kvarn_k4v4_g64", (4, 4, 64))]:
        p = Preset.parse(name)
        assert (p.key_bits, p.value_bits, p.group) == bits


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as e:
        Preset.parse("kvarn_k2v2_g128")
    for name in Preset.names():
        assert name in str(e.value)


@pytest.mark.parametrize("name,tile,per_token", [
    ("kvarn_k4v2_g128", 13824, 108), ("kvarn_k4v4_g128", 17920, 140),
    ("kvarn_k4v2_g64", 7296, 114), ("kvarn_k4v4_g64", 9344, 146)])
def test_sizes_at_d128_match_spec(name, tile, per_token):
    p = Preset.parse(name)
    assert p.tile_bytes(128) == tile
    assert p.bytes_per_token(128) == per_token


@pytest.mark.parametrize("name", Preset.names())
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_layout_offsets_and_no_power_of_two_padding(name, d):
    p = Preset.parse(name)
    g, kb, vb = p.group, p.key_bits, p.value_bits
    lay = p.layout(d)
    kc = d * g * kb // 8
    assert (lay.k_codes, lay.k_col_scale, lay.k_zero, lay.k_row_scale) == (
        0, kc, kc + 2 * d, kc + 4 * d)
    assert lay.v_codes == kc + 4 * d + 2 * g
    vc = lay.v_codes + g * d * vb // 8
    assert (lay.v_col_scale, lay.v_row_scale, lay.v_zero) == (vc, vc + 2 * d, vc + 2 * d + 2 * g)
    assert lay.total == p.tile_bytes(d) == d * g * (kb + vb) // 8 + 6 * (d + g)
    assert lay.total % 16 == 0  # records stay 16-byte aligned without padding
    assert p.bytes_per_token(d) * g == lay.total


def test_unsupported_head_dim():
    with pytest.raises(ValueError, match="head_dim 96"):
        Preset.parse("kvarn_k4v2_g128").tile_bytes(96)


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_round_trips_bit_exact(bits):
    codes = torch.randint(0, 1 << bits, (7, 64), dtype=torch.int32)
    packed = ref.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 64 * bits // 8)
    assert torch.equal(ref.unpack_bits(packed, bits), codes)
    # low bits first: code 0 of a row sits in the lowest bits of byte 0
    assert int(packed[0, 0]) & ((1 << bits) - 1) == int(codes[0, 0])


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_hadamard_orthonormal_symmetric(d):
    h = ref.hadamard(d)
    eye = torch.eye(d)
    assert torch.allclose(h, h.T)
    assert (h @ h.T - eye).abs().max() < 1e-5
    h16 = ref.hadamard(d, torch.float16).float()
    # fp16 copy: orthonormal within its own rounding (relative 2^-11 per entry)
    assert (h16 @ h16.T - eye).abs().max() < 2 * 2.0 ** -11

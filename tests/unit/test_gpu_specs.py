"""The GPU tier's run selection that is read on the CPU: the speed runs' shapes."""
import pytest

from tests.gpu.specs import SCENARIOS, kv_bytes_per_step, speed_shapes


def test_speed_shapes_default_to_the_full_table():
    assert speed_shapes("") == ([1, 8, 64], [4096, 16384])


def test_speed_shapes_take_every_pair_of_the_given_axes():
    assert speed_shapes("64x16384") == ([64], [16384])
    assert speed_shapes(" 64x16384 8x4096 ") == ([8, 64], [4096, 16384])


@pytest.mark.parametrize("bad", ["64", "64x", "x16384", "0x4096", "65x4096", "8x32768",
                                 "8x4096x2", "eight x4096"])
def test_bad_speed_shapes_name_what_is_allowed(bad):
    with pytest.raises(ValueError, match="allowed: BATCHxCONTEXT items, batch 1..64"):
        speed_shapes(bad)


def test_speed_runs_use_the_shapes():
    for name in ("speed-auto", "speed-fp8", "speed-kvarn_k4v2_g128"):
        func, _, spec = SCENARIOS[name]
        assert func == "speed" and spec["exclusive"]
        assert (spec["batches"], spec["contexts"]) == speed_shapes()


def test_kv_bytes_per_step_count_every_layer_head_and_token_of_the_large_model():
    # 8 layers x 8 KV heads of head_dim 128 at bf16 (512 bytes per token and head): the
    # 34.4 GB a 64 x 16K step reads (gpu-notes.md's anchor)
    assert kv_bytes_per_step(4 * 128, 64, 16384) == 512 * 8 * 8 * 64 * 16384
    assert kv_bytes_per_step(4 * 128, 64, 16384) / 1e9 == pytest.approx(34.36, abs=0.01)
    assert kv_bytes_per_step(108, 1, 4096) == 108 * 8 * 8 * 4096

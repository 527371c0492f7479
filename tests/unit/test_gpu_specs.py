"""The GPU tier's run selection that is read on the CPU: the models' specs, the speed
runs' shapes and profile, and the profiler table's total."""
import pytest

from tests.gpu.specs import (
    SCENARIOS,
    hbm_bytes_per_s,
    kv_bytes_per_step,
    kv_bytes_per_token_head,
    profiled_steps,
    profiled_time_us,
    speed_profile_steps,
    speed_runs,
    speed_shapes,
)


def test_speed_shapes_default_to_the_full_table():
    assert speed_shapes("") == [(1, 4096), (8, 4096), (64, 4096), (1, 16384), (8, 16384),
                                (64, 16384)]


def test_speed_shapes_take_each_pair_as_given():
    assert speed_shapes("64x16384") == [(64, 16384)]
    assert speed_shapes(" 64x16384 8x65536 1x131072 64x16384") == [
        (64, 16384), (8, 65536), (1, 131072)]


@pytest.mark.parametrize("bad", ["64", "64x", "x16384", "0x4096", "65x4096", "8x131073",
                                 "8x4096x2", "eight x4096"])
def test_bad_speed_shapes_name_what_is_allowed(bad):
    with pytest.raises(ValueError, match="allowed: BATCHxCONTEXT items, batch 1..64"):
        speed_shapes(bad)


def test_speed_runs_default_to_the_dense_model_with_bf16_fp8_and_kvarn():
    assert speed_runs("", "") == [("large", "auto"), ("large", "fp8"),
                                  ("large", "kvarn_k4v2_g128")]
    assert speed_runs("auto int4_per_token_head", "hybrid27 large") == [
        ("hybrid27", "auto"), ("hybrid27", "int4_per_token_head"), ("large", "auto"),
        ("large", "int4_per_token_head")]
    with pytest.raises(ValueError, match="KILN_GPU_SPEED_DTYPES: int3 not allowed; allowed: "
                                         "auto fp8 int8_per_token_head"):
        speed_runs("auto int3", "")
    with pytest.raises(ValueError, match="KILN_GPU_SPEED_MODELS: small not allowed"):
        speed_runs("", "small")


def test_speed_runs_use_the_shapes():
    for name in ("speed-large-auto", "speed-large-fp8", "speed-large-kvarn_k4v2_g128"):
        func, model, spec = SCENARIOS[name]
        assert func == "speed" and model == "large" and spec["exclusive"]
        assert spec["shapes"] == speed_shapes()
        assert spec["max_model_len"] == max(c for _, c in speed_shapes()) + 256


def test_kv_bytes_per_step_count_every_attention_layer_head_and_token():
    pytest.importorskip("vllm.kvarn", reason="reads the installed fork's formats")
    # 8 layers x 8 KV heads of head_dim 128 at bf16 (512 bytes per token and head): the
    # 34.4 GB a 64 x 16K step reads (gpu-notes.md's anchor)
    assert kv_bytes_per_step("auto", 64, 16384, "large") == 512 * 8 * 8 * 64 * 16384
    assert kv_bytes_per_step("auto", 64, 16384, "large") / 1e9 == pytest.approx(34.36, abs=0.01)
    # upstream's per-token-head caches add one fp32 scale per K and V: 128 + 4 bytes each
    assert kv_bytes_per_token_head("int8_per_token_head", 128) == 2 * (128 + 4)
    assert kv_bytes_per_token_head("int4_per_token_head", 128) == 2 * (64 + 4)
    assert kv_bytes_per_token_head("fp8", 128) == 2 * 128


def test_the_roofline_follows_the_card():
    assert hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_bytes_per_s("NVIDIA GeForce RTX 3090") is None


def test_speed_profile_is_off_unless_asked_for():
    assert speed_profile_steps("") == 0
    assert speed_profile_steps(" 16 ") == 16
    for name in ("speed-large-auto", "speed-large-fp8", "speed-large-kvarn_k4v2_g128"):
        assert SCENARIOS[name][2]["profile_steps"] == speed_profile_steps()


@pytest.mark.parametrize("bad", ["-1", "257", "1.5", "sixteen"])
def test_bad_speed_profile_steps_name_what_is_allowed(bad):
    with pytest.raises(ValueError, match="allowed: a step count 0..256"):
        speed_profile_steps(bad)


def test_profiled_time_reads_the_foot_of_a_real_profiler_table():
    # the table vLLM's torch profiler writes is key_averages().table(); on this CPU it
    # records CPU time only, so the CUDA total is absent
    torch = pytest.importorskip("torch")
    x = torch.randn(256, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            x = torch.tanh(x @ x)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total")
    total_us = sum(e.self_cpu_time_total for e in averages)
    assert profiled_time_us(table, "CPU") == pytest.approx(total_us, rel=1e-3, abs=1.0)
    assert profiled_time_us(table, "CUDA") is None
    assert profiled_time_us("Self CUDA time total: 12.500ms\n") == 12500.0
    assert profiled_time_us("Self CUDA time total: 1.250s") == 1.25e6


def test_profiled_steps_read_vllms_step_annotations_from_a_real_table():
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 64)
    steps = {"execute_context_1(129)_generation_0(0)": 1,
             "execute_context_0(0)_generation_64(64)": 3}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for name, calls in steps.items():
            for _ in range(calls):
                with torch.profiler.record_function(name):
                    x = torch.tanh(x @ x)
    assert profiled_steps(prof.key_averages().table(sort_by="self_cpu_time_total")) == steps
    assert profiled_steps("Self CPU time total: 1.000ms") == {}


def test_every_model_the_tier_builds_is_a_valid_spec_and_every_copy_design_holds():
    """A bad preset or a copy too weak for its positions would fail on the GPU machine
    only, after the bundle is built; here it fails first."""
    from kiln.testing import tinymodel
    from tests.gpu.specs import MODELS

    for name, fields in MODELS.items():
        if "dflash2_drafter" in fields:
            drafter = dict(fields["dflash2_drafter"])
            target = tinymodel.preset(**MODELS[drafter.pop("target")])
            tinymodel.validate_drafter(tinymodel.DrafterSpec(**drafter), {
                "hidden_size": target.hidden_size, "num_attention_heads": target.num_heads,
                "num_hidden_layers": target.num_layers, "vocab_size": target.vocab_size})
            continue
        spec = tinymodel.preset(**fields)
        tinymodel.validate(spec)
        if spec.copy_period is not None:
            assert tinymodel.copy_design(spec).margin_nats >= tinymodel.COPY_MIN_MARGIN, name

"""The hybrid model, `vllm serve` with --api-key, and the decode-speed table."""
import pytest

from tests.gpu.specs import (HBM_BYTES_PER_S, SPEED_BATCHES, SPEED_CONTEXTS, kv_bytes_per_step,
                             profiled_steps, profiled_time_us)


@pytest.mark.scenarios("hybrid-auto", "hybrid-kvarn_k4v2_g128")
def test_the_hybrid_model_serves_with_bf16_and_kvarn(scenario):
    bf16, kvarn = scenario("hybrid-auto"), scenario("hybrid-kvarn_k4v2_g128")
    for run in (bf16, kvarn):
        assert all(len(t) == 32 and all(0 <= x < run["vocab"] for x in t)
                   for t in run["tokens"])
    first = sum(a[0] == b[0] for a, b in zip(bf16["tokens"], kvarn["tokens"]))
    print(f"hybrid: first tokens agree on {first} of {len(bf16['tokens'])} prompts")


@pytest.mark.scenarios("serve-kvarn_k4v2_g128")
def test_vllm_serve_with_api_key_residue_sweep_and_copy_probe(scenario):
    run = scenario("serve-kvarn_k4v2_g128")
    assert run["unauthenticated_status"] == 401
    sweep, copy = run["probes"]["residue_sweep"], run["probes"]["copy_probe"]
    assert sweep["exit"] == 0 and sweep["broken"] == 0 and sweep["prompts"] == 128, sweep
    assert copy["exit"] == 0 and copy["broken"] == 0, copy


@pytest.mark.scenarios("profile-huge-ngram")
def test_kiln_profile_huge_ngram_serves_kvarn_with_speculation(scenario):
    run = scenario("profile-huge-ngram")
    assert "--kv-cache-dtype kvarn_k4v2_g128" in run["resolved"], run["resolved"]
    assert run["kvarn_backend"] and run["broken"] == 0, run
    # The copy model repeats its context, so n-gram drafts are nearly all accepted.
    tokens_per_step = 1 + run["accepted"] / run["drafts"]
    print(f"kiln-profile ctx=huge,spec=ngram: {tokens_per_step:.2f} tokens per step "
          f"({run['accepted']:.0f} accepted over {run['drafts']:.0f} drafts)")
    assert run["drafts"] > 0 and tokens_per_step > 2.0


SPEED = ("speed-auto", "speed-fp8", "speed-kvarn_k4v2_g128")


@pytest.mark.scenarios(*SPEED)
def test_decode_speed_table_and_profiled_capacity(scenario):
    """A benchmark, not a timed test: it asserts the table is complete and that KVarN's
    profiled pool (its side pool and scratch charged) keeps 0.85 of the format's ideal;
    with $KILN_GPU_SPEED_PROFILE, that each run's profile recorded its GPU time."""
    from vllm.kvarn import Preset, decode_cuda

    runs = {name: scenario(name) for name in SPEED}
    # K and V bytes per token and KV head (head_dim 128): bf16, fp8, the KVarN record
    head_bytes = {"speed-auto": 4 * 128, "speed-fp8": 2 * 128,
                  "speed-kvarn_k4v2_g128": Preset.parse("kvarn_k4v2_g128").bytes_per_token(128)}
    profile_problems = []
    for name, run in runs.items():
        assert len(run["table"]) == len(SPEED_BATCHES) * len(SPEED_CONTEXTS), name
        for row in run["table"]:
            # A non-positive step means the two timed runs measured something else.
            assert row["ms_per_step"] > 0, (name, row)
            kv = kv_bytes_per_step(head_bytes[name], row["batch"], row["context"])
            print(f"{name}: batch {row['batch']} x {row['context']}: "
                  f"{row['tokens_per_s']:.0f} tokens/s ({row['ms_per_step']:.2f} ms/step); "
                  f"KV bytes per step {kv / 1e9:.2f} GB, "
                  f"{100 * kv / HBM_BYTES_PER_S / (row['ms_per_step'] * 1e-3):.1f}% of its "
                  f"roofline at 4.8 TB/s")
        if "profile" in run:
            profile_problems += print_profile(name, run["profile"], run["table"])
    # The wheel's CUDA decode kernel serves KVarN wherever the wheel carries it.
    kernel = runs["speed-kvarn_k4v2_g128"]["decode_kernel"]
    print("\n".join(kernel))
    if decode_cuda.library_path().exists():
        assert kernel and all("CUDA C++" in line for line in kernel), kernel
    bf16 = runs["speed-auto"]["pool_tokens"]
    ideal = 4 * 128 / Preset.parse("kvarn_k4v2_g128").bytes_per_token(128)
    assert runs["speed-kvarn_k4v2_g128"]["pool_tokens"] / bf16 >= 0.85 * ideal
    assert runs["speed-fp8"]["pool_tokens"] / bf16 >= 0.85 * 2.0
    assert not profile_problems, profile_problems  # after every run's figures are out


def print_profile(name: str, profile: dict, table: list[dict]) -> list[str]:
    """The profiled engine steps (by vLLM's step annotations): GPU time per step against
    the timed step at that shape (the difference is time the GPU waited on the host),
    then the top kernels. Returns what went wrong, if anything."""
    if "error" in profile:
        return [f"{name}: {profile['error']}"]
    busy_us = profiled_time_us(profile["table"])
    if not busy_us:
        print(profile["table"])
        return [f"{name}: the profile recorded no device time (its table is printed above)"]
    steps = profiled_steps(profile["table"]) or {"(no step annotations)": profile["steps"]}
    timed = next(r for r in table if (r["batch"], r["context"]) ==
                 (profile["batch"], profile["context"]))
    busy_ms = busy_us / 1e3 / sum(steps.values())
    print(f"{name}: profiled at {profile['batch']} x {profile['context']}: {steps}; GPU "
          f"busy {busy_ms:.2f} ms per step, the timed step {timed['ms_per_step']:.2f} ms")
    print("\n".join(profile["table"].splitlines()[:40]))
    return []

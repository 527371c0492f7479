"""The hybrid model, `vllm serve` with --api-key, and the decode-speed table."""
import json
import os
from pathlib import Path

import pytest

from kiln.testing.tinymodel import preset
from tests.gpu.specs import (
    SPEED_RUNS,
    SPEED_SHAPES,
    hbm_bytes_per_s,
    kv_bytes_per_step,
    kv_bytes_per_token_head,
    profiled_steps,
    profiled_time_us,
)


def assert_32_tokens_each(*runs: dict) -> None:
    """Each run of the hybrid scenario answered every prompt with 32 tokens of its vocab."""
    for run in runs:
        assert all(len(t) == 32 and all(0 <= x < run["vocab"] for x in t)
                   for t in run["tokens"])


@pytest.mark.scenarios("hybrid-auto", "hybrid-kvarn_k4v2_g128")
def test_the_hybrid_model_serves_with_bf16_and_kvarn(scenario):
    bf16, kvarn = scenario("hybrid-auto"), scenario("hybrid-kvarn_k4v2_g128")
    if "skipped" in bf16:
        pytest.skip(bf16["skipped"])
    assert_32_tokens_each(bf16, kvarn)
    first = sum(a[0] == b[0] for a, b in zip(bf16["tokens"], kvarn["tokens"]))
    print(f"hybrid: first tokens agree on {first} of {len(bf16['tokens'])} prompts")


@pytest.mark.scenarios("hybrid27-auto", "hybrid27-mtp")
def test_the_27b_shaped_hybrid_serves_under_graphs_with_and_without_mtp(scenario):
    """The 27B's layer shapes boot and serve, and MTP boots on them and verifies drafts.
    Random weights: MTP's drafts are rarely accepted, and greedy ties may flip between
    a verify batch and a decode step, so agreement is reported, not asserted."""
    plain, mtp = scenario("hybrid27-auto"), scenario("hybrid27-mtp")
    if "skipped" in plain:
        pytest.skip(plain["skipped"])
    assert_32_tokens_each(plain, mtp)
    assert mtp["drafts"] > 0 and 1.0 <= mtp["tokens_per_step"] <= 4.0, mtp
    # The first token comes from the prompt's prefill alone, drafts or not.
    assert [t[0] for t in plain["tokens"]] == [t[0] for t in mtp["tokens"]]
    same = [next((i for i, (a, b) in enumerate(zip(p, m)) if a != b), len(p))
            for p, m in zip(plain["tokens"], mtp["tokens"])]
    print(f"hybrid27: pool {plain['pool_tokens']} tokens; MTP k=3 {mtp['tokens_per_step']:.2f} "
          f"tokens per step; tokens equal to no-speculation's up to positions {same}")


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


SPEED = [f"speed-{model}-{dtype}" for model, dtype in SPEED_RUNS]


@pytest.mark.scenarios(*SPEED)
def test_decode_speed_table_and_profiled_capacity(scenario):
    """A benchmark, not a timed test: decode after fresh prefills, as a user sees it
    (tests/gpu/scenarios.py speed). It asserts the table is complete, that KVarN's and
    fp8's profiled pools keep 0.85 of their format's ideal against bf16's, and with
    $KILN_GPU_SPEED_PROFILE that each run's profile recorded its GPU time; it prints
    the table and writes it to $KILN_GPU_RESULTS/speed-table.json."""
    from vllm.kvarn import decode_cuda

    runs = {(model, dtype): scenario(f"speed-{model}-{dtype}") for model, dtype in SPEED_RUNS}
    rows, profile_problems = [], []
    for (model, dtype), run in runs.items():
        assert [(r["batch"], r["context"]) for r in run["table"]] == SPEED_SHAPES, (model, dtype)
        roofline = hbm_bytes_per_s(run["device"])
        for row in run["table"]:
            # A non-positive step means the two timed runs measured something else.
            assert row["ms_per_step"] > 0, (model, dtype, row)
            kv = kv_bytes_per_step(dtype, row["batch"], row["context"], model)
            base = runs.get((model, "auto"))
            base_ms = next((r["ms_per_step"] for r in base["table"] if (r["batch"], r["context"])
                            == (row["batch"], row["context"])), None) if base else None
            rows.append({"model": model, "cache": dtype, "device": run["device"], **row,
                         "kv_gb_per_step": kv / 1e9, "pool_tokens": run["pool_tokens"],
                         "roofline_fraction": kv / roofline / (row["ms_per_step"] * 1e-3)
                         if roofline else None,
                         "step_vs_bf16": row["ms_per_step"] / base_ms if base_ms else None})
        if "profile" in run:
            profile_problems += print_profile(f"{model} {dtype}", run["profile"], run["table"])
    print_speed_table(rows)
    Path(os.environ["KILN_GPU_RESULTS"], "speed-table.json").write_text(json.dumps(rows, indent=1))
    for (model, dtype), run in runs.items():
        if dtype.startswith("kvarn_"):
            # The wheel's CUDA decode kernel serves KVarN wherever the wheel carries it.
            print("\n".join(run["decode_kernel"]))
            if decode_cuda.library_path().exists() and model == "large":
                assert run["decode_kernel"] and all(
                    "CUDA C++" in line for line in run["decode_kernel"]), run["decode_kernel"]
        base = runs.get((model, "auto"))
        if base and dtype != "auto" and model == "large":  # a hybrid's pages hold state too
            head_dim = preset(model).head_dim
            ideal = kv_bytes_per_token_head("auto", head_dim) / kv_bytes_per_token_head(
                dtype, head_dim)
            assert run["pool_tokens"] / base["pool_tokens"] >= 0.85 * ideal, (model, dtype)
    assert not profile_problems, profile_problems  # after every run's figures are out


def print_speed_table(rows: list[dict]) -> None:
    print(f"{'model':9} {'cache':22} {'batch x ctx':>13} {'ms/step':>8} {'tok/s':>8} "
          f"{'vs bf16':>7} {'KV GB':>7} {'roofline':>8}  card")
    for r in rows:
        ratio = f"{r['step_vs_bf16']:.2f}x" if r["step_vs_bf16"] else "-"
        roof = f"{100 * r['roofline_fraction']:.1f}%" if r["roofline_fraction"] else "-"
        print(f"{r['model']:9} {r['cache']:22} {r['batch']:>5} x {r['context']:<6} "
              f"{r['ms_per_step']:8.2f} {r['tokens_per_s']:8.0f} {ratio:>7} "
              f"{r['kv_gb_per_step']:7.2f} {roof:>8}  {r['device']}")


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

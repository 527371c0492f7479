"""Speculative decoding on the copy models: every method lossless against none (bf16 and
KVarN; on the 27B-shaped hybrid's copying variant too, eager and under CUDA graphs), the
copy task's tokens per step with n-gram chains and lookup drafting, and DFlash2 with the
random drafter at k = 3, 7, 15 under CUDA graphs with no JIT compile after boot."""
import os

import pytest

from tests.gpu.specs import JIT_RUNS, SPEC27_RUNS, SPEC_RUNS

# VLLM_TRITON_SPEC_VERIFY_ATTN=1 or 0 in the run's environment forces whose kernel serves
# TRITON_ATTN's verify batches; the runs below then check it was that one.
FORCED = {"1": "fork", "0": "upstream"}.get(os.environ.get("VLLM_TRITON_SPEC_VERIFY_ATTN", ""))

BF16 = [n for n in SPEC_RUNS if n.endswith("-bf16") and n != "spec-none-bf16"]
KVARN = [n for n in SPEC_RUNS if n.endswith("-kvarn") and n != "spec-none-kvarn"]


@pytest.mark.parametrize("none,runs", [("spec-none-bf16", BF16), ("spec-none-kvarn", KVARN)],
                         ids=["bf16", "kvarn"])
@pytest.mark.scenarios(*SPEC_RUNS)
def test_spec_decode_is_lossless_against_no_speculation(scenario, none, runs):
    base = scenario(none)
    assert len(base["tokens"]) >= 64
    for name in runs:
        run = scenario(name)
        same = sum(a == b for a, b in zip(run["tokens"], base["tokens"]))
        assert run["tokens"] == base["tokens"], f"{name}: {same} of {len(base['tokens'])}"
        assert run["copy"]["drafts"] > 0, name
        assert run["copy_broken"] == base["copy_broken"], name
        print(f"{name}: verify attention by {run['verify_attention']}")
        if FORCED and none.endswith("bf16"):
            assert run["verify_attention"] == FORCED, name
    # The copy model's greedy answers have wide margins: without speculation they are
    # the copy, so the runs above are right, not merely alike.
    assert base["tokens"] == base["expected"] and base["copy_broken"] == 0


SPEC27_GROUPS = sorted({n.split("-", 2)[2] for n in SPEC27_RUNS})  # "bf16-eager", ...


@pytest.mark.parametrize("group", SPEC27_GROUPS)
@pytest.mark.scenarios(*SPEC27_RUNS)
def test_spec_decode_is_lossless_on_the_27b_shaped_hybrid(scenario, group):
    """Gated DeltaNet state and the attention cache under verify batches, at the 27B's
    layer shapes: each method's greedy tokens are those without speculation, which
    are the copy (so right, not merely alike)."""
    base = scenario(f"spec27-none-{group}")
    assert base["tokens"] == base["expected"] and base["copy_broken"] == 0
    for name in (n for n in SPEC27_RUNS if n.endswith(group) and "-none-" not in n):
        run = scenario(name)
        same = sum(a == b for a, b in zip(run["tokens"], base["tokens"]))
        assert run["tokens"] == base["tokens"], f"{name}: {same} of {len(base['tokens'])}"
        assert run["copy"]["drafts"] > 0 and run["copy_broken"] == 0, name
        print(f"{name}: copy task {run['copy']['tokens_per_step']:.2f} tokens per step")


@pytest.mark.scenarios("spec-dflash2-chains-bf16", "spec-dflash2-lookup-bf16",
                       "spec-ngram-bf16")
def test_spec_decode_copy_task_tokens_per_step(scenario):
    chains = scenario("spec-dflash2-chains-bf16")["copy"]
    lookup = scenario("spec-dflash2-lookup-bf16")["copy"]
    ngram = scenario("spec-ngram-bf16")["copy"]
    for name, run in (("n-gram chains, k=7", chains), ("lookup, verify block 15", lookup),
                      ("upstream ngram, k=7", ngram)):
        print(f"copy task, {name}: {run['tokens_per_step']:.2f} tokens per step "
              f"({run['accepted']:.0f} accepted over {run['drafts']:.0f} drafts)")
    # The drafter is random: these come from the request's own history.
    assert chains["tokens_per_step"] >= 0.95 * (7 + 1)
    assert lookup["tokens_per_step"] >= 12


@pytest.mark.parametrize("k", [3, 7, 15])
@pytest.mark.scenarios(*JIT_RUNS)
def test_spec_decode_dflash2_boots_and_is_lossless_under_graphs(scenario, k):
    run = scenario(f"dflash2-jit-k{k}")
    assert run["draft_tokens"] == k
    assert run["tokens"] == run["expected"]
    if FORCED:
        assert run["verify_attention"] == FORCED, run["verify_attention"]


def _upstream_block_sizes(k: int, budget: int) -> list[int]:
    # prepare_dflash_inputs: BLOCK_SIZE = min(256, next_pow2(q + 1 + k)), q >= 1.
    return sorted({min(256, 1 << (q + k).bit_length()) for q in range(1, budget + 1)})


def _carries(topic: str) -> bool:
    from vllm.fork.identity import fork_identity

    return topic in fork_identity().topics


@pytest.mark.parametrize("k", [3, 7, 15])
@pytest.mark.scenarios(*JIT_RUNS)
def test_spec_decode_dflash2_leaves_no_jit_compile_after_boot(scenario, k):
    run = scenario(f"dflash2-jit-k{k}")
    if _carries("dflash2-prewarm"):  # 0.33.0: BLOCK_SIZE followed the query length
        sizes = _upstream_block_sizes(k, 1024)
        # Every variant was prewarmed at boot and a request then hit each one.
        listed = f"BLOCK_SIZE {', '.join(map(str, sizes))} at boot."
        assert run["prewarm"] and run["prewarm"][0].endswith(listed), run["prewarm"]
        assert sorted(int(s) for s in run["block_size_queries"]) == sizes
    else:  # 0.34.0 launches one BLOCK_SIZE (128), which upstream's warm-up compiles
        assert run["prewarm"] == [], run["prewarm"]
    dflash = [line for line in run["jit_after_boot"] if "prepare_dflash_inputs" in line]
    assert dflash == [], dflash
    # k = 7 ran with --jit-monitor-mode error: any compile would have failed the run.
    assert run["jit_after_boot"] == [], run["jit_after_boot"]

"""KVarN served for real: every preset, eager and CUDA graphs, on the copy model (exact
answers) and a random model (agreement with bf16); capacity at a fixed KV budget."""
import pytest

from tests.gpu.specs import PRESETS

RUNS = [f"kvarn-{p}-{m}" for p in PRESETS for m in ("eager", "graphs")]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.scenarios(*RUNS)
def test_every_answer_is_the_copy_in_eager_and_graphs(scenario, preset):
    eager, graphs = scenario(f"kvarn-{preset}-eager"), scenario(f"kvarn-{preset}-graphs")
    g = eager["block_size"]
    assert eager["broken"] == [] and graphs["broken"] == []
    assert graphs["outputs"] == eager["outputs"]
    # Records were written and read: prompts of at least four full blocks.
    assert min(eager["prompt_lengths"].values()) >= 4 * g - 1
    assert eager["prefix_hits"] > 0, "the second pass of the sweep hit the prefix cache"
    # At least 20x as many finished requests as seats, with no side-pool error.
    assert eager["finished"] >= 20 * eager["max_num_seqs"]


@pytest.mark.scenarios(*RUNS)
def test_the_small_pool_preempts_and_recomputes(scenario):
    preempted = {r: scenario(r)["preemptions"] for r in RUNS}
    assert all(scenario(r)["broken"] == [] for r in RUNS)
    assert any(v > 0 for v in preempted.values()), preempted


@pytest.mark.scenarios("kvarn-d64-kvarn_k4v4_g64-eager")
def test_head_dim_64(scenario):
    assert scenario("kvarn-d64-kvarn_k4v4_g64-eager")["broken"] == []


def _agreement(a, b):
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.scenarios("agree-auto", *(f"agree-{p}" for p in PRESETS), "noise-reference")
def test_top1_agreement_with_bf16_is_what_the_formats_error_explains(scenario, preset):
    """Teacher-forced over 4 x 1024 tokens in 128-token chunks. The bar: transformers
    with Gaussian noise of the preset's reconstruction NMSE on every K and V row past
    the sink agrees with clean transformers at rate A; KVarN (whose sink and newest
    rows are fp16) must agree with bf16 at least A - 0.02."""
    bf16, run = scenario("agree-auto"), scenario(f"agree-{preset}")
    noise = scenario("noise-reference")
    served = _agreement(run["top1"], bf16["top1"])
    expected = _agreement(noise[preset], noise["clean"])
    deltas = [abs(x - y) for ra, rb in zip(run["forced_logprob"], bf16["forced_logprob"])
              for x, y in zip(ra, rb)]
    print(f"{preset}: top-1 agreement {served:.4f} (noise bar {expected:.4f}), mean "
          f"|dlogprob| {sum(deltas) / len(deltas):.4f}, max {max(deltas):.3f}")
    assert served >= expected - 0.02


@pytest.mark.scenarios("agree-auto", "agree-fp8", *(f"agree-{p}" for p in PRESETS))
def test_capacity_at_the_same_kv_memory_is_near_each_formats_ideal(scenario):
    from vllm.kvarn import Preset

    head_dim = 128
    bf16 = scenario("agree-auto")["pool_tokens"]
    ideal = {"fp8": 2.0, **{p: 4 * head_dim / Preset.parse(p).bytes_per_token(head_dim)
                           for p in PRESETS}}
    for name, want in ideal.items():
        ratio = scenario(f"agree-{name}")["pool_tokens"] / bf16
        print(f"{name}: {ratio:.3f}x bf16's KV pool tokens, ideal {want:.3f}x")
        assert ratio >= 0.85 * want, name


@pytest.mark.scenarios("kvarn-extensible-graphs")
def test_kvarn_serves_under_the_extensible_kv_cache(scenario):
    run = scenario("kvarn-extensible-graphs")
    print(f"KVarN, extensible KV cache {run['extensible_kv_cache']}: pool "
          f"{run['pool_tokens']} tokens, {run['prefix_hits']:.0f} prefix-hit tokens")
    if run["extensible_kv_cache"] is not None:  # 0.34.0 on: it stays on for KVarN
        assert run["extensible_kv_cache"] is True
    assert run["broken"] == [] and run["finished"] > 128

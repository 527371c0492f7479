"""Prefix caching on the 27B-shaped hybrid (Gated DeltaNet state snapshots in align mode
beside the attention cache, bf16 and KVarN): a conversation's later turns are served
mostly from the cache, their first token comes sooner than a cold prefill of the same
length, and every answer stays the copy; eight conversations in a pool too small for
them are preempted and evicted and still answer right."""
import pytest

from tests.gpu.specs import CACHES27


@pytest.mark.parametrize("cache", list(CACHES27))
@pytest.mark.scenarios(*(f"conv27-{c}" for c in CACHES27))
def test_a_conversation_on_the_27b_shaped_hybrid_reuses_its_prefix(scenario, cache):
    run = scenario(f"conv27-{cache}")
    turns, block = run["turns"], run["block_size"]
    for i, turn in enumerate(turns):
        print(f"{cache} turn {i + 1}: {turn['prompt_tokens'][0]} prompt tokens, "
              f"{turn['cached_tokens'][0]} from the cache, first token "
              f"{turn['first_token_s']:.3f} s (cold {turn['cold_first_token_s']:.3f} s); "
              f"pool {run['pool_tokens']} tokens in blocks of {block}, mamba cache mode "
              f"{run['mamba_cache_mode']}")
        assert turn["first_right"] == 1 and turn["answers_right"] == 1, (i, turn)
    for before, turn in zip(turns, turns[1:]):
        # What the last turn computed: its prompt and all but the last answer token; the
        # DeltaNet state is kept at block boundaries only.
        computed = before["prompt_tokens"][0] + run["answer_tokens"] - 1
        assert turn["cached_tokens"][0] >= computed // block * block - block, turn
        assert turn["first_token_s"] < turn["cold_first_token_s"], turn


@pytest.mark.parametrize("cache", list(CACHES27))
@pytest.mark.scenarios(*(f"crowd27-{c}" for c in CACHES27))
def test_conversations_crowding_a_small_pool_are_preempted_and_stay_right(scenario, cache):
    run = scenario(f"crowd27-{cache}")
    print(f"{cache}: {run['preemptions']:.0f} preemptions; cached tokens per turn "
          f"{[t['cached_tokens'] for t in run['turns']]}")
    assert run["preemptions"] > 0, "the pool held every conversation: shrink it"
    for turn in run["turns"]:
        assert turn["answers_right"] == run["conversations"], turn
        assert turn["first_right"] == run["conversations"], turn

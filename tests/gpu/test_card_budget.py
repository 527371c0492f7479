"""--kiln-profile card=24g on a model with the deployment's weight budget (deploy27: the
27B's layer shapes, 15 GiB of weights, an MTP layer and a DFlash2 drafter), each
combination of ctx x spec x prefix-cache served alone inside a 24 GB card's memory:
every one boots or is refused at start-up with its reason, serves four seats and one
long prompt without the GPU's processes passing 24 GiB, and ctx=huge's KV pool holds at
least 1.2x upstream's int4_per_token_head pool with the same speculator."""
import pytest

from tests.gpu.specs import CARD_BUDGET_MIB, CARD_SPECS, SCENARIOS

CARD24 = [n for n in SCENARIOS if n.startswith("card24-") and "-int4-" not in n]
# KVarN takes the draft-free methods only until issue 27 item 2 lands.
REFUSED = {f"card24-huge-{spec}{pc}": "KVarN serves draft-free speculation only"
           for spec in ("mtp", "dflash2") for pc in ("", "-pc")}


@pytest.mark.parametrize("name", CARD24)
@pytest.mark.scenarios(*CARD24)
def test_every_card_24g_profile_boots_and_serves_within_24_gib(scenario, name):
    run = scenario(name)
    if name in REFUSED:
        assert REFUSED[name] in run.get("refused", ""), run
        return
    assert "refused" not in run, run["refused"]
    print(f"{name}: pool {run['pool_tokens']} tokens, max-model-len {run['max_model_len']}, "
          f"GPU {run['used_mib_after_seats']} MiB after four seats, "
          f"{run['used_mib_after_long']} MiB after a {run['long_prompt_tokens']}-token prompt")
    assert run["seats_answered"] == [64] * 4 and run["long_answered"] == 32, run
    assert max(run["used_mib_after_seats"], run["used_mib_after_long"]) <= CARD_BUDGET_MIB
    assert run["max_model_len"] >= 32768, run


@pytest.mark.parametrize("spec", [s for s in CARD_SPECS if f"card24-huge-{s}-pc" not in REFUSED])
@pytest.mark.scenarios(*(f"card24-{c}-{s}-pc" for c in ("huge", "int4") for s in CARD_SPECS))
def test_ctx_huge_holds_more_than_upstreams_int4_cache_in_24_gib(scenario, spec):
    huge, int4 = scenario(f"card24-huge-{spec}-pc"), scenario(f"card24-int4-{spec}-pc")
    ratio = huge["pool_tokens"] / int4["pool_tokens"]
    print(f"spec={spec}: KVarN {huge['pool_tokens']} tokens, int4_per_token_head "
          f"{int4['pool_tokens']}: {ratio:.2f}x")
    assert ratio >= 1.2

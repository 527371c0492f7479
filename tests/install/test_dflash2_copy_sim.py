"""Lookup drafting on the copying model: k + 1 tokens per step.

The copy model (kiln tiny-model --copy) runs in transformers on CPU for its real
greedy continuation; a speculative loop then drafts each step with the fork's own
history logic (vllm/fork/spec_lookup.py: match, chain, adaptive length, assembly)
next to a drafter that proposes random tokens, and greedy verification accepts the
drafts' leading run that equals the continuation plus one bonus token.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kiln.testing import tinymodel
from vllm.fork import spec_lookup
from vllm.fork.spec_lookup import TrustState

transformers = pytest.importorskip("transformers")

NEW = 64


@pytest.fixture(scope="module")
def copy_models(tmp_path_factory) -> dict[int, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("copy-sim")
    out = {}
    for period in (100, 12):
        folder = tinymodel.build(root / f"p{period}",
                                 spec=tinymodel.preset("d64", copy_period=period))
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        out[period] = (folder, model)
    return out


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def simulate(prompt: list[int], truth: list[int], verify_len: int, draft_len: int,
             lookup: bool, chains: bool) -> list[int]:
    """Tokens emitted per verify step, drafting as KilnDFlash2Speculator does."""
    rng = random.Random(0)
    cap = len(prompt) + len(truth) + verify_len + 2
    tokens = torch.zeros(1, cap, dtype=torch.int32)
    slot = torch.tensor([0])
    state = TrustState(1, verify_len, torch.device("cpu"))
    # The prefill step emits the first token; the request starts afresh.
    history = prompt + truth[:1]
    state.reset(slot)
    emitted = 1
    per_step = []
    while len(history) - len(prompt) + verify_len + 1 <= len(truth):
        tokens[0, : len(history)] = torch.tensor(history, dtype=torch.int32)
        length = torch.tensor([len(history)])
        state.observe(tokens, slot, length, torch.tensor([emitted], dtype=torch.int32))
        match = spec_lookup.match_history(tokens, slot, length, 2, 5, 1024)
        chain = torch.tensor([chains])  # greedy request
        cont, available = spec_lookup.continuation(tokens, slot, match, verify_len, chain)
        trust = state.trust[slot]
        covers = spec_lookup.chain_covers(match, chain, trust, verify_len)
        usable = available if lookup else available & covers[:, None]
        drafter = torch.tensor([[rng.randrange(3, 512) for _ in range(draft_len)]])
        pad = torch.tensor([history[-1]])
        drafts = spec_lookup.assemble(cont, usable, trust, drafter, pad)[0].tolist()
        state.record(slot, length, cont, available, torch.tensor([verify_len]))
        # Greedy verification against the target's own continuation.
        done = len(history) - len(prompt)
        accepted = 0
        while accepted < verify_len and drafts[accepted] == truth[done + accepted]:
            accepted += 1
        emitted = accepted + 1
        history = history + truth[done:done + emitted]
        per_step.append(emitted)
    return per_step


def test_the_copy_models_greedy_output_is_the_copy(copy_models):
    for period, (folder, model) in copy_models.items():
        prompt = tinymodel.copy_prompt(folder, 3 * period + 5, seed=period)
        assert _greedy(model, prompt, NEW) == tinymodel.copy_continuation(prompt, NEW, period)


@pytest.mark.parametrize("verify_len,draft_len", [(7, 7), (15, 7)])
def test_lookup_gives_k_plus_one_tokens_per_step(copy_models, verify_len, draft_len):
    folder, model = copy_models[100]
    prompt = tinymodel.copy_prompt(folder, 300, seed=3)
    truth = _greedy(model, prompt, NEW)
    for lookup, chains in ((True, True), (True, False), (False, True)):
        if not lookup and verify_len > draft_len:
            continue  # a verify block longer than the drafter's needs lookup drafting
        steps = simulate(prompt, truth, verify_len, draft_len, lookup, chains)
        assert steps and steps == [verify_len + 1] * len(steps), (lookup, chains, steps)


def test_a_chain_runs_past_the_history_where_the_period_is_shorter_than_the_block(
        copy_models):
    folder, model = copy_models[12]
    prompt = tinymodel.copy_prompt(folder, 40, seed=5)
    truth = _greedy(model, prompt, NEW)
    chained = simulate(prompt, truth, 15, 7, lookup=True, chains=True)
    assert chained == [16] * len(chained)
    # Without chains the history holds 12 tokens past the match; the random drafter
    # fills nothing useful after them, so the step ends at the period's edge.
    plain = simulate(prompt, truth, 15, 7, lookup=True, chains=False)
    assert plain and set(plain) == {13}


def test_without_the_history_the_random_drafter_gets_one_token_per_step(copy_models):
    folder, model = copy_models[100]
    prompt = tinymodel.copy_prompt(folder, 300, seed=3)
    truth = _greedy(model, prompt, 32)
    steps = simulate(prompt, truth, 7, 7, lookup=False, chains=False)
    assert steps and max(steps) <= 2 and sum(steps) / len(steps) < 1.2

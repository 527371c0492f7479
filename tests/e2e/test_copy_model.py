"""The copying tiny model (`tiny-model --copy`), run in transformers.

Greedy decoding continues copy_prompt exactly, also with the key/value noise a
4-bit/2-bit KV cache adds, and stops doing so exactly where the cached rows it
reads are broken: the checks the GPU tier makes across KV-cache paths are not
blind to the cache.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.testing import tinymodel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# At most 127, so every block-boundary length below holds a full period.
PERIOD = 100
LENGTHS = [PERIOD + 1, 127, 128, 129, 255, 256, 513, 2000]
NEW = 64
# KVarN k4v2: key NMSE ~0.01, value NMSE ~0.25.
KEY_NOISE, VALUE_NOISE = 0.1, 0.5

CONFIGS = {
    "d64-fp32": tinymodel.preset("d64", copy_period=PERIOD),
    "d64-bf16-3layers-gqa": tinymodel.preset(
        "d64", dtype="bfloat16", num_layers=3, num_heads=4, num_kv_heads=2, copy_period=PERIOD
    ),
    "d128-fp32": tinymodel.preset("d128", copy_period=PERIOD),
    "d128-bf16": tinymodel.preset("d128", dtype="bfloat16", copy_period=PERIOD),
}
SPECIAL_IDS = set(range(len(tinymodel.SPECIAL_TOKENS)))


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("copy")
    built: dict[str, tuple[Path, object]] = {}

    def get(name: str, spec: tinymodel.TinySpec | None = None):
        if name not in built:
            folder = tinymodel.build(root / name, spec=spec or CONFIGS[name])
            model = transformers.AutoModelForCausalLM.from_pretrained(folder)
            built[name] = (folder, model.eval())
        return built[name]

    return get


def greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy generate over a left-padded batch."""
    width = max(map(len, prompts))
    pad = 0  # <|endoftext|>, masked out
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=pad,
        )
    return out[:, width:].tolist()


@contextmanager
def kv_noise(model, key_rel: float, value_rel: float, seed: int = 0) -> Iterator[list[int]]:
    """Seeded Gaussian noise of the given relative size (per head row) on every
    key (after k_norm: what RoPE turns and the cache holds, up to that rotation)
    and value (v_proj's output) the model computes."""
    gen = torch.Generator().manual_seed(seed)
    calls = [0]

    def add(rel: float, heads: int | None):
        def hook(module, args, out):
            calls[0] += 1
            x = out.float()
            if heads:
                x = x.unflatten(-1, (heads, -1))
            rms = x.pow(2).mean(-1, keepdim=True).sqrt()
            x = x + torch.randn(x.shape, generator=gen) * rel * rms
            return (x.flatten(-2) if heads else x).to(out.dtype)

        return hook

    kv_heads = model.config.num_key_value_heads
    handles = []
    for layer in model.model.layers:
        handles.append(layer.self_attn.k_norm.register_forward_hook(add(key_rel, None)))
        handles.append(layer.self_attn.v_proj.register_forward_hook(add(value_rel, kv_heads)))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def check_copies(folder: Path, model, lengths: list[int], seed: int) -> None:
    period = tinymodel.read_spec(folder).copy_period
    prompts = [tinymodel.copy_prompt(folder, n, seed=seed + i) for i, n in enumerate(lengths)]
    got = greedy(model, prompts, NEW)
    for prompt, tokens in zip(prompts, got):
        want = tinymodel.copy_continuation(prompt, NEW, period)
        wrong = [i for i, (a, b) in enumerate(zip(tokens, want)) if a != b]
        assert not wrong, (
            f"prompt of {len(prompt)}: {len(wrong)} of {NEW} wrong, first at {wrong[0]}"
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_continues_copy_prompt(copy_model, name: str) -> None:
    folder, model = copy_model(name)
    check_copies(folder, model, LENGTHS, seed=1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_copies_through_kv_quantization_noise(copy_model, name: str) -> None:
    folder, model = copy_model(name)
    prompt = tinymodel.copy_prompt(folder, 300, seed=7)
    with torch.no_grad():
        clean = model(torch.tensor([prompt])).logits
        with kv_noise(model, KEY_NOISE, VALUE_NOISE) as calls:
            noisy = model(torch.tensor([prompt])).logits
            # The noise is there and moves the logits, well beyond rounding.
            assert calls[0] == 2 * model.config.num_hidden_layers
            assert float((noisy - clean).abs().max()) > 0.5
            check_copies(folder, model, LENGTHS, seed=11)


def test_copies_at_the_edge_of_max_positions(copy_model) -> None:
    folder, model = copy_model("d64-fp32")
    limit = model.config.max_position_embeddings
    check_copies(folder, model, [limit - NEW], seed=3)


def test_attention_reads_the_row_period_minus_one_back(copy_model) -> None:
    folder, _ = copy_model("d128-fp32")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    length = 2 * PERIOD + 37
    prompt = tinymodel.copy_prompt(folder, length, seed=5)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_attentions=True)
    queries = torch.arange(PERIOD - 1, length)
    for weights in out.attentions:  # per layer: [batch, heads, query, key]
        on_target = weights[0][:, queries, queries - (PERIOD - 1)]
        assert float(on_target.min()) > 0.9999


def test_copies_any_sequence_by_position(copy_model) -> None:
    folder, model = copy_model("d64-fp32")
    rng = random.Random(9)
    prompt = [rng.randrange(len(SPECIAL_IDS), 512) for _ in range(3 * PERIOD + 17)]
    assert greedy(model, [prompt], NEW)[0] == tinymodel.copy_continuation(prompt, NEW, PERIOD)


def test_special_tokens_are_never_produced(copy_model) -> None:
    folder, model = copy_model("d64-bf16-3layers-gqa")
    prompt = tinymodel.copy_prompt(folder, 2 * PERIOD + 50, seed=2)
    # Even where the copied token is special, or before a full period.
    for at in (10, PERIOD + 3, PERIOD + 40):
        prompt[at] = at % len(SPECIAL_IDS)
    with torch.no_grad():
        picks = model(torch.tensor([prompt])).logits[0].argmax(-1).tolist()
    assert not SPECIAL_IDS & set(picks)


def decode(model, prompt: list[int], n: int, corrupt=None) -> list[int]:
    """Greedy decoding by hand, so the cache can be broken after the prefill."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        if corrupt is not None:
            for layer in cache.layers:  # keys, values: [batch, kv heads, position, dim]
                corrupt(layer.keys, layer.values)
        token = out.logits[0, -1].argmax()
        tokens = [int(token)]
        for _ in range(n - 1):
            out = model(token.view(1, 1), past_key_values=cache, use_cache=True)
            token = out.logits[0, -1].argmax()
            tokens.append(int(token))
    return tokens


def _zero_keys(lo: int, hi: int):
    def corrupt(keys, values):
        keys[:, :, lo:hi] = 0

    return corrupt


def _values_off_by_one(lo: int, hi: int):
    def corrupt(keys, values):
        values[:, :, lo:hi] = values[:, :, lo + 1 : hi + 1].clone()

    return corrupt


def _stale_block(lo: int, hi: int):
    # A block table entry that points at an older block: its keys and values.
    def corrupt(keys, values):
        keys[:, :, lo:hi] = keys[:, :, 2 * lo - hi : lo].clone()
        values[:, :, lo:hi] = values[:, :, 2 * lo - hi : lo].clone()

    return corrupt


@pytest.mark.parametrize("name", ["d64-fp32", "d128-bf16"])
@pytest.mark.parametrize("breakage", [_zero_keys, _values_off_by_one, _stale_block])
def test_a_broken_cache_breaks_exactly_the_tokens_that_read_it(copy_model, name, breakage) -> None:
    folder, model = copy_model(name)
    length, width = 3 * PERIOD + 20, 24
    prompt = tinymodel.copy_prompt(folder, length, seed=4)
    want = tinymodel.copy_continuation(prompt, NEW, PERIOD)
    assert decode(model, prompt, NEW) == want  # the hand-rolled loop itself is right
    # Generated token k reads the row at length - PERIOD + k.
    lo = length - PERIOD + 1
    got = decode(model, prompt, NEW, corrupt=breakage(lo, lo + width))
    broken = range(1, 1 + width)
    wrong = [k for k in broken if got[k] != want[k]]
    assert len(wrong) >= width - 2, (len(wrong), got, want)
    # Tokens that read only intact rows are still right.
    assert got[0] == want[0] and got[1 + width :] == want[1 + width :]


def test_default_period_from_the_cli_rebuilds_identically_and_copies(
    copy_model, tmp_path: Path
) -> None:
    from kiln.cli import main

    out = tmp_path / "cli"
    argv = ["tiny-model", "--size", "d64", "--dtype", "bfloat16", "--copy", "--out", str(out)]
    assert main(argv) == 0
    spec = tinymodel.read_spec(out)
    assert spec.copy_period == tinymodel.DEFAULT_COPY_PERIOD
    again = tinymodel.build(tmp_path / "lib", spec=tinymodel.preset("d64", dtype="bfloat16",
                                                                   copy_period=spec.copy_period))
    assert tinymodel.tree_digest(again) == tinymodel.tree_digest(out)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    stamp = json.loads((out / tinymodel.STAMP).read_text())
    assert stamp["copy"] == tinymodel.copy_design(spec).as_json()
    assert stamp["copy"]["margin_nats"] >= tinymodel.COPY_MIN_MARGIN
    assert config["rope_parameters"]["rope_theta"] == stamp["copy"]["rope_theta"]
    _, model = copy_model("cli-default", spec)
    P = spec.copy_period
    check_copies(out, model, [P, P + 1, 4 * P + 3], seed=21)
    with kv_noise(model, KEY_NOISE, VALUE_NOISE, seed=1):
        check_copies(out, model, [P + 1, 1500], seed=31)


def test_copy_prompt_and_continuation() -> None:
    spec = CONFIGS["d64-fp32"]
    prompt = tinymodel.copy_prompt(spec, 2 * PERIOD + 30, seed=3)
    assert len(prompt) == 2 * PERIOD + 30
    assert prompt[:PERIOD] == prompt[PERIOD : 2 * PERIOD] and prompt[2 * PERIOD :] == prompt[:30]
    assert not SPECIAL_IDS & set(prompt) and max(prompt) < spec.vocab_size
    assert len(set(prompt[:PERIOD])) > PERIOD // 2
    assert prompt == tinymodel.copy_prompt(spec, 2 * PERIOD + 30, seed=3)
    assert prompt != tinymodel.copy_prompt(spec, 2 * PERIOD + 30, seed=4)
    assert tinymodel.copy_prompt(spec, 50, seed=3) == prompt[:50]
    periodic = prompt[30:PERIOD] + prompt[:PERIOD] * 3
    assert tinymodel.copy_continuation(prompt, 3 * PERIOD, PERIOD) == periodic[: 3 * PERIOD]
    with pytest.raises(KilnError, match="no full period"):
        tinymodel.copy_continuation(prompt[: PERIOD - 1], 5, PERIOD)
    with pytest.raises(KilnError, match="copy model"):
        tinymodel.copy_prompt(tinymodel.TinySpec(), 10, seed=0)


def test_copy_prompt_reads_the_period_from_a_folder(copy_model) -> None:
    folder, _ = copy_model("d128-fp32")
    assert tinymodel.copy_prompt(folder, 500, seed=8) == tinymodel.copy_prompt(
        CONFIGS["d128-fp32"], 500, seed=8
    )


def test_copy_rebuild_gives_identical_bytes(tmp_path: Path) -> None:
    spec = CONFIGS["d128-bf16"]
    first = tinymodel.build(tmp_path / "a", spec=spec)
    again = tinymodel.build(tmp_path / "b", spec=spec)
    assert tinymodel.tree_digest(first) == tinymodel.tree_digest(again)


def test_a_shape_too_weak_to_copy_is_refused() -> None:
    weak = tinymodel.TinySpec(hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=8,
                              copy_period=PERIOD)
    with pytest.raises(KilnError, match=r"--head-dim 8 .* only \d+\.\d nats"):
        tinymodel.copy_design(weak)


def test_large_preset_copies_with_margin_over_all_its_positions() -> None:
    spec = tinymodel.preset("large", copy_period=tinymodel.DEFAULT_COPY_PERIOD)
    design = tinymodel.copy_design(spec)
    assert design.margin_nats >= tinymodel.COPY_MIN_MARGIN
    assert design.code_dims >= 1000 and design.min_code_distance > design.code_dims // 4

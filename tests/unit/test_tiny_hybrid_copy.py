"""The hybrid copying model (``kiln tiny-model --size hybrid27 --copy``): a scaled-down
build that transformers' Qwen3.5 (gated attention, a quarter of each head rotated,
(1 + w) norms, Gated DeltaNet) loads and runs answers with the token one period back,
which copy_continuation states independently; the DeltaNet layers stay in the answer's
path (a non-finite state breaks it); the design at the 27B's shapes keeps its margin.
"""

from __future__ import annotations

import json

import pytest

from kiln.cli import main
from kiln.testing import tinymodel

SMALL = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
             head_dim=64, linear_key_heads=2, linear_value_heads=6, linear_key_dim=32,
             linear_value_dim=32, max_position_embeddings=1024)
PERIOD = 31


@pytest.fixture(scope="module")
def small_copy(tmp_path_factory):
    pytest.importorskip("transformers")
    spec = tinymodel.preset("hybrid27", copy_period=PERIOD, **SMALL)
    return tinymodel.build(tmp_path_factory.mktemp("hybrid-copy") / "m", spec=spec)


def _load(folder):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_small_hybrid_copy_answers_one_period_back_in_transformers(small_copy):
    model = _load(small_copy)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not model.config.tie_word_embeddings
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.25
    for length, seed in ((PERIOD, 1), (3 * PERIOD + 5, 2), (200, 3)):
        prompt = tinymodel.copy_prompt(small_copy, length, seed=seed)
        assert _greedy(model, prompt, 40) == tinymodel.copy_continuation(prompt, 40, PERIOD)


def test_the_answer_needs_the_attention_cache_and_passes_through_deltanet(small_copy):
    """Both full-attention layers write the copied code; with one layer's values
    zeroed the answer still holds (the other copies), with both it is gone. A
    DeltaNet layer's NaN state reaches every logit."""
    torch = pytest.importorskip("torch")
    model = _load(small_copy)
    prompt = tinymodel.copy_prompt(small_copy, 100, seed=5)
    expected = tinymodel.copy_continuation(prompt, 12, PERIOD)
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert full == [3, 7]
    layers = model.model.layers
    with torch.no_grad():
        layers[3].self_attn.v_proj.weight.zero_()
    assert _greedy(model, prompt, 12) == expected
    with torch.no_grad():
        layers[7].self_attn.v_proj.weight.zero_()
    assert _greedy(model, prompt, 12) != expected

    model = _load(small_copy)
    with torch.no_grad():
        model.model.layers[1].linear_attn.dt_bias.fill_(float("nan"))
        logits = model(torch.tensor([prompt])).logits
    assert torch.isnan(logits[0, -1]).all()


def test_deltanet_layers_write_only_outside_the_copy_dims(small_copy):
    torch = pytest.importorskip("torch")
    safetensors = pytest.importorskip("safetensors.torch")
    w = safetensors.load_file(str(small_copy / "model.safetensors"))
    stamp = json.loads((small_copy / "kiln-tiny-model.json").read_text())
    c = stamp["copy"]["code_dims"]
    out = w["model.layers.0.linear_attn.out_proj.weight"].float()
    assert not out[: 2 * c + 1].any() and out[2 * c + 1:].std() > 0.01
    assert w["model.layers.0.linear_attn.in_proj_qkv.weight"].float().std() > 0.01
    assert not w["model.layers.0.mlp.down_proj.weight"].any()
    assert w["mtp.fc.weight"].float().std() > 0.01  # the random hybrid's MTP layer
    # Past the rotated quarter, q_norm acts as 0: (1 + w) with w = -1.
    q_norm = w["model.layers.3.self_attn.q_norm.weight"].float()
    assert torch.equal(q_norm[SMALL["head_dim"] // 4:], torch.full((48,), -1.0))
    assert (q_norm[: SMALL["head_dim"] // 4] != -1).any()


def test_hybrid27_copy_design_keeps_its_margin_at_the_27b_shapes():
    design = tinymodel.copy_design(tinymodel.preset("hybrid27", copy_period=257))
    assert design.margin_nats >= tinymodel.COPY_MIN_MARGIN
    assert design.code_dims == 4 * 256  # every KV head carries part of the code
    assert design.min_code_distance >= design.code_dims // 4


def test_cli_size_hybrid27_copy_names_its_folder_and_period(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "m"
    argv = ["tiny-model", "--size", "hybrid27", "--copy", "--copy-period", str(PERIOD),
            "--out", str(out), *[a for k, v in SMALL.items() for a in (_flag(k), str(v))]]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    assert tinymodel.read_spec(out).copy_period == PERIOD
    assert tinymodel.read_spec(out).hybrid


def _flag(field: str) -> str:
    from kiln.testing.tinymodel.spec import FLAGS

    return FLAGS[field]


def test_a_dflash2_drafter_takes_its_sizes_from_the_hybrid_target(small_copy, tmp_path):
    """The tier's drafter27 for copy27: the drafter reads the target's top-level sizes,
    which a Qwen3.5 text config keeps where a Qwen3 one does."""
    from kiln.testing.tinymodel.drafter import drafter_config, drafter_shapes

    drafter = tinymodel.build_dflash2_drafter(small_copy, tmp_path / "drafter")
    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert (config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (256, 4, 2, 64)
    assert config["dflash_config"]["target_layer_ids"] == list(range(8))

    target = {"hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4,
              "head_dim": 256, "intermediate_size": 17408, "num_hidden_layers": 8,
              "vocab_size": 512}
    spec = tinymodel.DrafterSpec(block_size=16)
    shapes = dict(drafter_shapes(spec, target))
    assert shapes["fc.weight"] == (5120, 8 * 5120)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (24 * 256, 5120)
    assert drafter_config(spec, target)["head_dim"] == 256

"""The Qwen3.5 hybrid that ``kiln tiny-model --size hybrid27`` writes: Qwen3.5 27B's
layer shapes as transformers reads them back, a scaled-down build of the same writer
that transformers loads and runs, every tensor vLLM 0.34.0's Qwen3.5 and MTP loaders
ask for, and the flags' refusals. The expected names and shapes come from
transformers' own model (built on the meta device: no memory) and from the 27B
numbers written out here, not from the generator.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.testing import tinymodel

# Qwen3.5 27B's text config, per layer (the model card's numbers).
HIDDEN, INTERMEDIATE = 5120, 17408
HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_DIM, CONV = 16, 48, 128, 4
LINEAR, FULL = "linear_attention", "full_attention"

# A scaled-down hybrid27: the same generator and layer pattern, written in seconds.
SMALL = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
             head_dim=64, linear_key_heads=2, linear_value_heads=6, linear_key_dim=32,
             linear_value_dim=32)


def _config(spec: tinymodel.TinySpec, tmp_path: Path):
    """The config a streamed build writes for ``spec``, saved and read back."""
    transformers = pytest.importorskip("transformers")
    from kiln.testing.tinymodel.model import streamed_config
    from kiln.testing.tinymodel.tokenizer import CORPUS, train_tokenizer

    streamed_config(spec, train_tokenizer(spec, CORPUS)).save_pretrained(tmp_path)
    return transformers.AutoConfig.from_pretrained(tmp_path)


def _meta_state(config) -> dict[str, tuple[int, ...]]:
    """transformers' Qwen3_5ForCausalLM tensors for ``config``, on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # the embedding, stored once
    return state


def _file_layout(folder: Path) -> dict[str, tuple[int, ...]]:
    safe_open = pytest.importorskip("safetensors").safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def _mtp_expected(config, full_layer: int, layers: int) -> dict[str, tuple[int, ...]]:
    """What vLLM's Qwen3_5MTP loads (vllm/models/qwen3_5/nvidia/mtp.py): under mtp.,
    fc over [embedding; hidden], the two pre-fc norms, a final norm, and full-attention
    decoder layers named as the main model's (taken here from layer ``full_layer``)."""
    d = config.hidden_size
    expected = {
        "mtp.fc.weight": (d, 2 * d),
        "mtp.pre_fc_norm_embedding.weight": (d,),
        "mtp.pre_fc_norm_hidden.weight": (d,),
        "mtp.norm.weight": (d,),
    }
    prefix = f"model.layers.{full_layer}."
    for name, shape in _meta_state(config).items():
        if name.startswith(prefix):
            for i in range(layers):
                expected[f"mtp.layers.{i}." + name[len(prefix):]] = shape
    return expected


def test_hybrid27_config_reads_back_as_qwen35_27b_layers(tmp_path):
    spec = tinymodel.preset("hybrid27")
    config = _config(spec, tmp_path)
    assert type(config).__name__ == "Qwen3_5TextConfig"
    assert config.architectures == ["Qwen3_5ForCausalLM"]
    assert config.layer_types == [LINEAR, LINEAR, LINEAR, FULL] * 2
    assert (config.hidden_size, config.intermediate_size) == (HIDDEN, INTERMEDIATE)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        HEADS, KV_HEADS, HEAD_DIM)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (
        GDN_KEY_HEADS, GDN_VALUE_HEADS)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (GDN_DIM, GDN_DIM)
    assert config.linear_conv_kernel_dim == CONV
    assert config.mtp_num_hidden_layers == 1
    assert config.max_position_embeddings >= 131584
    assert config.initializer_range == 0.02
    assert config.vocab_size == 512  # the tiny tokenizer's
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["dtype"] == "bfloat16"
    assert raw["model_type"] == "qwen3_5_text"  # vLLM's MTP config keys on it
    assert tinymodel.attention_layers(spec) == 2


def test_hybrid27_holds_every_tensor_the_vllm_loaders_read(tmp_path):
    """At the full 27B shapes, without writing them: the main model's tensors are
    transformers' Qwen3_5ForCausalLM's, the 27B numbers give the GDN and gated
    attention sizes, and the MTP tensors are those Qwen3_5MTP loads."""
    spec = tinymodel.preset("hybrid27")
    config = _config(spec, tmp_path)
    ours = dict(tinymodel.hybrid_param_shapes(spec, config.vocab_size))
    main_part = {k: v for k, v in ours.items() if not k.startswith("mtp.")}
    assert main_part == _meta_state(config)
    assert {k: v for k, v in ours.items() if k.startswith("mtp.")} == _mtp_expected(config, 3, 1)

    # vLLM stacks in_proj_qkv + in_proj_z into in_proj_qkvz and in_proj_b + in_proj_a
    # into in_proj_ba; q_proj carries the output gate (attn_output_gate).
    keys, values = GDN_KEY_HEADS * GDN_DIM, GDN_VALUE_HEADS * GDN_DIM
    gdn = "model.layers.4.linear_attn."
    assert ours[gdn + "in_proj_qkv.weight"] == (2 * keys + values, HIDDEN) == (10240, 5120)
    assert ours[gdn + "in_proj_z.weight"] == (values, HIDDEN)
    assert ours[gdn + "in_proj_b.weight"] == ours[gdn + "in_proj_a.weight"] == (48, HIDDEN)
    assert ours[gdn + "conv1d.weight"] == (2 * keys + values, 1, CONV)
    assert ours[gdn + "A_log"] == ours[gdn + "dt_bias"] == (GDN_VALUE_HEADS,)
    assert ours[gdn + "norm.weight"] == (GDN_DIM,)
    assert ours[gdn + "out_proj.weight"] == (HIDDEN, values)
    attn = "model.layers.7.self_attn."
    assert ours[attn + "q_proj.weight"] == (2 * HEADS * HEAD_DIM, HIDDEN)
    assert ours[attn + "k_proj.weight"] == ours[attn + "v_proj.weight"] == (1024, HIDDEN)
    assert ours[attn + "o_proj.weight"] == (HIDDEN, HEADS * HEAD_DIM)
    assert {i for i in range(8) if f"model.layers.{i}.self_attn.q_proj.weight" in ours} == {3, 7}


def test_hybrid27_parameter_count():
    # Per layer from the 27B numbers: MLP 3 x 5120 x 17408; GDN in_proj_qkv, _z,
    # _b, _a, conv1d, A_log, dt_bias, its norm, out_proj; gated attention q (x2), k,
    # v, o and the q/k norms; two layer norms. MTP: fc, 3 norms, one full layer.
    d, mlp, norms = HIDDEN, 3 * HIDDEN * INTERMEDIATE, 2 * HIDDEN
    k, v, h = GDN_KEY_HEADS * GDN_DIM, GDN_VALUE_HEADS * GDN_DIM, GDN_VALUE_HEADS
    gdn = d * (2 * k + v) + d * v + 2 * d * h + (2 * k + v) * CONV + 2 * h + GDN_DIM + v * d
    full = d * 2 * HEADS * HEAD_DIM + 2 * d * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * d
    full += 2 * HEAD_DIM
    main_model = 512 * d + 6 * (gdn + mlp + norms) + 2 * (full + mlp + norms) + d
    mtp = 2 * d * d + 3 * d + full + mlp + norms
    count = tinymodel.param_count(tinymodel.preset("hybrid27"), 512)
    assert count == main_model + mtp == 3_471_475_520
    assert main_model == 3_046_776_128  # the 8 decoder layers, embedding and norm


def test_small_hybrid27_loads_in_transformers_and_runs(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = tinymodel.preset("hybrid27", **SMALL)
    out = tinymodel.build(tmp_path / "m", spec=spec)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert not info["unexpected_keys"], info  # transformers drops mtp.* by its own rule
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.dtype == torch.bfloat16
    layout = _file_layout(out)
    main_part = {k: v for k, v in layout.items() if not k.startswith("mtp.")}
    assert main_part == _meta_state(model.config)
    assert {k: v for k, v in layout.items() if k.startswith("mtp.")} == _mtp_expected(
        model.config, 3, 1)

    ids = torch.tensor([list(range(3, 67))])
    with torch.no_grad():
        result = model(ids, output_hidden_states=True)
    logits = result.logits.float()
    assert torch.isfinite(logits).all()
    # A sane random model: logits neither collapsed nor blown up, and the residual
    # stream stays well inside bf16's range through all 8 layers.
    assert 0.05 < float(logits.std()) < 10
    assert max(float(h.float().abs().max()) for h in result.hidden_states) < 100
    assert len({int(t) for t in logits[0].argmax(-1)}) > 4  # not one token everywhere


def test_small_hybrid27_weights_follow_the_documented_init(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors = pytest.importorskip("safetensors.torch")
    spec = tinymodel.preset("hybrid27", **SMALL)
    first = tinymodel.build(tmp_path / "a", spec=spec)
    assert tinymodel.tree_digest(tinymodel.build(tmp_path / "b", spec=spec)) == (
        tinymodel.tree_digest(first))
    w = {k: t.float() for k, t in safetensors.load_file(str(first / "model.safetensors")).items()}
    q = w["model.layers.3.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - 0.02) < 0.001
    assert not torch.equal(q, w["model.layers.7.self_attn.q_proj.weight"])
    # Qwen3.5's (1 + w) norms start at the identity, the GDN output norm (w x) at one.
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.3.self_attn.q_norm.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.layers.0.post_attention_layernorm.weight"):
        assert not w[name].any(), name
    assert (w["model.layers.0.linear_attn.norm.weight"] == 1).all()
    a = w["model.layers.1.linear_attn.A_log"].exp()
    assert a.min() >= 1 - 0.05 and a.max() <= 16 * 1.01 and a.std() > 1
    dt = torch.nn.functional.softplus(w["model.layers.1.linear_attn.dt_bias"])
    assert dt.min() >= 1e-3 * 0.97 and dt.max() <= 0.1 * 1.03
    conv = w["model.layers.2.linear_attn.conv1d.weight"]
    assert conv.abs().max() <= 0.5 and conv.std() > 0.2


def test_hybrid_defaults_keep_old_fingerprints():
    """Only fields set away from their defaults reach the stamp, so the tiny hybrid
    built before these fields existed keeps its cache name."""
    from kiln.testing.tinymodel.spec import spec_dict

    assert set(spec_dict(tinymodel.TinySpec(hybrid=True))) == {
        "hybrid", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
        "num_kv_heads", "head_dim", "max_position_embeddings", "initializer_range", "seed"}
    assert tinymodel.layer_types(tinymodel.TinySpec(hybrid=True, num_layers=3)) == [
        LINEAR, LINEAR, FULL]
    recorded = spec_dict(tinymodel.preset("hybrid27"))
    assert recorded["linear_value_heads"] == 48 and recorded["mtp_layers"] == 1
    assert "device" not in recorded


def test_cli_size_hybrid27_with_overrides_reaches_the_config(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "m"
    argv = ["tiny-model", "--size", "hybrid27", "--hidden", "128", "--intermediate", "256",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--linear-key-heads", "1",
            "--linear-value-heads", "3", "--linear-key-dim", "32", "--linear-value-dim", "32",
            "--layers", "4", "--out", str(out)]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == [LINEAR, LINEAR, LINEAR, FULL]
    assert (config["linear_num_key_heads"], config["linear_num_value_heads"]) == (1, 3)
    assert config["mtp_num_hidden_layers"] == 1 and config["dtype"] == "bfloat16"
    assert _file_layout(out)["mtp.fc.weight"] == (128, 256)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--linear-key-heads", "4"], ["--linear-key-heads", "only apply with --hybrid"]),
        (["--mtp-layers", "1"], ["--mtp-layers", "only apply with --hybrid"]),
        (["--hybrid", "--linear-key-heads", "3", "--linear-value-heads", "4"],
         ["--linear-key-heads 3 --linear-value-heads 4", "multiple"]),
        (["--hybrid", "--linear-value-dim", "0"], ["--linear-value-dim 0", "positive"]),
        (["--size", "hybrid27", "--full-attention-interval", "9"],
         ["--full-attention-interval 9", "1 to --layers (8)"]),
        (["--hybrid", "--mtp-layers", "1"], ["--mtp-layers 1", "--init seeded"]),
        (["--size", "hybrid27", "--mtp-layers", "-1"], ["--mtp-layers -1", ">= 0"]),
        (["--size", "hybrid27", "--head-dim", "36"], ["--head-dim 36", "multiple of 8"]),
        (["--device", "cuda"], ["--device cuda", "--init seeded"]),
        (["--size", "d64", "--copy", "--device", "cuda"], ["--device cuda", "without --copy"]),
    ],
)
def test_bad_hybrid_flags_are_refused_naming_the_flag(argv, words, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["tiny-model", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln tiny-model: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)
    assert not out.exists()


def test_cuda_draws_without_a_cuda_device_are_refused_and_leave_nothing(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "never"
    argv = ["tiny-model", "--size", "hybrid27", "--device", "cuda", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln tiny-model: error: --device cuda: ") and "no CUDA" in err
    assert list(tmp_path.iterdir()) == []


def test_help_names_hybrid27_and_its_flags():
    from kiln.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["tiny-model"]
    text = " ".join(sub.format_help().split())
    assert "hybrid27 Qwen3.5 27B's layer shapes" in text
    for flag in ("--linear-key-heads", "--linear-value-heads", "--full-attention-interval",
                 "--mtp-layers", "--device"):
        assert flag in text, flag
    assert str(round(tinymodel.param_count(tinymodel.preset("hybrid27")) / 1e9, 2)) in text

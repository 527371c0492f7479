"""The tiny model generator: same bytes every time, a usable tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.testing import tinymodel


@pytest.mark.skipif(
    bool(os.environ.get("E2E_MODEL_DIR")), reason="serving a model from elsewhere"
)
def test_rebuild_gives_identical_bytes(tiny_model: Path, tmp_path: Path) -> None:
    fresh = tinymodel.build(tmp_path / "again")
    assert tinymodel.tree_digest(fresh) == tinymodel.tree_digest(tiny_model)


def test_tokenizer_round_trips_and_has_chat_template(tiny_model: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    text = "Numbers: 1,200 degrees; ünïcödé and emoji 🔥 survive."
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: nothing lost
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["vocab_size"] == len(tok)
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")


# ---------------------------------------------------------------------------
# Sizes, dtypes, the seeded init and the flags.


def _tensors(folder: Path) -> dict:
    safetensors = pytest.importorskip("safetensors.torch")
    return safetensors.load_file(str(folder / "model.safetensors"))


def test_seeded_rebuild_gives_identical_bytes_and_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    spec = tinymodel.preset("d64", dtype="bfloat16", num_layers=3)
    first = tinymodel.build(tmp_path / "a", spec=spec)
    again = tinymodel.build(tmp_path / "b", spec=spec)
    assert tinymodel.tree_digest(first) == tinymodel.tree_digest(again)
    other_seed = tinymodel.build(tmp_path / "c", spec=tinymodel.preset("d64", dtype="bfloat16",
                                                                      num_layers=3, seed=1))
    assert tinymodel.tree_digest(other_seed) != tinymodel.tree_digest(first)

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        first, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 3 and model.config.head_dim == 64
    assert tinymodel.param_count(spec, model.config.vocab_size) == sum(
        p.numel() for p in model.parameters()
    )
    weights = _tensors(first)
    q = weights["model.layers.1.self_attn.q_proj.weight"].float()
    assert abs(float(q.std()) - spec.initializer_range) < 0.02 * spec.initializer_range
    assert abs(float(q.mean())) < 0.01
    # Each tensor has its own stream: two same-shape matrices differ.
    assert not torch.equal(q, weights["model.layers.2.self_attn.q_proj.weight"].float())
    assert torch.equal(weights["model.norm.weight"].float(), torch.ones(spec.hidden_size))


def test_seeded_writer_matches_transformers_layout(tmp_path: Path) -> None:
    """The streamed writer's config, generation config and tensor names/shapes
    are what transformers' own save writes for the same sizes."""
    safe_open = pytest.importorskip("safetensors").safe_open
    spec = tinymodel.preset("d64", num_kv_heads=2)
    ours = tinymodel.build(tmp_path / "seeded", spec=spec)
    theirs = tinymodel.build(tmp_path / "hf", spec=tinymodel.preset("d64", num_kv_heads=2,
                                                                    init="transformers"))
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (ours / name).read_text() == (theirs / name).read_text(), name

    def layout(folder: Path) -> dict:
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__

    assert layout(ours) == layout(theirs)
    assert tinymodel.tree_digest(ours) != tinymodel.tree_digest(theirs)


def test_dtype_only_rounds_the_same_weights(tiny_model: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if json.loads((tiny_model / "config.json").read_text())["dtype"] != "float32":
        pytest.skip("E2E_MODEL_DIR is not the fp32 tiny model")
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        folder = tinymodel.build(tmp_path / dtype, spec=tinymodel.TinySpec(dtype=dtype))
        config = json.loads((folder / "config.json").read_text())
        assert config["dtype"] == dtype
        low, full = _tensors(folder), _tensors(tiny_model)
        assert low.keys() == full.keys()
        for name, tensor in low.items():
            assert tensor.dtype == torch_dtype, name
            assert torch.equal(tensor, full[name].to(torch_dtype)), name


def test_cli_size_and_flags_reach_the_config(tmp_path: Path) -> None:
    from kiln.cli import main

    out = tmp_path / "m"
    argv = ["tiny-model", "--size", "d128", "--layers", "3", "--kv-heads", "1",
            "--intermediate", "96", "--max-positions", "1024", "--dtype", "float16",
            "--out", str(out)]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (3, 1)
    assert (config["intermediate_size"], config["max_position_embeddings"]) == (96, 1024)
    assert config["dtype"] == "float16"
    # Not overridden: the preset's.
    kept = (config["hidden_size"], config["num_attention_heads"], config["head_dim"])
    assert kept == (256, 4, 128)
    tensors = _tensors(out)
    assert tensors["model.layers.2.self_attn.k_proj.weight"].shape == (128, 256)
    assert {t.dtype for t in tensors.values()} == {pytest.importorskip("torch").float16}


def test_large_preset_is_about_400m_parameters() -> None:
    # param_count is checked against a loaded model above; building the large
    # preset itself (0.8 GB) is left to the GPU tier.
    count = tinymodel.param_count(tinymodel.preset("large"))
    assert 380e6 < count < 420e6, count


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--head-dim", "33"], ["--head-dim 33", "even"]),
        (["--heads", "3", "--kv-heads", "2"], ["--heads 3 --kv-heads 2", "multiple"]),
        (["--layers", "0"], ["--layers 0", "positive"]),
        (["--hidden", "-8"], ["--hidden -8", "positive"]),
        (["--copy-period", "100"], ["--copy-period 100", "only applies with --copy"]),
        (["--copy", "--copy-period", "1"], ["--copy-period 1", ">= 2"]),
        (["--copy", "--copy-period", "5000"], ["--copy-period 5000", "--max-positions (4096)"]),
        (["--copy", "--hidden", "40"], ["--hidden 40", "--hidden >= 49"]),
        (["--copy", "--kv-heads", "1", "--head-dim", "16"], ["--head-dim 16", ">= 24"]),
        (["--copy", "--hybrid"], ["--copy-period 257 --head-dim 32", "needs >= 20",
                                  "a quarter of each head"]),
        (["--hybrid", "--mtp-layers", "1"], ["--mtp-layers 1", "--init seeded"]),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv: list, words: list, tmp_path: Path,
                                               capsys) -> None:
    from kiln.cli import main

    out = tmp_path / "never"
    assert main(["tiny-model", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln tiny-model: error: ")
    for word in words:
        assert word in err, (word, err)
    assert not out.exists()


@pytest.mark.parametrize("argv", [["--dtype", "int8"], ["--size", "huge"], ["--init", "zeros"]])
def test_bad_choices_are_refused_by_the_parser(argv: list, capsys) -> None:
    from kiln.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["tiny-model", *argv])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_help_explains_every_flag_the_sizes_and_the_copy_model() -> None:
    from kiln.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["tiny-model"]
    for action in sub._actions:
        assert action.help and len(action.help) > 10, action.option_strings
    text = sub.format_help()
    for name in tinymodel.PRESETS:
        assert f"  {name} " in text, name
    assert "p + 1 - P" in text and "copy_prompt" in text


def test_a_stale_model_folder_is_rebuilt_and_a_foreign_file_stops_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    spec = tinymodel.preset("d64")
    out = tinymodel.build(tmp_path / "m", spec=spec)
    fresh = tinymodel.tree_digest(out)
    stamp = json.loads((out / tinymodel.STAMP).read_text())
    (out / tinymodel.STAMP).write_text(json.dumps({**stamp, "fingerprint": "an older one"}))
    (out / "config.json").write_text("{}\n")
    assert tinymodel.build(out, spec=spec) == out
    assert tinymodel.tree_digest(out) == fresh
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    (out / tinymodel.STAMP).write_text(json.dumps({**stamp, "fingerprint": "an older one"}))
    (out / "README.md").write_text("mine\n")
    with pytest.raises(KilnError, match="holds README.md, which tiny-model did not write"):
        tinymodel.build(out, spec=spec)
    assert (out / "README.md").read_text() == "mine\n"

"""`kiln trained-model`: the corpus split, the tokenizer, and the tiny size trained on
the CPU for real (loss falls, two builds give the same bytes, transformers loads it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.errors import KilnError
from kiln.testing.tinymodel import tree_digest
from kiln.testing.trained import STAMP, build, held_out_files, is_held_out, load_corpus, preset, stdlib_root

CAP = 256 << 10


def test_the_split_is_fixed_by_path_and_disjoint():
    first, again = load_corpus(stdlib_root(), CAP), load_corpus(stdlib_root(), CAP)
    assert first == again
    train = [f.path for f in first.train]
    held = [f.path for f in first.held_out]
    assert not set(train) & set(held)
    assert train == sorted(train) and held == sorted(held)
    assert all(is_held_out(p) for p in held) and not any(is_held_out(p) for p in train)
    assert sum(f.size for f in first.train) <= CAP
    # The held-out split does not depend on the cap: every hashed-out file, always.
    assert load_corpus(stdlib_root(), 4 * CAP).held_out == first.held_out
    every = len(held) / (len(held) + sum(1 for p in _all_paths() if not is_held_out(p)))
    assert 1 / 32 < every < 1 / 8


def _all_paths() -> list[str]:
    from kiln.testing.trained.corpus import source_paths

    return source_paths(stdlib_root())


def test_a_folder_without_sources_is_one_clear_error(tmp_path: Path):
    (tmp_path / "one.py").write_text("x = 1\n")
    with pytest.raises(KilnError, match="too few .py files"):
        load_corpus(tmp_path, CAP)


def test_the_tokenizer_round_trips_source():
    pytest.importorskip("tokenizers")
    from kiln.testing.trained.tokenizer import train_tokenizer

    corpus = load_corpus(stdlib_root(), CAP)
    tokenizer = train_tokenizer([corpus.read(f) for f in corpus.train], 512)
    assert tokenizer.get_vocab_size() == 512
    text = corpus.read(corpus.held_out[0]) + "\nπ = 'ünïcode' \t\r\n"
    ids = tokenizer.encode(text).ids
    assert len(ids) < len(text.encode())  # merges learned, not bytes alone
    assert tokenizer.decode(ids) == text


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    spec = preset("tiny")
    return (build("tiny", spec, parent=tmp_path_factory.mktemp("a")),
            build("tiny", spec, parent=tmp_path_factory.mktemp("b")))


def test_the_tiny_size_trains_and_two_builds_give_the_same_bytes(two_builds):
    a, b = two_builds
    assert a.name == b.name and a.name.startswith("tiny-")
    assert tree_digest(a) == tree_digest(b)
    record = json.loads((a / STAMP).read_text())
    losses = record["loss"]["values"]
    assert record["loss"]["steps"] == list(range(1, preset("tiny").steps + 1))
    assert losses[-1] < losses[0] - 0.2
    assert sorted(p.name for p in a.iterdir()) == [
        "config.json", "generation_config.json", STAMP, "model.safetensors",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def test_transformers_loads_the_folder_and_its_loss_is_the_trained_one(two_builds):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = two_builds[0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.float32 and model.config.head_dim == 32
    assert model.config.architectures == ["Qwen3ForCausalLM"]
    root, held = held_out_files(folder)
    text = (root / held[0].path).read_text(errors="replace")
    ids = torch.tensor([tokenizer(text)["input_ids"][:128]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    # Trained 8 steps from a uniform guess (ln 512 = 6.24): below it on held-out text.
    assert loss < 6.1


def test_a_second_build_reuses_the_folder(two_builds, capsys):
    a = two_builds[0]
    before = tree_digest(a)
    assert build("tiny", preset("tiny"), parent=a.parent) == a
    assert f"reusing {a}" in capsys.readouterr().out
    assert tree_digest(a) == before


def test_a_foreign_folder_under_the_name_is_refused_and_left_alone(two_builds, tmp_path):
    name = two_builds[0].name
    (tmp_path / name).mkdir()
    (tmp_path / name / "notes.txt").write_text("mine\n")
    with pytest.raises(KilnError, match="exists and is not this trained model; move it away"):
        build("tiny", preset("tiny"), parent=tmp_path)
    assert [p.name for p in (tmp_path / name).iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--size", "tiny", "--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
    (["--size", "tiny", "--steps", "0"], "argument --steps: 0: must be at least 1"),
    (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
])
def test_bad_flags_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trained-model", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_file_as_out_is_one_error_line(tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    assert main(["trained-model", "--size", "tiny", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"kiln trained-model: error: {out} is a file, not a folder; pass a folder to --out\n")

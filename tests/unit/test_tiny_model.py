"""`kiln tiny-model --out DIR` (the model or the DFlash2 drafter) never deletes a file it
did not write, and a broken stamp is one error line (no torch needed: the refusal comes
before the build)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.testing.tinymodel import DRAFTER_STAMP, STAMP


def _snapshot(folder: Path) -> dict[str, object]:
    return {p.relative_to(folder).as_posix(): p.is_dir() or p.read_bytes() for p in folder.rglob("*")}


def test_a_folder_with_an_old_stamp_and_other_files_is_refused_and_left_alone(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / STAMP).write_text(json.dumps({"fingerprint": "from an older build"}))
    (out / "config.json").write_text("{}\n")
    (out / "notes.txt").write_text("the user's, not tiny-model's\n")
    (out / "data").mkdir()
    before = _snapshot(out)
    assert main(["tiny-model", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"kiln tiny-model: error: {out} holds data, notes.txt, which tiny-model did not write; "
        "it only replaces a folder holding a tiny model and nothing else: move those out or "
        "pass an empty or new folder to --out\n")
    assert _snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_file_as_out_is_refused_and_left_alone(tmp_path, capsys):
    out = tmp_path / "model"
    out.write_text("a file\n")
    assert main(["tiny-model", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"kiln tiny-model: error: {out} is a file, not a folder; pass an empty or new folder to --out\n")
    assert out.read_text() == "a file\n" and [p.name for p in tmp_path.iterdir()] == ["model"]


def _target(tmp_path: Path) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 512}))
    return target


def test_a_drafter_folder_with_an_old_stamp_and_other_files_is_refused_and_left_alone(
        tmp_path, capsys):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / DRAFTER_STAMP).write_text(json.dumps({"fingerprint": "from an older build"}))
    (out / "model.safetensors").write_bytes(b"old weights")
    (out / "notes.txt").write_text("the user's, not tiny-model's\n")
    before = _snapshot(out)
    argv = ["tiny-model", "--dflash2-drafter", "--target", str(_target(tmp_path)), "--out", str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"kiln tiny-model: error: {out} holds notes.txt, which tiny-model did not write; "
        "it only replaces a folder holding a DFlash2 drafter and nothing else: move those out "
        "or pass an empty or new folder to --out\n")
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "target"]


@pytest.mark.parametrize("drafter", [False, True], ids=["model", "drafter"])
@pytest.mark.parametrize("stamp_bytes", [b'{"fingerprint": ', b"\xff\xfe", b"[1, 2]"],
                         ids=["cut-json", "not-utf8", "a-list"])
def test_a_broken_stamp_is_one_error_line_naming_it(tmp_path, capsys, drafter, stamp_bytes):
    out = tmp_path / "out"
    out.mkdir()
    stamp = out / (DRAFTER_STAMP if drafter else STAMP)
    stamp.write_bytes(stamp_bytes)
    (out / "config.json").write_text("{}\n")
    before = _snapshot(out)
    argv = (["tiny-model", "--dflash2-drafter", "--target", str(_target(tmp_path))] if drafter
            else ["tiny-model"]) + ["--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kiln tiny-model: error: {stamp}: ") and err.count("\n") == 1, err
    assert "pass an empty or new folder to --out" in err
    assert _snapshot(out) == before

"""`kiln tiny-model --out DIR` never deletes a file it did not write (no torch needed:
the refusal comes before the build)."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.cli import main
from kiln.tinymodel import STAMP


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

"""The unpacked sdist cache ($KILN_CACHE/trees) checks itself on every use."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from kiln.fetch import PristineFiles
from kiln.lock import PinnedFile, UpstreamRelease
from kiln.patching import apply_series_into
from kiln.pristine import PristineTree
from kiln.series import Series
from tests.unit.conftest import make_diff, write_patch

FILES = {"vllm/a.py": "A = 1\n", "vllm/b.py": "def f(x):\n    return x + 1\n", "tools/run.sh": "#!/bin/sh\n"}


@pytest.fixture
def files(tmp_path, monkeypatch) -> PristineFiles:
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    sdist = tmp_path / "vllm-1.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in FILES.items():
            info = tarfile.TarInfo(f"vllm-1.0.0/{name}")
            info.size, info.mode = len(text), 0o755 if name.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(text.encode()))
    pin = PinnedFile(sdist.name, hashlib.sha256(sdist.read_bytes()).hexdigest())
    release = UpstreamRelease("1.0.0", PinnedFile("unused.whl", "0" * 64), pin)
    return PristineFiles(release=release, wheel=Path(), sdist=sdist)


def _contents(root: Path) -> dict[str, tuple[str, bool]]:
    return {p.relative_to(root).as_posix(): (p.read_text(), os.access(p, os.X_OK))
            for p in root.rglob("*") if p.is_file()}


PRISTINE = {name: (text, name.endswith(".sh")) for name, text in FILES.items()}
ENTRIES = ["tools", "tools/run.sh", "vllm", "vllm/a.py", "vllm/b.py"]


def _entries(root: Path) -> list[str]:
    """Every entry under ``root`` (files, folders, links), not following links."""
    found = []
    for folder, folders, names in os.walk(root):
        found += [Path(folder, n).relative_to(root).as_posix() for n in folders + names]
    return sorted(found)


def test_a_tree_is_unpacked_once_and_reused_as_it_is(files, capsys):
    first = PristineTree.from_files(files)
    inode = (first.root / "vllm" / "a.py").stat().st_ino
    again = PristineTree.from_files(files)
    assert again.root == first.root and _contents(again.root) == PRISTINE
    assert (again.root / "vllm" / "a.py").stat().st_ino == inode
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("damage", ["edit", "add", "remove", "chmod", "link-to-folder",
                                    "empty-folder"])
def test_a_changed_file_in_the_cached_tree_is_replaced_by_the_sdist_s(files, damage, capsys,
                                                                     tmp_path):
    root = PristineTree.from_files(files).root
    if damage == "edit":
        (root / "vllm" / "b.py").write_text("def f(x):\n    return x + 2\n")
    elif damage == "add":
        (root / "vllm" / "stray.py").write_text("STRAY = 1\n")
    elif damage == "remove":
        (root / "vllm" / "a.py").unlink()
    elif damage == "chmod":
        (root / "vllm" / "a.py").chmod(0o755)
    elif damage == "link-to-folder":
        (tmp_path / "planted").mkdir()
        (tmp_path / "planted" / "evil.py").write_text("EVIL = 1\n")
        (root / "vllm" / "planted").symlink_to(tmp_path / "planted")
    else:
        (root / "vllm" / "empty").mkdir()
    tree = PristineTree.from_files(files)
    assert _contents(tree.root) == PRISTINE
    assert _entries(tree.root) == ENTRIES
    changed = {"edit": "vllm/b.py", "add": "vllm/stray.py", "link-to-folder": "vllm/planted",
               "empty-folder": "vllm/empty"}.get(damage, "vllm/a.py")
    assert capsys.readouterr().err == (f"{tree.root}: 1 file(s) differ from vllm-1.0.0.tar.gz "
                                       f"({changed}); unpacking it again\n")
    assert [p.name for p in tree.root.parent.iterdir() if p.name.startswith(".")] == []


def test_an_edit_in_the_cache_does_not_reach_the_applied_tree(files, tmp_path):
    root = PristineTree.from_files(files).root
    pristine_b = (root / "vllm" / "b.py").read_text()
    write_patch(tmp_path / "patches", 1, "bee", make_diff(root, "vllm/a.py", "A = 2\n"))
    (root / "vllm" / "b.py").write_text("EDITED IN THE CACHE\n")
    tree = PristineTree.from_files(files)
    apply_series_into(tree.root, Series.load(tmp_path / "patches"), tmp_path / "applied")
    assert (tmp_path / "applied" / "vllm" / "b.py").read_text() == pristine_b
    assert (tmp_path / "applied" / "vllm" / "a.py").read_text() == "A = 2\n"


def test_a_tree_from_before_manifests_is_kept_when_intact_and_replaced_when_not(files, capsys):
    root = PristineTree.from_files(files).root
    manifest = root.with_name(root.name + ".manifest.json")
    manifest.unlink(missing_ok=True)
    inode = (root / "vllm" / "a.py").stat().st_ino
    PristineTree.from_files(files)
    assert (root / "vllm" / "a.py").stat().st_ino == inode and manifest.is_file()
    assert capsys.readouterr().err == ""
    manifest.unlink()
    (root / "vllm" / "a.py").write_text("A = 99\n")
    assert _contents(PristineTree.from_files(files).root) == PRISTINE



def _files_only_manifest(root: Path) -> dict:
    """Rewrite the tree's manifest in the earlier format (files and links only, no
    format key); return the current one."""
    manifest = root.with_name(root.name + ".manifest.json")
    data = json.loads(manifest.read_text())
    files_only = {p: what for p, what in data["files"].items() if what != "dir"}
    manifest.write_text(json.dumps({"sdist_sha256": data["sdist_sha256"], "files": files_only}))
    return data


def test_a_tree_recorded_in_the_files_only_format_is_kept_when_intact(files, capsys):
    root = PristineTree.from_files(files).root
    current = _files_only_manifest(root)
    inode = (root / "vllm" / "a.py").stat().st_ino
    PristineTree.from_files(files)
    assert (root / "vllm" / "a.py").stat().st_ino == inode
    assert json.loads(root.with_name(root.name + ".manifest.json").read_text()) == current
    assert capsys.readouterr().err == ""


def test_a_tree_recorded_in_the_files_only_format_loses_a_planted_folder(files):
    root = PristineTree.from_files(files).root
    _files_only_manifest(root)
    (root / "vllm" / "empty").mkdir()
    assert _entries(PristineTree.from_files(files).root) == ENTRIES

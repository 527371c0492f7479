"""The unpacked sdist cache ($KILN_CACHE/trees) checks itself on every use."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kiln.paths import REPO_ROOT
from kiln.series.patching import apply_series_into
from kiln.series.series import Series
from kiln.upstream.fetch import PristineFiles
from kiln.upstream.lock import PinnedFile, UpstreamRelease
from kiln.upstream.pristine import PristineTree
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


# A child kiln: says it is ready, waits for the go line, then takes the tree and copies
# it into ARGV[2] as apply does (a folder moved away mid-copy fails with shutil.Error).
RACER = """
import sys
from pathlib import Path
from kiln.upstream.fetch import PristineFiles
from kiln.upstream.lock import PinnedFile, UpstreamRelease
from kiln.series.patching import apply_series_into
from kiln.upstream.pristine import PristineTree
from kiln.series.series import Series
sdist, into = Path(sys.argv[1]), Path(sys.argv[2])
pin = PinnedFile(sdist.name, sys.argv[3])
files = PristineFiles(UpstreamRelease("1.0.0", PinnedFile("u.whl", "0" * 64), pin), Path(), sdist)
(into / "patches").mkdir(parents=True)
(into / "patches" / "series").write_text("")
print("ready", flush=True)
sys.stdin.readline()
tree = PristineTree.from_files(files)
apply_series_into(tree.root, Series.load(into / "patches"), into / "applied")
"""
RACERS = 4


def test_racing_kilns_unpack_a_damaged_tree_once_and_all_use_it(tmp_path, monkeypatch, capsys):
    # Enough files that unpacking takes far longer than checking: every racer finds the
    # tree damaged before any has unpacked it again.
    sdist = tmp_path / "vllm-1.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for i in range(3000):
            data = f"X = {i}\n".encode()
            info = tarfile.TarInfo(f"vllm-1.0.0/vllm/m{i % 30}/f{i}.py")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    sha256 = hashlib.sha256(sdist.read_bytes()).hexdigest()
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    pin = PinnedFile(sdist.name, sha256)
    files = PristineFiles(UpstreamRelease("1.0.0", PinnedFile("u.whl", "0" * 64), pin),
                          Path(), sdist)
    root = PristineTree.from_files(files).root
    intact = _contents(root)
    (root / "vllm" / "m0" / "f0.py").write_text("damaged\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(sdist), str(tmp_path / f"r{i}"),
                                sha256], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(RACERS)]
    assert [racer.stdout.readline() for racer in racers] == ["ready\n"] * RACERS
    for racer in racers:
        racer.stdin.write("go\n")
        racer.stdin.flush()
    errors = [racer.communicate(timeout=300)[1] for racer in racers]
    assert [racer.returncode for racer in racers] == [0] * RACERS, errors
    assert sum(e.count("unpacking it again") for e in errors) == 1, errors
    for i in range(RACERS):
        assert _contents(tmp_path / f"r{i}" / "applied") == intact
    assert _contents(root) == intact

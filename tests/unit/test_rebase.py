"""kiln rebase on a synthetic upstream pair, with real git: stops, resolution, retirement."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.series.git import git
from kiln.series.materialize import materialize
from kiln.series.rebase import resume, start
from kiln.series.series import Series
from tests.unit.conftest import make_diff, write_patch

A_OLD = "".join(f"line {i}\n" for i in range(1, 21))
A_NEW = A_OLD.replace("line 10\n", "line 10 (upstream 2.0)\n")
B_OLD = "def f(x):\n    return x + 1\n"
B_NEW = "def f(x):\n    return x + 2\n"


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, Path]:
    old, new = tmp_path / "v1", tmp_path / "v2"
    for root, a, b in ((old, A_OLD, B_OLD), (new, A_NEW, B_NEW)):
        (root / "vllm").mkdir(parents=True)
        (root / "vllm" / "a.py").write_text(a)
        (root / "vllm" / "b.py").write_text(b)
        (root / "vllm" / "c.py").write_text("C = 1\n")
    patches = tmp_path / "patches"
    write_patch(patches, 1, "clean", make_diff(old, "vllm/c.py", "C = 1\nD = 2\n"))
    write_patch(patches, 2, "conflicting", make_diff(old, "vllm/a.py", A_OLD.replace("line 10\n", "line 10 (fork)\n")))
    write_patch(patches, 3, "absorbed", make_diff(old, "vllm/b.py", B_NEW))
    return materialize(old, "1.0", Series.load(patches), tmp_path / "git", log=lambda _: None), new


def test_a_rebase_stops_at_the_conflict_and_finishes_after_resolution(repo):
    path, new = repo
    report = start(path, "1.0", "2.0", new)
    assert report.state == "stopped"
    (stop,) = report.stops
    assert stop.topic == "conflicting" and stop.files == ["vllm/a.py"]
    (hunk,) = stop.hunks
    assert hunk.upstream == ["line 10 (upstream 2.0)"] and hunk.topic == ["line 10 (fork)"]
    assert stop.retire == ""
    assert (path / ".git" / "kiln-rebase" / "report.md").read_text().count("line 10 (fork)") == 1

    with pytest.raises(KilnError, match="unresolved file.*vllm/a.py"):
        resume(path)
    (path / "vllm" / "a.py").write_text(A_NEW.replace("line 10 (upstream 2.0)\n", "line 10 (upstream 2.0, fork)\n"))
    with pytest.raises(KilnError, match="unresolved file.*vllm/a.py"):
        resume(path)  # edited, but not marked resolved with git add
    git(path, "add", "vllm/a.py")
    report = resume(path)
    assert report.state == "done"
    assert {t: report.outcome(t) for t in report.topics} == {
        "clean": "clean", "conflicting": "re-cut", "absorbed": "retired"}
    assert git(path, "tag").split() == ["v1.0", "v2.0"]
    assert (path / "vllm" / "b.py").read_text() == B_NEW
    assert "conflicting" in report.range_diff and (path / ".git" / "kiln-rebase" / "range-diff.txt").exists()
    assert git(path, "rev-list", "--count", "v2.0..fork/2.0").strip() == "2"


def test_a_dirty_work_tree_is_refused(repo):
    path, new = repo
    (path / "vllm" / "c.py").write_text("edited\n")
    with pytest.raises(KilnError, match="uncommitted changes .*vllm/c.py"):
        start(path, "1.0", "2.0", new)
    assert "v2.0" not in git(path, "tag").split()


def test_continue_without_a_stopped_rebase_is_refused(repo):
    path, _ = repo
    with pytest.raises(KilnError, match="no kiln rebase is stopped"):
        resume(path)


def test_skip_retires_the_stopped_topic(repo):
    path, new = repo
    start(path, "1.0", "2.0", new)
    report = resume(path, skip=True)
    assert report.state == "done"
    assert report.outcome("conflicting") == "retired"
    assert (path / "vllm" / "a.py").read_text() == A_NEW


def test_a_stop_whose_change_upstream_already_holds_asks_to_retire(tmp_path):
    old, new = tmp_path / "v1", tmp_path / "v2"
    text = "".join(f"line {i}\n" for i in range(1, 11))
    (old / "vllm").mkdir(parents=True)
    (new / "vllm").mkdir(parents=True)
    (old / "vllm" / "a.py").write_text(text)
    # Upstream took the topic's line and changed the one next to it: a conflict, yet absorbed.
    (new / "vllm" / "a.py").write_text(text.replace("line 5\n", "line 5 fixed\n").replace("line 6\n", "line 6b\n"))
    patches = tmp_path / "patches"
    write_patch(patches, 1, "backport", make_diff(old, "vllm/a.py", text.replace("line 5\n", "line 5 fixed\n")))
    repo = materialize(old, "1.0", Series.load(patches), tmp_path / "git", log=lambda _: None)
    report = start(repo, "1.0", "2.0", new)
    assert report.state == "stopped"
    assert report.stops[0].retire == "every line the topic adds is already in upstream 2.0's files"

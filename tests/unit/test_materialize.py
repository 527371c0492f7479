import subprocess
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.series.git import git, git_env
from kiln.series.materialize import export, materialize
from kiln.series.series import Series
from tests.unit.conftest import make_diff, write_patch


@pytest.fixture
def series(pristine: Path, tmp_path: Path) -> Series:
    patches = tmp_path / "patches"
    write_patch(patches, 1, "bee", make_diff(pristine, "vllm/b.py", "def f(x):\n    return x - 1\n"))
    write_patch(patches, 2, "new-file", "diff --git a/vllm/c.py b/vllm/c.py\nnew file mode 100644\n"
                "--- /dev/null\n+++ b/vllm/c.py\n@@ -0,0 +1 @@\n+C = 3\n")
    return Series.load(patches)


def test_materialize_tags_pristine_and_commits_each_topic(pristine, series, tmp_path):
    repo = materialize(pristine, "1.0.0", series, tmp_path / "git", log=lambda _: None)
    assert git(repo, "tag").split() == ["v1.0.0"]
    assert git(repo, "branch", "--show-current").strip() == "fork/1.0.0"
    log = git(repo, "log", "-z", "--format=%B", "v1.0.0..fork/1.0.0")
    first_lines = [m.split("\n")[0] for m in log.split("\0") if m]
    assert first_lines == ["Topic: new-file", "Topic: bee"]
    assert git(repo, "log", "-1", "--format=%B", "HEAD~1").rstrip("\n") == series.topics[0].message
    assert (repo / "vllm" / "c.py").read_text() == "C = 3\n"


def test_export_of_an_unchanged_branch_changes_zero_bytes(pristine, series, tmp_path):
    repo = materialize(pristine, "1.0.0", series, tmp_path / "git", log=lambda _: None)
    first = export(repo, "1.0.0", series.directory)  # normalizes the hand-written diffs
    before = {p.name: p.read_bytes() for p in series.directory.iterdir()}
    again = export(repo, "1.0.0", series.directory)
    assert again.written == [] and again.removed == []
    assert {p.name: p.read_bytes() for p in series.directory.iterdir()} == before
    assert "series" not in first.written


def test_export_picks_up_an_amended_topic_and_a_dropped_one(pristine, series, tmp_path):
    repo = materialize(pristine, "1.0.0", series, tmp_path / "git", log=lambda _: None)
    export(repo, "1.0.0", series.directory)
    # Drop the first topic (rebase it away), keep the second.
    git(repo, "rebase", "-q", "--onto", "v1.0.0", "HEAD~1")
    result = export(repo, "1.0.0", series.directory)
    assert result.written == ["0001-new-file.patch", "series"]
    assert result.removed == ["0001-bee.patch", "0002-new-file.patch"]
    assert (series.directory / "series").read_text() == "0001-new-file.patch\n"
    assert sorted(p.name for p in series.directory.glob("*.patch")) == ["0001-new-file.patch"]


def test_export_refuses_a_dirty_tree(pristine, series, tmp_path):
    repo = materialize(pristine, "1.0.0", series, tmp_path / "git", log=lambda _: None)
    (repo / "vllm" / "b.py").write_text("edited\n")
    before = {p.name: p.read_bytes() for p in series.directory.iterdir()}
    with pytest.raises(KilnError, match="uncommitted changes .*vllm/b.py"):
        export(repo, "1.0.0", series.directory)
    assert {p.name: p.read_bytes() for p in series.directory.iterdir()} == before


def test_export_refuses_a_commit_without_a_topic_header(pristine, series, tmp_path):
    repo = materialize(pristine, "1.0.0", series, tmp_path / "git", log=lambda _: None)
    (repo / "vllm" / "b.py").write_text("edited\n")
    git(repo, "commit", "-q", "-am", "quick fix")
    with pytest.raises(KilnError, match="message is not a topic header: .*'quick fix'"):
        export(repo, "1.0.0", series.directory)


def test_materialize_refuses_a_non_empty_folder(pristine, series, tmp_path):
    (tmp_path / "git").mkdir()
    (tmp_path / "git" / "x").write_text("")
    with pytest.raises(KilnError, match="not empty"):
        materialize(pristine, "1.0.0", series, tmp_path / "git")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_export_refuses_while_a_rebase_is_stopped(pristine, series, tmp_path):
    repo = materialize(pristine, "1.0.0", series, tmp_path / "git", log=lambda _: None)
    export(repo, "1.0.0", series.directory)
    before = _snapshot(series.directory)
    # rebase -i stopped at the first topic ("edit"), which is then amended.
    subprocess.run(["git", "-C", str(repo), "rebase", "-i", "v1.0.0"], check=True, capture_output=True,
                   env={**git_env(), "GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/"})
    (repo / "vllm" / "b.py").write_text("def f(x):\n    return x - 2\n")
    git(repo, "commit", "-q", "-a", "--amend", "--no-edit")
    with pytest.raises(KilnError) as err:
        export(repo, "1.0.0", series.directory)
    assert f"a git rebase is in progress in {repo}" in str(err.value)
    assert "git rebase --continue" in str(err.value) and "git rebase --abort" in str(err.value)
    assert _snapshot(series.directory) == before


def test_export_onto_a_pin_the_repository_lacks_names_what_it_has(pristine, series, tmp_path):
    repo = materialize(pristine, "1.0.0", series, tmp_path / "git", log=lambda _: None)
    target = tmp_path / "patches-2.0.0"
    with pytest.raises(KilnError) as err:
        export(repo, "2.0.0", target)
    assert f"{repo} has no tag v2.0.0 (its fork branches: fork/1.0.0)" in str(err.value)
    git(repo, "tag", "v2.0.0", "v1.0.0")
    with pytest.raises(KilnError) as err:
        export(repo, "2.0.0", target)
    assert f"{repo} has no branch fork/2.0.0 (its fork branches: fork/1.0.0)" in str(err.value)
    assert "kiln rebase --onto 2.0.0" in str(err.value)
    assert not target.exists()

from pathlib import Path

import pytest

from kiln.build.version import fork_version, is_fork_version, version_tuple
from kiln.series.git import git


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("1\n")
    git(tmp_path, "add", "f")
    git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_untagged_repository_is_release_zero_with_distance(repo):
    version = fork_version("0.32.0", repo)
    head = git(repo, "rev-parse", "--short=12", "HEAD").strip()
    assert version == f"0.32.0+kiln.0.1.g{head}"
    assert is_fork_version(version)


def test_at_a_release_tag_the_version_is_plain(repo):
    git(repo, "tag", "kiln-3")
    assert fork_version("0.32.0", repo) == "0.32.0+kiln.3"
    (repo / "f").write_text("2\n")
    git(repo, "commit", "-q", "-am", "two")
    head = git(repo, "rev-parse", "--short=12", "HEAD").strip()
    assert fork_version("0.32.0", repo) == f"0.32.0+kiln.3.1.g{head}"


def test_uncommitted_changes_mark_the_version_dirty(repo):
    git(repo, "tag", "kiln-3")
    (repo / "f").write_text("changed\n")
    assert fork_version("0.32.0", repo) == "0.32.0+kiln.3.dirty"
    (repo / "f").write_text("1\n")
    (repo / "untracked").write_text("x")
    assert fork_version("0.32.0", repo) == "0.32.0+kiln.3"


def test_version_tuple_keeps_upstreams_shape():
    assert version_tuple("0.32.0+kiln.3") == (0, 32, 0, "kiln.3")
    assert version_tuple("0.32.0") == (0, 32, 0)


def test_the_version_is_a_valid_pep440_local_version(repo):
    from packaging.version import Version

    version = Version(fork_version("0.32.0", repo))
    assert version.public == "0.32.0" and version.local.startswith("kiln.0.1.g")

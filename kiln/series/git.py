"""Run git with a fixed configuration, so commits and diffs are reproducible."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kiln.errors import KilnError

IDENTITY = {"name": "kiln", "email": "kiln@localhost", "date": "2000-01-01T00:00:00+0000"}
# Options that change diff text; pinned so `export` writes the same bytes everywhere.
DIFF_OPTIONS = (
    "--no-color", "--no-ext-diff", "--no-renames", "--full-index",
    "--diff-algorithm=myers", "--src-prefix=a/", "--dst-prefix=b/", "-U3",
)


def git_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
        GIT_AUTHOR_NAME=IDENTITY["name"], GIT_AUTHOR_EMAIL=IDENTITY["email"],
        GIT_COMMITTER_NAME=IDENTITY["name"], GIT_COMMITTER_EMAIL=IDENTITY["email"],
        GIT_AUTHOR_DATE=IDENTITY["date"], GIT_COMMITTER_DATE=IDENTITY["date"],
        LC_ALL="C",
    )
    return env


def git(repo: Path, *args: str, input: str | None = None, check: bool = True) -> str:
    result = subprocess.run(
        ["git", "-C", str(repo), *args], input=input, capture_output=True, text=True,
        env=git_env(),
    )
    if check and result.returncode != 0:
        raise KilnError(f"git {' '.join(args)} failed in {repo}: {result.stderr.strip()}")
    return result.stdout


def is_dirty(repo: Path, untracked: bool = True) -> list[str]:
    """Paths with uncommitted changes (and untracked files unless told not to)."""
    flag = "--untracked-files=all" if untracked else "--untracked-files=no"
    out = git(repo, "status", "--porcelain", flag)
    return [line[3:] for line in out.splitlines() if line.strip()]


def rebase_in_progress(repo: Path) -> bool:
    """A git rebase (kiln's or a maintainer's ``rebase -i``) stopped in ``repo``: its
    commits are not on the branch until it finishes."""
    git_dir = Path(git(repo, "rev-parse", "--absolute-git-dir").strip())
    return (git_dir / "rebase-merge").exists() or (git_dir / "rebase-apply").exists()

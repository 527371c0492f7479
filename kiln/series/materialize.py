"""The git view of the series: pristine tag plus one commit per topic, and back.

``materialize`` builds the repository maintainers edit; ``export`` writes
``patches/`` back from its branch. Commit messages are the patch headers
verbatim and diffs are written with pinned options, so exporting an unchanged
branch rewrites every patch byte for byte.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.atomic import replacing
from kiln.errors import KilnError
from kiln.series.git import DIFF_OPTIONS, git, is_dirty, rebase_in_progress
from kiln.series.patching import apply_topic
from kiln.series.series import PATCH_NAME, SEPARATOR, Series, Topic, series_file_text


def upstream_tag(version: str) -> str:
    return f"v{version}"


def fork_branch(version: str) -> str:
    return f"fork/{version}"


def materialize(pristine: Path, version: str, series: Series, into: Path, log=print) -> Path:
    """Create a git repository at ``into``: tag v<version>, branch fork/<version>."""
    if into.exists() and any(into.iterdir()):
        raise KilnError(f"{into} exists and is not empty; materialize into a new folder")
    into.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into.parent, prefix=f".{into.name}.") as tmp:
        repo = Path(tmp) / "repo"
        shutil.copytree(pristine, repo, symlinks=True)
        git(repo, "init", "-q", "-b", fork_branch(version))
        git(repo, "config", "rerere.enabled", "true")
        git(repo, "add", "-A", "-f")
        git(repo, "commit", "-q", "--no-verify", "-m", f"vLLM {version} (pristine sdist)")
        git(repo, "tag", upstream_tag(version))
        for topic in series.topics:
            offsets = apply_topic(repo, topic)
            git(repo, "add", "-A", "-f")
            git(repo, "commit", "-q", "--no-verify", "--allow-empty", "--cleanup=verbatim",
                "-F", "-", input=topic.message)
            note = f" ({len(offsets)} hunk(s) at an offset)" if offsets else ""
            log(f"  {topic.name}{note}")
        if into.exists():
            into.rmdir()
        os.replace(repo, into)
    return into


@dataclass(frozen=True)
class ExportResult:
    written: list[str]
    removed: list[str]


def branch_topics(repo: Path, version: str, directory: Path) -> list[Topic]:
    """Read the topics off fork/<version>: one per commit since v<version>."""
    base, branch = upstream_tag(version), fork_branch(version)
    lines = git(repo, "rev-list", "--reverse", "--parents", f"{base}..{branch}").splitlines()
    topics = []
    for number, line in enumerate(lines, start=1):
        commit, *parents = line.split()
        if len(parents) != 1:
            raise KilnError(f"commit {commit[:12]} on {branch} is a merge; the series must be linear")
        message = git(repo, "log", "-1", "--format=%B", commit).rstrip("\n")
        diff = git(repo, "diff", *DIFF_OPTIONS, parents[0], commit)
        try:
            name = Topic.parse(Path("message"), message + "\n" + SEPARATOR).fields.get("Topic")
        except KilnError as e:
            raise KilnError(f"commit {commit[:12]}'s message is not a topic header: {e}") from None
        if not name:
            raise KilnError(f"commit {commit[:12]} has no 'Topic:' line in its message")
        path = directory / f"{number:04d}-{name}.patch"
        topics.append(Topic.parse(path, message + "\n" + SEPARATOR + diff))
    return topics


def export(repo: Path, version: str, directory: Path) -> ExportResult:
    """Rewrite ``directory`` (patches + series) from the branch; refuse a dirty tree, a
    rebase in progress and a repository without the version's tag and branch."""
    if rebase_in_progress(repo):
        raise KilnError(
            f"a git rebase is in progress in {repo}; {fork_branch(version)} holds its commits "
            "only when it is done: finish it (`git rebase --continue`, or `kiln rebase "
            f"--continue --repo {repo}`) or abort it (`git rebase --abort`), then export"
        )
    for kind, name, ref in (("tag", upstream_tag(version), "refs/tags/"),
                            ("branch", fork_branch(version), "refs/heads/")):
        if not git(repo, "rev-parse", "-q", "--verify", ref + name, check=False).strip():
            branches = git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/fork/")
            raise KilnError(
                f"{repo} has no {kind} {name} (its fork branches: "
                f"{', '.join(branches.split()) or 'none'}); export --version {version} needs "
                f"the series at {version}: `kiln materialize --version {version}` or "
                f"`kiln rebase --onto {version}`"
            )
    dirty = is_dirty(repo)
    if dirty:
        raise KilnError(
            f"{repo} has uncommitted changes ({', '.join(dirty[:5])}"
            f"{', ...' if len(dirty) > 5 else ''}); commit or discard them before export"
        )
    topics = branch_topics(repo, version, directory)
    problems = [p for t in topics for p in t.header_problems()]
    if problems:
        raise KilnError("the branch's commit messages are not complete headers:\n  " + "\n  ".join(problems))
    wanted = {t.path.name: t.text() for t in topics}
    wanted["series"] = series_file_text(topics)
    directory.mkdir(parents=True, exist_ok=True)
    existing = {p.name for p in directory.iterdir()
                if p.name == "series" or PATCH_NAME.match(p.name)}
    written = []
    for name, text in wanted.items():
        path = directory / name
        if not path.exists() or path.read_text() != text:
            with replacing(path) as tmp:
                tmp.write_text(text)
            written.append(name)
    removed = sorted(existing - set(wanted))
    for name in removed:
        (directory / name).unlink()
    return ExportResult(written=sorted(written), removed=removed)

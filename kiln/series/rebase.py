"""Move the materialized series onto a new upstream tag with git, recording every stop.

``start`` imports the new pristine tree as a parentless commit tagged
v<new>, branches fork/<new> from fork/<old> and runs ``git rebase --onto``
(rerere on, commits that become empty dropped). Each stop is recorded with
its topic, files, conflicting hunks and whether upstream already holds the
change. ``resume`` continues after a manual resolution. State lives in
``.git/kiln-rebase/``; the report (JSON, Markdown, range-diff) is written there.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.errors import KilnError, naming
from kiln.series.diff import parse_diff
from kiln.series.git import DIFF_OPTIONS, git, git_env, is_dirty, rebase_in_progress
from kiln.series.materialize import fork_branch, upstream_tag
from kiln.series.series import SEPARATOR, Topic

STATE_DIR = "kiln-rebase"
_MARKER_START, _MARKER_MID, _MARKER_END = "<<<<<<< ", "=======", ">>>>>>> "
_SHOWN_LINES = 12


@dataclass
class ConflictHunk:
    file: str
    line: int
    upstream: list[str]  # the new base's side
    topic: list[str]  # the topic's side


@dataclass
class RebaseStop:
    topic: str
    files: list[str]
    hunks: list[ConflictHunk]
    deleted_upstream: list[str]
    retire: str  # "" or why upstream may already contain the change


@dataclass
class RebaseReport:
    old: str
    new: str
    topics: list[str]  # in series order, from the old branch
    stops: list[RebaseStop] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    state: str = "running"  # running, stopped, done
    range_diff: str = ""

    def outcome(self, topic: str) -> str:
        if topic in self.retired:
            return "retired"
        if self.state == "stopped" and topic == self.stops[-1].topic:
            return "stopped"
        if any(s.topic == topic for s in self.stops):
            return "re-cut"
        if self.state == "stopped" and self.topics.index(topic) > self.topics.index(self.stops[-1].topic):
            return "pending"
        return "clean"

    def to_json(self) -> dict:
        data = asdict(self)
        data["outcomes"] = {t: self.outcome(t) for t in self.topics}
        return data

    @classmethod
    def from_json(cls, data: dict) -> RebaseReport:
        data = dict(data)
        data.pop("outcomes", None)
        stops = [RebaseStop(**{**s, "hunks": [ConflictHunk(**h) for h in s["hunks"]]}) for s in data.pop("stops")]
        return cls(stops=stops, **data)

    def markdown(self) -> str:
        out = [f"# Rebase fork/{self.old} onto v{self.new}: {self.state}\n\n",
               "| topic | outcome |\n| --- | --- |\n"]
        out += [f"| {t} | {self.outcome(t)} |\n" for t in self.topics]
        for stop in self.stops:
            out.append(f"\n## Stop: {stop.topic}\n\nFiles: {', '.join(stop.files) or 'none'}\n")
            if stop.retire:
                out.append(f"\nRetire? {stop.retire}\n")
            for path in stop.deleted_upstream:
                out.append(f"\n- `{path}`: upstream {self.new} deleted or moved this file\n")
            for hunk in stop.hunks:
                out.append(f"\n`{hunk.file}` line {hunk.line}:\n\n```\n<<<<<<< upstream {self.new}\n"
                           + "".join(line + "\n" for line in hunk.upstream) + "=======\n"
                           + "".join(line + "\n" for line in hunk.topic) + f">>>>>>> {stop.topic}\n```\n")
        if self.range_diff:
            out.append(f"\n## git range-diff\n\n```\n{self.range_diff}```\n")
        return "".join(out)


def state_dir(repo: Path) -> Path:
    return Path(git(repo, "rev-parse", "--absolute-git-dir").strip()) / STATE_DIR


def import_pristine(repo: Path, tree: Path, version: str) -> None:
    """Commit ``tree`` as a parentless commit tagged v<version>, leaving HEAD and the index alone."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**git_env(), "GIT_INDEX_FILE": str(Path(tmp) / "index")}

        def run(*args: str, input: str | None = None) -> str:
            result = subprocess.run(["git", "-C", str(repo), "--work-tree", str(tree), *args],
                                    input=input, capture_output=True, text=True, env=env)
            if result.returncode != 0:
                raise KilnError(f"git {' '.join(args)} failed importing {tree}: {result.stderr.strip()}")
            return result.stdout.strip()

        run("add", "-A", "-f", ".")
        commit = run("commit-tree", run("write-tree"), "-m", f"vLLM {version} (pristine sdist)")
    git(repo, "tag", upstream_tag(version), commit)


def _topic_of(repo: Path, commit: str) -> str:
    message = git(repo, "log", "-1", "--format=%B", commit)
    try:
        return Topic.parse(Path("message"), message + "\n" + SEPARATOR).fields.get("Topic") or commit[:12]
    except KilnError:
        return commit[:12]


def branch_topic_names(repo: Path, version: str, branch: str | None = None) -> list[str]:
    commits = git(repo, "rev-list", "--reverse", f"{upstream_tag(version)}..{branch or fork_branch(version)}")
    return [_topic_of(repo, c) for c in commits.split()]


def start(repo: Path, old: str, new: str, new_tree: Path) -> RebaseReport:
    """Import v<new>, branch fork/<new> from fork/<old> and rebase it; stop at the first conflict."""
    if not (repo / ".git").exists():
        raise KilnError(f"{repo} is not a materialized repository; run `kiln materialize --into {repo}` "
                        "or leave out --repo to materialize one")
    if rebase_in_progress(repo):
        raise KilnError(f"a rebase is already in progress in {repo}; finish it with "
                        "`kiln rebase --continue --repo ...` (or `git rebase --abort` there)")
    dirty = is_dirty(repo)
    if dirty:
        raise KilnError(f"{repo} has uncommitted changes ({', '.join(dirty[:5])}); commit or discard "
                        "them first: a rebase needs a clean work tree")
    for ref in (upstream_tag(old), fork_branch(old)):
        if not git(repo, "rev-parse", "-q", "--verify", ref, check=False).strip():
            raise KilnError(f"{repo} has no {ref}; it must be materialized at {old}")
    if git(repo, "rev-parse", "-q", "--verify", fork_branch(new), check=False).strip():
        raise KilnError(f"{repo} already has branch {fork_branch(new)}; delete it to rebase again")
    if not git(repo, "rev-parse", "-q", "--verify", upstream_tag(new), check=False).strip():
        import_pristine(repo, new_tree, new)
    git(repo, "config", "rerere.enabled", "true")
    git(repo, "config", "rerere.autoUpdate", "true")
    report = RebaseReport(old=old, new=new, topics=branch_topic_names(repo, old))
    git(repo, "branch", fork_branch(new), fork_branch(old))
    state_dir(repo).mkdir(parents=True, exist_ok=True)
    result = _git_status(repo, "rebase", "--empty=drop", "--onto", upstream_tag(new), upstream_tag(old),
                         fork_branch(new))
    return _after_step(repo, report, result)


def resume(repo: Path, skip: bool = False) -> RebaseReport:
    """Continue after a manual resolution (or ``skip``: retire the stopped topic)."""
    path = state_dir(repo) / "report.json"
    if not path.exists() or not rebase_in_progress(repo):
        raise KilnError(f"no kiln rebase is stopped in {repo}; start one with `kiln rebase --onto VERSION`")
    report = RebaseReport.from_json(json.loads(path.read_text()))
    stop = report.stops[-1]
    if skip:
        report.retired.append(stop.topic)
        return _after_step(repo, report, _git_status(repo, "rebase", "--skip"))
    unmerged = git(repo, "diff", "--name-only", "--diff-filter=U").split()
    marked = [f for f in stop.files if (repo / f).is_file() and _has_markers((repo / f).read_text(errors="replace"))]
    if unmerged or marked:
        raise KilnError(f"unresolved file(s) in {repo}: {', '.join(sorted(set(unmerged + marked)))}; "
                        "resolve the conflicts, remove every conflict marker and `git add` the files "
                        "(or retire the topic with --skip)")
    git(repo, "add", "-u")
    if not git(repo, "diff", "--cached", "--name-only").strip():
        raise KilnError(f"the resolution of {stop.topic} leaves no change; if upstream holds it, "
                        "retire the topic with `kiln rebase --skip`")
    return _after_step(repo, report, _git_status(repo, "-c", "core.editor=true", "rebase", "--continue"))


def _git_status(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=git_env())


def _after_step(repo: Path, report: RebaseReport, result: subprocess.CompletedProcess) -> RebaseReport:
    if rebase_in_progress(repo):
        if result.returncode == 0:
            raise KilnError(f"git rebase paused without a conflict in {repo}: {result.stdout.strip()}")
        report.stops.append(record_stop(repo, report.new))
        report.state = "stopped"
    elif result.returncode != 0:
        raise KilnError(f"git rebase failed in {repo}: {(result.stderr or result.stdout).strip()}")
    else:
        report.state = "done"
        kept = branch_topic_names(repo, report.new)
        report.retired += [t for t in report.topics if t not in kept and t not in report.retired]
        report.range_diff = git(repo, "range-diff", "--no-color",
                                f"{upstream_tag(report.old)}..{fork_branch(report.old)}",
                                f"{upstream_tag(report.new)}..{fork_branch(report.new)}")
    write_report(repo, report)
    return report


def record_stop(repo: Path, new: str) -> RebaseStop:
    """Topic, files, conflict hunks and the retire question for the commit git stopped at."""
    stopped = git(repo, "rev-parse", "REBASE_HEAD", check=False).strip()
    topic = _topic_of(repo, stopped) if stopped else "?"
    status = git(repo, "status", "--porcelain", "--untracked-files=no").splitlines()
    unmerged = [(line[:2], line[3:]) for line in status if line[:2] in ("UU", "AA", "DU", "UD", "AU", "UA", "DD")]
    files = [path for _, path in unmerged]
    deleted = [path for code, path in unmerged if code in ("DU", "UD")]
    hunks = [h for code, path in unmerged if code not in ("DU", "UD") and (repo / path).is_file()
             for h in conflict_hunks(path, (repo / path).read_text(errors="replace"))]
    return RebaseStop(topic, files, hunks, deleted, retire_question(repo, stopped, new) if stopped else "")


def conflict_hunks(path: str, text: str) -> list[ConflictHunk]:
    hunks, side, upstream, topic, start = [], None, [], [], 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(_MARKER_START):
            side, upstream, topic, start = "upstream", [], [], number
        elif line.startswith(_MARKER_MID) and side == "upstream":
            side = "topic"
        elif line.startswith(_MARKER_END) and side == "topic":
            hunks.append(ConflictHunk(path, start, upstream[:_SHOWN_LINES], topic[:_SHOWN_LINES]))
            side = None
        elif side == "upstream":
            upstream.append(line)
        elif side == "topic":
            topic.append(line)
    return hunks


def _has_markers(text: str) -> bool:
    return bool(re.search(r"^(<<<<<<< |>>>>>>> )", text, re.M))


def retire_question(repo: Path, commit: str, new: str) -> str:
    """Why upstream may already hold the topic's change, or "" when it does not."""
    diff = git(repo, "diff", *DIFF_OPTIONS, f"{commit}~1", commit)
    with tempfile.TemporaryDirectory() as tmp:
        git(repo, "worktree", "add", "-q", "--detach", str(Path(tmp) / "wt"), upstream_tag(new))
        try:
            reverse = subprocess.run(["git", "apply", "--check", "-R", "-"], cwd=Path(tmp) / "wt",
                                     input=diff, capture_output=True, text=True, env=git_env())
            if reverse.returncode == 0:
                return f"upstream {new} already contains this change exactly (it reverse-applies)"
            added = _added_lines(diff)
            present = [line for path, line in added if (Path(tmp) / "wt" / path).is_file()
                       and line in (Path(tmp) / "wt" / path).read_text(errors="replace")]
        finally:
            git(repo, "worktree", "remove", "--force", str(Path(tmp) / "wt"))
    if added and len(present) == len(added):
        return f"every line the topic adds is already in upstream {new}'s files"
    return ""


def _added_lines(text: str) -> list[tuple[str, str]]:
    return [(f.new_path, line.strip()) for f in parse_diff(text) if f.new_path
            for h in f.hunks for _, line in h.added() if line.strip()]


def write_report(repo: Path, report: RebaseReport) -> Path:
    folder = state_dir(repo)
    folder.mkdir(parents=True, exist_ok=True)
    with naming(folder / "report.json"):
        (folder / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    with naming(folder / "report.md"):
        (folder / "report.md").write_text(report.markdown())
    if report.range_diff:
        with naming(folder / "range-diff.txt"):
            (folder / "range-diff.txt").write_text(report.range_diff)
    return folder

"""``kiln verify``: every promise the series makes, checked on the real pristine tree."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kiln.abi.fa2 import FORK_SCAN, UPSTREAM_SCAN, Snapshot, check_calls
from kiln.build.wheel import check_topic_paths, overlay_files
from kiln.errors import KilnError
from kiln.paths import REPO_ROOT
from kiln.series.git import git
from kiln.series.materialize import export, fork_branch, materialize
from kiln.series.patching import PatchFailed, apply_series_into
from kiln.series.series import Series
from kiln.series.treediff import differing_files
from kiln.upstream.pristine import PristineTree


@dataclass
class VerifyReport:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, ok, detail))

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks)


def verify(pristine: PristineTree, patches: Path, *, branch_repo: Path | None = None,
           wheel_files: list[str] | None = None, root: Path | None = None,
           fa2: Snapshot | None = None, log=print) -> VerifyReport:
    """Run every check; each lands in the report, none stops the others.

    With ``fa2``, the patched tree's and the overlay's calls into the compiled attention
    ops must bind to those schemas.
    """
    report = VerifyReport()
    try:
        series = Series.load(patches)
        report.add("series and patches/ agree", True, f"{len(series.topics)} topic(s)")
    except KilnError as e:
        report.add("series and patches/ agree", False, str(e))
        return report
    problems = series.problems()
    report.add("patch headers complete", not problems, "\n".join(problems))
    try:
        check_topic_paths(series.topics)
        report.add("topics touch only vllm/", True)
    except KilnError as e:
        report.add("topics touch only vllm/", False, str(e))

    upstream = set(pristine.files()) | set(wheel_files or [])
    clashes = sorted(set(overlay_files(root) if root else overlay_files()) & upstream)
    report.add("overlay paths are not upstream paths", not clashes, ", ".join(clashes))

    with tempfile.TemporaryDirectory() as tmp:
        applied = Path(tmp) / "applied"
        try:
            result = apply_series_into(pristine.root, series, applied)
            report.add("series applies at fuzz 0", True,
                       "\n".join(str(o) for o in result.offsets) or "no offsets")
        except PatchFailed as e:
            report.add("series applies at fuzz 0", False, str(e))
            return report
        if fa2 is not None:
            calls = check_calls([(applied, UPSTREAM_SCAN), (root or REPO_ROOT, FORK_SCAN)], fa2)
            report.add("calls into the compiled attention ops bind to their schemas", calls.ok,
                       "\n".join(calls.errors) or f"{len(calls.checked)} call(s) checked "
                       f"against {fa2.count} schemas of vLLM {fa2.version}")

        repo = branch_repo
        if repo is None:
            repo = materialize(pristine.root, pristine.version, series, Path(tmp) / "git", log=lambda _: None)
            exported = Path(tmp) / "exported"
            export(repo, pristine.version, exported)
            changed = [n for n in sorted(p.name for p in exported.iterdir())
                       if (patches / n).read_bytes() != (exported / n).read_bytes()]
            report.add("materialize then export changes 0 bytes", not changed, ", ".join(changed))
        checkout = Path(tmp) / "branch"
        git(Path(tmp), "clone", "-q", "--branch", fork_branch(pristine.version), str(repo), str(checkout))
        differ = differing_files(applied, checkout)
        report.add("pristine + series equals the branch tree", not differ,
                   f"{len(differ)} differing file(s): " + ", ".join(differ[:20]) if differ else "0 differing files")
    return report

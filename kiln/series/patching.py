"""Apply the series with GNU patch semantics at fuzz 0.

Offsets (the hunk's context found a few lines away) are reported and accepted;
a hunk that needs fuzz, or does not apply at all, fails the whole apply, naming
the topic, the file and the hunk. ``apply_series_into`` works in a temporary
folder and moves it into place only on success, so no half-patched tree is left.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.series.series import Series, Topic

_PATCHING = re.compile(r"^patching file (?P<file>.+)$")
_OFFSET = re.compile(r"^Hunk #(?P<hunk>\d+) succeeded at (?P<line>\d+) \(offset (?P<offset>-?\d+) lines?\)\.")
_FAILED = re.compile(r"^Hunk #(?P<hunk>\d+) FAILED at (?P<line>\d+)")


@dataclass(frozen=True)
class HunkOffset:
    topic: str
    file: str
    hunk: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}: {self.file} hunk #{self.hunk} applied at offset {self.offset:+d}"


@dataclass
class ApplyReport:
    offsets: list[HunkOffset] = field(default_factory=list)


class PatchFailed(KilnError):
    def __init__(self, topic: str, failures: list[str], output: str):
        self.topic = topic
        self.failures = failures
        super().__init__(
            f"topic {topic} does not apply at fuzz 0:\n  " + "\n  ".join(failures)
            + "\nGNU patch said:\n" + output.strip()
        )


def patch_binary() -> str:
    path = shutil.which("patch")
    if path is None:
        raise KilnError("GNU patch is not installed; install it (apt-get install patch)")
    return path


def apply_topic(tree: Path, topic: Topic) -> list[HunkOffset]:
    """Apply one topic to ``tree`` in place; raise PatchFailed naming file and hunk."""
    result = subprocess.run(
        [patch_binary(), "-p1", "--fuzz=0", "--batch", "--forward",
         "--no-backup-if-mismatch", "--reject-file=-", "-d", str(tree)],
        input=topic.diff, capture_output=True, text=True,
    )
    output = result.stdout + result.stderr
    offsets, failures = [], []
    current = "?"
    for line in output.splitlines():
        if m := _PATCHING.match(line):
            current = m.group("file").strip("'")
        elif m := _OFFSET.match(line):
            offsets.append(HunkOffset(topic.name, current, int(m["hunk"]), int(m["offset"])))
        elif m := _FAILED.match(line):
            failures.append(f"{current}: hunk #{m['hunk']} FAILED at line {m['line']}")
        elif "Reversed (or previously applied) patch detected" in line:
            failures.append(f"{current}: already applied upstream (reversed patch detected)")
        elif line.startswith("can't find file to patch"):
            failures.append(f"{current}: file to patch does not exist")
    if result.returncode != 0 and not failures:
        failures.append(f"GNU patch exited with status {result.returncode}")
    if failures:
        raise PatchFailed(topic.name, failures, output)
    return offsets


def apply_series(tree: Path, topics: Iterable[Topic],
                 on_topic: Callable[[Topic, list[HunkOffset]], None] | None = None) -> ApplyReport:
    """Apply topics in order to ``tree`` in place."""
    report = ApplyReport()
    for topic in topics:
        offsets = apply_topic(tree, topic)
        report.offsets += offsets
        if on_topic:
            on_topic(topic, offsets)
    return report


def apply_series_into(pristine: Path, series: Series, into: Path,
                      on_topic: Callable[[Topic, list[HunkOffset]], None] | None = None) -> ApplyReport:
    """Copy ``pristine`` and apply the series; ``into`` appears only if all topics apply."""
    if into.exists():
        raise KilnError(f"{into} already exists; choose a new folder (nothing is overwritten)")
    into.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into.parent, prefix=f".{into.name}.") as tmp:
        work = Path(tmp) / "tree"
        shutil.copytree(pristine, work, symlinks=True)
        report = apply_series(work, series.topics, on_topic)
        os.replace(work, into)
    return report

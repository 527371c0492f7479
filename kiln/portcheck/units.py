"""The series' own code: each topic's added lines on the patched tree, and the overlay modules."""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kiln.portcheck.findings import OVERLAY_TOPIC, Finding, Unparsable, parse_source
from kiln.portcheck.treeindex import module_name
from kiln.series.patching import apply_topic
from kiln.series.series import Series, Topic


@dataclass
class Hunk:
    path: str
    added: list[int]  # line numbers of added lines in the file after the topic
    span: tuple[int, int]  # new-side lines the hunk's changes sit between


def topic_hunks(topic: Topic) -> list[Hunk]:
    """Added lines and change spans of each hunk, on the topic's new side."""
    return [Hunk(f.new_path, [n for n, _ in h.added()], (min(h.changed()), max(h.changed())))
            for f in topic.file_diffs() if f.new_path for h in f.hunks if h.changed()]


@dataclass
class CodeUnit:
    """A module's source and the lines whose code belongs to the series (None: all)."""

    topic: str
    path: str  # as the finding names it
    module: str
    tree: ast.Module
    source: str
    lines: set[int] | None
    hunks: list[Hunk] = field(default_factory=list)

    def counts(self, node: ast.AST) -> bool:
        if self.lines is None:
            return True
        start = getattr(node, "lineno", None)
        end = getattr(node, "end_lineno", start)
        return start is not None and any(n in self.lines for n in range(start, end + 1))


def series_units(pristine: Path, series: Series, work: Path,
                 unparsed: list[Finding]) -> list[CodeUnit]:
    """Apply the series to a copy of ``pristine`` topic by topic; keep each topic's added code.
    Files that do not parse go to ``unparsed``."""
    if not series.topics:
        return []
    tree = work / "tree"
    # Topics may only touch vllm/ (the wheel rule), so only that folder is copied.
    shutil.copytree(pristine / "vllm", tree / "vllm", symlinks=True)
    units: list[CodeUnit] = []
    for topic in series.topics:
        apply_topic(tree, topic)
        by_file: dict[str, list[Hunk]] = {}
        for hunk in topic_hunks(topic):
            by_file.setdefault(hunk.path, []).append(hunk)
        for path, hunks in by_file.items():
            if not path.endswith(".py"):
                continue
            text = (tree / path).read_text()
            try:
                parsed = parse_source(tree / path, path)
            except Unparsable as e:
                unparsed.append(e.finding(topic.name))
                continue
            lines = {n for h in hunks for n in h.added}
            units.append(CodeUnit(topic.name, path, module_name(path), parsed, text, lines, hunks))
    return units


def overlay_units(overlays: list[tuple[Path, str]], series: Series,
                  unparsed: list[Finding]) -> list[CodeUnit]:
    """Every overlay module, named after the topic whose added lines import it; files
    that do not parse go to ``unparsed``."""
    units = []
    for folder, package in overlays:
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(folder).as_posix()
            module = module_name(f"{package.replace('.', '/')}/{rel}")
            label = f"{folder.name}/{rel}"
            topic = next((t.name for t in series.topics if _mentions(t, module)), OVERLAY_TOPIC)
            try:
                parsed = parse_source(path, label)
            except Unparsable as e:
                unparsed.append(e.finding(topic))
                continue
            units.append(CodeUnit(topic, label, module, parsed, path.read_text(), None))
    return units


def _mentions(topic: Topic, module: str) -> bool:
    pattern = re.compile(rf"^\+.*\b{re.escape(module)}\b", re.M)
    return bool(pattern.search(topic.diff))

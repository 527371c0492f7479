"""The unified-diff model every kiln command reads patches through: files, their
hunks, and each hunk's lines on both sides.

A hunk's body is read by its counts, not by its lines' first characters, so a
removed line that reads ``-- a/x`` or an added ``++ b/y`` is never taken for a
file header.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.errors import KilnError

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_count: int
    new_start: int
    new_count: int
    lines: tuple[str, ...]  # the body, each line with its ' ', '+', '-' or '\\' mark

    def added(self) -> list[tuple[int, str]]:
        """(new-side line number, text) of every added line."""
        out, number = [], self.new_start
        for line in self.lines:
            if line.startswith("+"):
                out.append((number, line[1:]))
                number += 1
            elif line.startswith(" ") or line == "":
                number += 1
        return out

    def changed(self) -> list[int]:
        """New-side line numbers the hunk's changes sit at: an added line's own number,
        a removed line's next new-side line."""
        out, number = [], self.new_start
        for line in self.lines:
            if line.startswith("+"):
                out.append(number)
                number += 1
            elif line.startswith("-"):
                out.append(number)
            elif line.startswith(" ") or line == "":
                number += 1
        return out


@dataclass(frozen=True)
class FileDiff:
    old_path: str | None  # None: /dev/null (the diff adds the file)
    new_path: str | None  # None: /dev/null (the diff deletes the file)
    hunks: tuple[Hunk, ...]

    @property
    def paths(self) -> list[str]:
        """Old then new name, once each."""
        return list(dict.fromkeys(p for p in (self.old_path, self.new_path) if p))


def _path(line: str, prefix: str) -> str | None:
    """``--- a/x`` -> ``x``; ``/dev/null`` -> None (a tab-separated timestamp is dropped)."""
    name = line[4:].split("\t")[0].strip()
    if name == "/dev/null":
        return None
    return name[2:] if name.startswith(prefix) else name


def parse_diff(text: str, source: str = "diff") -> list[FileDiff]:
    """Every file of a git-style unified diff; ``source`` names it in errors."""
    files: list[FileDiff] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines)
                and lines[i + 1].startswith("+++ ")):
            i += 1  # git's own lines (diff --git, index, mode) and free text
            continue
        old, new = _path(lines[i], "a/"), _path(lines[i + 1], "b/")
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and (m := _HUNK.match(lines[i])):
            old_left, new_left = int(m.group(2) or 1), int(m.group(4) or 1)
            start, body = i + 1, []
            i += 1
            while old_left > 0 or new_left > 0:
                if i >= len(lines):
                    raise KilnError(f"{source}: the hunk at line {start} ({lines[start - 1]}) "
                                    f"ends early: {old_left} old and {new_left} new line(s) missing")
                line = lines[i]
                mark = line[:1]
                if mark == "+":
                    new_left -= 1
                elif mark == "-":
                    old_left -= 1
                elif mark in (" ", ""):
                    old_left -= 1
                    new_left -= 1
                elif mark != "\\":
                    raise KilnError(f"{source}: line {i + 1} in a hunk starts with {mark!r}; "
                                    "allowed: ' ', '+', '-', '\\'")
                body.append(line)
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                body.append(lines[i])  # "\ No newline at end of file" after the last line
                i += 1
            hunks.append(Hunk(int(m.group(1)), int(m.group(2) or 1), int(m.group(3)),
                              int(m.group(4) or 1), tuple(body)))
        files.append(FileDiff(old, new, tuple(hunks)))
    return files

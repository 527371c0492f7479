"""Synthetic upstream trees and series for kiln's unit tests (no network, no vLLM)."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

HEADER = """\
Topic: {name}
Kind: fix
What: {what}
Upstream: none
Cut-against: 1.0.0
Retires-when: never
"""


def make_diff(root: Path, path: str, new_text: str) -> str:
    """A git-style diff of one file of ``root`` against ``new_text``."""
    old = root / path
    result = subprocess.run(
        ["git", "diff", "--no-index", "--no-color", "--src-prefix=a/", "--dst-prefix=b/",
         str(old), "-"],
        input=new_text, capture_output=True, text=True,
    )
    # git names the files by their absolute paths; rewrite them to the tree's.
    lines = []
    for line in result.stdout.splitlines(keepends=True):
        if line.startswith("diff --git"):
            line = f"diff --git a/{path} b/{path}\n"
        elif line.startswith("--- "):
            line = f"--- a/{path}\n"
        elif line.startswith("+++ "):
            line = f"+++ b/{path}\n"
        elif line.startswith(("index ", "new file mode", "deleted file mode")):
            continue
        lines.append(line)
    return "".join(lines)


def write_patch(patches: Path, number: int, name: str, diff: str, what: str = "a change") -> Path:
    patches.mkdir(parents=True, exist_ok=True)
    path = patches / f"{number:04d}-{name}.patch"
    path.write_text(HEADER.format(name=name, what=what) + "---\n" + diff)
    series = patches / "series"
    entries = series.read_text() if series.exists() else ""
    series.write_text(entries + path.name + "\n")
    return path


@pytest.fixture
def pristine(tmp_path: Path) -> Path:
    """A small upstream tree: a package with two modules."""
    root = tmp_path / "pristine"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "a.py").write_text("".join(f"line {i}\n" for i in range(1, 41)))
    (root / "vllm" / "b.py").write_text(textwrap.dedent("""\
        def f(x):
            return x + 1


        def g(y):
            return y * 2
        """))
    return root

"""The repository's Markdown points only at what a clone has: every link and every
repository path it names exists in the repository, and nothing reaches outside it. A
document links only down from its own folder (no ../), so docs/ reads whole on its own."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.paths import REPO_ROOT

# Top-level folders whose paths, written in backticks, name repository files. vllm/ is
# left out but for vllm/fork/: most vllm/ paths in the docs are upstream's or the wheel's;
# csrc/ likewise (upstream's compiled sources).
REPO_PREFIXES = ("bench/", "docs/", "fa2/", "kiln/", "kvarn/", "patches/", "requirements/",
                 "specattn/", "tests/", "vllm/fork/", ".ci/")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# Globs, <version>-style placeholders, and segments in capitals (patches/V/, DIR/run).
PLACEHOLDER = re.compile(r"[*<>{}$\[\]|?]|(^|/)[A-Z][A-Z_]*(\.|/|$)")
UP = re.compile(r"(?<!\.)\.\./")  # ../ but not an ellipsis before a slash
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Line:
    doc: Path
    name: str  # the document's path in the repository
    number: int
    text: str
    code: bool  # inside a fenced or indented code block

    def where(self) -> str:
        return f"{self.name}:{self.number}"


def documents(root: Path = REPO_ROOT) -> list[Path]:
    return sorted([*root.glob("*.md"), *(root / "docs").glob("*.md"), *(root / "csrc").glob("*.md")])


def lines(doc: Path, root: Path = REPO_ROOT) -> list[Line]:
    name = str(doc.relative_to(root))
    result, fenced, previous_blank_or_code = [], False, True
    for number, text in enumerate(doc.read_text().splitlines(), start=1):
        if text.lstrip().startswith("```"):
            fenced = not fenced
            result.append(Line(doc, name, number, text, True))
            continue
        indented = text.startswith(("    ", "\t")) and previous_blank_or_code
        code = fenced or indented
        result.append(Line(doc, name, number, text, code))
        previous_blank_or_code = not text.strip() or indented
    return result


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path, root: Path = REPO_ROOT) -> set[str]:
    seen: dict[str, int] = {}
    for line in lines(doc, root):
        match = None if line.code else HEADING.match(line.text)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
    found = set()
    for base, count in seen.items():
        found.update([base, *(f"{base}-{i}" for i in range(1, count))])
    return found


def inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def link_problems(line: Line, root: Path = REPO_ROOT) -> list[str]:
    problems = []
    for target in LINK.findall(line.text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        path = (line.doc.parent / path_part).resolve() if path_part else line.doc
        if not inside(path, root):
            problems.append(f"{line.where()}: link {target!r} points outside the repository")
        elif UP.search(path_part):
            problems.append(f"{line.where()}: link {target!r} climbs out of its document's "
                            "folder; say what it needs in place")
        elif not path.exists():
            problems.append(f"{line.where()}: link {target!r}: {path.relative_to(root)} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path, root):
            problems.append(f"{line.where()}: link {target!r}: no heading in "
                            f"{path.relative_to(root)} has the anchor #{anchor}")
    return problems


def path_problems(line: Line, root: Path = REPO_ROOT) -> list[str]:
    """Paths outside the repository anywhere; repository paths in code spans that do not exist."""
    problems = [f"{line.where()}: {token!r} points outside the repository"
                for token in LINK.sub("", line.text).split() if UP.search(token)]
    if line.code:
        return problems
    for span in CODE_SPAN.findall(line.text):
        if " " in span or not span.startswith(REPO_PREFIXES) or PLACEHOLDER.search(span):
            continue
        path = re.split(r":", span, maxsplit=1)[0]  # file.py:name, file.py::test
        if not (root / path).exists():
            problems.append(f"{line.where()}: `{span}` names {path}, which the repository lacks")
    return problems


def test_the_documents_exist():
    names = {str(d.relative_to(REPO_ROOT)) for d in documents()}
    assert {"README.md", "RELEASE-NOTES.md", "docs/design.md", "docs/kvarn-format.md",
            "docs/topics.md", "docs/porting.md", "docs/ledger.md"} <= names


@pytest.mark.parametrize("doc", documents(), ids=lambda d: str(d.relative_to(REPO_ROOT)))
def test_every_link_and_path_stays_in_the_repository_and_exists(doc):
    problems = [p for line in lines(doc) for p in (*link_problems(line), *path_problems(line))]
    assert problems == [], "\n".join(problems)


# The checks themselves, on documents written here.

def _problems(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Some `code` (here)\n")
    (tmp_path / "kiln").mkdir(exist_ok=True)
    (tmp_path / "kiln" / "wheel.py").write_text("")
    doc = tmp_path / "README.md"
    doc.write_text(text)
    return [p for line in lines(doc, tmp_path) for p in (*link_problems(line, tmp_path),
                                                  *path_problems(line, tmp_path))]


def test_links_to_files_and_headings_that_exist_pass(tmp_path):
    assert _problems(tmp_path, "# Title\n\nSee [a](docs/other.md), [b](docs/other.md#some-code-here),"
                               " [c](#title), [d](https://example.com/x) and `kiln/wheel.py:build`.\n"
                               "A placeholder `patches/<version>/series` and a command "
                               "`tests/run tests/unit` are not paths.\n") == []


def test_a_link_outside_the_repository_fails(tmp_path):
    [problem] = _problems(tmp_path, "See [design](../shared/design.md).\n")
    assert "README.md:1: link '../shared/design.md' points outside the repository" in problem


def test_a_path_outside_the_repository_in_prose_or_a_command_fails(tmp_path):
    problems = _problems(tmp_path, "See `../shared/kvarn-spec.md`.\n\n    kiln materialize --into ../work\n")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "'`../shared/kvarn-spec.md`.' points outside the repository",
        "'../work' points outside the repository"]


def test_a_link_up_out_of_docs_fails_though_its_target_exists(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("See [the README](../README.md#top).\n")
    [problem] = [p for line in lines(page, tmp_path) for p in link_problems(line, tmp_path)]
    assert "docs/page.md:1: link '../README.md#top' climbs out of its document's folder" in problem


def test_a_missing_file_a_missing_anchor_and_a_missing_repository_path_fail(tmp_path):
    problems = _problems(tmp_path, "[a](docs/gone.md) [b](docs/other.md#nowhere) `kvarn/gone.py`\n")
    assert len(problems) == 3
    assert "docs/gone.md does not exist" in problems[0]
    assert "no heading in docs/other.md has the anchor #nowhere" in problems[1]
    assert "`kvarn/gone.py` names kvarn/gone.py, which the repository lacks" in problems[2]

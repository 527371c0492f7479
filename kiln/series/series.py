"""The topic series: ``patches/<version>/series`` (apply order) and one patch per topic.

A patch file is the topic's header (the commit message in the git view), a line
``---``, then a git-style unified diff against the upstream source root::

    Topic: prompt-progress
    Kind: backport
    What: streamed outputs carry num_computed_tokens
    Upstream: https://github.com/vllm-project/vllm/pull/40371
    Cut-against: 0.32.0
    Retires-when: upstream merges #40371

    Optional free text.
    ---
    diff --git a/vllm/outputs.py b/vllm/outputs.py
    ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.paths import REPO_ROOT
from kiln.series.diff import FileDiff, parse_diff
from kiln.textfile import read_utf8
from kiln.upstream.lock import UpstreamLock, version_key

HEADER_FIELDS = ("Topic", "Kind", "What", "Upstream", "Cut-against", "Retires-when")
KINDS = ("fix", "feature", "backport", "own", "local")
SEPARATOR = "---\n"
VERSION_DIR = re.compile(r"^\d+\.\d+\.\d+$")
PATCH_NAME = re.compile(r"^(?P<number>\d{4})-(?P<topic>[a-z0-9][a-z0-9_.-]*)\.patch$")


@dataclass(frozen=True)
class Topic:
    """One self-contained change: its header, its diff, and where it is stored."""

    name: str
    path: Path
    fields: dict[str, str]
    message: str  # everything before the separator: the commit message
    diff: str

    @property
    def kind(self) -> str:
        return self.fields.get("Kind", "")

    @property
    def what(self) -> str:
        return self.fields.get("What", "")

    def files(self) -> list[str]:
        """Upstream paths the diff touches (old and new names)."""
        return list(dict.fromkeys(p for f in self.file_diffs() for p in f.paths))

    def file_diffs(self) -> list[FileDiff]:
        return parse_diff(self.diff, self.path.name)

    def text(self) -> str:
        return self.message + "\n" + SEPARATOR + self.diff

    @classmethod
    def parse(cls, path: Path, text: str | None = None) -> Topic:
        text = read_utf8(path) if text is None else text
        message, sep, diff = text.partition("\n" + SEPARATOR)
        if not sep:
            raise KilnError(f"{path.name}: no '---' line between the header and the diff")
        fields: dict[str, str] = {}
        for line in message.split("\n"):
            if not line.strip():
                break
            key, colon, value = line.partition(":")
            if not colon:
                raise KilnError(f"{path.name}: header line {line!r} is not 'Field: value'")
            fields[key.strip()] = value.strip()
        m = PATCH_NAME.match(path.name)
        name = m.group("topic") if m else fields.get("Topic", path.stem)
        return cls(name=name, path=path, fields=fields, message=message, diff=diff)

    def header_problems(self) -> list[str]:
        """What makes this header incomplete or inconsistent, in words."""
        problems = []
        for key in HEADER_FIELDS:
            if not self.fields.get(key):
                problems.append(f"{self.path.name}: header field '{key}' is missing or empty")
        unknown = sorted(set(self.fields) - set(HEADER_FIELDS))
        if unknown:
            problems.append(
                f"{self.path.name}: unknown header field(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(HEADER_FIELDS)}"
            )
        if self.kind and self.kind not in KINDS:
            problems.append(
                f"{self.path.name}: Kind '{self.kind}' is not one of {', '.join(KINDS)}"
            )
        if self.fields.get("Topic") and self.fields["Topic"] != self.name:
            problems.append(
                f"{self.path.name}: Topic '{self.fields['Topic']}' differs from the file "
                f"name's topic '{self.name}'"
            )
        if not PATCH_NAME.match(self.path.name):
            problems.append(f"{self.path.name}: file name is not NNNN-<topic>.patch")
        if not self.diff.strip():
            problems.append(f"{self.path.name}: the diff is empty")
        return problems


@dataclass
class Series:
    """The ordered topics of a patches directory."""

    directory: Path
    topics: list[Topic] = field(default_factory=list)

    @property
    def series_file(self) -> Path:
        return self.directory / "series"

    @classmethod
    def load(cls, directory: Path | None = None) -> Series:
        """Read ``series`` and its patches (default: the lock's default pin's series);
        entries and files must agree both ways."""
        directory = directory or series_dir()
        series_file = directory / "series"
        if not series_file.exists():
            raise KilnError(f"{series_file}: missing; it lists the patches in apply order")
        entries = parse_series_file(read_utf8(series_file))
        problems = []
        listed = set(entries)
        for name in entries:
            if not (directory / name).is_file():
                problems.append(f"series lists {name}, but {directory / name} does not exist")
        for path in sorted(directory.glob("*.patch")):
            if path.name not in listed:
                problems.append(f"{path.name} is in {directory} but not listed in series")
        duplicates = sorted({n for n in entries if entries.count(n) > 1})
        problems += [f"series lists {n} more than once" for n in duplicates]
        if problems:
            raise KilnError("the series and the patch files disagree:\n  " + "\n  ".join(problems))
        return cls(directory, [Topic.parse(directory / n) for n in entries])

    def problems(self) -> list[str]:
        """Header problems of every topic plus duplicate topic names."""
        problems = [p for t in self.topics for p in t.header_problems()]
        names = [t.name for t in self.topics]
        problems += [f"topic {n} appears more than once" for n in sorted(set(names)) if names.count(n) > 1]
        return problems

    def topic(self, name: str) -> Topic:
        for t in self.topics:
            if t.name == name:
                return t
        raise KilnError(f"no topic {name!r}; topics: {', '.join(t.name for t in self.topics)}")


def series_dir(version: str | None = None, root: Path = REPO_ROOT,
               lock: UpstreamLock | None = None) -> Path:
    """``patches/<version>/``: the series cut against that upstream pin (default: the
    lock's default). Each carried pin has its own folder, so every command reads the
    series of the pin it is asked about and none is left unread. ``lock``: the root's
    lock, where the caller has read it already."""
    lock = lock or _root_lock(root)
    version = version or lock.default
    path = root / "patches" / version
    if version not in lock.releases:
        if (path / "series").is_file():
            raise _unpinned_series(path, lock)
        lock.release(version)  # refuses, naming the pinned versions
    if not (path / "series").is_file():
        carried = ", ".join(carried_versions(root, lock)) or "none"
        raise KilnError(f"no series for vLLM {version}: {path / 'series'} does not exist "
                        f"(carried pins: {carried})")
    return path


def carried_versions(root: Path = REPO_ROOT, lock: UpstreamLock | None = None) -> list[str]:
    """Every pin with a series folder under ``patches/``, oldest first; a folder for a
    version the lock does not pin is refused."""
    folders = sorted((p for p in (root / "patches").iterdir()
                      if VERSION_DIR.match(p.name) and (p / "series").is_file()),
                     key=lambda p: version_key(p.name))
    lock = lock or _root_lock(root)
    for folder in folders:
        if folder.name not in lock.releases:
            raise _unpinned_series(folder, lock)
    return [p.name for p in folders]


def _root_lock(root: Path) -> UpstreamLock:
    return UpstreamLock.load(root / "requirements" / "upstream.lock")


def _unpinned_series(folder: Path, lock: UpstreamLock) -> KilnError:
    return KilnError(
        f"{folder} holds a series for vLLM {folder.name}, which {lock.path} does not pin "
        f"(pinned: {', '.join(sorted(lock.releases, key=version_key))}); pin it with "
        f"`python -m kiln pin-bump --to {folder.name}` or remove the folder"
    )


def parse_series_file(text: str) -> list[str]:
    """Patch file names in order; blank lines and '#' comments are ignored."""
    entries = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            entries.append(line)
    return entries


def series_file_text(topics: list[Topic]) -> str:
    return "".join(t.path.name + "\n" for t in topics)

"""The training text: the ``.py`` files of the running Python's standard library.

Files are taken in sorted path order and split by a hash of their relative path
(never by random state), so the split is the same on every run and on every machine
with the same standard library. Bytes are read as UTF-8 with errors replaced.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

# One file in HELD_OUT_EVERY is held out for evaluation (by its path's hash).
HELD_OUT_EVERY = 16
_INSTALLED = {"site-packages", "dist-packages"}


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the library root, POSIX separators
    size: int
    sha256: str


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[SourceFile, ...]
    held_out: tuple[SourceFile, ...]

    def read(self, file: SourceFile) -> str:
        return read_text(self.root / file.path)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def is_held_out(path: str) -> bool:
    """Whether the file at relative ``path`` belongs to the evaluation split."""
    return hashlib.sha256(path.encode()).digest()[0] % HELD_OUT_EVERY == 0


def source_paths(root: Path) -> list[str]:
    """Every ``.py`` file under ``root``, relative and sorted; installed packages left out."""
    if not root.is_dir():
        raise KilnError(f"{root}: no such folder (the standard library to train on)")
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _INSTALLED.isdisjoint(rel.parts) and path.is_file():
            found.append(rel.as_posix())
    return sorted(found)


def load_corpus(root: Path, max_train_bytes: int) -> Corpus:
    """The split of ``root``'s files: the held-out ones, and the training ones in
    sorted order until the next would pass ``max_train_bytes``."""
    train: list[SourceFile] = []
    held: list[SourceFile] = []
    total = 0
    for rel in source_paths(root):
        data = (root / rel).read_bytes()
        entry = SourceFile(rel, len(data), hashlib.sha256(data).hexdigest())
        if is_held_out(rel):
            held.append(entry)
        elif total + entry.size <= max_train_bytes:
            train.append(entry)
            total += entry.size
    if not train or not held:
        raise KilnError(f"{root}: too few .py files for a training and a held-out split "
                        f"({len(train)} and {len(held)} within {max_train_bytes} bytes)")
    return Corpus(root, tuple(train), tuple(held))


def corpus_digest(files: tuple[SourceFile, ...]) -> str:
    """sha256 over each file's path, size and content hash."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return h.hexdigest()


def check_held_out(corpus_root: Path, files: tuple[SourceFile, ...]) -> None:
    """Refuse to evaluate on held-out files that differ from those recorded at training
    (another Python's standard library): the split would no longer be held out."""
    for f in files:
        path = corpus_root / f.path
        if not path.is_file():
            raise KilnError(f"{path}: held-out file recorded at training is missing; "
                            "evaluate with the Python the model was trained with")
        if hashlib.sha256(path.read_bytes()).hexdigest() != f.sha256:
            raise KilnError(f"{path}: differs from the held-out file recorded at training; "
                            "evaluate with the Python the model was trained with")

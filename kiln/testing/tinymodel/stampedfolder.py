"""A folder that a kiln command writes whole, marked by a stamp file recording what
built it.

The tiny model, the DFlash2 drafter and the trained reference model share it: a build
reuses a folder whose stamp matches, replaces one holding its stamp and nothing but the
files a build writes, and refuses anything else, so no file the user put in ``--out``
is ever deleted.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

_SHOWN = 5


@dataclass(frozen=True)
class StampedFolder:
    path: Path
    stamp: str  # the stamp's file name
    files: frozenset[str]  # every file a build writes, the stamp included
    what: str  # "tiny model", "DFlash2 drafter": named in refusals
    command: str = "tiny-model"  # the command that writes it, named in refusals

    def record(self) -> dict[str, Any] | None:
        """The stamp's contents; None where the folder has no stamp."""
        stamp = self.path / self.stamp
        if not stamp.is_file():
            return None
        try:
            data = json.loads(stamp.read_bytes())
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise KilnError(f"{stamp}: not the JSON record {self.command} writes ({e}); move "
                            "the folder away or pass an empty or new folder to --out") from None
        if not isinstance(data, dict):
            raise KilnError(f"{stamp}: holds a JSON {type(data).__name__}, not the object "
                            f"{self.command} writes; move the folder away or pass an empty or "
                            "new folder to --out")
        return data

    def holds(self, fingerprint: str) -> bool:
        """Whether the folder was built from ``fingerprint`` (its stamp says so)."""
        record = self.record()
        return record is not None and record.get("fingerprint") == fingerprint

    def check_replaceable(self, written: Iterable[str] = ()) -> None:
        """Refuse unless the folder is absent, empty, or holds a readable stamp and no file
        but those a build writes (``written``: the names a finished build holds)."""
        out = self.path
        if out.exists() and not out.is_dir():
            raise KilnError(f"{out} is a file, not a folder; pass an empty or new folder to --out")
        if not out.exists() or not any(out.iterdir()):
            return
        if self.record() is None:
            raise KilnError(f"{out} exists and is not a kiln {self.what} folder; "
                            "pass an empty or new folder to --out")
        owned = self.files | set(written)
        foreign = sorted(p.name for p in out.iterdir() if p.name not in owned)
        if foreign:
            shown = ", ".join(foreign[:_SHOWN]) + (", ..." if len(foreign) > _SHOWN else "")
            raise KilnError(
                f"{out} holds {shown}, which {self.command} did not write; it only replaces a "
                f"folder holding a {self.what} and nothing else: move those out or pass an "
                "empty or new folder to --out"
            )

    def replace_with(self, built: Path) -> None:
        """Put the finished folder ``built`` (a sibling) in place, checked again first;
        the old folder is moved aside, not removed, until the new one is in. mkdtemp
        and the safetensors writer make owner-only files, and a model folder is shared
        (CI users, servers running as another user), so it is made readable to all."""
        self.check_replaceable(p.name for p in built.iterdir())
        built.chmod(0o755)
        for path in built.iterdir():
            path.chmod(0o644)
        old = built.with_name(built.name + "-old")
        if self.path.exists():
            self.path.rename(old)
        built.rename(self.path)
        shutil.rmtree(old, ignore_errors=True)

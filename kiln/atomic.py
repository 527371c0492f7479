"""Write a file beside its final name and swap it in whole."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import naming


@contextlib.contextmanager
def replacing(target: Path, mode: int = 0o644) -> Iterator[Path]:
    """A new temporary path beside ``target``, unique to this writer, for the caller to
    write; it replaces ``target`` atomically when the block ends cleanly.

    Two writers of one target never share a file, so the target is always one whole
    write. On any exception (Ctrl-C and SIGTERM included) the temporary file is removed,
    and an error removing it never hides the original one.
    """
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        with naming(tmp):
            yield tmp
        tmp.chmod(mode)  # mkstemp makes it owner-only; what kiln writes is for anyone to read
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise

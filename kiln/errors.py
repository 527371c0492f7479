"""The exception types the CLI turns into a clean message and exit status."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path


class KilnError(Exception):
    """A user-facing failure: the message names what is wrong and what is allowed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so every cleanup that runs on Ctrl-C
    (temporary files removed) runs for it too."""


# What only a write raises; the write to an open file that fails names no file.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """Name ``path`` (the file or folder being written) on a disk-full, over-quota or
    too-large error raised inside that names no file, so the message says where."""
    try:
        yield
    except OSError as e:
        if e.errno in _WRITE_ERRNOS and e.filename is None:
            e.filename = str(path)
        raise


def describe_os_error(error: OSError) -> str:
    """'what (path)' for an OSError: the system's words and the file(s) involved. A
    copytree's shutil.Error (a list of failed copies) is told by its first failure."""
    if isinstance(error, shutil.Error) and error.args and isinstance(error.args[0], list):
        failures = error.args[0]
        source, target, why = failures[0]
        more = f"; {len(failures) - 1} more failed" if len(failures) > 1 else ""
        return f"copying {source} to {target} failed: {why}{more}"
    what = error.strerror or str(error)
    paths = [str(p) for p in (error.filename, error.filename2) if p is not None]
    return f"{what} ({' -> '.join(paths)})" if paths else what

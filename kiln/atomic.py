"""Write a file beside its final name and swap it in whole."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import naming

# A temporary file's name ends with its writer's pid: .<target>.<random>.<pid>.tmp
_WRITER_PID = re.compile(r"\.(?P<pid>\d+)\.tmp$")


@contextlib.contextmanager
def replacing(target: Path, mode: int = 0o644) -> Iterator[Path]:
    """A new temporary path beside ``target``, unique to this writer, for the caller to
    write; it replaces ``target`` atomically when the block ends cleanly.

    Two writers of one target never share a file, so the target is always one whole
    write. On any exception (Ctrl-C and SIGTERM included) the temporary file is removed,
    and an error removing it never hides the original one. A writer killed outright
    leaves it behind; the file's name (its writer's pid) and its lock, held while it is
    written, let :func:`remove_abandoned` tell it from a live writer's.
    """
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                suffix=f".{os.getpid()}.tmp")
    tmp = Path(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with naming(tmp):
            yield tmp
        tmp.chmod(mode)  # mkstemp makes it owner-only; what kiln writes is for anyone to read
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        os.close(fd)


def remove_abandoned(folder: Path, targets: str) -> list[Path]:
    """Remove the temporary files that :func:`replacing` left in ``folder`` for targets
    matching the glob ``targets`` and whose writer is gone: no process has its pid
    (a writer in another pid namespace may look gone that way) and no one holds its
    lock. Return the files removed."""
    removed = []
    for path in sorted(folder.glob(f".{targets}.*.tmp")):
        found = _WRITER_PID.search(path.name)
        if found is None or _runs(int(found["pid"])):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # its writer finished meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
            removed.append(path)
        except BlockingIOError:
            pass  # a live writer holds it
        finally:
            os.close(fd)
    return removed


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True

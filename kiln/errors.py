"""The exception types the CLI turns into a clean message and exit status."""

from __future__ import annotations


class KilnError(Exception):
    """A user-facing failure: the message names what is wrong and what is allowed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so every cleanup that runs on Ctrl-C
    (temporary files removed) runs for it too."""


def describe_os_error(error: OSError) -> str:
    """'what (path)' for an OSError: the system's words and the file(s) involved."""
    what = error.strerror or str(error)
    paths = [str(p) for p in (error.filename, error.filename2) if p is not None]
    return f"{what} ({' -> '.join(paths)})" if paths else what

"""SIGTERM and Ctrl-C for the CLI: raised where the program is, except inside a block
that a signal must not cut in half.

A signal raised in the middle of ``ZipFile.writestr`` leaves the archive with an open
writing handle, and closing it then fails with a second error that hides the first.
Such writes run inside :func:`uninterrupted`; a signal that arrives there is held and
raised as the block ends, between two whole writes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from kiln.errors import Terminated

# Process-wide because signal handlers are: the depth of nested uninterrupted() blocks
# and the first signal held inside them.
_depth = 0
_held: int | None = None


def _raise_for(signum: int) -> None:
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


def _handler(signum: int, frame) -> None:
    global _held
    if _depth:
        if _held is None:
            _held = signum
        return
    _raise_for(signum)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Run a block whole: SIGTERM or Ctrl-C arriving inside it is raised when it ends."""
    global _depth, _held
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if _depth == 0 and _held is not None:
        signum, _held = _held, None
        _raise_for(signum)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Install the handler for SIGTERM and SIGINT for the block (main thread only;
    elsewhere signals keep their handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

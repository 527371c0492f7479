"""The GPU tier's scenario engines run as process groups of their own (so a timed-out one
is killed with every process it started). A test session ended by a signal would leave
them holding the GPU, as a device run cut at its limit once did (118 GiB kept); the
session registers each group here and ends them all on SIGTERM or SIGINT."""
from __future__ import annotations

import contextlib
import os
import signal
import threading


class ProcessGroups:
    def __init__(self) -> None:
        self._leaders: set[int] = set()
        self._lock = threading.Lock()

    def add(self, pid: int) -> None:
        """A process started with start_new_session=True (it leads its group)."""
        with self._lock:
            self._leaders.add(pid)

    def discard(self, pid: int) -> None:
        with self._lock:
            self._leaders.discard(pid)

    def kill_all(self) -> list[int]:
        """SIGKILL every registered group; the leaders signalled."""
        with self._lock:
            leaders, self._leaders = sorted(self._leaders), set()
        for pid in leaders:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        return leaders

    def end_on(self, *signals: int) -> None:
        """On each signal: kill the groups, then die of that signal as before."""
        def handler(signum, frame):
            self.kill_all()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        for sig in signals:
            signal.signal(sig, handler)

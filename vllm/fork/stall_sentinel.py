"""Warn when no engine step completes for N seconds while requests are live.

A hung collective, a deadlocked kernel or a blocked KV transfer shows up from
outside as requests that never finish and a log that says nothing. The engine
core's busy loop reports each step start and finish here; a daemon thread
warns every VLLM_ENGINE_STALL_WARN_S seconds (0 disables) for as long as the
engine holds requests and no step has completed.

VLLM_ENGINE_STALL_TEST_TRIGGER names a file for tests: when it exists at the
start of a step, that step sleeps for the number of seconds the file holds and
the file is removed, so a test can stall a real server on purpose. A file that
holds "every N" stays, and every step sleeps N seconds while it does, so a test's
requests cannot finish however slowly its clients are scheduled.
"""

from __future__ import annotations

import os
import threading
import time

from vllm.logger import init_logger

from vllm import envs

logger = init_logger(__name__)


class StallSentinel:
    def __init__(self, warn_after_s: float, test_trigger: str | None) -> None:
        self.warn_after_s = warn_after_s
        self.test_trigger = test_trigger
        self._lock = threading.Lock()
        self._last_progress = time.monotonic()
        self._live = False
        self._warnings = 0
        self._thread: threading.Thread | None = None

    def step_started(self) -> None:
        with self._lock:
            if not self._live:
                # Idle time before the first request is not a stall.
                self._live = True
                self._last_progress = time.monotonic()
        if self._thread is None and self.warn_after_s > 0:
            self._thread = threading.Thread(
                target=self._watch, name="engine-stall-sentinel", daemon=True
            )
            self._thread.start()
        if self.test_trigger:
            self._inject_test_stall(self.test_trigger)

    def step_finished(self, live: bool) -> None:
        now = time.monotonic()
        with self._lock:
            stalled_for = now - self._last_progress
            warned, self._warnings = self._warnings, 0
            self._last_progress = now
            self._live = live
        if warned:
            logger.warning(
                "Engine step completed again after a %.1fs stall", stalled_for
            )

    def _watch(self) -> None:
        poll = max(0.05, min(1.0, self.warn_after_s / 4))
        while True:
            time.sleep(poll)
            with self._lock:
                stalled_for = time.monotonic() - self._last_progress
                due = self._live and stalled_for >= self.warn_after_s * (
                    self._warnings + 1
                )
                if due:
                    self._warnings += 1
            if due:
                logger.warning(
                    "Engine stall: no engine step completed for %.1fs while "
                    "requests are live (VLLM_ENGINE_STALL_WARN_S=%g)",
                    stalled_for,
                    self.warn_after_s,
                )

    @staticmethod
    def _inject_test_stall(trigger: str) -> None:
        try:
            with open(trigger) as f:
                text = f.read().strip()
            every = text.startswith("every ")
            seconds = float(text.removeprefix("every ") or 0)
            if not every:
                os.unlink(trigger)
        except FileNotFoundError:
            return
        if every:
            logger.warning_once("Slowing every engine step by %.3fs (test trigger)", seconds)
        else:
            logger.warning("Stalling this engine step for %.1fs (test trigger)", seconds)
        time.sleep(seconds)


_SENTINEL: StallSentinel | None = None


def _sentinel() -> StallSentinel:
    global _SENTINEL
    if _SENTINEL is None:
        _SENTINEL = StallSentinel(
            envs.VLLM_ENGINE_STALL_WARN_S, envs.VLLM_ENGINE_STALL_TEST_TRIGGER
        )
    return _SENTINEL


def step_started() -> None:
    _sentinel().step_started()


def step_finished(live: bool) -> None:
    _sentinel().step_finished(live)

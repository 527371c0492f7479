"""Run a real `vllm serve` as a subprocess for the end-to-end tier.

The server runs in its own process group so stopping it reaps the engine core
and any worker it spawned; its whole output goes to a log file that the tests
read (log lines are part of what some topics promise) and that is printed when
start-up or a test fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# Dropped from the child's environment: they would redirect it to a GPU, to the
# hub, or to a caller's own server configuration.
_SCRUBBED_ENV = ("CUDA_VISIBLE_DEVICES", "VLLM_API_KEY", "VLLM_HOST_IP", "VLLM_PORT")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


@contextlib.contextmanager
def running(server: VllmServer) -> Iterator[VllmServer]:
    """Start the server (E2E_SERVER_START_TIMEOUT seconds, default 900), yield it, and
    always stop it."""
    try:
        server.start(timeout=float(os.environ.get("E2E_SERVER_START_TIMEOUT", "900")))
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    def __init__(
        self,
        model: str,
        args: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        served_name: str | None = None,
    ) -> None:
        self.model = model
        self.served_name = served_name or model
        self.args = list(args)
        self.log_path = log_path
        self.api_key = api_key
        self.port = free_port()
        self.host = "127.0.0.1"
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        # The interpreter running the tests, so no `vllm` on PATH is needed.
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model]
        cmd += ["--host", self.host, "--port", str(self.port), *self.args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.served_name != self.model:
            cmd += ["--served-model-name", self.served_name]
        return cmd

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def start(self, timeout: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.command()) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
                start_new_session=True,
            )
        try:
            self._wait_healthy(started + timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"vllm serve exited with code {code} before it was healthy\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise ServerStartError(
            "vllm serve was not healthy within the start-up timeout\n" + self.log_tail()
        )

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `grace`."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session made the server its group leader
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or it lingers in the group as a zombie
            if not _group_alive(pgid):
                break
            time.sleep(0.2)
        else:
            _signal_group(pgid, signal.SIGKILL)
        proc.wait(timeout=30)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_tail(self, lines: int = 150) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return f"----- server log tail ({self.log_path}) -----\n" + "\n".join(tail)

    def wait_for_log(
        self, pattern: str, after: int = 0, timeout: float = 30.0
    ) -> re.Match[str]:
        """First match of `pattern` in log text written after byte offset `after`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(after)
                text = f.read().decode("utf-8", errors="replace")
            match = regex.search(text)
            if match:
                return match
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no log line matching {pattern!r} within {timeout}s\n"
                    + self.log_tail(60)
                )
            time.sleep(0.2)

    def routes(self) -> list[tuple[str, frozenset[str]]]:
        """(path, methods) of every route the running app listed at start-up."""
        found: dict[str, set[str]] = {}
        for m in re.finditer(r"Route: (\S+), Methods: ([A-Z, ]+)", self.log_text()):
            methods = {x.strip() for x in m.group(2).split(",") if x.strip()}
            found.setdefault(m.group(1), set()).update(methods)
        return [(path, frozenset(methods)) for path, methods in found.items()]


def stream_then_disconnect(http: Any, body: dict[str, Any], events: int) -> None:
    """POST a streaming completion and close the connection after ``events`` data
    events, as a client that goes away mid-stream does."""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= events:
                return  # leaving the block closes the connection


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True

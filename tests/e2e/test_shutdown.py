"""`vllm serve` stopped with SIGTERM while requests are in flight (shutdown-ends-requests).

A server of its own per case, since each case stops it. With the default
--shutdown-timeout 0, every open stream must end with an error event and
`data: [DONE]`, a non-streaming request must get 503, and the server must exit
within seconds, rather than leaving the clients waiting until they give up.
Upstream (and the fork before the topic) stopped the engine and then, most
times, waited for every connection to close.

The engine-stall-sentinel's test trigger slows every engine step, so no request
can finish however far behind the clients run on a busy machine (on the CPU box
the engine's threads can starve the test's for tens of seconds); the signal goes
out once all three requests are in and both streams have tokens, with every
request still open, as in the fault report.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from e2e_config import MAX_MODEL_LEN
from vllm_server import VllmServer, running

# Within the context; at STEP_S a step, a request needs 400 s to finish, far more
# than every wait below together.
MAX_TOKENS = 4000
STEP_S = 0.1
# The sentinel warns only after this long without a step: never here.
STALL_WARN_S = 5
# What "promptly" means here: the fix exits in about a second on the CPU box.
EXIT_WITHIN_S = 15.0
# The clients' read timeout: longer than EXIT_WITHIN_S, so a server that waits
# for its clients to give up fails the exit check before they do.
CLIENT_READ_TIMEOUT_S = 45.0
CHUNKS_BEFORE_SIGNAL = 3


@dataclass
class Outcome:
    """What one client saw from the moment it sent its request."""

    data_lines: list[str] = field(default_factory=list)
    status: int | None = None
    body: str = ""
    error: str | None = None
    ended_at: float | None = None
    chunks_seen: threading.Event = field(default_factory=threading.Event)


def _stream(server: VllmServer, path: str, body: dict, out: Outcome) -> None:
    timeout = httpx.Timeout(30.0, read=CLIENT_READ_TIMEOUT_S)
    try:
        with httpx.stream("POST", server.url + path, json=body, timeout=timeout) as r:
            out.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.data_lines.append(line[len("data: "):])
                    if len(out.data_lines) >= CHUNKS_BEFORE_SIGNAL:
                        out.chunks_seen.set()
    except httpx.HTTPError as e:
        out.error = repr(e)
    out.ended_at = time.monotonic()


def _plain(server: VllmServer, path: str, body: dict, out: Outcome) -> None:
    timeout = httpx.Timeout(30.0, read=CLIENT_READ_TIMEOUT_S)
    try:
        r = httpx.post(server.url + path, json=body, timeout=timeout)
        out.status, out.body = r.status_code, r.text
    except httpx.HTTPError as e:
        out.error = repr(e)
    out.ended_at = time.monotonic()


def _count(server: VllmServer, pattern: str) -> int:
    return len(re.findall(pattern, server.log_text()))


def _wait_until(what: str, ready, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.2)


def _assert_shutdown_error(error: dict) -> None:
    assert error["code"] == 503, error
    assert "shutting down" in error["message"], error


@pytest.mark.parametrize("target", ["server process", "process group"])
def test_sigterm_ends_open_requests_with_an_error_and_exits(
    tiny_model: Path, tmp_path: Path, target: str, upstream_version: str
) -> None:
    from packaging.version import Version

    if Version(upstream_version) < Version("0.34.0"):
        pytest.skip("the topic is carried from 0.34.0; 0.33.0 keeps upstream's shutdown")
    trigger = tmp_path / "slow-engine"
    srv = VllmServer(
        model=str(tiny_model),
        args=["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
              "--max-num-seqs", "4", "--enforce-eager", "--enable-log-requests"],
        log_path=tmp_path / "vllm-serve.log",
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENGINE_STALL_TEST_TRIGGER": str(trigger),
             "VLLM_ENGINE_STALL_WARN_S": str(STALL_WARN_S)},
    )
    staged = trigger.with_suffix(".tmp")
    staged.write_text(f"every {STEP_S}")
    staged.rename(trigger)  # whole, so the engine never reads it half written
    with running(srv):
        base = {"model": srv.served_name, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        prompt = "Bank the fire before you sleep."
        completion, chat, plain = Outcome(), Outcome(), Outcome()
        clients = [
            threading.Thread(target=_stream, args=(
                srv, "/v1/completions", {**base, "prompt": prompt, "stream": True},
                completion)),
            threading.Thread(target=_stream, args=(
                srv, "/v1/chat/completions",
                {**base, "messages": [{"role": "user", "content": prompt}],
                 "stream": True},
                chat)),
            threading.Thread(target=_plain, args=(
                srv, "/v1/completions", {**base, "prompt": prompt}, plain)),
        ]
        for client in clients:
            client.start()
        for stream in (completion, chat):
            assert stream.chunks_seen.wait(120), srv.log_tail()
        # --enable-log-requests logs each request the engine client takes.
        _wait_until("three requests added", lambda: _count(srv, r"Added request ") == 3)
        assert _count(srv, r"Finished request ") == 0, srv.log_tail()
        mark = srv.log_size()

        assert srv.proc is not None
        proc: subprocess.Popen[bytes] = srv.proc
        signalled = time.monotonic()
        if target == "server process":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vllm serve still running {EXIT_WITHIN_S:.0f}s after SIGTERM "
                        f"with requests in flight\n{srv.log_tail()}")
        for client in clients:
            client.join(CLIENT_READ_TIMEOUT_S + 10)

        for stream in (completion, chat):
            assert stream.status == 200 and stream.error is None, stream
            assert stream.ended_at is not None
            assert stream.ended_at - signalled < EXIT_WITHIN_S
            *_, last_event, done = stream.data_lines
            assert done == "[DONE]", stream.data_lines[-3:]
            assert "error" in json.loads(last_event), stream.data_lines[-3:]
            _assert_shutdown_error(json.loads(last_event)["error"])
        assert plain.error is None and plain.status == 503, plain
        _assert_shutdown_error(json.loads(plain.body)["error"])
        assert plain.ended_at is not None and plain.ended_at - signalled < EXIT_WITHIN_S

        # The completion log says each ended as an abort, once per request.
        log = srv.log_path.read_bytes()[mark:].decode(errors="replace")
        assert len(re.findall(r"Finished request \S+: .* finish_reason=abort", log)) == 3

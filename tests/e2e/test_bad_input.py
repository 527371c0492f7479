"""Bad requests get the right status and message, and the server keeps serving.

Every test ends by sending a good request: a bad one must not wedge the
engine or the HTTP front end.
"""

from __future__ import annotations

import time

import httpx
from e2e_config import MAX_MODEL_LEN
from vllm_server import stream_then_disconnect


def assert_still_serving(http, server) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": server.served_name, "prompt": "ok", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def error_message(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"] if isinstance(body.get("error"), dict) else str(body)


def test_wrong_model_name_lists_served_names(http, server) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "no-such-model",
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 404
    message = error_message(r)
    assert "no-such-model" in message
    assert f"Valid aliases: {server.served_name}" in message
    assert_still_serving(http, server)


def test_malformed_json(http, server) -> None:
    r = http.post(
        "/v1/completions",
        content=b'{"model": "tiny", "prompt": "unterminated',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert "json" in error_message(r).lower()
    assert_still_serving(http, server)


def test_wrong_content_type(http, server) -> None:
    r = http.post(
        "/v1/completions", content=b"prompt=hi", headers={"Content-Type": "text/plain"}
    )
    # Upstream answers 400 (not 415) and names the one media type allowed.
    assert r.status_code == 400, r.text
    assert "application/json" in error_message(r)
    assert_still_serving(http, server)


def test_prompt_longer_than_context(http, server) -> None:
    too_long = list(range(10, 10 + MAX_MODEL_LEN + 50))  # token ids, > context
    r = http.post(
        "/v1/completions",
        json={"model": server.served_name, "prompt": too_long, "max_tokens": 4},
    )
    assert r.status_code == 400, r.text
    message = error_message(r)
    assert str(MAX_MODEL_LEN) in message, message
    assert_still_serving(http, server)


def test_unknown_route(http, server) -> None:
    r = http.post("/v1/no/such/route", json={})
    assert r.status_code == 404
    r = http.get("/definitely-not-a-route")
    assert r.status_code == 404
    assert_still_serving(http, server)


def test_missing_and_wrong_key(server, http) -> None:
    body = {"model": server.served_name, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        r = anon.post("/v1/completions", json=body)
        assert r.status_code == 401
        assert r.json() == {"error": "Unauthorized"}
        r = anon.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status_code == 401
        r = anon.post(
            "/v1/completions",
            json=body,
            headers={"Authorization": f"Basic {server.api_key}"},
        )
        assert r.status_code == 401, "a non-Bearer scheme must not pass"
    assert_still_serving(http, server)


def running_requests(http) -> float:
    r = http.get("/metrics")
    assert r.status_code == 200
    total = 0.0
    for line in r.text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnects_mid_stream(http, server) -> None:
    mark = server.log_size()
    body = {
        "model": server.served_name,
        "prompt": "Write it down, even when it went well.",
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    stream_then_disconnect(http, body, events=3)
    # The engine notices the disconnect and aborts: nothing keeps running.
    server.wait_for_log(r"finish_reason=abort", after=mark, timeout=60)
    deadline = time.monotonic() + 60
    while running_requests(http) > 0:
        assert time.monotonic() < deadline, "aborted request still running"
        time.sleep(0.5)
    assert_still_serving(http, server)

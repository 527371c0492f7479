"""The API and engine topics, each through the real server."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx
import pytest
from e2e_config import STALL_WARN_S
from vllm_server import stream_then_disconnect

# --- tokenize-v1-route ------------------------------------------------------


def test_tokenize_and_detokenize_under_v1(http, server) -> None:
    body = {"model": server.served_name, "prompt": "The kiln on the hill"}
    plain = http.post("/tokenize", json=body)
    v1 = http.post("/v1/tokenize", json=body)
    assert plain.status_code == v1.status_code == 200, v1.text
    assert v1.json()["tokens"] == plain.json()["tokens"]
    assert v1.json()["count"] > 0

    back = http.post(
        "/v1/detokenize",
        json={"model": server.served_name, "tokens": v1.json()["tokens"]},
    )
    assert back.status_code == 200, back.text
    assert back.json()["prompt"] == "The kiln on the hill"


# --- serve-model-path-match -------------------------------------------------


@pytest.mark.parametrize("which", ["path", "path/", "basename"])
def test_model_path_or_basename_is_accepted(http, server, which: str) -> None:
    path = server.model
    name = {"path": path, "path/": path + "/", "basename": os.path.basename(path)}[
        which
    ]
    r = http.post(
        "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2}
    )
    assert r.status_code == 200, r.text


def test_near_miss_model_name_is_still_404(http, server) -> None:
    name = os.path.basename(server.model) + "-x"
    r = http.post(
        "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2}
    )
    assert r.status_code == 404


# --- api-root-health --------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_root_answers_without_key(server, method: str) -> None:
    r = httpx.request(method, server.url + "/", timeout=30)
    assert r.status_code == 200
    if method == "GET":
        assert r.text == "vLLM is running"


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_ollama_version_discovery(server, method: str) -> None:
    r = httpx.request(method, server.url + "/api/version", timeout=30)
    assert r.status_code == 200
    if method == "GET":
        version = httpx.get(server.url + "/version", timeout=30).json()["version"]
        assert r.json() == {"version": version}


def test_discovery_reveals_nothing_secret(server) -> None:
    for path in ("/", "/api/version"):
        text = httpx.get(server.url + path, timeout=30).text
        for secret in (server.api_key, server.model, server.served_name):
            assert secret not in text, (path, secret)


# --- engine-completion-log --------------------------------------------------

LOG_LINE = (
    r"Finished request (?P<id>\S+): prompt_tokens=(?P<prompt>\d+) "
    r"output_tokens=(?P<output>\d+) cached_tokens=\d+ ttft=(?P<ttft>[\d.]+)s "
    r"total=(?P<total>[\d.]+)s finish_reason=(?P<reason>\w+)"
)


def _log_after(server, mark: int) -> str:
    with open(server.log_path, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


def test_one_log_line_per_finished_request(http, server) -> None:
    mark = server.log_size()
    r = http.post(
        "/v1/completions",
        json={
            "model": server.served_name,
            "prompt": "Fired well. Cooled well.",
            "max_tokens": 7,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200
    usage = r.json()["usage"]
    m = server.wait_for_log(LOG_LINE, after=mark)
    assert int(m["prompt"]) == usage["prompt_tokens"]
    assert int(m["output"]) == 7
    assert m["reason"] == "length"
    assert 0 < float(m["ttft"]) <= float(m["total"])
    # Exactly one line for this request.
    time.sleep(1)
    assert len(re.findall(LOG_LINE, _log_after(server, mark))) == 1


def _skip_before_0_34(upstream_version: str) -> None:
    from packaging.version import Version

    if Version(upstream_version) < Version("0.34.0"):
        pytest.skip("0.33.0's series keeps one completion-log line per sample")


def test_one_log_line_for_a_request_with_n_samples(http, server, upstream_version) -> None:
    """n samples run as n child sequences in the engine; the request still gets
    one line, with the children's output tokens summed."""
    _skip_before_0_34(upstream_version)
    n = 1000
    mark = server.log_size()
    r = http.post(
        "/v1/completions",
        json={
            "model": server.served_name,
            "prompt": "One firing, many pots.",
            "max_tokens": 2,
            "ignore_eos": True,
            "n": n,
        },
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 2 * n
    m = server.wait_for_log(LOG_LINE + r" n=(?P<n>\d+)", after=mark, timeout=60)
    assert int(m["n"]) == n
    assert int(m["output"]) == usage["completion_tokens"]
    assert int(m["prompt"]) == usage["prompt_tokens"]
    assert m["reason"] == "length"
    assert 0 < float(m["ttft"]) <= float(m["total"])
    time.sleep(1)
    assert len(re.findall(LOG_LINE, _log_after(server, mark))) == 1


def test_one_abort_line_for_an_aborted_request_with_n_samples(
    http, server, upstream_version
) -> None:
    _skip_before_0_34(upstream_version)
    n = 4
    mark = server.log_size()
    body = {
        "model": server.served_name,
        "prompt": "Leave before the kiln cools.",
        "max_tokens": 3000,
        "ignore_eos": True,
        "n": n,
    }
    stream_then_disconnect(http, body, events=3 * n)
    m = server.wait_for_log(LOG_LINE + r" n=(?P<n>\d+)", after=mark, timeout=60)
    assert int(m["n"]) == n
    assert m["reason"] == "abort"
    assert int(m["output"]) >= 3
    time.sleep(1)
    assert len(re.findall(LOG_LINE, _log_after(server, mark))) == 1


def test_log_line_reports_stop_reason(http, server) -> None:
    mark = server.log_size()
    r = http.post(
        "/v1/completions",
        json={"model": server.served_name, "prompt": "Q: How long?", "max_tokens": 1,
              "min_tokens": 1},
    )
    assert r.status_code == 200
    m = server.wait_for_log(LOG_LINE, after=mark)
    assert m["reason"] == r.json()["choices"][0]["finish_reason"]


# --- engine-stall-sentinel --------------------------------------------------


def test_stalled_step_is_reported(http, server, stall_trigger: Path) -> None:
    stall_s = STALL_WARN_S * 2 + 1
    mark = server.log_size()
    stall_trigger.write_text(str(stall_s))
    r = http.post(
        "/v1/completions",
        json={"model": server.served_name, "prompt": "Wait.", "max_tokens": 3},
    )
    # The stalled step still completes the request.
    assert r.status_code == 200
    assert not stall_trigger.exists(), "the engine never picked up the trigger"
    m = server.wait_for_log(
        r"Engine stall: no engine step completed for ([\d.]+)s while requests "
        r"are live",
        after=mark,
    )
    assert float(m[1]) >= STALL_WARN_S
    server.wait_for_log(r"Engine step completed again after a [\d.]+s stall", after=mark)


def test_idle_server_is_not_a_stall(server) -> None:
    mark = server.log_size()
    time.sleep(STALL_WARN_S * 2)
    with open(server.log_path, "rb") as f:
        f.seek(mark)
        assert "Engine stall" not in f.read().decode(errors="replace")


# --- cpu-fallback-ops -------------------------------------------------------


def test_the_worker_serves_on_the_pure_torch_stand_ins(server, upstream_version) -> None:
    """The CUDA wheel has no compiled CPU ops, so the worker registers stand-ins;
    from 0.34.0, with no usable Triton on this x86 host, it runs upstream's
    standalone CPU runner on them."""
    from packaging.version import Version

    log = server.log_text()
    worker = [line for line in log.splitlines()
              if "VllmWorker" in line and "registered slow pure-torch fallbacks" in line]
    assert worker, server.log_tail()
    if Version(upstream_version) >= Version("0.34.0"):
        assert "gumbel_sample_cpu" in worker[0] and "post_update_cpu" in worker[0]
        assert re.search(r"\[standalone_model_runner\.py:\d+\] Loading model", log)

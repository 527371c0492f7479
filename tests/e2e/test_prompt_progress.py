"""prompt-progress through the real server: a long prompt reports its prefill."""

from __future__ import annotations

import json

import httpx
import pytest
from e2e_config import API_KEY, PREFILL_CHUNK

WORDS = ["clay", "kiln", "glaze", "fire", "ash", "stone", "river", "bread", "lamp", "wheel"]


def _events(server, path: str, body: dict) -> list[dict]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    events = []
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": " ".join(WORDS * 120)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": " ".join(WORDS * 120)}]}),
])
def test_a_long_prompt_streams_its_prefill_progress(server, path, body):
    events = _events(server, path, {
        **body, "model": server.served_name, "max_tokens": 4, "temperature": 0, "stream": True,
        "vllm_xargs": {"return_progress": True},
    })
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    tokens = [e for e in events if e.get("choices")]
    total = progress[0]["total"] if progress else 0
    assert total > 3 * PREFILL_CHUNK
    # One event per chunk that leaves the prompt unfinished, strictly rising by at
    # most a chunk (a prefix-cache hit may let the first one start further on).
    processed = [p["processed"] for p in progress]
    assert len(processed) >= 3
    steps = [b - a for a, b in zip(processed, processed[1:])]
    assert all(0 < step <= PREFILL_CHUNK for step in steps)
    assert 0 < total - processed[-1] <= PREFILL_CHUNK
    assert all(p["total"] == total for p in progress)
    assert all(not e["choices"] for e in events if "prompt_progress" in e)
    # Progress comes first, then the normal stream.
    assert events.index(tokens[0]) > max(i for i, e in enumerate(events) if "prompt_progress" in e)


def test_without_opting_in_the_stream_is_unchanged(server):
    events = _events(server, "/v1/completions", {
        "model": server.served_name, "prompt": " ".join(WORDS * 120), "max_tokens": 4,
        "temperature": 0, "stream": True,
    })
    assert not any("prompt_progress" in e for e in events)
    assert sum(len(e["choices"]) for e in events) >= 1

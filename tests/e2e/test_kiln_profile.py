"""`vllm serve --kiln-profile card=24g,prefix-cache,tool-strict` on the tiny model.

A server of its own (the shared one runs without a profile): it boots with the
profile and the model's tool-call format (pythonic: the tiny model has no tool-call
tokens), logs the resolved arguments, fits its context to the KV pool (card=24g's
--max-model-len -1: the tiny model's whole context fits), and a forced tool call comes
back with arguments that satisfy the tool's schema although the weights are random.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server import VllmServer, running

# Bounded strings and an enum, so a random-weight model still ends the call.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def profiled_server(tiny_model: Path, tmp_path_factory) -> Iterator[VllmServer]:
    srv = VllmServer(
        model=str(tiny_model),
        args=[
            "--kiln-profile", "card=24g,prefix-cache,tool-strict",
            "--tool-call-parser", "pythonic",
            "--dtype", "float32",
            "--enforce-eager",
            # No free whitespace, so the random-weight model closes the JSON.
            "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true}',
        ],
        log_path=tmp_path_factory.mktemp("profile-server") / "vllm-serve.log",
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    with running(srv):
        yield srv


def test_startup_log_shows_the_resolved_arguments(profiled_server) -> None:
    line = re.search(r"--kiln-profile card=24g,prefix-cache,tool-strict resolved: (.*)",
                     profiled_server.log_text())
    assert line, profiled_server.log_tail()
    assert "--max-model-len -1 (from profile card=24g)" in line.group(1)
    assert "--max-num-seqs 4 (from profile card=24g)" in line.group(1)
    assert "--enable-prefix-caching (from profile prefix-cache)" in line.group(1)
    assert "--enable-auto-tool-choice (from profile tool-strict)" in line.group(1)
    assert "--tool-strict-level parameter (from profile tool-strict)" in line.group(1)


def test_card_24g_fits_the_context_to_the_kv_pool(profiled_server, tiny_model) -> None:
    import httpx

    positions = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    served = httpx.get(profiled_server.url + "/v1/models", timeout=30).json()["data"][0]
    assert served["max_model_len"] == positions
    assert re.search(rf"Auto-fit max_model_len: full model context length {positions} fits",
                     profiled_server.log_text()), profiled_server.log_tail()


def test_forced_tool_call_satisfies_the_schema(profiled_server) -> None:
    import httpx
    import jsonschema

    reply = httpx.post(profiled_server.url + "/v1/chat/completions", timeout=300, json={
        "model": profiled_server.served_name,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 64,
        "temperature": 0,
    })
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"], message
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMA)

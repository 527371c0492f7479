"""`vllm serve --kiln-profile tool-strict --tool-call-parser qwen3_xml` on the tiny model.

Issue 14 part C. A server of its own, prompted through the Qwen3-Coder chat template of
the pinned vLLM 0.33.0 sdist (examples/tool_chat_template_qwen3coder.jinja). With a
structural-tag parser a forced or required call is decoded under xgrammar's builtin
qwen_3_coder tag, the arguments in the qwen_xml style, pinned to the schema by the
profile's --tool-strict-level parameter. The random-weight model's call must come back
through vLLM's own qwen3_xml parser as arguments that satisfy the schema, the bounded
string parameters (the fork's counted raw-text rule) within their maxLength.

The tag keeps stock's free whitespace before, between and after the parameters (and
around non-string values), where greedy decoding of random weights emits newlines until
max_tokens; the requests bias whitespace-only tokens down (logit_bias -100), which leaves
them where the grammar allows nothing else (the newline before </function>).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_config import MAX_MODEL_LEN
from vllm_server import VllmServer, running

# Bounded strings and an enum, so a random-weight model still ends the call.
SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "minLength": 1, "maxLength": 12},
        "mode": {"type": "string", "enum": ["append", "overwrite"]},
        "note": {"type": "string", "maxLength": 5},
    },
    "required": ["path", "mode", "note"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file", "parameters": SCHEMA}}


def qwen3_coder_template() -> Path:
    from kiln.upstream.fetch import fetch
    from kiln.upstream.pristine import PristineTree

    tree = PristineTree.from_files(fetch("0.33.0", log=lambda _: None), log=lambda _: None)
    return tree.root / "examples" / "tool_chat_template_qwen3coder.jinja"


@pytest.fixture(scope="module")
def qwen_server(tiny_model: Path, tmp_path_factory) -> Iterator[VllmServer]:
    srv = VllmServer(
        model=str(tiny_model),
        args=[
            "--kiln-profile", "tool-strict",
            "--tool-call-parser", "qwen3_xml",
            "--chat-template", str(qwen3_coder_template()),
            "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "2",
            "--enforce-eager",
            "--structured-outputs-config", '{"backend": "xgrammar"}',
        ],
        log_path=tmp_path_factory.mktemp("qwen-xml-server") / "vllm-serve.log",
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    with running(srv):
        yield srv


def whitespace_token_ids(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [i for i in range(len(tokenizer))
            if (text := tokenizer.decode([i])) and not text.strip()]


def call(server: VllmServer, model: Path, tool_choice) -> dict:
    import httpx

    reply = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
        "model": server.served_name,
        "messages": [{"role": "user", "content": "Append a note to notes.txt"}],
        "tools": [TOOL],
        "tool_choice": tool_choice,
        # One call, after which the tag ends: a finished call, not text up to max_tokens.
        "parallel_tool_calls": False,
        "max_tokens": 160,
        "temperature": 0,
        "logit_bias": {str(i): -100 for i in whitespace_token_ids(model)},
    })
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "write_file"}}, "required"])
def test_tool_call_parses_back_within_the_schema(qwen_server, tiny_model, tool_choice) -> None:
    import jsonschema

    choice = call(qwen_server, tiny_model, tool_choice)
    message = choice["message"]
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["write_file"], message
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMA)
    assert choice["finish_reason"] in ("tool_calls", "stop"), choice

"""Structured output through the real server, on the fork's xgrammar (issue 4).

The server runs with `--structured-outputs-config` forcing the xgrammar backend and
no free whitespace, so a random-weight model still finishes a JSON document in a few
tokens. logit_bias pulls the model toward one token so that the grammar, not the
weights, decides what comes out: the outcomes below are what the bounds allow, and
stock xgrammar 0.2.8 fails the escape case (it refuses escapes in a bounded string).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from kiln.build.xgrammar import XgrammarLock

# The most the server accepts; far above the tiny model's logits.
PULL = 100


@pytest.fixture(scope="module")
def token_id(tiny_model: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))

    def lookup(text: str) -> int:
        found = tokenizer.token_to_id(text)
        assert found is not None, f"the tiny model's vocabulary has no token {text!r}"
        return found

    return lookup


def _generate(client, server, bounds: dict, pulled: int) -> tuple[dict, str]:
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", **bounds}},
        "required": ["s"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=server.served_name,
        messages=[{"role": "user", "content": "Fill in the form."}],
        max_tokens=64,
        temperature=0,
        logit_bias={str(pulled): PULL},
        response_format={"type": "json_schema",
                         "json_schema": {"name": "form", "schema": schema}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    return json.loads(choice.message.content), choice.message.content


def test_server_imports_the_fork_xgrammar() -> None:
    assert importlib.metadata.version("xgrammar") == XgrammarLock.load().fork_version


def test_escapes_are_accepted_and_count_as_one_character(client, server, token_id) -> None:
    """Pulled toward a backslash, the model writes escaped backslashes up to maxLength."""
    doc, text = _generate(client, server, {"maxLength": 4}, token_id("\\"))
    assert doc == {"s": "\\" * 4}
    assert text == '{"s":"' + "\\\\" * 4 + '"}'


def test_min_length_holds_against_a_model_pulled_to_close(client, server, token_id) -> None:
    """Pulled toward the closing quote, the string still gets minLength characters."""
    doc, _ = _generate(client, server, {"minLength": 3, "maxLength": 6}, token_id('"'))
    assert 3 <= len(doc["s"]) <= 6


def test_max_length_holds_against_a_model_pulled_to_go_on(client, server, token_id) -> None:
    """Pulled toward a letter, the string stops at exactly maxLength characters."""
    doc, _ = _generate(client, server, {"maxLength": 7}, token_id("n"))
    assert doc == {"s": "n" * 7}

"""The tiny model generator: same bytes every time, a usable tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln import tinymodel


@pytest.mark.skipif(
    bool(os.environ.get("E2E_MODEL_DIR")), reason="serving a model from elsewhere"
)
def test_rebuild_gives_identical_bytes(tiny_model: Path, tmp_path: Path) -> None:
    fresh = tinymodel.build(tmp_path / "again")
    assert tinymodel.tree_digest(fresh) == tinymodel.tree_digest(tiny_model)


def test_tokenizer_round_trips_and_has_chat_template(tiny_model: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    text = "Numbers: 1,200 degrees; ünïcödé and emoji 🔥 survive."
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: nothing lost
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["vocab_size"] == len(tok)
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")

"""Chat and completions through the real server, streamed and not.

The tiny model has random weights, so these assert mechanics (the served name,
token counts, streaming equals non-streaming, seeded sampling repeats) and
numerics against transformers, never the meaning of the text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PROMPT = "The village keeps three clocks."


def test_models_lists_served_name(client, server) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.served_name]


def test_completion_counts_tokens(client, server) -> None:
    out = client.completions.create(
        model=server.served_name, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens > 0
    assert out.choices[0].text


def test_chat_completion(client, server) -> None:
    out = client.chat.completions.create(
        model=server.served_name,
        messages=[{"role": "user", "content": "How hot does the kiln get?"}],
        max_tokens=10,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    assert 0 < out.usage.completion_tokens <= 10


def test_greedy_matches_transformers(client, server, tiny_model: Path) -> None:
    """The CPU path's numerics agree with transformers' own forward pass."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32
    )
    for prompt in (PROMPT, "Q: What is the most important tool?\nA:"):
        ids = tok(prompt)["input_ids"]
        # Plain argmax decoding (no generate(): its EOS handling differs from
        # ignore_eos, which only keeps going past EOS).
        seq = list(ids)
        with torch.no_grad():
            for _ in range(16):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
        ref = seq[len(ids):]
        out = client.completions.create(
            model=server.served_name, prompt=ids, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.choices[0].token_ids == ref


def test_streaming_chat_equals_non_streaming(client, server) -> None:
    kwargs = dict(
        model=server.served_name,
        messages=[{"role": "user", "content": "Write it down."}],
        max_tokens=16,
        temperature=0,
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == full
    assert reasons[-1] in ("length", "stop")
    assert len([p for p in pieces if p]) > 1, "the answer arrived in one piece"


def test_streaming_completion_usage(client, server) -> None:
    stream = client.completions.create(
        model=server.served_name, prompt=PROMPT, max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_seeded_sampling_repeats(client, server) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=server.served_name, prompt=PROMPT, max_tokens=12,
            temperature=1.0, seed=seed, extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert {sample(s) for s in (1, 2, 3)} != {first}, "seeds do not change samples"

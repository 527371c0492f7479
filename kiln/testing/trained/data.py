"""Token streams and batches: files encoded and joined with the end-of-text token,
and the training batches drawn from the stream by a seeded generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.errors import KilnError


def token_stream(tokenizer: Any, texts: Sequence[str], separator: int) -> list[int]:
    """Every text's tokens, each followed by ``separator``."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts)):
        ids.extend(encoding.ids)
        ids.append(separator)
    return ids


def batch_starts(stream_len: int, seq_len: int, batch_size: int, steps: int, seed: int) -> Any:
    """[steps, batch_size] window starts into a stream of ``stream_len`` tokens, each
    window seq_len + 1 long (inputs and their next tokens): a CPU generator, so every
    machine draws the same ones."""
    import torch

    room = stream_len - (seq_len + 1)
    if room < 1:
        raise KilnError(f"the training split has {stream_len} tokens, fewer than one "
                        f"sequence of {seq_len + 1}; raise --corpus-bytes")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, room + 1, (steps, batch_size), generator=gen)


def batch(stream: Any, starts: Any, seq_len: int) -> tuple[Any, Any]:
    """Inputs and targets for one step's window starts (a [batch] tensor)."""
    import torch

    offsets = torch.arange(seq_len + 1)
    windows = stream[starts[:, None] + offsets[None, :]]
    return windows[:, :-1], windows[:, 1:]

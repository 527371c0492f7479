"""The needle-retrieval probe: a random ``name = "value"`` line placed early in
held-out source, filler up to the context length, and at the end the question
``assert name == "``, which greedy decoding answers by copying the value from the
far end of the KV cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.errors import KilnError

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class NeedleProbe:
    prompt: tuple[int, ...]
    value: str  # what the answer starts with
    answer_tokens: int  # tokens to generate: the value and its closing quote, plus one


def needle(rng: random.Random) -> tuple[str, str]:
    """A fresh variable name and an eight-digit value."""
    return f"key_{rng.randrange(16 ** 6):06x}", f"{rng.randrange(10 ** 8):08d}"


def build_probe(encode: Encode, filler: str, context: int, name: str, value: str) -> NeedleProbe:
    """First line of ``filler``, the needle line, the rest of ``filler`` cut to fit, the
    question: prompt plus answer exactly ``context`` tokens."""
    first, _, rest = filler.partition("\n")
    head = encode(first + "\n") + encode(f'{name} = "{value}"\n')
    question = encode(f'\nassert {name} == "')
    answer_tokens = len(encode(value + '"')) + 1
    room = context - answer_tokens - len(head) - len(question)
    body = encode(rest)
    if room < 1 or len(body) < room:
        raise KilnError(f"the needle probe needs {max(room, 1)} tokens of filler for a "
                        f"context of {context}; the held-out text gives {len(body)}")
    return NeedleProbe(tuple(head + body[:room] + question), value, answer_tokens)


def build_probes(encode: Encode, texts: Sequence[str], context: int, count: int,
                 seed: int = 0) -> list[NeedleProbe]:
    """``count`` probes, probe i filled from the held-out texts starting at text i
    (joined, so short files still fill the context), each with its own needle."""
    rng = random.Random(seed)
    if not texts:
        raise KilnError("no held-out text for the needle probe")
    probes = []
    for i in range(count):
        start = i % len(texts)
        # Source averages over 2 characters a token: 16 per token is filler enough.
        filler = "\n".join(texts[start:] + texts[:start])[:context * 16]
        probes.append(build_probe(encode, filler, context, *needle(rng)))
    return probes


def hit(generated: str, probe: NeedleProbe) -> bool:
    return generated.startswith(probe.value)

"""Teacher-forced quality from prompt logprobs: evaluation windows cut from a token
stream, and perplexity and top-1 agreement over a window's positions.

Position i of a window is the prediction of token i from tokens 0..i-1 (vLLM's
prompt_logprobs[i]; position 0 predicts nothing). Pure functions: the tests check
them against hand-computed values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError


@dataclass(frozen=True)
class WindowScores:
    """Per position 1..W-1: the logprob of the window's own token, and the token the
    model ranked first."""

    logprobs: tuple[float, ...]
    top1: tuple[int, ...]


def windows(stream: Sequence[int], width: int, count: int) -> list[list[int]]:
    """The first ``count`` back-to-back windows of ``width`` tokens of ``stream``."""
    if width < 2:
        raise KilnError(f"--window {width}: must be at least 2 tokens")
    if count * width > len(stream):
        raise KilnError(f"--windows {count} x --window {width} needs {count * width} "
                        f"held-out tokens; there are {len(stream)}")
    return [list(stream[i * width:(i + 1) * width]) for i in range(count)]


def window_scores(window: Sequence[int], prompt_logprobs: Sequence[Mapping[int, Any] | None]
                  ) -> WindowScores:
    """Scores from vLLM's prompt_logprobs of one window: per position a map from token
    id to an entry with ``logprob`` and ``rank`` (1 = the model's first choice); it
    holds the window's token and, with prompt_logprobs >= 1, the rank-1 token."""
    if len(prompt_logprobs) != len(window):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for {len(window)} tokens")
    logprobs, top1 = [], []
    for token, entries in zip(window[1:], prompt_logprobs[1:]):
        logprobs.append(entries[token].logprob)
        top1.append(min(entries, key=lambda t: entries[t].rank))
    return WindowScores(tuple(logprobs), tuple(top1))


def perplexity(scores: Sequence[WindowScores], start: int = 1) -> float:
    """exp of the mean negative logprob over positions >= ``start`` of every window."""
    picked = [lp for s in scores for lp in s.logprobs[start - 1:]]
    if not picked:
        raise ValueError(f"no position at or past {start}")
    return math.exp(-sum(picked) / len(picked))


def agreement(scores: Sequence[WindowScores], reference: Sequence[WindowScores],
              start: int = 1) -> float:
    """The fraction of positions >= ``start`` where the top-1 token is the reference's."""
    same = total = 0
    for s, r in zip(scores, reference, strict=True):
        for a, b in zip(s.top1[start - 1:], r.top1[start - 1:], strict=True):
            same += a == b
            total += 1
    if not total:
        raise ValueError(f"no position at or past {start}")
    return same / total

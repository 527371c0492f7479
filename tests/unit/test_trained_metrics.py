"""The quality benchmark's pure parts against hand-computed values: windows,
perplexity and top-1 agreement from prompt logprobs, the needle probe, the table."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from kiln.errors import KilnError
from kiln.testing.trained.metrics import WindowScores, agreement, perplexity, window_scores, windows
from kiln.testing.trained.needle import NeedleProbe, build_probe, build_probes, hit, needle
from kiln.testing.trained.report import FOOTER, quality, table


@dataclass
class Entry:  # vLLM's Logprob: the two fields the scores read
    logprob: float
    rank: int


def test_windows_are_back_to_back_and_refuse_a_short_stream():
    assert windows(list(range(10)), 3, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(KilnError, match=r"--windows 4 x --window 3 needs 12 held-out tokens; there are 10"):
        windows(list(range(10)), 3, 4)


def test_window_scores_take_the_windows_token_and_the_rank_one_token():
    # Window [7, 8, 9]: position 1 predicts 8 (the model's first choice 8), position 2
    # predicts 9 (first choice 4).
    logprobs = [None, {8: Entry(-0.5, 1)}, {9: Entry(-2.0, 3), 4: Entry(-0.25, 1)}]
    assert window_scores([7, 8, 9], logprobs) == WindowScores((-0.5, -2.0), (8, 4))


def test_perplexity_is_exp_of_the_mean_negative_logprob_from_start():
    a = WindowScores((-1.0, -2.0, -3.0), (0, 0, 0))
    b = WindowScores((-3.0, -1.0, -2.0), (0, 0, 0))
    assert perplexity([a, b]) == pytest.approx(math.exp(2.0))
    # From position 3: the last logprob of each window, -3 and -2.
    assert perplexity([a, b], start=3) == pytest.approx(math.exp(2.5))


def test_agreement_counts_top1_matches_from_start():
    mine = [WindowScores((0.0,) * 4, (1, 2, 3, 4)), WindowScores((0.0,) * 4, (5, 6, 7, 8))]
    ref = [WindowScores((0.0,) * 4, (1, 0, 3, 0)), WindowScores((0.0,) * 4, (5, 6, 0, 8))]
    assert agreement(mine, ref) == 5 / 8
    # Positions 3 and 4 (indices 2, 3): 3=3, 4!=0, 7!=0, 8=8.
    assert agreement(mine, ref, start=3) == 2 / 4


def test_quality_ratios_are_against_the_reference():
    ref = [WindowScores((-1.0, -1.0), (1, 2))]
    mine = [WindowScores((-1.0, -1.5), (1, 3))]
    q = quality("fp8", mine, ref, late_from=2, needle_hits=3, needle_probes=4)
    assert q.perplexity == pytest.approx(math.exp(1.25))
    assert q.ratio == pytest.approx(math.exp(0.25))
    assert q.ratio_late == pytest.approx(math.exp(0.5))
    assert (q.agreement, q.agreement_late) == (0.5, 0.0)
    text = table([q], late_from=2)
    assert "fp8" in text and "+28.40%" in text and "+64.87%" in text and "3/4" in text
    assert text.endswith(FOOTER)


def _chars(text: str) -> list[int]:  # a tokenizer of one token per character
    return [ord(c) for c in text]


def test_a_probe_puts_the_needle_after_the_first_line_and_fills_exactly_the_context():
    filler = "first\n" + "x" * 200
    probe = build_probe(_chars, filler, 60, "key_a", "12")
    head = 'first\nkey_a = "12"\n'
    question = '\nassert key_a == "'
    # The answer: "12" and the quote, plus one token: 4; the rest is filler.
    assert probe.answer_tokens == 4
    room = 60 - 4 - len(head) - len(question)
    assert "".join(map(chr, probe.prompt)) == head + "x" * room + question
    assert len(probe.prompt) + probe.answer_tokens == 60
    assert hit("12\"\n", probe) and not hit("13\"", probe)


def test_a_probe_refuses_filler_too_short_for_the_context():
    with pytest.raises(KilnError, match="needs 39 tokens of filler for a context of 80; the held-out text gives 10"):
        # 80 - answer 4 - head 19 (first line, needle line) - question 18 = 39.
        build_probe(_chars, "first\n" + "x" * 10, 80, "key_a", "12")


def test_probes_are_fixed_by_the_seed_and_rotate_through_the_texts():
    texts = ["a\n" + "1" * 100, "b\n" + "2" * 100]
    probes = build_probes(_chars, texts, 64, 3)
    assert probes == build_probes(_chars, texts, 64, 3)
    rng = random.Random(0)
    names = [needle(rng) for _ in range(3)]
    for probe, (name, value), first in zip(probes, names, "aba"):
        text = "".join(map(chr, probe.prompt))
        assert text.startswith(f'{first}\n{name} = "{value}"\n')
        assert text.endswith(f'\nassert {name} == "') and probe.value == value
    assert isinstance(probes[0], NeedleProbe)

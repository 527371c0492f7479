"""qwen_xml tool calls: stock 0.2.8 and the fork decide bounded string parameters.

A document is one Qwen3-Coder tool call (the frame of decide_worker.QWEN_BEGIN/QWEN_END)
with one string parameter ``s``, its raw text framed as the model's chat template renders
it (``<parameter=s>\\nVALUE\\n</parameter>``) or otherwise. The truth is what vLLM's own
Qwen3 parser (``vllm/parser/qwen3.py`` of the installed 0.33.0, behind the qwen3_coder and
qwen3_xml tool parsers) reads back: the text between the tags comes back whole (one
wrapping newline at each end stripped) and has between minLength and maxLength characters.
The fork must match the truth everywhere but for FORK_KINDS, and stock may differ only in
the ways STOCK_KINDS documents; each kind is asserted to occur.
"""

from __future__ import annotations

import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager

from tests.xgrammar.conftest import decisions
from tests.xgrammar.decide_worker import QWEN_BEGIN, QWEN_END

# One character each as raw text: no escaping in this format.
UNITS = {
    "ascii": "a",
    "utf8-2": "é",
    "utf8-3": "中",
    "utf8-4": "😀",
    "backslash": "\\",
    "quote": '"',
    "tab": "\t",
    "ctrl-01": "\x01",
    "newline": "\n",
    "space": " ",
    "lt": "<",
    "gt": ">",
}
# Text that vLLM's parser takes for a tag, so a value holding it is cut there.
TAGS = ["</parameter>", "<parameter=x>", "</function>", "<function=g>"]
# Near-misses of those tags: plain text to the parser.
NEAR_TAGS = ["</parameter", "<parameter", "<parameters", "</function", "<<", "< function=g>"]
# A tag with whitespace inside, which vLLM's parameter regex (<\s*/\s*parameter\s*>) also
# takes for one; the fork excludes only the tags as written.
SPACED_TAGS = ["</ parameter>", "< parameter=x>"]
# How the value sits between the tags: the template's frame first.
FRAMES = {
    "template": "\n{}\n",
    "bare": "{}",
    "leading-newline": "\n{}",
    "trailing-newline": "{}\n",
    "two-leading-newlines": "\n\n{}\n",
    "two-trailing-newlines": "\n{}\n\n",
    "leading-space": " {}\n",
    "spaces-around": "\n {} \n",
}
BOUNDS = [(0, 1), (0, 3), (2, 5), (4, 4), (1, None), (3, None), (0, 200), (130, 140)]


def schema(lo: int, hi: int | None) -> dict:
    bounds = {"minLength": lo} | ({"maxLength": hi} if hi is not None else {})
    return {"type": "object", "properties": {"s": {"type": "string", **bounds}},
            "required": ["s"], "additionalProperties": False}


def call(raw: str) -> str:
    return f"{QWEN_BEGIN}<parameter=s>{raw}</parameter>{QWEN_END}"


def documents(lo: int, hi: int | None) -> list[str]:
    lengths = sorted({n for b in (lo, hi) if b is not None for n in (b - 1, b, b + 1) if n >= 0})
    values = [filler * (n - 1) + unit if n else ""
              for unit in UNITS.values() for filler in ("a", "中") for n in lengths]
    values += [f"a{text}b" for text in TAGS + NEAR_TAGS + SPACED_TAGS]
    return list(dict.fromkeys(call(frame.format(v)) for v in values for frame in FRAMES.values()))


class NoVocabulary:
    """The parser looks its tags up in the vocabulary only to spot them as token ids."""

    def get_vocab(self) -> dict[str, int]:
        return {}


def vllm_reads(doc: str, tool_schema: dict) -> list[tuple[str, dict]]:
    """The calls, with their arguments, that vLLM's qwen3_xml tool parser reads in doc."""
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": tool_schema}}])
    parser = ToolParserManager.get_tool_parser("qwen3_xml")(NoVocabulary(), request.tools)
    info = parser.extract_tool_calls(doc, request)
    return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


def raw_value(doc: str) -> str:
    return doc[len(QWEN_BEGIN) + len("<parameter=s>"):-len(QWEN_END) - len("</parameter>")]


def truth(doc: str, lo: int, hi: int | None) -> bool:
    whole = raw_value(doc).removeprefix("\n").removesuffix("\n")
    return (vllm_reads(doc, schema(lo, hi)) == [("f", {"s": whole})]
            and lo <= len(whole) and (hi is None or len(whole) <= hi))


def has(doc: str, texts: list[str]) -> bool:
    return any(t in raw_value(doc) for t in texts)


def within(text: str, lo: int, hi: int | None) -> bool:
    return lo <= len(text) and (hi is None or len(text) <= hi)


# Each kind: (decision, doc, lo, hi) -> whether it explains a decision against the truth.
FORK_KINDS = {
    "FORK_ACCEPTS_SPACED_TAGS": lambda got, doc, lo, hi: got and has(doc, SPACED_TAGS),
}
def stock_reads_within(doc: str, lo: int, hi: int | None) -> bool:
    """Stock's value is whitespace, a repetition of any character, whitespace: whether some
    such split of the text has a repetition within the bounds."""
    raw = raw_value(doc)
    lead = len(raw) - len(raw.lstrip(" \t\n\r"))
    trail = len(raw) - len(raw.rstrip(" \t\n\r"))
    return any(within(raw[i:len(raw) - j], lo, hi)
               for i in range(lead + 1) for j in range(trail + 1) if i + j <= len(raw))


STOCK_KINDS = {
    # Stock counts whatever whitespace split fits, where vLLM strips one newline at each end
    # and keeps the rest: it accepts values vLLM reads as too long (spaces, extra newlines)
    # or too short (a framing newline counted as a character).
    "STOCK_SPLITS_WHITESPACE_OFF": lambda got, doc, lo, hi: got and stock_reads_within(
        doc, lo, hi) and not has(doc, TAGS + SPACED_TAGS),
    # The repetition takes any character, tags included, and vLLM cuts the value there.
    "STOCK_ACCEPTS_TAGS": lambda got, doc, lo, hi: got and has(doc, TAGS + SPACED_TAGS),
}


def differences(cases: list[dict], results: list, kinds: dict) -> tuple[dict, list]:
    """How often each kind explains a decision against the truth, and the unexplained ones."""
    counts: dict[str, int] = {}
    unexplained = []
    for case, decided, (lo, hi) in zip(cases, results, BOUNDS):
        for doc, got in zip(case["docs"], decided):
            if got == truth(doc, lo, hi):
                continue
            kind = next((k for k, test in kinds.items() if test(got, doc, lo, hi)), None)
            if kind is None:
                unexplained.append((lo, hi, doc, got))
            else:
                counts[kind] = counts.get(kind, 0) + 1
    return counts, unexplained


@pytest.fixture(scope="module")
def both(envs):
    cases = [{"schema": schema(lo, hi), "docs": documents(lo, hi), "style": "qwen_xml"}
             for lo, hi in BOUNDS]
    return cases, decisions(envs, "stock", cases), decisions(envs, "fork", cases)


def test_fork_matches_vllm_parser_but_for_spaced_tags(both):
    cases, _, fork = both
    counts, unexplained = differences(cases, fork, FORK_KINDS)
    total = sum(len(c["docs"]) for c in cases)
    assert not unexplained, (f"{len(unexplained)} of {total} fork decisions differ from "
                             f"vLLM's reading: {unexplained[:20]}")
    # The known gap must really occur, or this list has gone stale.
    assert set(counts) == set(FORK_KINDS), counts


def test_stock_differs_only_where_documented(both):
    cases, stock, _ = both
    counts, unexplained = differences(cases, stock, STOCK_KINDS)
    assert not unexplained, f"stock differs beyond the documented cases: {unexplained[:20]}"
    assert set(counts) == set(STOCK_KINDS), counts


def test_template_rendering_is_accepted_at_the_bounds(envs):
    """What the chat template renders for a value of exactly maxLength characters."""
    value = "中" * 4 + "\\" + '"'
    case = [{"schema": schema(0, len(value)), "style": "qwen_xml",
             "docs": [call(f"\n{value}\n"), call(f"\n{value}x\n")]}]
    assert decisions(envs, "fork", case) == [[True, False]]


def test_non_string_values_keep_json(envs):
    """An integer and an object beside a bounded string: JSON between the framing newlines."""
    case = [{"style": "qwen_xml", "schema": {
        "type": "object", "required": ["n", "o", "s"], "additionalProperties": False,
        "properties": {"n": {"type": "integer"},
                       "o": {"type": "object", "properties": {"k": {"type": "string"}},
                             "required": ["k"]},
                       "s": {"type": "string", "maxLength": 3}}},
        "docs": [QWEN_BEGIN + "<parameter=n>\n12\n</parameter>\n<parameter=o>\n"
                 '{"k": "v"}\n</parameter>\n<parameter=s>\nabc\n</parameter>' + QWEN_END,
                 QWEN_BEGIN + "<parameter=n>\ntwelve\n</parameter>\n<parameter=o>\n"
                 '{"k": "v"}\n</parameter>\n<parameter=s>\nabc\n</parameter>' + QWEN_END]}]
    assert decisions(envs, "fork", case) == decisions(envs, "stock", case) == [[True, False]]


def test_unbounded_parameters_agree(envs):
    """Without bounds both builds take stock's unchanged raw-string rule."""
    docs = [call(frame.format("a" + u)) for u in UNITS.values() for frame in FRAMES.values()]
    case = [{"style": "qwen_xml", "docs": docs, "schema": {
        "type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}]
    assert decisions(envs, "stock", case) == decisions(envs, "fork", case)

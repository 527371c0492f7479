"""Stock 0.2.8 and the fork's xgrammar agree on bounded strings, except where stock is wrong.

Each document is ``{"s": "<body>"}``; the truth is Python's own reading of it: valid JSON
whose decoded string has between minLength and maxLength characters (code points, so an
escape or a surrogate pair is one). The fork must match the truth everywhere. Stock may
differ only in the two ways issue 4 names, each asserted to occur:

* STOCK_REJECTS_ESCAPES: stock rejects every JSON escape inside a bounded string
  (upstream #800/#880), although the decoded length is within the bounds.
* STOCK_ACCEPTS_RAW_CONTROL: stock accepts a raw control character other than CR and LF
  (here a raw TAB and U+0001) inside a bounded string, which is not JSON at all; its
  unbounded strings reject them.
"""

from __future__ import annotations

import json

import pytest

from tests.xgrammar.conftest import decisions

# One decoded character each, written as it appears inside the JSON string.
UNITS = {
    "ascii": "a",
    "utf8-2": "é",
    "utf8-3": "中",
    "utf8-4": "😀",
    "esc-quote": '\\"',
    "esc-backslash": "\\\\",
    "esc-slash": "\\/",
    "esc-b": "\\b",
    "esc-f": "\\f",
    "esc-n": "\\n",
    "esc-r": "\\r",
    "esc-t": "\\t",
    "esc-u": "\\u00e9",
    "esc-u-upper": "\\u00C9",
    "surrogate-pair": "\\ud83d\\ude00",
    "lone-high-surrogate": "\\ud83d",
    "lone-low-surrogate": "\\ude00",
    "raw-tab": "\t",
    "raw-ctrl-01": "\x01",
}
# (minLength, maxLength): small bounds, stock's unrolled range (<=128) and its large path.
BOUNDS = [(0, 1), (0, 3), (2, 5), (4, 4), (0, 10), (1, None), (3, None), (0, 200), (200, None),
          (130, 140)]


def body(unit: str, filler: str, count: int) -> str:
    """``count`` characters: the unit once (last) and the filler before it."""
    return filler * (count - 1) + unit if count > 0 else ""


def documents(lo: int, hi: int | None) -> list[str]:
    lengths = sorted({n for b in (lo, hi) if b is not None for n in (b - 1, b, b + 1) if n >= 0})
    docs = []
    for unit in UNITS.values():
        for filler in ("a", "é", "\\n"):
            docs += ['{"s": "' + body(unit, filler, n) + '"}' for n in lengths]
    # A lone high surrogate directly before a low-surrogate escape is one pair, not two.
    docs += ['{"s": "' + "\\ud83d" * k + "\\ude00" + '"}' for k in (1, 2)]
    return list(dict.fromkeys(docs))


def schema(lo: int, hi: int | None) -> dict:
    bounds = {"minLength": lo} | ({"maxLength": hi} if hi is not None else {})
    return {"type": "object", "properties": {"s": {"type": "string", **bounds}},
            "required": ["s"], "additionalProperties": False}


def truth(doc: str, lo: int, hi: int | None) -> bool:
    try:
        value = json.loads(doc)["s"]
    except json.JSONDecodeError:
        return False
    return lo <= len(value) and (hi is None or len(value) <= hi)


def stock_wrong_kind(doc: str, lo: int, hi: int | None, stock: bool) -> str | None:
    """Which documented stock error explains a disagreement with the truth, if any."""
    inside = doc[len('{"s": "'):-2]
    if not stock and truth(doc, lo, hi) and "\\" in inside:
        return "STOCK_REJECTS_ESCAPES"
    if stock and not truth(doc, lo, hi) and ("\t" in inside or "\x01" in inside):
        return "STOCK_ACCEPTS_RAW_CONTROL"
    return None


@pytest.fixture(scope="module")
def both(envs):
    cases = [{"schema": schema(lo, hi), "docs": documents(lo, hi)} for lo, hi in BOUNDS]
    return cases, decisions(envs, "stock", cases), decisions(envs, "fork", cases)


def test_fork_matches_json_everywhere(both):
    cases, _, fork = both
    wrong = [(c["schema"]["properties"]["s"], doc, got)
             for c, results, (lo, hi) in zip(cases, fork, BOUNDS)
             for doc, got in zip(c["docs"], results) if got != truth(doc, lo, hi)]
    assert not wrong, f"{len(wrong)} fork decisions differ from JSON's: {wrong[:20]}"


def test_stock_differs_only_where_documented(both):
    cases, stock, _ = both
    kinds: dict[str, int] = {}
    unexplained = []
    for c, results, (lo, hi) in zip(cases, stock, BOUNDS):
        for doc, got in zip(c["docs"], results):
            if got == truth(doc, lo, hi):
                continue
            kind = stock_wrong_kind(doc, lo, hi, got)
            if kind is None:
                unexplained.append((lo, hi, doc, got))
            else:
                kinds[kind] = kinds.get(kind, 0) + 1
    assert not unexplained, f"stock differs beyond the documented cases: {unexplained[:20]}"
    # Both documented errors must really occur, or this list has gone stale.
    assert set(kinds) == {"STOCK_REJECTS_ESCAPES", "STOCK_ACCEPTS_RAW_CONTROL"}, kinds


@pytest.mark.parametrize("unit", ['\\"', "\\n"])
def test_stock_rejects_escapes_the_fork_accepts(envs, unit):
    """The two escapes issue 4 measured: common in a file's content, rejected by stock."""
    case = [{"schema": schema(0, 10), "docs": ['{"s": "x' + unit + 'y"}']}]
    assert decisions(envs, "stock", case) == [[False]]
    assert decisions(envs, "fork", case) == [[True]]


def test_unbounded_strings_agree(envs):
    """Without bounds both builds take the same (unchanged) path."""
    docs = ['{"s": "' + body(u, "a", 3) + '"}' for u in UNITS.values()] + ['{"s": ""}']
    case = [{"schema": {"type": "object", "properties": {"s": {"type": "string"}},
                        "required": ["s"]}, "docs": docs}]
    stock, fork = decisions(envs, "stock", case), decisions(envs, "fork", case)
    assert stock == fork
    assert fork[0] == [truth(d, 0, None) for d in docs]

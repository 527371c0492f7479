"""Run under one xgrammar build: does the token mask agree with accept_token?

Reads {"seed": N, "schemas": N, "steps": N} on stdin. For random schemas with bounded
string properties (JSON and qwen_xml style), it walks from the start of the grammar along
tokens the mask allows, picked at random, and at every step checks each token of a small
vocabulary: allowed by the mask, but refused by accept_token ("mask allows, accept
refuses"), or the reverse. Writes {"checked": N, "steps": N, "mismatches": [...]}.
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import xgrammar as xgr
from decide_worker import QWEN_BEGIN, compile_case

KEYS = ("s", "t", "u")

# Byte strings chosen to reach the bounds, cross rule boundaries and carry odd UTF-8.
TEXT_TOKENS = [
    *"abcde0123 \n\t<>/=\"\\,:{}[]stuf",
    *("a" * k for k in (2, 3, 4, 5, 6, 8, 12, 20, 40)),
    "ab cd", " the", "hello world", "x\n", "\n\n", "\na", "a\n", "a\n\n",
    "\\n", '\\"', "\\u00e9", "\\ud83d", "\\ude00", "\\\\",
    '{"', '": "', '", "', '"}', '":', '"s": "', '{"s": "', '"t": "', '"u": "', '": ', ", \"",
    '""', '"",', 'a"', 'a",', 'aaaa"}', '"}\n',
    "é", "中", "😀", "ééé", "中中中中",
    "<parameter=", "</parameter>", "\n</parameter>", "\n</parameter>\n", "</parameter>\n",
    ">\n", "\n<", "</", "</function>", "<function=", "parameter", "function",
    *(f"<parameter={k}>\n" for k in KEYS), *(f"<parameter={k}>" for k in KEYS),
    "abc\n</parameter>\n<parameter=t>\n", "aa</parameter>", "\n</function>\n</tool_call>",
    QWEN_BEGIN, "12", "-3", "0.5", "true", "null", "\n12\n",
]
BYTE_TOKENS = [b"\xc3", b"\xa9", b"\xe4", b"\xb8", b"\xad", b"\xf0\x9f", b"\x98\x80",
               b"\x80", b"\x80\x80\x80", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80",
               b"\xed\xa0\x80", b"a\x80", b"\xff"]
STOP = 0  # an empty special token at id 0 is the stop token
VOCAB = [b""] + [t.encode() for t in dict.fromkeys(TEXT_TOKENS)] + BYTE_TOKENS


def random_schema(rng: random.Random) -> dict:
    properties = {}
    for key in KEYS[: rng.randint(1, 3)]:
        if rng.random() < 0.15:
            properties[key] = {"type": "integer"}
            continue
        lo = rng.choice([0, 0, 1, 2, 3, 5])
        prop: dict = {"type": "string"}
        if lo or rng.random() < 0.3:
            prop["minLength"] = lo
        if rng.random() < 0.8:
            prop["maxLength"] = lo + rng.randint(0, 8)
        properties[key] = prop
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def allowed_ids(matcher: xgr.GrammarMatcher, bitmask) -> set[int]:
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].numpy().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: len(VOCAB)]
    return set(np.flatnonzero(bits).tolist())


def probe(compiler, rng: random.Random, style: str, schema: dict, steps: int) -> tuple[int, list]:
    matcher = xgr.GrammarMatcher(compile_case(compiler, schema, style))
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    checked, mismatches, prefix = 0, [], b""
    for _ in range(steps):
        if matcher.is_terminated():
            break
        allowed = allowed_ids(matcher, bitmask)
        both = []
        for token_id in range(len(VOCAB)):
            accepted = matcher.accept_token(token_id)
            if accepted:
                matcher.rollback(1)
                if token_id in allowed:
                    both.append(token_id)
            checked += 1
            if accepted != (token_id in allowed):
                mismatches.append({"style": style, "schema": schema, "prefix": prefix.decode(
                    errors="backslashreplace"), "token": VOCAB[token_id].decode(
                    errors="backslashreplace"), "mask_allows": token_id in allowed,
                    "accept_token": accepted})
        if not both:
            break
        # Long tokens now and then, so walks reach the bounds.
        choices = both
        if rng.random() < 0.3:
            choices = sorted(choices, key=lambda t: len(VOCAB[t]))[-3:]
        token_id = rng.choice(choices)
        assert matcher.accept_token(token_id)
        prefix += VOCAB[token_id]
    return checked, mismatches


def main() -> None:
    request = json.load(sys.stdin)
    rng = random.Random(request["seed"])
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB),
                             stop_token_ids=[STOP])
    # The cached compiler shares per-rule masks across schemas: they must respect the bounds.
    compilers = [xgr.GrammarCompiler(info, cache_enabled=False),
                 xgr.GrammarCompiler(info, cache_enabled=True)]
    total, walked, mismatches = 0, 0, []
    for i in range(request["schemas"]):
        style = ("json", "qwen_xml")[i % 4 // 2]
        checked, found = probe(compilers[i % 2], rng, style, random_schema(rng),
                               request["steps"])
        total += checked
        walked += 1
        mismatches += found
    json.dump({"checked": total, "walks": walked, "mismatches": mismatches}, sys.stdout)


if __name__ == "__main__":
    main()

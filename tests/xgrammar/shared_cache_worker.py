"""Run under one xgrammar build: bounded strings compiled in turn by ONE cached compiler.

Reads {"grammars": [{"style": "json" | "qwen_xml", "min": N, "max": N}, ...]} on stdin and
compiles each grammar's one-string schema, in order, with a single GrammarCompiler whose
cache is on, as vLLM keeps one per tokenizer. Then, for each grammar, at the value's start,
after its opening (quote or framing newline) and after 0..max+1 characters of it, every
token of a vocabulary of values at and around the bounds is checked: does the token mask
agree with accept_token? Also decides whole documents with accept_string. Writes
{"results": [{"mismatches": [...], "decisions": {"<length>": bool}}, ...]}.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import xgrammar as xgr
from decide_worker import QWEN_BEGIN, QWEN_END, compile_case

STOP = 0  # an empty special token at id 0 is the stop token
# (start of the value, its opening, its closing) in each style.
FRAMES = {
    "json": ('{"s": ', '"', '"'),
    "qwen_xml": (QWEN_BEGIN + "<parameter=s>", "\n", "\n</parameter>"),
}
END = {"json": "}", "qwen_xml": QWEN_END}


def lengths(grammars: list[dict]) -> list[int]:
    """Every length at and beside a bound of any grammar, and 0..2."""
    bounds = {g[k] for g in grammars for k in ("min", "max")}
    return sorted({n for b in bounds for n in (b - 1, b, b + 1) if n >= 0} | {0, 1, 2})


def vocabulary(style: str, sizes: list[int]) -> list[str]:
    """The opening and closing alone, and runs of "a" bare, opened, closed and whole."""
    _, opening, closing = FRAMES[style]
    tokens = [opening, closing, END[style], opening + closing]
    for n in sizes:
        run = "a" * n
        tokens += [run, opening + run, run + closing, opening + run + closing]
    return list(dict.fromkeys(t for t in tokens if t))


def schema(lo: int, hi: int) -> dict:
    return {"type": "object", "properties": {"s": {"type": "string", "minLength": lo,
                                                    "maxLength": hi}},
            "required": ["s"], "additionalProperties": False}


def allowed_ids(matcher: xgr.GrammarMatcher, size: int) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:size]
    return set(np.flatnonzero(bits).tolist())


def check(compiled: xgr.CompiledGrammar, style: str, hi: int, vocab: list[str]) -> list[dict]:
    """Mask against accept_token at the value's start, after its opening and inside it."""
    start, opening, _ = FRAMES[style]
    prefixes = [start, start + opening] + [start + opening + "a" * k for k in range(1, hi + 2)]
    mismatches = []
    for prefix in prefixes:
        matcher = xgr.GrammarMatcher(compiled)
        if not matcher.accept_string(prefix):
            continue  # past maxLength: no state to check
        allowed = allowed_ids(matcher, len(vocab))
        for token_id in range(1, len(vocab)):
            accepted = matcher.accept_token(token_id)
            if accepted:
                matcher.rollback(1)
            if accepted != (token_id in allowed):
                mismatches.append({"after": prefix[len(start):], "token": vocab[token_id],
                                   "mask_allows": token_id in allowed, "accept_token": accepted})
    return mismatches


def decisions(compiled: xgr.CompiledGrammar, style: str, sizes: list[int]) -> dict[str, bool]:
    """Whole documents holding a value of each size, decided by accept_string."""
    start, opening, closing = FRAMES[style]
    result = {}
    for n in sizes:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        doc = start + opening + "a" * n + closing + END[style]
        result[str(n)] = matcher.accept_string(doc) and matcher.is_terminated()
    return result


def main() -> None:
    grammars = json.load(sys.stdin)["grammars"]
    sizes = lengths(grammars)
    compilers, compiled = {}, []
    for g in grammars:
        if g["style"] not in compilers:
            vocab = [""] + vocabulary(g["style"], sizes)
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                                     stop_token_ids=[STOP])
            compilers[g["style"]] = (xgr.GrammarCompiler(info, cache_enabled=True), vocab)
        compiler, _ = compilers[g["style"]]
        compiled.append(compile_case(compiler, schema(g["min"], g["max"]), g["style"]))
    results = []
    for g, grammar in zip(grammars, compiled):
        vocab = compilers[g["style"]][1]
        results.append({"mismatches": check(grammar, g["style"], g["max"], vocab),
                        "decisions": decisions(grammar, g["style"], sizes)})
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    main()

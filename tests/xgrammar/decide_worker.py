"""Run under one xgrammar build (stock or fork): accept/reject decisions for JSON documents.

Reads {"cases": [{"schema": {...}, "docs": ["...", ...]}, ...]} on stdin and writes
{"results": [[true, false, ...] | "error: <message>", ...]} on stdout. A schema the
build refuses yields its error message instead of decisions.
"""

from __future__ import annotations

import json
import sys

import xgrammar as xgr


def decide(compiler: xgr.GrammarCompiler, schema: dict, docs: list[str]) -> list[bool] | str:
    try:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as e:  # noqa: BLE001  the message is the result
        return f"error: {type(e).__name__}: {e}"
    decisions = []
    for doc in docs:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        decisions.append(matcher.accept_string(doc) and matcher.is_terminated())
    return decisions


def main() -> None:
    request = json.load(sys.stdin)
    # No vocabulary: only the grammar's decisions on strings are compared.
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    results = [decide(compiler, case["schema"], case["docs"]) for case in request["cases"]]
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    main()

"""Run under one xgrammar build (stock or fork): accept/reject decisions for documents.

Reads {"cases": [{"schema": {...}, "docs": ["...", ...], "style": "json"}, ...]} on stdin
and writes {"results": [[true, false, ...] | "error: <message>", ...]} on stdout. A schema
the build refuses yields its error message instead of decisions. Style "json" (the
default) decides JSON documents; "qwen_xml" decides Qwen3-Coder tool calls
(QWEN_BEGIN, the schema's parameters in the qwen_xml style, QWEN_END), as vLLM's
qwen3_coder/qwen3_xml parsers constrain them through xgrammar's structural tag.
"""

from __future__ import annotations

import json
import sys

import xgrammar as xgr

# The tool-call frame of xgrammar 0.2.8's builtin qwen_3_coder structural tag.
QWEN_BEGIN = "<tool_call>\n<function=f>\n"
QWEN_END = "\n</function>\n</tool_call>"


def compile_case(compiler: xgr.GrammarCompiler, schema: dict, style: str) -> xgr.CompiledGrammar:
    if style == "json":
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": QWEN_BEGIN, "end": QWEN_END,
        "content": {"type": "json_schema", "json_schema": schema, "style": style}}}
    return compiler.compile_structural_tag(json.dumps(tag))


def decide(compiler: xgr.GrammarCompiler, schema: dict, docs: list[str],
           style: str = "json") -> list[bool] | str:
    try:
        compiled = compile_case(compiler, schema, style)
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
    results = [decide(compiler, case["schema"], case["docs"], case.get("style", "json"))
               for case in request["cases"]]
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    main()

"""Run in a bare venv holding only an installed xgrammar wheel and apache-tvm-ffi.

Loads the installed bindings the way xgrammar's own load_binding does (through
tvm_ffi), without importing the xgrammar package (its matcher imports torch, which
such a venv lacks), then drives the compiled code through its tvm_ffi objects: a JSON
schema with a bounded string is converted, compiled and matched. Writes one JSON
object on stdout: the installed version and wheel tags, the sha256 of the loaded
library, the bounded string's rule, the decisions and the error for maxLength -1.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import tvm_ffi
from tvm_ffi.libinfo import load_lib_module

PACKAGE = Path(importlib.util.find_spec("xgrammar").submodule_search_locations[0])
load_lib_module("xgrammar", "xgrammar_bindings", extra_lib_paths=[PACKAGE])
LIBRARY = PACKAGE / "libxgrammar_bindings.so"


# The bindings' own types; their methods come from the library's reflection data.
@tvm_ffi.register_object("xgrammar.tvm_ffi_binding.Grammar")
class Grammar(tvm_ffi.Object):
    pass


@tvm_ffi.register_object("xgrammar.tvm_ffi_binding.TokenizerInfo")
class TokenizerInfo(tvm_ffi.Object):
    pass


@tvm_ffi.register_object("xgrammar.tvm_ffi_binding.GrammarCompiler")
class GrammarCompiler(tvm_ffi.Object):
    pass


@tvm_ffi.register_object("xgrammar.tvm_ffi_binding.GrammarMatcher")
class GrammarMatcher(tvm_ffi.Object):
    pass


def from_schema(schema: dict) -> Grammar:
    # (schema, any_whitespace, indent, separators, strict_mode, max_whitespace_cnt,
    #  print_converted_ebnf, any_order), as xgrammar.Grammar.from_json_schema passes them.
    return Grammar.from_json_schema(json.dumps(schema), False, None, None, True, None, False,
                                    False)


def main() -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
              "required": ["s"]}
    grammar = from_schema(schema)
    # No vocabulary (RAW, size 0): only the grammar's decisions on strings matter here.
    compiler = GrammarCompiler(TokenizerInfo([], 0, None, None, False), 1, False, -1)
    compiled = compiler.compile_grammar_ebnf(grammar)
    decisions = []
    # Four characters, five, and four escaped backslashes: four characters, which stock
    # 0.2.8 refuses (it rejects every escape inside a bounded string).
    for doc in ('{"s": "abcd"}', '{"s": "abcde"}', '{"s": "' + "\\\\" * 4 + '"}'):
        matcher = GrammarMatcher(compiled, None, True, -1, None)
        decisions.append(bool(matcher.accept_string(doc, False) and matcher.is_terminated()))
    try:
        from_schema({"type": "string", "maxLength": -1})
        minus_one = None
    except Exception as e:  # noqa: BLE001  the message is the result
        minus_one = str(e)
    dist = importlib.metadata.distribution("xgrammar")
    wheel = dist.read_text("WHEEL") or ""
    print(json.dumps({
        "version": dist.version,
        "tags": [line[len("Tag: "):] for line in wheel.splitlines() if line.startswith("Tag: ")],
        "library_sha256": hashlib.sha256(LIBRARY.read_bytes()).hexdigest(),
        "bounded_rules": [line for line in grammar.to_string().splitlines()
                          if "string_max_length=4" in line],
        "decisions": decisions,
        "max_length_minus_one": minus_one,
    }))


if __name__ == "__main__":
    main()

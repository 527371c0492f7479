"""``# mirrors: <upstream name>`` markers: fork code that re-derives an upstream formula.

A fork module that recomputes what upstream computes (a block size, a scratch size, a
constant) cannot see upstream change it. Such code names the upstream definition it
mirrors in a comment, on the line above the fork's own definition:

    # mirrors: vllm.v1.worker.gpu.spec_decode.dflash.speculator.prepare_dflash_inputs
    def dflash_input_block_sizes(...):

The name is the dotted path of an upstream function, method, class or constant, or,
for a stand-in of a compiled op, ``csrc/<file>::<function>`` (text after it on the line
is free); port-check compares that definition's code between the two pins and reports
each mirror whose upstream changed or is gone.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

from kiln.portcheck.units import CodeUnit

MARKER = re.compile(r"#\s*mirrors:\s*(?P<target>csrc/[\w./-]+::\w+|[A-Za-z_][\w.]*)")


@dataclass(frozen=True)
class Mirror:
    line: int
    target: str


def mirrors_in(unit: CodeUnit) -> list[Mirror]:
    """The markers in the unit's comments (in a topic's own lines only, for a topic)."""
    found = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(unit.source).readline))
    except (tokenize.TokenError, SyntaxError):
        return []  # the file does not parse: port-check reports it as unparsed
    for token in tokens:
        if token.type != tokenize.COMMENT:
            continue
        m = MARKER.match(token.string)
        line = token.start[0]
        if m and (unit.lines is None or line in unit.lines):
            found.append(Mirror(line, m["target"].rstrip(".")))
    return found

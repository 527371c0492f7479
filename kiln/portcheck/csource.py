"""The text of a C++ function in upstream's sources, for ``# mirrors: csrc/F.cpp::name``.

The fork's pure-torch stand-ins for compiled ops re-derive what a C++ kernel computes;
their markers name the file and the function, and port-check compares that function's
body between the pins as it compares a Python definition. A definition is found by its
name at the start of a declarator, followed by its parameter list and a brace-delimited
body; comments and whitespace are left out, so only a change of the code shows.
"""

from __future__ import annotations

import re
from pathlib import Path

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _matching(text: str, start: int, open_: str, close: str) -> int | None:
    """The index just past the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def function_text(root: Path, target: str) -> str | None:
    """``path::name``'s definition (signature and body) with comments removed and
    whitespace folded; None where the file or a definition of that name is missing."""
    path, _, name = target.partition("::")
    file = root / path
    if not name or not file.is_file():
        return None
    text = _COMMENTS.sub(" ", file.read_text(errors="replace"))
    for m in re.finditer(rf"(?m)^[^\n;{{}}#]*?\b{re.escape(name)}\s*\(", text):
        params_end = _matching(text, m.end() - 1, "(", ")")
        if params_end is None:
            continue
        brace = re.match(r"[^;{]*\{", text[params_end:])  # const, noexcept, -> type ...
        if brace is None:
            continue  # a declaration or a call, not the definition
        body_end = _matching(text, params_end + brace.end() - 1, "{", "}")
        if body_end is not None:
            return " ".join(text[m.start():body_end].split())
    return None

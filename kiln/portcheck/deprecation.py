"""Whether an upstream definition says it is deprecated.

Four places say so: the first paragraph of its docstring, the comments right above it
(or on its line), a ``@deprecated`` decorator, and a warning that names it: a string
passed to a call in the class or module that defines it, in which the name comes
before the word (``"parallel_drafting is deprecated and has no effect"``).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

_WORD = re.compile(r"deprecat", re.I)
_DECORATOR = re.compile(r"^@[\w.]*\bdeprecated\b")


@dataclass(frozen=True)
class _Source:
    lines: list[str]
    call_strings: list[tuple[int, str]]  # (line, text) of string arguments of calls


@functools.lru_cache(maxsize=256)
def _source(path: str) -> _Source:
    text = Path(path).read_text(errors="replace")
    strings: list[tuple[int, str]] = []
    if _WORD.search(text):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            tree = None
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Call):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        strings.append((arg.lineno, arg.value))
                    elif isinstance(arg, ast.JoinedStr):
                        strings.append((arg.lineno, "".join(
                            v.value for v in arg.values if isinstance(v, ast.Constant))))
    return _Source(text.splitlines(), strings)


def deprecation(obj) -> str | None:
    """What says the griffe object ``obj`` is deprecated, quoted; None if nothing does."""
    if obj is None or obj.is_alias or obj.is_module or obj.lineno is None or obj.filepath is None:
        return None
    doc = obj.docstring.value.strip().split("\n\n")[0] if obj.docstring else ""
    if _WORD.search(doc):
        return f"its docstring: {_clip(doc)}"
    # griffe keeps a function's decorators; a property's are read from the lines above it.
    for decorator in getattr(obj, "decorators", ()):
        if _DECORATOR.match(f"@{decorator.value}"):
            return f"the line above it: {_clip(f'@{decorator.value}')}"
    source = _source(str(obj.filepath))
    index = obj.lineno - 1
    line = source.lines[index] if index < len(source.lines) else ""
    if not line.lstrip().startswith("@") and "#" in line and _WORD.search(line.partition("#")[2]):
        return f"the comment on its line: {_clip(line.strip())}"
    while index > 0 and source.lines[index - 1].strip().startswith(("@", "#")):
        index -= 1
        above = source.lines[index].strip()
        if _DECORATOR.match(above) or (above.startswith("#") and _WORD.search(above)):
            return f"the line above it: {_clip(above)}"
    scope = obj.parent if obj.parent is not None and obj.parent.is_class else None
    first, last = (scope.lineno, scope.endlineno) if scope is not None else (1, len(source.lines))
    spelled = "|".join(re.escape(n) for n in {obj.name, obj.name.replace("_", "-")})
    names_it = re.compile(rf"(?<![\w-])(?:{spelled})(?![\w-]).*deprecat", re.I | re.S)
    for number, text in source.call_strings:
        if first <= number <= (last or number) and names_it.search(text):
            return f"a warning at {Path(obj.filepath).name}:{number}: {_clip(text)}"
    return None


def _clip(text: str, width: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."

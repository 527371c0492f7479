"""Torch operator schema strings, such as ``varlen_fwd(Tensor! q, Tensor? gen) -> Tensor[]``.

Only what binding a Python call needs is modelled: the argument names, types, defaults and
which are keyword-only. An argument without a default must be passed at every call, even
when its type is optional (``Tensor?``): torch.ops has no implicit ``None``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.errors import KilnError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)?$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OPEN, _CLOSE = "([", ")]"


@dataclass(frozen=True)
class Argument:
    name: str
    type: str
    default: str | None = None
    keyword_only: bool = False

    @property
    def optional(self) -> bool:
        """The type accepts None (``T?``)."""
        return self.type.endswith("?")

    @property
    def required(self) -> bool:
        return self.default is None

    def __str__(self) -> str:
        return f"{self.type} {self.name}" + (f"={self.default}" if self.default is not None else "")


@dataclass(frozen=True)
class Schema:
    name: str  # the op name, without the overload
    overload: str  # "" for the default overload
    arguments: tuple[Argument, ...]
    returns: str

    @property
    def qualified(self) -> str:
        return f"{self.name}.{self.overload}" if self.overload else self.name

    @property
    def positional(self) -> tuple[Argument, ...]:
        return tuple(a for a in self.arguments if not a.keyword_only)

    def argument(self, name: str) -> Argument | None:
        return next((a for a in self.arguments if a.name == name), None)

    def __str__(self) -> str:
        parts, star = [], False
        for a in self.arguments:
            if a.keyword_only and not star:
                parts.append("*")
                star = True
            parts.append(str(a))
        return f"{self.qualified}({', '.join(parts)}) -> {self.returns}"


def split_top_level(text: str, source: str) -> list[str]:
    """``text`` split at commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                raise KilnError(f"{source}: unbalanced {ch!r} in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth or quote:
        raise KilnError(f"{source}: unclosed bracket or quote in {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _closing_paren(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def parse(text: str, source: str = "schema") -> Schema:
    """Parse one schema string; a malformed one raises KilnError naming ``source``."""
    text = " ".join(text.split())
    open_at = text.find("(")
    close_at = _closing_paren(text, open_at) if open_at > 0 else -1
    if close_at < 0:
        raise KilnError(f"{source}: {text!r} is not a schema (expected 'name(args) -> returns')")
    name = text[:open_at].strip()
    tail = text[close_at + 1:].strip()
    if not _NAME.match(name) or not tail.startswith("->") or not tail[2:].strip():
        raise KilnError(f"{source}: {text!r} is not a schema (expected 'name(args) -> returns')")
    op, _, overload = name.partition(".")
    body = text[open_at + 1:close_at].strip()
    arguments, keyword_only = [], False
    for part in split_top_level(body, source) if body else []:
        if part == "*":
            keyword_only = True
            continue
        decl, eq, default = part.partition("=")
        pieces = decl.strip().rsplit(" ", 1)
        if len(pieces) != 2 or not _IDENT.match(pieces[1]) or (eq and not default.strip()):
            raise KilnError(f"{source}: argument {part!r} of {name} is not 'Type name[=default]'")
        arguments.append(Argument(pieces[1], pieces[0].replace(" ", ""),
                                  default.strip() if eq else None, keyword_only))
    names = [a.name for a in arguments]
    if len(set(names)) != len(names):
        raise KilnError(f"{source}: {name} names an argument twice: {', '.join(names)}")
    return Schema(op, overload, tuple(arguments), tail[2:].strip())

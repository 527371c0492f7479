"""An upstream source tree's API, read statically through griffe."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kiln.portcheck.findings import Unparsable


_TOP_LEVEL_DEF = re.compile(r"^(?:async\s+def|def|class)\s+(\w+)|^(\w+)\s*(?::[^=\n]*)?=(?!=)", re.M)


class ApiModel:
    """One source tree seen through griffe, a module at a time, on demand."""

    def __init__(self, root: Path, version: str):
        self.root = root
        self.version = version
        self._modules: dict[str, Any] = {}
        self._definitions: dict[str, list[str]] | None = None
        self.unparsed: list[Unparsable] = []

    def module_file(self, name: str) -> Path | None:
        base = self.root / name.replace(".", "/")
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def module(self, name: str):
        if name not in self._modules:
            import griffe

            path = self.module_file(name)
            try:
                self._modules[name] = None if path is None else griffe.visit(name, path, path.read_text())
            except (SyntaxError, UnicodeDecodeError, ValueError) as e:
                # Reported as an ``unparsed`` finding, so what it hides is never just absent.
                self.unparsed.append(Unparsable(f"{self.version}:{path.relative_to(self.root)}", e))
                self._modules[name] = None
        return self._modules[name]

    def lookup(self, qualname: str, depth: int = 0):
        """The griffe object a dotted name means here, following re-exports; None if absent."""
        parts = qualname.split(".")
        for cut in range(len(parts), 0, -1):
            obj = self.module(".".join(parts[:cut]))
            if obj is None:
                continue
            for part in parts[cut:]:
                obj = self._member(obj, part, depth)
                if obj is None:
                    return None
            return obj
        return None

    def _member(self, obj, name: str, depth: int):
        if obj.is_alias:
            obj = self._follow(obj, depth)
            if obj is None or obj.is_alias:
                return obj  # outside this tree: exists, but has no members we can see
        member = obj.members.get(name)
        if member is None and obj.is_class:
            for base in obj.bases:
                base_obj = self.lookup(_expr_path(base), depth + 1) if depth < 8 else None
                if base_obj is not None and not base_obj.is_alias:
                    member = self._member(base_obj, name, depth + 1)
                    if member is not None:
                        break
        if member is not None and member.is_alias:
            return self._follow(member, depth)
        return member

    def _follow(self, alias, depth: int):
        target = alias.target_path
        if depth >= 8 or not target.startswith(self.root_package + "."):
            return alias
        return self.lookup(target, depth + 1)

    @property
    def root_package(self) -> str:
        return "vllm"

    def defined_in(self, name: str) -> list[str]:
        """Modules of this tree that define ``name`` at their top level."""
        if self._definitions is None:
            self._definitions = {}
            package = self.root / self.root_package
            for path in sorted(package.rglob("*.py")):
                module = module_name(path.relative_to(self.root).as_posix())
                for m in _TOP_LEVEL_DEF.finditer(path.read_text(errors="replace")):
                    self._definitions.setdefault(m.group(1) or m.group(2), []).append(module)
        return self._definitions.get(name, [])


def _expr_path(expr) -> str:
    """The dotted path a griffe expression (a base class, say) names."""
    try:
        return expr.canonical_path
    except AttributeError:
        return str(expr)


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)

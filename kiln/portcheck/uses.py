"""Every upstream name fork code reaches: imports, calls and base classes, resolved to dotted paths."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from kiln.portcheck.units import CodeUnit


class Scope:
    """What the names of one module mean: imports, own definitions, annotated parameters."""

    def __init__(self, unit: CodeUnit):
        self.unit = unit
        self.names: dict[str, str] = {}
        package = unit.module if unit.path.endswith("__init__.py") else unit.module.rpartition(".")[0]
        for node in ast.walk(unit.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.names[alias.asname] = alias.name
                    else:
                        root = alias.name.split(".")[0]
                        self.names[root] = root
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, package)
                for alias in node.names:
                    if alias.name != "*":
                        self.names[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in unit.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.names.setdefault(node.name, f"{unit.module}.{node.name}")

    def dotted(self, node: ast.AST, local: dict[str, str]) -> str | None:
        """The qualified name of a Name/Attribute chain, if its root is known."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            root = local.get(node.id) or self.names.get(node.id)
            if root is None:
                return None
            return ".".join([root, *reversed(parts)])
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
                and parts and "super" in local):
            return ".".join([local["super"], *reversed(parts)])
        return None

    def annotation(self, node: ast.expr | None) -> str | None:
        """The class an annotation names (``X``, ``"X"``, ``X | None``)."""
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            for side in (node.left, node.right):
                if not (isinstance(side, ast.Constant) and side.value is None):
                    return self.annotation(side)
        return self.dotted(node, {}) if isinstance(node, (ast.Name, ast.Attribute)) else None


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@dataclass
class Use:
    """An upstream name the series' code reaches, and how."""

    unit: CodeUnit
    qualname: str
    line: int
    call: ast.Call | None = None


def uses(unit: CodeUnit) -> Iterator[Use]:
    """Imports, attribute chains and calls of the series' lines that resolve to names."""
    scope = Scope(unit)
    for node in unit.tree.body:
        yield from _uses_in(node, unit, scope, {}, None)


def _uses_in(node: ast.AST, unit: CodeUnit, scope: Scope, local: dict[str, str],
             cls: str | None) -> Iterator[Use]:
    if isinstance(node, ast.ClassDef):
        qual = f"{unit.module}.{node.name}" if cls is None else f"{cls}.{node.name}"
        for base in node.bases:
            if unit.counts(base) and (name := scope.dotted(base, local)):
                yield Use(unit, name, base.lineno)
        for child in node.body:
            yield from _uses_in(child, unit, scope, local, qual)
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        inner = dict(local)
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        if cls is not None and args:
            inner[args[0].arg] = cls
            bases = _class_bases(unit, scope, cls)
            if bases:
                inner["super"] = bases[0]
        for arg in args:
            if (typ := scope.annotation(arg.annotation)) is not None:
                inner[arg.arg] = typ
        for child in node.body:
            yield from _uses_in(child, unit, scope, inner, cls)
        return
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        if unit.counts(node):
            package = unit.module if unit.path.endswith("__init__.py") else unit.module.rpartition(".")[0]
            for alias in node.names:
                if isinstance(node, ast.Import):
                    yield Use(unit, alias.name, node.lineno)
                elif alias.name != "*":
                    yield Use(unit, f"{_absolute(node, package)}.{alias.name}", node.lineno)
        return
    if isinstance(node, ast.Call):
        callee = scope.dotted(node.func, local)
        if callee and unit.counts(node):
            yield Use(unit, callee, node.lineno, node)
        if not isinstance(node.func, ast.Name):
            yield from _uses_in(node.func, unit, scope, local, cls)
        for child in [*node.args, *(k.value for k in node.keywords)]:
            yield from _uses_in(child, unit, scope, local, cls)
        return
    if isinstance(node, ast.Attribute):
        name = scope.dotted(node, local)
        if name and unit.counts(node):
            yield Use(unit, name, node.lineno)
            return
    for child in ast.iter_child_nodes(node):
        yield from _uses_in(child, unit, scope, local, cls)


def _class_bases(unit: CodeUnit, scope: Scope, cls: str) -> list[str]:
    name = cls.rpartition(".")[2]
    for node in ast.walk(unit.tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [b for b in (scope.dotted(base, {}) for base in node.bases) if b]
    return []

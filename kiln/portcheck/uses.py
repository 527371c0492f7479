"""Every upstream name fork code reaches, resolved to dotted paths, and the attribute
reads whose receiver has a type this static view cannot tell.

Names resolve through imports, the module's own definitions, annotated parameters, a
fork method's parameters left unannotated where the upstream method it overrides
annotates them, ``self`` (members a fork class does not define itself are its upstream
base's), local assignments, and, with an API model, the annotated types of upstream
attributes and return values: ``mode = spec.kv_quant_mode`` with ``spec: AttentionSpec``
makes ``getattr(mode, "is_custom_mode", False)`` a read of
``vllm.v1.kv_cache_interface.KVQuantMode.is_custom_mode``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.portcheck.units import CodeUnit

if TYPE_CHECKING:
    from kiln.portcheck.apimodel import ApiModel

# How the code uses a name, as a finding says it ("X, read here, ...").
READ, WRITTEN, CALLED, IMPORTED, SUBCLASSED = "read", "set", "called", "imported", "subclassed"
GETATTR, GETATTR_DEFAULT, HASATTR = ("read with getattr()", "read with getattr(..., default)",
                                     "tested with hasattr()")
SILENT = (GETATTR_DEFAULT, HASATTR)  # a missing attribute gives the default, not an error
_UNKNOWN = ""  # a local whose value this view cannot tell; hides a module-level name
_ANY = ("typing.Any", "typing_extensions.Any", "object")


@dataclass
class _ForkClass:
    bases: list[str]
    own: set[str] = field(default_factory=set)


class Scope:
    """What the names of one module mean: imports, own definitions, annotated parameters
    and, with an API model, the upstream types of the values they hold."""

    def __init__(self, unit: CodeUnit, model: ApiModel | None = None):
        self.unit = unit
        self.model = model
        self.names: dict[str, str] = {}
        self.classes: dict[str, _ForkClass] = {}
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
        for node in unit.tree.body:
            if isinstance(node, ast.ClassDef):
                bases = self.bases(node, {})
                self.classes[f"{unit.module}.{node.name}"] = _ForkClass(bases, _own_members(node))

    def bases(self, node: ast.ClassDef, local: dict[str, str]) -> list[str]:
        """The classes a class derives from (``Base[T]``: Base), where known."""
        return [b for b in (self.dotted(_generic_origin(base), local) for base in node.bases) if b]

    def dotted(self, node: ast.AST, local: dict[str, str]) -> str | None:
        """The qualified name of a Name/Attribute chain (or of a call's result), if its
        root is known."""
        paths = self.chain(node, local)
        return paths[-1] if paths else None

    def chain(self, node: ast.AST, local: dict[str, str]) -> list[str] | None:
        """The paths an attribute chain reaches: one per typed value it passes through
        (``vllm_config.speculative_config`` on VllmConfig), then the last one."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        parts.reverse()
        root = self._root(node, local, bool(parts))
        if not root:
            return None
        root = self._inherited(root, parts[0] if parts else None)
        paths, path = [], root
        for part in parts:
            typed = self.value_type(path)
            if typed is not None:
                paths.append(path)
                path = typed
            path = f"{path}.{part}"
        return [*paths, path]

    def _root(self, node: ast.AST, local: dict[str, str], has_parts: bool) -> str | None:
        if isinstance(node, ast.Name):
            return local[node.id] if node.id in local else self.names.get(node.id)
        if not isinstance(node, ast.Call):
            return None
        if isinstance(node.func, ast.Name) and node.func.id == "super":
            return local.get("super") if has_parts else None
        callee = self.dotted(node.func, local)
        return self.result(callee) if callee else None

    def _inherited(self, root: str, first: str | None) -> str:
        """``self.x`` of a fork class that does not define ``x``: its base's ``x``."""
        for _ in range(8):
            fork = self.classes.get(root)
            if fork is None or first is None or first in fork.own or not fork.bases:
                return root
            root = fork.bases[0]
        return root

    def value_type(self, path: str) -> str | None:
        if self.model is None or not path.startswith("vllm."):
            return None
        return self.model.value_type(path)

    def result(self, callee: str) -> str:
        """What a call of ``callee`` returns: its class when known, else ``callee()``."""
        return self.value_type(f"{callee}()") or f"{callee}()"

    def value_of(self, node: ast.AST, local: dict[str, str]) -> str:
        """What a local assigned ``node`` is: a class path, a dotted path, or unknown."""
        if not isinstance(node, (ast.Name, ast.Attribute, ast.Call)):
            return _UNKNOWN
        path = self.dotted(node, local)
        if path is None:
            return _UNKNOWN
        return self.value_type(path) or path

    def annotation(self, node: ast.expr | None) -> str | None:
        """The class an annotation names (``X``, ``"X"``, ``X | None``); None for Any."""
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
        if not isinstance(node, (ast.Name, ast.Attribute)):
            return None
        path = self.dotted(node, {})
        return None if path in _ANY else path

    def base_param_type(self, cls: str, method: str, param: str) -> str | None:
        """The annotated class of ``param`` in the upstream method ``method`` overrides."""
        fork = self.classes.get(cls)
        if self.model is None or fork is None:
            return None
        for base in fork.bases:
            if base.startswith("vllm.") and base not in self.classes:
                found = self.model.param_type(f"{base}.{method}", param)
                if found:
                    return found
        return None


def _generic_origin(base: ast.expr) -> ast.expr:
    return base.value if isinstance(base, ast.Subscript) else base


def _own_members(node: ast.ClassDef) -> set[str]:
    """What a fork class defines itself: its body's names and ``self.<name> = ...``."""
    own: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(stmt.name)
            args = [*stmt.args.posonlyargs, *stmt.args.args] if not isinstance(stmt, ast.ClassDef) else []
            if args:
                first = args[0].arg
                own.update(n.attr for n in ast.walk(stmt) if isinstance(n, ast.Attribute)
                           and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                           and n.value.id == first)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            own.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return own


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
    how: str = READ


@dataclass
class Read:
    """An attribute the code reads, sets or calls on a value of unknown type."""

    unit: CodeUnit
    name: str
    line: int
    how: str


def uses(unit: CodeUnit, model: ApiModel | None = None) -> Iterator[Use | Read]:
    """Imports, attribute chains, calls and attribute reads of the series' lines."""
    scope = Scope(unit, model)
    for node in unit.tree.body:
        yield from _uses_in(node, unit, scope, {}, None)


def _uses_in(node: ast.AST, unit: CodeUnit, scope: Scope, local: dict[str, str],
             cls: str | None) -> Iterator[Use | Read]:
    if isinstance(node, ast.ClassDef):
        qual = f"{unit.module}.{node.name}" if cls is None else f"{cls}.{node.name}"
        for base in node.bases:
            if unit.counts(base) and (name := scope.dotted(_generic_origin(base), local)):
                yield Use(unit, name, base.lineno, how=SUBCLASSED)
        for child in node.body:
            yield from _uses_in(child, unit, scope, local, qual)
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield from _function(node, unit, scope, local, cls)
        return
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        if unit.counts(node):
            package = unit.module if unit.path.endswith("__init__.py") else unit.module.rpartition(".")[0]
            for alias in node.names:
                if isinstance(node, ast.Import):
                    yield Use(unit, alias.name, node.lineno, how=IMPORTED)
                elif alias.name != "*":
                    yield Use(unit, f"{_absolute(node, package)}.{alias.name}", node.lineno, how=IMPORTED)
        return
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
        yield from _assignment(node, unit, scope, local, cls)
        return
    if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        yield from _uses_in(node.iter, unit, scope, local, cls)
        _forget(node.target, local)
        for child in [*getattr(node, "ifs", []), *getattr(node, "body", []), *getattr(node, "orelse", [])]:
            yield from _uses_in(child, unit, scope, local, cls)
        return
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp, ast.Lambda)):
        inner = dict(local)  # the comprehension's and the lambda's own names stay inside
        if isinstance(node, ast.Lambda):
            inner.update((a.arg, _UNKNOWN) for a in ast.walk(node.args) if isinstance(a, ast.arg))
            parts = [node.body]
        else:
            parts = [*node.generators, *((node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,))]
        for child in parts:
            yield from _uses_in(child, unit, scope, inner, cls)
        return
    if isinstance(node, ast.withitem):
        yield from _uses_in(node.context_expr, unit, scope, local, cls)
        if node.optional_vars is not None:
            _forget(node.optional_vars, local)
        return
    if isinstance(node, ast.Call):
        yield from _call(node, unit, scope, local, cls)
        return
    if isinstance(node, ast.Attribute):
        yield from _attribute(node, unit, scope, local, cls)
        return
    for child in ast.iter_child_nodes(node):
        yield from _uses_in(child, unit, scope, local, cls)


def _function(node, unit: CodeUnit, scope: Scope, local: dict[str, str],
              cls: str | None) -> Iterator[Use | Read]:
    inner = dict(local)
    args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
    if cls is not None and args:
        inner[args[0].arg] = cls
        fork = scope.classes.get(cls)
        if fork is not None and fork.bases:
            inner["super"] = fork.bases[0]
    for index, arg in enumerate(args):
        if cls is not None and index == 0:
            continue
        typ = scope.annotation(arg.annotation)
        if typ is None and arg.annotation is None and cls is not None:
            typ = scope.base_param_type(cls, node.name, arg.arg)
        inner[arg.arg] = typ or _UNKNOWN
    for extra in (node.args.vararg, node.args.kwarg):
        if extra is not None:
            inner[extra.arg] = _UNKNOWN
    for child in node.body:
        yield from _uses_in(child, unit, scope, inner, cls)


def _assignment(node, unit: CodeUnit, scope: Scope, local: dict[str, str],
                cls: str | None) -> Iterator[Use | Read]:
    if node.value is not None:
        yield from _uses_in(node.value, unit, scope, local, cls)
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        if isinstance(target, ast.Name):
            typed = scope.annotation(node.annotation) if isinstance(node, ast.AnnAssign) else None
            value = scope.value_of(node.value, local) if node.value is not None else _UNKNOWN
            local[target.id] = typed or value
        elif isinstance(target, (ast.Tuple, ast.List, ast.Starred)):
            _forget(target, local)
            for part in ast.walk(target):
                if isinstance(part, (ast.Attribute, ast.Subscript)):
                    yield from _uses_in(part, unit, scope, local, cls)
        else:
            yield from _uses_in(target, unit, scope, local, cls)


def _forget(target: ast.AST, local: dict[str, str]) -> None:
    for name in ast.walk(target):
        if isinstance(name, ast.Name):
            local[name.id] = _UNKNOWN


def _call(node: ast.Call, unit: CodeUnit, scope: Scope, local: dict[str, str],
          cls: str | None) -> Iterator[Use | Read]:
    func = node.func
    if (isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and func.id not in local
            and func.id not in scope.names and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        how = HASATTR if func.id == "hasattr" else GETATTR_DEFAULT if len(node.args) > 2 else GETATTR
        receiver = scope.dotted(node.args[0], local)
        if unit.counts(node):
            name = node.args[1].value
            if receiver is None:
                yield Read(unit, name, node.lineno, how)
            else:
                yield Use(unit, f"{scope.value_type(receiver) or receiver}.{name}", node.lineno, how=how)
    else:
        paths = scope.chain(func, local)
        if paths and unit.counts(node):
            for path in paths[:-1]:
                yield Use(unit, path, node.lineno)
            yield Use(unit, paths[-1], node.lineno, node, CALLED)
        elif paths is None and isinstance(func, ast.Attribute) and unit.counts(node):
            yield Read(unit, func.attr, node.lineno, CALLED)
        if isinstance(func, ast.Attribute):
            yield from _receiver(func, unit, scope, local, cls, resolved=paths is not None)
    for child in [*node.args, *(k.value for k in node.keywords)]:
        yield from _uses_in(child, unit, scope, local, cls)


def _attribute(node: ast.Attribute, unit: CodeUnit, scope: Scope, local: dict[str, str],
               cls: str | None) -> Iterator[Use | Read]:
    paths = scope.chain(node, local)
    how = WRITTEN if isinstance(node.ctx, ast.Store) else READ
    if unit.counts(node):
        if paths:
            for path in paths[:-1]:
                yield Use(unit, path, node.lineno)
            yield Use(unit, paths[-1], node.lineno, how=how)
        elif not isinstance(node.ctx, ast.Del):
            yield Read(unit, node.attr, node.lineno, how)
    yield from _receiver(node, unit, scope, local, cls, resolved=paths is not None)


def _receiver(node: ast.Attribute, unit: CodeUnit, scope: Scope, local: dict[str, str],
              cls: str | None, resolved: bool) -> Iterator[Use | Read]:
    """The expression an attribute is taken from: its own reads and calls. A resolved
    chain was reported whole; only a call at its root is left to walk."""
    value = node.value
    if resolved:
        while isinstance(value, ast.Attribute):
            value = value.value
        if isinstance(value, ast.Call):
            yield from _uses_in(value, unit, scope, local, cls)
        return
    if isinstance(value, ast.Attribute):
        yield from _attribute(value, unit, scope, local, cls)
    else:
        yield from _uses_in(value, unit, scope, local, cls)

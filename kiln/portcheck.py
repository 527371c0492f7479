"""Port checks: what a clean rebase onto a new upstream can still break.

The series' own code is read where it runs: the lines each topic adds (on the
old pristine tree with the series applied up to that topic) and the overlay
modules under ``vllm/`` and ``kvarn/``. Every upstream name, call, base class
and enum it reaches is compared between the old and the new pristine trees,
whose API model griffe builds statically (nothing is imported). Findings:

- ``removed-name``: a name the code uses that the new upstream no longer defines;
- ``moved``: such a name that the new upstream defines in another module;
- ``changed-signature``: a call whose arguments bind differently (or not at all);
- ``override``: a fork method that no longer takes what its upstream base declares;
- ``enum-collision``: a fork enum member whose value meets a new upstream member;
- ``body-drift``: an upstream function a topic patches whose body changed;
- ``unparsed``: a file (fork or upstream) that does not parse here, so nothing in it
  was checked: reported, never skipped.
"""

from __future__ import annotations

import ast
import difflib
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.patching import apply_topic
from kiln.series import Series, Topic
from kiln.tomlfile import read_toml

KINDS = ("unparsed", "removed-name", "changed-signature", "override", "enum-collision", "body-drift",
         "moved")
OVERLAY_TOPIC = "(overlay)"
UPSTREAM_TOPIC = "(upstream)"  # findings about an upstream file itself, not a topic's use of it
_TOP_LEVEL_DEF = re.compile(r"^(?:async\s+def|def|class)\s+(\w+)|^(\w+)\s*(?::[^=\n]*)?=(?!=)", re.M)
_ENUM_BASES = ("Enum", "IntEnum", "IntFlag", "Flag", "StrEnum")


@dataclass(frozen=True, order=True)
class Finding:
    """One thing the port must look at; ``where`` is stable across line shifts."""

    kind: str
    topic: str
    where: str
    detail: str

    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.topic, self.where)

    def to_json(self) -> dict[str, str]:
        return asdict(self)


# --- the API model ---------------------------------------------------------


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
                module = _module_name(path.relative_to(self.root).as_posix())
                for m in _TOP_LEVEL_DEF.finditer(path.read_text(errors="replace")):
                    self._definitions.setdefault(m.group(1) or m.group(2), []).append(module)
        return self._definitions.get(name, [])


def _expr_path(expr) -> str:
    """The dotted path a griffe expression (a base class, say) names."""
    try:
        return expr.canonical_path
    except AttributeError:
        return str(expr)


def _module_name(path: str) -> str:
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# --- signatures and binding ------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # positional-only, positional or keyword, variadic positional, keyword-only, variadic keyword
    required: bool


def signature(func) -> tuple[Param, ...] | None:
    """Parameters a caller passes (self/cls dropped); None for what is not callable."""
    if func is None or func.is_alias:
        return None
    if func.is_class:
        init = func.members.get("__init__")
        return signature(init) if init is not None and init.is_function else None
    if not func.is_function:
        return None
    params = [Param(p.name, p.kind.value, p.default is None and "variadic" not in p.kind.value)
              for p in func.parameters]
    if func.parent is not None and func.parent.is_class and "staticmethod" not in func.labels and params:
        params = params[1:]
    return tuple(params)


def describe(params: tuple[Param, ...]) -> str:
    return "(" + ", ".join(p.name for p in params) + ")"


def bind(params: tuple[Param, ...], positional: int, keywords: list[str],
         star_args: bool = False) -> dict[str, str] | str:
    """Argument slot -> parameter name, or why the call does not bind."""
    slots: dict[str, str] = {}
    positional_params = [p for p in params if p.kind in ("positional-only", "positional or keyword")]
    var_positional = next((p for p in params if p.kind == "variadic positional"), None)
    var_keyword = next((p for p in params if p.kind == "variadic keyword"), None)
    for index in range(positional):
        if index < len(positional_params):
            slots[f"argument #{index + 1}"] = positional_params[index].name
        elif var_positional is not None:
            slots[f"argument #{index + 1}"] = "*" + var_positional.name
        else:
            return f"{positional} positional arguments, but it takes {len(positional_params)}"
    by_name = {p.name: p for p in params if p.kind in ("positional or keyword", "keyword-only")}
    for key in keywords:
        if key in by_name:
            if key in slots.values():
                return f"`{key}` given by position and by keyword"
            slots[f"keyword {key}"] = key
        elif var_keyword is not None:
            slots[f"keyword {key}"] = "**" + var_keyword.name
        else:
            return f"no parameter `{key}`"
    if not star_args:
        missing = [p.name for p in params if p.required and p.name not in slots.values()]
        if missing:
            return "required parameter(s) not passed: " + ", ".join(missing)
    return slots


def with_series_params(new: tuple[Param, ...], pristine_old: tuple[Param, ...],
                       patched_old: tuple[Param, ...]) -> tuple[Param, ...]:
    """The new signature once the series re-adds its own parameters after upstream's."""
    upstream = {p.name for p in pristine_old} | {p.name for p in new}
    added = [p for p in patched_old if p.name not in upstream]
    cut = next((i for i, p in enumerate(new) if p.kind not in ("positional-only", "positional or keyword")),
               len(new))
    keep_kind = [p for p in added if p.kind in ("positional-only", "positional or keyword")]
    rest = [p for p in added if p not in keep_kind]
    return (*new[:cut], *keep_kind, *new[cut:], *rest)


# --- reading the series' code ----------------------------------------------


@dataclass
class Hunk:
    path: str
    added: list[int]  # line numbers of added lines in the file after the topic
    span: tuple[int, int]  # new-side lines the hunk's changes sit between


def topic_hunks(topic: Topic) -> list[Hunk]:
    """Added lines and change spans of each hunk, on the topic's new side."""
    return [Hunk(f.new_path, [n for n, _ in h.added()], (min(h.changed()), max(h.changed())))
            for f in topic.file_diffs() if f.new_path for h in f.hunks if h.changed()]


@dataclass
class CodeUnit:
    """A module's source and the lines whose code belongs to the series (None: all)."""

    topic: str
    path: str  # as the finding names it
    module: str
    tree: ast.Module
    source: str
    lines: set[int] | None
    hunks: list[Hunk] = field(default_factory=list)

    def counts(self, node: ast.AST) -> bool:
        if self.lines is None:
            return True
        start = getattr(node, "lineno", None)
        end = getattr(node, "end_lineno", start)
        return start is not None and any(n in self.lines for n in range(start, end + 1))


class Unparsable(Exception):
    """A file port-check cannot read; it becomes an ``unparsed`` finding, never a skip."""

    def __init__(self, label: str, error: Exception):
        super().__init__(f"{label}: {type(error).__name__}: {error}")
        self.label = label

    def finding(self, topic: str) -> Finding:
        return Finding("unparsed", topic, self.label,
                       f"{self}; port-check cannot see this file's uses, overrides or drift "
                       f"(it parses with Python {sys.version_info.major}.{sys.version_info.minor})")


def _parse(path: Path, label: str) -> ast.Module:
    try:
        return ast.parse(path.read_text(), filename=label)
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise Unparsable(label, e) from None


# --- resolving names in fork code ------------------------------------------


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


# --- the checks -----------------------------------------------------------


@dataclass
class PortCheck:
    """The inputs of one check: old and new pristine models, and the old tree with the series."""

    old: ApiModel
    new: ApiModel
    patched: ApiModel
    overlay_modules: set[str]

    def is_upstream(self, qualname: str) -> bool:
        top = qualname.split(".")[0]
        if top != "vllm":
            return False
        return not any(qualname == m or qualname.startswith(m + ".") for m in self.overlay_modules)

    def check_use(self, use: Use) -> Iterator[Finding]:
        if not self.is_upstream(use.qualname):
            return
        where = f"{use.unit.path}::{use.qualname}"
        old_obj = self.old.lookup(use.qualname)
        if old_obj is None:
            return  # the series' own name, or one this static view cannot see
        new_obj = self.new.lookup(use.qualname)
        if new_obj is None:
            yield self.vanished(use.unit.topic, where, use.qualname, f"{use.unit.path}:{use.line}")
            return
        if use.call is not None:
            yield from self.check_call(use, old_obj, new_obj, where)

    def vanished(self, topic: str, where: str, qualname: str, site: str) -> Finding:
        module, _, name = qualname.rpartition(".")
        homes = [m for m in self.new.defined_in(name) if m != module and self.new.lookup(f"{m}.{name}")]
        if homes:
            return Finding("moved", topic, where,
                           f"{site}: {qualname} is not in {self.new.version}'s {module}; "
                           f"{self.new.version} defines {name} in {', '.join(homes)} "
                           "(not re-exported): import it from there")
        parent = self.new.lookup(module)
        hint = ""
        if parent is not None and not parent.is_alias and parent.members:
            close = difflib.get_close_matches(name, list(parent.members), n=3, cutoff=0.6)
            if close:
                hint = f"; {module} now has {', '.join(close)} (renamed?)"
        return Finding("removed-name", topic, where,
                       f"{site}: {qualname} exists in {self.old.version} but not in "
                       f"{self.new.version}{hint}")

    def check_call(self, use: Use, old_obj, new_obj, where: str) -> Iterator[Finding]:
        old_sig, new_sig = signature(old_obj), signature(new_obj)
        if old_sig is None or new_sig is None or old_sig == new_sig:
            return
        patched_sig = signature(self.patched.lookup(use.qualname)) or old_sig
        effective = with_series_params(new_sig, old_sig, patched_sig)
        call = use.call
        star = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
        positional = len([a for a in call.args if not isinstance(a, ast.Starred)])
        keywords = [k.arg for k in call.keywords if k.arg is not None]
        before = bind(patched_sig, positional, keywords, star)
        after = bind(effective, positional, keywords, star)
        if isinstance(before, str):
            return  # the call did not bind before either; not a port question
        site = f"{use.unit.path}:{use.line}"
        change = (f"{use.qualname}{describe(old_sig)} in {self.old.version} is "
                  f"{describe(new_sig)} in {self.new.version}")
        breakages = _breakages(old_obj, new_obj)
        if isinstance(after, str):
            yield Finding("changed-signature", use.unit.topic, where,
                          f"{site}: the call no longer binds ({after}); {change}{breakages}")
            return
        moved = [f"{slot} binds to `{before[slot]}` in {self.old.version} but to `{after[slot]}` "
                 f"in {self.new.version}" for slot in before if after.get(slot) != before[slot]]
        if moved:
            yield Finding("changed-signature", use.unit.topic, where,
                          f"{site}: " + "; ".join(moved) + f"; {change}: pass it by keyword{breakages}")

    def check_overrides(self, unit: CodeUnit) -> Iterator[Finding]:
        scope = Scope(unit)
        for node in ast.walk(unit.tree):
            if not isinstance(node, ast.ClassDef) or not unit.counts(node):
                continue
            bases = [b for b in (scope.dotted(base, {}) for base in node.bases) if b and self.is_upstream(b)]
            for method in node.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or method.name.startswith("__"):
                    continue
                for base in bases:
                    finding = self.check_override(unit, node.name, method, f"{base}.{method.name}")
                    if finding:
                        yield finding
                        break

    def check_override(self, unit: CodeUnit, cls: str, method: ast.FunctionDef,
                       base_method: str) -> Finding | None:
        old_sig = signature(self.old.lookup(base_method))
        new_sig = signature(self.new.lookup(base_method))
        if new_sig is None or old_sig == new_sig:
            return None
        mine = _ast_signature(method)
        problems = override_problems(mine, new_sig)
        if not problems:
            return None
        return Finding("override", unit.topic, f"{unit.path}::{cls}.{method.name}",
                       f"{unit.path}:{method.lineno}: {cls}.{method.name}{describe(mine)} overrides "
                       f"{base_method}, which is {describe(old_sig or ())} in {self.old.version} and "
                       f"{describe(new_sig)} in {self.new.version}: " + "; ".join(problems))

    def check_enums(self, unit: CodeUnit) -> Iterator[Finding]:
        for node in ast.walk(unit.tree):
            if not isinstance(node, ast.ClassDef) or not _looks_like_enum(node):
                continue
            qual = f"{unit.module}.{node.name}"
            upstream = self.new.lookup(qual)
            if upstream is None or upstream.is_alias or not upstream.is_class:
                continue
            values: dict[Any, list[str]] = {}
            for name, member in upstream.members.items():
                value = _literal(member.value) if member.is_attribute else None
                if value is not None:
                    values.setdefault(value, []).append(name)
            for stmt in node.body:
                if not (isinstance(stmt, ast.Assign) and unit.counts(stmt) and len(stmt.targets) == 1
                        and isinstance(stmt.targets[0], ast.Name)):
                    continue
                value = _literal_node(stmt.value)
                name = stmt.targets[0].id
                clash = [n for n in values.get(value, []) if n != name] if value is not None else []
                if clash:
                    yield Finding("enum-collision", unit.topic, f"{unit.path}::{node.name}.{name}",
                                  f"{unit.path}:{stmt.lineno}: fork member {node.name}.{name} = {value!r} "
                                  f"meets {self.new.version}'s {', '.join(f'{c} = {value!r}' for c in clash)}; "
                                  f"an enum makes equal values one member, so {name} would silently "
                                  "become an alias: pick a value upstream does not use")

    def check_drift(self, unit: CodeUnit) -> Iterator[Finding]:
        if unit.lines is None:
            return
        old_file = self.old.module_file(unit.module)
        new_file = self.new.module_file(unit.module)
        if old_file is None:
            return  # a file the series adds
        try:
            old_tree = _parse(old_file, f"{self.old.version}:{unit.path}")
            new_tree = _parse(new_file, f"{self.new.version}:{unit.path}") if new_file else None
        except Unparsable as e:
            yield e.finding(unit.topic)
            return
        seen: set[str] = set()
        for hunk in unit.hunks:
            anchor = _enclosing(unit.tree, hunk.span)
            if anchor is None or anchor in seen:
                continue
            seen.add(anchor)
            old_node = _find_def(old_tree, anchor) if old_tree else None
            if old_node is None:
                continue  # a definition the series itself adds
            if isinstance(old_node, ast.ClassDef) and _looks_like_enum(old_node):
                continue  # members the series adds to an enum are the enum check's
            new_node = _find_def(new_tree, anchor) if new_tree else None
            where = f"{unit.path}::{anchor}"
            if new_node is None:
                yield self.vanished(unit.topic, where, f"{unit.module}.{anchor}",
                                    f"{unit.path}:{hunk.span[0]} (the topic patches it)")
                continue
            before, after = _body_text(old_node), _body_text(new_node)
            if before == after:
                continue
            diff = [l for l in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
                    if l[:1] in "+-" and not l.startswith(("+++", "---"))]
            added = _added_text(unit, hunk_lines(unit, anchor))
            absorbed = bool(added) and all(line in after for line in added)
            note = (" Every line the topic adds there is already in the new body: retire?"
                    if absorbed else " Check the topic's hunk still means the same there.")
            shown = "; ".join(_clip(l.strip()) for l in diff[:6]) + (" ..." if len(diff) > 6 else "")
            yield Finding("body-drift", unit.topic, where,
                          f"{unit.path}:{hunk.span[0]}: {anchor} changed between {self.old.version} and "
                          f"{self.new.version} ({len(diff)} line(s): {shown}).{note}")


def _clip(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def hunk_lines(unit: CodeUnit, anchor: str) -> list[int]:
    node = _find_def(unit.tree, anchor)
    if node is None or unit.lines is None:
        return []
    return sorted(n for n in unit.lines if node.lineno <= n <= node.end_lineno)


def _added_text(unit: CodeUnit, numbers: list[int]) -> list[str]:
    lines = unit.source.splitlines()
    return [lines[n - 1].strip() for n in numbers if 0 < n <= len(lines) and lines[n - 1].strip()]


def _breakages(old_obj, new_obj) -> str:
    """griffe's own account of the breaking part of a change, when it has one."""
    import griffe

    try:
        found = [b.explain(style=griffe.ExplanationStyle.ONE_LINE) for b in griffe.find_breaking_changes(old_obj, new_obj)]
    except Exception:  # griffe cannot compare every pair of objects (aliases it cannot resolve)
        return ""
    return (" (griffe: " + "; ".join(found) + ")") if found else ""


def _ast_signature(func: ast.FunctionDef) -> tuple[Param, ...]:
    a = func.args
    params: list[Param] = []
    positional = [*a.posonlyargs, *a.args]
    defaults_from = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        kind = "positional-only" if i < len(a.posonlyargs) else "positional or keyword"
        params.append(Param(arg.arg, kind, i < defaults_from))
    if a.vararg:
        params.append(Param(a.vararg.arg, "variadic positional", False))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(Param(arg.arg, "keyword-only", default is None))
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "variadic keyword", False))
    is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in func.decorator_list)
    return tuple(params if is_static else params[1:])


def override_problems(mine: tuple[Param, ...], base: tuple[Param, ...]) -> list[str]:
    """Why a call written against ``base`` would fail or misbind on ``mine``."""
    problems = []
    my_names = {p.name: p for p in mine}
    takes_kwargs = any(p.kind == "variadic keyword" for p in mine)
    takes_args = any(p.kind == "variadic positional" for p in mine)
    my_positional = [p.name for p in mine if p.kind in ("positional-only", "positional or keyword")]
    base_positional = [p.name for p in base if p.kind in ("positional-only", "positional or keyword")]
    for index, name in enumerate(base_positional):
        if index < len(my_positional) and my_positional[index] != name and name not in my_names:
            problems.append(f"its parameter #{index + 1} is `{my_positional[index]}` where the base has `{name}`")
        elif index >= len(my_positional) and not takes_args and name not in my_names:
            problems.append(f"it lacks `{name}`")
    for p in base:
        if p.kind == "keyword-only" and p.name not in my_names and not takes_kwargs:
            problems.append(f"it lacks keyword `{p.name}`")
    base_names = {p.name for p in base}
    for p in mine:
        if p.required and p.kind not in ("variadic positional", "variadic keyword") and p.name not in base_names:
            problems.append(f"it requires `{p.name}`, which callers of the base do not pass")
    return problems


def _looks_like_enum(node: ast.ClassDef) -> bool:
    for base in node.bases:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        if name in _ENUM_BASES:
            return True
    return False


def _literal(text) -> Any:
    if text is None:
        return None
    try:
        return ast.literal_eval(str(text))
    except (ValueError, SyntaxError):
        return None


def _literal_node(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _enclosing(tree: ast.Module, span: tuple[int, int]) -> str | None:
    """Qualified name of the innermost def or class holding the whole span."""
    best: str | None = None

    def visit(nodes, prefix: str) -> None:
        nonlocal best
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if start <= span[0] and span[1] <= node.end_lineno:
                    best = prefix + node.name
                    visit(node.body, best + ".")

    visit(tree.body, "")
    return best


def _find_def(tree: ast.Module | None, qualname: str):
    nodes = tree.body if tree else []
    found = None
    for part in qualname.split("."):
        found = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and n.name == part), None)
        if found is None:
            return None
        nodes = found.body
    return found


def _body_text(node) -> str:
    """A def's code without formatting; for a class, its statements other than methods."""
    if isinstance(node, ast.ClassDef):
        body = [n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    else:
        body = node.body
    return "\n".join(ast.unparse(n) for n in body)


# --- the whole run --------------------------------------------------------


def series_units(pristine: Path, series: Series, work: Path,
                 unparsed: list[Finding]) -> list[CodeUnit]:
    """Apply the series to a copy of ``pristine`` topic by topic; keep each topic's added code.
    Files that do not parse go to ``unparsed``."""
    tree = work / "tree"
    # Topics may only touch vllm/ (the wheel rule), so only that folder is copied.
    shutil.copytree(pristine / "vllm", tree / "vllm", symlinks=True)
    units: list[CodeUnit] = []
    for topic in series.topics:
        apply_topic(tree, topic)
        by_file: dict[str, list[Hunk]] = {}
        for hunk in topic_hunks(topic):
            by_file.setdefault(hunk.path, []).append(hunk)
        for path, hunks in by_file.items():
            if not path.endswith(".py"):
                continue
            text = (tree / path).read_text()
            try:
                parsed = _parse(tree / path, path)
            except Unparsable as e:
                unparsed.append(e.finding(topic.name))
                continue
            lines = {n for h in hunks for n in h.added}
            units.append(CodeUnit(topic.name, path, _module_name(path), parsed, text, lines, hunks))
    return units


def overlay_units(overlays: list[tuple[Path, str]], series: Series,
                  unparsed: list[Finding]) -> list[CodeUnit]:
    """Every overlay module, named after the topic whose added lines import it; files
    that do not parse go to ``unparsed``."""
    units = []
    for folder, package in overlays:
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(folder).as_posix()
            module = _module_name(f"{package.replace('.', '/')}/{rel}")
            label = f"{folder.name}/{rel}"
            topic = next((t.name for t in series.topics if _mentions(t, module)), OVERLAY_TOPIC)
            try:
                parsed = _parse(path, label)
            except Unparsable as e:
                unparsed.append(e.finding(topic))
                continue
            units.append(CodeUnit(topic, label, module, parsed, path.read_text(), None))
    return units


def _mentions(topic: Topic, module: str) -> bool:
    pattern = re.compile(rf"^\+.*\b{re.escape(module)}\b", re.M)
    return bool(pattern.search(topic.diff))


def port_check(old_root: Path, old_version: str, new_root: Path, new_version: str,
               series: Series, overlays: list[tuple[Path, str]]) -> list[Finding]:
    """All findings for moving ``series`` (+ overlays) from the old tree to the new one."""
    with tempfile.TemporaryDirectory(prefix="kiln-port-check-") as tmp:
        unparsed: list[Finding] = []
        units = series_units(old_root, series, Path(tmp), unparsed)
        patched = ApiModel(Path(tmp) / "tree", f"{old_version}+series")
        overlay = overlay_units(overlays, series, unparsed)
        check = PortCheck(ApiModel(old_root, old_version), ApiModel(new_root, new_version), patched,
                          {u.module for u in overlay})
        findings: set[Finding] = set(unparsed)
        for unit in [*units, *overlay]:
            for use in uses(unit):
                findings.update(check.check_use(use))
            findings.update(check.check_overrides(unit))
            findings.update(check.check_enums(unit))
            findings.update(check.check_drift(unit))
        for model in (check.old, check.new, patched):
            findings.update(e.finding(UPSTREAM_TOPIC) for e in model.unparsed)
    first: dict[tuple[str, str, str], Finding] = {}
    for finding in sorted(findings, key=lambda f: (KINDS.index(f.kind), f.topic, f.where, _site_line(f))):
        first.setdefault(finding.key(), finding)  # one finding per name and place: its first use
    return list(first.values())


def _site_line(finding: Finding) -> int:
    m = re.match(r"[^:]+:(\d+)", finding.detail)
    return int(m.group(1)) if m else 0


# --- accepted findings ----------------------------------------------------


@dataclass(frozen=True)
class Acceptance:
    kind: str
    topic: str
    where: str
    reason: str
    to: str | None

    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.topic, self.where)


def load_acceptances(path: Path, to_version: str) -> list[Acceptance]:
    """The file's ``[[accept]]`` entries that apply when porting to ``to_version``."""
    data = read_toml(path, "no such accept file; create it or leave --accept out")
    entries = []
    for number, entry in enumerate(data.get("accept", []), start=1):
        missing = [k for k in ("kind", "topic", "where", "reason") if not str(entry.get(k, "")).strip()]
        if missing:
            raise KilnError(f"{path}: accept entry #{number} lacks {', '.join(missing)}; each entry "
                            "needs kind, topic, where and a non-empty reason (optional: to)")
        if entry["kind"] not in KINDS:
            raise KilnError(f"{path}: accept entry #{number} has kind {entry['kind']!r}; "
                            f"allowed: {', '.join(KINDS)}")
        unknown = sorted(set(entry) - {"kind", "topic", "where", "reason", "to"})
        if unknown:
            raise KilnError(f"{path}: accept entry #{number} has unknown key(s) {', '.join(unknown)}; "
                            "allowed: kind, topic, where, reason, to")
        acceptance = Acceptance(entry["kind"], entry["topic"], entry["where"], entry["reason"], entry.get("to"))
        if acceptance.to in (None, to_version):
            entries.append(acceptance)
    return entries


@dataclass
class Verdict:
    open: list[Finding]
    accepted: list[tuple[Finding, Acceptance]]
    stale: list[Acceptance]


def judge(findings: list[Finding], acceptances: list[Acceptance]) -> Verdict:
    by_key = {a.key(): a for a in acceptances}
    accepted = [(f, by_key[f.key()]) for f in findings if f.key() in by_key]
    open_ = [f for f in findings if f.key() not in by_key]
    found = {f.key() for f in findings}
    stale = [a for a in acceptances if a.key() not in found]
    return Verdict(open_, accepted, stale)

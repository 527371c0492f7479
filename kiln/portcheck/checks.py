"""The checks: removed, moved or deprecated names, reads that now fall back to a default,
reads matched by name, changed signatures, overrides, enum collisions, mirrors, body drift."""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kiln.portcheck.apimodel import ApiModel
from kiln.portcheck.deprecation import deprecation
from kiln.portcheck.findings import Finding, Unparsable, parse_source
from kiln.portcheck.mirrors import mirrors_in
from kiln.portcheck.signatures import ast_signature, bind, describe, override_problems, signature, with_series_params
from kiln.portcheck.units import CodeUnit
from kiln.portcheck.uses import CALLED, GETATTR, GETATTR_DEFAULT, HASATTR, READ, SILENT, WRITTEN, Read, Scope, Use

_ENUM_BASES = ("Enum", "IntEnum", "IntFlag", "Flag", "StrEnum")
# What the code does with an attribute that is gone, by how it uses it.
_GONE = {READ: "reading it raises AttributeError", CALLED: "calling it raises AttributeError",
         GETATTR: "getattr() raises AttributeError",
         WRITTEN: "the assignment sets an attribute nothing reads any more",
         GETATTR_DEFAULT: "getattr() silently returns its default instead",
         HASATTR: "hasattr() is now always False, silently"}


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
        site = f"{use.unit.path}:{use.line}"
        old_obj = self.old.lookup(use.qualname)
        if old_obj is None:
            receiver, _, name = use.qualname.rpartition(".")
            if receiver and not _is_namespace(self.old.lookup(receiver)):
                # An upstream value whose type this view cannot tell: match the name.
                yield from self.check_read(Read(use.unit, name, use.line, use.how))
            return  # otherwise the series' own name, or one this static view cannot see
        new_obj = self.new.lookup(use.qualname)
        if new_obj is None:
            gone = self.vanished(use.unit.topic, where, use.qualname, site)
            if use.how in SILENT:
                yield Finding("silent-default", use.unit.topic, where,
                              f"{gone.detail}; it is {use.how} here, so {_GONE[use.how]}")
            else:
                yield gone
            return
        news = deprecation(new_obj)
        if news is not None and deprecation(old_obj) is None:
            yield Finding("deprecated", use.unit.topic, where,
                          f"{site}: {use.qualname}, {use.how} here, is deprecated in {self.new.version} "
                          f"and was not in {self.old.version} ({news}): find what replaces it")
        if use.call is not None:
            yield from self.check_call(use, old_obj, new_obj, where)

    def check_read(self, read: Read) -> Iterator[Finding]:
        """A read on a value of unknown type, matched by name: upstream defined the name
        (on a class or a module) in the old pin and defines it nowhere in the new one."""
        name = read.name
        if name.startswith("__"):
            return
        old_homes = sorted({*self.old.index.member_homes(name), *self.old.index.top_level_homes(name)})
        if not old_homes or name in self.new.index.members or name in self.new.index.top_level:
            return
        shown = ", ".join(old_homes[:3]) + (f" and {len(old_homes) - 3} more" if len(old_homes) > 3 else "")
        yield Finding("name-match", read.unit.topic, f"{read.unit.path}::*.{name}",
                      f"{read.unit.path}:{read.line}: `.{name}` is {read.how} here on a value whose "
                      f"type port-check cannot tell; {self.old.version} defines {name} in {shown}, "
                      f"{self.new.version} nowhere: if the value is upstream's, "
                      f"{_GONE.get(read.how, _GONE[READ])} (annotate the value's type for an exact check)")

    def check_mirrors(self, unit: CodeUnit) -> Iterator[Finding]:
        """Each ``# mirrors:`` marker whose upstream definition changed between the pins."""
        for mirror in mirrors_in(unit):
            target, site = mirror.target, f"{unit.path}:{mirror.line}"
            where = f"{unit.path}::{target}"
            upstream = target.startswith(("vllm.", "csrc/"))
            before = self.old.definition_text(target) if upstream else None
            after = self.new.definition_text(target) if upstream else None
            if before is None:
                also = f" ({self.new.version} does: is the code written for that pin?)" if after else ""
                yield Finding("mirror-drift", unit.topic, where,
                              f"{site}: the marker names {target}, which {self.old.version} does not "
                              f"define{also}; a marker names an upstream function, class, method or "
                              "constant by its dotted path")
                continue
            if after is None:
                gone = self.vanished(unit.topic, where, target, site)
                yield Finding("mirror-drift", unit.topic, where,
                              f"{gone.detail}. The fork mirrors it here: find where the formula went "
                              "and re-derive it")
            elif after != before:
                count, shown = _diff_summary(before, after)
                yield Finding("mirror-drift", unit.topic, where,
                              f"{site}: mirrors {target}, which changed between {self.old.version} and "
                              f"{self.new.version} ({count} line(s): {shown}): re-derive what this "
                              "module computes from it")

    def vanished(self, topic: str, where: str, qualname: str, site: str) -> Finding:
        module, _, name = qualname.rpartition(".")
        old_parent = self.old.lookup(module)
        in_module = old_parent is not None and not old_parent.is_alias and old_parent.is_module
        homes = [m for m in (self.new.defined_in(name) if in_module else [])
                 if m != module and self.new.lookup(f"{m}.{name}")]
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
            bases = [b for b in scope.bases(node, {}) if self.is_upstream(b)]
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
        mine = ast_signature(method)
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
            old_tree = parse_source(old_file, f"{self.old.version}:{unit.path}")
            new_tree = parse_source(new_file, f"{self.new.version}:{unit.path}") if new_file else None
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
            count, shown = _diff_summary(before, after)
            added = _added_text(unit, hunk_lines(unit, anchor))
            absorbed = bool(added) and all(line in after for line in added)
            note = (" Every line the topic adds there is already in the new body: retire?"
                    if absorbed else " Check the topic's hunk still means the same there.")
            yield Finding("body-drift", unit.topic, where,
                          f"{unit.path}:{hunk.span[0]}: {anchor} changed between {self.old.version} and "
                          f"{self.new.version} ({count} line(s): {shown}).{note}")


def _diff_summary(before: str, after: str) -> tuple[int, str]:
    """How many lines differ, and the first few of them."""
    diff = [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    shown = "; ".join(_clip(line.strip()) for line in diff[:6])
    return len(diff), shown + (" ..." if len(diff) > 6 else "")


def _is_namespace(obj) -> bool:
    """A module or class of the tree, or a name from outside it: what a dotted path
    below it means is known (or not upstream's to check)."""
    return obj is not None and (obj.is_alias or obj.is_module or obj.is_class)


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
        found = [b.explain(style=griffe.ExplanationStyle.ONE_LINE)
                 for b in griffe.find_breaking_changes(old_obj, new_obj)]
    except Exception:  # griffe cannot compare every pair of objects (aliases it cannot resolve)
        return ""
    return (" (griffe: " + "; ".join(found) + ")") if found else ""


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

"""An upstream source tree's API, read statically through griffe."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Any

from kiln.portcheck.csource import function_text
from kiln.portcheck.findings import Unparsable
from kiln.portcheck.treeindex import TreeIndex, tree_index

# Annotations that wrap the type of the value: ``Optional[X]``, ``SkipValidation[X]``, ...
_WRAPPERS = {"Optional", "Annotated", "ClassVar", "Final", "InitVar", "SkipValidation",
             "Required", "NotRequired", "ReadOnly"}


class ApiModel:
    """One source tree seen through griffe, a module at a time, on demand."""

    def __init__(self, root: Path, version: str, index_cache: Path | None = None):
        self.root = root
        self.version = version
        self.index_cache = index_cache  # where the tree's name index is kept; None: not kept
        self._modules: dict[str, Any] = {}
        self._index: TreeIndex | None = None
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
            package, _, leaf = name.rpartition(".")
            try:
                # Visited inside its package, so that relative imports resolve from there.
                self._modules[name] = None if path is None else griffe.visit(
                    leaf, path, path.read_text(), parent=_package(package) if package else None)
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

    @property
    def index(self) -> TreeIndex:
        """Where each name is defined in this tree (read once, kept in ``index_cache``)."""
        if self._index is None:
            self._index = tree_index(self.root / self.root_package, self.index_cache)
        return self._index

    def defined_in(self, name: str) -> list[str]:
        """Modules of this tree that define ``name`` at their top level."""
        return self.index.top_level_homes(name)

    def value_type(self, qualname: str) -> str | None:
        """The class (its path here) of the value ``qualname`` names: an attribute's
        annotated type, or for ``f()`` what ``f`` returns (a class: an instance of it).
        None where this static view cannot tell."""
        call = qualname.endswith("()")
        obj = self.lookup(qualname[:-2] if call else qualname)
        if obj is None or obj.is_alias:
            return None
        if call:
            if obj.is_class:
                return obj.path
            return self._annotation_class(obj.returns) if obj.is_function else None
        return self._annotation_class(obj.annotation) if obj.is_attribute else None

    def param_type(self, function: str, name: str) -> str | None:
        """The class a parameter of ``function`` is annotated with, if it names one here."""
        obj = self.lookup(function)
        if obj is None or obj.is_alias or not obj.is_function:
            return None
        param = next((p for p in obj.parameters if p.name == name), None)
        return self._annotation_class(param.annotation) if param is not None else None

    def _annotation_class(self, expr, depth: int = 0) -> str | None:
        import griffe

        if expr is None or isinstance(expr, str) or depth > 4:
            return None
        if isinstance(expr, griffe.ExprBinOp) and expr.operator == "|":
            sides = [s for s in (expr.left, expr.right) if str(s) != "None"]
            return self._annotation_class(sides[0], depth + 1) if len(sides) == 1 else None
        if isinstance(expr, griffe.ExprSubscript):
            wrapper = str(expr.left).rpartition(".")[2]
            inner = expr.slice.elements if isinstance(expr.slice, griffe.ExprTuple) else [expr.slice]
            if wrapper == "Union":
                inner = [e for e in inner if str(e) != "None"]
                return self._annotation_class(inner[0], depth + 1) if len(inner) == 1 else None
            return self._annotation_class(inner[0], depth + 1) if wrapper in _WRAPPERS else None
        if isinstance(expr, (griffe.ExprName, griffe.ExprAttribute)):
            obj = self.lookup(expr.canonical_path, depth + 1)
            if obj is not None and not obj.is_alias and obj.is_class:
                return obj.path
        return None

    def definition_text(self, qualname: str) -> str | None:
        """The code of the function, class or constant ``qualname`` names, decorators
        included and docstrings and comments left out, so only a change of what it
        computes changes the text. None when this tree does not define it.
        ``csrc/<file>::<function>`` names a C++ function of the tree's compiled sources
        (kiln.portcheck.csource)."""
        if "::" in qualname:
            return function_text(self.root, qualname)
        obj = self.lookup(qualname)
        if obj is None or obj.is_alias or obj.lineno is None or obj.is_module:
            return None
        lines = Path(obj.filepath).read_text().splitlines()
        start = obj.lineno
        while start > 1 and lines[start - 2].lstrip().startswith("@"):
            start -= 1
        source = textwrap.dedent("\n".join(lines[start - 1: obj.endlineno or obj.lineno]))
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return source
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        return ast.unparse(tree)


def _package(dotted: str):
    """Empty griffe modules for a package and its parents: where a module sits."""
    import griffe

    parent = None
    for part in dotted.split("."):
        parent = griffe.Module(part, parent=parent)
    return parent


def _expr_path(expr) -> str:
    """The dotted path a griffe expression (a base class, say) names."""
    try:
        return expr.canonical_path
    except AttributeError:
        return str(expr)

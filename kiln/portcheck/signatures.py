"""Parameters of upstream and fork functions, and how a call binds to them."""

from __future__ import annotations

import ast
from dataclasses import dataclass


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


def ast_signature(func: ast.FunctionDef) -> tuple[Param, ...]:
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

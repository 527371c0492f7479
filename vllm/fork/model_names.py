"""Accept a served model's path, or the last part of it, as its name.

Clients configured with the path they passed to `vllm serve` (or with the
folder name, as many UIs derive it) get a 404 upstream whenever
--served-model-name renamed the model. A request naming the model by path or
basename means that model; anything else still gets the 404.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol


class _ServedModel(Protocol):
    name: str
    model_path: str


def _path_forms(path: str) -> set[str]:
    """A path as given, without trailing separators, normalised, and its basename."""
    trimmed = path.rstrip("/\\") or path
    forms = {path, trimmed, os.path.normpath(trimmed)}
    base = os.path.basename(trimmed)
    if base:
        forms.add(base)
    return forms


def matches_served_model(model_name: str, served: Iterable[_ServedModel]) -> bool:
    """True when `model_name` is a served name, a model path, or its basename."""
    requested = model_name.rstrip("/\\") or model_name
    return any(
        model_name == model.name
        or requested in _path_forms(model.model_path)
        or os.path.normpath(requested) in _path_forms(model.model_path)
        for model in served
    )

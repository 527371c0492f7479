"""A built folder: the files a build writes and its stamp (``StampedFolder``), the spec
read back from the stamp, the library versions a fingerprint hashes, and a digest of a
whole tree that tests compare builds by.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, naming
from kiln.testing.tinymodel.spec import TinySpec, spec_from_dict
from kiln.testing.tinymodel.stampedfolder import StampedFolder

STAMP = "kiln-tiny-model.json"
# Every file a build writes: a rebuild replaces a folder holding these and nothing else.
MODEL_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
    "tokenizer.json", "tokenizer_config.json", STAMP,
})
NEEDS = ("torch", "transformers", "tokenizers")


def library_versions() -> dict[str, str]:
    # Weight init and file formats may change between releases of these.
    found = {}
    for name in NEEDS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def write_json(path: Path, data: dict[str, Any]) -> None:
    with naming(path):
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def model_folder(out: Path) -> StampedFolder:
    return StampedFolder(out, STAMP, MODEL_FILES, "tiny model")


def read_spec(folder: Path) -> TinySpec:
    """The spec a built folder was made from (its stamp)."""
    record = model_folder(Path(folder)).record()
    if record is None:
        raise KilnError(f"{folder} is not a kiln tiny model folder (no {STAMP})")
    return spec_from_dict(record["spec"])


def tree_digest(folder: Path) -> str:
    """sha256 over every file's relative name and bytes: equal trees, equal digest."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()

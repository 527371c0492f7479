"""Where a source tree defines each name, read with regular expressions (no parse).

A full parse of vLLM (3,000+ modules, 49 MB) takes half a minute or more on two cores;
these patterns read it in a few seconds, and a pristine tree never changes, so the
index is kept in a cache file named after the tree and this module's own code.

- ``top_level``: names a module defines at column 0 (def, class, assignment);
- ``members``: names defined indented (methods, properties, class fields and enum
  members, but also a function's locals) or assigned as ``self.<name>``. It errs on
  the side of "defined": a name it misses nowhere is a name nothing defines.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kiln.atomic import replacing

_TOP_LEVEL = re.compile(r"^(?:async\s+def|def|class)\s+(\w+)|^(\w+)\s*(?::[^=\n]*)?=(?!=)", re.M)
# Indented ``def``/``class``, or a name followed by ``:`` or ``=`` (a field, an enum
# member, a local, a keyword argument on its own line): generous on purpose.
_INDENTED = re.compile(r"^[ \t]+(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)|^[ \t]+(\w+)[ \t]*[:=](?!=)", re.M)
_SELF = re.compile(r"\bself\.(\w+)[ \t]*(?::[^=\n]*)?=(?!=)")


@dataclass(frozen=True)
class TreeIndex:
    modules: list[str]
    top_level: dict[str, list[int]]  # name -> indexes into ``modules``
    members: dict[str, list[int]]

    def top_level_homes(self, name: str) -> list[str]:
        """Modules that define ``name`` at their top level."""
        return [self.modules[i] for i in self.top_level.get(name, ())]

    def member_homes(self, name: str) -> list[str]:
        """Modules that define ``name`` indented or as ``self.<name>``."""
        return [self.modules[i] for i in self.members.get(name, ())]

    def to_json(self) -> dict:
        return {"modules": self.modules, "top_level": self.top_level, "members": self.members}


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def build_index(package: Path) -> TreeIndex:
    modules: list[str] = []
    top: dict[str, list[int]] = {}
    members: dict[str, list[int]] = {}
    for path in sorted(package.rglob("*.py")):
        index = len(modules)
        modules.append(module_name(path.relative_to(package.parent).as_posix()))
        text = path.read_text(errors="replace")
        for names, pattern in ((top, _TOP_LEVEL), (members, _INDENTED), (members, _SELF)):
            for m in pattern.finditer(text):
                homes = names.setdefault(next(g for g in m.groups() if g), [])
                if not homes or homes[-1] != index:
                    homes.append(index)
    return TreeIndex(modules, top, {k: sorted(set(v)) for k, v in members.items()})


def tree_index(package: Path, cache: Path | None) -> TreeIndex:
    """The index of ``package`` (a tree's ``vllm/``); kept in ``cache`` when one is given,
    for trees that never change (the pristine trees under kiln's cache)."""
    if cache is None:
        return build_index(package)
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    path = cache / f"{package.parent.name}-{package.name}-{code}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return TreeIndex(data["modules"], data["top_level"], data["members"])
    index = build_index(package)
    cache.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(index.to_json()))
    return index

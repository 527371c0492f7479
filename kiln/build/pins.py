"""requirements/fork-pins.txt: how the fork's Requires-Dist differs from upstream's.

Each line is a PEP 508 requirement that replaces every non-extra Requires-Dist
line of the same project (or is added when upstream has none), or ``-name`` to
drop that project. Blank lines and ``#`` comments are ignored. Lines under a
``[X.Y.Z]`` header apply only to the wheel built on that upstream pin (a pin change
answers one release's requirements); lines before any header apply to every pin.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_SECTION = re.compile(r"^\[(\d+(?:\.\d+)*)\]$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    m = _NAME.match(requirement)
    if not m:
        raise KilnError(f"{requirement!r} is not a requirement (expected 'name<spec>[; marker]')")
    return canonical(m.group(1))


@dataclass(frozen=True)
class PinChanges:
    replace: dict[str, str] = field(default_factory=dict)  # canonical name -> requirement
    drop: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str, source: str = "fork-pins.txt",
              version: str | None = None) -> PinChanges:
        """The changes for a wheel built on upstream ``version``: the lines before any
        section, and those of its own ``[version]`` section."""
        replace: dict[str, str] = {}
        drop: set[str] = set()
        section: str | None = None
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("["):
                m = _SECTION.match(line)
                if not m:
                    raise KilnError(f"{source} line {number}: {line!r} is not a section "
                                    "header (expected '[X.Y.Z]', an upstream pin)")
                section = m.group(1)
                continue
            if section is not None and section != version:
                continue
            try:
                if line.startswith("-"):
                    drop.add(requirement_name(line[1:]))
                else:
                    replace[requirement_name(line)] = line
            except KilnError as e:
                raise KilnError(f"{source} line {number}: {e}") from None
        both = sorted(drop & set(replace))
        if both:
            raise KilnError(f"{source}: {', '.join(both)} both dropped and replaced")
        return cls(replace=replace, drop=frozenset(drop))

    @classmethod
    def load(cls, path: Path, version: str | None = None) -> PinChanges:
        return cls.parse(path.read_text(), path.name, version) if path.exists() else cls()

    def apply_to_metadata(self, metadata: str) -> str:
        head, sep, body = metadata.partition("\n\n")
        lines, done = [], set()
        for line in head.split("\n"):
            if line.startswith("Requires-Dist: ") and "extra ==" not in line:
                name = requirement_name(line[len("Requires-Dist: "):])
                if name in self.drop:
                    continue
                if name in self.replace:
                    if name not in done:
                        lines.append(f"Requires-Dist: {self.replace[name]}")
                        done.add(name)
                    continue
            lines.append(line)
        extra = [f"Requires-Dist: {req}" for n, req in self.replace.items() if n not in done]
        if extra:
            last = max((i for i, l in enumerate(lines) if l.startswith("Requires-Dist: ")), default=len(lines) - 1)
            lines[last + 1:last + 1] = extra
        return "\n".join(lines) + sep + body

"""What port-check reports: findings, their kinds, and files it cannot read."""

from __future__ import annotations

import ast
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("unparsed", "removed-name", "silent-default", "deprecated", "name-match", "changed-signature",
         "override", "enum-collision", "mirror-drift", "body-drift", "moved")


OVERLAY_TOPIC = "(overlay)"


UPSTREAM_TOPIC = "(upstream)"  # findings about an upstream file itself, not a topic's use of it


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


class Unparsable(Exception):
    """A file port-check cannot read; it becomes an ``unparsed`` finding, never a skip."""

    def __init__(self, label: str, error: Exception):
        super().__init__(f"{label}: {type(error).__name__}: {error}")
        self.label = label

    def finding(self, topic: str) -> Finding:
        return Finding("unparsed", topic, self.label,
                       f"{self}; port-check cannot see this file's uses, overrides or drift "
                       f"(it parses with Python {sys.version_info.major}.{sys.version_info.minor})")


def parse_source(path: Path, label: str) -> ast.Module:
    try:
        return ast.parse(path.read_text(), filename=label)
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise Unparsable(label, e) from None

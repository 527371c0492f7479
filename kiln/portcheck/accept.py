"""Accepted findings: the reviewed list a port carries, and the verdict against it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.portcheck.findings import KINDS, Finding
from kiln.tomlfile import read_toml


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

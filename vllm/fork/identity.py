"""What ran: the fork version and the topics carried, for --version and the start-up log."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

MANIFEST = "manifest.json"  # written into the wheel by `kiln build`


@dataclass(frozen=True)
class ForkIdentity:
    fork_version: str
    upstream_version: str
    topics: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"{self.fork_version} (kiln fork of vLLM {self.upstream_version}, "
            f"{len(self.topics)} topics)"
        )


@cache
def fork_identity() -> ForkIdentity:
    manifest = json.loads(resources.files(__package__).joinpath(MANIFEST).read_text())
    return ForkIdentity(
        fork_version=manifest["fork_version"],
        upstream_version=manifest["upstream_version"],
        topics=tuple(manifest["topics"]),
    )


def describe_fork() -> str:
    return fork_identity().describe()

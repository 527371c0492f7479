"""requirements/upstream.lock: which pristine files a version means, by sha256."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.paths import REPO_ROOT
from kiln.tomlfile import read_toml

LOCK_PATH = REPO_ROOT / "requirements" / "upstream.lock"


def version_key(version: str) -> tuple[int, ...]:
    """Sort key of an upstream version: 0.9.0 before 0.10.0; a non-numeric part counts 0."""
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+-]", version))


@dataclass(frozen=True)
class PinnedFile:
    name: str
    sha256: str

    @classmethod
    def from_table(cls, table: dict, key: str) -> PinnedFile:
        """The file a lock names under ``key``, pinned by its ``<key>_sha256`` entry."""
        return cls(table[key], table[f"{key}_sha256"])


@dataclass(frozen=True)
class UpstreamRelease:
    version: str
    wheel: PinnedFile
    sdist: PinnedFile


_TOML_TYPES = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
               (list, "an array"), (dict, "a table"))
_PINNED_KEYS = ("wheel", "wheel_sha256", "sdist", "sdist_sha256")


def _toml_type(value: object) -> str:
    return next((name for kind, name in _TOML_TYPES if isinstance(value, kind)), "a date or time")


def _expect(path: Path, key: str, value: object, kind: type, name: str) -> None:
    if not isinstance(value, kind):
        raise KilnError(f"{path}: {key} is {_toml_type(value)} ({value!r}); expected {name}")


def _check_types(path: Path, data: dict) -> None:
    """Refuse a value of the wrong type, naming its key and the type expected."""
    if "default" in data:
        _expect(path, "default", data["default"], str, "a string (a pinned version)")
    versions = data.get("versions", {})
    _expect(path, "versions", versions, dict, 'a table of [versions."X.Y.Z"] tables')
    for version, entry in versions.items():
        key = f'versions."{version}"'
        _expect(path, key, entry, dict, "a table (wheel, wheel_sha256, sdist, sdist_sha256)")
        for name in _PINNED_KEYS:
            if name in entry:
                _expect(path, f"{key}.{name}", entry[name], str, "a string")


@dataclass(frozen=True)
class UpstreamLock:
    default: str
    releases: dict[str, UpstreamRelease]
    path: Path = LOCK_PATH  # the file it was read from, named in messages

    @classmethod
    def load(cls, path: Path = LOCK_PATH) -> UpstreamLock:
        data = read_toml(path, "missing; it pins the pristine upstream files")
        _check_types(path, data)
        releases = {}
        for version, entry in data.get("versions", {}).items():
            try:
                releases[version] = UpstreamRelease(
                    version=version,
                    wheel=PinnedFile.from_table(entry, "wheel"),
                    sdist=PinnedFile.from_table(entry, "sdist"),
                )
            except KeyError as e:
                raise KilnError(
                    f"{path}: version {version} lacks {e.args[0]}; each version needs "
                    "wheel, wheel_sha256, sdist, sdist_sha256"
                ) from None
        default = data.get("default")
        if default not in releases:
            raise KilnError(f"{path}: default {default!r} is not one of the pinned versions")
        return cls(default=default, releases=releases, path=path)

    def release(self, version: str | None = None) -> UpstreamRelease:
        version = version or self.default
        if version not in self.releases:
            known = ", ".join(sorted(self.releases, key=version_key))
            raise KilnError(
                f"upstream version {version} has no pinned hashes in {self.path.name} "
                f"(pinned: {known}); pin it with `python -m kiln pin-bump --to {version}`"
            )
        return self.releases[version]

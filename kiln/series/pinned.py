"""A pin's pristine tree and the series cut against it: the setup that apply,
materialize, port-check and rebase share, read under one load of the lock."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.series.series import Series, series_dir
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pristine import PristineTree


@dataclass(frozen=True)
class PinnedSeries:
    pristine: PristineTree
    series: Series

    @property
    def version(self) -> str:
        return self.pristine.version

    @classmethod
    def load(cls, version: str | None = None, *, lock: UpstreamLock | None = None,
             patches: Path | None = None) -> PinnedSeries:
        """``version`` (None: the lock's default) with ``patches`` (default: its own
        ``patches/<version>/``). A version the lock does not pin and a series that does
        not load are refused before anything is fetched."""
        lock = lock or UpstreamLock.load()
        release = lock.release(version)
        series = Series.load(patches or series_dir(release.version, lock=lock))
        return cls(PristineTree.pinned(release.version, lock), series)

"""Fetch pristine upstream files from the package registry, checked against the lock.

The wheel comes through ``pip download``. pip cannot download an sdist without
building its metadata (which for vLLM needs a CUDA torch), so the sdist is read
from the registry's simple index (PEP 691 JSON), the same place pip reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError, naming
from kiln.paths import cache_dir
from kiln.upstream.lock import PinnedFile, UpstreamLock, UpstreamRelease

ATTEMPTS = 3
BACKOFF_SECONDS = 2.0
DEFAULT_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class PristineFiles:
    release: UpstreamRelease
    wheel: Path
    sdist: Path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def upstream_dir() -> Path:
    path = cache_dir() / "upstream"
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch(version: str | None = None, *, lock: UpstreamLock | None = None,
          log=print) -> PristineFiles:
    """Return the verified pristine wheel and sdist, downloading what the cache lacks."""
    lock = lock or UpstreamLock.load()
    release = lock.release(version)
    pinned_by = f"{lock.path} (vLLM {release.version})"
    wheel = fetch_pinned(release.wheel, lambda d: _pip_download_wheel(release, d), log, pinned_by)
    sdist = fetch_pinned(release.sdist, lambda d: download_from_index(release.sdist, d), log, pinned_by)
    return PristineFiles(release=release, wheel=wheel, sdist=sdist)


def fetch_pinned(pin: PinnedFile, download, log, pinned_by: str = "its lock file") -> Path:
    """The cached file with the pinned sha256, downloaded when the cache lacks it.

    A cached file with another hash is either damaged or the pin is wrong; one fresh
    download tells which. It replaces the cached file only when it has the pinned hash;
    when it has the cached file's hash, the pin is wrong and the file is kept.
    ``pinned_by`` names the lock entry in messages.
    """
    target = upstream_dir() / pin.name
    cached = sha256_of(target) if target.exists() else None
    if cached == pin.sha256:
        return target
    if cached is not None:
        log(f"{target}: sha256 {cached}, but {pinned_by} pins {pin.sha256}; "
            "downloading it again to tell a damaged file from a wrong pin")
    try:
        with _downloaded(pin, download, log) as got:
            fresh = sha256_of(got)
            if fresh == pin.sha256:
                os.replace(got, target)
                return target
    except KilnError as e:
        if cached is None:
            raise
        raise KilnError(
            f"{target} has sha256 {cached}, but {pinned_by} pins {pin.sha256}, and downloading "
            f"it again failed ({e}), so kiln cannot tell a damaged file from a wrong pin; the "
            "file was kept. Check the pin, or delete the file to download it afresh"
        ) from None
    if cached is None:
        raise KilnError(
            f"{pin.name}: sha256 mismatch: {pinned_by} pins {pin.sha256}, the package index "
            f"served {fresh}; the download was deleted and nothing was built"
        )
    if fresh == cached:
        raise KilnError(
            f"{pinned_by} pins {pin.name} with sha256 {pin.sha256}, but the package index "
            f"serves {fresh}, the sha256 of the cached {target} too: the pin is wrong, not the "
            "file, which was kept. Correct the pin (pin-bump writes it from the index)"
        )
    raise KilnError(
        f"{pin.name}: {pinned_by} pins sha256 {pin.sha256}, the cached {target} has {cached}, "
        f"the package index serves {fresh}; nothing was replaced or built"
    )


@contextlib.contextmanager
def _downloaded(pin: PinnedFile, download, log) -> Iterator[Path]:
    """The file ``download`` writes into a temporary folder of the cache, retried."""
    last_error = ""
    for attempt in range(1, ATTEMPTS + 1):
        log(f"downloading {pin.name} (attempt {attempt}/{ATTEMPTS})")
        with tempfile.TemporaryDirectory(dir=upstream_dir()) as tmp:
            try:
                got = download(Path(tmp))
            except (OSError, subprocess.CalledProcessError, urllib.error.URLError) as e:
                last_error = str(e)
                time.sleep(BACKOFF_SECONDS * attempt)
                continue
            yield got
            return
    raise KilnError(
        f"could not download {pin.name} after {ATTEMPTS} attempts: {last_error}; "
        "check the network or the package index (PIP_INDEX_URL)"
    )


def _pip_download_wheel(release: UpstreamRelease, dest: Path) -> Path:
    return pip_download(release.wheel, f"vllm=={release.version}", dest,
                        python_version="3.11", platforms=("manylinux_2_28_x86_64",))


def pip_download(pin: PinnedFile, requirement: str, dest: Path, *, python_version: str,
                 platforms: Sequence[str]) -> Path:
    """The binary wheel pip picks for ``requirement`` on that Python and those platforms.

    A wheel other than the pinned file name (pip chose other tags) is refused.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        *(arg for platform in platforms for arg in ("--platform", platform)),
        "--python-version", python_version, "--implementation", "cp", "-d", str(dest),
        requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(result.stderr.strip().splitlines()[-1] if result.stderr else "pip failed")
    path = dest / pin.name
    if not path.exists():
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise KilnError(f"pip downloaded {found}, not the pinned {pin.name}")
    return path


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def index_files(project: str, index: str | None = None) -> list[dict]:
    """The project's files as the registry's simple index lists them (PEP 691 JSON)."""
    request = urllib.request.Request(
        f"{index or index_url()}/{project}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["files"]


def download_from_index(pin: PinnedFile, dest: Path) -> Path:
    files = index_files(pin.name.split("-")[0])
    url = next((f["url"] for f in files if f["filename"] == pin.name), None)
    if url is None:
        raise KilnError(f"{pin.name} is not on the package index {index_url()}")
    path = dest / pin.name
    with urllib.request.urlopen(url, timeout=600) as response, naming(path), \
            path.open("wb") as out:
        shutil.copyfileobj(response, out, 1 << 20)
    return path

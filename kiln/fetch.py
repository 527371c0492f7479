"""Fetch pristine upstream files from the package registry, checked against the lock.

The wheel comes through ``pip download``. pip cannot download an sdist without
building its metadata (which for vLLM needs a CUDA torch), so the sdist is read
from the registry's simple index (PEP 691 JSON), the same place pip reads.
"""

from __future__ import annotations

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.lock import PinnedFile, UpstreamLock, UpstreamRelease
from kiln.paths import cache_dir

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


def check_pinned(path: Path, pin: PinnedFile) -> None:
    """Refuse a file whose hash is not the pinned one, and delete it."""
    actual = sha256_of(path)
    if actual != pin.sha256:
        path.unlink(missing_ok=True)
        raise KilnError(
            f"{pin.name}: sha256 mismatch (expected {pin.sha256}, got {actual}); "
            "the file was deleted and nothing was built"
        )


def upstream_dir() -> Path:
    path = cache_dir() / "upstream"
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch(version: str | None = None, *, lock: UpstreamLock | None = None,
          log=print) -> PristineFiles:
    """Return the verified pristine wheel and sdist, downloading what the cache lacks."""
    release = (lock or UpstreamLock.load()).release(version)
    wheel = fetch_pinned(release.wheel, lambda d: _pip_download_wheel(release, d), log)
    sdist = fetch_pinned(release.sdist, lambda d: download_from_index(release.sdist, d), log)
    return PristineFiles(release=release, wheel=wheel, sdist=sdist)


def fetch_pinned(pin: PinnedFile, download, log) -> Path:
    target = upstream_dir() / pin.name
    if target.exists():
        check_pinned(target, pin)
        return target
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
            check_pinned(got, pin)
            os.replace(got, target)
            return target
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
    with urllib.request.urlopen(url, timeout=600) as response, path.open("wb") as out:
        shutil.copyfileobj(response, out, 1 << 20)
    return path

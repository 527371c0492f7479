"""The fork wheel's .dist-info: upstream's files with the fork version and pins, plus
the fork's NOTICE."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from kiln.build.pins import PinChanges
from kiln.build.version import fork_version
from kiln.errors import KilnError, naming
from kiln.paths import REPO_ROOT
from kiln.upstream.fetch import fetch
from kiln.upstream.lock import UpstreamLock

PACKAGE = "vllm"
# Beside upstream's licenses/LICENSE, in the folder PEP 639 gives license files.
NOTICE = "licenses/NOTICE"


def dist_info_name(version: str) -> str:
    return f"{PACKAGE}-{version}.dist-info"


def upstream_dist_info(names: list[str]) -> str:
    found = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
    if len(found) != 1:
        raise KilnError(f"the upstream wheel has {len(found)} .dist-info folders, expected 1")
    return found[0]


# vLLM runs every vllm.general_plugins entry point in each of its processes.
FORK_ENTRY_POINTS = "[vllm.general_plugins]\nkiln_fork = vllm.fork.plugin:register\n"


def fork_entry_points(upstream_entry_points: str) -> str:
    """Upstream's entry points plus the fork's plugin group."""
    return upstream_entry_points.rstrip("\n") + "\n\n" + FORK_ENTRY_POINTS


def fork_metadata(upstream_metadata: str, version: str, pins: PinChanges) -> str:
    """Upstream's METADATA with the fork version and the fork's pin changes."""
    text = re.sub(r"^Version: .*$", f"Version: {version}", upstream_metadata, count=1, flags=re.M)
    return pins.apply_to_metadata(text)


def fork_notice(root: Path = REPO_ROOT) -> bytes:
    """The repository's NOTICE: Apache-2.0 asks a modified vLLM to say it was modified."""
    path = root / "NOTICE"
    if not path.is_file():
        raise KilnError(f"{path} is missing: the wheel, a modified vLLM, must carry the "
                        "fork's NOTICE (Apache-2.0, section 4)")
    return path.read_bytes()


def dist_info_files(upstream: zipfile.ZipFile, version: str, pins: PinChanges,
                    notice: bytes) -> dict[str, tuple[int, bytes]]:
    """File name inside .dist-info -> (zip attributes, bytes), all but RECORD."""
    old = upstream_dist_info(upstream.namelist())
    if f"{old}/{NOTICE}" in upstream.namelist():
        raise KilnError(f"the upstream wheel carries {old}/{NOTICE}; the fork's NOTICE would "
                        "replace it: carry both (kiln/build/metadata.py)")
    files = {}
    for info in upstream.infolist():
        rel = info.filename[len(old) + 1:]
        if info.filename.startswith(old + "/") and not info.is_dir() and rel != "RECORD":
            data = upstream.read(info.filename)
            if rel == "METADATA":
                data = fork_metadata(data.decode(), version, pins).encode()
            elif rel == "entry_points.txt":
                data = fork_entry_points(data.decode()).encode()
            files[rel] = (info.external_attr, data)
    files[NOTICE] = (0, notice)
    return files


def write_dist_info(target: Path, root: Path = REPO_ROOT) -> None:
    """Fill a .dist-info folder with the fork wheel's metadata files (PEP 517 prepare)."""
    lock = UpstreamLock.load(root / "requirements" / "upstream.lock")
    version = fork_version(lock.default, root)
    pins = PinChanges.load(root / "requirements" / "fork-pins.txt", lock.default)
    with zipfile.ZipFile(fetch(lock.default, lock=lock).wheel) as upstream:
        for rel, (_, data) in dist_info_files(upstream, version, pins, fork_notice(root)).items():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            with naming(target / rel):
                (target / rel).write_bytes(data)

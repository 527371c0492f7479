"""Build the fork wheel by repacking the pristine upstream wheel.

Upstream's compiled files are copied byte for byte; the series is applied to
the Python files it touches; the ``vllm/`` overlay, ``kvarn/`` and ``specattn/`` are
added inside the package, with the KVarN CUDA library where nvcc exists
(``kiln.build.kvarncuda``); the version module, METADATA and RECORD are rewritten.
Entries carry one timestamp (SOURCE_DATE_EPOCH, else the HEAD commit's time),
so two builds of one commit are byte-identical.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import subprocess
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kiln.atomic import remove_abandoned, replacing
from kiln.build.csrc import build_csrc
from kiln.errors import KilnError, naming
from kiln.upstream.fetch import fetch
from kiln.build.kvarncuda import build_kvarn_library
from kiln.upstream.lock import UpstreamLock
from kiln.build.metadata import dist_info_files, dist_info_name, fork_notice, upstream_dist_info
from kiln.paths import REPO_ROOT
from kiln.series.patching import apply_series
from kiln.build.pins import PinChanges
from kiln.series.series import Series, Topic, series_dir
from kiln.signals import uninterrupted
from kiln.build.version import fork_version, version_tuple

# repo folder -> wheel folder
OVERLAY_DIRS = (("vllm", "vllm"), ("kvarn", "vllm/kvarn"), ("specattn", "vllm/specattn"))
SKIP_PARTS = ("__pycache__",)
SKIP_SUFFIXES = (".pyc", ".pyo")
COMPILED_SOURCE_PREFIXES = ("csrc/", "cmake/", "CMakeLists.txt")
MANIFEST_PATH = "vllm/fork/manifest.json"
FILE_MODE = 0o100644 << 16
COMPRESS_LEVEL = 6


@dataclass
class WheelBuild:
    path: Path
    version: str
    upstream_version: str
    topics: list[str]
    patched: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    seconds: float = 0.0


def check_topic_paths(topics: list[Topic]) -> None:
    """The wheel reuses upstream's binaries: a topic may only touch vllm/ Python files."""
    problems = []
    for topic in topics:
        for path in topic.files():
            if path.startswith(COMPILED_SOURCE_PREFIXES):
                problems.append(
                    f"topic {topic.name} touches upstream {path}: the fork wheel reuses "
                    "upstream's compiled binaries, so compiled sources cannot be patched; "
                    "put CUDA code in the fork's own csrc/ instead"
                )
            elif not path.startswith("vllm/"):
                problems.append(
                    f"topic {topic.name} touches {path}, outside the vllm/ package the "
                    "wheel ships; topics may only change files under vllm/"
                )
    if problems:
        raise KilnError("refusing to build:\n  " + "\n  ".join(problems))


def overlay_files(root: Path = REPO_ROOT) -> dict[str, Path]:
    """Wheel path -> repository file for every tracked overlay file.

    Only files git tracks are shipped, so a stray untracked file never lands in
    a wheel; modified tracked files are shipped and mark the version .dirty.
    """
    result = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--", *(src for src, _ in OVERLAY_DIRS)],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise KilnError(f"cannot list the overlay files with git in {root}: {result.stderr.strip()}")
    files: dict[str, Path] = {}
    for rel in sorted(filter(None, result.stdout.split("\0"))):
        source, _, inner = rel.partition("/")
        target = dict(OVERLAY_DIRS)[source]
        if rel.endswith(SKIP_SUFFIXES) or any(p in SKIP_PARTS for p in rel.split("/")):
            continue
        if (root / rel).is_file():
            files[f"{target}/{inner}"] = root / rel
    return files


def source_date_epoch(root: Path = REPO_ROOT) -> int:
    if "SOURCE_DATE_EPOCH" in os.environ:
        return int(os.environ["SOURCE_DATE_EPOCH"])
    result = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%ct"],
                            capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        raise KilnError("no SOURCE_DATE_EPOCH and no git commit to take the build time from")
    return int(result.stdout)


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def record_csv(rows: list[tuple[str, str, str]]) -> bytes:
    """RECORD as CSV (PEP 376): paths that hold a comma are quoted, as installers parse
    them with the csv module."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue().encode()


def version_module(version: str, commit: str) -> bytes:
    return (
        "# Written by kiln build: the fork's version, in the shape upstream's\n"
        "# generated module has, so vllm.version keeps working.\n"
        f"__version__ = version = {version!r}\n"
        f"__version_tuple__ = version_tuple = {version_tuple(version)!r}\n"
        f"__commit_id__ = commit_id = {commit!r}\n"
    ).encode()


def head_commit(root: Path = REPO_ROOT) -> str:
    result = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                            capture_output=True, text=True)
    return "g" + result.stdout.strip() if result.returncode == 0 else "unknown"


def write_entry(out: zipfile.ZipFile, name: str, attr: int, data: bytes,
                date_time: tuple[int, ...]) -> None:
    """One whole wheel entry. A signal inside writestr would leave the archive with an
    open writing handle, which no close can finish, so it is held to the entry's end."""
    info = zipfile.ZipInfo(name, date_time)
    info.external_attr, info.create_system = attr, 3
    info.compress_type = zipfile.ZIP_DEFLATED
    with uninterrupted():
        out.writestr(info, data, compresslevel=COMPRESS_LEVEL)


def _patched_files(source: zipfile.ZipFile, topics: list[Topic]) -> dict[str, bytes | None]:
    """Apply the series to the wheel files it touches; None marks a deleted file."""
    touched = sorted({p for t in topics for p in t.files()})
    names = set(source.namelist())
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        for path in touched:
            if path in names:
                (tree / path).parent.mkdir(parents=True, exist_ok=True)
                with naming(tree / path):
                    (tree / path).write_bytes(source.read(path))
        apply_series(tree, topics)
        return {p: (tree / p).read_bytes() if (tree / p).exists() else None for p in touched}


def _entries(source: zipfile.ZipFile, replaced: dict[str, bytes | None],
             added: dict[str, bytes], old_dist: str) -> Iterator[tuple[str, int, bytes]]:
    """(name, external_attr, bytes) for every file of the new wheel but dist-info."""
    for info in source.infolist():
        if info.is_dir() or info.filename.startswith(old_dist + "/"):
            continue
        if info.filename in replaced:
            data = replaced[info.filename]
            if data is not None:
                yield info.filename, info.external_attr or FILE_MODE, data
            continue
        yield info.filename, info.external_attr or FILE_MODE, source.read(info.filename)
    for name in sorted(added):
        yield name, FILE_MODE, added[name]


def build_wheel(out_dir: Path, *, version: str | None = None, root: Path = REPO_ROOT,
                lock: UpstreamLock | None = None, log=print) -> WheelBuild:
    """The fork wheel for ``version`` (default: the lock's default): its pristine wheel
    plus ``patches/<version>/`` plus the overlay. ``lock``: the root's lock, where the
    caller has read it already."""
    started = time.monotonic()
    lock = lock or UpstreamLock.load(root / "requirements" / "upstream.lock")
    release = lock.release(version)
    series = Series.load(series_dir(release.version, root, lock))
    problems = series.problems()
    if problems:
        raise KilnError("refusing to build: incomplete patch headers:\n  " + "\n  ".join(problems))
    check_topic_paths(series.topics)
    pins = PinChanges.load(root / "requirements" / "fork-pins.txt", release.version)
    version = fork_version(release.version, root)
    epoch = max(source_date_epoch(root), 315532800)  # zip cannot store dates before 1980
    date_time = time.gmtime(epoch)[:6]
    upstream_wheel = fetch(release.version, lock=lock, log=log).wheel
    log(f"building vllm {version} from {upstream_wheel.name} + {len(series.topics)} topic(s)")

    wheel_name = upstream_wheel.name.replace(f"-{release.version}-", f"-{version}-", 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    for abandoned in remove_abandoned(out_dir, "vllm-*.whl"):
        log(f"removed {abandoned}, left unfinished by a build that was killed")
    target = out_dir / wheel_name
    with zipfile.ZipFile(upstream_wheel) as source, tempfile.TemporaryDirectory() as csrc_build:
        names = source.namelist()
        old_dist = upstream_dist_info(names)
        new_dist = dist_info_name(version)
        replaced = _patched_files(source, series.topics)
        replaced["vllm/_version.py"] = version_module(version, head_commit(root))
        overlay = {**overlay_files(root), **build_csrc(root, Path(csrc_build), log),
                   **build_kvarn_library(root, Path(csrc_build) / "kvarn", log)}
        clashes = sorted(set(overlay) & (set(names) | set(replaced)))
        if clashes:
            raise KilnError(
                "overlay files would replace upstream files (change those through a topic "
                "patch instead): " + ", ".join(clashes)
            )
        added = {name: path.read_bytes() for name, path in overlay.items()}
        added[MANIFEST_PATH] = json.dumps({
            "fork_version": version, "upstream_version": release.version,
            "topics": [t.name for t in series.topics],
        }, indent=1).encode() + b"\n"
        dist_info = dist_info_files(source, version, pins, fork_notice(root))

        record: list[tuple[str, str, str]] = []
        with replacing(target) as tmp:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=COMPRESS_LEVEL) as out:
                def write(name: str, attr: int, data: bytes) -> None:
                    write_entry(out, name, attr, data, date_time)
                    record.append((name, record_hash(data), str(len(data))))

                for name, attr, data in _entries(source, replaced, added, old_dist):
                    write(name, attr, data)
                for rel, (attr, data) in sorted(dist_info.items()):
                    write(f"{new_dist}/{rel}", attr or FILE_MODE, data)
                write(f"{new_dist}/RECORD", FILE_MODE,
                      record_csv([*record, (f"{new_dist}/RECORD", "", "")]))
    patched = sorted(p for p in replaced if p != "vllm/_version.py")
    return WheelBuild(
        path=target, version=version, upstream_version=release.version,
        topics=[t.name for t in series.topics], patched=patched, added=sorted(added),
        seconds=time.monotonic() - started,
    )

"""The KVarN CUDA decode library for the wheel: csrc/kvarn/kvarn_decode.cu through nvcc.

The command is ``kvarn/cuda_build.py``'s, the one ``kvarn.decode_cuda.build_library``
runs; kiln loads that module from its file, since ``kvarn/__init__`` imports torch.
Where no nvcc exists the library is left out (KVarN then decodes with its Triton
kernel) and one line says so. A compiled library is cached under
``$KILN_CACHE/kvarn-cuda``, keyed by its inputs, so a rebuild is a copy; a miss simply
compiles (23-34 s for the four archs on 2 cores).

nvcc hashes the source's absolute path into the names of the kernels (they live in an
anonymous namespace) and ``-lineinfo`` records its folder and modification time, so the
source is compiled from one fixed path, ``STAGE``, with its time set to STAGED_MTIME:
the same inputs then give the same bytes in any checkout.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

from kiln.atomic import replacing
from kiln.errors import KilnError
from kiln.paths import cache_dir
from kiln.signals import uninterrupted

SOURCE = "csrc/kvarn/kvarn_decode.cu"
WHEEL_PATH = "vllm/kvarn/libkvarn_decode.so"
STAGE = Path("/tmp/kiln-kvarn-cuda")
STAGED_MTIME = 0  # "unknown" in the line table's file entries


def cuda_build(root: Path) -> ModuleType:
    """kvarn/cuda_build.py of the checkout at ``root``, without importing kvarn (torch)."""
    path = root / "kvarn" / "cuda_build.py"
    spec = importlib.util.spec_from_file_location("kiln_kvarn_cuda_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def staged_source() -> Path:
    return STAGE / Path(SOURCE).name


def cache_key(source: bytes, archs, command: list[str], nvcc_version: str) -> str:
    """sha256 of everything the library's bytes depend on: the source, the archs, nvcc's
    arguments (flags, the staged path), the staged file's time and nvcc's version."""
    inputs = {"source_sha256": hashlib.sha256(source).hexdigest(), "archs": list(archs),
              "command": command, "staged_mtime": STAGED_MTIME, "nvcc": nvcc_version}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _compile(build: ModuleType, nvcc: str, source: bytes, out_dir: Path) -> Path:
    try:
        STAGE.mkdir(exist_ok=True)
        with open(STAGE / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one staged source per machine at a time
            staged_source().write_bytes(source)
            os.utime(staged_source(), (STAGED_MTIME, STAGED_MTIME))
            return build.compile_library(out_dir, build.ARCHS, staged_source(), nvcc,
                                         cleanup_guard=uninterrupted)
    except OSError as exc:
        raise KilnError(f"cannot stage {SOURCE} in {STAGE} for nvcc: {exc}") from None
    except RuntimeError as exc:
        raise KilnError(f"compiling {SOURCE} failed: {exc}") from None


def _store(library: Path, cached: Path, log) -> None:
    """Best effort: a cache that cannot be written only costs the next build a compile."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with replacing(cached) as tmp:
            shutil.copyfile(library, tmp)
    except OSError as exc:
        log(f"csrc/kvarn: could not cache {library.name} at {cached}: {exc}")


def build_kvarn_library(root: Path, build_dir: Path, log=print) -> dict[str, Path]:
    """Wheel path -> compiled library; empty (and one line logged) where no nvcc is."""
    if not (root / SOURCE).is_file():
        log(f"csrc/kvarn: skipped: the checkout has no {SOURCE}")
        return {}
    build = cuda_build(root)
    nvcc = build.find_nvcc()
    if nvcc is None:
        log(f"csrc/kvarn: skipped {build.LIB_NAME}: no nvcc (not on PATH nor in "
            "$CUDA_HOME/bin); the wheel's KVarN decode uses its Triton kernel")
        return {}
    source = (root / SOURCE).read_bytes()
    arguments = build.nvcc_command(nvcc, staged_source(), build.LIB_NAME, build.ARCHS)[1:]
    key = cache_key(source, build.ARCHS, arguments, build.nvcc_version(nvcc))
    cached = cache_dir() / "kvarn-cuda" / key[:24] / build.LIB_NAME
    if cached.is_file():
        log(f"csrc/kvarn: {build.LIB_NAME} from the cache ({cached})")
        return {WHEEL_PATH: cached}
    archs = ", ".join(f"sm_{a}" for a in build.ARCHS)
    log(f"csrc/kvarn: compiling {SOURCE} for {archs} with {nvcc}")
    started = time.monotonic()
    library = _compile(build, nvcc, source, build_dir)
    log(f"csrc/kvarn: compiled {build.LIB_NAME} in {time.monotonic() - started:.0f} s")
    _store(library, cached, log)
    return {WHEEL_PATH: library}

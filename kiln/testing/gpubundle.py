"""The offline GPU test bundle: the fork wheel made to run where nothing can be fetched.

A GPU machine with Python 3.12 and a CUDA torch >= 2.11 but no network and no vLLM
(the lent H200 is one) gets one folder of at most 60 MiB:

    run                        bash: DIR/run RESULTS_DIR [pytest args] (kiln/testing/gpubundle_run.sh)
    manifest.json              fork version, archs, every file's size and sha256
    vllm-python.tar.xz         the wheel's Python and data files
    compiled/vllm/*.so.xz      the compiled extensions it needs, slimmed to the archs
    standins/...               modules in place of what is left out (kiln/testing/standins)
    wheels/*.whl               requirements/gpu-bundle.lock: what such a machine lacks,
                               and the fork's xgrammar built for that Python
    src/                       kiln, tests, bench, kvarn, specattn, pyproject.toml: the sources

The pieces that take long (slimming and compressing 124 MB of extensions, compressing
the Python tree) are cached under kiln's cache, keyed by the hashes of their inputs
and of the code that makes them.
"""

from __future__ import annotations

import calendar
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kiln.abi import fatbin
from kiln.build.metadata import upstream_dist_info
from kiln.build.wheel import build_wheel
from kiln.build.xgrammar import XgrammarLock, find_pythons, fork_wheel, load_series, wheel_for_python
from kiln.errors import KilnError, naming
from kiln.paths import REPO_ROOT, cache_dir
from kiln.testing.gpulock import LOCK_PATH, GpuBundleLock
from kiln.testing.gpurun import COMPILED, MANIFEST, PYTHON_TREE, RUN, SOURCES, STANDINS, WHEELS
from kiln.upstream.fetch import sha256_of

ALLOWED_ARCHS = (80, 86, 89, 90)
DEFAULT_ARCHS = (90,)
SIZE_LIMIT = 60 * 2**20
XZ_PRESET = 6
RUN_SCRIPT = Path(__file__).with_name("gpubundle_run.sh")
ELF_MAGIC = b"\x7fELF"

# Every compiled file of the wheel is carried (slimmed) or left out, for a reason; a
# wheel with a compiled file in neither list is refused until someone decides.
CARRIED = {
    "vllm/_C_stable_libtorch.abi3.so":
        "the core CUDA ops; vllm/platforms/cuda.py imports it unconditionally",
    "vllm/_moe_C_stable_libtorch.abi3.so":
        "the MoE ops (routing, fused MoE GEMMs) the CUDA platform loads at start-up",
    "vllm/cumem_allocator.abi3.so":
        "sleep mode's allocator (vllm/device_allocator/cumem.py); host code, 27 KB",
    "vllm/fs_io_C.abi3.so": "the file-system KV offload tier's I/O; host code, 28 KB",
    "vllm/spinloop.abi3.so": "VLLM_USE_SPINLOOP_EXT's polling loop; host code, 17 KB",
    "vllm/kvarn/libkvarn_decode.so":
        "the KVarN CUDA decode kernel (vllm/kvarn/decode_cuda.py); without it KVarN "
        "decodes with its Triton kernel",
}
# Carried files kiln build makes only where nvcc is: a wheel without one still bundles.
BUILT_WITH_NVCC = ("vllm/kvarn/libkvarn_decode.so",)
LEFT_OUT = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so":
        "FlashAttention 2 (308 MB): an empty stand-in lets vllm.vllm_flash_attn import; "
        "serve with --attention-backend TRITON_ATTN or a KVarN --kv-cache-dtype",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so":
        "FlashAttention 3 (173 MB, sm_90a only): the fa2 stand-in is enough for the import",
    "vllm/_qutlass_C.abi3.so": "sm_100a code only; imported only if present",
    "vllm/_deepselect_C.abi3.so": "sm_100a code only (a sparse indexer); imported on demand",
    "vllm/_flashmla_C.abi3.so": "MLA attention (DeepSeek-style models), sm_90a/sm_100; optional",
    "vllm/_flashmla_extension_C.abi3.so": "MLA attention's FP8 path, sm_90a/sm_100; optional",
    "vllm/_flashkda_C.abi3.so": "Kimi/GLM linear attention kernels; imported by those models only",
    "vllm/third_party/deep_gemm/_C_extension.abi3.so":
        "DeepGEMM, which compiles its kernels at run time from headers; without it "
        "has_deep_gemm() is False and vLLM uses its other FP8 kernels",
    "vllm/vllm-rs": "the Rust front end (59 MB), used only with VLLM_USE_RUST_FRONTEND",
}
# Inputs of run-time compilation by DeepGEMM (left out above) and fmha_sm100 (sm_100
# only): 57 MB of C++ headers nothing on an sm_80-sm_90 machine compiles.
JIT_SOURCE_TREES = ("vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/")
JIT_SOURCE_SUFFIXES = (".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp", ".c")
# The sources the GPU tier runs from: kiln (tiny-model), the tests, the benchmarks,
# kvarn and specattn (bench/ and tests/kernels import them as top-level packages) and
# pyproject.toml (pytest's settings).
SOURCE_PATHS = ("kiln", "tests", "bench", "kvarn", "specattn", "pyproject.toml")
# Modules put in place of what the bundle leaves out: kiln/testing/standins/<path in the
# installed site>, each saying what it stands in for and why.
STANDIN_ROOT = Path(__file__).with_name("standins")
STANDIN_MODULES = {p.relative_to(STANDIN_ROOT).as_posix(): p.read_text()
                   for p in sorted(STANDIN_ROOT.rglob("*.py"))}

Log = Callable[[str], None]


@dataclass(frozen=True)
class GpuBundle:
    path: Path
    fork_version: str
    archs: tuple[int, ...]
    parts: dict[str, int]  # part of the folder -> bytes
    seconds: float

    @property
    def size(self) -> int:
        return sum(self.parts.values())


def parse_archs(values: Iterable[str]) -> tuple[int, ...]:
    """``["90"]``, ``["80,86", "90"]``: the SM archs, sorted, each one allowed."""
    archs: set[int] = set()
    allowed = ", ".join(map(str, ALLOWED_ARCHS))
    for value in values:
        for item in filter(None, (v.strip() for v in value.split(","))):
            if not item.isdigit() or int(item) not in ALLOWED_ARCHS:
                raise KilnError(f"--arch {item!r} is not an arch the bundle supports "
                                f"(allowed: {allowed})")
            archs.add(int(item))
    if not archs:
        raise KilnError(f"no arch given (allowed: {allowed})")
    return tuple(sorted(archs))


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"


def _cached(key: str, name: str, make: Callable[[Path], None], log: Log) -> Path:
    """A piece cached under its inputs' hash, made by ``make(path)`` when missing."""
    folder = cache_dir() / "gpu-bundle"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key[:24]}-{name}"
    if path.exists():
        log(f"{name}: from the cache")
        return path
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")  # another build may make it too
    os.close(fd)
    try:
        make(Path(tmp))
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def _key(*parts: object) -> str:
    """Hash of a piece's inputs and of the code that makes it: an edit never reuses a stale one."""
    digest = hashlib.sha256(repr((XZ_PRESET, *parts)).encode())
    for module in (Path(__file__), Path(fatbin.__file__)):
        digest.update(module.read_bytes())
    return digest.hexdigest()


def classify(wheel: zipfile.ZipFile) -> tuple[list[str], list[str]]:
    """(compiled files to carry, Python and data files to carry); refuses undecided ones."""
    compiled, python, undecided = [], [], []
    for info in wheel.infolist():
        name = info.filename
        if info.is_dir() or name.endswith(".dist-info/RECORD"):
            continue  # RECORD would list files the bundle leaves out
        with wheel.open(info) as f:
            is_elf = f.read(4) == ELF_MAGIC
        if is_elf:
            if name in CARRIED:
                compiled.append(name)
            elif name not in LEFT_OUT:
                undecided.append(name)
        elif not (name.startswith(JIT_SOURCE_TREES) and name.endswith(JIT_SOURCE_SUFFIXES)):
            python.append(name)
    if undecided:
        raise KilnError(
            f"the wheel has compiled files the bundle has no decision for: "
            f"{', '.join(undecided)}; add each to CARRIED or LEFT_OUT in kiln/testing/gpubundle.py")
    missing = sorted(set(CARRIED) - set(compiled) - set(BUILT_WITH_NVCC))
    if missing:
        raise KilnError(f"the wheel lacks compiled files the bundle carries: {', '.join(missing)}")
    return compiled, python


def _python_tree(wheel: zipfile.ZipFile, names: list[str], target: Path, log: Log) -> None:
    log(f"compressing the wheel's {len(names)} Python and data files")
    started = time.monotonic()
    with naming(target), tarfile.open(target, "w:xz", preset=XZ_PRESET,
                                      format=tarfile.PAX_FORMAT) as tree:
        for name in sorted(names):
            data = wheel.read(name)
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            info.mtime = calendar.timegm((*wheel.getinfo(name).date_time, 0, 0, 0))
            tree.addfile(info, io.BytesIO(data))
    log(f"compressed the Python tree to {mib(target.stat().st_size)} "
        f"in {time.monotonic() - started:.0f} s")


def _slimmed(data: bytes, name: str, archs: tuple[int, ...], target: Path, log: Log) -> None:
    slim = fatbin.slim(data, archs, name)
    if slim.kept or slim.zeroed:
        kept = Counter(e.name for e in slim.kept)
        log(f"slimmed {name}: kept {len(slim.kept)} GPU code entries "
            f"({', '.join(f'{n} {c}' for n, c in sorted(kept.items())) or 'none'}), "
            f"zeroed {len(slim.zeroed)} ({mib(slim.zeroed_bytes)})")
    started = time.monotonic()
    with naming(target):
        target.write_bytes(lzma.compress(slim.data, preset=XZ_PRESET))
    log(f"compressed {name}: {mib(len(data))} -> {mib(target.stat().st_size)} "
        f"in {time.monotonic() - started:.0f} s")


def _wheel_pieces(wheel: Path, archs: tuple[int, ...], stage: Path, log: Log) -> str:
    """Write the Python tree and the slimmed compiled files; return the wheel's version."""
    with zipfile.ZipFile(wheel) as zf:
        version = wheel_version(zf)
        compiled, python = classify(zf)
        # (file in the bundle, cache key, how to make it)
        jobs: list[tuple[Path, str, Callable[[Path], None]]] = [(
            stage / PYTHON_TREE,
            _key("python-tree", sha256_of(wheel), JIT_SOURCE_TREES, JIT_SOURCE_SUFFIXES),
            lambda target: _python_tree(zf, python, target, log),
        )]
        for name in compiled:
            data = zf.read(name)
            jobs.append((
                stage / COMPILED / f"{name}.xz",
                _key("compiled", hashlib.sha256(data).hexdigest(), archs),
                lambda target, data=data, name=name: _slimmed(data, name, archs, target, log),
            ))

        def piece(job: tuple[Path, str, Callable[[Path], None]]) -> None:
            target, key, make = job
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(_cached(key, target.name, make, log), target)

        # lzma releases the GIL: the pieces compress side by side, one per core.
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(piece, jobs))
    return version


def wheel_version(wheel: zipfile.ZipFile) -> str:
    """The Version of the wheel's METADATA."""
    metadata = wheel.read(f"{upstream_dist_info(wheel.namelist())}/METADATA").decode()
    for line in metadata.partition("\n\n")[0].splitlines():
        if line.startswith("Version: "):
            return line[len("Version: "):].strip()
    raise KilnError("the wheel's METADATA has no Version")


def source_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files of the source paths (no caches)."""
    result = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
         "--", *SOURCE_PATHS],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise KilnError(f"cannot list the source files with git in {root}: {result.stderr.strip()}")
    return sorted({p for p in result.stdout.split("\0") if p and (root / p).is_file()})


def _copy_sources(root: Path, target: Path, log: Log) -> None:
    files = source_files(root)
    for rel in files:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, target / rel)
    if not (target / "tests" / "gpu").is_dir():
        log("warning: the checkout has no tests/gpu: DIR/run will find no GPU tier to run")


def _parts(stage: Path) -> dict[str, int]:
    """Sizes by part: each top-level file, compiled file and wheel; src/ and standins/ whole."""
    parts: dict[str, int] = {}
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        rel = path.relative_to(stage)
        part = rel.parts[0] if rel.parts[0] in (SOURCES, STANDINS) else str(rel)
        parts[part] = parts.get(part, 0) + path.stat().st_size
    return parts


def check_budget(parts: dict[str, int], limit: int) -> None:
    total = sum(parts.values())
    if total > limit:
        largest = sorted(parts.items(), key=lambda kv: -kv[1])[:5]
        raise KilnError(
            f"the bundle would be {mib(total)}, over its {mib(limit)} limit; largest parts: "
            + ", ".join(f"{name} {mib(size)}" for name, size in largest))


def platform_tags(wheel: str) -> list[str]:
    """The platform tags of a wheel's file name (the last of its dash-separated fields)."""
    return wheel[:-len(".whl")].split("-")[-1].split(".")


def glibc_needed(wheels: Iterable[str]) -> str | None:
    """The newest glibc any of the wheels needs: per wheel, its oldest manylinux_2_X tag."""
    needed = []
    for wheel in wheels:
        minors = [int(t.split("_")[2]) for t in platform_tags(wheel) if t.startswith("manylinux_2_")]
        needed += [min(minors)] if minors else []
    return f"2.{max(needed)}" if needed else None


def _manifest(stage: Path, version: str, archs: tuple[int, ...], lock: GpuBundleLock,
              xgrammar: Path) -> dict:
    files = {}
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        files[str(path.relative_to(stage))] = {"size": path.stat().st_size,
                                               "sha256": sha256_of(path)}
    # The installer passes these tags to pip: the lock's, and the fork xgrammar's own.
    platforms = list(lock.platforms)
    platforms += [t for t in platform_tags(xgrammar.name) if t not in platforms]
    return {
        "fork_version": version,
        "archs": list(archs),
        "python_version": lock.python_version,
        "platforms": platforms,
        "glibc": glibc_needed(p.name for p in (stage / WHEELS).glob("*.whl")),
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }


def bundle_xgrammar(python_version: str, given: Path | None, log: Log) -> Path:
    """The fork's xgrammar wheel for the bundle's Python: ``given``, checked, or the
    cached build for it (built like `kiln build` when missing)."""
    lock = XgrammarLock.load()
    if given is None:
        try:
            [python] = find_pythons([python_version])
        except KilnError as e:
            raise KilnError(f"{e}; or give a built one with --xgrammar") from None
        return fork_wheel(lock, load_series(), log, python)[0]
    if not given.is_file():
        raise KilnError(f"{given}: no such wheel; build one with "
                        f"`python3 -m kiln build-xgrammar --python {python_version}`")
    wheel_for_python([given], python_version)
    if not given.name.startswith(f"xgrammar-{lock.fork_version}-"):
        raise KilnError(f"{given.name} is not the fork's xgrammar {lock.fork_version}, which the "
                        "bundle carries (requirements/xgrammar.lock)")
    return given


def _check_out(out: Path) -> None:
    """Only a missing or empty folder, or an earlier bundle, may be replaced."""
    if not out.exists() or (out / MANIFEST).is_file():
        return
    if not out.is_dir() or any(out.iterdir()):
        raise KilnError(f"{out} exists and is not a GPU bundle; give a new folder or remove it")


def _publish(stage: Path, out: Path) -> None:
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(stage, out)
    shutil.rmtree(old, ignore_errors=True)


def build_gpu_bundle(out: Path, archs: tuple[int, ...] = DEFAULT_ARCHS, wheel: Path | None = None,
                     xgrammar: Path | None = None, *, limit: int = SIZE_LIMIT,
                     root: Path = REPO_ROOT, log: Log = print) -> GpuBundle:
    """Write the bundle to ``out`` (replacing an earlier bundle there), or nothing at all.

    ``wheel`` is the fork wheel and ``xgrammar`` the fork's xgrammar wheel for the
    bundle's Python; each is built from this checkout when not given.
    """
    started = time.monotonic()
    archs = parse_archs(str(a) for a in archs)
    out = out.resolve()
    _check_out(out)
    if wheel is not None and not wheel.is_file():
        raise KilnError(f"{wheel}: no such wheel; build one with `python3 -m kiln build`")
    lock = GpuBundleLock.load(root / "requirements" / LOCK_PATH.name)
    xgrammar = bundle_xgrammar(lock.python_version, xgrammar, log)
    log(f"checking the {len(lock.wheels)} pinned wheels (downloading what the cache lacks)")
    wheels = [*lock.fetch(log), xgrammar]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            log("building the fork wheel")
            wheel = build_wheel(Path(tmp), root=root, log=log).path
        stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        try:
            log(f"bundling {wheel.name} for {', '.join(f'sm_{a}' for a in archs)}")
            version = _wheel_pieces(wheel, archs, stage, log)
            (stage / WHEELS).mkdir()
            for path in wheels:
                shutil.copyfile(path, stage / WHEELS / path.name)
            _copy_sources(root, stage / SOURCES, log)
            for rel, text in STANDIN_MODULES.items():
                standin = stage / STANDINS / rel
                standin.parent.mkdir(parents=True, exist_ok=True)
                with naming(standin):
                    standin.write_text(text)
            shutil.copyfile(RUN_SCRIPT, stage / RUN)
            (stage / RUN).chmod(0o755)
            manifest = _manifest(stage, version, archs, lock, xgrammar)
            with naming(stage / MANIFEST):
                (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            parts = _parts(stage)
            check_budget(parts, limit)
            stage.chmod(0o755)
            _publish(stage, out)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    return GpuBundle(out, version, archs, parts, time.monotonic() - started)

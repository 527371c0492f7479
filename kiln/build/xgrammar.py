"""The fork's xgrammar: the pinned 0.2.8 sdist + patches/xgrammar/, built into wheels.

vLLM 0.32.0 pins xgrammar==0.2.8. The fork ships ``xgrammar-0.2.8+kiln.N`` beside its
own wheel (the pin accepts a local version), rebuilt from the registry's sdist with a
second patch series in the same format as ``patches/``, once for each CPython the fork
supports (``PYTHONS``), each tagged manylinux for the glibc it needs (kiln/abi/manylinux.py).
The sdist is checked against ``requirements/xgrammar.lock``; each build (scikit-build-core:
CMake + ninja, under that Python's pip with build isolation, constrained by
``requirements/xgrammar-build.txt``) is cached outside the repository, keyed by the
hashes of everything that goes into it, that Python's version included.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError, naming
from kiln.upstream.fetch import fetch_pinned, download_from_index, sha256_of
from kiln.upstream.lock import PinnedFile
from kiln.abi.manylinux import TOOLS_REQUIREMENTS, repair
from kiln.series.patching import apply_series
from kiln.paths import REPO_ROOT, cache_dir
from kiln.series.series import Series, Topic
from kiln.testing.testenv import COMPLETE, TORCH
from kiln.tomlfile import read_toml

LOCK_PATH = REPO_ROOT / "requirements" / "xgrammar.lock"
BUILD_CONSTRAINTS = REPO_ROOT / "requirements" / "xgrammar-build.txt"
RUNTIME_REQUIREMENTS = REPO_ROOT / "requirements" / "xgrammar-test.txt"
# What stock and fork xgrammar import, plus mistral_common for the benchmark's vocabulary.
RUNTIME_MODULES = ("torch", "transformers", "pydantic", "tvm_ffi", "numpy", "mistral_common")
PATCH_DIR = REPO_ROOT / "patches" / "xgrammar"
# ninja's progress lines, as scikit-build-core passes them through with pip -v.
_NINJA_STEP = re.compile(r"\[(\d+)/(\d+)\]")
# The CPythons the fork's xgrammar is built for: vLLM 0.32/0.33 accept 3.11 to 3.14;
# 3.14 waits for an interpreter on the build machines.
PYTHONS = ("3.11", "3.12", "3.13")
# The bindings link libtvm_ffi.so, which the apache-tvm-ffi requirement ships; upstream's
# release builds leave it out of the wheel the same way.
PROVIDED_LIBS = ("libtvm_ffi.so",)

Log = Callable[[str], None]


@dataclass(frozen=True)
class XgrammarLock:
    version: str
    local: int
    sdist: PinnedFile
    stock_wheel: PinnedFile

    @property
    def fork_version(self) -> str:
        return f"{self.version}+kiln.{self.local}"

    @classmethod
    def load(cls, path: Path = LOCK_PATH) -> XgrammarLock:
        data = read_toml(path, "missing; it pins the xgrammar sdist the fork rebuilds")
        try:
            lock = cls(
                version=data["version"],
                local=data["local"],
                sdist=PinnedFile.from_table(data, "sdist"),
                stock_wheel=PinnedFile.from_table(data, "stock_wheel"),
            )
        except KeyError as e:
            raise KilnError(
                f"{path}: lacks {e.args[0]}; it needs version, local, sdist, sdist_sha256, "
                "stock_wheel, stock_wheel_sha256"
            ) from None
        if not isinstance(lock.local, int) or lock.local < 1:
            raise KilnError(f"{path}: local must be a positive integer, not {lock.local!r}")
        return lock


@dataclass(frozen=True)
class Interpreter:
    """A CPython to build the wheel with; its full ``sys.version`` is part of the cache key."""

    version: str  # "3.12"
    path: Path
    build: str  # its sys.version

    @property
    def tag(self) -> str:
        """The wheel's Python tag, e.g. cp312."""
        return "cp" + self.version.replace(".", "")


@dataclass(frozen=True)
class XgrammarBuild:
    path: Path  # the wheel in the output folder
    version: str
    python: str  # "3.12"
    topics: list[str]
    cached: bool
    seconds: float


# Prints what find_python needs to know of a candidate interpreter, as JSON.
_PROBE = ("import importlib.util, json, sys; print(json.dumps({'version': '%d.%d' % "
          "sys.version_info[:2], 'build': sys.version, "
          "'pip': importlib.util.find_spec('pip') is not None}))")


def parse_pythons(values: Iterable[str]) -> tuple[str, ...]:
    """``["3.12"]``, ``["3.11,3.13"]``: the Python versions asked for, in PYTHONS' order."""
    asked: set[str] = set()
    for value in values:
        for item in filter(None, (v.strip() for v in value.split(","))):
            if item not in PYTHONS:
                raise KilnError(f"--python {item!r} is not a Python the fork's xgrammar is built "
                                f"for (allowed: {', '.join(PYTHONS)})")
            asked.add(item)
    if not asked:
        raise KilnError(f"no Python given (allowed: {', '.join(PYTHONS)})")
    return tuple(v for v in PYTHONS if v in asked)


def _candidates(version: str) -> list[Path]:
    """Where a CPython ``version`` may be: this one, PATH, then pyenv's newest patch first."""
    found = []
    if "%d.%d" % sys.version_info[:2] == version:
        found.append(Path(sys.executable))
    if on_path := shutil.which(f"python{version}"):
        found.append(Path(on_path))
    versions = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    patches = versions.glob(f"{version}.*/bin/python{version}")
    found += sorted(patches, key=lambda p: [int(n) for n in re.findall(r"\d+", p.parts[-3])],
                    reverse=True)
    return found


def find_python(version: str) -> tuple[Interpreter | None, str]:
    """The first candidate that is CPython ``version`` with pip, or None and what was seen."""
    seen = []
    for path in _candidates(version):
        try:
            result = subprocess.run([str(path), "-c", _PROBE], capture_output=True, text=True,
                                    timeout=60)
            info = json.loads(result.stdout) if result.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            info = None
        if info is None:
            seen.append(f"{path} does not run")
        elif info["version"] != version:
            seen.append(f"{path} is Python {info['version']}")
        elif not info["pip"]:
            seen.append(f"{path} has no pip (`{path} -m ensurepip` adds it)")
        else:
            return Interpreter(version, path, info["build"]), ""
    return None, "; ".join(seen)


def find_pythons(versions: Sequence[str] = PYTHONS) -> list[Interpreter]:
    """An interpreter for each version, or an error naming every one missing and the way out."""
    found, missing = [], {}
    for version in versions:
        python, seen = find_python(version)
        if python is None:
            missing[version] = seen
        else:
            found.append(python)
    if missing:
        named = "; ".join(
            f"Python {v} (looked for python{v} on PATH and under $PYENV_ROOT/versions/{v}.*"
            + (f": {seen}" if seen else "") + ")" for v, seen in missing.items())
        others = ",".join(p.version for p in found)
        raise KilnError(
            f"the fork's xgrammar is built with each Python asked for ({', '.join(versions)}); "
            f"not found: {named}. Install with "
            + " and ".join(f"`pyenv install {v}`" for v in missing)
            + " (or your distribution's python3.X and its pip)"
            + (f", or build only for the others with --python {others}" if others else ""))
    return found


def load_series(directory: Path = PATCH_DIR) -> Series:
    """The xgrammar series, refused whole if any header is incomplete."""
    series = Series.load(directory)
    problems = series.problems()
    if problems:
        raise KilnError(f"{directory}: the series has problems:\n  " + "\n  ".join(problems))
    return series


def fetch_sdist(lock: XgrammarLock, log: Log = print) -> Path:
    """The verified sdist, downloaded from the registry's simple index when not cached."""
    return fetch_pinned(lock.sdist, lambda dest: download_from_index(lock.sdist, dest), log,
                        f"{LOCK_PATH} (sdist)")


def build_key(lock: XgrammarLock, topics: list[Topic], version: str, python: Interpreter) -> str:
    """Hash of all that decides a wheel's bytes: sdist, patches, version, pins, interpreter,
    and the tools that tag it."""
    digest = hashlib.sha256()
    for part in (lock.sdist.sha256, version, python.build, BUILD_CONSTRAINTS.read_text(),
                 TOOLS_REQUIREMENTS.read_text()):
        digest.update(part.encode() + b"\0")
    for topic in topics:
        digest.update(topic.path.name.encode() + b"\0" + topic.path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build_xgrammar(out: Path, pythons: Sequence[Interpreter] | None = None,
                   log: Log = print) -> list[XgrammarBuild]:
    """Build (or reuse) the fork's xgrammar wheel for each Python (default: all of PYTHONS)
    and copy them into ``out``; nothing is copied unless every build succeeded."""
    lock = XgrammarLock.load()
    series = load_series()
    pythons = find_pythons() if pythons is None else pythons
    built = []
    for i, python in enumerate(pythons, 1):
        started = time.monotonic()
        log(f"xgrammar {lock.fork_version} for Python {python.version} ({i} of {len(pythons)}, "
            f"{python.path})")
        wheel, cached = fork_wheel(lock, series, log, python)
        built.append((python, wheel, cached, time.monotonic() - started))
    builds = [XgrammarBuild(path=_publish(wheel, out), version=lock.fork_version,
                            python=python.version, topics=[t.name for t in series.topics],
                            cached=cached, seconds=seconds)
              for python, wheel, cached, seconds in built]
    for python, build in zip(pythons, builds):
        # An older build of this version for this Python (another tag) would sit beside it
        # in pip's --find-links; only the new one stays.
        for stale in out.glob(f"xgrammar-{lock.fork_version}-{python.tag}-{python.tag}-*.whl"):
            if stale != build.path:
                stale.unlink()
    return builds


def wheel_for_python(wheels: Iterable[Path], version: str) -> Path:
    """The one wheel among ``wheels`` built for CPython ``version`` (by its Python tag)."""
    wheels = list(wheels)
    tag = "cp" + version.replace(".", "")
    # {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
    matching = [w for w in wheels if tag in w.name[:-len(".whl")].split("-")[-3].split(".")]
    names = ", ".join(w.name for w in wheels)
    if not matching:
        raise KilnError(f"no xgrammar wheel for Python {version} ({tag}) among: {names}; "
                        f"build it with `python3 -m kiln build-xgrammar --python {version}`")
    if len(matching) > 1:
        raise KilnError(f"more than one xgrammar wheel for Python {version} ({tag}): {names}")
    return matching[0]


def this_python() -> Interpreter:
    """The running interpreter, as a build target."""
    return Interpreter("%d.%d" % sys.version_info[:2], Path(sys.executable), sys.version)


def fork_wheel(lock: XgrammarLock, series: Series, log: Log = print,
               python: Interpreter | None = None) -> tuple[Path, bool]:
    """The cached fork wheel for ``python`` (default: this one), built if missing, and
    whether it was already cached."""
    return _wheel(lock, series.topics, lock.fork_version, python or this_python(), log)


def rebuilt_stock_wheel(lock: XgrammarLock, series: Series, log: Log = print) -> Path:
    """Stock 0.2.8 compiled here: the sdist with only the series' build topics (Kind: local).

    It separates what the fork's patches cost from what this machine's compiler costs
    against the registry's wheel, which upstream builds with a newer GCC in manylinux.
    """
    topics = [t for t in series.topics if t.kind == "local"]
    return _wheel(lock, topics, f"{lock.version}+rebuilt", this_python(), log)[0]


def _wheel(lock: XgrammarLock, topics: list[Topic], version: str, python: Interpreter,
           log: Log) -> tuple[Path, bool]:
    sdist = fetch_sdist(lock, log)
    cache = cache_dir() / "xgrammar" / f"build-{build_key(lock, topics, version, python)}"
    wheel = _cached_wheel(cache)
    if wheel is not None:
        log(f"  {wheel.name}: from the cache")
        return wheel, True
    return _build_into_cache(sdist, topics, version, python, cache, log), False


def _cached_wheel(cache: Path) -> Path | None:
    wheels = sorted(cache.glob("xgrammar-*.whl")) if cache.is_dir() else []
    return wheels[0] if len(wheels) == 1 else None


def _build_into_cache(sdist: Path, topics: list[Topic], version: str, python: Interpreter,
                      cache: Path, log: Log) -> Path:
    """Unpack, patch, build and tag in a temporary folder; the cache folder appears only whole."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache.parent, prefix=f".{cache.name}.") as tmp:
        tree = _unpack(sdist, Path(tmp) / "src")
        apply_series(tree, topics,
                     lambda topic, offsets: log(f"applied {topic.path.name}"
                                                + "".join(f"\n  {o}" for o in offsets)))
        raw = Path(tmp) / "raw"
        _pip_wheel(tree, raw, version, python, log)
        wheels = list(raw.glob("xgrammar-*.whl"))
        if len(wheels) != 1:
            raise KilnError(
                f"the build wrote {[w.name for w in wheels]}, expected one xgrammar wheel")
        tagged = repair(wheels[0], Path(tmp) / "wheel", PROVIDED_LIBS, log)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(tagged.parent, cache)
    return cache / tagged.name


def _unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar, naming(into):
        tar.extractall(into, filter="data")
    roots = [p for p in into.iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise KilnError(f"{sdist.name}: expected one top folder, found {[p.name for p in roots]}")
    return roots[0]


def _pip_wheel(tree: Path, dest: Path, version: str, python: Interpreter, log: Log) -> None:
    """``python``'s pip wheel with build isolation; ninja's [k/n] lines are reported as progress."""
    env = dict(os.environ)
    env["SETUPTOOLS_SCM_PRETEND_VERSION"] = version
    env["PIP_CONSTRAINT"] = str(BUILD_CONSTRAINTS)
    # 2 cores on CI and developer machines; more jobs only thrash memory during LTO.
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    cmd = [str(python.path), "-m", "pip", "wheel", "-v", "--no-deps",
           "--disable-pip-version-check", "-w", str(dest), str(tree)]
    log(f"building xgrammar {version} for Python {python.version} (CMake + ninja, "
        f"{env['CMAKE_BUILD_PARALLEL_LEVEL']} jobs)")
    tail: list[str] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line])[-60:]
            if m := _NINJA_STEP.search(line):
                log(f"  {python.tag}: compile step {m.group(1)}/{m.group(2)}")
    if proc.returncode != 0:
        raise KilnError(f"building the xgrammar wheel for Python {python.version} failed "
                        f"(pip exit {proc.returncode}):\n" + "".join(tail))


def _publish(wheel: Path, out: Path) -> Path:
    """Copy the wheel into ``out`` under a temporary name, then rename: never half a file."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / wheel.name
    fd, tmp_name = tempfile.mkstemp(dir=out, prefix=f".{wheel.name}.")
    os.close(fd)
    try:
        shutil.copyfile(wheel, tmp_name)
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; a wheel in dist/ is for anyone
        if sha256_of(Path(tmp_name)) != sha256_of(wheel):
            raise KilnError(f"copying {wheel.name} into {out} gave different bytes")
        os.replace(tmp_name, target)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class XgrammarEnvs:
    """One interpreter and a folder per xgrammar build, each put first on PYTHONPATH."""

    python: Path
    stock: Path
    fork: Path
    rebuilt: Path | None = None  # stock compiled here, when asked for

    @property
    def builds(self) -> list[str]:
        return ["stock", "fork"] + (["rebuilt"] if self.rebuilt is not None else [])

    def environ(self, which: str) -> dict[str, str]:
        """os.environ with build ``which`` (one of ``builds``) first on the import path."""
        if which not in self.builds:
            raise KilnError(f"unknown xgrammar build {which!r}; allowed: {', '.join(self.builds)}")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(getattr(self, which))] + [p for p in [env.get("PYTHONPATH")] if p])
        return env


def xgrammar_envs(log: Log = print, rebuilt: bool = False) -> XgrammarEnvs:
    """Stock 0.2.8 from the registry and the fork's build, each importable on its own;
    with ``rebuilt``, also stock compiled here (see rebuilt_stock_wheel)."""
    lock = XgrammarLock.load()
    series = load_series()
    stock = fetch_pinned(lock.stock_wheel, lambda d: download_from_index(lock.stock_wheel, d), log,
                         f"{LOCK_PATH} (stock_wheel)")
    fork, _ = fork_wheel(lock, series, log)
    return XgrammarEnvs(
        python=runtime_python(log),
        stock=install_target(stock, log),
        fork=install_target(fork, log),
        rebuilt=install_target(rebuilt_stock_wheel(lock, series, log), log) if rebuilt else None,
    )


def runtime_python(log: Log = print) -> Path:
    """This interpreter if it has xgrammar's dependencies, else a cached venv that does."""
    if _has_modules(Path(sys.executable), RUNTIME_MODULES):
        return Path(sys.executable)
    text = "\n".join([sys.version, TORCH, RUNTIME_REQUIREMENTS.read_text()])
    venv = cache_dir() / "venvs" / f"xgrammar-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    python = venv / "bin" / "python"
    if (venv / COMPLETE).exists():
        return python
    # A venv cannot be moved once made: build in place, mark complete last.
    shutil.rmtree(venv, ignore_errors=True)
    log(f"making {venv} (CPU torch + {RUNTIME_REQUIREMENTS.name})")
    _run([sys.executable, "-m", "venv", str(venv)], "create the xgrammar venv")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    _run([*pip, TORCH], "install CPU torch")
    _run([*pip, "-r", str(RUNTIME_REQUIREMENTS)], f"install {RUNTIME_REQUIREMENTS.name}")
    with naming(venv / COMPLETE):
        (venv / COMPLETE).write_text(text)
    return python


def install_target(wheel: Path, log: Log = print) -> Path:
    """A folder holding only this wheel's files (no dependencies), keyed by its hash."""
    target = cache_dir() / "xgrammar" / f"site-{sha256_of(wheel)[:16]}"
    if (target / COMPLETE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"unpacking {wheel.name} into {target}")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        _run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
              "--no-deps", "--target", tmp, str(wheel)], f"unpack {wheel.name}")
        with naming(Path(tmp) / COMPLETE):
            (Path(tmp) / COMPLETE).write_text(wheel.name + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        os.mkdir(tmp)  # TemporaryDirectory removes its folder on exit
    return target


def _has_modules(python: Path, modules: tuple[str, ...]) -> bool:
    code = ("import importlib.util, sys; "
            f"sys.exit(any(importlib.util.find_spec(m) is None for m in {modules!r}))")
    return subprocess.run([str(python), "-c", code], capture_output=True).returncode == 0


def _run(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise KilnError(f"{what} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def sdist_tests(log: Log = print) -> Path:
    """xgrammar's own test folder from the pinned sdist, unpacked once into the cache."""
    lock = XgrammarLock.load()
    target = cache_dir() / "xgrammar" / f"tests-{lock.sdist.sha256[:16]}"
    if (target / COMPLETE).exists():
        return target / "tests"
    sdist = fetch_sdist(lock, log)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        tree = _unpack(sdist, Path(tmp) / "src")
        shutil.move(str(tree / "tests"), str(Path(tmp) / "tests"))
        shutil.rmtree(Path(tmp) / "src")
        with naming(Path(tmp) / COMPLETE):
            (Path(tmp) / COMPLETE).write_text(lock.sdist.name + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        os.mkdir(tmp)  # TemporaryDirectory removes its folder on exit
    return target / "tests"

"""kiln gpu-bundle from the real fork wheel: contents, slimmed extensions, budget, refusals.

The first build slims and compresses 124 MB of extensions and the wheel's Python tree
(about a minute on 2 cores; the pieces are cached, keyed by their inputs and code).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import kiln.upstream.fetch
from kiln.abi import fatbin
from kiln.build.xgrammar import XgrammarLock, build_xgrammar, find_pythons
from kiln.cli import main
from kiln.errors import KilnError
from kiln.testing.gpubundle import (BUILT_WITH_NVCC, CARRIED, SIZE_LIMIT, STANDIN_MODULES,
                                    build_gpu_bundle)
from kiln.testing.gpulock import LOCK_PATH, GpuBundleLock
from kiln.testing.gpurun import gpu_visible

C_OPS = "vllm/_C_stable_libtorch.abi3.so"


@pytest.fixture(scope="module")
def xgrammar_cp312(tmp_path_factory) -> Path:
    """The fork's xgrammar for the bundle's Python, as `kiln build` writes it (cached)."""
    out = tmp_path_factory.mktemp("xgrammar")
    [build] = build_xgrammar(out, find_pythons([GpuBundleLock.load().python_version]),
                             log=lambda _: None)
    return build.path


@pytest.fixture(scope="module")
def bundle(fork_wheel, xgrammar_cp312, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu90") / "bundle"
    log: list[str] = []
    started = time.monotonic()
    # No --xgrammar: the bundle takes the cached cp312 build itself, as by default.
    built = build_gpu_bundle(out, (90,), fork_wheel, log=log.append)
    print(f"\ngpu-bundle --arch 90: {time.monotonic() - started:.0f} s\n" + "\n".join(log))
    return built


@pytest.fixture(scope="module")
def bundle86(fork_wheel, tmp_path_factory):
    return build_gpu_bundle(tmp_path_factory.mktemp("gpu86") / "bundle", (86,), fork_wheel,
                            log=lambda _: None)


def unpacked(bundle, name: str) -> bytes:
    return lzma.decompress((bundle.path / "compiled" / f"{name}.xz").read_bytes())


def test_the_bundle_fits_its_budget_and_nothing_else_is_left_beside_it(bundle):
    files = [p for p in bundle.path.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) == bundle.size <= SIZE_LIMIT
    assert [p.name for p in bundle.path.parent.iterdir()] == ["bundle"]
    assert bundle.archs == (90,)


def test_the_manifest_lists_every_file_with_its_size_and_sha256(bundle, fork_wheel):
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    on_disk = {str(p.relative_to(bundle.path)) for p in bundle.path.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk - {"manifest.json"}
    for rel, entry in manifest["files"].items():
        data = (bundle.path / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    with zipfile.ZipFile(fork_wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        assert f"Version: {manifest['fork_version']}\n" in zf.read(metadata).decode()
    assert manifest["archs"] == [90] and manifest["python_version"] == "3.12"
    assert manifest["built"].endswith("Z")


def test_the_manifest_names_the_platforms_and_glibc_of_the_fork_xgrammar(bundle, xgrammar_cp312):
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    lock = GpuBundleLock.load()
    platform = xgrammar_cp312.name[:-len(".whl")].split("-")[-1]
    assert platform.startswith("manylinux_2_")
    assert manifest["platforms"] == list(lock.platforms) + (
        [] if platform in lock.platforms else [platform])
    # The fork's build (GCC 12 here) needs a newer glibc than any registry wheel carried.
    assert manifest["glibc"] == "2." + platform.split("_")[2]
    for wheel in (bundle.path / "wheels").iterdir():
        minors = [int(t.split("_")[2]) for t in wheel.name[:-4].split("-")[-1].split(".")
                  if t.startswith("manylinux_2_")]
        assert not minors or min(minors) <= int(platform.split("_")[2]), wheel.name


def test_every_pinned_wheel_and_the_fork_xgrammar_are_there(bundle, xgrammar_cp312):
    lock = GpuBundleLock.load()
    wheels = bundle.path / "wheels"
    assert sorted(p.name for p in wheels.iterdir()) == sorted(
        [w.pin.name for w in lock.wheels] + [xgrammar_cp312.name])
    for wheel in lock.wheels:
        assert hashlib.sha256((wheels / wheel.pin.name).read_bytes()).hexdigest() == wheel.pin.sha256
    assert (wheels / xgrammar_cp312.name).read_bytes() == xgrammar_cp312.read_bytes()
    fork = XgrammarLock.load().fork_version
    assert xgrammar_cp312.name.startswith(f"xgrammar-{fork}-cp312-cp312-manylinux_2_")


def test_the_pinned_versions_satisfy_the_fork_wheels_requirements(fork_zip):
    metadata = next(n for n in fork_zip.namelist() if n.endswith(".dist-info/METADATA"))
    pinned = {w.project: w.version for w in GpuBundleLock.load().wheels}
    pinned["xgrammar"] = XgrammarLock.load().fork_version  # the fork's build, carried too
    checked = set()
    for line in fork_zip.read(metadata).decode().partition("\n\n")[0].splitlines():
        if line.startswith("Requires-Dist: ") and "extra ==" not in line:
            req = Requirement(line[len("Requires-Dist: "):])
            version = pinned.get(canonicalize_name(req.name))
            if version is not None:
                assert req.specifier.contains(version, prereleases=True), (req, version)
                checked.add(canonicalize_name(req.name))
    assert len(checked) >= 20 and "xgrammar" in checked


def test_the_stand_in_pynvml_and_the_run_script_are_there(bundle):
    for rel in STANDIN_MODULES:
        standin = bundle.path / "standins" / rel
        compile(standin.read_text(), str(standin), "exec")
    fa2 = bundle.path / "standins" / "vllm/vllm_flash_attn/_vllm_fa2_C.py"
    assert "registers no operator" in fa2.read_text()
    run = bundle.path / "run"
    assert os.access(run, os.X_OK) and run.read_text().startswith("#!/usr/bin/env bash\n")
    with tarfile.open(bundle.path / "vllm-python.tar.xz") as tree:
        assert tree.getmember("vllm/third_party/pynvml.py").size > 100_000


def test_the_python_tree_is_the_wheels_files_less_compiled_code_and_jit_headers(bundle, fork_zip):
    with tarfile.open(bundle.path / "vllm-python.tar.xz") as tree:
        members = {m.name: m for m in tree.getmembers()}
        wheel_names = {i.filename for i in fork_zip.infolist() if not i.is_dir()}
        assert set(members) <= wheel_names
        python = {n for n in wheel_names if n.endswith(".py")}
        assert python <= set(members)
        for name in sorted(python)[::50] + ["vllm/_version.py", "vllm/fork/manifest.json"]:
            assert tree.extractfile(name).read() == fork_zip.read(name), name
        for name in members:
            assert tree.extractfile(name).read(4) != b"\x7fELF", name
        assert not any(n.endswith("/RECORD") for n in members)
        assert any(n.endswith(".dist-info/entry_points.txt") for n in members)
        assert not any(n.startswith("vllm/third_party/deep_gemm/include/") for n in members)


def test_the_sources_take_the_bundle_for_the_repository_root(bundle):
    src = bundle.path / "src"
    for rel in ("kiln/__main__.py", "kiln/testing/tinymodel/corpus.txt", "bench", "kvarn/__init__.py",
                "specattn/__init__.py", "pyproject.toml"):
        assert (src / rel).exists(), rel
    result = subprocess.run(
        [sys.executable, "-c", "from kiln.paths import REPO_ROOT; from kiln.testing import tinymodel; "
         "print(REPO_ROOT); print(tinymodel.CORPUS.is_file())"],
        cwd=src, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(src), "True"]


def _readelf(*args: str) -> str:
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    return subprocess.run(["readelf", "-W", *args], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("name", sorted(CARRIED))
def test_a_slimmed_extension_differs_only_inside_zeroed_fatbin_payloads(bundle, fork_zip, name,
                                                                        tmp_path):
    if name in BUILT_WITH_NVCC and name not in fork_zip.namelist():
        pytest.skip(f"the wheel was built without nvcc: it has no {name}")
    original, slim = fork_zip.read(name), unpacked(bundle, name)
    assert len(slim) == len(original)
    expected = bytearray(original)
    for b in fatbin.read(original, name):
        for e in b.entries:
            if slim[e.payload_offset:e.end] == bytes(e.payload_size):
                expected[e.payload_offset:e.end] = bytes(e.payload_size)
    assert slim == bytes(expected)
    (tmp_path / "original.so").write_bytes(original)
    (tmp_path / "slim.so").write_bytes(slim)
    for args in (["--section-headers"], ["--dyn-syms"]):
        assert (_readelf(*args, str(tmp_path / "slim.so")).replace("slim.so", "X")
                == _readelf(*args, str(tmp_path / "original.so")).replace("original.so", "X"))


def _kept(original: bytes, slim: bytes, name: str) -> list[list[fatbin.Entry]]:
    """Per blob, the entries whose payload the slimmed file still holds."""
    return [[e for e in b.entries if slim[e.payload_offset:e.end] != bytes(e.payload_size)]
            for b in fatbin.read(original, name)]


def test_the_slimmed_core_ops_keep_exactly_the_sm_90_code(bundle, fork_zip):
    original = fork_zip.read(C_OPS)
    blobs = fatbin.read(original, C_OPS)
    kept = _kept(original, unpacked(bundle, C_OPS), C_OPS)
    assert sum(map(len, kept)) > 50
    for blob, entries in zip(blobs, kept):
        sm90 = [e for e in blob.entries if e.is_elf and e.arch == 90]
        if sm90:
            assert entries == sm90  # sm_90 and sm_90a machine code, nothing else
        else:
            ptx = [e for e in blob.entries if not e.is_elf and e.arch <= 90]
            newest = max((e.arch for e in ptx), default=None)
            assert entries == [e for e in ptx if e.arch == newest]


def test_the_kvarn_cuda_library_keeps_only_its_sm_90_code(bundle, fork_zip):
    name = "vllm/kvarn/libkvarn_decode.so"
    if name not in fork_zip.namelist():
        pytest.skip(f"the wheel was built without nvcc: it has no {name}")
    kept = _kept(fork_zip.read(name), unpacked(bundle, name), name)
    assert kept and [[e.name for e in entries] for entries in kept] == [["sm_90 ELF"]] * len(kept)


def test_arch_86_keeps_sm_86_or_else_sm_80_and_nothing_more(bundle86, fork_zip):
    original = fork_zip.read(C_OPS)
    blobs = fatbin.read(original, C_OPS)
    kept = _kept(original, unpacked(bundle86, C_OPS), C_OPS)
    for blob, entries in zip(blobs, kept):
        elf = {e.arch for e in blob.entries if e.is_elf}
        best = 86 if 86 in elf else 80 if 80 in elf else None
        if best:
            assert entries == [e for e in blob.entries if e.is_elf and e.arch == best]
        else:
            assert all(not e.is_elf and e.arch <= 86 for e in entries)
    assert {e.name for entries in kept for e in entries} == {"sm_80 ELF", "sm_86 ELF"}
    manifest = json.loads((bundle86.path / "manifest.json").read_text())
    assert manifest["archs"] == [86]


def test_an_arch_outside_the_allowed_set_is_a_clean_error(fork_wheel, tmp_path, capsys):
    code = main(["gpu-bundle", "--out", str(tmp_path / "b"), "--arch", "75",
                 "--wheel", str(fork_wheel)])
    assert code == 2
    assert capsys.readouterr().err == (
        "kiln gpu-bundle: error: --arch '75' is not an arch the bundle supports "
        "(allowed: 80, 86, 89, 90)\n")
    assert not (tmp_path / "b").exists()


def test_a_damaged_cached_wheel_is_downloaded_again_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    first = GpuBundleLock.load().wheels[0].pin
    cached = tmp_path / "cache" / "upstream" / first.name
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"corrupted")
    lines: list[str] = []
    lock = dataclasses.replace(GpuBundleLock.load(), wheels=GpuBundleLock.load().wheels[:1])
    assert lock.fetch(lines.append) == [cached]
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == first.sha256
    assert any("to tell a damaged file from a wrong pin" in line for line in lines)


def test_a_damaged_cached_wheel_that_cannot_be_checked_is_kept_and_nothing_built(
        fork_wheel, xgrammar_cp312, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    # Only that index: no pip.conf extra indexes or find-links that could still serve it.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setattr(kiln.upstream.fetch, "BACKOFF_SECONDS", 0.0)
    wheel = GpuBundleLock.load().wheels[0]
    first = wheel.pin
    cached = tmp_path / "cache" / "upstream" / first.name
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"corrupted")
    with pytest.raises(KilnError) as err:
        build_gpu_bundle(tmp_path / "b", (90,), fork_wheel, xgrammar_cp312, log=lambda _: None)
    assert str(err.value).startswith(
        f"{cached} has sha256 {hashlib.sha256(b'corrupted').hexdigest()}, but {LOCK_PATH} "
        f"({wheel.project}) pins {first.sha256}, and downloading it again failed")
    assert "the file was kept" in str(err.value)
    assert cached.read_bytes() == b"corrupted"
    assert not (tmp_path / "b").exists()


def test_an_over_budget_bundle_is_refused_naming_its_largest_parts(bundle, fork_wheel,
                                                                   xgrammar_cp312, tmp_path):
    with pytest.raises(KilnError) as err:
        build_gpu_bundle(tmp_path / "b", (90,), fork_wheel, xgrammar_cp312, limit=20 * 2**20,
                         log=lambda _: None)
    message = str(err.value)
    assert message.startswith(f"the bundle would be {bundle.size / 2**20:.1f} MiB, over its "
                              "20.0 MiB limit; largest parts: compiled/vllm/_C_stable_libtorch")
    core = bundle.parts[f"compiled/{C_OPS}.xz"]
    assert f"compiled/{C_OPS}.xz {core / 2**20:.1f} MiB, " in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(gpu_visible(), reason="this machine has an NVIDIA GPU")
def test_run_refuses_a_machine_without_a_gpu_at_once(bundle, tmp_path):
    started = time.monotonic()
    result = subprocess.run(["bash", str(bundle.path / "run"), str(tmp_path / "results")],
                            capture_output=True, text=True)
    assert result.returncode == 3
    assert "kiln gpu bundle: refused: no CUDA GPU on this machine" in result.stderr
    assert time.monotonic() - started < 30
    assert not (tmp_path / "results").exists()


def test_install_lays_out_the_wheels_python_compiled_files_and_stand_ins(bundle, tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "kiln.testing.gpurun", "install", str(bundle.path),
                             str(site)], env={**os.environ, "PYTHONPATH": str(bundle.path / "src")},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for name in CARRIED:
        if name in BUILT_WITH_NVCC and not (bundle.path / "compiled" / f"{name}.xz").exists():
            continue  # a wheel built without nvcc
        assert (site / name).read_bytes() == unpacked(bundle, name)
        assert os.access(site / name, os.X_OK)
    for rel in STANDIN_MODULES:
        assert (site / rel).read_text() == (bundle.path / "standins" / rel).read_text()
    assert (site / "vllm" / "third_party" / "pynvml.py").is_file()
    assert os.access(site / "bin" / "vllm", os.X_OK)
    installed = {canonicalize_name(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    assert {w.project for w in GpuBundleLock.load().wheels} | {"vllm", "xgrammar"} == installed
    # The fork's xgrammar, installed by the tags the manifest gives pip.
    assert (site / f"xgrammar-{XgrammarLock.load().fork_version}.dist-info").is_dir()


def test_install_refuses_a_damaged_copy_naming_the_file(bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundle.path, copy)
    damaged = next((copy / "wheels").glob("pydantic-*.whl"))
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    result = subprocess.run([sys.executable, "-m", "kiln.testing.gpurun", "install", str(copy),
                             str(tmp_path / "site")],
                            env={**os.environ, "PYTHONPATH": str(copy / "src")},
                            capture_output=True, text=True)
    assert result.returncode == 3
    assert result.stderr.startswith("kiln gpu bundle: error: 1 file(s) of the bundle differ "
                                    f"from its manifest (copied incompletely?): wheels/{damaged.name}")
    assert not (tmp_path / "site").exists()

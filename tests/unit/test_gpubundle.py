"""kiln.testing.gpubundle's rules that need no wheel: archs, the size budget, the output folder, the lock."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.build.pins import canonical
from kiln.errors import KilnError
from kiln.testing.gpubundle import (
    build_gpu_bundle,
    bundle_xgrammar,
    check_budget,
    glibc_needed,
    parse_archs,
    platform_tags,
)
from kiln.testing.gpulock import GpuBundleLock


@pytest.mark.parametrize("values, archs", [
    (["90"], (90,)),
    (["86,80", "90"], (80, 86, 90)),
    ([" 89 , 89"], (89,)),
])
def test_archs_are_repeatable_and_comma_separated(values, archs):
    assert parse_archs(values) == archs


@pytest.mark.parametrize("values, bad", [(["75"], "'75'"), (["90,100"], "'100'"),
                                         (["sm_90"], "'sm_90'")])
def test_other_archs_are_refused_naming_the_value_and_the_allowed_set(values, bad):
    with pytest.raises(KilnError) as err:
        parse_archs(values)
    assert str(err.value) == f"--arch {bad} is not an arch the bundle supports (allowed: 80, 86, 89, 90)"


def test_no_arch_at_all_is_refused():
    with pytest.raises(KilnError, match="no arch given"):
        parse_archs([","])


def test_an_over_budget_bundle_names_its_largest_parts_first():
    parts = {"wheels/a.whl": 3 * 2**20, "compiled/vllm/_C.so.xz": 14 * 2**20, "src": 300 * 2**10,
             "vllm-python.tar.xz": 6 * 2**20}
    check_budget(parts, 24 * 2**20)
    with pytest.raises(KilnError) as err:
        check_budget(parts, 20 * 2**20)
    assert str(err.value) == (
        "the bundle would be 23.3 MiB, over its 20.0 MiB limit; largest parts: "
        "compiled/vllm/_C.so.xz 14.0 MiB, vllm-python.tar.xz 6.0 MiB, wheels/a.whl 3.0 MiB, "
        "src 300 KiB")


def test_a_folder_that_is_not_a_bundle_is_never_replaced(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(KilnError, match="exists and is not a GPU bundle"):
        build_gpu_bundle(tmp_path, (90,), tmp_path / "missing.whl")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_missing_wheel_is_refused_before_anything_is_fetched(tmp_path: Path):
    with pytest.raises(KilnError, match="missing.whl: no such wheel"):
        build_gpu_bundle(tmp_path / "bundle", (90,), tmp_path / "missing.whl")
    assert not (tmp_path / "bundle").exists()


# What the lent H200's image already has of the fork's requirements
# (../shared/gpu-notes.md section 4): the bundle must not carry another copy.
ON_THE_GPU_MACHINE = ("torch", "triton", "transformers", "tokenizers", "numpy", "safetensors",
                      "huggingface-hub", "numba", "protobuf", "aiohttp", "pillow",
                      "opencv-python-headless", "requests", "tqdm", "regex", "psutil",
                      "sentencepiece", "tiktoken", "pyyaml", "einops", "cloudpickle", "ninja")


def test_the_lock_pins_cp312_linux_wheels_of_what_the_gpu_machine_lacks():
    lock = GpuBundleLock.load()
    assert lock.python_version == "3.12"
    # 29 from the registry (orjson since 0.33.0); xgrammar is the fork's own build, added by gpu-bundle.
    assert len(lock.wheels) == 29
    assert "xgrammar" not in {w.project for w in lock.wheels}
    for wheel in lock.wheels:
        name = wheel.pin.name
        assert canonical(name.split("-")[0]) == wheel.project, name
        python, abi, platform = name[:-len(".whl")].split("-")[-3:]
        assert python in ("py3", "cp312") or abi == "abi3", name
        assert platform == "any" or any(p in platform.split(".") for p in lock.platforms), name
        assert len(wheel.pin.sha256) == 64
    assert not {w.project for w in lock.wheels} & set(ON_THE_GPU_MACHINE)


@pytest.mark.parametrize("text, missing", [
    (('python_version = "3.12"\n[wheels.a]\nwheel = "a-1-py3-none-any.whl"\n'
     'wheel_sha256 = "00"\n'), "platforms"),
    ('python_version = "3.12"\nplatforms = []\n[wheels.a]\nwheel = "a-1-py3-none-any.whl"\n',
     "wheel_sha256"),
])
def test_a_lock_missing_a_setting_is_refused_naming_it(tmp_path: Path, text, missing):
    path = tmp_path / "gpu-bundle.lock"
    path.write_text(text)
    with pytest.raises(KilnError, match=f"gpu-bundle.lock: lacks {missing}; it needs"):
        GpuBundleLock.load(path)


def test_platform_tags_and_the_glibc_the_wheels_need():
    fork = "xgrammar-0.2.8+kiln.2-cp312-cp312-manylinux_2_36_x86_64.whl"
    both = "msgspec-0.23.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl"
    assert platform_tags(both) == ["manylinux2014_x86_64", "manylinux_2_17_x86_64",
                                   "manylinux_2_28_x86_64"]
    # A wheel tagged 2_17 and 2_28 runs on glibc 2.17: its oldest tag is what it needs.
    assert glibc_needed([both]) == "2.17"
    assert glibc_needed([both, fork, "sniffio-1.3.1-py3-none-any.whl"]) == "2.36"
    assert glibc_needed(["sniffio-1.3.1-py3-none-any.whl"]) is None


def test_the_bundle_refuses_an_xgrammar_wheel_for_another_python(tmp_path: Path):
    cp311 = tmp_path / "xgrammar-0.2.8+kiln.2-cp311-cp311-manylinux_2_36_x86_64.whl"
    cp311.write_bytes(b"not read: refused by its name")
    with pytest.raises(KilnError, match=r"no xgrammar wheel for Python 3\.12 \(cp312\) among: "
                       r"xgrammar-0\.2\.8\+kiln\.2-cp311"):
        bundle_xgrammar("3.12", cp311, log=lambda _: None)


def test_the_bundle_refuses_stock_xgrammar_naming_the_fork_version(tmp_path: Path):
    stock = tmp_path / "xgrammar-0.2.8-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
    stock.write_bytes(b"not read: refused by its name")
    with pytest.raises(KilnError) as err:
        bundle_xgrammar("3.12", stock, log=lambda _: None)
    assert str(err.value) == (f"{stock.name} is not the fork's xgrammar 0.2.8+kiln.4, which the "
                              "bundle carries (requirements/xgrammar.lock)")
    with pytest.raises(KilnError, match="missing.whl: no such wheel; build one with "
                       r"`python3 -m kiln build-xgrammar --python 3\.12`"):
        bundle_xgrammar("3.12", tmp_path / "missing.whl", log=lambda _: None)

"""The fork's xgrammar wheels: one per Python, tagged manylinux as auditwheel reads them,
and the README's install line takes the right one in a real venv of each Python.

The wheels come from the build cache (tests/run built them with `kiln build`; cold,
the fixture builds them, minutes each). Each venv gets apache-tvm-ffi (what loads the
bindings; xgrammar's other requirements, torch among them, are left out), then the
README's line verbatim, then load_worker.py loads the installed bindings and matches a
bounded string with them.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.abi.manylinux import audit
from kiln.build.xgrammar import PROVIDED_LIBS, PYTHONS, XgrammarBuild, XgrammarLock, build_xgrammar, find_pythons
from kiln.paths import REPO_ROOT

HERE = Path(__file__).resolve().parent
# The README's line for the fork's xgrammar alone (its CPU install); the GPU line adds
# the vllm wheel and the index to the same -c/--find-links pair.
README_LINE = ("pip install --no-deps --no-index -c requirements/xgrammar-constraints.txt "
               "--find-links dist xgrammar")
LIBRARY = "xgrammar/libxgrammar_bindings.so"
WHEEL_NAME = re.compile(r"xgrammar-(?P<version>[^-]+)-(?P<py>cp3\d+)-(?P<abi>cp3\d+)-"
                        r"(?P<platform>manylinux_2_(?P<glibc>\d+)_x86_64)\.whl")


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> tuple[Path, dict[str, XgrammarBuild]]:
    """One folder holding the wheel of every supported Python, as `kiln build` writes it."""
    out = tmp_path_factory.mktemp("xgrammar") / "dist"
    builds = build_xgrammar(out, find_pythons(PYTHONS),
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    return out, {b.python: b for b in builds}


def test_one_wheel_per_python_each_tagged_manylinux_for_its_python(dist):
    out, builds = dist
    assert sorted(p.name for p in out.iterdir()) == sorted(b.path.name for b in builds.values())
    version = XgrammarLock.load().fork_version
    for python, build in builds.items():
        tag = "cp" + python.replace(".", "")
        name = WHEEL_NAME.fullmatch(build.path.name)
        assert name, build.path.name
        assert (name["version"], name["py"], name["abi"]) == (version, tag, tag)
        with zipfile.ZipFile(build.path) as zf:
            wheel = zf.read(f"xgrammar-{version}.dist-info/WHEEL").decode()
            metadata = zf.read(f"xgrammar-{version}.dist-info/METADATA").decode()
        assert re.findall(r"^Tag: (.+)$", wheel, re.M) == [f"{tag}-{tag}-{name['platform']}"]
        # The one library left out of the wheel comes with this requirement.
        assert "\nRequires-Dist: apache-tvm-ffi>=0.1.11\n" in metadata


def test_auditwheel_accepts_each_wheel_under_the_tag_it_carries(dist):
    """The tag is the one the wheel's versioned symbols allow, and it holds once the library
    its requirement ships (libtvm_ffi.so) is left aside: nothing else outside the policy."""
    _, builds = dist
    for python, build in builds.items():
        found = audit(build.path, log=lambda m: print(m, file=sys.stderr))
        platform = WHEEL_NAME.fullmatch(build.path.name)["platform"]
        print(f"{build.path.name}: auditwheel show: {found.text}", file=sys.stderr)
        assert found.symbol_tag == platform, (python, found.text)
        assert set(found.external_libs) == set(PROVIDED_LIBS), (python, found.text)
        assert found.reaches(platform, PROVIDED_LIBS), (python, found.text)
        # Only the C and C++ runtimes the policy allows.
        assert set(found.versioned_symbols) <= {"libc.so.6", "libm.so.6", "libgcc_s.so.1",
                                                "libstdc++.so.6"}, found.versioned_symbols


def test_the_readme_installs_from_one_folder_with_this_line():
    lines = [line.strip() for line in (REPO_ROOT / "README.md").read_text().splitlines()]
    assert README_LINE in lines


@pytest.mark.parametrize("version", PYTHONS)
def test_the_readme_line_takes_the_wheel_of_each_pythons_own_tag(dist, version, tmp_path):
    out, builds = dist
    build = builds[version]
    [python] = find_pythons([version])
    venv = tmp_path / "venv"
    _run([python.path, "-m", "venv", venv])
    pip = [venv / "bin" / "python", "-m", "pip", "--disable-pip-version-check"]
    pins = [line for line in (REPO_ROOT / "requirements" / "xgrammar-test.txt").read_text()
            .splitlines() if line.startswith(("apache-tvm-ffi==", "typing-extensions=="))]
    _run([*pip, "install", "-q", *pins])
    args = shlex.split(README_LINE)
    assert args[:2] == ["pip", "install"]
    _run([*pip, *(str(out) if a == "dist" else a for a in args[1:])], cwd=REPO_ROOT)
    loaded = json.loads(_run([venv / "bin" / "python", HERE / "load_worker.py"]).stdout)
    with zipfile.ZipFile(build.path) as zf:
        library = hashlib.sha256(zf.read(LIBRARY)).hexdigest()
    tag = "cp" + version.replace(".", "")
    platform = WHEEL_NAME.fullmatch(build.path.name)["platform"]
    assert loaded["version"] == XgrammarLock.load().fork_version
    assert loaded["tags"] == [f"{tag}-{tag}-{platform}"]
    assert loaded["library_sha256"] == library  # pip installed exactly this Python's wheel
    # The fork's code runs: its counted string rule, escapes counted as one character, and
    # maxLength -1 refused (stock reads it as no bound).
    assert len(loaded["bounded_rules"]) == 1
    assert loaded["decisions"] == [True, False, True]
    assert "maxLength must be a non-negative integer" in loaded["max_length_minus_one"]


def test_with_the_index_the_constraints_never_fall_back_to_stock(tmp_path):
    """vLLM requires xgrammar==0.2.8, which the index has; with a folder lacking a fork wheel
    for this Python, the constraints make pip stop rather than take stock."""
    (tmp_path / "dist").mkdir()
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
           "--disable-pip-version-check", "--find-links", str(tmp_path / "dist")]
    stock = _run([*pip, "xgrammar==0.2.8"], cwd=REPO_ROOT)
    assert "Would install xgrammar-0.2.8\n" in stock.stdout  # the index is there
    result = subprocess.run([*pip, "-c", "requirements/xgrammar-constraints.txt",
                             "xgrammar==0.2.8"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode != 0, result.stdout
    assert "Would install" not in result.stdout
    fork = XgrammarLock.load().fork_version
    assert f"The user requested (constraint) xgrammar=={fork}" in result.stdout + result.stderr
    assert "ResolutionImpossible" in result.stderr

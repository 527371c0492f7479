"""Which Pythons the fork's xgrammar is built with, and which wheel each Python takes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kiln.build.xgrammar import PYTHONS, find_python, find_pythons, parse_pythons, wheel_for_python
from kiln.cli import main
from kiln.errors import KilnError
from kiln.upstream.lock import UpstreamLock

WHEELS = [Path(f"dist/xgrammar-0.2.8+kiln.2-{t}-{t}-manylinux_2_36_x86_64.whl")
          for t in ("cp311", "cp312", "cp313")]


@pytest.mark.parametrize("values, pythons", [
    (["3.12"], ("3.12",)),
    (["3.13,3.11"], ("3.11", "3.13")),
    (["3.12", " 3.11 , 3.12"], ("3.11", "3.12")),
    (list(PYTHONS), PYTHONS),
])
def test_pythons_are_repeatable_comma_separated_and_kept_in_order(values, pythons):
    assert parse_pythons(values) == pythons


@pytest.mark.parametrize("value", ["3.10", "3.14", "312", "cp312"])
def test_other_pythons_are_refused_naming_the_allowed_set(value):
    with pytest.raises(KilnError) as err:
        parse_pythons([value])
    assert str(err.value) == (f"--python {value!r} is not a Python the fork's xgrammar is built "
                              "for (allowed: 3.11, 3.12, 3.13)")


def test_the_running_python_is_found_as_itself():
    version = "{}.{}".format(*sys.version_info[:2])
    python, _ = find_python(version)
    assert python is not None and python.version == version
    assert python.tag == "cp" + version.replace(".", "")


def test_a_missing_python_is_named_with_how_to_get_it(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    monkeypatch.setenv("PATH", str(tmp_path))
    version = "{}.{}".format(*sys.version_info[:2])
    with pytest.raises(KilnError) as err:
        find_pythons([version, "3.99"])
    assert str(err.value) == (
        f"the fork's xgrammar is built with each Python asked for ({version}, 3.99); not found: "
        "Python 3.99 (looked for python3.99 on PATH and under $PYENV_ROOT/versions/3.99.*). "
        "Install with `pyenv install 3.99` (or your distribution's python3.X and its pip), "
        f"or build only for the others with --python {version}")


def test_build_xgrammar_stops_before_building_when_a_python_is_missing(tmp_path: Path,
                                                                      monkeypatch, capsys):
    missing = next(v for v in PYTHONS if v != "{}.{}".format(*sys.version_info[:2]))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    code = main(["build-xgrammar", "--out", str(tmp_path / "dist"), "--python", missing])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln build-xgrammar: error: the fork's xgrammar is built with each "
                          f"Python asked for ({missing}); not found: Python {missing}")
    assert f"`pyenv install {missing}`" in err
    assert not (tmp_path / "dist").exists() and not (tmp_path / "cache" / "xgrammar").exists()


@pytest.mark.parametrize("version, index", [("3.11", 0), ("3.12", 1), ("3.13", 2)])
def test_each_python_takes_the_wheel_of_its_own_tag(version, index):
    assert wheel_for_python(WHEELS, version) == WHEELS[index]


def test_a_python_without_a_wheel_is_told_how_to_build_one():
    with pytest.raises(KilnError) as err:
        wheel_for_python(WHEELS[:2], "3.13")
    assert str(err.value) == (
        f"no xgrammar wheel for Python 3.13 (cp313) among: {WHEELS[0].name}, {WHEELS[1].name}; "
        "build it with `python3 -m kiln build-xgrammar --python 3.13`")


def test_two_wheels_for_one_python_are_refused():
    other = Path("xgrammar-0.2.8+kiln.2-cp312-cp312-linux_x86_64.whl")
    with pytest.raises(KilnError, match=r"more than one xgrammar wheel for Python 3\.12"):
        wheel_for_python([*WHEELS, other], "3.12")


def test_test_env_refuses_xgrammar_wheels_none_of_which_is_for_its_python(tmp_path: Path,
                                                                          capsys):
    """Checked before any venv is made: the venv's Python is this one."""
    version = "{}.{}".format(*sys.version_info[:2])
    wheel = tmp_path / f"vllm-{UpstreamLock.load().default}+kiln.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not read")
    others = [tmp_path / w.name for w in WHEELS if f"-cp{version.replace('.', '')}-" not in w.name]
    for path in others:
        path.write_bytes(b"not read")
    code = main(["test-env", "--wheel", str(wheel), "--xgrammar", *map(str, others)])
    assert code == 2
    assert (f"no xgrammar wheel for Python {version} (cp{version.replace('.', '')}) among: "
            in capsys.readouterr().err)

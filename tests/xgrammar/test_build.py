"""The fork's xgrammar wheel: pins agree, the series is well-formed, bad schemas fail cleanly."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from kiln.build.xgrammar import PYTHONS, XgrammarLock, build_xgrammar, find_pythons, load_series
from kiln.paths import REPO_ROOT
from tests.xgrammar.conftest import decisions


def test_constraints_pin_the_locked_fork_version():
    lock = XgrammarLock.load()
    text = (REPO_ROOT / "requirements" / "xgrammar-constraints.txt").read_text()
    pins = re.findall(r"^xgrammar==(\S+)$", text, re.MULTILINE)
    assert pins == [lock.fork_version]


def test_series_headers_are_complete_and_cut_against_the_lock():
    lock = XgrammarLock.load()
    series = load_series()  # raises on any header problem
    assert [t.fields["Cut-against"] for t in series.topics] == [lock.version] * len(series.topics)


def test_build_publishes_the_wheels_whole_and_replaces_an_older_tag(tmp_path: Path):
    """A rebuild of cached inputs is a copy; nothing but the wheels lands in --out, and an
    earlier build of this version for one of the Pythons (another tag) is replaced."""
    pythons = find_pythons(PYTHONS)
    build_xgrammar(tmp_path / "first", pythons, log=lambda _: None)  # builds what is missing
    dist = tmp_path / "dist"
    dist.mkdir()
    version = XgrammarLock.load().fork_version
    older = dist / f"xgrammar-{version}-cp311-cp311-linux_x86_64.whl"
    other = dist / "xgrammar-0.2.8+kiln.1-cp311-cp311-linux_x86_64.whl"
    for path in (older, other):
        path.write_bytes(b"an earlier build")
    builds = build_xgrammar(dist, pythons, log=lambda _: None)
    assert [b.python for b in builds] == list(PYTHONS)
    assert all(b.cached for b in builds)
    assert sorted(p.name for p in dist.iterdir()) == sorted(
        [other.name] + [b.path.name for b in builds])
    for build in builds:
        with zipfile.ZipFile(build.path) as zf:
            metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            assert f"\nVersion: {build.version}\n" in zf.read(metadata).decode()


def _string_schema(**bounds: int) -> dict:
    return {"type": "object", "properties": {"s": {"type": "string", **bounds}}, "required": ["s"]}


BAD = {
    "min > max": _string_schema(minLength=5, maxLength=2),
    "negative maxLength": _string_schema(maxLength=-5),
    "maxLength -1": _string_schema(maxLength=-1),
    "negative minLength": _string_schema(minLength=-3),
    "minLength 10^12": _string_schema(minLength=10**12),
}


def test_bad_bounds_fail_with_an_error_naming_the_bound(envs):
    """Every schema stock refuses, the fork refuses too, naming minLength or maxLength.

    Stock reads maxLength -1 as "no bound" and accepts the document; the fork refuses it
    like any other negative length (the clearer error issue 4 allows).
    """
    cases = [{"schema": s, "docs": ['{"s": "abc"}']} for s in BAD.values()]
    stock = dict(zip(BAD, decisions(envs, "stock", cases, timeout=300)))
    fork = dict(zip(BAD, decisions(envs, "fork", cases, timeout=300)))
    assert stock["maxLength -1"] == [True]
    for name, result in fork.items():
        assert isinstance(result, str) and ("minLength" in result or "maxLength" in result), (
            name, result)
    assert all(isinstance(stock[n], str) for n in BAD if n != "maxLength -1"), stock


def test_huge_bounds_compile_and_agree_with_stock(envs):
    """maxLength 10^12 is beyond int32 and means no bound for both; 10^6 is a real bound.

    The timeout is a hang guard, not a speed target (compile time is in the benchmark).
    """
    docs = ['{"s": "abc"}', '{"s": "a\\nb"}', '{"s": ""}']
    cases = [{"schema": _string_schema(maxLength=10**12), "docs": docs},
             {"schema": _string_schema(maxLength=10**6, minLength=1), "docs": docs}]
    assert decisions(envs, "fork", cases, timeout=300) == [[True, True, True], [True, True, False]]
    # Stock agrees except for the escape it wrongly rejects inside the 10^6 bound.
    assert decisions(envs, "stock", cases, timeout=300) == [[True, True, True],
                                                             [True, False, False]]

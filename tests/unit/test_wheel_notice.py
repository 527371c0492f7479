"""The fork wheel carries the fork's NOTICE beside upstream's license (Apache-2.0: a
modified vLLM says so), built for real from a synthetic upstream wheel."""

from __future__ import annotations

import csv
import io
import zipfile

import pytest

from kiln.build.metadata import dist_info_files
from kiln.build.pins import PinChanges
from kiln.errors import KilnError
from kiln.paths import REPO_ROOT


def _built_wheel(checkout, out) -> zipfile.ZipFile:
    result = checkout.run("build", "--out", str(out), "--no-xgrammar")
    assert result.returncode == 0, result.stderr
    [wheel] = out.glob("vllm-*.whl")
    return zipfile.ZipFile(wheel)


def test_the_wheel_carries_the_notice_beside_upstreams_license(checkout, tmp_path):
    with _built_wheel(checkout, tmp_path / "dist") as wheel:
        [dist] = {n.split("/")[0] for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info")}
        assert dist.startswith("vllm-1.0.0+kiln.")
        assert wheel.read(f"{dist}/licenses/NOTICE") == (REPO_ROOT / "NOTICE").read_bytes()
        assert wheel.read(f"{dist}/licenses/LICENSE") == b"upstream's license text\n"
        record = {row[0] for row in csv.reader(io.StringIO(wheel.read(f"{dist}/RECORD").decode()))}
    assert {f"{dist}/licenses/NOTICE", f"{dist}/licenses/LICENSE"} <= record


def test_the_notice_says_the_wheel_is_a_modified_vllm_under_apache_2():
    notice = " ".join((REPO_ROOT / "NOTICE").read_text().split())
    assert "modified version of vLLM" in notice
    assert "Copyright the vLLM contributors" in notice
    assert "Apache License, Version 2.0" in notice
    assert (REPO_ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_a_checkout_without_a_notice_builds_no_wheel(checkout, tmp_path):
    (checkout.root / "NOTICE").unlink()
    out = tmp_path / "dist"
    result = checkout.run("build", "--out", str(out), "--no-xgrammar")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln build: error: "), result.stderr
    assert f"{checkout.root / 'NOTICE'} is missing" in lines[0]
    assert not list(out.glob("*.whl"))


def test_an_upstream_notice_is_never_replaced_by_the_forks(tmp_path):
    path = tmp_path / "upstream.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm-1.0.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 1.0.0\n")
        z.writestr("vllm-1.0.0.dist-info/licenses/NOTICE", "upstream's notice\n")
    with zipfile.ZipFile(path) as upstream, pytest.raises(KilnError) as err:
        dist_info_files(upstream, "1.0.0+kiln.0", PinChanges(), b"ours\n")
    assert "carries vllm-1.0.0.dist-info/licenses/NOTICE" in str(err.value)

"""The fork wheel against the pristine upstream wheel, entry by entry."""

import base64
import csv
import hashlib
import io
import json
import re
import subprocess

from kiln.paths import REPO_ROOT
from kiln.series.series import Series, series_dir
from kiln.upstream.lock import UpstreamLock


def _dist_info(names):
    (found,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    return found


def test_the_wheel_name_keeps_upstreams_tags_with_the_fork_version(fork_wheel, pristine_files):
    name = fork_wheel.name
    default = re.escape(UpstreamLock.load().default)  # tests/run builds the default pin
    assert re.fullmatch(rf"vllm-{default}\+kiln\.\d+[.a-z0-9]*-cp38-abi3-manylinux_2_28_x86_64\.whl",
                        name), name
    assert pristine_files.wheel.name.split("-")[2:] == name.split("-")[2:]


def test_every_record_entry_has_the_right_hash_and_size(fork_zip):
    names = [i.filename for i in fork_zip.infolist() if not i.is_dir()]
    record_name = f"{_dist_info(names)}/RECORD"
    rows = list(csv.reader(io.StringIO(fork_zip.read(record_name).decode())))
    assert all(len(row) == 3 for row in rows)
    assert any("," in path for path, _, _ in rows), "upstream has paths with commas"
    listed = {path for path, _, _ in rows}
    assert listed == set(names) and len(rows) == len(names)
    for path, digest, size in rows:
        if path == record_name:
            assert digest == "" and size == ""
            continue
        data = fork_zip.read(path)
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={expected}", path
        assert int(size) == len(data), path


def test_upstream_files_are_byte_identical_unless_a_topic_patches_them(fork_zip, upstream_zip,
                                                                     upstream_version):
    topics = Series.load(series_dir(upstream_version)).topics
    patched = {p for t in topics for p in t.files()} | {"vllm/_version.py"}
    up_dist = _dist_info(upstream_zip.namelist())
    fork_names = set(fork_zip.namelist())
    compiled = 0
    for info in upstream_zip.infolist():
        name = info.filename
        if info.is_dir() or name.startswith(up_dist + "/"):
            continue
        assert name in fork_names, f"{name} is missing from the fork wheel"
        same = fork_zip.read(name) == upstream_zip.read(name)
        assert same != (name in patched), name
        if not name.endswith(".py"):
            compiled += 1
    assert compiled > 100  # the .so files, the vllm-rs binary, kernels' data files


def test_metadata_is_upstreams_with_the_fork_version(fork_zip, upstream_zip, fork_wheel,
                                                    upstream_version):
    fork_meta = fork_zip.read(f"{_dist_info(fork_zip.namelist())}/METADATA").decode().splitlines()
    up_meta = upstream_zip.read(f"{_dist_info(upstream_zip.namelist())}/METADATA").decode().splitlines()
    version = fork_wheel.name.split("-")[1]
    assert len(fork_meta) == len(up_meta)
    differ = [(a, b) for a, b in zip(up_meta, fork_meta) if a != b]
    # Only the version differs, and requirements/fork-pins.txt's one change: 0.34.0's
    # flashinfer-python 0.7.3, which the index never had.
    expected = [(f"Version: {upstream_version}", f"Version: {version}")]
    if upstream_version == "0.34.0":
        expected.append(("Requires-Dist: flashinfer-python==0.7.3",
                         "Requires-Dist: flashinfer-python==0.7.4"))
    assert differ == expected


def test_the_version_module_and_manifest_name_the_fork(fork_zip, fork_wheel, upstream_version):
    version = fork_wheel.name.split("-")[1]
    namespace = {}
    exec(fork_zip.read("vllm/_version.py").decode(), namespace)
    assert namespace["__version__"] == version
    assert namespace["__version_tuple__"][:3] == tuple(map(int, upstream_version.split(".")))
    manifest = json.loads(fork_zip.read("vllm/fork/manifest.json"))
    assert manifest == {"fork_version": version, "upstream_version": upstream_version,
                        "topics": [t.name for t in Series.load(series_dir(upstream_version)).topics]}


def test_tracked_overlay_kvarn_and_specattn_files_are_inside_the_package(fork_zip):
    tracked = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "vllm", "kvarn", "specattn"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked
    for rel in tracked:
        inside = rel if rel.startswith("vllm/") else "vllm/" + rel
        assert fork_zip.read(inside) == (REPO_ROOT / rel).read_bytes(), rel


def test_entry_points_are_upstreams_plus_the_fork_plugin(fork_zip, upstream_zip):
    fork = fork_zip.read(f"{_dist_info(fork_zip.namelist())}/entry_points.txt").decode()
    upstream = upstream_zip.read(f"{_dist_info(upstream_zip.namelist())}/entry_points.txt")
    assert fork.startswith(upstream.decode().rstrip("\n"))
    assert fork.endswith("[vllm.general_plugins]\nkiln_fork = vllm.fork.plugin:register\n")

"""Every carried series (patches/<version>/) on its real pristine tree: none goes unread."""

import zipfile

import pytest

from kiln.series.patching import apply_series_into
from kiln.series.series import Series, carried_versions, series_dir
from kiln.series.verify import verify
from kiln.upstream.fetch import fetch
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pristine import PristineTree

VERSIONS = carried_versions()


def test_the_default_pin_and_every_folder_under_patches_is_a_carried_series():
    lock = UpstreamLock.load()
    assert lock.default in VERSIONS
    assert set(VERSIONS) <= set(lock.releases), "a series folder for a pin the lock lacks"
    folders = {p.name for p in series_dir().parent.iterdir() if p.is_dir()}
    assert folders - set(VERSIONS) == {"xgrammar"}, "a folder under patches/ no command reads"


@pytest.fixture(scope="module", params=VERSIONS)
def pin(request):
    files = fetch(request.param, log=lambda _: None)
    return request.param, files, PristineTree.from_files(files)


def test_the_series_applies_to_pristine_without_fuzz(pin, tmp_path):
    version, _, tree = pin
    series = Series.load(series_dir(version))
    assert {t.fields["Cut-against"] for t in series.topics} == {version}
    applied = []
    apply_series_into(tree.root, series, tmp_path / "tree",
                      on_topic=lambda t, offsets: applied.append((t.name, offsets)))
    assert [name for name, _ in applied] == [t.name for t in series.topics]
    for topic in series.topics:
        for path in topic.files():
            assert (tmp_path / "tree" / path).read_bytes() != (tree.root / path).read_bytes()


def test_verify_passes_every_check(pin):
    version, files, tree = pin
    with zipfile.ZipFile(files.wheel) as wheel:
        names = wheel.namelist()
    report = verify(tree, series_dir(version), wheel_files=names, log=lambda _: None)
    failed = [(name, detail) for name, ok, detail in report.checks if not ok]
    assert failed == []
    names = [name for name, _, _ in report.checks]
    assert "materialize then export changes 0 bytes" in names
    assert dict((n, d) for n, _, d in report.checks)["pristine + series equals the branch tree"] == "0 differing files"


@pytest.mark.parametrize("version", [v for v in VERSIONS if v != UpstreamLock.load().default])
def test_every_other_carried_pin_still_builds_its_wheel(version, tmp_path):
    """tests/run builds and tests the default pin; the others must stay buildable."""
    import json

    from kiln.build.wheel import build_wheel

    build = build_wheel(tmp_path, version=version)
    assert build.path.name.startswith(f"vllm-{version}+kiln.")
    with zipfile.ZipFile(build.path) as wheel:
        manifest = json.loads(wheel.read("vllm/fork/manifest.json"))
    assert manifest["upstream_version"] == version
    assert manifest["topics"] == [t.name for t in Series.load(series_dir(version)).topics]

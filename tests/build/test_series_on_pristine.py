"""The real series on the real pristine 0.32.0 tree."""

import zipfile

from kiln.paths import REPO_ROOT
from kiln.patching import apply_series_into
from kiln.series import Series
from kiln.verify import verify


def test_the_series_applies_to_pristine_without_fuzz(pristine_tree, tmp_path):
    series = Series.load()
    applied = []
    apply_series_into(pristine_tree.root, series, tmp_path / "tree",
                      on_topic=lambda t, offsets: applied.append((t.name, offsets)))
    assert [name for name, _ in applied] == [t.name for t in series.topics]
    for topic in series.topics:
        for path in topic.files():
            assert (tmp_path / "tree" / path).read_bytes() != (pristine_tree.root / path).read_bytes()


def test_verify_passes_every_check(pristine_tree, pristine_files):
    with zipfile.ZipFile(pristine_files.wheel) as wheel:
        names = wheel.namelist()
    report = verify(pristine_tree, REPO_ROOT / "patches", wheel_files=names, log=lambda _: None)
    failed = [(name, detail) for name, ok, detail in report.checks if not ok]
    assert failed == []
    names = [name for name, _, _ in report.checks]
    assert "materialize then export changes 0 bytes" in names
    assert dict((n, d) for n, _, d in report.checks)["pristine + series equals the branch tree"] == "0 differing files"

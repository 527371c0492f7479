from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.series.series import Series, Topic, parse_series_file
from tests.unit.conftest import HEADER, make_diff, write_patch


def test_series_file_ignores_comments_and_blank_lines():
    assert parse_series_file("# order\n0001-a.patch\n\n0002-b.patch  # why\n") == [
        "0001-a.patch", "0002-b.patch"]


def test_topic_header_fields_and_files(pristine: Path, tmp_path: Path):
    diff = make_diff(pristine, "vllm/b.py", "def f(x):\n    return x + 2\n")
    path = write_patch(tmp_path / "patches", 1, "bump", diff, what="f adds two")
    topic = Topic.parse(path)
    assert topic.name == "bump"
    assert topic.kind == "fix" and topic.what == "f adds two"
    assert topic.files() == ["vllm/b.py"]
    assert topic.header_problems() == []
    assert topic.text() == path.read_text()


@pytest.mark.parametrize("broken, expected", [
    (lambda h: h.replace("Kind: fix\n", ""), "'Kind' is missing"),
    (lambda h: h.replace("Kind: fix", "Kind: tweak"), "Kind 'tweak' is not one of"),
    (lambda h: h.replace("Upstream: none", "Upstream:"), "'Upstream' is missing or empty"),
    (lambda h: h.replace("Topic: bump", "Topic: other"), "differs from the file name's topic"),
    (lambda h: h + "Owner: me\n", "unknown header field(s) Owner"),
])
def test_incomplete_headers_are_named(tmp_path: Path, broken, expected):
    header = broken(HEADER.format(name="bump", what="x"))
    path = tmp_path / "0001-bump.patch"
    path.write_text(header + "---\ndiff --git a/vllm/b.py b/vllm/b.py\n")
    problems = Topic.parse(path).header_problems()
    assert any(expected in p for p in problems), problems


def test_patch_without_separator_is_refused(tmp_path: Path):
    path = tmp_path / "0001-x.patch"
    path.write_text("Topic: x\ndiff --git a/f b/f\n")
    with pytest.raises(KilnError, match="no '---' line"):
        Topic.parse(path)


def test_series_entry_without_file_and_file_without_entry(pristine: Path, tmp_path: Path):
    patches = tmp_path / "patches"
    write_patch(patches, 1, "one", make_diff(pristine, "vllm/b.py", "x = 1\n"))
    (patches / "0002-stray.patch").write_text("Topic: stray\n---\n")
    (patches / "series").write_text("0001-one.patch\n0003-missing.patch\n")
    with pytest.raises(KilnError) as err:
        Series.load(patches)
    message = str(err.value)
    assert "series lists 0003-missing.patch, but" in message
    assert "0002-stray.patch is in" in message and "not listed in series" in message


def test_series_listing_a_patch_twice_is_refused(pristine: Path, tmp_path: Path):
    patches = tmp_path / "patches"
    write_patch(patches, 1, "one", make_diff(pristine, "vllm/b.py", "x = 1\n"))
    (patches / "series").write_text("0001-one.patch\n0001-one.patch\n")
    with pytest.raises(KilnError, match="more than once"):
        Series.load(patches)


def test_missing_series_file(tmp_path: Path):
    with pytest.raises(KilnError, match="series: missing"):
        Series.load(tmp_path)


def test_each_pin_has_its_own_series_folder_and_a_missing_one_is_named(tmp_path):
    from kiln.series.series import carried_versions, series_dir

    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "upstream.lock").write_text(
        'default = "1.10.0"\n' + "".join(
            f'[versions."{v}"]\nwheel = "w"\nwheel_sha256 = "0"\nsdist = "s"\nsdist_sha256 = "0"\n'
            for v in ("1.9.0", "1.10.0", "2.0.0")))
    for version in ("1.9.0", "1.10.0"):
        (tmp_path / "patches" / version).mkdir(parents=True)
        (tmp_path / "patches" / version / "series").write_text("")
    (tmp_path / "patches" / "xgrammar").mkdir()
    assert carried_versions(tmp_path) == ["1.9.0", "1.10.0"]  # by number, not by text
    assert series_dir(root=tmp_path) == tmp_path / "patches" / "1.10.0"
    with pytest.raises(KilnError, match=r"no series for vLLM 2\.0\.0: .* \(carried pins: 1\.9\.0, 1\.10\.0\)"):
        series_dir("2.0.0", tmp_path)


def test_a_series_folder_for_a_pin_the_lock_lacks_is_refused_by_name(tmp_path):
    from kiln.series.series import carried_versions, series_dir

    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "upstream.lock").write_text(
        'default = "1.0.0"\n[versions."1.0.0"]\nwheel = "w"\nwheel_sha256 = "0"\n'
        'sdist = "s"\nsdist_sha256 = "0"\n')
    for version in ("1.0.0", "1.1.0"):
        (tmp_path / "patches" / version).mkdir(parents=True)
        (tmp_path / "patches" / version / "series").write_text("")
    expected = (f"{tmp_path / 'patches' / '1.1.0'} holds a series for vLLM 1.1.0, which "
                f"{tmp_path / 'requirements' / 'upstream.lock'} does not pin (pinned: 1.0.0); "
                "pin it with `python -m kiln pin-bump --to 1.1.0` or remove the folder")
    with pytest.raises(KilnError) as err:
        series_dir("1.1.0", tmp_path)
    assert str(err.value) == expected
    with pytest.raises(KilnError) as err:
        carried_versions(tmp_path)  # what `verify --version all` reads, before verifying any
    assert str(err.value) == expected
    assert series_dir(root=tmp_path) == tmp_path / "patches" / "1.0.0"

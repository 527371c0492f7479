from pathlib import Path

import pytest

from kiln.series.patching import PatchFailed, apply_series_into, apply_topic
from kiln.series.series import Series, Topic
from tests.unit.conftest import make_diff, write_patch


def _a_with(line10: str, prefix: str = "") -> str:
    lines = [f"line {i}\n" for i in range(1, 41)]
    lines[9] = line10
    return prefix + "".join(lines)


def test_offset_is_reported_and_accepted(pristine: Path, tmp_path: Path):
    topic = Topic.parse(write_patch(tmp_path / "p", 1, "ten", make_diff(pristine, "vllm/a.py", _a_with("TEN\n"))))
    # Upstream grew three lines above the hunk: same context, three lines lower.
    moved = tmp_path / "moved"
    (moved / "vllm").mkdir(parents=True)
    (moved / "vllm" / "a.py").write_text(_a_with("line 10\n", prefix="x\ny\nz\n"))
    offsets = apply_topic(moved, topic)
    assert [(o.file, o.hunk, o.offset) for o in offsets] == [("vllm/a.py", 1, 3)]
    assert (moved / "vllm" / "a.py").read_text() == _a_with("TEN\n", prefix="x\ny\nz\n")


def test_hunk_needing_fuzz_is_refused_naming_file_and_hunk(pristine: Path, tmp_path: Path):
    topic = Topic.parse(write_patch(tmp_path / "p", 1, "ten", make_diff(pristine, "vllm/a.py", _a_with("TEN\n"))))
    changed = tmp_path / "changed"
    (changed / "vllm").mkdir(parents=True)
    # A context line next to the change differs: GNU patch would need fuzz 1.
    text = _a_with("line 10\n").replace("line 8\n", "line eight\n")
    (changed / "vllm" / "a.py").write_text(text)
    with pytest.raises(PatchFailed) as err:
        apply_topic(changed, topic)
    assert err.value.topic == "ten"
    assert err.value.failures == ["vllm/a.py: hunk #1 FAILED at line 7"]


def test_missing_file_is_named(pristine: Path, tmp_path: Path):
    topic = Topic.parse(write_patch(tmp_path / "p", 1, "bee", make_diff(pristine, "vllm/b.py", "x = 1\n")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PatchFailed, match="bee"):
        apply_topic(empty, topic)


def test_no_half_patched_output_when_a_later_topic_fails(pristine: Path, tmp_path: Path):
    patches = tmp_path / "patches"
    write_patch(patches, 1, "good", make_diff(pristine, "vllm/b.py", "def f(x):\n    return 0\n"))
    bad = make_diff(pristine, "vllm/a.py", _a_with("TEN\n")).replace(" line 8\n", " line eight\n")
    write_patch(patches, 2, "bad", bad)
    into = tmp_path / "out"
    with pytest.raises(PatchFailed, match="topic bad"):
        apply_series_into(pristine, Series.load(patches), into)
    assert not into.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    assert (pristine / "vllm" / "b.py").read_text().startswith("def f(x):\n    return x + 1")


def test_apply_series_into_refuses_existing_folder(pristine: Path, tmp_path: Path):
    patches = tmp_path / "patches"
    write_patch(patches, 1, "good", make_diff(pristine, "vllm/b.py", "x = 1\n"))
    (tmp_path / "out").mkdir()
    with pytest.raises(Exception, match="already exists"):
        apply_series_into(pristine, Series.load(patches), tmp_path / "out")


def test_patch_already_in_upstream_is_reported(pristine: Path, tmp_path: Path):
    topic = Topic.parse(write_patch(tmp_path / "p", 1, "ten", make_diff(pristine, "vllm/a.py", _a_with("TEN\n"))))
    apply_topic(pristine, topic)
    with pytest.raises(PatchFailed, match="already applied upstream"):
        apply_topic(pristine, topic)

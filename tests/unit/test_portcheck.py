"""port-check on synthetic upstream pairs: each change makes its own check fire, and only it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("griffe")

from kiln.portcheck import Finding, port_check  # noqa: E402
from kiln.series.series import Series  # noqa: E402
from tests.unit.conftest import make_diff, write_patch  # noqa: E402

HOOK_MODULE = "vllm/engine.py"
HOOK = "def step(state):\n    return state\n"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for path, text in {HOOK_MODULE: HOOK, **files}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return root


def run_check(tmp_path: Path, old: dict[str, str], new: dict[str, str], overlay: dict[str, str] | None = None,
              topic_edits: dict[str, str] | None = None) -> list[Finding]:
    """Old and new upstream trees, a series cut against old, and an overlay hooked by it."""
    old_root = write_tree(tmp_path / "old", old)
    new_root = write_tree(tmp_path / "new", new)
    patches = tmp_path / "patches"
    edits = dict(topic_edits or {})
    if overlay:
        edits[HOOK_MODULE] = "from vllm.fork.hook import *  # noqa\n" + HOOK
    for number, (path, text) in enumerate(edits.items(), start=1):
        write_patch(patches, number, f"topic{number}", make_diff(old_root, path, textwrap.dedent(text)))
    overlay_root = tmp_path / "overlay" / "vllm"
    (overlay_root / "fork").mkdir(parents=True)
    (overlay_root / "fork" / "hook.py").write_text(textwrap.dedent((overlay or {}).get("hook", "")))
    return port_check(old_root, "1.0", new_root, "2.0", Series.load(patches), [(overlay_root, "vllm")])


def kinds(findings: list[Finding]) -> list[str]:
    return [f.kind for f in findings]


def test_a_renamed_function_is_a_removed_name_with_the_new_name_suggested(tmp_path):
    findings = run_check(
        tmp_path,
        old={"vllm/util.py": "def make_plan(x):\n    return x\n"},
        new={"vllm/util.py": "def make_plans(x):\n    return x\n"},
        overlay={"hook": "from vllm.util import make_plan\n\n\ndef go():\n    return make_plan(1)\n"},
    )
    assert kinds(findings) == ["removed-name"]
    (finding,) = findings
    assert finding.topic == "topic1"
    assert finding.where == "vllm/fork/hook.py::vllm.util.make_plan"
    assert "make_plans (renamed?)" in finding.detail


OUT_OLD = """\
class State:
    def make(self, tokens, pooling=None):
        return tokens
"""
OUT_NEW = """\
class State:
    def make(self, tokens, pooling=None, error=None):
        return tokens
"""
OUT_TOPIC = """\
class State:
    def make(self, tokens, pooling=None, count=None):
        return tokens
"""


def test_a_new_positional_parameter_rebinds_a_positional_call(tmp_path):
    findings = run_check(
        tmp_path, old={"vllm/out.py": OUT_OLD}, new={"vllm/out.py": OUT_NEW},
        topic_edits={"vllm/out.py": OUT_TOPIC},
        overlay={"hook": "from vllm.out import State\n\n\ndef go(state: State):\n    return state.make([], None, 5)\n"},
    )
    assert kinds(findings) == ["changed-signature"]
    assert "argument #3 binds to `count` in 1.0 but to `error` in 2.0" in findings[0].detail
    assert findings[0].where == "vllm/fork/hook.py::vllm.out.State.make"


def test_the_same_call_by_keyword_is_not_a_finding(tmp_path):
    findings = run_check(
        tmp_path, old={"vllm/out.py": OUT_OLD}, new={"vllm/out.py": OUT_NEW},
        topic_edits={"vllm/out.py": OUT_TOPIC},
        overlay={"hook": "from vllm.out import State\n\n\ndef go(state: State):\n"
                         "    return state.make([], None, count=5)\n"},
    )
    assert findings == []


def test_a_function_moved_to_another_file_says_where_it_went(tmp_path):
    findings = run_check(
        tmp_path,
        old={"vllm/kv_utils.py": "def plan(x):\n    return x\n\n\ndef other():\n    pass\n"},
        new={"vllm/kv_utils.py": "def other():\n    pass\n", "vllm/kv_planning.py": "def plan(x):\n    return x\n"},
        overlay={"hook": "from vllm.kv_utils import plan, other\n"},
    )
    assert kinds(findings) == ["moved"]
    assert "defines plan in vllm.kv_planning" in findings[0].detail


def test_an_absorbed_change_is_drift_that_asks_to_retire(tmp_path):
    findings = run_check(
        tmp_path,
        old={"vllm/b.py": "def f(x):\n    return x + 1\n"},
        new={"vllm/b.py": "def f(x):\n    return x + 2\n"},
        topic_edits={"vllm/b.py": "def f(x):\n    return x + 2\n"},
    )
    assert kinds(findings) == ["body-drift"]
    assert findings[0].where == "vllm/b.py::f"
    assert "retire?" in findings[0].detail


def test_a_changed_body_around_a_clean_hunk_is_drift(tmp_path):
    old = "def f(x):\n    y = x\n    return y\n"
    findings = run_check(
        tmp_path, old={"vllm/b.py": old},
        new={"vllm/b.py": "def f(x):\n    if x is None:\n        return 0\n    y = x\n    return y\n"},
        topic_edits={"vllm/b.py": "def f(x):\n    y = x\n    y = hook(y)\n    return y\n"},
    )
    assert kinds(findings) == ["body-drift"]
    assert "Check the topic's hunk" in findings[0].detail


ENUM_OLD = "from enum import IntEnum\n\n\nclass Mode(IntEnum):\n    NONE = 0\n    FP8 = 1\n"


def test_a_fork_enum_value_meeting_a_new_upstream_member_and_alias(tmp_path):
    findings = run_check(
        tmp_path, old={"vllm/kv.py": ENUM_OLD},
        new={"vllm/kv.py": ENUM_OLD + "    OCTAVE = 2\n    CUSTOM = 2\n"},
        topic_edits={"vllm/kv.py": ENUM_OLD + "    KVARN = 2\n"},
    )
    assert kinds(findings) == ["enum-collision"]
    assert findings[0].where == "vllm/kv.py::Mode.KVARN"
    assert "OCTAVE = 2, CUSTOM = 2" in findings[0].detail


SPEC_OLD = "class Base:\n    def propose(self, batch, dp_sync=None):\n        raise NotImplementedError\n"
SPEC_NEW = ("class Base:\n    def propose(self, batch, dp_sync=None, kv_cache_spec=None):\n"
            "        raise NotImplementedError\n")


def test_an_override_whose_base_gained_a_parameter(tmp_path):
    findings = run_check(
        tmp_path, old={"vllm/spec.py": SPEC_OLD}, new={"vllm/spec.py": SPEC_NEW},
        overlay={"hook": "from vllm.spec import Base\n\n\nclass Mine(Base):\n"
                         "    def propose(self, batch, dp_sync=None):\n        return batch\n"},
    )
    assert kinds(findings) == ["override"]
    assert findings[0].where == "vllm/fork/hook.py::Mine.propose"
    assert "it lacks `kv_cache_spec`" in findings[0].detail


def test_an_unchanged_upstream_gives_no_findings(tmp_path):
    tree = {"vllm/out.py": OUT_OLD, "vllm/spec.py": SPEC_OLD, "vllm/kv.py": ENUM_OLD}
    findings = run_check(
        tmp_path, old=tree, new=tree, topic_edits={"vllm/out.py": OUT_TOPIC, "vllm/kv.py": ENUM_OLD + "    K = 2\n"},
        overlay={"hook": "from vllm.out import State\nfrom vllm.spec import Base\n\n\nclass Mine(Base):\n"
                         "    def propose(self, batch, dp_sync=None):\n        return State().make([], None, 5)\n"},
    )
    assert findings == []


def test_an_overlay_file_that_does_not_parse_is_a_finding_not_a_skip(tmp_path):
    findings = run_check(tmp_path, old={"vllm/util.py": "def plan(x):\n    return x\n"},
                         new={"vllm/util.py": "def plan(x):\n    return x\n"},
                         overlay={"hook": "from vllm.util import plan\n\n\ndef go(:\n    pass\n"})
    assert kinds(findings) == ["unparsed"]
    assert findings[0].topic == "topic1" and findings[0].where == "vllm/fork/hook.py"
    assert "SyntaxError" in findings[0].detail


def test_a_new_upstream_module_that_does_not_parse_is_named(tmp_path):
    findings = run_check(tmp_path, old={"vllm/util.py": "def plan(x):\n    return x\n"},
                         new={"vllm/util.py": "def plan(x:\n    return x\n"},
                         overlay={"hook": "from vllm.util import plan\n"})
    unparsed = [f for f in findings if f.kind == "unparsed"]
    assert [f.where for f in unparsed] == ["2.0:vllm/util.py"], findings
    assert kinds(findings)[0] == "unparsed"


def test_a_patched_upstream_file_whose_new_version_does_not_parse_is_named(tmp_path):
    findings = run_check(tmp_path, old={"vllm/out.py": OUT_OLD}, new={"vllm/out.py": "class State(:\n"},
                         topic_edits={"vllm/out.py": OUT_TOPIC})
    assert ("unparsed", "topic1", "2.0:vllm/out.py") in [(f.kind, f.topic, f.where) for f in findings]

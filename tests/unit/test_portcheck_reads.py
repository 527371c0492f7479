"""port-check on synthetic upstream pairs: attribute reads (typed, through getattr and
hasattr, or matched by name), deprecations, and ``# mirrors:`` markers in every overlay."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("griffe")

from kiln.build.wheel import OVERLAY_DIRS  # noqa: E402
from kiln.portcheck import Finding, port_check  # noqa: E402
from kiln.series.series import Series  # noqa: E402


def write(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return root


def check(tmp_path: Path, old: dict[str, str], new: dict[str, str],
          checkout: dict[str, str]) -> list[Finding]:
    """Old and new upstream trees and the checkout's overlay folders, as port-check
    reads them (no topics)."""
    series = tmp_path / "patches"
    series.mkdir(parents=True)
    (series / "series").write_text("")
    root = write(tmp_path / "checkout", checkout)
    overlays = [(root / folder, target.replace("/", ".")) for folder, target in OVERLAY_DIRS]
    return port_check(write(tmp_path / "old", old), "1.0", write(tmp_path / "new", new), "2.0",
                      Series.load(series), overlays)


def found(findings: list[Finding]) -> list[tuple[str, str]]:
    return [(f.kind, f.where) for f in findings]


KV_OLD = '''\
class Mode:
    @property
    def is_custom(self) -> bool:
        return True


class Spec:
    mode: Mode
'''
KV_NEW = "class Mode:\n    pass\n\n\nclass Spec:\n    mode: Mode\n"


@pytest.mark.parametrize("read, kind, says", [
    ('getattr(mode, "is_custom", False)', "silent-default", "getattr() silently returns its default"),
    ('hasattr(mode, "is_custom")', "silent-default", "hasattr() is now always False"),
    ("mode.is_custom", "removed-name", "exists in 1.0 but not in 2.0"),
])
def test_a_member_gone_from_the_type_of_a_local_is_named_by_how_it_is_read(tmp_path, read, kind, says):
    findings = check(tmp_path, {"vllm/kv.py": KV_OLD}, {"vllm/kv.py": KV_NEW}, {
        "vllm/fork/hook.py": f"from vllm.kv import Spec\n\n\ndef preset(spec: Spec):\n"
                             f"    mode = spec.mode\n    return {read}\n"})
    assert found(findings) == [(kind, "vllm/fork/hook.py::vllm.kv.Mode.is_custom")]
    assert findings[0].detail.startswith("vllm/fork/hook.py:6: ") and says in findings[0].detail


def test_a_member_still_there_is_no_finding(tmp_path):
    findings = check(tmp_path, {"vllm/kv.py": KV_OLD}, {"vllm/kv.py": KV_OLD}, {
        "vllm/fork/hook.py": "from vllm.kv import Spec\n\n\ndef preset(spec: Spec):\n"
                             "    return getattr(spec.mode, 'is_custom', False)\n"})
    assert findings == []


CONFIG = '''\
import logging
from vllm.spec import SpecConfig

logger = logging.getLogger(__name__)


class Config:
    spec: SpecConfig | None = None


def current() -> Config | None:
    return None
'''
FLAG = '''\
class SpecConfig:
    {decorator}def flag(self) -> bool:
        {docstring}{body}
'''
READER = '''\
from vllm.config import current


def drafts_in_parallel() -> bool:
    config = current()
    return bool(config.spec.flag)
'''


@pytest.mark.parametrize("decorator, docstring, body, says", [
    ("", '"""Deprecated and has no effect."""\n        ', "return False",
     "its docstring: Deprecated and has no effect."),
    ("@deprecated('use the speculator config')\n    ", "", "return False",
     "the line above it: @deprecated('use the speculator config')"),
    ("# Deprecated: the speculator config says it.\n    ", "", "return False",
     "the line above it: # Deprecated: the speculator config says it."),
    ("", "", 'logging.warning("flag is deprecated and ignored"); return False',
     "a warning at spec.py:3: flag is deprecated and ignored"),
])
def test_a_member_the_new_pin_deprecates_is_found_through_annotated_types(
        tmp_path, decorator, docstring, body, says):
    old = {"vllm/config.py": CONFIG, "vllm/spec.py": FLAG.format(decorator="", docstring="", body="return True")}
    new = {"vllm/config.py": CONFIG,
           "vllm/spec.py": FLAG.format(decorator=decorator, docstring=docstring, body=body)}
    findings = check(tmp_path, old, new, {"vllm/fork/hook.py": READER})
    assert found(findings) == [("deprecated", "vllm/fork/hook.py::vllm.spec.SpecConfig.flag")]
    assert "flag, read here, is deprecated in 2.0 and was not in 1.0" in findings[0].detail
    assert says in findings[0].detail


def test_a_deprecation_the_old_pin_had_already_or_one_of_another_name_is_no_finding(tmp_path):
    deprecated = FLAG.format(decorator="", docstring='"""Deprecated."""\n        ', body="return True")
    other = FLAG.format(decorator="", docstring="",
                        body='logging.warning("other is deprecated; use flag"); return True')
    for old, new in ((deprecated, deprecated), (FLAG.format(decorator="", docstring="", body="return True"), other)):
        findings = check(tmp_path / str(len(old)), {"vllm/config.py": CONFIG, "vllm/spec.py": old},
                         {"vllm/config.py": CONFIG, "vllm/spec.py": new}, {"vllm/fork/hook.py": READER})
        assert findings == []


BUILDER_OLD = '''\
from typing import Generic, TypeVar

T = TypeVar("T")


class Config:
    use_v2: bool = True


class Builder(Generic[T]):
    def __init__(self, spec, config: Config):
        self.spec = spec

    def threshold(self) -> int:
        return 1
'''
BUILDER_NEW = BUILDER_OLD.replace("    use_v2: bool = True\n", "    pass\n").replace(
    "\n    def threshold(self) -> int:\n        return 1\n", "")
MINE = '''\
from vllm.builder import Builder


class Mine(Builder[int]):
    def __init__(self, spec, config):
        super().__init__(spec, config)
        if not config.use_v2:
            raise ValueError("V2 only")
        self.limit = self.threshold()
'''


def test_an_override_reads_its_parameters_as_the_upstream_method_types_them(tmp_path):
    findings = check(tmp_path, {"vllm/builder.py": BUILDER_OLD}, {"vllm/builder.py": BUILDER_NEW},
                     {"vllm/fork/hook.py": MINE})
    assert found(findings) == [("removed-name", "vllm/fork/hook.py::vllm.builder.Builder.threshold"),
                               ("removed-name", "vllm/fork/hook.py::vllm.builder.Config.use_v2")]


UNTYPED = '''\
def limit(runner):
    return runner.kv_cache_config.{name}
'''


@pytest.mark.parametrize("name, new, expected", [
    ("backed_blocks", "class Other:\n    pass\n", [("name-match", "vllm/fork/hook.py::*.backed_blocks")]),
    ("backed_blocks", "class Other:\n    backed_blocks = 0\n", []),  # still defined somewhere
    ("num_blocks", "class Other:\n    pass\n", []),  # never an upstream name
])
def test_a_read_on_a_value_of_unknown_type_is_matched_by_name(tmp_path, name, new, expected):
    old = {"vllm/kv.py": "class KVCacheConfig:\n    backed_blocks: int = 0\n"}
    findings = check(tmp_path, old, {"vllm/kv.py": new}, {"vllm/fork/hook.py": UNTYPED.format(name=name)})
    assert found(findings) == expected
    if expected:
        assert "1.0 defines backed_blocks in vllm.kv, 2.0 nowhere" in findings[0].detail


FORMULA = '''\
import triton


def prepare(max_tokens):
    """Launch the input kernel."""
    # one program per block
    BLOCK_SIZE = {block}
    return BLOCK_SIZE
'''
MIRROR = '''\
"""Not a marker in a docstring:
# mirrors: vllm.nowhere.at_all
"""


# mirrors: vllm.kernels.prepare (its BLOCK_SIZE)
def block_sizes(max_tokens):
    return [min(256, max_tokens)]
'''


@pytest.mark.parametrize("folder", ["vllm/fork", "kvarn", "specattn"])
def test_a_mirror_whose_upstream_changed_is_reported_from_every_overlay_folder(tmp_path, folder):
    old = {"vllm/kernels.py": FORMULA.format(block="min(256, triton.next_power_of_2(max_tokens))")}
    new = {"vllm/kernels.py": FORMULA.format(block="128")}
    findings = check(tmp_path, old, new, {f"{folder}/sizes.py": MIRROR})
    assert found(findings) == [("mirror-drift", f"{folder}/sizes.py::vllm.kernels.prepare")]
    assert findings[0].detail.startswith(f"{folder}/sizes.py:6: mirrors vllm.kernels.prepare, which changed")
    assert "+    BLOCK_SIZE = 128" in findings[0].detail


def test_a_mirror_whose_upstream_changed_only_in_words_is_no_finding(tmp_path):
    old = {"vllm/kernels.py": FORMULA.format(block="128")}
    new = {"vllm/kernels.py": FORMULA.format(block="128").replace("Launch", "Start").replace(
        "# one program", "# a program")}
    assert check(tmp_path, old, new, {"vllm/fork/sizes.py": MIRROR}) == []


@pytest.mark.parametrize("old, new, says", [
    ({"vllm/kernels.py": "def other():\n    pass\n"}, {"vllm/kernels.py": "def other():\n    pass\n"},
     "the marker names vllm.kernels.prepare, which 1.0 does not define; a marker names"),
    ({"vllm/kernels.py": "def other():\n    pass\n"}, {"vllm/kernels.py": FORMULA.format(block="128")},
     "which 1.0 does not define (2.0 does: is the code written for that pin?)"),
    ({"vllm/kernels.py": FORMULA.format(block="128")}, {"vllm/kernels.py": "def prepared(x):\n    return x\n"},
     "vllm.kernels.prepare exists in 1.0 but not in 2.0"),
])
def test_a_mirror_of_a_name_that_is_missing_is_reported(tmp_path, old, new, says):
    findings = check(tmp_path, old, new, {"vllm/fork/sizes.py": MIRROR})
    assert found(findings) == [("mirror-drift", "vllm/fork/sizes.py::vllm.kernels.prepare")]
    assert says in findings[0].detail

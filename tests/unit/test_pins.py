import pytest

from kiln.build.pins import PinChanges
from kiln.errors import KilnError

METADATA = """\
Metadata-Version: 2.4
Name: vllm
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: xgrammar==0.2.8; platform_machine == "x86_64"
Requires-Dist: torchcodec>=0.14
Requires-Dist: pandas; extra == "bench"

Long description with Requires-Dist: not-a-header
"""


def test_replace_drop_and_add_touch_only_their_lines():
    pins = PinChanges.parse("xgrammar==0.2.8+kiln.1\n-torchcodec\nnew-thing>=1  # why\n")
    out = pins.apply_to_metadata(METADATA)
    lines = out.split("\n\n")[0].splitlines()
    assert lines[3:] == [
        "Requires-Dist: regex",
        "Requires-Dist: xgrammar==0.2.8+kiln.1",
        "Requires-Dist: pandas; extra == \"bench\"",
        "Requires-Dist: new-thing>=1",
    ]
    assert out.endswith("Long description with Requires-Dist: not-a-header\n")


def test_no_changes_is_identity():
    assert PinChanges.parse("# nothing\n").apply_to_metadata(METADATA) == METADATA


def test_bad_lines_are_named():
    with pytest.raises(KilnError, match="line 2: '==1' is not a requirement"):
        PinChanges.parse("regex\n==1\n")
    with pytest.raises(KilnError, match="regex both dropped and replaced"):
        PinChanges.parse("regex>1\n-regex\n")


def test_a_section_applies_only_to_its_pin():
    text = "regex>=1\n[0.34.0]\nflashinfer-python==0.7.4  # why\n-torchcodec\n[0.33.0]\nregex==2\n"
    on_34 = PinChanges.parse(text, version="0.34.0")
    assert on_34.replace == {"regex": "regex>=1", "flashinfer-python": "flashinfer-python==0.7.4"}
    assert on_34.drop == {"torchcodec"}
    on_33 = PinChanges.parse(text, version="0.33.0")
    assert on_33.replace == {"regex": "regex==2"} and on_33.drop == frozenset()
    assert PinChanges.parse(text).replace == {"regex": "regex>=1"}


def test_a_malformed_section_header_is_refused_naming_the_line():
    with pytest.raises(KilnError, match=r"fork-pins.txt line 2: '\[next\]' is not a section header"):
        PinChanges.parse("regex\n[next]\n")

import pytest

from kiln.errors import KilnError
from kiln.pins import PinChanges

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

"""The --accept file: accepted findings, stale entries and bad entries."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.portcheck import Finding
from kiln.portcheck.accept import judge, load_acceptances

DRIFT = Finding("body-drift", "prompt-progress", "vllm/x.py::f", "f changed")
MOVED = Finding("moved", "fork-identity", "vllm/y.py::g", "g moved")


def write(tmp_path, text):
    path = tmp_path / "accept.toml"
    path.write_text(text)
    return path


def test_an_accepted_finding_is_not_open_and_a_vanished_one_is_stale(tmp_path):
    path = write(tmp_path, """
[[accept]]
kind = "body-drift"
topic = "prompt-progress"
where = "vllm/x.py::f"
reason = "reviewed: the hook is after the moved return"

[[accept]]
kind = "override"
topic = "gone"
where = "vllm/z.py::C.m"
reason = "fixed long ago"
to = "2.0"

[[accept]]
kind = "moved"
topic = "fork-identity"
where = "vllm/y.py::g"
reason = "for another port"
to = "3.0"
""")
    verdict = judge([DRIFT, MOVED], load_acceptances(path, "2.0"))
    assert verdict.open == [MOVED]
    assert [(f, a.reason) for f, a in verdict.accepted] == [(DRIFT, "reviewed: the hook is after the moved return")]
    assert [a.topic for a in verdict.stale] == ["gone"]


@pytest.mark.parametrize("entry, message", [
    ('kind = "drift"\ntopic = "t"\nwhere = "w"\nreason = "r"', "kind 'drift'; allowed: unparsed, removed-name"),
    ('kind = "moved"\ntopic = "t"\nwhere = "w"', "lacks reason"),
    ('kind = "moved"\ntopic = "t"\nwhere = "w"\nreason = "r"\nwhy = "x"', "unknown key"),
])
def test_bad_accept_entries_are_refused_naming_what_is_allowed(tmp_path, entry, message):
    with pytest.raises(KilnError, match=message):
        load_acceptances(write(tmp_path, "[[accept]]\n" + entry + "\n"), "2.0")


def test_a_missing_accept_file_is_an_error(tmp_path):
    with pytest.raises(KilnError, match="no such accept file"):
        load_acceptances(tmp_path / "nope.toml", "2.0")

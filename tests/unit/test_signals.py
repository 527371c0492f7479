"""kiln.signals: a signal inside an uninterrupted block is raised when the block ends."""

from __future__ import annotations

import io
import os
import signal
import zipfile

import pytest

from kiln.errors import Terminated
from kiln.signals import handled, uninterrupted


def test_sigterm_outside_a_block_raises_where_it_lands():
    with handled(), pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not raise")


@pytest.mark.parametrize("signum, raised", [(signal.SIGTERM, Terminated),
                                            (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_inside_a_block_is_raised_as_it_ends(signum, raised):
    finished = []
    with handled(), pytest.raises(raised):
        with uninterrupted():
            os.kill(os.getpid(), signum)
            finished.append("block")
        finished.append("after")
    assert finished == ["block"]


def test_nested_blocks_hold_the_signal_to_the_outermost_end():
    finished = []
    with handled(), pytest.raises(Terminated):
        with uninterrupted():
            with uninterrupted():
                os.kill(os.getpid(), signal.SIGTERM)
            finished.append("inner ended")
        finished.append("after")
    assert finished == ["inner ended"]


def _write_cut_after_open(out: zipfile.ZipFile, handles: list | None = None) -> None:
    """writestr's own steps, with SIGTERM sent where the CI build was cut: after
    ``open`` marked the archive as being written, before the handle's block began."""
    dest = out.open("a", "w")
    if handles is not None:
        handles.append(dest)
    os.kill(os.getpid(), signal.SIGTERM)
    with dest:
        dest.write(b"x" * 1000)


def test_a_zip_write_cut_inside_a_block_leaves_only_terminated():
    buf = io.BytesIO()
    with handled(), pytest.raises(Terminated), zipfile.ZipFile(buf, "w") as out:
        with uninterrupted():
            _write_cut_after_open(out)
        pytest.fail("SIGTERM was not raised between entries")
    with zipfile.ZipFile(buf) as z:
        assert z.read("a") == b"x" * 1000


def test_a_zip_write_cut_outside_a_block_cannot_close():
    """The failure the block guards against: the handle stays open, and closing the
    archive raises a ValueError that hides Terminated."""
    handles: list = []
    with handled(), pytest.raises(ValueError, match="open writing handle") as caught, \
            zipfile.ZipFile(io.BytesIO(), "w") as out:
        _write_cut_after_open(out, handles)
    assert isinstance(caught.value.__context__, Terminated)
    handles[0].close()
    out.close()


def test_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with handled():
        assert signal.getsignal(signal.SIGTERM) is not before[0]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before

"""A byte that is not UTF-8 in a patch or the series, and a lock value of the wrong type:
one error line naming the file and where, never a traceback. The commands run for real
in a subprocess on a synthetic checkout (tests/unit/conftest.py)."""

from __future__ import annotations

import shutil

import pytest

from kiln.errors import KilnError
from kiln.paths import REPO_ROOT
from kiln.series.series import Series
from kiln.upstream.lock import UpstreamLock
from tests.unit.conftest import KilnCheckout

BAD_HEADER = b"Topic: bad\nKind: fix\nWhat: caf\xe9 au lait\n---\ndiff --git a/x b/x\n"
NOT_UTF8 = "line 3, byte 10: 0xe9 is not UTF-8 (kiln reads this file as UTF-8 text)"
LOCK = ('default = "1.0.0"\n\n[versions."1.0.0"]\nwheel = "w.whl"\nwheel_sha256 = "0"\n'
        'sdist = "s.tar.gz"\nsdist_sha256 = "0"\n')


@pytest.fixture
def bad_patch(tmp_path) -> tuple[KilnCheckout, str]:
    checkout = KilnCheckout(tmp_path, payload_mib=1)
    series = checkout.root / "patches" / "1.0.0"
    (series / "0001-bad.patch").write_bytes(BAD_HEADER)
    (series / "series").write_text("0001-bad.patch\n")
    # verify checks the attention ops against a schema snapshot; any valid one will do.
    (checkout.root / "fa2" / "schemas").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "fa2" / "schemas" / "0.33.0.txt",
                checkout.root / "fa2" / "schemas" / "1.0.0.txt")
    return checkout, f"{series / '0001-bad.patch'}: {NOT_UTF8}"


@pytest.mark.parametrize("command", [["apply", "--into", "applied"],
                                     ["build", "--out", "dist", "--no-xgrammar"], ["topics"]])
def test_a_patch_header_that_is_not_utf8_is_one_error_line(bad_patch, command):
    checkout, message = bad_patch
    result = checkout.run(*command)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"kiln {command[0]}: error: {message}\n"


def test_verify_fails_its_series_check_naming_the_patch_and_the_byte(bad_patch):
    checkout, message = bad_patch
    result = checkout.run("verify")
    assert result.returncode == 1, result.stderr
    assert f"FAIL series and patches/ agree\n     {message}\n" in result.stdout
    assert "Traceback" not in result.stderr


def test_a_series_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "series").write_bytes(b"# caf\xc3\n0001-a.patch\n")
    with pytest.raises(KilnError) as err:
        Series.load(tmp_path)
    assert str(err.value) == (f"{tmp_path / 'series'}: line 1, byte 6: 0xc3 is not UTF-8 "
                              "(kiln reads this file as UTF-8 text)")


@pytest.mark.parametrize(("lock", "message"), [
    ('default = "1.0.0"\nversions = "x"\n',
     "versions is a string ('x'); expected a table of [versions.\"X.Y.Z\"] tables"),
    (LOCK.replace('wheel = "w.whl"', "wheel = 7"),
     'versions."1.0.0".wheel is an integer (7); expected a string'),
    (LOCK.replace('sdist_sha256 = "0"', "sdist_sha256 = [0]"),
     'versions."1.0.0".sdist_sha256 is an array ([0]); expected a string'),
    (LOCK.replace('[versions."1.0.0"]\n', "[versions]\n\"1.0.0\" = 1\n[other]\n"),
     ('versions."1.0.0" is an integer (1); expected a table (wheel, wheel_sha256, sdist, '
     "sdist_sha256)")),
    (LOCK.replace('default = "1.0.0"', "default = 1.0"),
     "default is a float (1.0); expected a string (a pinned version)"),
], ids=["versions", "wheel", "sha256", "version-entry", "default"])
def test_a_lock_value_of_the_wrong_type_names_the_key_and_the_type(tmp_path, lock, message):
    path = tmp_path / "upstream.lock"
    path.write_text(lock)
    with pytest.raises(KilnError) as err:
        UpstreamLock.load(path)
    assert str(err.value) == f"{path}: {message}"


def test_a_lock_value_of_the_wrong_type_is_one_error_line(tmp_path):
    checkout = KilnCheckout(tmp_path, payload_mib=1)
    lock = checkout.root / "requirements" / "upstream.lock"
    text = lock.read_text()
    lock.write_text(text.replace(text[text.index("wheel = "):text.index("\nwheel_sha256")],
                                 "wheel = 7"))
    result = checkout.run("topics")
    assert result.returncode == 2
    assert result.stderr == (f"kiln topics: error: {lock}: versions.\"1.0.0\".wheel is an "
                             "integer (7); expected a string\n")

import hashlib
from pathlib import Path

import pytest

import kiln.fetch
from kiln.errors import KilnError
from kiln.fetch import fetch
from kiln.lock import UpstreamLock

LOCK = """\
default = "1.0.0"

[versions."1.0.0"]
wheel = "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
wheel_sha256 = "{wheel}"
sdist = "vllm-1.0.0.tar.gz"
sdist_sha256 = "{sdist}"
"""


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    # A closed local port: a real, fast network failure.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setattr(kiln.fetch, "BACKOFF_SECONDS", 0.0)
    (tmp_path / "cache" / "upstream").mkdir(parents=True)
    return tmp_path / "cache"


def _lock(tmp_path: Path, wheel: str, sdist: str) -> UpstreamLock:
    path = tmp_path / "upstream.lock"
    path.write_text(LOCK.format(wheel=wheel, sdist=sdist))
    return UpstreamLock.load(path)


def test_cached_files_with_the_pinned_hashes_are_used(cache, tmp_path):
    wheel, sdist = b"wheel bytes", b"sdist bytes"
    (cache / "upstream" / "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(wheel)
    (cache / "upstream" / "vllm-1.0.0.tar.gz").write_bytes(sdist)
    lock = _lock(tmp_path, hashlib.sha256(wheel).hexdigest(), hashlib.sha256(sdist).hexdigest())
    files = fetch(lock=lock, log=lambda _: None)
    assert files.wheel.read_bytes() == wheel and files.sdist.read_bytes() == sdist


def test_a_hash_mismatch_is_refused_named_and_deleted(cache, tmp_path):
    bad = cache / "upstream" / "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    bad.write_bytes(b"tampered")
    expected = hashlib.sha256(b"the real wheel").hexdigest()
    lock = _lock(tmp_path, expected, "0" * 64)
    with pytest.raises(KilnError) as err:
        fetch(lock=lock, log=lambda _: None)
    message = str(err.value)
    assert bad.name in message and expected in message
    assert hashlib.sha256(b"tampered").hexdigest() in message
    assert not bad.exists()


def test_a_failed_download_is_retried_then_reported(cache, tmp_path):
    wheel = b"wheel bytes"
    (cache / "upstream" / "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(wheel)
    lock = _lock(tmp_path, hashlib.sha256(wheel).hexdigest(), "1" * 64)
    attempts = []
    with pytest.raises(KilnError, match="could not download vllm-1.0.0.tar.gz after 3 attempts"):
        fetch(lock=lock, log=attempts.append)
    assert len(attempts) == 3
    assert list((cache / "upstream").iterdir()) == [
        cache / "upstream" / "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"]


def test_an_unpinned_version_is_refused(tmp_path):
    lock = _lock(tmp_path, "0" * 64, "1" * 64)
    with pytest.raises(KilnError, match="upstream version 9.9.9 has no pinned hashes .*pinned: 1.0.0"):
        lock.release("9.9.9")


def test_a_lock_entry_missing_a_hash_is_refused(tmp_path):
    path = tmp_path / "upstream.lock"
    path.write_text('default = "1.0.0"\n[versions."1.0.0"]\nwheel = "w.whl"\n')
    with pytest.raises(KilnError, match="lacks wheel_sha256"):
        UpstreamLock.load(path)

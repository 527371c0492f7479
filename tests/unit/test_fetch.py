import hashlib
import http.server
import json
import threading
from pathlib import Path

import pytest

import kiln.upstream.fetch
from kiln.errors import KilnError
from kiln.upstream.fetch import fetch
from kiln.upstream.lock import UpstreamLock

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
    monkeypatch.setattr(kiln.upstream.fetch, "BACKOFF_SECONDS", 0.0)
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


WHEEL = "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
SDIST = "vllm-1.0.0.tar.gz"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def index(monkeypatch):
    """A PEP 691 simple index on a local port serving the files put in the returned dict."""
    served: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/simple/vllm/":
                files = [{"filename": n, "url": f"{base}/files/{n}", "hashes": {"sha256": _sha(d)}}
                         for n, d in served.items()]
                body, kind = json.dumps({"files": files}).encode(), "application/vnd.pypi.simple.v1+json"
            elif self.path.startswith("/files/") and self.path[7:] in served:
                body, kind = served[self.path[7:]], "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("PIP_INDEX_URL", f"{base}/simple")
    yield served
    server.shutdown()
    server.server_close()


def test_a_wrong_pin_keeps_the_intact_cached_file_and_names_the_lock(cache, tmp_path, index):
    wheel, sdist = b"wheel bytes", b"the real sdist"
    (cache / "upstream" / WHEEL).write_bytes(wheel)
    (cache / "upstream" / SDIST).write_bytes(sdist)
    index[SDIST] = sdist
    wrong = _sha(b"a typo in the lock")
    lock = _lock(tmp_path, _sha(wheel), wrong)
    with pytest.raises(KilnError) as err:
        fetch(lock=lock, log=lambda _: None)
    message = str(err.value)
    assert f"{tmp_path / 'upstream.lock'} (vLLM 1.0.0) pins {SDIST} with sha256 {wrong}" in message
    assert f"serves {_sha(sdist)}, the sha256 of the cached {cache / 'upstream' / SDIST}" in message
    assert "the pin is wrong, not the file, which was kept" in message
    assert (cache / "upstream" / SDIST).read_bytes() == sdist
    assert sorted(p.name for p in (cache / "upstream").iterdir()) == sorted([SDIST, WHEEL])


def test_a_damaged_cached_file_is_replaced_by_a_fresh_download(cache, tmp_path, index):
    wheel, sdist = b"wheel bytes", b"the real sdist"
    (cache / "upstream" / WHEEL).write_bytes(wheel)
    (cache / "upstream" / SDIST).write_bytes(b"the real sdist, truncated on disk")
    index[SDIST] = sdist
    said = []
    files = fetch(lock=_lock(tmp_path, _sha(wheel), _sha(sdist)), log=said.append)
    assert files.sdist.read_bytes() == sdist
    assert "downloading it again to tell a damaged file from a wrong pin" in said[0]
    assert sorted(p.name for p in (cache / "upstream").iterdir()) == sorted([SDIST, WHEEL])


def test_a_mismatch_that_cannot_be_settled_offline_keeps_the_file(cache, tmp_path):
    wheel, cached = b"wheel bytes", b"which is right?"
    (cache / "upstream" / WHEEL).write_bytes(wheel)
    (cache / "upstream" / SDIST).write_bytes(cached)
    expected = _sha(b"the real sdist")
    with pytest.raises(KilnError) as err:
        fetch(lock=_lock(tmp_path, _sha(wheel), expected), log=lambda _: None)
    message = str(err.value)
    assert f"has sha256 {_sha(cached)}, but {tmp_path / 'upstream.lock'} (vLLM 1.0.0) pins {expected}" in message
    assert "cannot tell a damaged file from a wrong pin; the file was kept" in message
    assert (cache / "upstream" / SDIST).read_bytes() == cached


def test_a_download_with_another_hash_is_refused_and_not_kept(cache, tmp_path, index):
    wheel = b"wheel bytes"
    (cache / "upstream" / WHEEL).write_bytes(wheel)
    index[SDIST] = b"not what was pinned"
    expected = _sha(b"the real sdist")
    with pytest.raises(KilnError) as err:
        fetch(lock=_lock(tmp_path, _sha(wheel), expected), log=lambda _: None)
    assert (f"{SDIST}: sha256 mismatch: {tmp_path / 'upstream.lock'} (vLLM 1.0.0) pins {expected}, "
            f"the package index served {_sha(b'not what was pinned')}") in str(err.value)
    assert [p.name for p in (cache / "upstream").iterdir()] == [WHEEL]


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

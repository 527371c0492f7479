"""pin-bump: registry files and hashes, the lock, and the fork pins (flashinfer-cubin rule)."""

from __future__ import annotations

import io
import tarfile

import pytest

from kiln.errors import KilnError
from kiln.upstream.fetch import sha256_of
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pinbump import cuda_pins, pin_bump, release_from_registry, torch_dependents, update_fork_pins

WHEEL = "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
H = "ab" * 32


def test_the_wheel_with_the_default_tags_and_the_sdist_are_picked_with_their_hashes():
    files = {"vllm-2.0.0-cp38-abi3-manylinux_2_28_aarch64.whl": "cd" * 32,
             "vllm-2.0.0-cp38-abi3-manylinux_2_28_x86_64.whl": H, "vllm-2.0.0.tar.gz": "ef" * 32}
    release = release_from_registry("2.0.0", WHEEL, files)
    assert release.wheel.name == "vllm-2.0.0-cp38-abi3-manylinux_2_28_x86_64.whl" and release.wheel.sha256 == H
    assert release.sdist.sha256 == "ef" * 32


def test_a_version_the_index_does_not_have_is_refused():
    with pytest.raises(KilnError, match="vllm 9.9.9 is not on the package index .*latest there: 1.0.0"):
        release_from_registry("9.9.9", WHEEL, {WHEEL: H, "vllm-1.0.0.tar.gz": H})


def test_a_file_without_a_known_hash_is_refused():
    with pytest.raises(KilnError, match="no sha256 for vllm-2.0.0.tar.gz"):
        release_from_registry("2.0.0", WHEEL, {"vllm-2.0.0-cp38-abi3-manylinux_2_28_x86_64.whl": H,
                                                "vllm-2.0.0.tar.gz": ""})


def write_cuda(root, text):
    (root / "requirements").mkdir(parents=True, exist_ok=True)
    (root / "requirements" / "common.txt").write_text("numpy\nxgrammar==0.2.8\n")
    (root / "requirements" / "cuda.txt").write_text("# CUDA\n-r common.txt\n" + text)
    return root


def test_flashinfer_cubin_follows_flashinfer_python_when_upstream_lists_no_cubin(tmp_path):
    pins = cuda_pins(write_cuda(tmp_path, "--extra-index-url https://x\nflashinfer-python==0.7.2.post1\n"))
    assert pins["flashinfer-cubin"] == "flashinfer-cubin==0.7.2.post1"
    assert pins["xgrammar"] == "xgrammar==0.2.8"


def test_a_cubin_pin_that_differs_from_flashinfer_python_is_refused(tmp_path):
    root = write_cuda(tmp_path, "flashinfer-python==0.7.2\nflashinfer-cubin==0.7.0\n")
    with pytest.raises(KilnError, match="flashinfer-cubin must equal the flashinfer-python version"):
        cuda_pins(root)


def test_fork_pins_that_follow_upstream_move_and_overrides_are_flagged():
    old = {"flashinfer-cubin": "flashinfer-cubin==0.7.0.post1", "xgrammar": "xgrammar==0.2.8"}
    new = {"flashinfer-cubin": "flashinfer-cubin==0.7.2.post1", "xgrammar": "xgrammar==0.2.9"}
    text = "# fork pins\nflashinfer-cubin==0.7.0.post1\nxgrammar==0.2.8+kiln.1\n-torchcodec\n"
    update = update_fork_pins(text, old, new)
    assert update.text == "# fork pins\nflashinfer-cubin==0.7.2.post1\nxgrammar==0.2.8+kiln.1\n-torchcodec\n"
    assert update.changed == ["flashinfer-cubin: 0.7.0.post1 -> 0.7.2.post1"]
    assert len(update.review) == 1 and update.review[0].startswith("xgrammar")


def make_sdist(cache, version, cuda):
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        for name, text in (("requirements/cuda.txt", cuda), ("requirements/common.txt", "numpy\n")):
            body = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    path = cache / "upstream" / f"vllm-{version}.tar.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.getvalue())
    return sha256_of(path)


def test_pin_bump_adds_the_version_keeps_the_default_and_moves_the_cubin_pin(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE", str(cache))
    old_sha = make_sdist(cache, "1.0.0", "-r common.txt\nflashinfer-python==0.7.0\nflashinfer-cubin==0.7.0\n")
    new_sha = make_sdist(cache, "2.0.0", "-r common.txt\nflashinfer-python==0.7.2\n")
    lock = tmp_path / "upstream.lock"
    lock.write_text(f'# pins\ndefault = "1.0.0"\n\n[versions."1.0.0"]\nwheel = "{WHEEL}"\nwheel_sha256 = "{H}"\n'
                    f'sdist = "vllm-1.0.0.tar.gz"\nsdist_sha256 = "{old_sha}"\n')
    pins = tmp_path / "fork-pins.txt"
    pins.write_text("flashinfer-cubin==0.7.0\n")
    files = {"vllm-2.0.0-cp38-abi3-manylinux_2_28_x86_64.whl": "cd" * 32, "vllm-2.0.0.tar.gz": new_sha}
    result = pin_bump("2.0.0", lock_path=lock, pins_path=pins, make_default=False, files=files)
    loaded = UpstreamLock.load(lock)
    assert loaded.default == "1.0.0" and sorted(loaded.releases) == ["1.0.0", "2.0.0"]
    assert loaded.release("2.0.0").sdist.sha256 == new_sha
    assert lock.read_text().startswith("# pins\n")
    assert pins.read_text() == "flashinfer-cubin==0.7.2\n"
    assert "flashinfer-python: flashinfer-python==0.7.0 -> flashinfer-python==0.7.2" in result.upstream_changes
    assert result.torch is None  # neither requirements file pins torch

    pin_bump("2.0.0", lock_path=lock, pins_path=pins, make_default=True, files=files)
    assert UpstreamLock.load(lock).default == "2.0.0"


def test_pin_bump_refuses_to_change_an_existing_pin(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    lock = tmp_path / "upstream.lock"
    lock.write_text(f'default = "1.0.0"\n\n[versions."1.0.0"]\nwheel = "{WHEEL}"\nwheel_sha256 = "{H}"\n'
                    f'sdist = "vllm-1.0.0.tar.gz"\nsdist_sha256 = "{H}"\n')
    with pytest.raises(KilnError, match="refusing to overwrite a pin"):
        pin_bump("1.0.0", lock_path=lock, pins_path=tmp_path / "p.txt", make_default=False,
                 files={WHEEL: "cd" * 32, "vllm-1.0.0.tar.gz": H})


def test_pin_bump_that_moves_torch_says_what_moves_and_what_must_be_rebuilt(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE", str(cache))
    old_sha = make_sdist(cache, "1.0.0", "-r common.txt\ntorch==2.14.0\ntorchaudio==2.11.0\n"
                                         "torchvision==0.29.0\nflashinfer-python==0.7.3\n")
    new_sha = make_sdist(cache, "2.0.0", "-r common.txt\ntorch==2.15.0\ntorchaudio==2.12.0\n"
                                         "torchvision==0.29.0\nflashinfer-python==0.7.3\n")
    lock = tmp_path / "upstream.lock"
    lock.write_text(f'default = "1.0.0"\n\n[versions."1.0.0"]\nwheel = "{WHEEL}"\nwheel_sha256 = "{H}"\n'
                    f'sdist = "vllm-1.0.0.tar.gz"\nsdist_sha256 = "{old_sha}"\n')
    files = {"vllm-2.0.0-cp38-abi3-manylinux_2_28_x86_64.whl": "cd" * 32, "vllm-2.0.0.tar.gz": new_sha}
    result = pin_bump("2.0.0", lock_path=lock, pins_path=tmp_path / "fork-pins.txt", make_default=False,
                      files=files)
    # This checkout: the xgrammar build pins no torch, csrc/ has no torch extension and
    # the KVarN library includes no torch header, so only these two are named.
    assert result.torch.describe() == [
        "torch moves: 2.14.0 -> 2.15.0; with it torchaudio: torchaudio==2.11.0 -> torchaudio==2.12.0",
        "rebuild against the new torch:",
        ("  the CPU test venv: kiln/testing/testenv.py installs the wheel's own torch pin, so the next "
        "`tests/run` makes a new venv with torch==2.15.0"),
        ("  the GPU bundle (`python -m kiln gpu-bundle`): it carries upstream's compiled ops, now "
        "built against torch 2.15.0, to a machine that keeps its own torch; rebuild it and rerun "
        "tests/gpu there"),
    ]


def test_torch_dependents_name_a_torch_extension_a_torch_header_and_a_torch_build_pin(tmp_path):
    assert len(torch_dependents(tmp_path, "2.15.0")) == 2
    (tmp_path / "csrc" / "kvarn").mkdir(parents=True)
    (tmp_path / "csrc" / "ops.cu").write_text("__global__ void k() {}\n")
    (tmp_path / "csrc" / "kvarn" / "decode.cu").write_text("#include <torch/extension.h>\n")
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "xgrammar-build.txt").write_text("scikit-build-core==1.1.2\ntorch==2.15.0\n")
    named = [line.split(":")[0] for line in torch_dependents(tmp_path, "2.15.0")]
    assert named == ["the CPU test venv", "the GPU bundle (`python -m kiln gpu-bundle`)",
                     "the fork's xgrammar wheels", "the fork's torch extension _kiln_C",
                     "the KVarN CUDA library"]

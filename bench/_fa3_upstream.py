"""Upstream's FlashAttention-3 paged decode as a timing baseline for bench/kvarn_decode.py.

vLLM's default bf16 attention on Hopper is FA3, compiled into the upstream wheel as
``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so`` (172 MB, sm_90a, torch's stable C ABI
only, so it loads under any torch of that ABI). The GPU bundle leaves it out for size;
``extract`` copies it out of the pinned, sha256-checked upstream wheel into a git-ignored
folder, xz-compressed to about 16 MB so a device call can carry it, and ``load`` unpacks
it to a temporary folder, checks its sha256 and registers its torch ops.

Nothing of upstream's Python is used: ``FA3.paged_decode`` calls the op by the schema
the library registers (its argument names, read from the binary).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import lzma
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch

LIBRARY = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
PACKED = "_vllm_fa3_C.abi3.so.xz"
MANIFEST = "fa3.json"
XZ_PRESET = 1  # 16 MB in 7 s on the CPU box; preset 6 saves 4 MB for 30 s more


def extract(folder: Path, version: str = "0.33.0", log=print) -> Path:
    """folder/version/ <- the FA3 library of the pinned upstream wheel (fetched into
    kiln's cache when missing), xz-compressed, and a manifest of its raw sha256."""
    from kiln.upstream.fetch import download_from_index, fetch_pinned
    from kiln.upstream.lock import UpstreamLock

    release = UpstreamLock.load().release(version)
    wheel = fetch_pinned(release.wheel, lambda d: download_from_index(release.wheel, d), log)
    out = Path(folder) / version
    out.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    size = 0
    tmp = out / (PACKED + ".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(LIBRARY) as src, \
            lzma.open(tmp, "wb", preset=XZ_PRESET) as dst:
        while chunk := src.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
            dst.write(chunk)
    tmp.replace(out / PACKED)
    (out / MANIFEST).write_text(json.dumps({
        "version": version, "wheel": release.wheel.name, "wheel_sha256": release.wheel.sha256,
        "library": LIBRARY, "size": size, "sha256": digest.hexdigest()}, indent=1) + "\n")
    log(f"FA3 of vLLM {version}: {size / 2**20:.0f} MiB -> "
        f"{(out / PACKED).stat().st_size / 2**20:.1f} MiB in {out}")
    return out


class FA3:
    """The loaded library (its ops are registered process-wide); ``paged_decode`` is one
    decode step over a paged bf16 cache."""

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                     scale: float, out: torch.Tensor, cu_q: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], caches [blocks, page, H, D] (vLLM's NHD layout), bf16; one
        query token per request (cu_q: int32 0..B, made once so no launch is timed but
        FA3's), causal, FA3's own split heuristics (num_splits 0)."""
        return torch.ops._vllm_fa3_C.fwd(
            q=q, k=k_cache, v=v_cache, k_new=None, v_new=None, q_v=None, out=out,
            cu_seqlens_q=cu_q, cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None,
            seqused_k=seq_lens, max_seqlen_q=1, max_seqlen_k=max_seq_len,
            page_table=block_table, kv_batch_idx=None, leftpad_k=None, rotary_cos=None,
            rotary_sin=None, seqlens_rotary=None, q_descale=None, k_descale=None,
            v_descale=None, softmax_scale=scale, is_causal=True, window_size_left=-1,
            window_size_right=-1, softcap=0.0, is_rotary_interleaved=True,
            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, s_aux=None,
            cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None)[0]


def load(folder: str | Path | None) -> FA3 | str:
    """The FA3 library from an ``extract`` folder (DIR/0.33.0), or why it cannot run here."""
    if folder is None:
        return "no --fa3 folder given (make one with --extract-fa3 DIR, pass DIR/0.33.0)"
    folder = Path(folder)
    packed, manifest = folder / PACKED, folder / MANIFEST
    if not (packed.is_file() and manifest.is_file()):
        return (f"--fa3 {folder}: no {PACKED} and {MANIFEST} there (make them with "
                f"--extract-fa3 DIR, pass DIR/<version>)")
    if not torch.cuda.is_available():
        return "FA3 needs a CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"FA3 is built for sm_90a only; this GPU is sm_{cap[0]}{cap[1]}"
    want = json.loads(manifest.read_text())
    unpacked = Path(tempfile.mkdtemp(prefix="kiln-fa3-")) / Path(LIBRARY).name
    atexit.register(shutil.rmtree, unpacked.parent, True)
    digest = hashlib.sha256()
    with lzma.open(packed) as src, unpacked.open("wb") as dst:
        while chunk := src.read(1 << 22):
            digest.update(chunk)
            dst.write(chunk)
    if digest.hexdigest() != want["sha256"]:
        return f"--fa3 {folder}: {PACKED} does not unpack to the sha256 its {MANIFEST} names"
    try:
        torch.ops.load_library(str(unpacked))
    except (OSError, RuntimeError) as exc:
        return f"FA3 of vLLM {want['version']} did not load: {exc}"
    return FA3()

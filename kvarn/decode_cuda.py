"""CUDA C++ fused decode / speculative-verify attention over the paged KVarN cache.

``attend_rotated_cuda`` computes exactly what ``kvarn.decode.attend_rotated`` (the Triton
kernel) computes, from ``csrc/kvarn/kvarn_decode.cu``: a shared library with a C ABI, loaded
here with ctypes, so it needs no torch headers and works with any torch build. The
launch takes raw pointers and shapes on torch's current stream (no host syncs, no
allocation inside), so it can be captured in a CUDA graph. Shapes the kernel has no
instance for (``supports`` is False) are for the caller to send to the Triton kernel.

The library is looked up at ``$KVARN_CUDA_LIB``, else next to this file
(``libkvarn_decode.so``); ``build_library`` compiles it with nvcc.

Imports torch, ctypes and the standard library only (no triton).
"""
from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

import torch

from .cuda_build import ARCHS, LIB_NAME, compile_library
from .layout import PagedKV
from .preset import Preset

LOG2E = 1.4426950408889634
ENV_LIB = "KVARN_CUDA_LIB"
HEAD_DIMS = (64, 128, 256)
MAX_ROWS = 16  # query rows per (request, KV head): Q * (Hq / H)
MAX_SPLITS = 1024  # the library's bound (the combine keeps its weights in shared memory)
_Q_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_lib = None
_lib_error: str | None = None


def library_path() -> Path:
    env = os.environ.get(ENV_LIB)
    return Path(env) if env else Path(__file__).resolve().parent / LIB_NAME


def build_library(out_dir, archs=ARCHS, source: Path | None = None, nvcc: str | None = None,
                  ptxas_verbose: bool = False, threads: int = 0) -> Path:
    """Compile csrc/kvarn/kvarn_decode.cu into out_dir/libkvarn_decode.so for the given SM
    archs; with ptxas_verbose, registers and spills per kernel go to out_dir/build.log.
    Exact math (no --use_fast_math); the command is ``cuda_build``'s, the one kiln build
    uses. Raises RuntimeError with nvcc's output on failure."""
    return compile_library(out_dir, archs, source, nvcc, ptxas_verbose, threads)


def load_library(path=None) -> ctypes.CDLL:
    """Load (or reload from `path`) the shared library and declare its C ABI."""
    global _lib, _lib_error
    path = Path(path) if path else library_path()
    if not path.exists():
        _lib, _lib_error = None, (f"the KVarN CUDA library is not built: {path} does not exist "
                                  f"(kvarn.decode_cuda.build_library, or set ${ENV_LIB})")
        raise RuntimeError(_lib_error)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _lib, _lib_error = None, f"the KVarN CUDA library at {path} does not load: {exc}"
        raise RuntimeError(_lib_error) from None
    p, i, ll, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    lib.kvarn_decode_launch.restype = i
    try:
        lib.kvarn_decode_partials.restype = i
    except AttributeError:  # a library built before part 0 took the side pool
        _lib, _lib_error = None, (f"the KVarN CUDA library at {path} is older than this "
                                  f"package (no kvarn_decode_partials): rebuild it "
                                  f"(kvarn.decode_cuda.build_library, or kiln build)")
        raise RuntimeError(_lib_error) from None
    lib.kvarn_decode_partials.argtypes = [i]
    lib.kvarn_decode_launch.argtypes = [p, i, p, p, p, ll, p, ll, i, p, p, p, p, p,
                                        i, i, i, i, i, i, i, i, f, i, p]
    lib.kvarn_decode_supported.restype = i
    lib.kvarn_decode_supported.argtypes = [i, i, i, i]
    lib.kvarn_decode_selftest.restype = i
    lib.kvarn_decode_selftest.argtypes = [p, p]
    lib.kvarn_decode_error_string.restype = ctypes.c_char_p
    lib.kvarn_decode_error_string.argtypes = [i]
    _lib, _lib_error = lib, None
    return lib


def _get_lib() -> ctypes.CDLL:
    if _lib is not None:
        return _lib
    return load_library()


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not (no CUDA, library not built)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if torch.version.hip is not None:
        return "the KVarN CUDA kernel is CUDA only (this torch is a ROCm build)"
    try:
        _get_lib()
    except RuntimeError as exc:
        return str(exc)
    return None


def available() -> bool:
    return unavailable_reason() is None


SELFTEST_BITS = ("ldmatrix", "ldmatrix.trans", "movmatrix.trans", "mma.m16n8k16")


def selftest(device=None) -> list[str]:
    """The PTX primitives whose fragment layout on this GPU differs from what the kernel
    assumes (empty when all agree). Syncs: a diagnostic, not for the decode path."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda", torch.cuda.current_device())
    lib = _get_lib()
    flags = torch.zeros(1, dtype=torch.int32, device=dev)
    with torch.cuda.device(dev):
        rc = lib.kvarn_decode_selftest(flags.data_ptr(), torch.cuda.current_stream(dev).cuda_stream)
        if rc != 0:
            raise RuntimeError(f"kvarn_decode_selftest failed: "
                               f"{lib.kvarn_decode_error_string(rc).decode()}")
        bits = int(flags.item())
    if bits < 0:
        return ["the library has no sm_80+ code for this GPU"]
    return [name for i, name in enumerate(SELFTEST_BITS) if bits >> i & 1]


def supports(preset, head_dim: int, q_rows: int) -> bool:
    """Whether the kernel has an instance for this preset (name or Preset), head dim and
    number of query rows per KV head (Q * Hq / H); False means use the Triton kernel."""
    p = Preset.parse(preset) if isinstance(preset, str) else preset
    return (p.key_bits == 4 and p.value_bits in (2, 4) and p.group in (64, 128)
            and head_dim in HEAD_DIMS and 1 <= q_rows <= MAX_ROWS)


# Record CTAs per SM that the default split count aims at. The kernel holds 4 CTAs per
# SM at D <= 128, but its split sweep on the H200 (bench/kvarn_decode.py --cuda-sweep)
# was fastest near 2: 1 split at 64 x 16K and 256 x 8K, 32 at 1 x 32K, 8-16 at 1 x 4K,
# at D = 128 and 256 alike (each split past the first also adds a combine row)
PROGRAMS_PER_SM = 2
_SMS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def default_splits(batch: int, num_kv_heads: int, max_blocks: int,
                   programs_per_sm: int = PROGRAMS_PER_SM, device: int | None = None) -> int:
    """kvarn.decode.default_splits's formula (no triton import), at the CUDA kernel's own
    occupancy: about programs_per_sm CTAs per SM from shapes alone, at least 4 blocks
    per split, at most 64 splits."""
    sms = _sm_count(torch.cuda.current_device() if device is None else device)
    want = -(-programs_per_sm * sms // (batch * num_kv_heads))
    return max(1, min(want, max_blocks // 4, 64))


def _check_table(name: str, t: torch.Tensor, rows: int, dev: torch.device) -> None:
    if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"{name} must be int32 [{rows}, width], got {t.dtype} {tuple(t.shape)}")
    if t.device != dev or t.stride(1) != 1:
        raise ValueError(f"{name} must be on {dev} with unit stride along its columns "
                         f"(device {t.device}, strides {t.stride()})")


def _check_vector(name: str, t: torch.Tensor, rows: int, dev: torch.device) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != (rows,) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 [{rows}], "
                         f"got {t.dtype} {tuple(t.shape)}")
    if t.device != dev:
        raise ValueError(f"{name} must be on {dev}, got {t.device}")


def attend_rotated_cuda(q_rot: torch.Tensor, kv: PagedKV, block_table: torch.Tensor,
                        side_table: torch.Tensor, seq_lens: torch.Tensor,
                        num_flushed: torch.Tensor, sm_scale: float | None = None,
                        num_splits: int | None = None) -> torch.Tensor:
    """Attention in the rotated frame, kvarn.decode.attend_rotated's semantics and
    output: q_rot [B, Q, Hq, D] (fp32, fp16 or bf16) -> fp32 [B, Q, Hq, D]. Q = 1 is
    decode, Q = k + 1 speculative verify (row i sees seq_len - Q + i + 1 positions).
    num_splits: split-K over each request's records (None: ``default_splits``); with more
    than one, the fp16 side pool gets a CTA of its own.
    Table ids are not checked (as the Triton kernel outside debug mode)."""
    if q_rot.dim() != 4:
        raise ValueError(f"q_rot must be [B, Q, Hq, D], got shape {tuple(q_rot.shape)}")
    bsz, nq, hq, d = q_rot.shape
    h, p = kv.num_kv_heads, kv.preset
    if d != kv.head_dim or hq % h or hq == 0:
        raise ValueError(f"q_rot must be [B, Q, k*{h}, {kv.head_dim}], got {tuple(q_rot.shape)}")
    if q_rot.dtype not in _Q_DTYPES:
        raise ValueError(f"q_rot dtype {q_rot.dtype}: allowed: float32, float16, bfloat16")
    rows = nq * (hq // h)
    if not supports(p, d, rows):
        raise ValueError(f"{p.name}, head_dim {d}, {rows} query rows per KV head: the CUDA "
                         f"kernel supports head_dim {HEAD_DIMS} and 1..{MAX_ROWS} rows "
                         f"(Q * Hq / H); use kvarn.decode.attend_rotated")
    if not q_rot.is_cuda:
        raise ValueError(f"q_rot must be a CUDA tensor, got {q_rot.device}")
    dev = q_rot.device
    if kv.cache.device != dev or kv.side.device != dev:
        raise ValueError(f"kv.cache and kv.side must be on {dev}, got {kv.cache.device} "
                         f"and {kv.side.device}")
    if kv.cache.data_ptr() % 16 or kv.side.data_ptr() % 16:
        raise ValueError("kv.cache and kv.side must start 16-byte aligned")
    if not 1 <= bsz <= 65535:
        raise ValueError(f"batch {bsz}: allowed: 1..65535")
    _check_table("block_table", block_table, bsz, dev)
    _check_table("side_table", side_table, bsz, dev)
    _check_vector("seq_lens", seq_lens, bsz, dev)
    _check_vector("num_flushed", num_flushed, bsz, dev)
    if num_splits is None:
        splits = default_splits(bsz, h, block_table.shape[1], device=dev.index)
    else:
        splits = int(num_splits)
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"num_splits {num_splits}: allowed: 1..{MAX_SPLITS} "
                             f"(None: default)")
    lib = _get_lib()
    q = q_rot.contiguous()
    out = torch.empty(bsz, nq, hq, d, dtype=torch.float32, device=dev)
    parts = lib.kvarn_decode_partials(splits)
    if parts:
        o_part = torch.empty(bsz * nq * hq * parts, d, dtype=torch.float32, device=dev)
        lse = torch.empty(bsz * nq * hq * parts, dtype=torch.float32, device=dev)
        o_ptr, lse_ptr = o_part.data_ptr(), lse.data_ptr()
    else:
        o_ptr = lse_ptr = None
    scale = (sm_scale if sm_scale is not None else d ** -0.5) * LOG2E
    if not math.isfinite(scale):
        raise ValueError(f"sm_scale {sm_scale}: must be finite")
    args = (q.data_ptr(), _Q_DTYPES[q.dtype], kv.cache.data_ptr(), kv.side.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), side_table.data_ptr(),
            side_table.stride(0), side_table.shape[1], seq_lens.data_ptr(),
            num_flushed.data_ptr(), out.data_ptr(), o_ptr, lse_ptr, bsz, nq, hq, h, d, p.group,
            p.value_bits, splits, scale, dev.index, torch.cuda.current_stream(dev).cuda_stream)
    if dev.index == torch.cuda.current_device():
        rc = lib.kvarn_decode_launch(*args)
    else:  # the library's runtime follows the thread's current device: make it q's
        with torch.cuda.device(dev):
            rc = lib.kvarn_decode_launch(*args)
    if rc != 0:
        msg = lib.kvarn_decode_error_string(rc).decode()
        raise RuntimeError(f"kvarn_decode_launch failed: {msg} (cudaError {rc}; {p.name}, "
                           f"D={d}, rows={rows}, splits={splits})")
    return out

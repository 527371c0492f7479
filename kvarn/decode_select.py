"""Which kernel serves a decode call: the CUDA C++ kernel (``decode_cuda``) or Triton's.

"auto" and "cuda" take the CUDA kernel where its library loads and has an instance for
the call's shape, else the Triton "prefetch" kernel. The choice reads only shapes,
devices and a check made once per process (no device sync), so it is the same inside
CUDA-graph capture as outside. The first launch is guarded: a library that loads but
cannot launch (a driver older than the CUDA runtime it links, no code for this GPU)
fails before anything is queued, and the process falls back to Triton for good. Each
reason for a fallback is logged once.
"""
from __future__ import annotations

import logging

import torch

from . import decode_cuda

logger = logging.getLogger(__name__)

FALLBACK = "prefetch"
_state: dict[str, str | None] = {}  # "unavailable": None (usable) or why not
_launched = False
_logged: set[str] = set()


def unavailable_reason() -> str | None:
    """Why the CUDA kernel cannot serve this process (None: it can); checked once."""
    if "unavailable" not in _state:
        _state["unavailable"] = decode_cuda.unavailable_reason()
    return _state["unavailable"]


def fallback_reason(preset, head_dim: int, rows: int, device: torch.device | None = None,
                    debug: bool = False) -> str | None:
    """Why a call of this shape (on ``device``, when given) cannot take the CUDA kernel
    (None: it can)."""
    if debug:
        return "debug=True (the out-of-pool table check runs inside the Triton kernel)"
    if device is not None and device.type != "cuda":
        return f"the query is on {device}, not a CUDA device"
    if not decode_cuda.supports(preset, head_dim, rows):
        return (f"{preset.name}, head_dim {head_dim}, {rows} query rows per KV head: the CUDA "
                f"kernel has head_dim {', '.join(map(str, decode_cuda.HEAD_DIMS))} and "
                f"1..{decode_cuda.MAX_ROWS} rows")
    return unavailable_reason()


def choose(variant: str, preset, head_dim: int, rows: int, device: torch.device,
           debug: bool = False) -> str:
    """"cuda" or FALLBACK for variant "auto" or "cuda"; a fallback's reason is logged once."""
    reason = fallback_reason(preset, head_dim, rows, device, debug)
    if reason is None:
        return "cuda"
    _log_once(logging.WARNING if variant == "cuda" else logging.INFO,
              f"KVarN decode variant {variant!r} uses the Triton {FALLBACK!r} kernel: {reason}")
    return FALLBACK


def attend(q_rot, kv, block_table, side_table, seq_lens, num_flushed, sm_scale,
           num_splits) -> torch.Tensor | None:
    """decode_cuda.attend_rotated_cuda; None when this process's first launch failed."""
    global _launched
    try:
        out = decode_cuda.attend_rotated_cuda(q_rot, kv, block_table, side_table, seq_lens,
                                              num_flushed, sm_scale, num_splits)
    except RuntimeError as exc:  # the launcher's cudaError: shape errors are ValueErrors
        if _launched:
            raise
        _state["unavailable"] = f"the CUDA kernel's first launch failed: {exc}"
        _log_once(logging.WARNING, f"KVarN decode falls back to the Triton {FALLBACK!r} kernel "
                                   f"for this process: {_state['unavailable']}")
        return None
    _launched = True
    return out


def describe(variant: str, preset, head_dim: int, rows: int) -> str:
    """The kernel CUDA calls of this shape get under ``variant``, in words (a start-up log)."""
    if variant not in ("auto", "cuda"):
        return f"Triton {variant!r} (KVARN_DECODE_VARIANT={variant})"
    reason = fallback_reason(preset, head_dim, rows)
    if reason is None:
        return f"CUDA C++ ({decode_cuda.library_path()})"
    return f"Triton {FALLBACK!r}, since {reason}"


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)

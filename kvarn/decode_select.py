"""Which kernel serves a decode call: the CUDA C++ kernel (``decode_cuda``) or Triton's.

"auto" and "cuda" take the CUDA kernel where its library loads and has an instance for
the call's shape, else the Triton "prefetch" kernel. The choice reads only shapes,
devices and what a ``DecodeSelector`` has learnt (no device sync), so it is the same
inside CUDA-graph capture as outside. A selector checks once whether the CUDA kernel can
serve the process, guards its first launch (a library that loads but cannot launch, such
as a driver older than the CUDA runtime it links or no code for this GPU, fails before
anything is queued, and the selector falls back to Triton for good) and logs each reason
for a fallback once. The KVARN backend's metadata builder owns one and passes it to every
decode call through its metadata; a call given none gets a fresh one.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import decode_cuda

logger = logging.getLogger(__name__)

FALLBACK = "prefetch"


def shape_reason(preset, head_dim: int, rows: int, device: torch.device | None = None,
                 debug: bool = False) -> str | None:
    """Why a call of this shape (on ``device``, when given) cannot take the CUDA kernel on
    any machine (None: it can where the kernel is available)."""
    if debug:
        return "debug=True (the out-of-pool table check runs inside the Triton kernel)"
    if device is not None and device.type != "cuda":
        return f"the query is on {device}, not a CUDA device"
    if not decode_cuda.supports(preset, head_dim, rows):
        return (f"{preset.name}, head_dim {head_dim}, {rows} query rows per KV head: the CUDA "
                f"kernel has head_dim {', '.join(map(str, decode_cuda.HEAD_DIMS))} and "
                f"1..{decode_cuda.MAX_ROWS} rows")
    return None


@dataclass
class DecodeSelector:
    """What one server has learnt about the CUDA kernel in this process.

    probe says why the kernel cannot serve here (None: it can); it runs once, on the
    first call that needs the answer.
    """

    probe: Callable[[], str | None] = decode_cuda.unavailable_reason
    checked: bool = False
    unavailable: str | None = None  # the probe's answer, or why the first launch failed
    launched: bool = False  # a launch went through: a later launch error is a real one
    logged: set[str] = field(default_factory=set)

    def unavailable_reason(self) -> str | None:
        """Why the CUDA kernel cannot serve this process (None: it can)."""
        if not self.checked:
            self.unavailable, self.checked = self.probe(), True
        return self.unavailable

    def fallback_reason(self, preset, head_dim: int, rows: int,
                        device: torch.device | None = None, debug: bool = False) -> str | None:
        """Why a call of this shape (on ``device``, when given) cannot take the CUDA kernel
        here (None: it can)."""
        return shape_reason(preset, head_dim, rows, device, debug) or self.unavailable_reason()

    def choose(self, variant: str, preset, head_dim: int, rows: int, device: torch.device,
               debug: bool = False) -> str:
        """"cuda" or FALLBACK for variant "auto" or "cuda"; a fallback's reason is logged
        once."""
        reason = self.fallback_reason(preset, head_dim, rows, device, debug)
        if reason is None:
            return "cuda"
        self._log_once(logging.WARNING if variant == "cuda" else logging.INFO,
                       f"KVarN decode variant {variant!r} uses the Triton {FALLBACK!r} "
                       f"kernel: {reason}")
        return FALLBACK

    def attend(self, q_rot, kv, block_table, side_table, seq_lens, num_flushed, sm_scale,
               num_splits) -> torch.Tensor | None:
        """decode_cuda.attend_rotated_cuda; None when this selector's first launch failed."""
        try:
            out = decode_cuda.attend_rotated_cuda(q_rot, kv, block_table, side_table,
                                                  seq_lens, num_flushed, sm_scale, num_splits)
        except RuntimeError as exc:  # the launcher's cudaError: shape errors are ValueErrors
            if self.launched:
                raise
            self.checked, self.unavailable = True, f"the CUDA kernel's first launch failed: {exc}"
            self._log_once(logging.WARNING, f"KVarN decode falls back to the Triton "
                                            f"{FALLBACK!r} kernel for this process: "
                                            f"{self.unavailable}")
            return None
        self.launched = True
        return out

    def describe(self, variant: str, preset, head_dim: int, rows: int) -> str:
        """The kernel CUDA calls of this shape get under ``variant``, in words (a start-up
        log)."""
        if variant not in ("auto", "cuda"):
            return f"Triton {variant!r} (KVARN_DECODE_VARIANT={variant})"
        reason = self.fallback_reason(preset, head_dim, rows)
        if reason is None:
            return f"CUDA C++ ({decode_cuda.library_path()})"
        return f"Triton {FALLBACK!r}, since {reason}"

    def _log_once(self, level: int, message: str) -> None:
        if message not in self.logged:
            self.logged.add(message)
            logger.log(level, message)

"""Weights written tensor by tensor: a safetensors writer that holds one tensor in
memory at a time, the seeded init's per-tensor generators (on the CPU, or on the
device a spec names), and the dtype names kiln accepts mapped to torch's. torch is
imported inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, naming

# A tensor to write: its name, its shape, and a function making its values.
Entry = tuple[str, tuple[int, ...], Callable[[], Any]]

_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def write_safetensors(path: Path, entries: Sequence[Entry], dtype: str) -> None:
    """A safetensors file written one tensor at a time, in ``entries`` order.

    The format: an 8-byte little-endian header length, a JSON header naming
    each tensor's dtype, shape and byte range, then the raw little-endian data.
    Only one tensor is in memory at a time.
    """
    import torch

    if sys.byteorder != "little":
        raise KilnError("writing safetensors needs a little-endian machine")
    stored = torch_dtype(dtype)
    itemsize = torch.empty((), dtype=stored).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = math.prod(shape) * itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with naming(path), path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, make in entries:
            tensor = make().to(device="cpu", dtype=stored).contiguous()
            if tuple(tensor.shape) != shape:
                raise AssertionError(f"{name}: made {tuple(tensor.shape)}, declared {shape}")
            f.write(tensor.view(torch.uint8).numpy().data)


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_generator(seed: int, name: str, device: str) -> Any:
    """The generator tensor ``name`` draws from: its own stream, on ``device``.

    The CPU's streams give the same values everywhere; a CUDA stream's values
    differ from the CPU's and may differ between GPU kinds.
    """
    import torch

    if device != "cpu" and not torch.cuda.is_available():
        raise KilnError(f"--device {device}: this torch sees no CUDA device; use --device cpu")
    return torch.Generator(device=device).manual_seed(tensor_seed(seed, name))


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float,
                  device: str = "cpu") -> Any:
    """normal(0, std) in float32 from ``name``'s generator."""
    import torch

    gen = seeded_generator(seed, name, device)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


def seeded_uniform(seed: int, name: str, shape: tuple[int, ...], low: float, high: float,
                   device: str = "cpu") -> Any:
    """uniform(low, high) in float32 from ``name``'s generator."""
    import torch

    gen = seeded_generator(seed, name, device)
    return torch.empty(shape, device=device).uniform_(low, high, generator=gen)

"""The KVarN cache dtypes as vLLM names them: --kv-cache-dtype values, the storage
dtype of the paged pool, and the KVQuantMode member each one maps to.

Imported by vllm/utils/torch_utils.py and vllm/v1/kv_cache_interface.py, so it
imports nothing from vLLM (only the torch-only vllm.kvarn package).
"""

from __future__ import annotations

import torch

from vllm.kvarn.preset import Preset

KVARN_CACHE_DTYPES: tuple[str, ...] = Preset.names()
# The paged pool holds packed tile records (codes and fp16 scales), addressed as bytes.
KVARN_STORAGE_DTYPE = torch.uint8


def is_kvarn_dtype(cache_dtype: object) -> bool:
    return isinstance(cache_dtype, str) and cache_dtype in KVARN_CACHE_DTYPES


def kvarn_storage_dtypes() -> dict[str, torch.dtype]:
    """Entries for upstream's STR_DTYPE_TO_TORCH_DTYPE."""
    return dict.fromkeys(KVARN_CACHE_DTYPES, KVARN_STORAGE_DTYPE)


def kvarn_quant_mode_name(cache_dtype: str) -> str:
    """The KVQuantMode member of a preset: its name upper-cased, as upstream does for
    TurboQuant, so the mode maps back to the preset with ``.name.lower()``."""
    Preset.parse(cache_dtype)
    return cache_dtype.upper()

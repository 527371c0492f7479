"""The KVarN cache dtypes as vLLM names them: --kv-cache-dtype values, the storage
dtype of the paged pool, and the KVQuantMode each one maps to, registered by the fork's
plugin through upstream's register_kv_cache_dtype (``register_kvarn_dtypes``). The module
imports nothing from vLLM at import time (only the torch-only vllm.kvarn package).
"""

from __future__ import annotations

import torch
from vllm.kvarn.preset import Preset

KVARN_CACHE_DTYPES: tuple[str, ...] = Preset.names()
# The paged pool holds packed tile records (codes and fp16 scales), addressed as bytes.
KVARN_STORAGE_DTYPE = torch.uint8


def is_kvarn_dtype(cache_dtype: object) -> bool:
    return isinstance(cache_dtype, str) and cache_dtype in KVARN_CACHE_DTYPES


class KVarNCacheDType:
    """upstream's KVCacheDTypeHandler for one preset (``name`` is set per preset)."""

    name: str

    def torch_dtype(self) -> torch.dtype:
        return KVARN_STORAGE_DTYPE

    def quant_mode(self):
        from vllm.v1.kv_cache_interface import KVQuantMode

        return KVQuantMode.CUSTOM


def register_kvarn_dtypes() -> None:
    """Register every preset with upstream's register_kv_cache_dtype, stored as uint8
    under KVQuantMode.CUSTOM (the KVARN backend dispatches its own kernels)."""
    from vllm.config.cache import get_kv_cache_dtype_handler, register_kv_cache_dtype

    for name in KVARN_CACHE_DTYPES:
        if get_kv_cache_dtype_handler(name) is None:  # plugins may load more than once
            register_kv_cache_dtype(name)(type(f"KVarNCacheDType_{name}",
                                               (KVarNCacheDType,), {"name": name}))


"""The KVarN cache dtypes as vLLM names them: --kv-cache-dtype values, the storage
dtype of the paged pool, and the KVQuantMode each one maps to.

On 0.32.0 the kvarn-dtypes topic reads these from vllm/utils/torch_utils.py and
vllm/v1/kv_cache_interface.py, so the module imports nothing from vLLM at import time
(only the torch-only vllm.kvarn package). From 0.33.0 on, ``register_kvarn_dtypes``
(run by the fork's plugin) carries them through upstream's register_kv_cache_dtype.
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


class KVarNCacheDType:
    """upstream's KVCacheDTypeHandler for one preset (``name`` is set per preset)."""

    name: str

    def torch_dtype(self) -> torch.dtype:
        return KVARN_STORAGE_DTYPE

    def quant_mode(self):
        from vllm.v1.kv_cache_interface import KVQuantMode

        return KVQuantMode.CUSTOM


def register_kvarn_dtypes() -> bool:
    """Register every preset with upstream's register_kv_cache_dtype, stored as uint8
    under KVQuantMode.CUSTOM (the KVARN backend dispatches its own kernels); False on a
    pin without that extension point, where the kvarn-dtypes topic carries them."""
    try:
        from vllm.config.cache import get_kv_cache_dtype_handler, register_kv_cache_dtype
    except ImportError:
        return False
    for name in KVARN_CACHE_DTYPES:
        if get_kv_cache_dtype_handler(name) is None:  # plugins may load more than once
            register_kv_cache_dtype(name)(type(f"KVarNCacheDType_{name}",
                                               (KVarNCacheDType,), {"name": name}))
    return True


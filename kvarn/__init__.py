"""KVarN: variance-normalized 4/2-bit KV cache (format, torch reference, Triton kernels).

Imports torch and triton only, so it runs without vLLM. Inside the fork wheel it lives at
``vllm/kvarn``; all imports in it are relative.
"""
from . import reference
from .layout import PagedKV
from .preset import DEFAULT_PRESET, HEAD_DIMS, Preset

__all__ = ["DEFAULT_PRESET", "HEAD_DIMS", "PagedKV", "Preset", "reference"]

"""The fork's split-KV multi-query attention for speculative verify (Triton), over the
paged KV caches of upstream's TRITON_ATTN backend: bf16/fp16, fp8, and the int8, fp8
and int4 per-token-head dtypes.

Imports torch and triton only, so it runs and is tested without vLLM. Inside the fork
wheel it lives at ``vllm/specattn``; all imports in it are relative, but for the Hadamard
builder of its sibling package kvarn (``rotation``).
"""
from . import reference
from .cache import CACHE_DTYPES, Mode, PagedCache
from .verify import MAX_QUERY_LEN, verify_attention

__all__ = ["CACHE_DTYPES", "MAX_QUERY_LEN", "Mode", "PagedCache", "reference",
           "verify_attention"]

"""Stand-in for FlashAttention 2's compiled extension, which the GPU bundle leaves out.

vllm.vllm_flash_attn refuses to import unless _vllm_fa2_C or _vllm_fa3_C does, and
every model imports it. This module registers no operator: serve with
--attention-backend TRITON_ATTN or a KVarN --kv-cache-dtype, which never call it.
Copied by `python3 -m kiln gpu-bundle`.
"""

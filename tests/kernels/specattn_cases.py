"""Random paged caches in upstream's TRITON_ATTN layouts, for the verify kernel tests."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from specattn import Mode, PagedCache
from specattn import reference as ref

ON_GPU = torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET")
DEVICE = "cuda" if ON_GPU else "cpu"


def has_upstream_vllm() -> bool:
    """Whether an installed vLLM (the fork wheel) is importable: the checkout's own
    vllm/ overlay folder, on sys.path in this tier, is a namespace package without it."""
    return importlib.util.find_spec("vllm") is not None and \
        importlib.util.find_spec("vllm.platforms") is not None

# name -> (mode, entry dtype of the writer, upstream --kv-cache-dtype)
DTYPES = {
    "bf16": (Mode.PLAIN, torch.bfloat16, "auto"),
    "fp16": (Mode.PLAIN, torch.float16, "float16"),
    "fp8": (Mode.FP8, None, "fp8"),
    "int8_pth": (Mode.PER_TOKEN_HEAD, torch.int8, "int8_per_token_head"),
    "fp8_pth": (Mode.PER_TOKEN_HEAD, torch.float8_e4m3fn, "fp8_per_token_head"),
    "int4_pth": (Mode.INT4, None, "int4_per_token_head"),
}


@dataclass
class Batch:
    q: torch.Tensor  # [T, H_q, D]
    cache: PagedCache
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int


def upstream_views(entries: torch.Tensor, values: torch.Tensor, scales: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Pack K/V entries [B, N, H, C] the way upstream allocates a layer: one logical
    [B, H, N, 2 * (C + pad)] tensor (pad = one float32 scale when ``scales``), then the
    kernels' views cache.transpose(1, 2).split(...) and, for scales, float32 views of the
    pad bytes. Returns (key view, value view, k_scale view, v_scale view)."""
    b, n, h, c = entries.shape
    pad = 4 // entries.element_size() if scales else 0
    raw = torch.zeros(b, h, n, 2 * (c + pad), dtype=entries.dtype, device=entries.device)
    raw[..., :c] = entries.transpose(1, 2)
    raw[..., c + pad: 2 * c + pad] = values.transpose(1, 2)
    key, value = raw.transpose(1, 2).split(c + pad, dim=-1)
    if not scales:
        return key, value, None, None
    as_f32 = raw.view(torch.uint8).view(b, h, n, -1).view(torch.float32)
    per = (c + pad) * entries.element_size() // 4
    ks = as_f32[..., per - 1].transpose(1, 2)
    vs = as_f32[..., 2 * per - 1].transpose(1, 2)
    return key, value, ks, vs


def make_batch(dtype: str, contexts: list[int], query_lens: list[int], *, kv_heads: int = 2,
               gqa: int = 4, head_size: int = 64, page: int = 16, seed: int = 0,
               device: str = DEVICE, q_dtype: torch.dtype | None = None) -> Batch:
    """Random K/V for every page, written as ``dtype`` through upstream's packed layout
    (scales inline, strided views), pages shuffled; request b has contexts[b] tokens of
    which the last query_lens[b] are its queries (0: a padding request)."""
    mode, entry, _ = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-c // page) for c in contexts]
    num_blocks = sum(pages) + 3
    k = torch.randn(num_blocks, page, kv_heads, head_size, generator=gen)
    v = torch.randn(num_blocks, page, kv_heads, head_size, generator=gen)
    k_ent, k_sc = ref.quantize(mode, k, entry)
    v_ent, v_sc = ref.quantize(mode, v, entry)
    if mode in (Mode.PER_TOKEN_HEAD, Mode.INT4):
        key, value, ks, vs = upstream_views(k_ent.to(device), v_ent.to(device), scales=True)
        ks.copy_(k_sc)
        vs.copy_(v_sc)
    else:
        key, value, _, _ = upstream_views(k_ent.to(device), v_ent.to(device), scales=False)
        ks = k_sc.to(device) if k_sc is not None else None
        vs = v_sc.to(device) if v_sc is not None else None
    cache = PagedCache(mode, key, value, ks, vs)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(contexts), max(pages) + 2), num_blocks + 100, dtype=torch.int32)
    first = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[first:first + n]
        first += n
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    model_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    q = torch.randn(int(qsl[-1]), kv_heads * gqa, head_size, generator=gen).to(
        q_dtype or model_dtype)
    return Batch(q.to(device), cache, table.to(device),
                 torch.tensor(contexts, dtype=torch.int32, device=device), qsl.to(device),
                 max(query_lens))


def scratch(tokens: int, heads: int, segments: int, head_size: int, device: str = DEVICE):
    """Upstream's split-softmax scratch shapes, filled with NaN so unwritten reads show."""
    pad = 1 << (head_size - 1).bit_length()
    return (torch.full((tokens, heads, segments, pad), float("nan"), device=device),
            torch.full((tokens, heads, segments), float("nan"), device=device),
            torch.full((tokens, heads, segments), float("nan"), device=device))


def relative_errors(got: torch.Tensor, want: torch.Tensor, query_start_loc: torch.Tensor
                    ) -> list[float]:
    """||got - want|| / ||want|| per request with query tokens."""
    errs = []
    qsl = query_start_loc.tolist()
    for s, e in zip(qsl[:-1], qsl[1:]):
        if e > s:
            w = want[s:e].float()
            errs.append(float((got[s:e].float() - w).norm() / w.norm()))
    return errs

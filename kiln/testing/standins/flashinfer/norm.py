"""Gemma-style RMSNorm in torch, standing in for FlashInfer's kernels of the same names
(see the package docstring): y = x / sqrt(mean(x^2) + eps) * (1 + weight), computed in
float32 and returned in x's dtype. Slower than FlashInfer's fused kernel, equally so for
every KV cache dtype a benchmark compares.
"""
import torch


def _normalize(x32: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x32 * inv_rms * (1.0 + weight.float())


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    y = _normalize(input.float(), weight, eps).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float = 1e-6, enable_pdl: bool | None = None) -> None:
    """In place, as FlashInfer's: residual += input, then input = the norm of that sum,
    normalized from its float32 value (the stored residual is rounded to its dtype)."""
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_normalize(total, weight, eps))

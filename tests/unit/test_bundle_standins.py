"""The GPU bundle's FlashInfer stand-in computes the Gemma RMSNorm that transformers'
Qwen3.5 computes, so the hybrid the GPU tier serves through it is the model a user runs
(vLLM 0.34.0's Qwen3.5 on NVIDIA calls it in every layer)."""
import importlib.util

import pytest
import torch

from kiln.testing.gpubundle import STANDIN_ROOT

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _norm_module():
    spec = importlib.util.spec_from_file_location("standin_flashinfer_norm",
                                                  STANDIN_ROOT / "flashinfer" / "norm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(hidden: int, weight: torch.Tensor, eps: float):
    ref = qwen3_5.Qwen3_5RMSNorm(hidden, eps=eps)
    with torch.no_grad():
        ref.weight.copy_(weight)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rmsnorm_matches_transformers_qwen3_5(dtype):
    norm = _norm_module()
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 5120, generator=gen) * 3).to(dtype)
    weight = torch.randn(5120, generator=gen) * 0.1
    expected = _reference(5120, weight, 1e-6)(x)
    got = norm.gemma_rmsnorm(x, weight.to(dtype), 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected.to(dtype))
    out = torch.empty_like(x)
    assert norm.gemma_rmsnorm(x, weight.to(dtype), 1e-6, out=out) is out
    torch.testing.assert_close(out, got)


def test_gemma_fused_add_rmsnorm_updates_both_in_place():
    norm = _norm_module()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    residual = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    weight = torch.randn(256, generator=gen) * 0.1
    total = x.float() + residual.float()
    expected = _reference(256, weight, 1e-6)(total)
    assert norm.gemma_fused_add_rmsnorm(x, residual, weight.to(torch.bfloat16), 1e-6) is None
    torch.testing.assert_close(residual, total.to(torch.bfloat16))
    torch.testing.assert_close(x, expected.to(torch.bfloat16))

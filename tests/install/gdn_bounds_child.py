"""Run by test_gdn_spec_bounds.py in a process of its own: TRITON_INTERPRET=1 must be set
before triton is imported, and it runs upstream's Gated DeltaNet spec-decode kernels on
the CPU (with no VLLM_TARGET_DEVICE, so the platform keeps the Triton conv update).
Writes what the test compares as JSON to argv[1].

Each kernel runs twice over the same inputs: a request whose accepted-token count is 0
(a step that emitted nothing for it), and the same request with a count of 1. With the
count bounded, both read the request's own first state slot.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
    fused_sigmoid_gating_delta_rule_update,
)


def conv(accepted: list[int]) -> dict[str, list]:
    """Two requests of 3 query tokens (k = 2) through causal_conv1d_update: request 0 on
    cache line 1, request 1 on line 2; line 0 is the null block."""
    gen = torch.Generator().manual_seed(0)
    dim, width, tokens = 8, 4, 3
    x = torch.randn(2, dim, tokens, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    bias = torch.randn(dim, generator=gen)
    state = torch.randn(4, dim, width - 1 + tokens - 1, generator=gen)
    out = causal_conv1d_update(
        x, state, weight, bias, activation="silu",
        conv_state_indices=torch.tensor([1, 2], dtype=torch.int32),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32), out=x.clone())
    return {"out": out[1].tolist(), "state": state[2].tolist()}


def deltanet(accepted: list[int]) -> dict[str, list]:
    """Two requests of 3 tokens through fused_sigmoid_gating_delta_rule_update, each with
    its own row of 3 state slots (request 0: slots 1-3, request 1: slots 4-6)."""
    gen = torch.Generator().manual_seed(1)
    heads, value_heads, dk, dv, total = 1, 2, 16, 16, 6
    q = torch.randn(1, total, heads, dk, generator=gen)
    k = torch.randn(1, total, heads, dk, generator=gen)
    v = torch.randn(1, total, value_heads, dv, generator=gen)
    a = torch.randn(total, value_heads, generator=gen)
    b = torch.randn(total, value_heads, generator=gen)
    a_log = torch.rand(value_heads, generator=gen)
    dt_bias = torch.rand(value_heads, generator=gen)
    state = torch.randn(7, value_heads, dv, dk, generator=gen)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=a_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, initial_state=state,
        inplace_final_state=True, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32),
        ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True)
    return {"out": out[0, 3:].tolist(), "state": state[4:].tolist()}


def main() -> None:
    result = {name: {"zero": run([1, 0]), "one": run([1, 1])}
              for name, run in (("conv", conv), ("deltanet", deltanet))}
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

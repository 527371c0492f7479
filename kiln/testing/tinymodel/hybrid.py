"""Qwen3.5 hybrid checkpoints (transformers' Qwen3_5TextConfig, architecture
Qwen3_5ForCausalLM): Gated DeltaNet (linear attention) layers with a gated
full-attention layer every ``full_attention_interval``, and ``mtp_layers``
multi-token-prediction layers stored under ``mtp.`` as vLLM's Qwen3.5 MTP loader
reads them. The config, every tensor's name and shape (``hybrid_param_shapes``, the
one place they are derived), and the seeded weights, streamed tensor by tensor.

The ``hybrid27`` preset has Qwen3.5 27B's per-layer shapes. It differs from the real
model in 8 layers (6 linear, 2 full) instead of 64, a 512-token vocabulary instead of
248k, tied embeddings, and random weights. What the GPU tier measures does not change:
the per-layer shapes decide which kernels run, the KV bytes per token of each
full-attention layer and the size of each GDN layer's recurrent and convolution
state, and a decode step's time scales with the layer count (x8 to 64 layers), while
the vocabulary only sizes the embedding and the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kiln.testing.tinymodel.spec import TinySpec, layer_types
from kiln.testing.tinymodel.tensors import Entry, seeded_normal, seeded_uniform

Shapes = list[tuple[str, tuple[int, ...]]]

# Mamba2's init, which Gated DeltaNet keeps: decay rates A in [1, 16] and time steps
# dt log-uniform in [1e-3, 1e-1], so the per-token decay exp(-A dt) spans short and
# long memories.
A_RANGE = (1.0, 16.0)
DT_RANGE = (1e-3, 1e-1)


def hybrid_config(spec: TinySpec, common: dict[str, Any]) -> Any:
    """The Qwen3_5TextConfig of a hybrid spec; ``common`` holds the dense fields."""
    from transformers import Qwen3_5TextConfig

    extra = {"mtp_num_hidden_layers": spec.mtp_layers} if spec.mtp_layers else {}
    return Qwen3_5TextConfig(
        **common,
        layer_types=layer_types(spec),
        linear_num_key_heads=spec.linear_key_heads,
        linear_num_value_heads=spec.linear_value_heads,
        linear_key_head_dim=spec.linear_key_dim,
        linear_value_head_dim=spec.linear_value_dim,
        linear_conv_kernel_dim=spec.linear_conv_kernel,
        **extra,
    )


def _attention(spec: TinySpec, p: str) -> Shapes:
    d, D = spec.hidden_size, spec.head_dim
    return [
        # The query projection also carries the output gate: two per head.
        (p + "self_attn.q_proj.weight", (2 * spec.num_heads * D, d)),
        (p + "self_attn.k_proj.weight", (spec.num_kv_heads * D, d)),
        (p + "self_attn.v_proj.weight", (spec.num_kv_heads * D, d)),
        (p + "self_attn.o_proj.weight", (d, spec.num_heads * D)),
        (p + "self_attn.q_norm.weight", (D,)),
        (p + "self_attn.k_norm.weight", (D,)),
    ]


def _linear_attention(spec: TinySpec, p: str) -> Shapes:
    d = spec.hidden_size
    keys = spec.linear_key_heads * spec.linear_key_dim
    values = spec.linear_value_heads * spec.linear_value_dim
    heads = spec.linear_value_heads
    p += "linear_attn."
    return [
        (p + "in_proj_qkv.weight", (2 * keys + values, d)),
        (p + "in_proj_z.weight", (values, d)),
        (p + "in_proj_b.weight", (heads, d)),
        (p + "in_proj_a.weight", (heads, d)),
        # Depthwise causal convolution over q, k and v.
        (p + "conv1d.weight", (2 * keys + values, 1, spec.linear_conv_kernel)),
        (p + "A_log", (heads,)),
        (p + "dt_bias", (heads,)),
        (p + "norm.weight", (spec.linear_value_dim,)),
        (p + "out_proj.weight", (d, values)),
    ]


def _layer(spec: TinySpec, p: str, kind: str) -> Shapes:
    d, ff = spec.hidden_size, spec.intermediate_size
    mixer = _attention if kind == "full_attention" else _linear_attention
    return [
        (p + "input_layernorm.weight", (d,)),
        *mixer(spec, p),
        (p + "post_attention_layernorm.weight", (d,)),
        (p + "mlp.gate_proj.weight", (ff, d)),
        (p + "mlp.up_proj.weight", (ff, d)),
        (p + "mlp.down_proj.weight", (d, ff)),
    ]


def hybrid_param_shapes(spec: TinySpec, vocab: int, tied: bool = True) -> Shapes:
    """Every tensor of the checkpoint, in the order written: the main model as
    transformers names it (an lm_head unless tied to the embedding), then the MTP
    layers."""
    d = spec.hidden_size
    shapes: Shapes = [("model.embed_tokens.weight", (vocab, d))]
    for i, kind in enumerate(layer_types(spec)):
        shapes += _layer(spec, f"model.layers.{i}.", kind)
    shapes.append(("model.norm.weight", (d,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, d)))
    if spec.mtp_layers:
        # The MTP head: norms of the embedding and of the main model's last
        # hidden state, fc joining the two, full-attention layers, a final norm.
        shapes += [
            ("mtp.pre_fc_norm_embedding.weight", (d,)),
            ("mtp.pre_fc_norm_hidden.weight", (d,)),
            ("mtp.fc.weight", (d, 2 * d)),
        ]
        for i in range(spec.mtp_layers):
            shapes += _layer(spec, f"mtp.layers.{i}.", "full_attention")
        shapes.append(("mtp.norm.weight", (d,)))
    return shapes


def hybrid_maker(spec: TinySpec, name: str, shape: tuple[int, ...]) -> Callable[[], Any]:
    """How the random hybrid draws one tensor (see hybrid_entries)."""
    import torch

    seed, device = spec.seed, spec.device
    if name.endswith("A_log"):
        return lambda: seeded_uniform(seed, name, shape, *A_RANGE, device).log()

    if name.endswith("dt_bias"):
        def dt_bias() -> Any:
            low, high = (math.log(x) for x in DT_RANGE)
            dt = seeded_uniform(seed, name, shape, low, high, device).exp()
            return dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
        return dt_bias

    if name.endswith("conv1d.weight"):
        bound = 1 / math.sqrt(spec.linear_conv_kernel)  # torch's own Conv1d init
        return lambda: seeded_uniform(seed, name, shape, -bound, bound, device)
    if name.endswith("linear_attn.norm.weight"):
        # The GDN output norm scales by w itself.
        return lambda: torch.ones(shape)
    if len(shape) == 1:
        # Qwen3.5's other norms scale by (1 + w): zero is the identity.
        return lambda: torch.zeros(shape)
    return lambda: seeded_normal(seed, name, shape, spec.initializer_range, device)


def hybrid_entries(spec: TinySpec, vocab: int) -> list[Entry]:
    """The seeded weights: normal(0, initializer_range) matrices from a generator
    per tensor on ``spec.device``, identity norms, Mamba2-style A_log and dt_bias,
    torch's default convolution init. The CPU's bytes are the same on every machine;
    cuda's are not the CPU's (see seeded_generator)."""
    return [(n, s, hybrid_maker(spec, n, s)) for n, s in hybrid_param_shapes(spec, vocab)]

"""The copying variant of a Qwen3.5 hybrid (``--hybrid --copy``, e.g. ``--size hybrid27
--copy``): every gated full-attention layer copies as the dense copying model's one
layer does (copymodel.py), so a greedy answer is known in advance and an exact-match
check over a speculative method, a cache dtype or a prefix hit means something.

What runs and what the answer depends on:
- The full-attention layers read q and k from the constant, v from the token code,
  and open their output gate (sigmoid of a large constant read). Both copy the token
  P - 1 back into the same dims, so the answer needs each attention layer's cache.
- The Gated DeltaNet layers keep the random hybrid's weights (their kernels, state
  and convolution run as in the random model), but their output projection writes
  only dims the copy does not use. A NaN or inf in their state reaches every logit
  through the next norm; a wrong but finite state changes no answer.
- The MLPs write nothing; the MTP layers are the random hybrid's (drafts are rarely
  right, which a lossless check does not mind).
The DeltaNet writes widen the residual that the final norm divides by, so the right
token's logit is smaller than the dense copy's (about 10 at the 27B's shapes, still
about 9 nats ahead of the next), the same at every position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.testing.tinymodel.copymodel import (
    copy_embed,
    copy_layout,
    copy_lm_head,
    copy_o_proj,
    copy_v_proj,
    read_constant,
)
from kiln.testing.tinymodel.hybrid import hybrid_maker, hybrid_param_shapes
from kiln.testing.tinymodel.spec import TinySpec
from kiln.testing.tinymodel.tensors import Entry

# What the output gate's rows read from the constant; after the input norm the
# constant is about 0.5 to 2, so sigmoid(gate) is above 0.98 at every position.
GATE_WEIGHT = 8.0


def gated_q_proj(spec: TinySpec, parts: dict[str, Any]) -> Any:
    """Qwen3.5's q_proj holds each head's query and then its gate (2 x head_dim rows
    per head): queries read the constant as the dense copy's do, gates read it x
    GATE_WEIGHT."""
    D = spec.head_dim
    w = read_constant(spec, parts, 2 * spec.num_heads * D)
    for h in range(spec.num_heads):
        w[h * 2 * D + D : (h + 1) * 2 * D] *= GATE_WEIGHT
    return w


def _linear_out(spec: TinySpec, name: str, shape: tuple[int, ...], parts: dict[str, Any]
                ) -> Callable[[], Any]:
    """A DeltaNet layer's random out_proj with the rows of the copy's dims zeroed."""
    draw = hybrid_maker(spec, name, shape)
    used = copy_layout(parts)[1] + parts["codes"].shape[1]

    def make() -> Any:
        w = draw().cpu()
        w[:used] = 0.0
        return w

    return make


def hybrid_copy_entries(
    spec: TinySpec, vocab: int, parts: dict[str, Any], lm_scale: float
) -> list[Entry]:
    """The hybrid copying model's weights, in hybrid_param_shapes' order with an
    lm_head of its own."""
    import torch

    def zeros(shape: tuple[int, ...]) -> Callable[[], Any]:
        # Qwen3.5's norms scale by (1 + w): zero is the identity.
        return lambda: torch.zeros(shape)

    attention: dict[str, Callable[[], Any]] = {
        "q_proj": lambda: gated_q_proj(spec, parts),
        "k_proj": lambda: read_constant(spec, parts, spec.num_kv_heads * spec.head_dim),
        "v_proj": lambda: copy_v_proj(spec, parts),
        "o_proj": lambda: copy_o_proj(spec, parts),
        "q_norm": lambda: parts["q_norm"],
        "k_norm": lambda: parts["k_norm"],
    }
    whole: dict[str, Callable[[], Any]] = {
        "model.embed_tokens.weight": lambda: copy_embed(spec, vocab, parts),
        "lm_head.weight": lambda: copy_lm_head(spec, vocab, parts, lm_scale),
    }
    entries: list[Entry] = []
    for name, shape in hybrid_param_shapes(spec, vocab, tied=False):
        part = name.rsplit(".", 2)[-2]
        if name in whole:
            make = whole[name]
        elif name.startswith("mtp."):
            make = hybrid_maker(spec, name, shape)
        elif ".self_attn." in name:
            make = attention[part]
        elif ".linear_attn." in name:
            make = (_linear_out(spec, name, shape, parts) if part == "out_proj"
                    else hybrid_maker(spec, name, shape))
        else:  # the layer norms, the final norm and the MLPs
            make = zeros(shape)
        entries.append((name, shape, make))
    return entries

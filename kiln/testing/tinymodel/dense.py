"""Dense Qwen3 checkpoints with random weights: the transformers config of a spec (a
hybrid's from hybrid.py), the weights from transformers' own init, and the seeded
ones (normal(0, range) per tensor, streamed), with the tensor names and shapes both
share; the parameter count of any spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.testing.tinymodel.hybrid import hybrid_config, hybrid_param_shapes
from kiln.testing.tinymodel.spec import TinySpec
from kiln.testing.tinymodel.tensors import Entry, seeded_normal, torch_dtype
from kiln.testing.tinymodel.tokenizer import END_OF_TEXT, IM_END


def qwen3_fields(spec: Any, tokenizer: Any) -> dict[str, Any]:
    """The transformers config fields a model spec decides, for a TinySpec and for the
    trained reference models' spec alike: the shapes, tied embeddings, the tokenizer's
    size and ids."""
    return dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(END_OF_TEXT),
    )


def model_config(spec: TinySpec, tokenizer: Any, **extra: Any) -> Any:
    common = {**qwen3_fields(spec, tokenizer), "initializer_range": spec.initializer_range,
              **extra}
    if spec.hybrid:
        return hybrid_config(spec, common)
    from transformers import Qwen3Config

    return Qwen3Config(**common)


def write_model(spec: TinySpec, tokenizer: Any, out: Path) -> None:
    """Weights from transformers' own init (the original tiny model's path)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.dtype != "float32":
        # Drawn in float32 and rounded, so the dtype changes only the rounding.
        model = model.to(torch_dtype(spec.dtype))
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


def _layer_shapes(spec: TinySpec, i: int) -> list[tuple[str, tuple[int, ...]]]:
    d, D = spec.hidden_size, spec.head_dim
    p = f"model.layers.{i}."
    return [
        (p + "input_layernorm.weight", (d,)),
        (p + "self_attn.q_proj.weight", (spec.num_heads * D, d)),
        (p + "self_attn.k_proj.weight", (spec.num_kv_heads * D, d)),
        (p + "self_attn.v_proj.weight", (spec.num_kv_heads * D, d)),
        (p + "self_attn.o_proj.weight", (d, spec.num_heads * D)),
        (p + "self_attn.q_norm.weight", (D,)),
        (p + "self_attn.k_norm.weight", (D,)),
        (p + "post_attention_layernorm.weight", (d,)),
        (p + "mlp.gate_proj.weight", (spec.intermediate_size, d)),
        (p + "mlp.up_proj.weight", (spec.intermediate_size, d)),
        (p + "mlp.down_proj.weight", (d, spec.intermediate_size)),
    ]


def param_shapes(spec: TinySpec, vocab: int, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a dense Qwen3 checkpoint, as transformers names them."""
    shapes = [("model.embed_tokens.weight", (vocab, spec.hidden_size))]
    for i in range(spec.num_layers):
        shapes += _layer_shapes(spec, i)
    shapes.append(("model.norm.weight", (spec.hidden_size,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, spec.hidden_size)))
    return shapes


def param_count(spec: TinySpec, vocab: int | None = None) -> int:
    """Parameters of the model a spec describes, dense or hybrid (its MTP layers
    included; lm_head counted once if tied)."""
    vocab = vocab or spec.vocab_size
    if spec.hybrid:
        shapes = hybrid_param_shapes(spec, vocab, tied=spec.copy_period is None)
    else:
        shapes = param_shapes(spec, vocab, tied=spec.copy_period is None)
    return sum(math.prod(shape) for _, shape in shapes)


def seeded_entries(spec: TinySpec, vocab: int) -> list[Entry]:
    """normal(0, initializer_range) matrices, each from its own seeded generator
    on ``spec.device``; norm weights one. The same distribution transformers'
    init draws from."""
    import torch

    def make(name: str, shape: tuple[int, ...]) -> Callable[[], Any]:
        if len(shape) == 1:
            return lambda: torch.ones(shape)
        return lambda: seeded_normal(spec.seed, name, shape, spec.initializer_range,
                                     spec.device)

    return [(n, s, make(n, s)) for n, s in param_shapes(spec, vocab, tied=True)]

"""Make a tiny random-weight Qwen3-architecture model and tokenizer, no hub.

The folder serves with `vllm serve DIR`. Run with a Python that has torch,
transformers and tokenizers (any vLLM environment does). The same spec and
corpus give the same bytes; a folder already built from them is reused.

Sizes (--size, then any size flag on top of it; vocabulary 512 throughout):
  tiny   hidden 64, 2 layers, 2 heads / 1 KV head, head dim 32, fp32: the CPU
         tier's model, from transformers' own init (the default)
  d64    hidden 128, 2 layers, 2 heads / 1 KV head, head dim 64
  d128   hidden 256, 2 layers, 4 heads / 2 KV heads, head dim 128
  large  hidden 2048, 8 layers, 16 heads / 8 KV heads, head dim 128,
         intermediate 6144, 131584 positions, bf16, init range 0.02: ~404M
         parameters, ~0.8 GB, built in seconds in well under its size of RAM
  hybrid27  Qwen3.5 27B's layer shapes (a --hybrid): 8 of its 64 layers, three
         Gated DeltaNet then one gated full attention, twice, plus one MTP
         layer; hidden 5120, intermediate 17408, 24 heads / 4 KV heads of 256
         (q_proj carries the output gate), GDN 16 key / 48 value heads of 128,
         conv kernel 4, 131584 positions, bf16, init range 0.02: 3.47B
         parameters, ~6.9 GB; --device cuda draws them in seconds. vLLM serves
         it with --speculative-config '{"method": "mtp", ...}'
d64, d128, large and hybrid27 draw weights with --init seeded.

--hybrid makes a Qwen3.5 layout (transformers' Qwen3_5TextConfig): Gated
DeltaNet layers, a gated full-attention layer every --full-attention-interval
(default: the last layer alone), and --mtp-layers MTP layers (needs --init
seeded). Its GDN sizes: --linear-key-heads, --linear-value-heads (a multiple
of the key heads), --linear-key-dim, --linear-value-dim, --linear-conv-kernel.

--copy makes a copying model instead of random weights: the greedy next token
at position p is the token at p + 1 - P (P = --copy-period), fetched through
attention from the KV-cache row P - 1 back, so a period of P tokens repeated
(kiln.testing.tinymodel.copy_prompt) continues exactly (copy_continuation). q
and k are constant per head; RoPE phases and the q/k norm weights make the key
P - 1 back win by >= 20 nats over every other key within --max-positions (the
build refuses a shape where it would not); values carry a +/-1 code per token
that the untied lm_head reads. It stays exact with key noise ~0.1 and value
noise ~0.5 (relative), as a 4-bit/2-bit KV cache adds. With --hybrid (e.g.
--size hybrid27 --copy) every gated attention layer copies (RoPE on a quarter
of each head, the output gate open) while the Gated DeltaNet layers keep
random weights but write outside the copy's dimensions; the MTP layers stay
random. Drawn on the CPU (the 27B shapes: about a minute).

--dflash2-drafter --target DIR writes a random DFlash2 drafter for the model in
DIR instead (vLLM's DFlash2DraftModel, speculative method "dflash"): a
config.json with a dflash_config (block_size, conv_group_size,
conv_kernel_size, mask_token_id, target_layer_ids, selector_rank,
selector_top_k) and its weights, without an embedding or lm_head (vLLM takes
both from the target). Hidden size, heads and vocabulary are the target's;
--layers sets the drafter's layers (default 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "tiny-model"
HELP = "write a deterministic tiny Qwen3-architecture model + tokenizer to a folder"

# Size flags: (flag, TinySpec field, help).
_SIZE_FLAGS = (
    ("--layers", "num_layers", "decoder layers"),
    ("--hidden", "hidden_size", "hidden size"),
    ("--heads", "num_heads", "query heads"),
    ("--kv-heads", "num_kv_heads", "KV heads; must divide --heads (GQA)"),
    ("--head-dim", "head_dim", "channels per head; even"),
    ("--intermediate", "intermediate_size", "MLP intermediate size"),
    ("--max-positions", "max_position_embeddings", "max_position_embeddings"),
    ("--linear-key-heads", "linear_key_heads", "with --hybrid: GDN key heads"),
    ("--linear-value-heads", "linear_value_heads",
     "with --hybrid: GDN value heads; a multiple of --linear-key-heads"),
    ("--linear-key-dim", "linear_key_dim", "with --hybrid: channels per GDN key head"),
    ("--linear-value-dim", "linear_value_dim", "with --hybrid: channels per GDN value head"),
    ("--linear-conv-kernel", "linear_conv_kernel", "with --hybrid: GDN convolution taps"),
    ("--full-attention-interval", "full_attention_interval",
     "with --hybrid: every Nth layer is full attention, 1 to --layers"),
    ("--mtp-layers", "mtp_layers", "with --hybrid and --init seeded: MTP layers"),
)


# Drafter flags: (flag, DrafterSpec field, help).
_DRAFTER_FLAGS = (
    ("--block-size", "block_size", ("query tokens per request it drafts from (anchor + "
     "masks; default 16)")),
    ("--conv-group-size", "conv_group_size", ("channels per convolution group; must "
     "divide the hidden size (default 16)")),
    ("--conv-kernel-size", "conv_kernel_size", "convolution taps (default 3)"),
    ("--selector-rank", "selector_rank", "candidate selector rank (default 8)"),
    ("--selector-top-k", "selector_top_k", "candidates per position (default 4)"),
    ("--mask-token-id", "mask_token_id", ("token id of the mask slots (default: the "
     "target's pad token)")),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kiln.testing import tinymodel

    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder to write (default: under kiln's cache, named by fingerprint)",
    )
    parser.add_argument(
        "--size",
        choices=list(tinymodel.PRESETS),
        default="tiny",
        help="named size the flags below start from (default tiny; see above)",
    )
    for flag, field, text in _SIZE_FLAGS:
        parser.add_argument(
            flag, type=int, default=None, metavar="N", dest=field,
            help=f"{text} (default: the size's)",
        )
    parser.add_argument(
        "--dtype",
        choices=tinymodel.DTYPES,
        default=None,
        help="dtype of the saved weights and the config (default: the size's)",
    )
    parser.add_argument(
        "--init",
        choices=tinymodel.INITS,
        default=None,
        help="random weights from transformers' per-module init, or normal(0, range) "
        "from a generator seeded per tensor, streamed to disk: fast and lean for "
        "large sizes (default: the size's)",
    )
    parser.add_argument(
        "--device",
        choices=tinymodel.DEVICES,
        default=None,
        help="where --init seeded draws: cpu, the same bytes on every machine, or "
        "cuda, seconds for billions of values but other bytes than the CPU's "
        "(default: the size's, cpu)",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="Qwen3.5-style layout with linear-attention (Gated DeltaNet) layers "
        "(see above); transformers runs it, vLLM's CPU fallback cannot serve it yet",
    )
    parser.add_argument(
        "--copy",
        action="store_true",
        help="a copying model (see above) instead of random weights",
    )
    parser.add_argument(
        "--dflash2-drafter",
        action="store_true",
        help="a random DFlash2 drafter for the model given with --target (see above)",
    )
    parser.add_argument("--target", type=Path, default=None, metavar="DIR",
                        help="with --dflash2-drafter: the target model's folder")
    for flag, field, text in _DRAFTER_FLAGS:
        parser.add_argument(flag, type=int, default=None, metavar="N", dest=field,
                            help=f"with --dflash2-drafter: {text}")
    parser.add_argument(
        "--target-layer-ids", default=None, metavar="I,J,..",
        help="with --dflash2-drafter: target layers feeding the drafter (default: all)")
    parser.add_argument(
        "--copy-period",
        type=int,
        default=None,
        metavar="P",
        help=f"with --copy: the period P, at most --max-positions "
        f"(default {tinymodel.DEFAULT_COPY_PERIOD})",
    )


def spec_from_args(args: argparse.Namespace):  # -> tinymodel.TinySpec
    from kiln.errors import KilnError
    from kiln.testing import tinymodel

    overrides = {}
    for _, field, _ in _SIZE_FLAGS:
        if getattr(args, field) is not None:
            overrides[field] = getattr(args, field)
    for field in ("dtype", "init", "device"):
        if getattr(args, field) is not None:
            overrides[field] = getattr(args, field)
    if args.hybrid:
        overrides["hybrid"] = True
    if args.copy_period is not None and not args.copy:
        raise KilnError(f"--copy-period {args.copy_period}: only applies with --copy")
    if args.copy:
        overrides["copy_period"] = (
            tinymodel.DEFAULT_COPY_PERIOD if args.copy_period is None else args.copy_period
        )
    spec = tinymodel.preset(args.size, **overrides)
    tinymodel.validate(spec)
    return spec


def drafter_spec_from_args(args: argparse.Namespace):  # -> tinymodel.DrafterSpec
    from kiln.errors import KilnError
    from kiln.testing import tinymodel

    if args.target is None:
        raise KilnError("--dflash2-drafter needs --target DIR (the target model's folder)")
    others = [flag for flag, field, _ in _SIZE_FLAGS
              if field != "num_layers" and getattr(args, field) is not None]
    others += [f"--{f}" for f in ("dtype", "init", "device", "size") if getattr(args, f) not in
               (None, "tiny")]
    others += [flag for flag, on in (("--hybrid", args.hybrid), ("--copy", args.copy)) if on]
    if others:
        raise KilnError(f"--dflash2-drafter takes its sizes from --target; drop "
                        f"{', '.join(others)} (allowed: --layers and the drafter flags)")
    overrides = {field: getattr(args, field) for _, field, _ in _DRAFTER_FLAGS
                 if getattr(args, field) is not None}
    if args.num_layers is not None:
        overrides["num_layers"] = args.num_layers
    if args.target_layer_ids is not None:
        try:
            overrides["target_layer_ids"] = tuple(
                int(x) for x in args.target_layer_ids.split(","))
        except ValueError:
            raise KilnError(f"--target-layer-ids {args.target_layer_ids}: give "
                            "comma-separated layer indices, e.g. 0,1") from None
    return tinymodel.DrafterSpec(**overrides)


def run(args: argparse.Namespace) -> int:
    from kiln.errors import KilnError
    from kiln.testing import tinymodel

    if args.dflash2_drafter:
        out = tinymodel.build_dflash2_drafter(args.target, out=args.out,
                                              spec=drafter_spec_from_args(args))
        print(out)
        return 0
    stray = [flag for flag, field, _ in _DRAFTER_FLAGS if getattr(args, field) is not None]
    stray += [f for f, v in (("--target", args.target),
                             ("--target-layer-ids", args.target_layer_ids)) if v is not None]
    if stray:
        raise KilnError(f"{', '.join(stray)}: only apply with --dflash2-drafter")
    out = tinymodel.build(out=args.out, spec=spec_from_args(args))
    print(out)
    return 0

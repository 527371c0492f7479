"""Make a tiny random-weight Qwen3-architecture model and tokenizer, no hub.

The folder serves with `vllm serve DIR`. Run with a Python that has torch,
transformers and tokenizers (any vLLM environment does). The same spec and
corpus give the same bytes; a folder already built from them is reused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "tiny-model"
HELP = "write a deterministic tiny Qwen3-architecture model + tokenizer to a folder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder to write (default: under kiln's cache, named by fingerprint)",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="Qwen3.5-style layout with linear-attention (Gated DeltaNet) layers; "
        "transformers runs it, vLLM's CPU fallback cannot serve it yet",
    )


def run(args: argparse.Namespace) -> int:
    from kiln import tinymodel

    out = tinymodel.build(out=args.out, hybrid=args.hybrid)
    print(out)
    return 0

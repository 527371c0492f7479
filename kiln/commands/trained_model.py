"""Train a small Qwen3-architecture reference model on this Python's standard library.

The model is for measuring quality (perplexity, agreement) where a random-weight
model cannot tell anything: bench/kv_quality.py compares KV-cache dtypes on it. Run
with a Python that has torch, transformers and tokenizers (a vLLM environment). It
prints the folder it wrote: config, bf16 safetensors, generation config, its own
byte-level BPE tokenizer, and a stamp recording the held-out files for evaluation.

The corpus is every .py file of the running Python's standard library in sorted
path order; one file in 16 (by a hash of its path) is held out for evaluation, the
rest are read until --corpus-bytes. The folder is named by the hash of the size,
the corpus files, the library versions and the generator, under --out (default:
kiln's cache), and reused when it exists.

Sizes (vocabulary 8192, sequences of 2048 tokens, so positions past 1024 are trained;
16 sequences a step, 1200 steps = 39M tokens, AdamW with cosine decay):
  d128  hidden 512, 8 layers, 4 heads / 2 KV heads of 128, intermediate 1536: 29M
        parameters, ~0.28 GFLOP a token: about 2-4 minutes on one H100 (estimated
        from FLOPs at 50-100 TFLOP/s, not yet timed)
  d256  the same with heads of 256: 36M parameters, ~0.41 GFLOP a token, about 3-5
        minutes
  tiny  hidden 64, 2 layers, head dim 32, vocabulary 512, 8 steps of 4 x 128 tokens
        on the CPU in seconds: the tests' size

On the CPU a run is deterministic: the same inputs give the same bytes. On CUDA it
trains under bf16 autocast with the same seed and data, but GPU kernels may sum in
another order, so two runs can differ slightly.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "trained-model"
HELP = "train a small Qwen3 reference model on the standard library's sources (quality tests)"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kiln.testing.trained.spec import DEVICES, PRESETS

    parser.add_argument("--size", choices=list(PRESETS), default="d128",
                        help="the named size (default d128; see above)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="folder to write the model's folder into (default: "
                        "kiln's cache, trained-model/)")
    parser.add_argument("--steps", type=_positive, default=None, metavar="N",
                        help="optimizer steps (default: the size's)")
    parser.add_argument("--corpus-bytes", type=_positive, default=None, metavar="N",
                        help="cap on the training split's bytes (default: the size's)")
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help="where it trains (default: cuda, the tiny size cpu)")


def run(args: argparse.Namespace) -> int:
    from kiln.testing.trained import build, preset

    overrides = {field: getattr(args, field) for field in ("steps", "corpus_bytes", "device")
                 if getattr(args, field) is not None}
    print(build(args.size, preset(args.size, **overrides), parent=args.out))
    return 0

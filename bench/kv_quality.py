"""KV-cache dtypes against bf16 on a trained model: perplexity, top-1 agreement, needle.

    python bench/kv_quality.py MODEL_DIR [--dtypes auto,fp8,...] [--windows 24]
        [--window 2048] [--needles 8] [--json PATH]

MODEL_DIR is a folder `python3 -m kiln trained-model` wrote (its stamp names the
held-out standard-library files; they must be this Python's, unchanged). For each
cache dtype one vLLM engine (bf16 weights, chunked prefill in chunks of 512 tokens so
every later chunk reads the cache in that dtype, prefix caching off so nothing is
reused, eager) computes:
  - prompt logprobs (the token's and the top-1) over --windows back-to-back windows
    of --window held-out tokens: perplexity, its ratio to bf16's ("auto"), the same
    from position --late-from on, and top-1 agreement with bf16 at every position;
  - greedy answers to --needles needle probes at the model's trained context: a
    `key_xxxxxx = "NNNNNNNN"` line after the first line of held-out source, filler,
    then `assert key_xxxxxx == "`; a hit copies the value.
Non-KVarN dtypes run on TRITON_ATTN (the GPU bundle carries no FlashAttention), the
CPU platform on its own backend; KVarN picks its own. Each engine is freed before the
next. The table goes to stdout, everything to --json.

What a small model can tell: which formats add error to learned attention, ranked,
at about a tenth of a percent of perplexity and up; the late-position columns show
error growing with context inside the trained length. What it cannot tell: how a
large model, longer contexts, or task accuracy fare; small differences between
formats that are near bf16 are within what another training run would move.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kiln.errors import KilnError  # noqa: E402
from kiln.testing.trained import check_held_out, held_out_files, read_stamp, trained_spec  # noqa: E402
from kiln.testing.trained.data import token_stream  # noqa: E402
from kiln.testing.trained.metrics import WindowScores, window_scores, windows  # noqa: E402
from kiln.testing.trained.needle import NeedleProbe, build_probes, hit  # noqa: E402
from kiln.testing.trained.report import as_json, quality, table  # noqa: E402
from kiln.testing.trained.tokenizer import separator_id  # noqa: E402

DEFAULT_DTYPES = ("auto", "fp8", "int8_per_token_head", "int4_per_token_head",
                  "kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
CHUNK = 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("model", type=Path, help="a folder `kiln trained-model` wrote")
    p.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES),
                   help="comma-separated KV-cache dtypes; auto (bf16) is always run first")
    p.add_argument("--windows", type=int, default=24, help="held-out windows (default 24)")
    p.add_argument("--window", type=int, default=2048, help="tokens a window (default 2048)")
    p.add_argument("--late-from", type=int, default=1024,
                   help="the late columns score positions from here on (default 1024)")
    p.add_argument("--needles", type=int, default=8, help="needle probes (default 8; 0: none)")
    p.add_argument("--model-dtype", default="bfloat16",
                   help="the engine's weights and activations (default bfloat16)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write results here")
    return p.parse_args(argv)


def dtype_list(text: str) -> list[str]:
    """The requested dtypes, bf16 ("auto") first and once, each one vLLM knows."""
    names = [d.strip() for d in text.split(",") if d.strip()]
    from vllm.config.cache import KV_CACHE_DTYPES
    from vllm.plugins import load_general_plugins

    # The fork's plugin registers the KVarN presets (upstream's register_kv_cache_dtype);
    # upstream's CacheDType literal never lists them.
    load_general_plugins()
    unknown = [d for d in names if d not in KV_CACHE_DTYPES]
    if unknown:
        raise KilnError(f"--dtypes {','.join(unknown)}: not a KV-cache dtype of this vLLM; "
                        f"allowed: {', '.join(KV_CACHE_DTYPES)}")
    return ["auto"] + [d for d in dict.fromkeys(names) if d != "auto"]


def _engine(model: Path, dtype: str, model_dtype: str, max_model_len: int) -> Any:
    from vllm.platforms import current_platform

    from vllm import LLM

    kvarn = dtype.startswith("kvarn")
    backend = None if kvarn or current_platform.is_cpu() else "TRITON_ATTN"
    return LLM(model=str(model), dtype=model_dtype, kv_cache_dtype=dtype, seed=0,
               max_model_len=max_model_len, enable_chunked_prefill=True,
               max_num_batched_tokens=CHUNK, enable_prefix_caching=False,
               enforce_eager=True, attention_backend=backend)


def _collect() -> None:
    """Return a deleted engine's memory before the next one starts."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_dtype(model: Path, dtype: str, model_dtype: str, wins: list[list[int]],
              probes: list[NeedleProbe], max_model_len: int) -> tuple[list[WindowScores], int]:
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    llm = _engine(model, dtype, model_dtype, max_model_len)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in wins],
                            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)
        scores = [window_scores(w, o.prompt_logprobs) for w, o in zip(wins, outs)]
        hits = 0
        if probes:
            answers = llm.generate(
                [TokensPrompt(prompt_token_ids=list(p.prompt)) for p in probes],
                [SamplingParams(temperature=0.0, max_tokens=p.answer_tokens) for p in probes],
                use_tqdm=False)
            hits = sum(hit(a.outputs[0].text, p) for a, p in zip(answers, probes))
    finally:
        del llm  # the only reference: the engine goes with it
        _collect()
    return scores, hits


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _main(args)
    except KilnError as e:
        print(f"kv_quality: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    import vllm

    if read_stamp(args.model) is None:
        raise KilnError(f"{args.model}: not a folder `kiln trained-model` wrote")
    if not 1 <= args.late_from < args.window:
        raise KilnError(f"--late-from {args.late_from}: must be within 1..{args.window - 1}")
    dtypes = dtype_list(args.dtypes)
    spec = trained_spec(args.model)
    root, files = held_out_files(args.model)
    check_held_out(root, files)
    texts = [(root / f.path).read_bytes().decode("utf-8", errors="replace") for f in files]
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    wins = windows(token_stream(tokenizer, texts, separator_id(tokenizer)),
                   args.window, args.windows)
    context = spec.seq_len  # the longest context the model was trained on
    probes = build_probes(lambda s: tokenizer.encode(s).ids, texts, context, args.needles)
    max_model_len = max(args.window + 1, context)

    results: dict[str, tuple[list[WindowScores], int]] = {}
    seconds: dict[str, float] = {}
    for dtype in dtypes:
        began = time.perf_counter()
        results[dtype] = run_dtype(args.model, dtype, args.model_dtype, wins, probes,
                                   max_model_len)
        seconds[dtype] = round(time.perf_counter() - began, 1)
        print(f"{dtype}: done in {seconds[dtype]}s", file=sys.stderr, flush=True)
    reference = results["auto"][0]
    rows = [quality(d, s, reference, args.late_from, h, len(probes))
            for d, (s, h) in results.items()]
    print(table(rows, args.late_from))
    if args.json:
        stamp = read_stamp(args.model) or {}
        setup = {"model": str(args.model), "preset": stamp.get("preset"),
                 "fingerprint": stamp.get("fingerprint"), "windows": args.windows,
                 "window": args.window, "late_from": args.late_from,
                 "needle_context": context, "needles": len(probes),
                 "model_dtype": args.model_dtype, "chunk": CHUNK,
                 "vllm": vllm.__version__, "device": _device(), "seconds": seconds}
        args.json.write_text(json.dumps(as_json(rows, setup), indent=2) + "\n")
    return 0


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())

"""Residue sweep: prefix-cache hits must not change greedy answers.

For every prompt length residue r modulo the KV block size, send one prompt of
`base_blocks * block + r` tokens twice; the second is a full prefix-cache hit.
Greedy answers that differ are "broken": a cache hit changed the output (the
class of bug that shows at particular block boundaries). Prompts are token id
lists so their lengths are exact without a tokenizer; every prompt starts
differently so the first send of each is cold.

    python bench/probes/residue_sweep.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import time

from probe_common import (
    ProbeError,
    add_endpoint_args,
    block_size_from_metrics,
    emit,
    endpoint_from,
    run_probe,
)


def prompt_tokens(residue: int, length: int, low: int, high: int) -> list[int]:
    """A deterministic token sequence, different for every residue."""
    state = 0x9E3779B9 ^ (residue * 0x85EBCA6B)
    span = high - low
    tokens = []
    for _ in range(length):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        tokens.append(low + state % span)
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_endpoint_args(parser)
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size (default: read from the server's /metrics)",
    )
    parser.add_argument("--base-blocks", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--token-range",
        default="10:250",
        help="LOW:HIGH token ids the prompts draw from (within any vocabulary)",
    )
    args = parser.parse_args()
    endpoint = endpoint_from(args)
    block = args.block_size or block_size_from_metrics(endpoint)
    if not block:
        raise ProbeError("the server publishes no block size; pass --block-size")
    low, high = (int(x) for x in args.token_range.split(":"))

    started = time.monotonic()
    broken: list[dict[str, object]] = []
    cached_hits = 0
    for residue in range(block):
        length = args.base_blocks * block + residue
        tokens = prompt_tokens(residue, length, low, high)
        first = endpoint.complete(tokens, args.max_tokens)
        second = endpoint.complete(tokens, args.max_tokens)
        details = second["usage"].get("prompt_tokens_details") or {}
        cached_hits += int((details.get("cached_tokens") or 0) > 0)
        if first["text"] != second["text"]:
            broken.append(
                {"residue": residue, "first": first["text"], "second": second["text"]}
            )
    emit(
        {
            "probe": "residue_sweep",
            "model": endpoint.served_model(),
            "block_size": block,
            "prompts": block,
            "broken": len(broken),
            "broken_cases": broken,
            # Only servers that report prompt_tokens_details show hits here.
            "reported_cache_hits": cached_hits,
            "elapsed_s": round(time.monotonic() - started, 2),
        }
    )
    return 1 if broken else 0


if __name__ == "__main__":
    run_probe(main)

"""Output tokens per second: `--concurrency` streams of `--max-tokens` each.

A figure, not a check: it says how fast this server decoded on this machine
(`ignore_eos` keeps every request to exactly `--max-tokens`, a vLLM extension).

    python bench/probes/decode_speed.py --concurrency 1 --max-tokens 256
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from probe_common import add_endpoint_args, emit, endpoint_from, run_probe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_endpoint_args(parser)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt", default="The kiln on the hill")
    args = parser.parse_args()
    endpoint = endpoint_from(args)
    model = endpoint.served_model()

    def one(_: int) -> int:
        out = endpoint.post(
            "/v1/completions",
            {
                "model": model,
                "prompt": args.prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        return int(out["usage"]["completion_tokens"])

    one(0)  # warm-up: first-request set-up is not decode speed
    started = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(one, range(args.concurrency)))
    elapsed = time.monotonic() - started
    emit(
        {
            "probe": "decode_speed",
            "model": model,
            "concurrency": args.concurrency,
            "output_tokens": tokens,
            "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(tokens / elapsed, 2),
        }
    )
    return 0


if __name__ == "__main__":
    run_probe(main)

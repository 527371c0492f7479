"""Tokens per step from the server's speculative-decoding metrics.

tokens/step = 1 + accepted draft tokens / verification steps (drafts), from
vLLM's vllm:spec_decode_* counters. With `--requests N` the probe first sends
N greedy requests and reports the change over them; otherwise it reports the
server's totals so far. A server without speculative decoding reports
"present": false, not a number.

    python bench/probes/tokens_per_step.py --requests 4
"""

from __future__ import annotations

import argparse

from probe_common import (
    Endpoint,
    add_endpoint_args,
    emit,
    endpoint_from,
    metric_samples,
    run_probe,
)

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"


def read_counters(endpoint: Endpoint) -> dict[str, float] | None:
    text = endpoint.metrics()
    counters = {}
    for name in (DRAFTS, ACCEPTED, DRAFT_TOKENS):
        samples = metric_samples(text, name)
        if not samples:
            return None
        counters[name] = sum(value for _, value in samples)
    return counters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_endpoint_args(parser)
    parser.add_argument("--requests", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--prompt", default="Count from one to one hundred, one number per line."
    )
    args = parser.parse_args()
    endpoint = endpoint_from(args)

    before = read_counters(endpoint)
    for _ in range(args.requests):
        endpoint.complete(args.prompt, args.max_tokens)
    after = read_counters(endpoint) if args.requests else before
    if before is None or after is None:
        emit({"probe": "tokens_per_step", "present": False})
        return 0
    base = before if args.requests else dict.fromkeys(after, 0.0)
    delta = {name: after[name] - base[name] for name in after}
    drafts = delta[DRAFTS]
    emit(
        {
            "probe": "tokens_per_step",
            "present": True,
            "window": f"{args.requests} requests" if args.requests else "server total",
            "drafts": drafts,
            "draft_tokens": delta[DRAFT_TOKENS],
            "accepted_tokens": delta[ACCEPTED],
            "tokens_per_step": round(1 + delta[ACCEPTED] / drafts, 4) if drafts else None,
            "acceptance_rate": round(delta[ACCEPTED] / delta[DRAFT_TOKENS], 4)
            if delta[DRAFT_TOKENS]
            else None,
        }
    )
    return 0


if __name__ == "__main__":
    run_probe(main)

"""KV pool size, read from the server.

vLLM publishes its cache configuration as the labels of vllm:cache_config_info
(num_gpu_blocks, block_size, cache_dtype); the pool in tokens is blocks times
block size. `--log FILE` falls back to the start-up line "... KV cache size:
N tokens" of a server log, for servers whose /metrics is off.

    python bench/probes/kv_pool.py
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from probe_common import (
    ProbeError,
    add_endpoint_args,
    emit,
    endpoint_from,
    metric_samples,
    run_probe,
)

LOG_LINE = re.compile(r"(GPU|CPU|XPU) KV cache size: ([\d,]+) tokens")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_endpoint_args(parser)
    parser.add_argument("--log", type=Path, default=None, help="server log to read")
    args = parser.parse_args()

    if args.log is not None:
        matches = LOG_LINE.findall(args.log.read_text(errors="replace"))
        if not matches:
            raise ProbeError(f"no 'KV cache size: N tokens' line in {args.log}")
        device, tokens = matches[-1]
        emit(
            {
                "probe": "kv_pool",
                "source": "log",
                "device": device,
                "tokens": int(tokens.replace(",", "")),
            }
        )
        return 0

    samples = metric_samples(endpoint_from(args).metrics(), "vllm:cache_config_info")
    if not samples:
        raise ProbeError("/metrics has no vllm:cache_config_info; try --log")
    labels = samples[0][0]
    blocks = int(labels["num_gpu_blocks"])
    block_size = int(labels["block_size"])
    emit(
        {
            "probe": "kv_pool",
            "source": "metrics",
            "num_blocks": blocks,
            "block_size": block_size,
            "tokens": blocks * block_size,
            "cache_dtype": labels.get("cache_dtype"),
        }
    )
    return 0


if __name__ == "__main__":
    run_probe(main)

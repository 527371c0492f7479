"""Copy probe: greedy verbatim copy of a long local document; output hash.

The hash is compared across pins, builds and flags: the same model, document
and server settings must give the same bytes. `--repeat N` sends the request
N times (later ones hit the prefix cache); any answer that differs from the
first counts as broken. `copied_prefix_chars` says how far the output follows
the document, which only a trained model does.

    python bench/probes/copy_probe.py --doc kiln/testing/tinymodel/corpus.txt
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

from probe_common import add_endpoint_args, emit, endpoint_from, run_probe

DEFAULT_DOC = Path(__file__).resolve().parents[2] / "kiln" / "testing" / "tinymodel" / "corpus.txt"
INSTRUCTION = "Copy the following text exactly, with nothing added.\n\n"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_endpoint_args(parser)
    parser.add_argument("--doc", type=Path, default=DEFAULT_DOC)
    parser.add_argument(
        "--max-chars", type=int, default=None, help="copy only the document's start"
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    endpoint = endpoint_from(args)
    doc = args.doc.read_text(encoding="utf-8")[: args.max_chars]
    prompt = INSTRUCTION + doc + "\n\nCopy:\n"

    started = time.monotonic()
    outputs = [endpoint.complete(prompt, args.max_tokens) for _ in range(args.repeat)]
    first = outputs[0]["text"]
    broken = sum(1 for o in outputs[1:] if o["text"] != first)
    emit(
        {
            "probe": "copy",
            "model": endpoint.served_model(),
            "doc": args.doc.name,
            "doc_sha256": sha256(doc),
            "prompt_tokens": outputs[0]["usage"].get("prompt_tokens"),
            "output_tokens": outputs[0]["usage"].get("completion_tokens"),
            "output_sha256": sha256(first),
            "copied_prefix_chars": common_prefix(first, doc),
            "repeats": args.repeat,
            "broken": broken,
            "elapsed_s": round(time.monotonic() - started, 2),
        }
    )
    return 1 if broken else 0


if __name__ == "__main__":
    run_probe(main)

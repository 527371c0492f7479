"""What every probe shares: the endpoint, its CLI flags, JSON output.

Standard library only, so a probe runs from any Python against any
OpenAI-compatible server (a CPU CI server or a user's GPU box).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn


class ProbeError(RuntimeError):
    """The endpoint answered something the probe cannot use."""


@dataclass
class Endpoint:
    base_url: str
    api_key: str | None
    model: str | None = None
    timeout: float = 600.0

    def _request(self, method: str, path: str, body: Any = None) -> bytes:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            self.base_url.rstrip("/") + path, data=data, headers=headers, method=method
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise ProbeError(f"{method} {path} -> HTTP {e.code}: {detail}") from e

    def get_text(self, path: str) -> str:
        return self._request("GET", path).decode()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return json.loads(self._request("POST", path, body))

    def served_model(self) -> str:
        if self.model is None:
            models = json.loads(self._request("GET", "/v1/models"))["data"]
            if not models:
                raise ProbeError("/v1/models lists no model; pass --model")
            self.model = str(models[0]["id"])
        return self.model

    def complete(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        """One greedy completion; returns the first choice plus usage."""
        out = self.post(
            "/v1/completions",
            {
                "model": self.served_model(),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "seed": 0,
            },
        )
        choice = dict(out["choices"][0])
        choice["usage"] = out.get("usage") or {}
        return choice

    def metrics(self) -> str:
        return self.get_text("/metrics")


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of a Prometheus metric in `text`."""
    samples = []
    pattern = re.compile(
        r"^" + re.escape(name) + r"(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$"
    )
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
            samples.append((labels, float(m["value"])))
    return samples


def block_size_from_metrics(endpoint: Endpoint) -> int | None:
    """vLLM publishes its cache config as labels of vllm:cache_config_info."""
    try:
        text = endpoint.metrics()
    except (ProbeError, urllib.error.URLError):
        return None
    for labels, _ in metric_samples(text, "vllm:cache_config_info"):
        if labels.get("block_size", "").isdigit():
            return int(labels["block_size"])
    return None


def add_endpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url",
        default=os.environ.get("PROBE_BASE_URL", "http://127.0.0.1:8000"),
        help="server root, without /v1 (env PROBE_BASE_URL)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer key (env OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--model", default=None, help="model name (default: first of /v1/models)"
    )
    parser.add_argument("--timeout", type=float, default=600.0)


def endpoint_from(args: argparse.Namespace) -> Endpoint:
    return Endpoint(args.base_url, args.api_key, args.model, args.timeout)


def emit(result: dict[str, Any]) -> None:
    json.dump(result, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def run_probe(main: Callable[[], int]) -> NoReturn:
    """Exit with main's code, or 2 with a one-line reason when the endpoint fails."""
    try:
        code = main()
    except (ProbeError, urllib.error.URLError, OSError) as e:
        print(f"probe failed: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)

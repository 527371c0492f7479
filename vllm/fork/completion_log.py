"""One INFO line per finished request: tokens, timings and why it ended.

Upstream aggregates these into Prometheus histograms; an operator reading the
log of a small deployment wants the per-request line instead. Requests that
finish in the engine are logged from IterationStats.update_from_finished_request;
requests aborted by the client (a dropped connection) never reach it, so
OutputProcessor.abort_requests logs those. Both need stats logging on (the
`vllm serve` default; --disable-log-stats turns this off with the rest).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

if TYPE_CHECKING:
    # Only for annotations: vllm.v1.metrics.stats imports this module.
    from vllm.v1.metrics.stats import FinishedRequestStats, RequestStateStats

logger = init_logger(__name__)


def _log_line(
    request_id: str | None,
    prompt_tokens: int,
    output_tokens: int,
    cached_tokens: int,
    first_token_latency: float,
    total: float,
    finish_reason: str,
) -> None:
    # first_token_latency stays 0.0 when no token was produced (e.g. an abort
    # during prefill); say so rather than print a fake 0.000s.
    ttft = f"{first_token_latency:.3f}s" if first_token_latency > 0 else "n/a"
    logger.info(
        "Finished request %s: prompt_tokens=%d output_tokens=%d "
        "cached_tokens=%d ttft=%s total=%.3fs finish_reason=%s",
        request_id,
        prompt_tokens,
        output_tokens,
        cached_tokens,
        ttft,
        total,
        finish_reason,
    )


def log_finished_request(
    finished: FinishedRequestStats, req_stats: RequestStateStats
) -> None:
    _log_line(
        finished.request_id,
        finished.num_prompt_tokens,
        finished.num_generation_tokens,
        finished.num_cached_tokens,
        req_stats.first_token_latency,
        finished.e2e_latency,
        str(finished.finish_reason),
    )


def log_aborted_request(req_state: Any) -> None:
    """Log a request the client aborted; `req_state` is an OutputProcessor
    RequestState (typed loosely: that module imports this one)."""
    stats: RequestStateStats | None = req_state.stats
    if stats is None:
        return
    _log_line(
        req_state.external_req_id,
        req_state.prompt_len or 0,
        stats.num_generation_tokens,
        req_state.num_cached_tokens or 0,
        stats.first_token_latency,
        time.time() - stats.arrival_time,
        "abort",
    )

"""One INFO line per finished request: tokens, timings and why it ended.

Upstream aggregates these into Prometheus histograms; an operator reading the
log of a small deployment wants the per-request line instead. Sequences that
finish in the engine are reported from OutputProcessor._update_stats_from_finished;
sequences aborted by the client (a dropped connection) never reach it, so
OutputProcessor.abort_requests reports those. Both need stats logging on (the
`vllm serve` default; --disable-log-stats turns this off with the rest).

A request with n > 1 runs as n child sequences; its line is written when the
last child has finished or been aborted, and ends in `n=<n>`: output tokens
are the children's sum, prompt tokens are counted once, cached tokens are
the fewest any child found, ttft is the first child's first token, total is
until the last child ended, and finish_reason lists the children's distinct
reasons (e.g. `abort,length`).

The 0.33.0 series hooks log_finished_request and log_aborted_request, which
log each sequence on its own (one line per sample of an n > 1 request); they
go when that pin is no longer carried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

if TYPE_CHECKING:
    # Only for annotations: vllm.v1.metrics.stats imports this module on 0.33.0.
    from vllm.v1.metrics.stats import FinishedRequestStats, RequestStateStats

logger = init_logger(__name__)


@dataclass(frozen=True)
class SequenceOutcome:
    """How one sequence (a request, or one child of an n > 1 request) ended."""

    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    # 0.0 when no token was produced (e.g. an abort during prefill).
    first_token_latency: float
    total: float
    finish_reason: str


@dataclass
class ChildOutcomes:
    """The outcomes of an n > 1 request's children; owned by its ParentRequest."""

    n: int
    outcomes: list[SequenceOutcome] = field(default_factory=list)

    def add(self, outcome: SequenceOutcome) -> SequenceOutcome | None:
        """Record one child; the request's outcome once all n have ended."""
        self.outcomes.append(outcome)
        if len(self.outcomes) < self.n:
            return None
        started = [o.first_token_latency for o in self.outcomes
                   if o.first_token_latency > 0]
        return SequenceOutcome(
            prompt_tokens=self.outcomes[0].prompt_tokens,
            output_tokens=sum(o.output_tokens for o in self.outcomes),
            cached_tokens=min(o.cached_tokens for o in self.outcomes),
            first_token_latency=min(started, default=0.0),
            total=max(o.total for o in self.outcomes),
            finish_reason=",".join(sorted({o.finish_reason for o in self.outcomes})),
        )


def _log_line(request_id: str | None, outcome: SequenceOutcome, n: int) -> None:
    # Say n/a rather than print a fake 0.000s when no token came.
    latency = outcome.first_token_latency
    ttft = f"{latency:.3f}s" if latency > 0 else "n/a"
    logger.info(
        "Finished request %s: prompt_tokens=%d output_tokens=%d "
        "cached_tokens=%d ttft=%s total=%.3fs finish_reason=%s%s",
        request_id,
        outcome.prompt_tokens,
        outcome.output_tokens,
        outcome.cached_tokens,
        ttft,
        outcome.total,
        outcome.finish_reason,
        f" n={n}" if n > 1 else "",
    )


def _outcome(req_state: Any, finish_reason: str) -> SequenceOutcome | None:
    """`req_state` is an OutputProcessor RequestState (typed loosely: that
    module imports this one); None when stats logging is off."""
    stats: RequestStateStats | None = req_state.stats
    if stats is None:
        return None
    return SequenceOutcome(
        prompt_tokens=req_state.prompt_len or 0,
        output_tokens=stats.num_generation_tokens,
        cached_tokens=req_state.num_cached_tokens or 0,
        first_token_latency=stats.first_token_latency,
        total=time.time() - stats.arrival_time,
        finish_reason=finish_reason,
    )


def _report(req_state: Any, finish_reason: str) -> None:
    """Log the request the sequence belongs to, once that request has ended."""
    outcome = _outcome(req_state, finish_reason)
    if outcome is None:
        return
    parent = req_state.parent_req
    if parent is None:
        _log_line(req_state.external_req_id, outcome, 1)
        return
    request_outcome = parent.child_outcomes.add(outcome)
    if request_outcome is not None:
        _log_line(parent.external_req_id, request_outcome, parent.n)


def log_finished_sequence(req_state: Any, finish_reason: Any) -> None:
    """A sequence the engine finished (stop, length, ...)."""
    _report(req_state, str(finish_reason))


def log_aborted_sequence(req_state: Any) -> None:
    """A sequence the client aborted."""
    _report(req_state, "abort")


def log_finished_request(
    finished: FinishedRequestStats, req_stats: RequestStateStats
) -> None:
    """0.33.0's hook in IterationStats: one line for this sequence."""
    outcome = SequenceOutcome(
        prompt_tokens=finished.num_prompt_tokens,
        output_tokens=finished.num_generation_tokens,
        cached_tokens=finished.num_cached_tokens,
        first_token_latency=req_stats.first_token_latency,
        total=finished.e2e_latency,
        finish_reason=str(finished.finish_reason),
    )
    _log_line(finished.request_id, outcome, 1)


def log_aborted_request(req_state: Any) -> None:
    """0.33.0's hook in OutputProcessor.abort_requests: one line for this sequence."""
    outcome = _outcome(req_state, "abort")
    if outcome is not None:
        _log_line(req_state.external_req_id, outcome, 1)

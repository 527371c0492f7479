"""One cache dtype's results against bf16's, and the readable table with its footer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kiln.testing.trained.metrics import WindowScores, agreement, perplexity

# What a model this small can and cannot tell: the footer under every table.
FOOTER = """\
A ~30M-parameter model trained for minutes on the standard library's sources. It
ranks cache formats by the error they add to learned attention: perplexity ratios
and top-1 agreement differences of about a tenth of a percent and up are signal for
this model and these windows. It cannot tell how a large model, long contexts past
its trained length, reasoning or instruction following fare: those need a real
model. The needle probe tests copying one value across the whole context; a miss
under bf16 means the model is too small to retrieve at that length, not a cache fault."""


@dataclass(frozen=True)
class Quality:
    dtype: str
    perplexity: float
    perplexity_late: float  # positions >= late_from
    ratio: float  # perplexity / bf16's
    ratio_late: float
    agreement: float  # top-1 the same as bf16's
    agreement_late: float
    needle_hits: int
    needle_probes: int


def quality(dtype: str, scores: Sequence[WindowScores], reference: Sequence[WindowScores],
            late_from: int, needle_hits: int, needle_probes: int) -> Quality:
    """``dtype``'s results; ``reference`` is bf16's ("auto") on the same windows."""
    ppl, ppl_late = perplexity(scores), perplexity(scores, late_from)
    return Quality(
        dtype=dtype,
        perplexity=ppl,
        perplexity_late=ppl_late,
        ratio=ppl / perplexity(reference),
        ratio_late=ppl_late / perplexity(reference, late_from),
        agreement=agreement(scores, reference),
        agreement_late=agreement(scores, reference, late_from),
        needle_hits=needle_hits,
        needle_probes=needle_probes,
    )


def as_json(rows: Sequence[Quality], setup: dict[str, Any]) -> dict[str, Any]:
    return {"setup": setup, "results": [asdict(r) for r in rows]}


def table(rows: Sequence[Quality], late_from: int) -> str:
    head = (f"{'kv cache dtype':<22} {'ppl':>8} {'vs bf16':>8} {f'ppl@{late_from}+':>10} "
            f"{'vs bf16':>8} {'top-1':>7} {f'top-1@{late_from}+':>12} {'needle':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.dtype:<22} {r.perplexity:>8.3f} {(r.ratio - 1) * 100:>+7.2f}% "
            f"{r.perplexity_late:>10.3f} {(r.ratio_late - 1) * 100:>+7.2f}% "
            f"{r.agreement * 100:>6.2f}% {r.agreement_late * 100:>11.2f}% "
            f"{f'{r.needle_hits}/{r.needle_probes}':>7}")
    return "\n".join(lines + ["", FOOTER])

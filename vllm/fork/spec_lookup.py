"""Drafts from a request's own history, for the fork's DFlash2 speculator.

Everything here is batched torch on whatever device the tensors live on (the GPU
in the engine, the CPU in tests) and never waits on the device: no ``.item()``,
no host-side branching on tensor values. It imports torch only.

* ``match_history``: the longest recent n-gram (``min_n..max_n`` tokens) ending
  the history that also occurs earlier in it, and where its continuation starts.
* ``continuation``: the tokens that follow the match. A chain (``chain=True``)
  keeps going past the end of the history by feeding its own drafts back in,
  which for a match ``d`` tokens back is ``history[start + i % d]``.
* ``TrustState``: how many leading verify slots the lookup is trusted with, per
  request slot (the adaptive verify length). It grades the lookup's last
  prediction against the tokens the step actually emitted, not against the slots
  that were verified, so the drafter's rejected tokens never count against it.
* ``assemble``: one verify block per request from the lookup, the drafter and a
  padding token, in that order of preference.
* ``dflash_input_block_sizes`` / ``dflash_prewarm_plan``: every ``BLOCK_SIZE``
  upstream's DFlash input kernel can be launched with, and a query length that
  selects each, so all of them are compiled at boot (vllm/fork/dflash_prewarm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature a request samples greedily (upstream's _SAMPLING_EPS).
# mirrors: vllm.sampling_params._SAMPLING_EPS
GREEDY_EPS = 1e-5
# Fully accepted steps in a row after which the trusted length doubles.
GROW_STREAK = 2
# Largest BLOCK_SIZE upstream's DFlash input kernel uses.
DFLASH_MAX_BLOCK = 256


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


# mirrors: vllm.v1.worker.gpu.spec_decode.dflash.speculator.prepare_dflash_inputs (its BLOCK_SIZE)
def dflash_input_block_sizes(max_query_len: int, num_query_per_req: int) -> list[int]:
    """The BLOCK_SIZE values of upstream's prepare_dflash_inputs for every batch whose
    longest target query is 1..max_query_len tokens: min(256, next_pow2(q + 1 + k))
    with num_query_per_req = 1 + k, ascending. Powers of two between the two ends."""
    if max_query_len < 1 or num_query_per_req < 1:
        raise ValueError(f"max_query_len={max_query_len} and num_query_per_req="
                         f"{num_query_per_req} must both be >= 1")
    low = min(DFLASH_MAX_BLOCK, _next_pow2(1 + num_query_per_req))
    high = min(DFLASH_MAX_BLOCK, _next_pow2(max_query_len + num_query_per_req))
    sizes = []
    size = low
    while size <= high:
        sizes.append(size)
        size *= 2
    return sizes


def dflash_prewarm_plan(max_query_len: int, num_query_per_req: int) -> list[tuple[int, int]]:
    """(BLOCK_SIZE, the shortest query length that selects it) for every variant."""
    return [(size, max(1, size // 2 - num_query_per_req + 1))
            for size in dflash_input_block_sizes(max_query_len, num_query_per_req)]


@dataclass
class HistoryMatch:
    """Per batch row: the matched n-gram length (0: none), the position of the first
    continuation token, and how far back the match lies (history length - start)."""

    n: torch.Tensor
    start: torch.Tensor
    distance: torch.Tensor


def match_history(tokens: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                  min_n: int, max_n: int, window: int) -> HistoryMatch:
    """The longest n in max_n..min_n whose last-n-token suffix of each row's history
    (``tokens[rows[b], :lengths[b]]``) also ends earlier within the last ``window``
    tokens, taking the most recent such occurrence; n = 0 where none does."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"lookup sizes {min_n}..{max_n}: need 1 <= min <= max")
    device = tokens.device
    lengths = lengths.to(torch.int64)
    num_rows = rows.shape[0]
    width = min(window, tokens.shape[1])
    offsets = torch.arange(width, device=device)
    # Window coordinates: index width is the next (not yet known) position.
    first = lengths - width
    pos = first[:, None] + offsets[None, :]
    hist = tokens[rows.to(torch.int64)[:, None], pos.clamp(min=0)].to(torch.int64)
    hist = torch.where(pos >= 0, hist, torch.full_like(hist, -1))
    best_n = torch.zeros(num_rows, dtype=torch.int64, device=device)
    best_j = torch.zeros(num_rows, dtype=torch.int64, device=device)
    for n in range(max_n, min_n - 1, -1):
        if n >= width:
            continue
        # An occurrence at [j, j + n) with a continuation inside the window,
        # i.e. j <= width - n - 1; the suffix itself sits at j = width - n.
        windows = hist.unfold(1, n, 1)[:, : width - n]
        suffix = hist[:, width - n:]
        # Positions before the history read -1, which no token equals: a window
        # reaching there holds fewer real tokens than the suffix and never matches.
        hit = (windows == suffix[:, None, :]).all(dim=2)
        j = torch.where(hit, offsets[None, : width - n], torch.full_like(hit, -1,
                                                                         dtype=torch.int64))
        j = j.max(dim=1).values
        take = (best_n == 0) & (j >= 0)
        best_n = torch.where(take, torch.full_like(best_n, n), best_n)
        best_j = torch.where(take, j, best_j)
    start = torch.where(best_n > 0, first + best_j + best_n, lengths)
    return HistoryMatch(n=best_n, start=start, distance=lengths - start)


def continuation(tokens: torch.Tensor, rows: torch.Tensor, match: HistoryMatch,
                 num: int, chain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [rows, num], available [rows, num]): the ``num`` tokens after each
    row's match. Where ``chain`` is set a row runs on past its history (slot i is
    history[start + i % distance]); elsewhere only the ``distance`` tokens the
    history holds are available. Rows without a match have nothing available."""
    device = tokens.device
    slots = torch.arange(num, device=device)[None, :]
    distance = match.distance.clamp(min=1)[:, None]
    chained = match.start[:, None] + slots % distance
    plain = match.start[:, None] + slots
    pos = torch.where(chain[:, None], chained, plain)
    available = (match.n > 0)[:, None] & (chain[:, None] | (slots < distance))
    pos = torch.where(available, pos, torch.zeros_like(pos))
    out = tokens[rows.to(torch.int64)[:, None], pos].to(torch.int64)
    return out, available


class TrustState:
    """The adaptive verify length: per request slot, how many leading verify slots
    the lookup fills (0..verify_len), grown on fully accepted streaks and cut after
    the lookup mispredicted an emitted token.

    ``observe`` grades the prediction ``record`` stored one step earlier: the
    emitted tokens (accepted drafts and the bonus token, ``emitted`` of them)
    sit in the history at ``base .. base + emitted - 1``. The lookup agreed with
    the first ``agree`` of them. Where it missed one (agree < the tokens it could
    be graded on) the trusted length becomes ``agree``; where it missed none the
    length grows to at least ``agree``, and a step in which every verified slot
    was accepted (emitted == proposed + 1) extends the streak, which doubles the
    length every GROW_STREAK steps. A row whose history does not continue the
    recorded one (base + emitted != its length now) is not graded.
    """

    def __init__(self, max_num_reqs: int, verify_len: int, device: torch.device):
        self.verify_len = verify_len
        self.trust = torch.full((max_num_reqs,), verify_len, dtype=torch.int32,
                                device=device)
        self.streak = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.pred = torch.zeros(max_num_reqs, verify_len, dtype=torch.int64, device=device)
        self.pred_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.base = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.proposed = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)

    def reset(self, slots: torch.Tensor) -> None:
        """New, resumed (after preemption) or reassigned requests start trusted and
        ungraded."""
        slots = slots.to(torch.int64)
        self.trust[slots] = self.verify_len
        self.streak[slots] = 0
        self.pred_len[slots] = 0
        self.proposed[slots] = 0

    def observe(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                emitted: torch.Tensor) -> None:
        slots = slots.to(torch.int64)
        lengths = lengths.to(torch.int64)
        emitted = emitted.to(torch.int64)
        base = self.base[slots].to(torch.int64)
        pred_len = self.pred_len[slots].to(torch.int64)
        graded = (pred_len > 0) & (emitted > 0) & (base + emitted == lengths)
        idx = torch.arange(self.verify_len, device=tokens.device)[None, :]
        comparable = torch.minimum(emitted, pred_len)
        in_range = idx < comparable[:, None]
        pos = torch.where(in_range, base[:, None] + idx, torch.zeros_like(idx))
        actual = tokens[slots[:, None], pos].to(torch.int64)
        same = (actual == self.pred[slots]) | ~in_range
        # Leading agreement: the index of the first miss, or the comparable count.
        agree = torch.where(same.all(dim=1), comparable,
                            (~same).to(torch.int64).argmax(dim=1))
        trust = self.trust[slots].to(torch.int64)
        streak = self.streak[slots].to(torch.int64)
        missed = agree < comparable
        proposed = self.proposed[slots].to(torch.int64)
        full = (proposed > 0) & (emitted == proposed + 1)
        grown = torch.maximum(trust, agree)
        streak_next = torch.where(full, streak + 1, torch.zeros_like(streak))
        doubled = streak_next >= GROW_STREAK
        grown = torch.where(doubled, 2 * grown.clamp(min=1), grown)
        streak_next = torch.where(doubled, torch.zeros_like(streak_next), streak_next)
        new_trust = torch.where(missed, agree, grown).clamp(max=self.verify_len)
        new_streak = torch.where(missed, torch.zeros_like(streak), streak_next)
        self.trust[slots] = torch.where(graded, new_trust, trust).to(torch.int32)
        self.streak[slots] = torch.where(graded, new_streak, streak).to(torch.int32)

    def record(self, slots: torch.Tensor, lengths: torch.Tensor, pred: torch.Tensor,
               available: torch.Tensor, proposed: torch.Tensor) -> None:
        """This step's lookup prediction (its leading available run is graded next
        step) and how many drafts went into the verify block."""
        slots = slots.to(torch.int64)
        run = available.to(torch.int64).cumprod(dim=1).sum(dim=1)
        self.pred[slots] = pred
        self.pred_len[slots] = run.to(torch.int32)
        self.base[slots] = lengths.to(torch.int32)
        self.proposed[slots] = proposed.to(torch.int32)


def assemble(lookup: torch.Tensor, lookup_ok: torch.Tensor, trust: torch.Tensor,
             drafter: torch.Tensor | None, pad: torch.Tensor) -> torch.Tensor:
    """Verify blocks [rows, slots]: slot i takes the lookup's token while i < trust
    and the lookup has one there, else the drafter's (for i below its width), else
    the lookup's untrusted token, else ``pad`` (the row's last token)."""
    slots = torch.arange(lookup.shape[1], device=lookup.device)[None, :]
    out = torch.where(lookup_ok, lookup, pad[:, None].to(lookup.dtype))
    if drafter is not None:
        width = drafter.shape[1]
        from_drafter = torch.zeros_like(lookup_ok)
        from_drafter[:, :width] = True
        wide = torch.zeros_like(lookup)
        wide[:, :width] = drafter[:, : lookup.shape[1]]
        out = torch.where(from_drafter, wide, out)
    trusted = lookup_ok & (slots < trust[:, None].to(torch.int64))
    return torch.where(trusted, lookup, out)


def chain_covers(match: HistoryMatch, chain: torch.Tensor, trust: torch.Tensor,
                 count: int) -> torch.Tensor:
    """Rows whose verify block is all trusted chain: they need no drafter tokens."""
    return chain & (match.n > 0) & (trust.to(torch.int64) >= count)


def is_greedy(temperature: torch.Tensor) -> torch.Tensor:
    return temperature < GREEDY_EPS

"""The copying model: constructed weights whose greedy next token at position p is
the token at p + 1 - P, read through attention and the KV cache. ``copy_design``
chooses and checks the q/k shapes, ``copy_entries`` writes the weights, and
``copy_prompt``/``copy_continuation`` give a prompt and what the model must answer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.testing.tinymodel.dense import param_shapes
from kiln.testing.tinymodel.folder import read_spec
from kiln.testing.tinymodel.spec import TinySpec, code_dims, rotary_dims, validate
from kiln.testing.tinymodel.tensors import Entry, tensor_seed, torch_dtype
from kiln.testing.tinymodel.tokenizer import SPECIAL_TOKENS

# The attention margin the copy construction aims for and the least it accepts.
COPY_TARGET_MARGIN = 32.0
COPY_MIN_MARGIN = 20.0
# The largest attention score (in nats) the construction will use to get there.
COPY_MAX_SCORE = 256.0


@dataclass(frozen=True)
class CopyDesign:
    """What copy_design chose and measured for a copy spec."""

    period: int
    rope_theta: float
    # Pair i of q/k gets weight proportional to theta_i ** freq_power.
    freq_power: float
    # Attention score (logit, nats) of the key P - 1 back.
    peak_score: float
    # Its lead over the best other key within max positions, exact arithmetic
    # on the stored (rounded) q_norm/k_norm weights.
    margin_nats: float
    # How many positions back that best other key lies.
    runner_up_offset: int
    code_dims: int
    # Least Hamming distance between two tokens' codes.
    min_code_distance: int
    lm_head_scale: float

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# The q/k shapes tried, in order; the first with the largest margin wins.
_COPY_THETAS = (2.0, 3.0, 10.0)
_COPY_POWERS = (2.0, 3.0, 4.0)


def _rope_inv_freq(theta: float, rotary_dims: int) -> Any:
    """theta_i = rope_theta ** (-2i / R), in float32 as transformers and vLLM make it."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, rotary_dims, 2, dtype=torch.float32) / rotary_dims))


def _scores(q: Any, k: Any, inv_freq: Any, positions: int) -> Any:
    """Attention logit of a query at p against the key at p - d, for d = 0..positions-1.

    q and k are the per-head vectors after q_norm/k_norm (constant over
    positions); neox RoPE turns channel pair (i, i + R/2) of the first R = 2 x
    len(inv_freq) channels by position * theta_i; the channels past R add the
    same q . k at every distance.
    """
    import torch

    q, k = q.double(), k.double()
    rot = 2 * inv_freq.numel()
    half = rot // 2
    qa, qb, ka, kb = q[:half], q[half:rot], k[:half], k[half:rot]
    real = qa * ka + qb * kb
    imag = qb * ka - qa * kb
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    still = float(q[rot:] @ k[rot:])
    return (torch.cos(angle) @ real - torch.sin(angle) @ imag + still) / math.sqrt(q.numel())


def _copy_qk(spec: TinySpec) -> tuple[Any, Any, float, float, float]:
    """q_norm and k_norm weights as they act (the stored ones: norm_weights),
    rope_theta, freq power, peak score."""
    import torch

    D, M, P = spec.head_dim, spec.max_position_embeddings, spec.copy_period
    R = rotary_dims(spec)
    assert P is not None
    # Offsets d - (P - 1) of every key a query can see, the target's excluded.
    delta = torch.arange(M, dtype=torch.float64) - (P - 1)
    delta = delta[delta != 0]
    best: tuple[float, float, float] | None = None
    for theta in _COPY_THETAS:
        freq = _rope_inv_freq(theta, R).double()
        loss = 1.0 - torch.cos(delta[:, None] * freq[None, :])
        for power in _COPY_POWERS:
            weight = freq**power
            weight = weight / weight.sum()
            # Score lost at the closest wrong offset, per unit of peak score.
            unit_margin = float((loss @ weight).min())
            if best is None or unit_margin > best[0]:
                best = (unit_margin, theta, power)
    assert best is not None
    unit_margin, theta, power = best
    peak = min(COPY_TARGET_MARGIN / max(unit_margin, 1e-9), COPY_MAX_SCORE)
    freq = _rope_inv_freq(theta, R).double()
    weight = freq**power
    weight = weight / weight.sum()
    # q . k / sqrt(D) summed over pairs is the peak score when the pairs align.
    amplitude = torch.sqrt(weight * peak * math.sqrt(D))
    # The key has phase 0, the query is turned back by (P - 1) * theta_i, so
    # the two line up exactly P - 1 positions apart; unturned channels stay 0.
    phase = -(P - 1) * freq
    still = torch.zeros(D - R, dtype=torch.float64)
    q = torch.cat([amplitude * torch.cos(phase), amplitude * torch.sin(phase), still])
    k = torch.cat([amplitude, torch.zeros_like(amplitude), still])
    return q, k, theta, power, peak


def norm_weights(spec: TinySpec, acting: Any) -> tuple[Any, Any]:
    """The stored q_norm/k_norm weight that makes a norm scale by ``acting``, and
    what it then scales by after rounding to the spec's dtype. Qwen3.5's norms
    scale by (1 + w), in float32; Qwen3's by w."""
    stored = (acting - 1.0 if spec.hybrid else acting).to(torch_dtype(spec.dtype))
    return stored, (1.0 + stored.float() if spec.hybrid else stored).double()


def _copy_codes(spec: TinySpec, vocab: int) -> tuple[Any, int]:
    """One +/-1 code per token, seeded; no two closer than half the code width."""
    import torch

    c = code_dims(spec)
    gen = torch.Generator().manual_seed(tensor_seed(spec.seed, "copy-codes"))
    codes = torch.empty(vocab, c)
    # Two codes whose dot product is at most c/2 differ in >= c/4 places, which
    # keeps the right token ahead when the copied values are noisy.
    limit = c // 2
    for t in range(vocab):
        for _ in range(10_000):
            cand = torch.randint(0, 2, (c,), generator=gen).float() * 2 - 1
            if t == 0 or float((codes[:t] @ cand).max()) <= limit:
                codes[t] = cand
                break
        else:
            raise KilnError(
                f"--copy with --hidden {spec.hidden_size} --kv-heads {spec.num_kv_heads} "
                f"--head-dim {spec.head_dim}: token codes of {c} dims (the smaller of "
                f"(hidden - 1) / 2 and kv-heads x head-dim) leave no room for {vocab} "
                "distinct tokens; raise the smaller"
            )
    gram = codes @ codes.T
    gram.fill_diagonal_(-float(c))
    min_distance = int((c - float(gram.max())) // 2)
    return codes, min_distance


def copy_design(spec: TinySpec, vocab: int | None = None) -> CopyDesign:
    """Choose and check a copy spec's attention; raise KilnError when too weak.

    Needs torch but no transformers: a probe can check a spec without building.
    """
    validate(spec)
    if spec.copy_period is None:
        raise KilnError("copy_design needs a spec with copy_period set (--copy)")
    design, _ = copy_parts(spec, vocab or spec.vocab_size)
    return design


def copy_parts(spec: TinySpec, vocab: int) -> tuple[CopyDesign, dict[str, Any]]:
    import torch

    q, k, theta, power, peak = _copy_qk(spec)
    q_norm, q = norm_weights(spec, q)
    k_norm, k = norm_weights(spec, k)
    scores = _scores(q, k, _rope_inv_freq(theta, rotary_dims(spec)),
                     spec.max_position_embeddings)
    P = spec.copy_period
    assert P is not None
    target = float(scores[P - 1])
    others = scores.clone()
    others[P - 1] = -math.inf
    runner_up = int(torch.argmax(others))
    margin = target - float(others[runner_up])
    if margin < COPY_MIN_MARGIN:
        raise KilnError(
            f"--copy-period {P} --head-dim {spec.head_dim} --max-positions "
            f"{spec.max_position_embeddings}: the key {P - 1} positions back leads the "
            f"best other key ({runner_up} back) by only {margin:.1f} nats; the copy "
            f"needs >= {COPY_MIN_MARGIN:.0f}: use a larger --head-dim or fewer --max-positions"
            + (" (a --hybrid model turns only a quarter of each head)" if spec.hybrid else "")
        )
    codes, min_distance = _copy_codes(spec, vocab)
    c = codes.shape[1]
    # The copied code arrives normalised to about unit entries; this puts the
    # right token's logit near 32 and the nearest other >= 8 nats below.
    lm_scale = 32.0 / c
    design = CopyDesign(
        period=P,
        rope_theta=theta,
        freq_power=power,
        peak_score=peak,
        margin_nats=margin,
        runner_up_offset=runner_up,
        code_dims=c,
        min_code_distance=min_distance,
        lm_head_scale=lm_scale,
    )
    return design, {"q_norm": q_norm, "k_norm": k_norm, "codes": codes}


def copy_layout(parts: dict[str, Any]) -> tuple[int, int]:
    """Where the residual stream keeps the constant and the copied code: the token's
    code is in dims [0, c), the constant 1 in c, the copied code in [c + 1, 2c + 1)."""
    c = parts["codes"].shape[1]
    return c, c + 1


def copy_embed(spec: TinySpec, vocab: int, parts: dict[str, Any]) -> Any:
    import torch

    codes = parts["codes"]
    one, _ = copy_layout(parts)
    w = torch.zeros(vocab, spec.hidden_size)
    w[:, : codes.shape[1]] = codes
    w[:, one] = 1.0
    return w


def read_constant(spec: TinySpec, parts: dict[str, Any], rows: int) -> Any:
    """A projection whose every output reads the constant. As q or k, after
    q_norm/k_norm, that is the norm weight itself at every position."""
    import torch

    one, _ = copy_layout(parts)
    w = torch.zeros(rows, spec.hidden_size)
    w[:, one] = 1.0
    return w


def copy_v_proj(spec: TinySpec, parts: dict[str, Any]) -> Any:
    """Code dimension i travels in KV head i % Hkv, channel i // Hkv, so every KV
    head carries part of the code."""
    import torch

    D, Hkv = spec.head_dim, spec.num_kv_heads
    w = torch.zeros(Hkv * D, spec.hidden_size)
    for i in range(parts["codes"].shape[1]):
        w[(i % Hkv) * D + i // Hkv, i] = 1.0
    return w


def copy_o_proj(spec: TinySpec, parts: dict[str, Any]) -> Any:
    """Each query head's share of the copied code, into the copied-code dims."""
    import torch

    D, H, Hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    group = H // Hkv
    c, out0 = parts["codes"].shape[1], copy_layout(parts)[1]
    w = torch.zeros(spec.hidden_size, H * D)
    for h in range(H):
        g = h // group
        for ch in range(D):
            i = ch * Hkv + g
            if i < c:
                w[out0 + i, h * D + ch] = 1.0 / group
    return w


def copy_lm_head(spec: TinySpec, vocab: int, parts: dict[str, Any], lm_scale: float) -> Any:
    import torch

    codes = parts["codes"]
    out0 = copy_layout(parts)[1]
    w = torch.zeros(vocab, spec.hidden_size)
    w[:, out0 : out0 + codes.shape[1]] = codes * lm_scale
    # Special tokens score 0 against a right token near +32: never produced.
    w[: len(SPECIAL_TOKENS)] = 0.0
    return w


def copy_entries(
    spec: TinySpec, vocab: int, parts: dict[str, Any], lm_scale: float
) -> list[Entry]:
    """The dense copying model's weights (see copy_design and the module docstring);
    the MLPs write nothing."""
    import torch

    d = spec.hidden_size

    def ones(n: int) -> Callable[[], Any]:
        return lambda: torch.ones(n)

    def zeros(shape: tuple[int, ...]) -> Callable[[], Any]:
        return lambda: torch.zeros(shape)

    makers: dict[str, Callable[[], Any]] = {
        "model.embed_tokens.weight": lambda: copy_embed(spec, vocab, parts),
        "model.norm.weight": ones(d),
        "lm_head.weight": lambda: copy_lm_head(spec, vocab, parts, lm_scale),
    }
    entries: list[Entry] = []
    for name, shape in param_shapes(spec, vocab, tied=False):
        part = name.rsplit(".", 2)[-2]
        make = makers.get(name)
        if make is None:
            make = {
                "input_layernorm": ones(d),
                "post_attention_layernorm": ones(d),
                "q_proj": lambda: read_constant(spec, parts, spec.num_heads * spec.head_dim),
                "k_proj": lambda: read_constant(spec, parts,
                                                spec.num_kv_heads * spec.head_dim),
                "v_proj": lambda: copy_v_proj(spec, parts),
                "o_proj": lambda: copy_o_proj(spec, parts),
                "q_norm": lambda: parts["q_norm"],
                "k_norm": lambda: parts["k_norm"],
            }.get(part, zeros(shape))
        entries.append((name, shape, make))
    return entries


def copy_prompt(
    model_dir_or_spec: Path | str | TinySpec, length: int, seed: int = 0
) -> list[int]:
    """Token ids for a copy model: a seeded random period of non-special tokens,
    repeated and cut to ``length``. Standard library only."""
    spec = (
        model_dir_or_spec
        if isinstance(model_dir_or_spec, TinySpec)
        else read_spec(Path(model_dir_or_spec))
    )
    period = spec.copy_period
    if period is None:
        raise KilnError("copy_prompt needs a copy model (built with --copy)")
    if length < 0:
        raise KilnError(f"copy_prompt length {length}: must be >= 0")
    # The tokenizer puts the special tokens first (the builder checks it).
    tokens = range(len(SPECIAL_TOKENS), spec.vocab_size)
    rng = random.Random(seed)
    base = [rng.choice(tokens) for _ in range(period)]
    return (base * (length // period + 1))[:length]


def copy_continuation(prompt_ids: Iterable[int], n: int, period: int) -> list[int]:
    """The next ``n`` tokens a copy model of ``period`` gives after ``prompt_ids``:
    each is the token ``period`` places before it."""
    seq = list(prompt_ids)
    if len(seq) < period:
        raise KilnError(
            f"a prompt of {len(seq)} tokens holds no full period of {period}: "
            "the copy is only defined from one period on"
        )
    start = len(seq)
    for _ in range(n):
        seq.append(seq[-period])
    return seq[start:]

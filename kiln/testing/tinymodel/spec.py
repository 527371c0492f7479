"""What a tiny model is: ``TinySpec`` (every field that decides its bytes), the named
sizes in ``PRESETS``, and ``validate``, which names the CLI flag behind a bad field.
Standard library only: the CLI checks a spec before anything imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from kiln.errors import KilnError

DTYPES = ("float32", "bfloat16", "float16")
INITS = ("transformers", "seeded")
DEFAULT_COPY_PERIOD = 257


@dataclass(frozen=True)
class TinySpec:
    """Everything that decides the bytes of a tiny model."""

    hybrid: bool = False
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    max_position_embeddings: int = 4096
    # Wider than the usual 0.02 so logits have clear winners: greedy answers
    # then do not flip on last-bit differences between batch shapes.
    initializer_range: float = 0.3
    seed: int = 0
    # Fields added later. At these defaults they are left out of the
    # fingerprint and the stamp, so folders built before they existed keep
    # their bytes and their cache names.
    dtype: str = "float32"
    # "transformers": transformers' per-module init under torch.manual_seed;
    # "seeded": normal(0, initializer_range) from a generator seeded per tensor.
    # A copy model draws no random weights but its token codes (from seed).
    init: str = "transformers"
    # A copying model with this period (see copy_design); None: random weights.
    copy_period: int | None = None


_LATER_DEFAULTS = {"dtype": "float32", "init": "transformers", "copy_period": None}

# The CLI flag that sets each field, for error messages.
FLAGS = {
    "hybrid": "--hybrid",
    "hidden_size": "--hidden",
    "intermediate_size": "--intermediate",
    "num_layers": "--layers",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "max_position_embeddings": "--max-positions",
    "dtype": "--dtype",
    "init": "--init",
    "copy_period": "--copy-period",
}

# Named sizes; fields not named keep TinySpec's defaults ("tiny" is today's
# CPU-tier model). Explicit flags override a preset's values.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "d64": dict(
        hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1,
        head_dim=64, init="seeded",
    ),
    "d128": dict(
        hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
        head_dim=128, init="seeded",
    ),
    # About 400M parameters, bf16. The usual 0.02 init keeps activations of
    # this width in fp16 range (0.3 would not).
    "large": dict(
        num_layers=8, hidden_size=2048, intermediate_size=6144, num_heads=16,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131584,
        dtype="bfloat16", init="seeded", initializer_range=0.02,
    ),
}


def preset(name: str, **overrides: Any) -> TinySpec:
    """The spec of a named size, with ``overrides`` (TinySpec fields) on top."""
    if name not in PRESETS:
        raise KilnError(f"--size {name}: unknown size; choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(TinySpec)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise KilnError(f"unknown TinySpec field(s): {', '.join(unknown)}")
    return replace(TinySpec(), **{**PRESETS[name], **overrides})


def attention_layers(spec: TinySpec) -> int:
    """Layers with a KV cache: all of a dense model's, the last of a hybrid's."""
    return 1 if spec.hybrid else spec.num_layers


def spec_dict(spec: TinySpec) -> dict[str, Any]:
    """The spec as recorded in the fingerprint and the stamp."""
    data = asdict(spec)
    for name, default in _LATER_DEFAULTS.items():
        if data[name] == default:
            del data[name]
    return data


def spec_from_dict(data: dict[str, Any]) -> TinySpec:
    return TinySpec(**data)

# A copy model's code width (see copy_design) must be at least this.
MIN_CODE_DIMS = 24


def code_dims(spec: TinySpec) -> int:
    return min((spec.hidden_size - 1) // 2, spec.num_kv_heads * spec.head_dim)


def validate(spec: TinySpec) -> None:
    """Raise KilnError naming the flag and what it allows; needs no torch."""
    sizes = (
        "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
        "intermediate_size", "max_position_embeddings",
    )
    for name in sizes:
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KilnError(f"{FLAGS[name]} {value}: must be a positive whole number")
    if spec.head_dim % 2:
        raise KilnError(
            f"--head-dim {spec.head_dim}: must be even (RoPE rotates pairs of channels)"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise KilnError(
            f"--heads {spec.num_heads} --kv-heads {spec.num_kv_heads}: the number of "
            "query heads must be a multiple of the number of KV heads"
        )
    if spec.dtype not in DTYPES:
        raise KilnError(f"--dtype {spec.dtype}: choose one of {', '.join(DTYPES)}")
    if spec.init not in INITS:
        raise KilnError(f"--init {spec.init}: choose one of {', '.join(INITS)}")
    if spec.hybrid and spec.init != "transformers":
        raise KilnError(
            "--hybrid takes transformers' init only (--init transformers): the seeded "
            "writer knows the dense Qwen3 layout alone"
        )
    if spec.copy_period is None:
        return
    period = spec.copy_period
    if spec.hybrid:
        raise KilnError("--copy and --hybrid: the copying model is dense attention only")
    if not isinstance(period, int) or isinstance(period, bool) or period < 2:
        raise KilnError(f"--copy-period {period}: must be a whole number >= 2")
    if period > spec.max_position_embeddings:
        raise KilnError(
            f"--copy-period {period}: must be at most --max-positions "
            f"({spec.max_position_embeddings}), or no prompt holds one period"
        )
    if (spec.hidden_size - 1) // 2 < MIN_CODE_DIMS:
        raise KilnError(
            f"--copy with --hidden {spec.hidden_size}: needs --hidden >= "
            f"{2 * MIN_CODE_DIMS + 1} (token code, a constant, the copied code)"
        )
    if spec.num_kv_heads * spec.head_dim < MIN_CODE_DIMS:
        raise KilnError(
            f"--copy with --kv-heads {spec.num_kv_heads} --head-dim {spec.head_dim}: "
            f"the values carry the token code; needs kv-heads x head-dim >= {MIN_CODE_DIMS}"
        )

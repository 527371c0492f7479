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
DEVICES = ("cpu", "cuda")
DEFAULT_COPY_PERIOD = 257
# Qwen3.5 rotates a quarter of each head (transformers' Qwen3_5TextConfig default
# rope_parameters["partial_rotary_factor"]; hybrid.py writes it into the config).
HYBRID_ROTARY_FRACTION = 0.25


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
    # The hybrid's Gated DeltaNet (linear attention) layers: key and value heads
    # and their widths, and the causal convolution's taps.
    linear_key_heads: int = 2
    linear_value_heads: int = 2
    linear_key_dim: int = 32
    linear_value_dim: int = 32
    linear_conv_kernel: int = 4
    # Every Nth layer of a hybrid is full attention (Qwen3.5: 4, three linear
    # then one full); None: the last layer alone.
    full_attention_interval: int | None = None
    # Multi-token-prediction layers after a hybrid's last (vLLM's "mtp" method).
    mtp_layers: int = 0
    # Where the seeded init draws: cuda draws billions of values in seconds, but
    # its values differ from the CPU's (the same for one device kind and torch).
    device: str = "cpu"


_LATER_DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "init": "transformers", "copy_period": None,
    "linear_key_heads": 2, "linear_value_heads": 2, "linear_key_dim": 32,
    "linear_value_dim": 32, "linear_conv_kernel": 4, "full_attention_interval": None,
    "mtp_layers": 0, "device": "cpu",
}
# The fields that shape a hybrid's layers alone.
LINEAR_SIZES = (
    "linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim",
    "linear_conv_kernel",
)
HYBRID_FIELDS = (*LINEAR_SIZES, "full_attention_interval", "mtp_layers")

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
    "linear_key_heads": "--linear-key-heads",
    "linear_value_heads": "--linear-value-heads",
    "linear_key_dim": "--linear-key-dim",
    "linear_value_dim": "--linear-value-dim",
    "linear_conv_kernel": "--linear-conv-kernel",
    "full_attention_interval": "--full-attention-interval",
    "mtp_layers": "--mtp-layers",
    "device": "--device",
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
    # Qwen3.5 27B's layer shapes in 8 of its 64 layers (see hybrid.py): hidden
    # 5120, gated attention 24 heads / 4 KV heads of 256, GDN 16 key / 48 value
    # heads of 128, every 4th layer full attention, one MTP layer.
    "hybrid27": dict(
        hybrid=True, num_layers=8, hidden_size=5120, intermediate_size=17408,
        num_heads=24, num_kv_heads=4, head_dim=256, linear_key_heads=16,
        linear_value_heads=48, linear_key_dim=128, linear_value_dim=128,
        linear_conv_kernel=4, full_attention_interval=4, mtp_layers=1,
        max_position_embeddings=131584, dtype="bfloat16", init="seeded",
        initializer_range=0.02,
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


def layer_types(spec: TinySpec) -> list[str]:
    """Each decoder layer's kind, as Qwen3.5's config lists them."""
    if not spec.hybrid:
        return ["full_attention"] * spec.num_layers
    every = spec.full_attention_interval or spec.num_layers
    return ["linear_attention" if (i + 1) % every else "full_attention"
            for i in range(spec.num_layers)]


def attention_layers(spec: TinySpec) -> int:
    """Layers with a KV cache: all of a dense model's, a hybrid's full-attention ones."""
    return layer_types(spec).count("full_attention")


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


def rotary_dims(spec: TinySpec) -> int:
    """Channels of a head that RoPE turns: all of a dense Qwen3's, a quarter of Qwen3.5's."""
    return int(spec.head_dim * HYBRID_ROTARY_FRACTION) if spec.hybrid else spec.head_dim


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
    if spec.device not in DEVICES:
        raise KilnError(f"--device {spec.device}: choose one of {', '.join(DEVICES)}")
    if spec.device != "cpu" and (spec.init != "seeded" or spec.copy_period is not None):
        raise KilnError(
            f"--device {spec.device}: only the seeded init draws on a device "
            "(--init seeded, without --copy)"
        )
    _validate_hybrid(spec)
    if spec.copy_period is None:
        return
    period = spec.copy_period
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


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _validate_hybrid(spec: TinySpec) -> None:
    if not spec.hybrid:
        given = [FLAGS[n] for n in HYBRID_FIELDS if getattr(spec, n) != _LATER_DEFAULTS[n]]
        if given:
            raise KilnError(f"{', '.join(given)}: only apply with --hybrid (the Qwen3.5 layout)")
        return
    for name in LINEAR_SIZES:
        if not _whole(getattr(spec, name), 1):
            raise KilnError(f"{FLAGS[name]} {getattr(spec, name)}: must be a positive whole number")
    if spec.linear_value_heads % spec.linear_key_heads:
        raise KilnError(
            f"--linear-key-heads {spec.linear_key_heads} --linear-value-heads "
            f"{spec.linear_value_heads}: the value heads must be a multiple of the key heads"
        )
    every = spec.full_attention_interval
    if every is not None and not (_whole(every, 1) and every <= spec.num_layers):
        raise KilnError(
            f"--full-attention-interval {every}: must be a whole number from 1 to --layers "
            f"({spec.num_layers}), so that some layer is full attention"
        )
    if not _whole(spec.mtp_layers, 0):
        raise KilnError(f"--mtp-layers {spec.mtp_layers}: must be a whole number >= 0")
    if spec.mtp_layers and spec.init != "seeded":
        raise KilnError(
            f"--mtp-layers {spec.mtp_layers}: needs --init seeded (transformers' Qwen3.5 "
            "has no MTP layer to initialise)"
        )
    if spec.head_dim % 8:
        raise KilnError(
            f"--head-dim {spec.head_dim} with --hybrid: must be a multiple of 8 (Qwen3.5 "
            "rotates a quarter of each head, in pairs)"
        )

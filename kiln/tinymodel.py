"""A tiny Qwen3-architecture model made locally and deterministically: no hub.

Random weights from a fixed seed and a small byte-level BPE tokenizer trained on
a text file shipped in the repository, with a ChatML chat template. The same
inputs give the same bytes, so a built folder is cached by a fingerprint of
what went into it. torch, transformers and tokenizers are imported inside the
functions that need them: kiln itself imports with the standard library only.

Sizes and the weights' dtype come from a ``TinySpec`` (named presets in
``PRESETS``). Random weights come either from transformers' own per-module
initialisation (the default, which the CPU end-to-end tier's model was built
with) or from a seeded generator per tensor, streamed to disk one tensor at a
time, which keeps large models fast to build and small in memory.

A copying model (``copy_period=P``) has constructed weights instead: its greedy
next token at position p is the token at position p + 1 - P, read through the
attention and the KV cache (see ``copy_design``), so a prompt made of a period
repeated (``copy_prompt``) continues exactly (``copy_continuation``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, naming
from kiln.paths import REPO_ROOT, cache_dir
from kiln.stampedfolder import StampedFolder

CORPUS = REPO_ROOT / "tests" / "e2e" / "data" / "corpus.txt"
STAMP = "kiln-tiny-model.json"
# Every file a build writes: a rebuild replaces a folder holding these and nothing else.
MODEL_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
    "tokenizer.json", "tokenizer_config.json", STAMP,
})
_NEEDS = ("torch", "transformers", "tokenizers")
# Bump when the generator changes what it writes for the same spec.
GENERATOR_VERSION = 1

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

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
# The attention margin the copy construction aims for and the least it accepts.
COPY_TARGET_MARGIN = 32.0
COPY_MIN_MARGIN = 20.0
# The largest attention score (in nats) the construction will use to get there.
COPY_MAX_SCORE = 256.0


def _code_dims(spec: TinySpec) -> int:
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


def _versions() -> dict[str, str]:
    # Weight init and file formats may change between releases of these.
    found = {}
    for name in _NEEDS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def fingerprint(spec: TinySpec, corpus: Path = CORPUS) -> str:
    """Hash of the spec, the corpus, the library versions and this generator."""
    h = hashlib.sha256()
    h.update(json.dumps(spec_dict(spec), sort_keys=True).encode())
    h.update(corpus.read_bytes())
    h.update(json.dumps(_versions(), sort_keys=True).encode())
    h.update(str(GENERATOR_VERSION).encode())
    return h.hexdigest()[:16]


def default_out(spec: TinySpec) -> Path:
    kind = "hybrid" if spec.hybrid else "copy" if spec.copy_period else "dense"
    return cache_dir() / "tiny-model" / f"{kind}-{fingerprint(spec)}"


def _train_tokenizer(spec: TinySpec, corpus: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every input string encodes, nothing maps to an unknown token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def _write_tokenizer(tokenizer: Any, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(
        out / "special_tokens_map.json",
        {"eos_token": IM_END, "pad_token": END_OF_TEXT},
    )


def _model_config(spec: TinySpec, tokenizer: Any, **extra: Any) -> Any:
    vocab = tokenizer.get_vocab_size()
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(END_OF_TEXT),
    )
    common.update(extra)
    if spec.hybrid:
        from transformers import Qwen3_5TextConfig

        # Qwen3.5 layout: linear-attention (Gated DeltaNet) layers with a
        # full-attention layer every few.
        return Qwen3_5TextConfig(
            **common,
            layer_types=["linear_attention"] * (spec.num_layers - 1)
            + ["full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
        )
    from transformers import Qwen3Config

    return Qwen3Config(**common)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _write_model(spec: TinySpec, tokenizer: Any, out: Path) -> None:
    """Weights from transformers' own init (the original tiny model's path)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _model_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.dtype != "float32":
        # Drawn in float32 and rounded, so the dtype changes only the rounding.
        model = model.to(_torch_dtype(spec.dtype))
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


# ---------------------------------------------------------------------------
# Weights written tensor by tensor: the seeded init and the copying model.

# A tensor to write: its name, its shape, and a function making its values.
_Entry = tuple[str, tuple[int, ...], Callable[[], Any]]

_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _write_safetensors(path: Path, entries: Sequence[_Entry], dtype: str) -> None:
    """A safetensors file written one tensor at a time, in ``entries`` order.

    The format: an 8-byte little-endian header length, a JSON header naming
    each tensor's dtype, shape and byte range, then the raw little-endian data.
    Only one tensor is in memory at a time.
    """
    import torch

    if sys.byteorder != "little":
        raise KilnError("writing safetensors needs a little-endian machine")
    torch_dtype = _torch_dtype(dtype)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = math.prod(shape) * itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with naming(path), path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, make in entries:
            tensor = make().to(torch_dtype).contiguous()
            if tuple(tensor.shape) != shape:
                raise AssertionError(f"{name}: made {tuple(tensor.shape)}, declared {shape}")
            f.write(tensor.view(torch.uint8).numpy().data)


def _layer_shapes(spec: TinySpec, i: int) -> list[tuple[str, tuple[int, ...]]]:
    d, D = spec.hidden_size, spec.head_dim
    p = f"model.layers.{i}."
    return [
        (p + "input_layernorm.weight", (d,)),
        (p + "self_attn.q_proj.weight", (spec.num_heads * D, d)),
        (p + "self_attn.k_proj.weight", (spec.num_kv_heads * D, d)),
        (p + "self_attn.v_proj.weight", (spec.num_kv_heads * D, d)),
        (p + "self_attn.o_proj.weight", (d, spec.num_heads * D)),
        (p + "self_attn.q_norm.weight", (D,)),
        (p + "self_attn.k_norm.weight", (D,)),
        (p + "post_attention_layernorm.weight", (d,)),
        (p + "mlp.gate_proj.weight", (spec.intermediate_size, d)),
        (p + "mlp.up_proj.weight", (spec.intermediate_size, d)),
        (p + "mlp.down_proj.weight", (d, spec.intermediate_size)),
    ]


def _param_shapes(spec: TinySpec, vocab: int, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a dense Qwen3 checkpoint, as transformers names them."""
    shapes = [("model.embed_tokens.weight", (vocab, spec.hidden_size))]
    for i in range(spec.num_layers):
        shapes += _layer_shapes(spec, i)
    shapes.append(("model.norm.weight", (spec.hidden_size,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, spec.hidden_size)))
    return shapes


def param_count(spec: TinySpec, vocab: int | None = None) -> int:
    """Parameters of the dense model a spec describes (lm_head counted once if tied)."""
    tied = spec.copy_period is None
    shapes = _param_shapes(spec, vocab or spec.vocab_size, tied)
    return sum(math.prod(shape) for _, shape in shapes)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _seeded_entries(spec: TinySpec, vocab: int) -> list[_Entry]:
    """normal(0, initializer_range) matrices, each from its own seeded generator;
    norm weights one. The same distribution transformers' init draws from."""
    import torch

    def make(name: str, shape: tuple[int, ...]) -> Callable[[], Any]:
        if len(shape) == 1:
            return lambda: torch.ones(shape)

        def draw() -> Any:
            gen = torch.Generator().manual_seed(_tensor_seed(spec.seed, name))
            out = torch.empty(shape)
            return out.normal_(0.0, spec.initializer_range, generator=gen)

        return draw

    return [(n, s, make(n, s)) for n, s in _param_shapes(spec, vocab, tied=True)]


# ---------------------------------------------------------------------------
# The copying model.


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


def _rope_inv_freq(theta: float, head_dim: int) -> Any:
    """theta_i = rope_theta ** (-2i / D), in float32 as transformers and vLLM make it."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _scores(q: Any, k: Any, inv_freq: Any, positions: int) -> Any:
    """Attention logit of a query at p against the key at p - d, for d = 0..positions-1.

    q and k are the per-head vectors after q_norm/k_norm (constant over
    positions); neox RoPE turns channel pair (i, i + D/2) by position * theta_i.
    """
    import torch

    q, k = q.double(), k.double()
    half = q.numel() // 2
    qa, qb, ka, kb = q[:half], q[half:], k[:half], k[half:]
    real = qa * ka + qb * kb
    imag = qb * ka - qa * kb
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    return (torch.cos(angle) @ real - torch.sin(angle) @ imag) / math.sqrt(q.numel())


def _copy_qk(spec: TinySpec) -> tuple[Any, Any, float, float, float]:
    """q_norm and k_norm weights (as stored), rope_theta, freq power, peak score."""
    import torch

    D, M, P = spec.head_dim, spec.max_position_embeddings, spec.copy_period
    assert P is not None
    # Offsets d - (P - 1) of every key a query can see, the target's excluded.
    delta = torch.arange(M, dtype=torch.float64) - (P - 1)
    delta = delta[delta != 0]
    best: tuple[float, float, float] | None = None
    for theta in _COPY_THETAS:
        freq = _rope_inv_freq(theta, D).double()
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
    freq = _rope_inv_freq(theta, D).double()
    weight = freq**power
    weight = weight / weight.sum()
    # q . k / sqrt(D) summed over pairs is the peak score when the pairs align.
    amplitude = torch.sqrt(weight * peak * math.sqrt(D))
    # The key has phase 0, the query is turned back by (P - 1) * theta_i, so
    # the two line up exactly P - 1 positions apart.
    phase = -(P - 1) * freq
    q = torch.cat([amplitude * torch.cos(phase), amplitude * torch.sin(phase)])
    k = torch.cat([amplitude, torch.zeros_like(amplitude)])
    dtype = _torch_dtype(spec.dtype)
    return q.to(dtype), k.to(dtype), theta, power, peak


def _copy_codes(spec: TinySpec, vocab: int) -> tuple[Any, int]:
    """One +/-1 code per token, seeded; no two closer than half the code width."""
    import torch

    c = _code_dims(spec)
    gen = torch.Generator().manual_seed(_tensor_seed(spec.seed, "copy-codes"))
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
    design, _ = _copy_parts(spec, vocab or spec.vocab_size)
    return design


def _copy_parts(spec: TinySpec, vocab: int) -> tuple[CopyDesign, dict[str, Any]]:
    import torch

    q, k, theta, power, peak = _copy_qk(spec)
    scores = _scores(q, k, _rope_inv_freq(theta, spec.head_dim), spec.max_position_embeddings)
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
    return design, {"q_norm": q, "k_norm": k, "codes": codes}


def _copy_entries(
    spec: TinySpec, vocab: int, parts: dict[str, Any], lm_scale: float
) -> list[_Entry]:
    """The copying model's weights (see copy_design and the module docstring).

    Residual stream layout: [code(t): c dims | 1 | copied code: c dims | 0...].
    """
    import torch

    d, D = spec.hidden_size, spec.head_dim
    H, Hkv = spec.num_heads, spec.num_kv_heads
    group = H // Hkv
    codes = parts["codes"]
    c = codes.shape[1]
    one = c  # the constant dimension
    out0 = c + 1  # first dimension of the copied code

    def embed() -> Any:
        w = torch.zeros(vocab, d)
        w[:, :c] = codes
        w[:, one] = 1.0
        return w

    def qk_proj(rows: int) -> Callable[[], Any]:
        # Every head reads only the constant: after q_norm/k_norm that is the
        # norm weight itself, the same vector at every position.
        def make() -> Any:
            w = torch.zeros(rows, d)
            w[:, one] = 1.0
            return w

        return make

    # Code dimension i travels in KV head i % Hkv, channel i // Hkv, so every
    # KV head carries part of the code.
    def v_proj() -> Any:
        w = torch.zeros(Hkv * D, d)
        for i in range(c):
            w[(i % Hkv) * D + i // Hkv, i] = 1.0
        return w

    def o_proj() -> Any:
        w = torch.zeros(d, H * D)
        for h in range(H):
            g = h // group
            for ch in range(D):
                i = ch * Hkv + g
                if i < c:
                    w[out0 + i, h * D + ch] = 1.0 / group
        return w

    def lm_head() -> Any:
        w = torch.zeros(vocab, d)
        w[:, out0 : out0 + c] = codes * lm_scale
        # Special tokens score 0 against a right token near +32: never produced.
        w[: len(SPECIAL_TOKENS)] = 0.0
        return w

    def ones(n: int) -> Callable[[], Any]:
        return lambda: torch.ones(n)

    def zeros(shape: tuple[int, ...]) -> Callable[[], Any]:
        return lambda: torch.zeros(shape)

    makers: dict[str, Callable[[], Any]] = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": ones(d),
        "lm_head.weight": lm_head,
    }
    entries: list[_Entry] = []
    for name, shape in _param_shapes(spec, vocab, tied=False):
        part = name.rsplit(".", 2)[-2]
        make = makers.get(name)
        if make is None:
            make = {
                "input_layernorm": ones(d),
                "post_attention_layernorm": ones(d),
                "q_proj": qk_proj(H * D),
                "k_proj": qk_proj(Hkv * D),
                "v_proj": v_proj,
                "o_proj": o_proj,
                "q_norm": lambda: parts["q_norm"],
                "k_norm": lambda: parts["k_norm"],
            }.get(part, zeros(shape))  # the MLP writes nothing
        entries.append((name, shape, make))
    return entries


def _write_streamed(spec: TinySpec, tokenizer: Any, out: Path) -> dict[str, Any] | None:
    """A dense Qwen3 folder whose weights are written tensor by tensor.

    Returns the copy design's record for a copying model, else None.
    """
    from transformers import GenerationConfig

    vocab = tokenizer.get_vocab_size()
    record = None
    if spec.copy_period is not None:
        for i, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != i:
                raise KilnError(f"tokenizer put {token} at {tokenizer.token_to_id(token)}, not {i}")
        if vocab != spec.vocab_size:
            raise KilnError(f"tokenizer has {vocab} tokens, the spec {spec.vocab_size}")
        design, parts = _copy_parts(spec, vocab)
        record = design.as_json()
        config = _model_config(
            spec,
            tokenizer,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": design.rope_theta},
        )
        entries = _copy_entries(spec, vocab, parts, design.lm_head_scale)
    else:
        config = _model_config(spec, tokenizer)
        entries = _seeded_entries(spec, vocab)
    config.architectures = ["Qwen3ForCausalLM"]
    config.dtype = spec.dtype
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    generation.do_sample = False
    generation.save_pretrained(out)
    _write_safetensors(out / "model.safetensors", entries, spec.dtype)
    return record


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with naming(path):
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def model_folder(out: Path) -> StampedFolder:
    return StampedFolder(out, STAMP, MODEL_FILES, "tiny model")


def build(
    out: Path | None = None,
    hybrid: bool = False,
    corpus: Path = CORPUS,
    spec: TinySpec | None = None,
) -> Path:
    """Write the model ``spec`` describes (default: the tiny one) into ``out``
    (default: under kiln's cache); return it.

    A folder already holding the same fingerprint is reused as it is.
    """
    spec = spec or TinySpec()
    if hybrid:
        spec = replace(spec, hybrid=True)
    validate(spec)
    if not corpus.is_file():
        raise KilnError(f"tokenizer corpus {corpus} is missing")
    out = (out or default_out(spec)).resolve()
    print_ = fingerprint(spec, corpus)
    folder = model_folder(out)
    if folder.holds(print_):
        return out
    folder.check_replaceable()
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise KilnError(
            f"tiny-model needs {', '.join(missing)} in this Python "
            f"({sys.executable}); run it with a vLLM environment's python"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap in whole, so a killed run leaves no
    # half-written folder that a later run could mistake for a model.
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        with naming(tmp):  # what transformers and tokenizers write names no file
            tokenizer = _train_tokenizer(spec, corpus)
            _write_tokenizer(tokenizer, tmp)
            stamp: dict[str, Any] = {
                "fingerprint": print_, "spec": spec_dict(spec), "corpus": corpus.name,
            }
            if spec.init == "transformers" and spec.copy_period is None:
                _write_model(spec, tokenizer, tmp)
            else:
                copy = _write_streamed(spec, tokenizer, tmp)
                if copy is not None:
                    stamp["copy"] = copy
            _write_json(tmp / STAMP, stamp)
            # mkdtemp and the safetensors writer make owner-only files; a model
            # folder is shared (CI users, servers running as another user).
            tmp.chmod(0o755)
            for path in tmp.iterdir():
                path.chmod(0o644)
            folder.replace_with(tmp)
    finally:
        # Never masks the error that ended the build.
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_spec(folder: Path) -> TinySpec:
    """The spec a built folder was made from (its stamp)."""
    record = model_folder(Path(folder)).record()
    if record is None:
        raise KilnError(f"{folder} is not a kiln tiny model folder (no {STAMP})")
    return spec_from_dict(record["spec"])


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


def tree_digest(folder: Path) -> str:
    """sha256 over every file's relative name and bytes: equal trees, equal digest."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------
# A tiny random DFlash2 drafter for a target folder.

DRAFTER_STAMP = "kiln-dflash2-drafter.json"
# Every file a drafter build writes.
DRAFTER_FILES = frozenset({"config.json", "model.safetensors", DRAFTER_STAMP})
DRAFTER_GENERATOR_VERSION = 1


@dataclass(frozen=True)
class DrafterSpec:
    """A random DFlash2 drafter (vLLM's ``DFlash2DraftModel``, method ``dflash``).

    Its embedding and lm_head are the target's (vLLM shares them at load), so the
    drafter's hidden size, heads and vocabulary are the target's; only these vary.
    """

    # Query tokens the drafter was trained on per request: the anchor + block_size - 1
    # mask tokens, so at most block_size - 1 speculative tokens.
    block_size: int = 16
    conv_group_size: int = 16
    conv_kernel_size: int = 3
    selector_rank: int = 8
    selector_top_k: int = 4
    num_layers: int = 1
    # Target layers whose outputs feed the drafter; None: all of them.
    target_layer_ids: tuple[int, ...] | None = None
    # None: the target's pad token.
    mask_token_id: int | None = None
    initializer_range: float = 0.02
    seed: int = 0


DRAFTER_FLAGS = {
    "block_size": "--block-size",
    "conv_group_size": "--conv-group-size",
    "conv_kernel_size": "--conv-kernel-size",
    "selector_rank": "--selector-rank",
    "selector_top_k": "--selector-top-k",
    "num_layers": "--layers",
    "target_layer_ids": "--target-layer-ids",
    "mask_token_id": "--mask-token-id",
}


def _target_config(target: Path) -> dict[str, Any]:
    path = Path(target) / "config.json"
    if not path.is_file():
        raise KilnError(f"--target {target}: no config.json there (pass a model folder)")
    config = json.loads(path.read_text())
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not isinstance(config.get(key), int):
            raise KilnError(f"--target {target}: config.json has no integer {key}")
    return config


def validate_drafter(spec: DrafterSpec, target: dict[str, Any]) -> None:
    """Raise KilnError naming the flag, the value and what is allowed."""
    for name in ("block_size", "conv_group_size", "conv_kernel_size", "selector_rank",
                 "selector_top_k", "num_layers"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KilnError(f"{DRAFTER_FLAGS[name]} {value}: must be a positive whole number")
    hidden = target["hidden_size"]
    if hidden % spec.conv_group_size:
        raise KilnError(
            f"--conv-group-size {spec.conv_group_size}: must divide the hidden size "
            f"{hidden} (the drafter's hidden size is the target's); divisors up to 64: "
            f"{', '.join(str(g) for g in range(1, 65) if hidden % g == 0)}")
    if spec.block_size < 2:
        raise KilnError(f"--block-size {spec.block_size}: must be >= 2 (the anchor and "
                        "at least one mask token)")
    if spec.conv_kernel_size > spec.block_size:
        raise KilnError(f"--conv-kernel-size {spec.conv_kernel_size}: must be at most "
                        f"--block-size ({spec.block_size}); the convolution runs within a block")
    vocab = target["vocab_size"]
    if spec.selector_top_k > vocab:
        raise KilnError(f"--selector-top-k {spec.selector_top_k}: must be at most the "
                        f"target's vocabulary ({vocab})")
    layers = target["num_hidden_layers"]
    ids = spec.target_layer_ids
    if ids is not None:
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= layers:
            raise KilnError(
                f"--target-layer-ids {','.join(map(str, ids))}: must be distinct, "
                f"increasing target layer indices in 0..{layers - 1}")
    mask = spec.mask_token_id
    if mask is not None and not 0 <= mask < vocab:
        raise KilnError(f"--mask-token-id {mask}: must be a token id in 0..{vocab - 1}")


def _drafter_layout(spec: DrafterSpec, target: dict[str, Any]) -> dict[str, Any]:
    heads = target["num_attention_heads"]
    hidden = target["hidden_size"]
    ids = list(spec.target_layer_ids or range(target["num_hidden_layers"]))
    mask = spec.mask_token_id
    if mask is None:
        mask = target.get("pad_token_id") or 0
    return dict(
        hidden=hidden, heads=heads, kv_heads=target.get("num_key_value_heads") or heads,
        head_dim=target.get("head_dim") or hidden // heads,
        intermediate=target.get("intermediate_size") or 2 * hidden,
        vocab=target["vocab_size"], target_layer_ids=ids, mask_token_id=mask,
        groups=hidden // spec.conv_group_size,
    )


def drafter_config(spec: DrafterSpec, target: dict[str, Any]) -> dict[str, Any]:
    """The drafter's config.json: a Qwen3 config with vLLM's DFlash2 keys."""
    lay = _drafter_layout(spec, target)
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": lay["hidden"],
        "intermediate_size": lay["intermediate"],
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": lay["heads"],
        "num_key_value_heads": lay["kv_heads"],
        "head_dim": lay["head_dim"],
        "vocab_size": lay["vocab"],
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": target.get("dtype") or target.get("torch_dtype") or "bfloat16",
        "dflash_config": {
            "block_size": spec.block_size,
            "conv_group_size": spec.conv_group_size,
            "conv_kernel_size": spec.conv_kernel_size,
            "mask_token_id": lay["mask_token_id"],
            "target_layer_ids": lay["target_layer_ids"],
            "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k,
        },
    }
    if "rope_parameters" in target:
        config["rope_parameters"] = target["rope_parameters"]
    return config


def drafter_shapes(spec: DrafterSpec, target: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the drafter's checkpoint, named as DFlash checkpoints name them
    (no ``model.`` prefix; vLLM's loader adds it), with no embedding or lm_head."""
    lay = _drafter_layout(spec, target)
    d, D, taps = lay["hidden"], lay["head_dim"], spec.conv_kernel_size
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (lay["heads"] * D, d)),
            (p + "self_attn.k_proj.weight", (lay["kv_heads"] * D, d)),
            (p + "self_attn.v_proj.weight", (lay["kv_heads"] * D, d)),
            (p + "self_attn.o_proj.weight", (d, lay["heads"] * D)),
            (p + "self_attn.q_norm.weight", (D,)),
            (p + "self_attn.k_norm.weight", (D,)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (lay["intermediate"], d)),
            (p + "mlp.up_proj.weight", (lay["intermediate"], d)),
            (p + "mlp.down_proj.weight", (d, lay["intermediate"])),
        ]
        for conv in ("attention_conv", "mlp_conv"):
            shapes += [
                (p + f"{conv}.base_kernel", (2, taps, d)),
                (p + f"{conv}.kernel_projection.weight", (2 * taps * lay["groups"], d)),
            ]
    shapes += [
        ("fc.weight", (d, d * len(lay["target_layer_ids"]))),
        ("hidden_norm.weight", (d,)),
        ("norm.weight", (d,)),
        ("candidate_selector.predecessor_codebook", (lay["vocab"], spec.selector_rank)),
        ("candidate_selector.successor_codebook", (lay["vocab"], spec.selector_rank)),
        ("candidate_selector.hidden_projection.weight", (spec.selector_rank, d)),
    ]
    return shapes


def _drafter_entries(spec: DrafterSpec, target: dict[str, Any]) -> list[_Entry]:
    """Norm weights one; the first tap of each convolution's base kernel one (so a
    block position starts from its own input); the rest normal(0, range), seeded
    per tensor."""
    import torch

    def make(name: str, shape: tuple[int, ...]) -> Callable[[], Any]:
        if name.endswith("norm.weight"):
            return lambda: torch.ones(shape)

        def draw() -> Any:
            gen = torch.Generator().manual_seed(_tensor_seed(spec.seed, "dflash2:" + name))
            out = torch.empty(shape).normal_(0.0, spec.initializer_range, generator=gen)
            if name.endswith("base_kernel"):
                out[:, 0] += 1.0
            return out

        return draw

    return [(n, s, make(n, s)) for n, s in drafter_shapes(spec, target)]


def drafter_folder(out: Path) -> StampedFolder:
    return StampedFolder(out, DRAFTER_STAMP, DRAFTER_FILES, "DFlash2 drafter")


def drafter_fingerprint(spec: DrafterSpec, target_config_bytes: bytes) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    h.update(target_config_bytes)
    h.update(json.dumps(_versions(), sort_keys=True).encode())
    h.update(f"drafter-{DRAFTER_GENERATOR_VERSION}".encode())
    return h.hexdigest()[:16]


def build_dflash2_drafter(target: Path, out: Path | None = None,
                          spec: DrafterSpec | None = None) -> Path:
    """Write a random DFlash2 drafter for the model in ``target`` into ``out``
    (default: under kiln's cache); return it. Reused when already built."""
    spec = spec or DrafterSpec()
    target = Path(target)
    config_path = target / "config.json"
    target_config = _target_config(target)
    validate_drafter(spec, target_config)
    print_ = drafter_fingerprint(spec, config_path.read_bytes())
    out = (out or cache_dir() / "tiny-model" / f"dflash2-{print_}").resolve()
    folder = drafter_folder(out)
    if folder.holds(print_):
        return out
    folder.check_replaceable()
    if importlib.util.find_spec("torch") is None:
        raise KilnError(f"the drafter needs torch in this Python ({sys.executable})")
    dtype = str(target_config.get("dtype") or target_config.get("torch_dtype") or "bfloat16")
    if dtype not in DTYPES:
        raise KilnError(f"--target {target}: dtype {dtype} is not one of {', '.join(DTYPES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".drafter-", dir=out.parent))
    try:
        _write_json(tmp / "config.json", drafter_config(spec, target_config))
        _write_safetensors(tmp / "model.safetensors", _drafter_entries(spec, target_config),
                           dtype)
        _write_json(tmp / DRAFTER_STAMP, {"fingerprint": print_, "spec": asdict(spec),
                                          "target": str(target.resolve())})
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        folder.replace_with(tmp)
    finally:
        # Never masks the error that ended the build.
        shutil.rmtree(tmp, ignore_errors=True)
    return out

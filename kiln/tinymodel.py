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
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.paths import REPO_ROOT, cache_dir

CORPUS = REPO_ROOT / "tests" / "e2e" / "data" / "corpus.txt"
STAMP = "kiln-tiny-model.json"
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
    init: str = "transformers"


_LATER_DEFAULTS = {"dtype": "float32", "init": "transformers"}

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
        num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
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


def spec_dict(spec: TinySpec) -> dict[str, Any]:
    """The spec as recorded in the fingerprint and the stamp."""
    data = asdict(spec)
    for name, default in _LATER_DEFAULTS.items():
        if data[name] == default:
            del data[name]
    return data


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
    kind = "hybrid" if spec.hybrid else "dense"
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
# Weights written tensor by tensor: the seeded init.

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
    with path.open("wb") as f:
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
    shapes = _param_shapes(spec, vocab or spec.vocab_size, tied=True)
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


def _write_streamed(spec: TinySpec, tokenizer: Any, out: Path) -> None:
    """A dense Qwen3 folder whose weights are written tensor by tensor."""
    from transformers import GenerationConfig

    vocab = tokenizer.get_vocab_size()
    config = _model_config(spec, tokenizer)
    entries = _seeded_entries(spec, vocab)
    config.architectures = ["Qwen3ForCausalLM"]
    config.dtype = spec.dtype
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    generation.do_sample = False
    generation.save_pretrained(out)
    _write_safetensors(out / "model.safetensors", entries, spec.dtype)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _stamp_matches(out: Path, print_: str) -> bool:
    stamp = out / STAMP
    if not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get("fingerprint") == print_
    except json.JSONDecodeError:
        return False


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
    if _stamp_matches(out, print_):
        return out
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise KilnError(
            f"tiny-model needs {', '.join(missing)} in this Python "
            f"({sys.executable}); run it with a vLLM environment's python"
        )
    if out.exists() and any(out.iterdir()) and not (out / STAMP).is_file():
        raise KilnError(
            f"{out} exists and is not a kiln tiny model folder; "
            "pass an empty or new folder to --out"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap in whole, so a killed run leaves no
    # half-written folder that a later run could mistake for a model.
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        tokenizer = _train_tokenizer(spec, corpus)
        _write_tokenizer(tokenizer, tmp)
        stamp: dict[str, Any] = {
            "fingerprint": print_, "spec": spec_dict(spec), "corpus": corpus.name,
        }
        if spec.init == "transformers":
            _write_model(spec, tokenizer, tmp)
        else:
            _write_streamed(spec, tokenizer, tmp)
        _write_json(tmp / STAMP, stamp)
        # mkdtemp and the safetensors writer make owner-only files; a model
        # folder is shared (CI users, servers running as another user).
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def tree_digest(folder: Path) -> str:
    """sha256 over every file's relative name and bytes: equal trees, equal digest."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()

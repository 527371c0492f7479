"""A tiny Qwen3-architecture model made locally and deterministically: no hub.

Random weights from a fixed seed and a small byte-level BPE tokenizer trained on
a text file shipped in the repository, with a ChatML chat template. The same
inputs give the same bytes, so a built folder is cached by a fingerprint of
what went into it. torch, transformers and tokenizers are imported inside the
functions that need them: kiln itself imports with the standard library only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
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
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
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


def _model_config(spec: TinySpec, tokenizer: Any) -> Any:
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


def _write_model(spec: TinySpec, tokenizer: Any, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = _model_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


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


def build(out: Path | None = None, hybrid: bool = False, corpus: Path = CORPUS) -> Path:
    """Write the tiny model into ``out`` (default: under kiln's cache); return it.

    A folder already holding the same fingerprint is reused as it is.
    """
    spec = TinySpec(hybrid=hybrid)
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
        _write_model(spec, tokenizer, tmp)
        _write_json(
            tmp / STAMP,
            {"fingerprint": print_, "spec": asdict(spec), "corpus": corpus.name},
        )
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

"""Building a trained reference folder: the fingerprint that names it, and the
build, written into a temporary folder beside it and renamed in whole.

The folder holds config.json, generation_config.json, model.safetensors (bf16), the
tokenizer files and a stamp (``kiln-trained-model.json``) recording the spec, the
held-out files (path, size, sha256) the evaluation reads, and the loss record.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, naming
from kiln.paths import cache_dir
from kiln.testing.tinymodel.folder import NEEDS, library_versions, write_json
from kiln.testing.tinymodel.stampedfolder import StampedFolder
from kiln.testing.tinymodel.tokenizer import write_tokenizer
from kiln.testing.trained.corpus import Corpus, SourceFile, corpus_digest, load_corpus, stdlib_root
from kiln.testing.trained.data import token_stream
from kiln.testing.trained.spec import TrainSpec, spec_dict, spec_from_dict, validate
from kiln.testing.trained.tokenizer import separator_id, train_tokenizer

STAMP = "kiln-trained-model.json"
# Bump when the builder changes what it writes for the same inputs.
GENERATOR_VERSION = 1


def fingerprint(name: str, spec: TrainSpec, corpus: Corpus) -> str:
    """Hash of the preset and its spec, both splits' files, the library versions and
    this generator."""
    h = hashlib.sha256()
    h.update(json.dumps({"preset": name, "spec": spec_dict(spec)}, sort_keys=True).encode())
    h.update(corpus_digest(corpus.train).encode())
    h.update(corpus_digest(corpus.held_out).encode())
    h.update(json.dumps(library_versions(), sort_keys=True).encode())
    h.update(str(GENERATOR_VERSION).encode())
    return h.hexdigest()[:16]


def _stamped(folder: Path) -> StampedFolder:
    return StampedFolder(folder, STAMP, frozenset(), "trained model", "trained-model")


def read_stamp(folder: Path) -> dict[str, Any] | None:
    record = _stamped(folder).record()
    if record is not None and "fingerprint" not in record:
        raise KilnError(f"{folder / STAMP}: not the record trained-model writes")
    return record


def held_out_files(folder: Path) -> tuple[Path, tuple[SourceFile, ...]]:
    """The library root and held-out files a trained folder records."""
    record = read_stamp(folder)
    if record is None:
        raise KilnError(f"{folder} is not a kiln trained model folder (no {STAMP})")
    files = tuple(SourceFile(**f) for f in record["held_out"])
    return Path(record["corpus_root"]), files


def trained_spec(folder: Path) -> TrainSpec:
    record = read_stamp(folder)
    if record is None:
        raise KilnError(f"{folder} is not a kiln trained model folder (no {STAMP})")
    return spec_from_dict(record["spec"])


def _check_libraries() -> None:
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise KilnError(f"trained-model needs {', '.join(missing)} in this Python "
                        f"({sys.executable}); run it with a vLLM environment's python")


def _write(name: str, spec: TrainSpec, corpus: Corpus, print_: str, out: Path) -> None:
    from transformers import GenerationConfig

    from kiln.testing.trained.train import train

    train_texts = [corpus.read(f) for f in corpus.train]
    print(f"tokenizer: byte-level BPE, {spec.vocab_size} tokens, on {len(train_texts)} files "
          f"({sum(f.size for f in corpus.train)} bytes)", flush=True)
    tokenizer = train_tokenizer(train_texts, spec.vocab_size)
    write_tokenizer(tokenizer, out)
    stream = token_stream(tokenizer, train_texts, separator_id(tokenizer))
    model, log = train(spec, tokenizer, stream)
    import torch

    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    write_json(out / STAMP, {
        "fingerprint": print_,
        "preset": name,
        "spec": spec_dict(spec),
        "corpus_root": str(corpus.root),
        "train_files": len(corpus.train),
        "train_bytes": sum(f.size for f in corpus.train),
        "train_tokens": len(stream),
        "held_out": [vars(f) for f in corpus.held_out],
        "loss": {"steps": list(log.steps), "values": list(log.losses)},
    })


def default_parent() -> Path:
    return cache_dir() / "trained-model"


def build(name: str, spec: TrainSpec, parent: Path | None = None,
          root: Path | None = None) -> Path:
    """Train the model ``spec`` describes on ``root``'s sources (default: this Python's
    standard library) into ``parent``/``<name>-<fingerprint>`` (default parent: under
    kiln's cache) and return that folder; a folder already there is reused."""
    validate(spec)
    corpus = load_corpus(root or stdlib_root(), spec.corpus_bytes)
    print_ = fingerprint(name, spec, corpus)
    parent = (parent or default_parent()).resolve()
    if parent.exists() and not parent.is_dir():
        raise KilnError(f"{parent} is a file, not a folder; pass a folder to --out")
    out = parent / f"{name}-{print_}"
    if out.exists():
        if not _stamped(out).holds(print_):
            raise KilnError(f"{out} exists and is not this trained model; move it away")
        print(f"reusing {out}", flush=True)
        return out
    _check_libraries()
    parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed whole, so a killed run leaves no
    # half-written folder that a later run could take for a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=parent))
    try:
        with naming(tmp):  # what transformers and tokenizers write names no file
            _write(name, spec, corpus, print_, tmp)
        _stamped(out).replace_with(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # never masks the error that ended the build
    return out

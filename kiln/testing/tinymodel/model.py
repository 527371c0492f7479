"""Building a tiny model folder: the fingerprint that names and reuses it, and the
build itself, written beside the target and swapped in whole.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, naming
from kiln.paths import cache_dir
from kiln.testing.tinymodel.copymodel import copy_entries, copy_parts
from kiln.testing.tinymodel.dense import model_config, seeded_entries, write_model
from kiln.testing.tinymodel.folder import NEEDS, STAMP, library_versions, model_folder, write_json
from kiln.testing.tinymodel.hybrid import hybrid_entries
from kiln.testing.tinymodel.hybridcopy import hybrid_copy_entries
from kiln.testing.tinymodel.spec import HYBRID_ROTARY_FRACTION, TinySpec, spec_dict, validate
from kiln.testing.tinymodel.tensors import write_safetensors
from kiln.testing.tinymodel.tokenizer import CORPUS, SPECIAL_TOKENS, train_tokenizer, write_tokenizer

# Bump when the generator changes what it writes for the same spec.
GENERATOR_VERSION = 1


def fingerprint(spec: TinySpec, corpus: Path = CORPUS) -> str:
    """Hash of the spec, the corpus, the library versions and this generator."""
    h = hashlib.sha256()
    h.update(json.dumps(spec_dict(spec), sort_keys=True).encode())
    h.update(corpus.read_bytes())
    h.update(json.dumps(library_versions(), sort_keys=True).encode())
    h.update(str(GENERATOR_VERSION).encode())
    return h.hexdigest()[:16]


def default_out(spec: TinySpec) -> Path:
    kinds = {(False, False): "dense", (False, True): "copy", (True, False): "hybrid",
             (True, True): "hybrid-copy"}
    kind = kinds[spec.hybrid, spec.copy_period is not None]
    return cache_dir() / "tiny-model" / f"{kind}-{fingerprint(spec)}"


def streamed_config(spec: TinySpec, tokenizer: Any, **extra: Any) -> Any:
    """The config a streamed build writes: model_config's, with the architecture
    vLLM loads and the weights' dtype."""
    config = model_config(spec, tokenizer, **extra)
    config.architectures = ["Qwen3_5ForCausalLM" if spec.hybrid else "Qwen3ForCausalLM"]
    config.dtype = spec.dtype
    return config


def _write_streamed(spec: TinySpec, tokenizer: Any, out: Path) -> dict[str, Any] | None:
    """A dense Qwen3 or a Qwen3.5 hybrid folder whose weights are written tensor by
    tensor.

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
        design, parts = copy_parts(spec, vocab)
        record = design.as_json()
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": design.rope_theta}
        if spec.hybrid:
            rope["partial_rotary_factor"] = HYBRID_ROTARY_FRACTION
        config = streamed_config(spec, tokenizer, tie_word_embeddings=False,
                                 rope_parameters=rope)
        write = hybrid_copy_entries if spec.hybrid else copy_entries
        entries = write(spec, vocab, parts, design.lm_head_scale)
    else:
        config = streamed_config(spec, tokenizer)
        entries = hybrid_entries(spec, vocab) if spec.hybrid else seeded_entries(spec, vocab)
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    generation.do_sample = False
    generation.save_pretrained(out)
    write_safetensors(out / "model.safetensors", entries, spec.dtype)
    return record


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
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
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
            tokenizer = train_tokenizer(spec, corpus)
            write_tokenizer(tokenizer, tmp)
            stamp: dict[str, Any] = {
                "fingerprint": print_, "spec": spec_dict(spec), "corpus": corpus.name,
            }
            if spec.init == "transformers" and spec.copy_period is None:
                write_model(spec, tokenizer, tmp)
            else:
                copy = _write_streamed(spec, tokenizer, tmp)
                if copy is not None:
                    stamp["copy"] = copy
            write_json(tmp / STAMP, stamp)
            folder.replace_with(tmp)
    finally:
        # Never masks the error that ended the build.
        shutil.rmtree(tmp, ignore_errors=True)
    return out

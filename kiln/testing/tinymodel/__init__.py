"""Tiny Qwen3-architecture models made locally and deterministically, no hub: random
weights from a fixed seed (transformers' own init, or a generator per tensor streamed
to disk for large sizes, dense Qwen3 or a Qwen3.5 hybrid with MTP), a copying model
(dense or hybrid) with constructed weights whose greedy answer is known in advance, a random DFlash2
drafter for a target folder, and a byte-level BPE tokenizer trained on this package's
``corpus.txt``. The same inputs give the same bytes, so a built folder is cached by a
fingerprint of what went into it. torch, transformers and tokenizers are imported
inside the functions that need them, so kiln imports with the standard library only.
What callers use is exported here; the modules split it by job (spec, tokenizer,
tensors, dense, hybrid, copymodel, hybridcopy, drafter, folder, model).
"""

from kiln.testing.tinymodel.copymodel import COPY_MIN_MARGIN, CopyDesign, copy_continuation, copy_design, copy_prompt
from kiln.testing.tinymodel.dense import param_count
from kiln.testing.tinymodel.drafter import (
    DRAFTER_STAMP,
    DrafterSpec,
    build_dflash2_drafter,
    validate_drafter,
)
from kiln.testing.tinymodel.folder import STAMP, read_spec, tree_digest
from kiln.testing.tinymodel.hybrid import hybrid_param_shapes
from kiln.testing.tinymodel.model import build, fingerprint
from kiln.testing.tinymodel.spec import (
    DEFAULT_COPY_PERIOD,
    DEVICES,
    DTYPES,
    INITS,
    PRESETS,
    TinySpec,
    attention_layers,
    layer_types,
    preset,
    validate,
)
from kiln.testing.tinymodel.tokenizer import CORPUS, SPECIAL_TOKENS

__all__ = [
    "COPY_MIN_MARGIN", "CORPUS", "CopyDesign", "DEFAULT_COPY_PERIOD", "DEVICES",
    "DRAFTER_STAMP", "DTYPES", "DrafterSpec", "INITS", "PRESETS", "SPECIAL_TOKENS", "STAMP",
    "TinySpec", "attention_layers", "build", "build_dflash2_drafter", "copy_continuation",
    "copy_design", "copy_prompt", "fingerprint", "hybrid_param_shapes", "layer_types",
    "param_count", "preset", "read_spec", "tree_digest", "validate", "validate_drafter",
]

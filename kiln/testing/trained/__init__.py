"""Small Qwen3-architecture models trained locally on the running Python's standard
library, so quality measurements (KV-cache dtypes against bf16) have a model with
learned, not random, attention. A folder is named by the hash of what went into it
and reused. torch, transformers and tokenizers are imported inside the functions
that need them, so kiln imports with the standard library only. The modules split
the job: spec (sizes), corpus (files and split), tokenizer, data (token streams and
batches), train (the loop), build (fingerprint and folder), and for the evaluation
windows, metrics, needle and table.
"""

from kiln.testing.trained.build import STAMP, build, fingerprint, held_out_files, read_stamp, trained_spec
from kiln.testing.trained.corpus import Corpus, SourceFile, check_held_out, is_held_out, load_corpus, stdlib_root
from kiln.testing.trained.spec import DEVICES, PRESETS, TrainSpec, preset, validate

__all__ = [
    "DEVICES", "PRESETS", "STAMP", "Corpus", "SourceFile", "TrainSpec", "build", "check_held_out",
    "fingerprint", "held_out_files", "is_held_out", "load_corpus", "preset", "read_stamp",
    "stdlib_root", "trained_spec", "validate",
]

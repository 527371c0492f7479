"""The model's own byte-level BPE tokenizer, trained on the training split with the
``tokenizers`` library and saved the way the tiny models' is (tokenizer.json and its
config, so vLLM and transformers load it). Imported only when training.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiln.testing.tinymodel.tokenizer import END_OF_TEXT, SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every string encodes, nothing maps to an unknown token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def separator_id(tokenizer: Any) -> int:
    """The token between two files in the token stream."""
    return tokenizer.token_to_id(END_OF_TEXT)

"""Training data: a byte-level :class:`Tokenizer`, a synthetic corpus generated
from code (:func:`build_corpus`) and data-parallel sharded next-token batches
(:func:`build_dataloader`). Nothing is downloaded."""

from torchtitan_spmd.data.corpus import DEFAULT_CORPUS_CHARS, build_corpus
from torchtitan_spmd.data.loader import (
    ShardedBatchIterator,
    build_block,
    build_dataloader,
    build_token_stream,
)
from torchtitan_spmd.data.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_CORPUS_CHARS",
    "ShardedBatchIterator",
    "Tokenizer",
    "build_block",
    "build_corpus",
    "build_dataloader",
    "build_token_stream",
]

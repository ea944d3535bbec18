"""Training data: a byte-level :class:`Tokenizer` or a Hugging Face one
(:class:`HuggingFaceTokenizer`, ``hf_assets_path``), a synthetic corpus generated
from code (:func:`build_corpus`) or local text files (:func:`load_documents`,
``dataloader.dataset``), and data-parallel sharded next-token batches
(:func:`build_dataloader`). Nothing is downloaded; ``tokenizers`` and ``datasets`` are
imported only when a Hugging Face tokenizer or a file dataset is asked for."""

from torchtitan_spmd.data.corpus import DEFAULT_CORPUS_CHARS, build_corpus
from torchtitan_spmd.data.hf_datasets import PackedTextIterator, load_documents
from torchtitan_spmd.data.hf_tokenizer import (
    HuggingFaceTokenizer,
    build_tokenizer,
    check_vocab_size,
)
from torchtitan_spmd.data.loader import (
    ShardedBatchIterator,
    build_block,
    build_dataloader,
    build_token_stream,
)
from torchtitan_spmd.data.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_CORPUS_CHARS",
    "HuggingFaceTokenizer",
    "PackedTextIterator",
    "ShardedBatchIterator",
    "Tokenizer",
    "build_block",
    "build_corpus",
    "build_dataloader",
    "build_token_stream",
    "build_tokenizer",
    "check_vocab_size",
    "load_documents",
]

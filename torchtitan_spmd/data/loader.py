"""Data-parallel sharded next-token batches over the synthetic corpus.

The data is an endless series of *blocks*. Block ``b`` is the corpus of
:func:`~torchtitan_spmd.data.corpus.build_corpus` drawn from ``(seed, b)`` alone
(``block=b``), tokenized document by document as ``[BOS] + bytes + [EOS]``,
concatenated, and cut into ``W = windows_per_block(seq_len)`` consecutive *windows*
of ``seq_len + 1`` tokens (about :data:`BLOCK_TOKENS` tokens; the rest of the block
is dropped). A window gives one
sample: ``input_ids = window[:-1]``, ``labels = window[1:]``. Documents are drawn
independently, so the windows need no shuffling.

Samples are numbered globally: sample ``k`` is window ``k % W`` of block ``k // W``. So what a sample holds depends only on the seed,
``seq_len`` and its number -- not on the number of steps of the run, nor on the
layout -- and a block is generated only when first read (start-up costs one block).
With ``G = local_batch_size * dp_degree``, the global batch of step ``t`` is global
samples ``t*G .. t*G + G - 1`` and rank ``r`` reads the rank-major slice
``t*G + r*B .. t*G + (r+1)*B - 1``. Therefore the concatenation over ranks of
the local batches equals the batch of
``build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=G, ...)``, so a
single-process reference sees exactly what ``dp_degree`` ranks see together.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from torchtitan_spmd.data.corpus import DEFAULT_CORPUS_CHARS, build_corpus
from torchtitan_spmd.data.position import steps_read
from torchtitan_spmd.data.tokenizer import Tokenizer

__all__ = [
    "BLOCK_TOKENS",
    "ShardedBatchIterator",
    "build_block",
    "build_dataloader",
    "build_token_stream",
    "windows_per_block",
]

#: About how many tokens one generated block of the data holds (a few ms to generate).
BLOCK_TOKENS = 1 << 15


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _stream(seed: int, n_chars: int, block: int | None) -> torch.Tensor:
    tok = Tokenizer()
    ids: list[int] = []
    for doc in build_corpus(seed, n_chars, block=block).splitlines():
        ids.append(tok.bos_id)
        ids.extend(doc.encode("utf-8"))
        ids.append(tok.eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def build_token_stream(seed: int = 0, n_chars: int = DEFAULT_CORPUS_CHARS) -> torch.Tensor:
    """The corpus of ``(seed, n_chars)`` as one int64 token stream (a fresh copy).

    Every document becomes ``[BOS] + utf8 bytes + [EOS]``.
    """
    _check_int("seed", seed, 0)
    _check_int("n_chars", n_chars, 1)
    return _stream(seed, n_chars, None)


def windows_per_block(seq_len: int) -> int:
    """How many samples of ``seq_len`` tokens one block holds (at least one)."""
    return max(1, BLOCK_TOKENS // (seq_len + 1))


@functools.lru_cache(maxsize=8)
def _cached_block(seed: int, window: int, block: int) -> torch.Tensor:
    n = windows_per_block(window - 1) * window
    stream = _stream(seed, n, block)  # at least one token per character
    return stream[:n].view(-1, window)


def build_block(seed: int, seq_len: int, block: int) -> torch.Tensor:
    """Block ``block`` of the data: int64 ``[windows_per_block(seq_len), seq_len + 1]`` (a fresh copy).

    Row ``i`` is global sample ``block * windows_per_block(seq_len) + i``; the rows are
    consecutive stretches of the block's token stream (documents as in
    :func:`build_token_stream`) over ``build_corpus(seed, rows * (seq_len + 1), block=block)``.
    """
    _check_int("seed", seed, 0)
    _check_int("seq_len", seq_len, 1)
    _check_int("block", block, 0)
    return _cached_block(seed, seq_len + 1, block).clone()


class ShardedBatchIterator(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """Infinite iterator of ``(input_ids, labels)``, each int64 ``[local_batch_size, seq_len]``.

    Built by :func:`build_dataloader`. ``step`` is the number of batches already
    yielded; :meth:`state_dict`/:meth:`load_state_dict` save and restore the position
    (a checkpoint's ``dataloader`` entry).
    """

    def __init__(self, *, dp_rank: int, dp_degree: int, local_batch_size: int, seq_len: int,
                 seed: int) -> None:
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.local_batch_size = local_batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.step = 0

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all data-parallel ranks."""
        return self.local_batch_size * self.dp_degree

    def _samples(self, first: int, count: int) -> torch.Tensor:
        rows, per_block = [], windows_per_block(self.seq_len)
        for k in range(first, first + count):
            block, row = divmod(k, per_block)
            rows.append(_cached_block(self.seed, self.seq_len + 1, block)[row])
        return torch.stack(rows)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.step * self.global_batch_size + self.dp_rank * self.local_batch_size
        batch = self._samples(first, self.local_batch_size)
        self.step += 1
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def __iter__(self) -> ShardedBatchIterator:
        return self

    def state_dict(self) -> dict[str, int]:
        """``{"step": batches read, "samples": global samples read}`` (the same on every rank)."""
        return {"step": self.step, "samples": self.step * self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a :meth:`state_dict`, also one saved with another data-parallel layout.

        The position is the number of global samples read; it must be a whole number of
        this iterator's global batches (``ValueError`` naming both otherwise).
        """
        step = state["step"]
        _check_int("step", step, 0)
        samples = state.get("samples", step * self.global_batch_size)
        _check_int("samples", samples, 0)
        self.step = steps_read(samples, self.local_batch_size, self.dp_degree)


def build_dataloader(
    *,
    dp_rank: int,
    dp_degree: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
    dataset: str = "synthetic",
    dataset_path: str | None = None,
    tokenizer: Any = None,
    infinite: bool = True,
    documents: Any = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's iterator of ``(input_ids, labels)`` (endless unless ``infinite=False``).

    Both tensors are int64 ``[local_batch_size, seq_len]``; ``labels`` is
    ``input_ids`` shifted left by one token (next-token prediction). See the
    module docstring for the sharding contract: the data depends only on ``seed``,
    ``seq_len`` and the position.

    Args:
        dp_rank: this rank, ``0 <= dp_rank < dp_degree``.
        dp_degree: number of data-parallel ranks (>= 1).
        local_batch_size: samples per rank per step (>= 1).
        seq_len: tokens per sample (>= 1).
        seed: corpus seed (>= 0).
        dataset, dataset_path: ``dataloader.dataset`` / ``dataloader.dataset_path``: the synthetic
            data (:class:`ShardedBatchIterator`, byte-level) or local files
            (:class:`~torchtitan_spmd.data.hf_datasets.PackedTextIterator`, same sharding
            contract, tokenised with ``tokenizer``).
        tokenizer: for a file dataset (None: the byte tokenizer). The synthetic data is
            byte-level: any other tokenizer is an error.
        infinite: False: one pass over a file dataset, then ``StopIteration``
            (:class:`~torchtitan_spmd.data.hf_datasets.PackedTextIterator`); the synthetic data is
            an endless stream, so ``infinite=False`` with it is an error.
        documents: a file dataset's documents already read (:func:`load_documents` of ``dataset``
            and ``dataset_path``), to build a fresh loader without reading the files again.

    Raises:
        ValueError: a bad argument; the message names it and its value.
    """
    _check_int("dp_degree", dp_degree, 1)
    _check_int("dp_rank", dp_rank, 0)
    if dp_rank >= dp_degree:
        raise ValueError(f"dp_rank must be < dp_degree={dp_degree}, got {dp_rank!r}")
    _check_int("local_batch_size", local_batch_size, 1)
    _check_int("seq_len", seq_len, 1)
    _check_int("seed", seed, 0)
    if dataset == "synthetic":
        if not infinite:
            raise ValueError("the synthetic data (dataloader.dataset='synthetic') is an endless stream, generated "
                             "from the seed: it has no end for one pass over it (infinite=False); use a file "
                             "dataset ('json', 'text', 'parquet' or 'c4_test').")
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise ValueError("the synthetic data (dataloader.dataset='synthetic') is byte-level; a tokenizer from "
                             f"hf_assets_path={getattr(tokenizer, 'path', None)!r} needs a text dataset: set "
                             "dataloader.dataset ('json', 'text', 'parquet' or 'c4_test') and dataloader.dataset_path.")
        return ShardedBatchIterator(dp_rank=dp_rank, dp_degree=dp_degree, local_batch_size=local_batch_size,
                                    seq_len=seq_len, seed=seed)
    from torchtitan_spmd.data.hf_datasets import PackedTextIterator, load_documents

    if documents is None:
        documents = load_documents(dataset, dataset_path)
    return PackedTextIterator(documents, tokenizer if tokenizer is not None else Tokenizer(), dp_rank=dp_rank,
                              dp_degree=dp_degree, local_batch_size=local_batch_size, seq_len=seq_len,
                              name=f"dataloader.dataset={dataset!r} at {dataset_path!r}", infinite=infinite)

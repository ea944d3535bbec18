"""Data-parallel sharded next-token batches over the synthetic corpus.

The corpus of :func:`~torchtitan_spmd.data.corpus.build_corpus` is tokenized
document by document as ``[BOS] + bytes + [EOS]`` and concatenated into one
token stream, which is cut into non-overlapping *windows* of ``seq_len + 1``
tokens (the tail shorter than a window is dropped). A window gives one sample:
``input_ids = window[:-1]``, ``labels = window[1:]``.

Samples are numbered globally. Epoch ``e`` visits the windows in a fixed
permutation seeded by ``(seed, e)``, and wraps around forever. With
``G = local_batch_size * dp_degree``, the global batch of step ``t`` is global
samples ``t*G .. t*G + G - 1`` and rank ``r`` reads the rank-major slice
``t*G + r*B .. t*G + (r+1)*B - 1``. Therefore the concatenation over ranks of
the local batches equals the batch of
``build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=G, ...)``, so a
single-process reference sees exactly what ``dp_degree`` ranks see together.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from torchtitan_spmd.data.corpus import DEFAULT_CORPUS_CHARS, build_corpus
from torchtitan_spmd.data.tokenizer import Tokenizer

__all__ = ["ShardedBatchIterator", "build_dataloader", "build_token_stream"]


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@functools.lru_cache(maxsize=4)
def _cached_stream(seed: int, n_chars: int) -> torch.Tensor:
    tok = Tokenizer()
    ids: list[int] = []
    for doc in build_corpus(seed, n_chars).splitlines():
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
    return _cached_stream(seed, n_chars).clone()


def _epoch_permutation(seed: int, epoch: int, n_windows: int) -> torch.Tensor:
    digest = hashlib.blake2b(f"data/{seed}/{epoch}".encode(), digest_size=8).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randperm(n_windows, generator=gen)


class ShardedBatchIterator(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """Infinite iterator of ``(input_ids, labels)``, each int64 ``[local_batch_size, seq_len]``.

    Built by :func:`build_dataloader`. ``step`` is the number of batches already
    yielded; :meth:`state_dict`/:meth:`load_state_dict` save and restore it.
    """

    def __init__(
        self,
        *,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
        seq_len: int,
        seed: int,
        corpus_chars: int,
    ) -> None:
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.local_batch_size = local_batch_size
        self.seq_len = seq_len
        self.seed = seed
        stream = _cached_stream(seed, corpus_chars)
        window = seq_len + 1
        self.n_windows = stream.numel() // window
        self._windows = stream[: self.n_windows * window].view(self.n_windows, window)
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)
        self.step = 0

    def _window_ids(self, first: int, count: int) -> torch.Tensor:
        ids = []
        for k in range(first, first + count):
            epoch, pos = divmod(k, self.n_windows)
            if epoch != self._perm_epoch:
                self._perm = _epoch_permutation(self.seed, epoch, self.n_windows)
                self._perm_epoch = epoch
            ids.append(int(self._perm[pos]))
        return torch.tensor(ids, dtype=torch.int64)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        global_batch = self.local_batch_size * self.dp_degree
        first = self.step * global_batch + self.dp_rank * self.local_batch_size
        batch = self._windows[self._window_ids(first, self.local_batch_size)]
        self.step += 1
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def __iter__(self) -> ShardedBatchIterator:
        return self

    def state_dict(self) -> dict[str, int]:
        """``{"step": ...}``: enough to resume the same sequence of batches."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a :meth:`state_dict`."""
        step = state["step"]
        _check_int("step", step, 0)
        self.step = step


def build_dataloader(
    *,
    dp_rank: int,
    dp_degree: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
    corpus_chars: int = DEFAULT_CORPUS_CHARS,
) -> ShardedBatchIterator:
    """This data-parallel rank's infinite iterator of ``(input_ids, labels)``.

    Both tensors are int64 ``[local_batch_size, seq_len]``; ``labels`` is
    ``input_ids`` shifted left by one token (next-token prediction). See the
    module docstring for the sharding contract.

    Args:
        dp_rank: this rank, ``0 <= dp_rank < dp_degree``.
        dp_degree: number of data-parallel ranks (>= 1).
        local_batch_size: samples per rank per step (>= 1).
        seq_len: tokens per sample (>= 1, and a window must fit in the corpus).
        seed: corpus and shuffling seed (>= 0).
        corpus_chars: corpus size passed to :func:`build_corpus`.

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
    _check_int("corpus_chars", corpus_chars, 1)
    n_tokens = _cached_stream(seed, corpus_chars).numel()
    if seq_len + 1 > n_tokens:
        raise ValueError(
            f"seq_len={seq_len} is too long for a corpus of {n_tokens} tokens "
            f"(corpus_chars={corpus_chars})"
        )
    return ShardedBatchIterator(
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        seed=seed,
        corpus_chars=corpus_chars,
    )

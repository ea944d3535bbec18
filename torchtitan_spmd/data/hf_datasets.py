"""Local text datasets through the Hugging Face ``datasets`` package, packed to ``seq_len``.

``dataloader.dataset`` picks the format of the files at ``dataloader.dataset_path``:

=============  ===============================================================
``"json"``     JSON lines (or a JSON array) of objects with a ``text`` field
``"text"``     plain text, one document per line
``"parquet"``  parquet with a ``text`` column
``"c4_test"``  torchtitan's test set: a folder of JSON lines with ``text``
               (``tests/assets/c4_test`` unless ``dataloader.dataset_path``)
=============  ===============================================================

``dataset_path`` is a file, a folder (its files of that format, sorted by name) or a glob
pattern. The files are read with ``datasets.load_dataset`` and its packaged builder for
the format (``json``, ``text``, ``parquet``): local files only, nothing is downloaded.

**Packing.** The documents, in order, are tokenised as ``[BOS] + ids + [EOS]``
(``tokenizer.encode_documents``; documents with no text, e.g. blank lines, are skipped) and
concatenated into one stream that repeats the dataset in order for ever (``infinite=False``:
one pass, see below); the stream is cut
into consecutive windows of ``seq_len + 1`` tokens, window ``k`` being global sample ``k``
(``input_ids = window[:-1]``, ``labels = window[1:]``). As for the synthetic data
(:mod:`torchtitan_spmd.data.loader`), the global batch of step ``t`` is samples
``t*G .. t*G + G - 1`` and data-parallel rank ``r`` reads rows ``r*B .. (r+1)*B - 1`` of it,
so what a sample holds does not depend on the layout. Documents run across window (and rank)
boundaries, so every rank tokenises the documents of the whole global batch and keeps its
own rows (tokenising is cheap next to a step: see ``docs/benchmarks.md``).

**One pass** (``infinite=False``, upstream's validation set under ``validator.steps = -1``):
the iterator stops (``StopIteration``) before the first global batch that would need a token
of the set's second pass; the tokens after the last whole global batch are not read. Every
rank tokenises the same global stream, so every rank stops after the same batch (upstream's
per-rank split of the documents can leave ranks with unequal counts and hang).

**Position.** :meth:`PackedTextIterator.state_dict` is the stream position of the next
global batch, the same on every rank: the epoch, the document and the token offset inside
it, and the samples read. A resume under another layout (or another ``seq_len``) continues on
the same token.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import torch

from torchtitan_spmd._errors import require
from torchtitan_spmd.data.position import steps_read

__all__ = ["C4_TEST_PATH", "PackedTextIterator", "load_documents"]

#: Where ``dataloader.dataset="c4_test"`` reads without ``dataloader.dataset_path`` (torchtitan's path,
#: relative to the working directory; this repository ships a small stand-in there).
C4_TEST_PATH = "tests/assets/c4_test"

#: ``dataloader.dataset`` -> (the ``datasets`` builder, the file name endings a folder is searched for).
_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "json": ("json", (".jsonl", ".json", ".jsonl.gz", ".json.gz")),
    "c4_test": ("json", (".jsonl", ".json", ".jsonl.gz", ".json.gz")),
    "text": ("text", (".txt", ".txt.gz")),
    "parquet": ("parquet", (".parquet",)),
}

#: The field every document's text is read from.
TEXT_FIELD = "text"

#: Documents tokenised per batched call.
_DOCS_PER_CALL = 64


def _data_files(dataset: str, path: str) -> list[str]:
    """The files ``dataloader.dataset_path`` names, sorted (``ValueError`` when there are none)."""
    endings = _FORMATS[dataset][1]
    where = f"dataloader.dataset_path={path!r} (dataloader.dataset={dataset!r})"
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(endings) and os.path.isfile(os.path.join(path, f)))
        if not files:
            raise ValueError(f"{where}: the folder holds no {'/'.join(endings)} file.")
        return files
    if glob.has_magic(path):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        if not files:
            raise ValueError(f"{where}: the pattern matches no file.")
        return files
    raise ValueError(f"{where} does not exist.")


def _innermost(err: BaseException) -> BaseException:
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return err


def load_documents(dataset: str, dataset_path: str | None) -> Any:
    """The documents of ``dataloader.dataset`` at ``dataloader.dataset_path``: a ``datasets.Dataset``
    with one column, ``text``.

    Raises:
        ValueError: an unknown format, a missing path, no files, files that cannot be read as
            the format, no ``text`` field, no document; one line naming the field and path.
        torchtitan_spmd._errors.MissingExtraError: ``datasets`` is not installed (names the ``hf`` extra).
    """
    if dataset not in _FORMATS:
        raise ValueError(f"dataloader.dataset={dataset!r} is not a file dataset; valid: "
                         f"{', '.join(map(repr, _FORMATS))}.")
    path = dataset_path or (C4_TEST_PATH if dataset == "c4_test" else None)
    if not path:
        raise ValueError(f"dataloader.dataset={dataset!r} needs dataloader.dataset_path.")
    files = _data_files(dataset, path)
    datasets = require("datasets", "hf", f"dataloader.dataset={dataset!r}")
    builder = _FORMATS[dataset][0]
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"dataloader.dataset_path={path!r}: the dataset is empty ({len(files)} empty file(s)).")
    datasets.disable_progress_bars()  # no progress bars from every rank
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a bad file: our one line, not the builder's log too
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as err:  # the builders raise many types; the innermost one says what was wrong
        inner = _innermost(err)
        message = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
        raise ValueError(f"dataloader.dataset_path={path!r}: cannot read {len(files)} file(s) as {builder!r} "
                         f"(dataloader.dataset={dataset!r}): {type(inner).__name__}: {message}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if TEXT_FIELD not in ds.column_names:
        raise ValueError(f"dataloader.dataset_path={path!r}: the documents have no {TEXT_FIELD!r} field "
                         f"(their fields: {', '.join(ds.column_names) or 'none'}).")
    if len(ds) == 0:
        raise ValueError(f"dataloader.dataset_path={path!r}: the dataset is empty (no document).")
    return ds.select_columns([TEXT_FIELD])


class PackedTextIterator(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """Iterator of ``(input_ids, labels)``, each int64 ``[local_batch_size, seq_len]``, over
    packed documents (see the module docstring): endless, or one pass with ``infinite=False``.

    Raises:
        ValueError: the tokenizer has neither BOS nor EOS (the documents would run together).

    Args:
        documents: a sequence of texts or a ``datasets.Dataset`` with a ``text`` column.
        tokenizer: has ``encode_documents(texts) -> list[list[int]]`` (BOS/EOS added).
        dp_rank, dp_degree, local_batch_size, seq_len: as :func:`~torchtitan_spmd.data.build_dataloader`.
        name: how errors name the dataset.
        infinite: repeat the set for ever (the default), or stop after one pass (the whole
            global batches of the set's first pass).
    """

    def __init__(self, documents: Any, tokenizer: Any, *, dp_rank: int, dp_degree: int,
                 local_batch_size: int, seq_len: int, name: str = "the dataset", infinite: bool = True) -> None:
        if getattr(tokenizer, "bos_id", None) is None and getattr(tokenizer, "eos_id", None) is None:
            raise ValueError(f"{name}: the tokenizer {tokenizer!r} has neither a BOS nor an EOS token to separate "
                             "the packed documents (tokenizer_config.json names them: bos_token, eos_token).")
        self.documents = documents
        self.tokenizer = tokenizer
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.local_batch_size = local_batch_size
        self.seq_len = seq_len
        self.name = name
        self.infinite = infinite
        self.exhausted = False  # infinite=False: the pass has ended
        self.n_documents = len(documents)
        self.step = 0
        #: The stream position of the next global batch: (epoch, document, token offset).
        self.epoch, self.document, self.offset = 0, 0, 0
        self._cache: dict[int, list[int]] = {}  # document -> its tokens, for the documents ahead

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all data-parallel ranks."""
        return self.local_batch_size * self.dp_degree

    def _texts(self, start: int, stop: int) -> list[Any]:
        if hasattr(self.documents, "column_names"):  # a datasets.Dataset: one slice, one Arrow read
            return list(self.documents[start:stop][TEXT_FIELD])
        return list(self.documents[start:stop])

    def _tokens(self, doc: int) -> list[int]:
        if doc not in self._cache:
            self._cache.clear()
            stop = min(doc + _DOCS_PER_CALL, self.n_documents)
            texts = self._texts(doc, stop)
            for i, text in enumerate(texts):
                if text is None:
                    raise ValueError(f"{self.name}: document {doc + i} has no {TEXT_FIELD!r} field.")
                if not isinstance(text, str):
                    raise ValueError(f"{self.name}: document {doc + i} has a {type(text).__name__} "
                                     f"{TEXT_FIELD!r}, not text.")
            keep = [i for i, t in enumerate(texts) if t.strip()]
            encoded = self.tokenizer.encode_documents([texts[i] for i in keep]) if keep else []
            self._cache = {doc + i: [] for i in range(len(texts))}
            self._cache.update({doc + i: ids for i, ids in zip(keep, encoded, strict=True)})
        return self._cache[doc]

    def _take(self, n: int) -> list[int]:
        """The next ``n`` tokens of the stream; advances the position."""
        out: list[int] = []
        epoch_tokens = 0 if (self.document, self.offset) == (0, 0) else None
        while len(out) < n:
            tokens = self._tokens(self.document)
            piece = tokens[self.offset:self.offset + n - len(out)]
            out.extend(piece)
            self.offset += len(piece)
            if epoch_tokens is not None:
                epoch_tokens += len(piece)
            if self.offset >= len(tokens):
                self.document, self.offset = self.document + 1, 0
                if self.document == self.n_documents:
                    if epoch_tokens == 0:
                        raise ValueError(f"{self.name}: no document has any text.")
                    if not self.infinite and len(out) < n:  # one pass: this batch would need the next
                        self.exhausted = True
                        raise StopIteration
                    self.epoch, self.document, epoch_tokens = self.epoch + 1, 0, 0
        return out

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exhausted or (not self.infinite and self.epoch > 0):  # the pass ended on a batch's edge
            self.exhausted = True
            raise StopIteration
        window, rows = self.seq_len + 1, self.local_batch_size
        tokens = self._take(self.global_batch_size * window)
        first = self.dp_rank * rows * window
        batch = torch.tensor(tokens[first:first + rows * window], dtype=torch.int64).view(rows, window)
        self.step += 1
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def __iter__(self) -> PackedTextIterator:
        return self

    def state_dict(self) -> dict[str, int]:
        """The position (the same on every rank): ``step`` (batches read), ``samples`` (global
        samples read), ``epoch``, ``document`` and ``offset`` (the stream position of the next
        global batch) and ``documents`` (the dataset's size, checked on load)."""
        return {"step": self.step, "samples": self.step * self.global_batch_size, "epoch": self.epoch,
                "document": self.document, "offset": self.offset, "documents": self.n_documents}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a :meth:`state_dict`, also one saved with another layout or ``seq_len``.

        ``samples`` must be a whole number of this iterator's global batches, and the
        dataset must have the saved number of documents (``ValueError`` naming both otherwise).
        """
        if int(state["documents"]) != self.n_documents:
            raise ValueError(f"the checkpoint's data position is in a dataset of {int(state['documents'])} "
                             f"documents; {self.name} has {self.n_documents}: resume on the same data.")
        self.step = steps_read(int(state["samples"]), self.local_batch_size, self.dp_degree)
        self.epoch, self.document, self.offset = int(state["epoch"]), int(state["document"]), int(state["offset"])
        self._cache.clear()

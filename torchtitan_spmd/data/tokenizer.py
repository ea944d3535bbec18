"""A byte-level tokenizer with BOS/EOS/PAD ids.

Design choice: every UTF-8 byte is its own token (ids 0..255), followed by the
special ids ``BOS = 256``, ``EOS = 257`` and ``PAD = 258``. The vocabulary is
padded with unused ids up to 320, a multiple of 64, so that the embedding and
output matrices split evenly over tensor-parallel degrees 2, 4, 8, 16, 32 and 64.
Nothing is trained or downloaded, ``decode(encode(s)) == s`` for every string,
and the mapping never changes between runs or machines.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Tokenizer"]


class Tokenizer:
    """Byte-level tokenizer: ids ``0..255`` are bytes, then BOS, EOS, PAD.

    Attributes:
        vocab_size: 320 (258 used ids padded up to a multiple of 64).
        bos_id: 256, begin of document.
        eos_id: 257, end of document.
        pad_id: 258, padding (never produced by the data pipeline).
    """

    n_bytes: int = 256
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 320

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, optionally wrapped in BOS/EOS."""
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    @property
    def model_vocab_size(self) -> int:
        """The vocabulary the trainer gives the model: :attr:`vocab_size` (already padded)."""
        return self.vocab_size

    def encode_documents(self, texts: Iterable[str]) -> list[list[int]]:
        """``[encode(t, add_bos=True, add_eos=True) for t in texts]``."""
        return [self.encode(t, add_bos=True, add_eos=True) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: special and unused ids are dropped; invalid UTF-8 is
        replaced by U+FFFD.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
            if i < self.n_bytes:
                out.append(i)
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Tokenizer(byte-level, vocab_size={self.vocab_size})"

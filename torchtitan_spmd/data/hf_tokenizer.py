"""A Hugging Face tokenizer from an assets folder (``hf_assets_path``).

Behaves as torchtitan's ``HuggingFaceTokenizer`` for a folder with ``tokenizer.json``:

* the tokenizer is ``tokenizer.json`` through the ``tokenizers`` package (the ``hf`` extra,
  imported on first use);
* ``tokenizer_config.json`` (when present) names the special tokens (``bos_token``,
  ``eos_token``, ``pad_token``, ... as strings or ``{"content": ...}``, and
  ``added_tokens_decoder``); they are registered as special tokens and give
  :attr:`HuggingFaceTokenizer.bos_id` / :attr:`~HuggingFaceTokenizer.eos_id`;
* ``encode(text, add_bos=True, add_eos=True)`` adds BOS/EOS unless the tokenizer's own
  post-processor already does (found by encoding ``""``), so a Llama 3 tokenizer, whose
  template adds ``<|begin_of_text|>``, does not get two;
  ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` are the defaults when
  ``encode`` is not told.

Only ``tokenizer.json`` is read (torchtitan also builds a BPE from ``vocab.json`` +
``merges.txt``; every current Hugging Face model ships ``tokenizer.json``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from torchtitan_spmd._errors import require
from torchtitan_spmd._safe_files import UnsafeFile, read_inside, read_json_inside

__all__ = ["HuggingFaceTokenizer", "build_tokenizer", "check_vocab_size", "padded_vocab_size"]

#: The model's vocabulary is the tokenizer's rounded up to a multiple of this, so that the
#: embedding and output matrices split evenly over tensor-parallel degrees up to 64 (as the
#: byte tokenizer's 258 ids are padded to 320).
VOCAB_MULTIPLE = 64

#: The largest tokenizer.json read: 1 GiB (Llama 3's is 9 MB).
MAX_TOKENIZER_BYTES = 1 << 30

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


def padded_vocab_size(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def _token_content(where: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a token string or {{'content': ...}}, got {value!r}.")


class HuggingFaceTokenizer:
    """The tokenizer of a Hugging Face assets folder; see the module docstring.

    Attributes:
        path: the folder.
        vocab_size: the tokenizer's vocabulary, special tokens included
            (``tokenizers.Tokenizer.get_vocab_size()``).
        bos_id, eos_id, pad_id: the special ids ``tokenizer_config.json`` names, or None.
        bos_token, eos_token: their strings, or None.

    Raises:
        ValueError: ``path`` is not a folder, has no ``tokenizer.json``, or one of its files
            cannot be read (the message names ``hf_assets_path`` and the file).
        torchtitan_spmd._errors.MissingExtraError: ``tokenizers`` is not installed (names the ``hf`` extra).
    """

    def __init__(self, path: str) -> None:
        tokenizers = require("tokenizers", "hf", "hf_assets_path (a Hugging Face tokenizer)")
        if not os.path.isdir(path):
            raise ValueError(f"hf_assets_path={path!r} is not a folder (it must hold tokenizer.json).")
        file = os.path.join(path, "tokenizer.json")
        try:  # a regular file of the folder, no link followed (a FIFO would block the read)
            text = read_inside(path, "tokenizer.json", MAX_TOKENIZER_BYTES)
        except FileNotFoundError:
            present = sorted(os.listdir(path))[:10]
            raise ValueError(f"hf_assets_path={path!r} has no tokenizer.json (it holds {present}); "
                             "only tokenizer.json is read.") from None
        except (UnsafeFile, OSError) as err:
            raise ValueError(f"hf_assets_path: cannot read {file}: {err}") from None
        try:
            self._tok = tokenizers.Tokenizer.from_str(text.decode("utf-8"))
        except Exception as err:  # the Rust library's own exception type; UnicodeDecodeError
            raise ValueError(f"hf_assets_path: cannot read {file}: {err}") from None
        self.path = path
        self.config = self._read_config(path, "tokenizer_config.json")
        self.bos_token = _token_content("tokenizer_config.json bos_token", self.config.get("bos_token"))
        self.eos_token = _token_content("tokenizer_config.json eos_token", self.config.get("eos_token"))
        pad_token = _token_content("tokenizer_config.json pad_token", self.config.get("pad_token"))
        self._register_special_tokens(tokenizers)
        self.bos_id = self._id_of(self.bos_token)
        self.eos_id = self._id_of(self.eos_token)
        self.pad_id = self._id_of(pad_token)
        # Does the tokenizer's own post-processor add them already?
        empty = self._tok.encode("").ids
        self._adds_bos = self.bos_id is not None and self.bos_id in empty
        self._adds_eos = self.eos_id is not None and self.eos_id in empty
        self.default_add_bos = bool(self.config.get("add_bos_token", False))
        self.default_add_eos = bool(self.config.get("add_eos_token", False))

    @staticmethod
    def _read_config(folder: str, name: str) -> dict[str, Any]:
        file = os.path.join(folder, name)
        if not os.path.lexists(file):
            return {}
        try:
            config = read_json_inside(folder, name)
        except (OSError, ValueError) as err:  # UnsafeFile (a link, a FIFO, bad JSON) is a ValueError
            raise ValueError(f"hf_assets_path: cannot read {file}: {err}") from None
        if not isinstance(config, dict):
            raise ValueError(f"hf_assets_path: {file} must hold a JSON object, got {type(config).__name__}.")
        return config

    def _register_special_tokens(self, tokenizers: Any) -> None:
        """Every special token the config names becomes a special token of the tokenizer
        (as transformers does), so that its text encodes to its one id."""
        added = []
        for key in _SPECIAL_KEYS:
            value = self.config.get(key)
            content = _token_content(f"tokenizer_config.json {key}", value)
            if content is not None:
                added.append(self._added_token(tokenizers, content, value if isinstance(value, dict) else {}))
        decoder = self.config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise ValueError("tokenizer_config.json added_tokens_decoder must be an object of id -> token.")
        for spec in decoder.values():
            if isinstance(spec, dict) and isinstance(spec.get("content"), str):
                added.append(self._added_token(tokenizers, spec["content"], spec))
        if added:
            self._tok.add_special_tokens(added)

    @staticmethod
    def _added_token(tokenizers: Any, content: str, spec: dict[str, Any]) -> Any:
        return tokenizers.AddedToken(
            content, single_word=bool(spec.get("single_word", False)), lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)), normalized=bool(spec.get("normalized", False)),
            special=bool(spec.get("special", True)),
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: ``0 .. vocab_size - 1`` (special tokens included)."""
        return self._tok.get_vocab_size()

    @property
    def model_vocab_size(self) -> int:
        """The vocabulary the trainer gives the model: :attr:`vocab_size` padded to a multiple of 64."""
        return padded_vocab_size(self.vocab_size)

    def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """The ids of ``text`` (the tokenizer's own post-processing included), with BOS/EOS
        added when asked (None: ``tokenizer_config.json``'s ``add_bos_token`` /
        ``add_eos_token``) and not already there."""
        ids = self._tok.encode(text).ids
        if (self.default_add_bos if add_bos is None else add_bos) and self.bos_id is not None and not self._adds_bos:
            ids.insert(0, self.bos_id)
        if (self.default_add_eos if add_eos is None else add_eos) and self.eos_id is not None and not self._adds_eos:
            ids.append(self.eos_id)
        return ids

    def encode_documents(self, texts: Iterable[str]) -> list[list[int]]:
        """``[encode(t, add_bos=True, add_eos=True) for t in texts]``, in one batched call."""
        texts = list(texts)
        out = []
        for enc in self._tok.encode_batch(texts):
            ids = enc.ids
            if self.bos_id is not None and not self._adds_bos:
                ids.insert(0, self.bos_id)
            if self.eos_id is not None and not self._adds_eos:
                ids.append(self.eos_id)
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens dropped unless ``skip_special_tokens=False``)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (f"HuggingFaceTokenizer({self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id})")


def build_tokenizer(hf_assets_path: str | None) -> Any:
    """``hf_assets_path``'s :class:`HuggingFaceTokenizer`, or the byte tokenizer for None."""
    if hf_assets_path is None:
        from torchtitan_spmd.data.tokenizer import Tokenizer

        return Tokenizer()
    return HuggingFaceTokenizer(hf_assets_path)


def check_vocab_size(model_vocab_size: int, tokenizer: Any, *, model: str) -> None:
    """``ValueError`` naming both sizes when the model cannot embed every id the tokenizer produces."""
    if model_vocab_size < tokenizer.vocab_size:
        source = getattr(tokenizer, "path", None)
        which = f"the tokenizer of hf_assets_path={source!r}" if source else "the byte tokenizer"
        raise ValueError(f"model {model} has vocab_size={model_vocab_size}, smaller than {which} "
                         f"(vocab_size={tokenizer.vocab_size}): every token id must have an embedding row.")

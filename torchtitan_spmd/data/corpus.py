"""A deterministic, learnable synthetic text corpus generated from code.

Nothing is downloaded or shipped: :func:`build_corpus` draws documents from a
small template grammar with a seeded :class:`random.Random`. The text is
English-like and strongly structured, so a small byte-level model's loss falls
quickly and visibly:

* **stories** -- sentences of the form ``"<name> <verb> the <adj> <noun> <prep>
  the <place>."`` over short word lists;
* **arithmetic** -- correct facts ``"7 plus 5 is 12."``, ``"3 times 4 is 12."``;
* **counting** -- runs of consecutive numbers or letters (``"count: 4 5 6 7."``);
* **echoes** -- a sentence followed by ``"again: "`` and the same sentence.

Each document is one line (no ``"\\n"`` inside a document).
"""

from __future__ import annotations

import random
import string

__all__ = ["DEFAULT_CORPUS_CHARS", "build_corpus"]

#: Default corpus size: about 2M bytes, i.e. ~7,800 windows of 257 tokens, so
#: 100 steps of 8 x 256 tokens read each window at most once.
DEFAULT_CORPUS_CHARS = 2_000_000

_NAMES = (
    "alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi",
    "ivan", "judy", "mallory", "oscar", "peggy", "trent", "victor", "wendy",
)  # fmt: skip
_VERBS = (
    "found", "moved", "painted", "carried", "dropped", "lifted", "washed", "hid",
    "sold", "bought", "watched", "cleaned",
)  # fmt: skip
_ADJS = (
    "red", "blue", "green", "small", "large", "old", "new", "quiet",
    "bright", "heavy", "soft", "round",
)  # fmt: skip
_NOUNS = (
    "box", "cat", "dog", "book", "lamp", "chair", "apple", "stone",
    "cup", "key", "ball", "hat",
)  # fmt: skip
_PREPS = ("in", "near", "under", "behind", "beside", "inside")
_PLACES = (
    "house", "garden", "kitchen", "market", "school", "park", "barn", "room",
)  # fmt: skip
_ENDINGS = (
    "then they went home.", "it was a good day.", "nobody saw it.",
    "everyone laughed.", "the sun was warm.",
)  # fmt: skip
_NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
)  # fmt: skip


def _story_sentence(rng: random.Random) -> str:
    return (
        f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} "
        f"{rng.choice(_NOUNS)} {rng.choice(_PREPS)} the {rng.choice(_PLACES)}."
    )


def _story(rng: random.Random) -> str:
    sentences = [_story_sentence(rng) for _ in range(rng.randint(2, 5))]
    sentences.append(rng.choice(_ENDINGS))
    return " ".join(sentences)


def _arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(3, 6)):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if rng.random() < 0.5:
            facts.append(f"{a} plus {b} is {a + b}.")
        else:
            a, b = a % 11, b % 11
            facts.append(f"{a} times {b} is {a * b}.")
    return " ".join(facts)


def _counting(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        start = rng.randint(0, 80)
        items = [str(n) for n in range(start, start + rng.randint(5, 12))]
    elif kind == 1:
        start = rng.randint(0, 14)
        items = list(string.ascii_lowercase[start : start + rng.randint(5, 12)])
    else:
        start = rng.randint(0, 5)
        items = list(_NUMBER_WORDS[start : start + rng.randint(3, 6)])
    return "count: " + " ".join(items) + "."


def _echo(rng: random.Random) -> str:
    sentence = _story_sentence(rng)
    return f"{sentence} again: {sentence}"


_GENERATORS = (_story, _story, _arithmetic, _counting, _echo)


def build_corpus(seed: int = 0, n_chars: int = DEFAULT_CORPUS_CHARS, *, block: int | None = None) -> str:
    """Deterministic synthetic text of at least ``n_chars`` characters.

    Documents (see the module docstring) are separated by ``"\\n"``; the text
    ends with ``"\\n"``. The same ``(seed, n_chars, block)`` always gives the same
    string; a longer ``n_chars`` extends the shorter corpus of the same seed and block.
    The text is pure ASCII, so one character is one byte token.

    ``block``: one of an endless series of independent corpora of the same seed
    (what the data loader reads: block ``b`` is drawn from ``(seed, b)`` only);
    None is the original single corpus of ``seed``.

    Raises:
        ValueError: ``n_chars < 1``, a negative ``block`` or a non-int argument.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if not isinstance(n_chars, int) or isinstance(n_chars, bool) or n_chars < 1:
        raise ValueError(f"n_chars must be a positive int, got {n_chars!r}")
    if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block < 0):
        raise ValueError(f"block must be None or an int >= 0, got {block!r}")
    name = f"torchtitan_spmd.corpus/{seed}" if block is None else f"torchtitan_spmd.corpus/{seed}/block/{block}"
    rng = random.Random(name)
    docs: list[str] = []
    total = 0
    while total < n_chars:
        doc = rng.choice(_GENERATORS)(rng)
        docs.append(doc)
        total += len(doc) + 1
    return "\n".join(docs) + "\n"

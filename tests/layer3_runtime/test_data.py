"""Tokenizer, synthetic corpus and the data-parallel sharded loader."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from torchtitan_spmd.data import (
    ShardedBatchIterator,
    Tokenizer,
    build_block,
    build_corpus,
    build_dataloader,
    build_token_stream,
)
from torchtitan_spmd.data.loader import windows_per_block
from torchtitan_spmd.models.llama3 import FLAVORS, build_model

SMALL = 20_000  # n_chars of a small corpus


pytestmark = pytest.mark.usefixtures("single_thread")


def take(it: ShardedBatchIterator, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(it, n))


def loader(**overrides) -> ShardedBatchIterator:
    kwargs = dict(dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=32, seed=0)
    kwargs.update(overrides)
    return build_dataloader(**kwargs)


# ------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize(
    "text", ["", "hello world.", "3 plus 4 is 7.\n", "naïve café ✓ 日本", "\x00\xff"]
)
def test_tokenizer_round_trip(text: str) -> None:
    tok = Tokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    wrapped = tok.encode(text, add_bos=True, add_eos=True)
    assert wrapped[0] == tok.bos_id and wrapped[-1] == tok.eos_id
    assert wrapped[1:-1] == ids
    assert tok.decode(wrapped) == text


def test_tokenizer_ids() -> None:
    tok = Tokenizer()
    assert tok.encode("ab") == [97, 98]
    specials = {tok.bos_id, tok.eos_id, tok.pad_id}
    assert len(specials) == 3 and all(256 <= i < tok.vocab_size for i in specials)
    assert tok.vocab_size % 64 == 0
    assert tok.vocab_size == FLAVORS["debugmodel"].vocab_size == FLAVORS["tiny"].vocab_size
    assert tok.decode([tok.bos_id, 104, 105, tok.pad_id, tok.vocab_size - 1, tok.eos_id]) == "hi"
    with pytest.raises(ValueError, match=str(tok.vocab_size)):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])


# ------------------------------------------------------------------ corpus


def test_corpus_deterministic_and_seeded() -> None:
    a = build_corpus(seed=0, n_chars=50_000)
    assert a == build_corpus(seed=0, n_chars=50_000)
    assert a != build_corpus(seed=1, n_chars=50_000)
    assert len(a) >= 50_000
    assert a.isascii() and a.endswith("\n")
    assert build_corpus(seed=0, n_chars=200_000).startswith(a[:-1])


def test_corpus_is_structured() -> None:
    text = build_corpus(seed=3, n_chars=100_000)
    assert " plus " in text and " times " in text and "count: " in text and " again: " in text
    for line in text.splitlines():
        if " again: " in line:
            first, second = line.split(" again: ")
            assert first == second
    for fact in (s for s in text.replace("\n", " ").split(". ") if " plus " in s):
        words = fact.strip(".").split(" ")
        if len(words) == 5 and words[1] == "plus":
            assert int(words[0]) + int(words[2]) == int(words[4])


@pytest.mark.parametrize("kwargs", [{"n_chars": 0}, {"n_chars": 1.5}, {"seed": "x"}])
def test_corpus_bad_args(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=repr(next(iter(kwargs.values())))):
        build_corpus(**kwargs)


def test_token_stream_documents() -> None:
    tok = Tokenizer()
    stream = build_token_stream(seed=0, n_chars=SMALL)
    text = build_corpus(seed=0, n_chars=SMALL)
    assert stream.dtype == torch.int64
    assert stream[0] == tok.bos_id and stream[-1] == tok.eos_id
    n_docs = text.count("\n")
    assert int((stream == tok.bos_id).sum()) == n_docs == int((stream == tok.eos_id).sum())
    assert stream.numel() == len(text.encode()) - n_docs + 2 * n_docs
    assert tok.decode(stream.tolist()) == text.replace("\n", "")


# ------------------------------------------------------------------ loader


def test_batch_shapes_dtype_and_range() -> None:
    tok = Tokenizer()
    for x, y in take(loader(local_batch_size=3, seq_len=40), 5):
        assert x.shape == y.shape == (3, 40)
        assert x.dtype == y.dtype == torch.int64
        assert int(x.min()) >= 0 and int(x.max()) < tok.vocab_size
        assert int(y.min()) >= 0 and int(y.max()) < tok.vocab_size


def test_labels_are_shifted_inputs() -> None:
    stream = build_block(seed=0, seq_len=24, block=0).flatten()
    for x, y in take(loader(seq_len=24), 4):
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in range(x.shape[0]):
            window = torch.cat((x[row], y[row, -1:]))
            # the window is a contiguous stretch of the block's token stream
            starts = (stream.unfold(0, window.numel(), 1) == window).all(dim=1).nonzero()
            assert starts.numel() >= 1


def test_blocks_are_documents_of_their_own_corpus() -> None:
    tok = Tokenizer()
    block = build_block(seed=5, seq_len=31, block=3)
    assert block.shape == (windows_per_block(31), 32)
    text = tok.decode(block.flatten().tolist())
    corpus = build_corpus(seed=5, n_chars=block.numel(), block=3).replace("\n", "")
    assert corpus.startswith(text)
    assert not torch.equal(block, build_block(seed=5, seq_len=31, block=4))
    assert not torch.equal(block, build_block(seed=6, seq_len=31, block=3))


def test_loader_deterministic_and_seeded() -> None:
    a = take(loader(), 6)
    b = take(loader(), 6)
    c = take(loader(seed=1), 6)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=True))


def test_consecutive_batches_differ() -> None:
    batches = [x for x, _ in take(loader(), 10)]
    rows = {tuple(r.tolist()) for x in batches for r in x}
    assert len(rows) == 40


@pytest.mark.parametrize("dp_degree", [2, 4])
@pytest.mark.parametrize("seq_len", [48, 4000])
def test_dp_ranks_concatenate_to_global_batch(dp_degree: int, seq_len: int) -> None:
    """Rank-major concatenation of the local batches == the single-process batch,
    including across block boundaries (seq_len 4000: 8 samples a block, local slices span two)."""
    b, steps = 3, 12
    common = dict(seq_len=seq_len, seed=0)
    reference = build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=b * dp_degree, **common)
    ranks = [
        build_dataloader(dp_rank=r, dp_degree=dp_degree, local_batch_size=b, **common)
        for r in range(dp_degree)
    ]
    if seq_len == 4000:
        assert windows_per_block(seq_len) % b != 0  # some local slices really span two blocks
    for _ in range(steps):
        gx, gy = next(reference)
        local = [next(it) for it in ranks]
        assert torch.equal(torch.cat([x for x, _ in local]), gx)
        assert torch.equal(torch.cat([y for _, y in local]), gy)
    # ranks see different data
    assert not torch.equal(local[0][0], local[1][0])


def test_samples_are_the_blocks_rows_in_order() -> None:
    """Sample k is row k % W of block k // W: the data depends only on seed, seq_len and position."""
    seq_len, b = 200, 16
    per_block = windows_per_block(seq_len)
    it = loader(seq_len=seq_len, local_batch_size=b)
    rows = torch.cat([torch.cat((x, y[:, -1:]), dim=1) for x, y in take(it, 3 * per_block // b + 1)])
    blocks = torch.cat([build_block(seed=0, seq_len=seq_len, block=k) for k in range(4)])
    assert torch.equal(rows, blocks[: rows.shape[0]])


def test_state_dict_resume() -> None:
    it = loader()
    take(it, 3)
    state = it.state_dict()
    assert state == {"step": 3, "samples": 12}
    expected = take(it, 2)
    resumed = loader()
    resumed.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(expected, take(resumed, 2), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_state_dict_resume_with_another_data_parallel_layout() -> None:
    """The position is in global samples: 3 batches of 4 resume as 6 batches of 2 on rank 1 of 2."""
    it = loader(local_batch_size=4)
    take(it, 3)
    state = it.state_dict()
    expected, _ = next(it)
    rank1 = loader(local_batch_size=1, dp_degree=2, dp_rank=1)
    rank1.load_state_dict(state)
    assert rank1.step == 6
    x, _ = next(rank1)
    assert torch.equal(x, expected[1:2])
    wider = loader(local_batch_size=8)
    with pytest.raises(ValueError, match=r"12 samples read.*global batches of 8"):
        wider.load_state_dict({"step": 3, "samples": 12})


@pytest.mark.parametrize(
    "overrides,bad",
    [
        ({"dp_rank": 2, "dp_degree": 2}, "2"),
        ({"dp_rank": -1}, "-1"),
        ({"dp_degree": 0}, "0"),
        ({"local_batch_size": 0}, "0"),
        ({"seq_len": 0}, "0"),
        ({"seq_len": 2.5}, "2.5"),
        ({"seed": -3}, "-3"),
        ({"local_batch_size": True}, "True"),
    ],
)
def test_bad_args_raise(overrides: dict, bad: str) -> None:
    name = next(iter(overrides))
    with pytest.raises(ValueError, match=name) as info:
        loader(**overrides)
    assert bad in str(info.value)


# ------------------------------------------------------------------ learnable


def test_tiny_model_learns_the_data() -> None:
    """A few optimizer steps already cut the loss well below ln(vocab)."""
    model = build_model("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    losses = []
    for x, y in take(loader(local_batch_size=8, seq_len=32, seed=0), 25):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # ~ln(320) at init
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses

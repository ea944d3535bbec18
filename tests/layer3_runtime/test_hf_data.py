"""Hugging Face data: the tokenizer of an assets folder, local datasets packed to ``seq_len``,
their data-parallel slices and saved positions, the setup errors, and TensorBoard scalars.

The tokenizer is checked against ``tokenizers`` and transformers' ``AutoTokenizer`` on the
real torchtitan test tokenizer (``tests/assets/tokenizer``); the packed batches against an
independent packing of the fixture's JSON lines written here with ``json`` and
``AutoTokenizer`` (no code of the loader).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_data_helpers import C4_TEST, NEEDS_HF, TOKENIZER, hf_cache, read_scalars  # noqa: F401 (a fixture)

from torchtitan_spmd._errors import MissingExtraError, require
from torchtitan_spmd.data import (
    HuggingFaceTokenizer,
    build_dataloader,
    build_tokenizer,
    check_vocab_size,
)

pytestmark = [pytest.mark.usefixtures("single_thread", "hf_cache"), NEEDS_HF]


def _texts() -> list[str]:
    return [json.loads(line)["text"] for line in C4_TEST.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def auto() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope="module")
def tok() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(str(TOKENIZER))


# ------------------------------------------------------------------ tokenizer
SPECIAL_TEXTS = [
    "", " ", "Hello world", "naïve café ✓ 日本語 \t\n end", "<|begin_of_text|>x<|end_of_text|>",
    "<|im_start|>user\nhi<|im_end|> [PAD]", "  two  spaces  ",
]


def test_ids_match_tokenizers_and_autotokenizer(tok: HuggingFaceTokenizer, auto: Any) -> None:
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    texts = _texts() + SPECIAL_TEXTS
    for text in texts:
        ids = tok.encode(text)
        assert ids == auto(text).input_ids, text[:60]
        if "<|" not in text and "[PAD]" not in text:  # the bare tokenizer.json knows no special tokens
            assert ids == raw.encode(text).ids, text[:60]
        assert tok.decode(ids) == auto.decode(ids, skip_special_tokens=True)
    # BOS / EOS as transformers names them; added around each document
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id)
    assert tok.bos_id is not None and tok.eos_id is not None
    for text in texts[:5] + SPECIAL_TEXTS:
        want = [auto.bos_token_id, *auto(text).input_ids, auto.eos_token_id]
        assert tok.encode(text, add_bos=True, add_eos=True) == want
    assert tok.encode_documents(SPECIAL_TEXTS) == [tok.encode(t, add_bos=True, add_eos=True) for t in SPECIAL_TEXTS]
    assert tok.vocab_size == len(auto) == 2020
    assert tok.model_vocab_size == 2048  # padded to a multiple of 64, as torchtitan's debugmodel


def test_a_tokenizer_whose_template_adds_bos_gets_one(tmp_path: Path, tok: HuggingFaceTokenizer) -> None:
    """A Llama 3 style tokenizer.json adds BOS itself (TemplateProcessing): not twice."""
    import tokenizers
    from transformers import AutoTokenizer

    raw = tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    raw.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    bos = raw.token_to_id("<|begin_of_text|>")
    raw.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    raw.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(TOKENIZER / "tokenizer_config.json", tmp_path)
    own, auto = HuggingFaceTokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert own.bos_id == bos == auto.bos_token_id
    for text in SPECIAL_TEXTS:
        assert own.encode(text) == auto(text).input_ids
        ids = own.encode(text, add_bos=True, add_eos=True)
        assert ids == [*auto(text).input_ids, auto.eos_token_id] and ids.count(bos) == 1 + text.count("<|begin_of_text|>")


def test_the_byte_tokenizer_stays_the_default() -> None:
    from torchtitan_spmd.data import Tokenizer

    assert isinstance(build_tokenizer(None), Tokenizer) and build_tokenizer(None).model_vocab_size == 320


def test_vocab_size_check_names_both(tok: HuggingFaceTokenizer) -> None:
    check_vocab_size(2048, tok, model="llama3/debugmodel")
    check_vocab_size(2020, tok, model="llama3/debugmodel")
    with pytest.raises(ValueError, match=r"llama3/debugmodel has vocab_size=2019, smaller than the tokenizer of "
                                         r"hf_assets_path=.*\(vocab_size=2020\)"):
        check_vocab_size(2019, tok, model="llama3/debugmodel")


# ------------------------------------------------------------------ packing and data-parallel slices
def independent_stream(auto: Any, texts: list[str], n_tokens: int) -> list[int]:
    """[BOS] + ids + [EOS] of every non-blank document, in order, the dataset repeated."""
    docs = [[auto.bos_token_id, *auto(t).input_ids, auto.eos_token_id] for t in texts if t.strip()]
    stream: list[int] = []
    for doc in itertools.cycle(docs):
        stream.extend(doc)
        if len(stream) >= n_tokens:
            return stream[:n_tokens]
    raise AssertionError("unreachable")


def loaders(dp_degree: int, local: int, seq_len: int, dataset: str = "json", path: Path | str = C4_TEST,
            tokenizer: Any = None) -> list[Any]:
    tokenizer = tokenizer or HuggingFaceTokenizer(str(TOKENIZER))
    return [build_dataloader(dp_rank=r, dp_degree=dp_degree, local_batch_size=local, seq_len=seq_len, seed=0,
                             dataset=dataset, dataset_path=str(path), tokenizer=tokenizer) for r in range(dp_degree)]


def test_each_rank_reads_its_own_rows_of_the_independent_packing(auto: Any) -> None:
    """Two ranks of 2 rows, 60 steps of 4 x 257 tokens: past the end of the fixture (about 57k
    tokens), so across an epoch boundary too."""
    seq_len, local, dp, steps = 256, 2, 2, 60
    window, global_batch = seq_len + 1, local * dp
    stream = torch.tensor(independent_stream(auto, _texts(), steps * global_batch * window))
    want = stream.view(steps, global_batch, window)
    ranks = loaders(dp, local, seq_len)
    for step in range(steps):
        for rank, it in enumerate(ranks):
            inputs, labels = next(it)
            rows = want[step, rank * local:(rank + 1) * local]
            assert torch.equal(inputs, rows[:, :-1]) and torch.equal(labels, rows[:, 1:]), (step, rank)
    assert ranks[0].state_dict()["epoch"] == 1 and ranks[0].state_dict() == ranks[1].state_dict()


def test_a_resume_under_another_layout_continues_on_the_same_tokens() -> None:
    seq_len = 64
    two = loaders(2, 2, seq_len)
    for _ in range(7):
        for it in two:
            next(it)
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["samples"] == 28
    want = torch.cat([next(it)[0] for it in two])  # step 8, both ranks
    (one,) = loaders(1, 4, seq_len)
    one.load_state_dict(state)
    assert torch.equal(next(one)[0], want)
    # ... and four ranks of one row
    four = loaders(4, 1, seq_len)
    for it in four:
        it.load_state_dict(state)
    assert torch.equal(torch.cat([next(it)[0] for it in four]), want)
    # a fresh loader that did not load the state reads other tokens
    (fresh,) = loaders(1, 4, seq_len)
    assert not torch.equal(next(fresh)[0], want)


def test_a_position_in_other_data_or_batch_is_refused() -> None:
    (it,) = loaders(1, 4, 32)
    next(it)
    state = it.state_dict()
    (odd,) = loaders(1, 3, 32)
    with pytest.raises(ValueError, match=r"4 samples read\) is not a whole number of global batches of 3"):
        odd.load_state_dict(state)
    with pytest.raises(ValueError, match=r"dataset of 47 documents; .* has 48"):
        it.load_state_dict({**state, "documents": 47})


def test_text_parquet_and_c4_test_read_the_same_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [t.replace("\n", " ") for t in _texts()[:12]]
    (tmp_path / "docs.txt").write_text("\n".join(texts[:6]) + "\n\n" + "\n".join(texts[6:]) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"id": list(range(12)), "text": texts}), tmp_path / "docs.parquet")
    with open(tmp_path / "part-0.jsonl", "w", encoding="utf-8") as f:
        for t in texts[:5]:
            f.write(json.dumps({"text": t, "url": "x"}) + "\n")
    with open(tmp_path / "part-1.jsonl", "w", encoding="utf-8") as f:
        for t in texts[5:]:
            f.write(json.dumps({"text": t}) + "\n")
    batches = {}
    for name, dataset, path in [("text", "text", tmp_path / "docs.txt"), ("parquet", "parquet", tmp_path / "docs.parquet"),
                                ("json folder", "json", tmp_path), ("json glob", "json", tmp_path / "part-*.jsonl")]:
        (it,) = loaders(1, 2, 128, dataset, path)
        batches[name] = torch.cat([next(it)[0] for _ in range(6)])
    for name, got in batches.items():
        assert torch.equal(got, batches["text"]), name
    # c4_test: torchtitan's default folder, tests/assets/c4_test
    (c4,) = loaders(1, 2, 128, "c4_test", C4_TEST.parent)
    (js,) = loaders(1, 2, 128, "json", C4_TEST)
    assert torch.equal(next(c4)[0], next(js)[0])


def test_the_byte_tokenizer_reads_a_file_dataset_too() -> None:
    from torchtitan_spmd.data import Tokenizer

    (it,) = loaders(1, 1, 40, tokenizer=Tokenizer())
    inputs, _ = next(it)
    text = _texts()[0]
    assert inputs[0].tolist() == [256, *text.encode("utf-8")][:40]


# ------------------------------------------------------------------ errors: one line each
def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("case", ["missing", "empty", "no text field", "a document without text", "empty folder",
                                  "no match", "bad json", "blank lines only", "not text"])
def test_bad_datasets_are_one_line_errors(case: str, tmp_path: Path) -> None:
    dataset, path, match = "json", tmp_path / "d.jsonl", ""
    if case == "missing":
        match = r"dataloader.dataset_path='.*nowhere.jsonl' \(dataloader.dataset='json'\) does not exist"
        path = tmp_path / "nowhere.jsonl"
    elif case == "empty":
        path.write_text("")
        match = r"the dataset is empty \(1 empty file\(s\)\)"
    elif case == "no text field":
        path.write_text('{"content": "a"}\n{"content": "b"}\n')
        match = r"the documents have no 'text' field \(their fields: content\)"
    elif case == "a document without text":
        path.write_text('{"text": "a"}\n{"content": "b"}\n')
        match = "document 1 has no 'text' field"
    elif case == "empty folder":
        path = tmp_path
        (tmp_path / "notes.md").write_text("x")
        match = r"the folder holds no \.jsonl/\.json"
    elif case == "no match":
        path = tmp_path / "*.jsonl"
        match = "the pattern matches no file"
    elif case == "bad json":
        path.write_text('{"text": "a"}\n{"text": \n')
        match = r"cannot read 1 file\(s\) as 'json'"
    elif case == "blank lines only":
        dataset, path = "text", tmp_path / "d.txt"
        path.write_text("\n  \n\n")
        match = "no document has any text"
    elif case == "not text":
        path.write_text('{"text": 3}\n{"text": 4}\n')
        match = "document 0 has a int 'text', not text"
    with pytest.raises(ValueError, match=match) as exc:
        (it,) = loaders(1, 2, 16, dataset, path)
        next(it)
    _one_line(exc)


@pytest.mark.parametrize("case", ["no folder", "no tokenizer.json", "bad json"])
def test_bad_assets_are_one_line_errors(case: str, tmp_path: Path) -> None:
    path, match = tmp_path, ""
    if case == "no folder":
        path, match = tmp_path / "nope", r"hf_assets_path='.*nope' is not a folder"
    elif case == "no tokenizer.json":
        (tmp_path / "config.json").write_text("{}")
        match = r"has no tokenizer.json \(it holds \['config.json'\]\)"
    else:
        (tmp_path / "tokenizer.json").write_text("{not json")
        match = r"hf_assets_path: cannot read .*tokenizer.json"
    with pytest.raises(ValueError, match=match) as exc:
        HuggingFaceTokenizer(str(path))
    _one_line(exc)


def test_a_tokenizer_without_bos_and_eos_cannot_pack(tmp_path: Path, auto: Any) -> None:
    """Without tokenizer_config.json there is no BOS or EOS: packing would join documents."""
    shutil.copy(TOKENIZER / "tokenizer.json", tmp_path)
    bare = HuggingFaceTokenizer(str(tmp_path))
    assert (bare.bos_id, bare.eos_id) == (None, None)
    assert bare.encode("a b", add_bos=True, add_eos=True) == auto("a b").input_ids  # nothing to add
    with pytest.raises(ValueError, match="has neither a BOS nor an EOS token") as exc:
        loaders(1, 1, 8, tokenizer=bare)
    _one_line(exc)
    # EOS only (as Qwen's tokenizers): documents end with EOS and start with no BOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    (eos_only,) = loaders(1, 1, 8, tokenizer=HuggingFaceTokenizer(str(tmp_path)))
    first = _texts()[0]
    assert next(eos_only)[0][0].tolist() == auto(first).input_ids[:8]


def test_config_errors_name_the_field() -> None:
    from torchtitan_spmd.config import DataloaderConfig

    with pytest.raises(ValueError, match=r"dataloader.dataset: invalid value 'jsonl'; valid choices are 'synthetic', "
                                         r"'c4_test', 'text', 'json', 'parquet'. Did you mean 'json'\?"):
        DataloaderConfig(dataset="jsonl")
    with pytest.raises(ValueError, match="dataloader.dataset='c4' is torchtitan's download of allenai/c4"):
        DataloaderConfig(dataset="c4")
    with pytest.raises(ValueError, match="dataloader.dataset='json' needs dataloader.dataset_path"):
        DataloaderConfig(dataset="json")
    with pytest.raises(ValueError, match="dataloader.dataset_path='x.jsonl' needs a file dataset"):
        DataloaderConfig(dataset_path="x.jsonl")
    with pytest.raises(ValueError, match="synthetic data .* is byte-level; a tokenizer from hf_assets_path"):
        build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=1, seq_len=8, seed=0,
                         tokenizer=HuggingFaceTokenizer(str(TOKENIZER)))


def test_a_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    for mod in ("tokenizers", "datasets", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, mod, None)  # what an absent package looks like to import
    with pytest.raises(MissingExtraError, match=r"hf_assets_path .* needs the 'tokenizers' package: "
                                                r'pip install -e "\.\[hf\]" \(in ') as exc:
        HuggingFaceTokenizer(str(TOKENIZER))
    assert isinstance(exc.value, ImportError) and isinstance(exc.value, ValueError)  # a setup error (exit 2)
    with pytest.raises(MissingExtraError, match=r"dataloader.dataset='json' needs the 'datasets' package: "
                                                r'pip install -e "\.\[hf\]" \(in '):
        loaders(1, 1, 8, tokenizer=object())
    with pytest.raises(MissingExtraError, match=r"metrics.enable_tensorboard needs the 'torch.utils.tensorboard' "
                                                r'package: pip install -e "\.\[tensorboard\]" \(in '):
        require("torch.utils.tensorboard", "tensorboard", "metrics.enable_tensorboard")


# ------------------------------------------------------------------ TensorBoard
def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    from torchtitan_spmd.config import MetricsConfig
    from torchtitan_spmd.tools.metrics import TAGS, build_metrics_logger
    from torchtitan_spmd.train import StepRecord

    records = [StepRecord(step=s, loss=5.0 / s, grad_norm=1.5 + s, lr=1e-4 * s, tokens_per_s=100.0 * s,
                          peak_memory_mib=512.0 * s) for s in (1, 2, 3)]
    off = build_metrics_logger(MetricsConfig(), str(tmp_path / "off"), writes=True)
    other_rank = build_metrics_logger(MetricsConfig(enable_tensorboard=True), str(tmp_path / "r1"), writes=False)
    logger = build_metrics_logger(MetricsConfig(enable_tensorboard=True, save_tb_folder="board"), str(tmp_path),
                                  writes=True)
    for log in (off, other_rank, logger):
        for r in records:
            log.log(r)
        log.close()
    assert not (tmp_path / "off").exists() and not (tmp_path / "r1").exists()
    assert Path(logger.log_dir).parent == tmp_path / "board"
    scalars = read_scalars(tmp_path / "board")
    assert set(scalars) == set(TAGS)
    for tag, (attr, scale) in TAGS.items():
        want = [(r.step, getattr(r, attr) * scale) for r in records]
        assert [s for s, _ in scalars[tag]] == [1, 2, 3]
        assert all(abs(v - w) <= 1e-6 * abs(w) for (_, v), (_, w) in zip(scalars[tag], want, strict=True)), tag
    assert scalars["memory/max_active(GiB)"][1][1] == 1.0

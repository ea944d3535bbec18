"""Shared by the Hugging Face data tests: the shipped fixtures, the skip when the dev extra's
packages are absent, and TensorBoard's own reader."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TOKENIZER = ASSETS / "tokenizer"
C4_TEST = ASSETS / "c4_test" / "data.json"

#: What these tests need (the dev extra has them; a GPU box without them skips, naming them).
MISSING = [m for m in ("tokenizers", "datasets", "tensorboard", "transformers") if importlib.util.find_spec(m) is None]
NEEDS_HF = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)} (pip install -e '.[dev]')")


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the one event file under ``folder``, through TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(folder.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``datasets``' Arrow cache in a temporary folder for the module (forked ranks inherit it),
    not the user's ``~/.cache/huggingface``."""
    import datasets

    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf-datasets-cache")
    yield datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = saved

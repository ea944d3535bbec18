"""Layer 3: real checkpoint shapes (Llama 3.1 RoPE scaling, Llama 3.2 and Qwen3-0.6B tied
embeddings) in and out of the trainer, against transformers, on forked gloo ranks.

See ``hf_real_helpers.check``. The ``spmd_types`` rows run here too (``--backend``); tying
under pipeline parallelism is a setup error, as upstream.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_helpers import read_safetensors
from hf_real_helpers import MODELS, check, job, run, save_source, setup_errors, without_tensor
from parity_helpers import skip_full_dtensor_on_old_torch
from version_helpers import requires_torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.multiproc, requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor)")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {n: save_source(n, tmp_path_factory.mktemp(f"hf-{n}")) for n in MODELS}


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_real_shapes_fsdp2_tp2_match_transformers(backend: str, sources: dict[str, Path], tmp_path: Path) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    check(backend, "fsdp2_tp2", tmp_path, sources, MODELS)


@pytest.mark.parametrize("name", ["llama32_tied", "qwen3_tied"])
def test_tied_model_under_pp_is_a_setup_error_naming_the_alternative(name: str, sources: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    from torchtitan_spmd.train import validate_job

    with pytest.raises(ValueError, match=r"ties its embedding and output weights .*parallelism.pipeline_parallel_degree=2\): "
                                         r"train it without PP"):
        validate_job(job(name, "pp2_fsdp2", "default", sources[name], tmp_path), 4, "cpu")


@pytest.mark.backend("default")
def test_tied_training_under_tp_equals_one_process(sources: dict[str, Path], tmp_path: Path) -> None:
    """Two steps of the tied Qwen3 on FSDP 2 x TP 2 leave the one embedding/output weight (and every
    other) where one process leaves it: both uses' gradients reach the one parameter under TP."""
    import torch

    names = ("qwen3_tied",)
    tp = run("default", "fsdp2_tp2", tmp_path / "tp", sources, names)["qwen3_tied"]
    one = run("default", "single", tmp_path / "one", sources, names)["qwen3_tied"]
    assert tp["tokens"] == one["tokens"]
    assert sorted(tp["weights"]) == sorted(one["weights"]) and "output.weight" not in tp["weights"]
    for key in ("tok_embeddings.weight", "layers.0.attention.wq.weight"):
        gap = (torch.tensor(tp["weights"][key]) - torch.tensor(one["weights"][key])).abs().max().item()
        assert gap < 1e-4, (key, gap)  # an update is ~lr = 3e-3 per step
    source = read_safetensors(sources["qwen3_tied"])["model.embed_tokens.weight"]
    assert (torch.tensor(tp["weights"]["tok_embeddings.weight"]) - source).abs().max() > 1e-4  # it trained


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_llama31_pp2_fsdp2_matches_transformers(backend: str, sources: dict[str, Path], tmp_path: Path) -> None:
    """The Llama 3.1 shape at PP 2 x FSDP 2: each stage reads only its own tensors, step 1 gives
    transformers' loss, and the export writes the whole model once (``hf_real_helpers.check``)."""
    skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")  # the same data-parallel degree, 2
    check(backend, "pp2_fsdp2", tmp_path, sources, ("llama31",))


@pytest.mark.backend("default")
def test_tensor_missing_from_one_stage_stops_every_rank(sources: dict[str, Path], tmp_path: Path) -> None:
    """Under PP a folder lacking the last stage's ``lm_head`` is the same one-line error on every
    rank, the first stage's too (it holds no ``lm_head``): none waits in DCP's read."""
    src = without_tensor(sources["llama31"], tmp_path / "no-lm-head", "lm_head.weight")
    errors = setup_errors(job("llama31", "pp2_fsdp2", "default", src, tmp_path / "dump"), 4)
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert f"Hugging Face folder {str(src)!r} has no tensor 'lm_head.weight'" in errors[0], errors[0]

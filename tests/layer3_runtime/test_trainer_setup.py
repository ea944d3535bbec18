"""Layer 3: the trainer's set-up phases -- validation before any mesh or model, the model
contract's part names, build_model returning what it builds, setup errors agreed by every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchtitan_spmd import train
from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked
from torchtitan_spmd.models import get_model_spec, model_families
from torchtitan_spmd.techniques.pipeline_parallel import model_part_names


@pytest.mark.parametrize("family", sorted(model_families()))
def test_part_names_are_the_built_models(family: str) -> None:
    """ModelSpec.part_names (what PP validates against, before any model) names exactly the
    top-level parts of the model the family builds: the model contract."""
    spec = get_model_spec(family)
    for flavor in sorted(spec.flavors):
        if flavor == "from_hf":
            continue
        config = spec.model_config(flavor)
        with torch.device("meta"):
            model = spec.build(config)
        assert spec.part_names(config) == model_part_names(model), (family, flavor)


def _job(**parallelism: Any) -> JobConfig:
    job = JobConfig()
    job.model.flavor = "tiny"
    job.training.seq_len = 32
    job.training.local_batch_size = 2
    for key, value in parallelism.items():
        setattr(job.parallelism, key, value)
    return job


def test_validation_needs_no_mesh_and_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """validate_job checks a PP config (a wrong stage count) without building a mesh or a model."""
    def no(*_: Any, **__: Any) -> None:
        raise AssertionError("validation built a mesh or a model")

    monkeypatch.setattr("torchtitan_spmd.distributed.parallel_dims.ParallelDims.build_mesh", no)
    monkeypatch.setattr(torch.nn.Embedding, "__init__", no)  # every family's tok_embeddings
    setup = train.validate_job(_job(pipeline_parallel_degree=2, data_parallel_shard_degree=2), 4, "cpu")
    assert setup.stages is not None and setup.stages.num_stages == 2
    assert setup.stages.parts[0][0] == "tok_embeddings" and setup.stages.parts[-1][-1] == "output"
    assert setup.gradient_accumulation_steps == 1
    with pytest.raises(ValueError, match="1F1B.* single-stage schedule .* 4 stages, 2 a rank"):
        train.validate_job(_job(pipeline_parallel_degree=2, data_parallel_shard_degree=2,
                                pipeline_parallel_layers_per_stage=1), 4, "cpu")


@pytest.mark.parametrize(("field", "module", "extra"), [("enable_wandb", "wandb", "wandb"),
                                                      ("enable_tensorboard", "torch.utils.tensorboard", "tensorboard")])
def test_a_missing_metrics_extra_is_a_validation_error(monkeypatch: pytest.MonkeyPatch, field: str, module: str,
                                                       extra: str) -> None:
    """A metrics backend whose package is missing stops the run in validation (agreed by every rank,
    printed once), not later on each rank as its logger is built."""
    monkeypatch.setitem(__import__("sys").modules, module, None)  # import raises ImportError
    job = _job(data_parallel_shard_degree=2)
    setattr(job.metrics, field, True)
    with pytest.raises(ValueError, match=rf"metrics.{field} needs the '{module}' package: .*\[{extra}\]"):
        train.validate_job(job, 2, "cpu")


def test_ranges() -> None:
    assert train._ranges([0, 1, 2, 5]) == "0-2, 5"
    assert train._ranges([3]) == "3"
    assert train._ranges([0, 2, 3, 4, 7, 8]) == "0, 2-4, 7-8"


def _setup_error_worker(rank: int, world_size: int, fail_on: list[int]) -> str | None:
    original = train.validate_job

    def validate(job_config: JobConfig, ws: int, device: str) -> Any:
        if rank in fail_on:
            raise ValueError("model.hf_assets_path: no tokenizer.json on this node")
        return original(job_config, ws, device)

    train.validate_job = validate  # this forked rank's copy only
    try:
        trainer = train.Trainer(_job(data_parallel_shard_degree=world_size))
    except train.AgreedSetupError as err:
        dist.barrier()
        return str(err)
    trainer.close()
    return None


@pytest.mark.multiproc
@pytest.mark.parametrize(("fail_on", "want"), [
    ([1], "rank 1: model.hf_assets_path: no tokenizer.json on this node"),
    ([0, 1], "model.hf_assets_path: no tokenizer.json on this node"),
])
def test_setup_errors_are_agreed_by_every_rank(fail_on: list[int], want: str) -> None:
    """A setup error on some ranks reaches every rank, naming the ranks unless all had it: no
    rank waits for peers that stopped, and rank 0 alone prints the line (run_job)."""
    out = run_forked(_setup_error_worker, 2, fail_on, timeout_s=120)
    assert out == [want, want]


@pytest.mark.multiproc
def test_build_model_returns_what_it_builds() -> None:
    """Under PP 2 each rank's BuiltModel is its stage's part: the first holds tok_embeddings, the
    last norm and output, and together they are the whole model, each part once."""
    first, last = run_forked(_built_worker, 2, timeout_s=120)
    spec = get_model_spec("llama3")
    assert first[0] == "tok_embeddings" and last[-2:] == ["norm", "output"]
    assert first + last == spec.part_names(spec.model_config("tiny"))


def _built_worker(rank: int, world_size: int) -> list[str]:
    job = _job(pipeline_parallel_degree=2, pipeline_parallel_schedule="GPipe")
    trainer = train.Trainer(job)
    try:
        assert trainer.pipeline is not None and trainer.model_parts == [trainer.model]
        assert set(trainer.model.state_dict()) <= set(trainer.state_layouts)  # + non-persistent buffers
        return [n for n in model_part_names(trainer.model)]
    finally:
        trainer.close()

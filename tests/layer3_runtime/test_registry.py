"""The model registry: families selected by ``model.name``, flavours by ``model.flavor``, each
family's validation and ``config_registry`` jobs."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
from parity_helpers import warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed.parallel_dims import ParallelDims
from torchtitan_spmd.launcher import run_forked
from torchtitan_spmd.models import (
    BUILTIN_FAMILIES,
    ModelSpec,
    get_model_spec,
    model_families,
    register_model_spec,
)

#: family -> (model class name, config_registry functions)
JOBS = {
    "llama3": ("Transformer", ("llama3_405b", "llama3_70b", "llama3_8b", "llama3_debugmodel",
                               "llama3_debugmodel_flex_attn", "llama3_tiny",
                               # upstream's converter recipes (issue 42)
                               "llama3_8b_first_85_pct_layers_nvfp4", "llama3_8b_mxfp8",
                               "llama3_debugmodel_first_85_pct_layers_nvfp4", "llama3_debugmodel_float8",
                               "llama3_debugmodel_float8_emulate_lora", "llama3_debugmodel_nvfp4")),
    "qwen3": ("Qwen3Model", ("qwen3_0_6b", "qwen3_14b", "qwen3_1_7b", "qwen3_30b_a3b", "qwen3_32b",
                             "qwen3_debugmodel", "qwen3_moe_debug", "qwen3_moe_tiny", "qwen3_tiny",
                             "qwen3_debugmodel_first_85_pct_layers_nvfp4", "qwen3_debugmodel_nvfp4")),
    "deepseek_v3": ("DeepSeekV3Model", ("deepseek_v3_16b", "deepseek_v3_671b", "deepseek_v3_debugmodel",
                                        "deepseek_v3_tiny", "deepseek_v3_671b_float8",
                                        "deepseek_v3_debugmodel_mxfp8")),
}

#: jobs whose flavour is not the job's name after the family (upstream's names)
JOB_FLAVORS = {"qwen3_moe_debug": "debugmodel_moe", "llama3_8b": "8B", "llama3_70b": "70B", "llama3_405b": "405B",
               "qwen3_0_6b": "0.6B", "qwen3_1_7b": "1.7B", "qwen3_14b": "14B", "qwen3_32b": "32B",
               "qwen3_30b_a3b": "30B-A3B", "deepseek_v3_16b": "16B", "deepseek_v3_671b": "671B",
               "deepseek_v3_debugmodel": "debugmodel", "deepseek_v3_tiny": "tiny",
               # a converter recipe's flavour is its base recipe's
               "llama3_8b_first_85_pct_layers_nvfp4": "8B", "llama3_8b_mxfp8": "8B",
               "llama3_debugmodel_first_85_pct_layers_nvfp4": "debugmodel", "llama3_debugmodel_float8": "debugmodel",
               "llama3_debugmodel_float8_emulate_lora": "debugmodel", "llama3_debugmodel_nvfp4": "debugmodel",
               "qwen3_debugmodel_first_85_pct_layers_nvfp4": "debugmodel", "qwen3_debugmodel_nvfp4": "debugmodel",
               "deepseek_v3_671b_float8": "671B", "deepseek_v3_debugmodel_mxfp8": "debugmodel"}


def test_builtin_families() -> None:
    assert BUILTIN_FAMILIES == ("llama3", "qwen3", "deepseek_v3") == tuple(JOBS)
    for name in BUILTIN_FAMILIES:
        spec = get_model_spec(name)
        assert spec.name == name and {"debugmodel", "tiny"} <= set(spec.flavors)


def test_unknown_family_and_flavor_name_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown model.name 'llama'; valid names: 'llama3', 'qwen3', 'deepseek_v3'\. "
                                         r"Did you mean 'llama3'\?"):
        get_model_spec("llama")
    with pytest.raises(ValueError, match=r"unknown model.flavor 'debug' for model.name='qwen3'; "
                                         r"valid flavors: 0.6B, 1.7B, 14B, 30B-A3B, 32B, debugmodel, debugmodel_flex, "
                                         r"debugmodel_moe, moe_tiny, tiny, tiny_block_causal"):
        get_model_spec("qwen3").model_config("debug")


def test_a_fork_registers_its_own_family() -> None:
    llama3 = get_model_spec("llama3")
    spec = ModelSpec(name="my_llama", flavors={"small": llama3.flavors["tiny"]}, build=llama3.build,
                     sharding_plan=llama3.sharding_plan, validate=llama3.validate)
    from torchtitan_spmd.models import _REGISTERED

    register_model_spec(spec)
    try:
        assert get_model_spec("my_llama") is spec and model_families()[-1] == "my_llama"
        with pytest.raises(ValueError, match="already registered"):
            register_model_spec(spec)
        with pytest.raises(ValueError, match="already registered"):
            register_model_spec(replace(spec, name="qwen3"))
    finally:
        _REGISTERED.pop("my_llama")


def test_vocab_size_override() -> None:
    assert get_model_spec("qwen3").model_config("tiny", vocab_size=512).vocab_size == 512
    assert get_model_spec("qwen3").flavors["tiny"].vocab_size == 320


@pytest.mark.parametrize(("family", "field", "value", "what"), [
    ("llama3", "n_kv_heads", 1, "model n_kv_heads=1"),
    ("qwen3", "hidden_dim", 191, "model hidden_dim=191"),
    ("qwen3", "vocab_size", 321, "vocab size=321"),
])
def test_each_family_validates_its_own_fields(family: str, field: str, value: int, what: str) -> None:
    spec = get_model_spec(family)
    config = replace(spec.flavors["tiny"], **{field: value})
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2,
                      spmd_backend="default", device_type="cpu")
    job = JobConfig.from_dict({"training": {"seq_len": 32}})
    with pytest.raises(ValueError, match=f"{what} is not divisible by parallelism.tensor_parallel_degree=2"):
        spec.validate(config, job, pd)
    spec.validate(spec.flavors["tiny"], job, pd)  # the flavour itself is fine
    job.training.seq_len = 31  # sequence parallel splits the sequence too
    with pytest.raises(ValueError, match="training.seq_len=31"):
        spec.validate(spec.flavors["tiny"], job, pd)


@pytest.mark.parametrize("family", sorted(JOBS))
def test_config_registry_jobs(family: str) -> None:
    module = importlib.import_module(f"torchtitan_spmd.models.{family}.config_registry")
    names = JOBS[family][1]
    assert sorted(module.__all__) == sorted(names)
    for name in names:
        cfg = getattr(module, name)()
        assert isinstance(cfg, JobConfig)
        assert (cfg.model.name, cfg.model.flavor) == (family, JOB_FLAVORS.get(name, name.split("_", 1)[1]))
        get_model_spec(cfg.model.name).model_config(cfg.model.flavor)  # a valid flavour


def _train_job(rank: int, world: int, family: str) -> tuple[str, list[float]]:
    from torchtitan_spmd.train import Trainer

    cfg = importlib.import_module(f"torchtitan_spmd.models.{family}.config_registry").__dict__[f"{family}_tiny"]()
    cfg.training.steps = 3
    cfg.training.device = "cpu"
    trainer = Trainer(cfg)
    return type(trainer.model).__name__, [r.loss for r in trainer.run()]


@pytest.mark.multiproc
@pytest.mark.parametrize("family", sorted(JOBS))
def test_the_trainer_builds_the_family_of_the_config(family: str) -> None:
    warm_parent()
    (result,) = run_forked(_train_job, 1, family, timeout_s=120)
    cls, losses = result
    assert cls == JOBS[family][0]
    assert len(losses) == 3 and losses[-1] < losses[0]

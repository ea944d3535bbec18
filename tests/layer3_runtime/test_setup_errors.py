"""Layer 3: unsupported combinations and bad plans fail at setup with clear errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed.layout import S, SpmdLayout
from torchtitan_spmd.distributed.plan import ModulePlan, Redistribute, ShardingPlan
from torchtitan_spmd.distributed.representation import get_representation
from torchtitan_spmd.launcher import WorkerError, run_forked


def _cfg(backend: str, **parallelism: int) -> JobConfig:
    return JobConfig.from_dict(
        {
            "model": {"flavor": "tiny"},
            "training": {"steps": 1, "local_batch_size": 1, "seq_len": 16, "device": "cpu"},
            "parallelism": {"spmd_backend": backend, **parallelism},
        }
    )


def test_unimplemented_config_values_stop_the_trainer_at_setup() -> None:
    from torchtitan_spmd.train import Trainer

    cfg = _cfg("default")
    cfg.training.enable_cpu_offload = True
    with pytest.raises(ValueError, match="training.enable_cpu_offload=True: FSDP CPU offload is not implemented"):
        Trainer(cfg)  # before any process group or model exists
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"training.global_batch_size": 6}, ["training.global_batch_size=6", "local_batch_size=1",
                                             "data-parallel degree 4", "(= 4)"]),
        ({"training.global_batch_size": 2}, ["training.global_batch_size=2", "(= 4)"]),
        ({"compile.enable": True, "compile.components": ["model", "optimizer"]},
         ["compile.components", "'optimizer'", "'model', 'loss'"]),
        ({"compile.enable": True, "compile.backend": "inductorx"},
         ["compile.backend='inductorx'", "inductor"]),
    ],
)
def test_bad_training_feature_values_fail_at_setup(fake_pg: Callable[[int], None], fields: dict,
                                                   needles: list[str]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(4)
    cfg = _cfg("default", data_parallel_shard_degree=4)
    for key, value in fields.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ValueError) as err:
        Trainer(cfg)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_an_activation_checkpointing_mode_that_does_not_exist_is_rejected() -> None:
    from torchtitan_spmd.config import ActivationCheckpointConfig
    from torchtitan_spmd.techniques.activation_checkpoint import apply_ac

    with pytest.raises(ValueError, match=r"activation_checkpoint\.mode.*'everything'"):
        JobConfig.from_dict({"activation_checkpoint": {"mode": "everything"}})
    bad = ActivationCheckpointConfig()
    object.__setattr__(bad, "mode", "everything")  # past the config's own check
    with pytest.raises(ValueError, match=r"activation_checkpoint\.mode='everything': .* use 'selective', 'none' or 'full'"):
        apply_ac(nn.Sequential(), bad)


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_tp_degree_must_divide_the_model(backend: str) -> None:
    from torchtitan_spmd.train import Trainer

    def make(rank: int, world: int) -> str:
        try:
            Trainer(_cfg(backend, tensor_parallel_degree=3, data_parallel_shard_degree=1))
        except ValueError as err:
            return str(err)
        return "no error"

    messages = run_forked(make, 3)
    assert all("not divisible by parallelism.tensor_parallel_degree=3" in m for m in messages), messages


def test_mismatched_configs_across_ranks_fail_fast() -> None:
    from torchtitan_spmd.train import Trainer

    def make(rank: int, world: int) -> None:
        cfg = _cfg("default", data_parallel_shard_degree=2)
        cfg.training.seq_len = 16 if rank == 0 else 32
        Trainer(cfg)

    with pytest.raises(WorkerError) as err:
        run_forked(make, 2, timeout_s=60)
    assert "ranks were started with different configs" in str(err.value)
    assert "training.seq_len" in str(err.value)


def test_unknown_flavor_lists_the_valid_ones() -> None:
    from torchtitan_spmd.models.llama3 import build_model

    with pytest.raises(ValueError, match="debugmodel"):
        build_model("debug_model", seed=0)


def test_get_representation_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="valid choices are 'default', 'full_dtensor', 'spmd_types'"):
        get_representation("fsdp")
    # The registry names the module: a backend whose module is absent (a stack prefix
    # without the spmd_types layer) is a clear error, not an ImportError.
    from torchtitan_spmd.config import backends

    monkeypatch.setitem(backends._REGISTRY, "spmd_types", dataclasses.replace(
        backends.backend("spmd_types"), module="torchtitan_spmd.distributed._absent_spmd_types"))
    with pytest.raises(ValueError, match=r"has no runtime in this build \(torchtitan_spmd\.distributed\._absent_"):
        get_representation("spmd_types")


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_plan_pattern_matching_nothing() -> None:
    plan = ShardingPlan({"proj": ModulePlan(), "missing.*": ModulePlan()})
    with pytest.raises(ValueError, match="'missing.\\*' matches no module"):
        plan.resolve(_Tiny())


def test_plan_unknown_parameter() -> None:
    plan = ShardingPlan({"proj": ModulePlan(params={"bias": SpmdLayout({"tp": S(0)})})})
    with pytest.raises(ValueError, match="lays out 'bias'.*has only \\['weight'\\]"):
        plan.resolve(_Tiny())


def test_plan_module_matched_twice() -> None:
    plan = ShardingPlan({"proj": ModulePlan(), "pro*": ModulePlan()})
    with pytest.raises(ValueError, match="matches two plan patterns"):
        plan.resolve(_Tiny())


def test_plan_types_are_checked() -> None:
    with pytest.raises(TypeError, match="must be an SpmdLayout"):
        ModulePlan(params={"weight": "S(0)"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="Redistribute.dst must be an SpmdLayout"):
        Redistribute(SpmdLayout(), None)  # type: ignore[arg-type]


def test_wildcards_do_not_span_dots() -> None:
    from torchtitan_spmd.distributed.plan import fqn_matches

    assert fqn_matches("layers.*", "layers.0")
    assert not fqn_matches("layers.*", "layers.0.attention")
    assert fqn_matches("", "") and not fqn_matches("", "layers")


@pytest.mark.backend("full_dtensor")
def test_full_dtensor_rejects_plain_tensors_at_module_boundaries() -> None:
    from torchtitan_spmd.train import Trainer

    def make(rank: int, world: int) -> str:
        trainer = Trainer(_cfg("full_dtensor", data_parallel_shard_degree=1))
        tokens = torch.zeros(1, 16, dtype=torch.long)
        try:
            trainer.model(tokens)
        except TypeError as err:
            return str(err)
        return "no error"

    (message,) = run_forked(make, 1)
    assert "plain torch.Tensor reached" in message and "prepare_inputs" in message


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_sequence_parallel_needs_tp_to_divide_seq_len(fake_pg: Callable[[int], None], backend: str,
                                                      model: str) -> None:
    """Without this check the real run dies with SIGABRT in the sequence-parallel all-gather."""
    from torchtitan_spmd.train import Trainer

    fake_pg(2)
    cfg = _cfg(backend, tensor_parallel_degree=2, data_parallel_shard_degree=1)
    cfg.model.name = model
    cfg.training.seq_len = 15
    assert cfg.parallelism.enable_sequence_parallel
    with pytest.raises(ValueError) as err:
        Trainer(cfg)
    assert str(err.value) == "training.seq_len=15 is not divisible by parallelism.tensor_parallel_degree=2."

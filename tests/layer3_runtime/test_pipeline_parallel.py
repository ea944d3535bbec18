"""Layer 3: pipeline parallelism (torch's pipelining) on real gloo ranks against the independent reference.

The reference (``torchtitan_spmd/reference.py``) has no pipeline code: the one-process model in
float64. Each PP cell must reproduce its losses (1e-5) and gradient norms (1e-4) on the same global
batch; a checkpoint saved under PP resumes without PP, with the model's own keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from checkpoint_helpers import ck_config
from parity_helpers import (
    NORM_TOL,
    TOL,
    check_grad_norms,
    job_config,
    max_rel,
    reference,
    reference_with_trace,
    run_config,
)

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.techniques.pipeline_parallel import generate_llm_fqn_per_model_part

STEPS = 4

#: name -> (world, parallelism, local batch, global batch)
def _pp2(schedule: str, *, dp_shard: int = 2, tp: int = 1) -> dict[str, Any]:
    return {"data_parallel_shard_degree": dp_shard, "tensor_parallel_degree": tp, "pipeline_parallel_degree": 2,
            "pipeline_parallel_schedule": schedule}


PP_CELLS: dict[str, tuple[int, dict[str, Any], int, int]] = {
    "pp2_fsdp2_1f1b": (4, _pp2("1F1B"), 2, 4),
    "pp2_tp2_gpipe": (4, _pp2("GPipe", dp_shard=1, tp=2), 2, 2),
    # two accumulation steps of two microbatches each: with FSDP 2 (global 8 = 2 rows x 2 data-parallel
    # ranks x 2), and pp only (global 4 = 2 rows x 2)
    "pp2_fsdp2_gpipe_accumulation": (4, _pp2("GPipe"), 2, 8),
    "pp2_gpipe_accumulation": (2, _pp2("GPipe", dp_shard=1), 2, 4),
    # two stages a rank (tiny: [embedding], [layers.0], [layers.1], [norm, output]), each its own FSDP root
    **{f"pp2_fsdp2_{s.lower()}": (4, _pp2(s), 2, 4)
       for s in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")},
    # DualPipeV needs as many microbatches as stages (4)
    "pp2_fsdp2_dualpipev": (4, _pp2("DualPipeV"), 4, 8),
}


def _pp_config(name: str, steps: int = STEPS) -> tuple[JobConfig, int, int]:
    world, par, local, global_batch = PP_CELLS[name]
    cfg = job_config("default", par, local_batch=local, steps=steps)
    cfg.training.global_batch_size = global_batch
    return cfg, world, global_batch


@pytest.mark.parametrize("cell", list(PP_CELLS))
def test_pipeline_parallel_matches_the_reference(cell: str) -> None:
    cfg, world, global_batch = _pp_config(cell)
    got = run_config(cfg, world)  # every rank logs the same (loss, grad norm), rank 0 included; the schedule class checked
    ref, ref_trace = reference_with_trace(global_batch, steps=STEPS)
    check_grad_norms(got, ref_trace, cell)  # every stage's parameters, pooled over the ranks
    assert max_rel([g[0] for g in got], [r[0] for r in ref]) < TOL, (got, ref)
    assert max_rel([g[1] for g in got], [r[1] for r in ref]) < NORM_TOL, (got, ref)


@pytest.mark.parametrize("cell", ["pp2_fsdp2_1f1b", "pp2_fsdp2_interleaved1f1b"])
def test_a_pp_checkpoint_has_the_model_keys_and_resumes_without_pp(tmp_path: Path, cell: str) -> None:
    import torch.distributed.checkpoint as dcp

    from torchtitan_spmd.models import get_model_spec

    world, par, local, global_batch = PP_CELLS[cell]
    # "single" is the one-process layout of checkpoint_helpers; its local batch is the global batch (4)
    saved = ck_config("default", "single", tmp_path, steps=2, interval=2, last_save_model_only=False)
    for key, value in par.items():
        setattr(saved.parallelism, key, value)
    saved.training.local_batch_size = local
    run_config(saved, world)
    step2 = tmp_path / "checkpoint" / "step-2"
    keys = set(dcp.FileSystemReader(str(step2)).read_metadata().state_dict_metadata)
    model = get_model_spec("llama3").build(get_model_spec("llama3").flavors["tiny"])
    names = {n for n, _ in model.named_parameters()}
    model_keys = {k for k in keys if k.split(".")[0] in {"tok_embeddings", "layers", "norm", "output"}}
    assert not [k for k in keys - model_keys if any(k.endswith("." + n) for n in names)]
    assert model_keys == names, sorted(model_keys ^ names)  # the FQNs of the whole model, no stage prefix

    resumed = ck_config("default", "single", tmp_path, steps=STEPS, interval=2)
    got = run_config(resumed, 1)
    ref = reference(global_batch, steps=STEPS)
    assert len(got) == STEPS - 2
    assert max_rel([g[0] for g in got], [r[0] for r in ref[2:]]) < TOL, (got, ref)
    assert max_rel([g[1] for g in got], [r[1] for r in ref[2:]]) < NORM_TOL, (got, ref)


def test_a_checkpoint_without_pp_resumes_under_pp(tmp_path: Path) -> None:
    world, par, local, global_batch = PP_CELLS["pp2_fsdp2_1f1b"]
    run_config(ck_config("default", "single", tmp_path, steps=2, interval=2, last_save_model_only=False), 1)
    resumed = ck_config("default", "single", tmp_path, steps=STEPS, interval=2)
    resumed.parallelism.data_parallel_shard_degree = 2
    resumed.parallelism.pipeline_parallel_degree = 2
    resumed.training.local_batch_size = local
    got = run_config(resumed, world)
    ref = reference(global_batch, steps=STEPS)
    assert len(got) == STEPS - 2
    assert max_rel([g[0] for g in got], [r[0] for r in ref[2:]]) < TOL, (got, ref)
    assert max_rel([g[1] for g in got], [r[1] for r in ref[2:]]) < NORM_TOL, (got, ref)


def test_upstreams_split_rule() -> None:
    # 8 layers on 4 stages, the embedding and the output one layer each: 10 effective, 3-3-2-2.
    assert generate_llm_fqn_per_model_part(4, 8) == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "layers.4"],
        ["layers.5", "layers.6"], ["layers.7", "norm", "output"],
    ]
    assert generate_llm_fqn_per_model_part(2, 2, 0, 0) == [
        ["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    assert generate_llm_fqn_per_model_part(1, 2) == [["tok_embeddings", "layers.0", "layers.1", "norm", "output"]]


def _cfg(backend: str = "default", flavor: str = "tiny", ac: str = "none", **parallelism: Any) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"flavor": flavor},
        "activation_checkpoint": {"mode": ac},
        "training": {"steps": 1, "local_batch_size": 2, "seq_len": 16, "device": "cpu"},
        "parallelism": {"spmd_backend": backend, "data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2,
                        **parallelism},
    })


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"pipeline_parallel_schedule": "Nope"}, ["pipeline_parallel_schedule='Nope'", "unknown", "'GPipe'",
                                                  "'Interleaved1F1B'", "'DualPipeV'"]),
        ({"pipeline_parallel_schedule": "PipelineScheduleMulti"}, ["'PipelineScheduleMulti'", "abstract",
                                                                   "'LoopedBFS'"]),
        ({"pipeline_parallel_schedule": "ZBVZeroBubble", "pipeline_parallel_layers_per_stage": 1,
          "flavor": "debugmodel"}, ["'ZBVZeroBubble' places 2 stages a rank", "8 stages, 4 a rank"]),
        ({"pipeline_parallel_schedule": "ZBVZeroBubble", "ac": "selective"},
         ["'ZBVZeroBubble' splits each backward", "activation_checkpoint.mode='selective'", "'LoopedBFS'"]),
        ({"pipeline_parallel_schedule": "DualPipeV", "ac": "full"}, ["'DualPipeV' with 2 microbatches",
                                                       "pipeline_parallel_microbatch_size", "4 stages"]),
        ({"pipeline_parallel_schedule": "Interleaved1F1B", "pipeline_parallel_layers_per_stage": 2},
         ["multi-stage", "pipeline_parallel_layers_per_stage=2", "2 stages, 1 a rank"]),
        ({"pipeline_parallel_layers_per_stage": 1}, ["single-stage", "pipeline_parallel_layers_per_stage=1",
                                                     "4 stages, 2 a rank"]),
        ({"pipeline_parallel_layers_per_stage": 4}, ["pipeline_parallel_layers_per_stage=4", "1 stages",
                                                     "not a multiple of pipeline_parallel_degree=2"]),
        ({"pipeline_parallel_first_stage_less_layers": 5}, ["pipeline_parallel_first_stage_less_layers=5",
                                                            "exceeds the 4"]),
        ({"pipeline_parallel_microbatch_size": 3}, ["pipeline_parallel_microbatch_size=3",
                                                    "training.local_batch_size=2"]),
        ({"pipeline_parallel_schedule_csv": "/no/such/schedule.csv"}, ["pipeline_parallel_schedule_csv",
                                                                       "/no/such/schedule.csv", "no such file"]),
        ({"module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["layers.9", "norm", "output"]]},
         ["module_fqns_per_model_part[1]", "'layers.9'", "'layers.1'"]),
        ({"module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["norm", "output"]]},
         ["module_fqns_per_model_part", "['layers.1']", "no part"]),
    ],
)
def test_bad_pipeline_config_is_a_setup_error(fake_pg: Callable[[int], None], overrides: dict[str, Any],
                                              needles: list[str]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(4)
    backend = overrides.pop("spmd_backend", "default")
    with pytest.raises(ValueError) as err:
        Trainer(_cfg(backend, **overrides))  # type: ignore[arg-type]
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_a_layers_per_stage_that_fits_builds(fake_pg: Callable[[int], None]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(4)
    with closing(Trainer(_cfg(pipeline_parallel_layers_per_stage=2))) as trainer:
        assert trainer.pipeline is not None and trainer.pipeline.module_names == [["tok_embeddings", "layers.0"]]


def test_a_looped_schedule_places_upstreams_stages(fake_pg: Callable[[int], None]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(4)  # this process is pp rank 0 of 2: loop style stages 0 and 2, V style 0 and 3
    with closing(Trainer(_cfg(pipeline_parallel_schedule="Interleaved1F1B"))) as trainer:
        looped = trainer.pipeline
    assert looped is not None and looped.stage_indices == [0, 2]
    assert looped.module_names == [["tok_embeddings"], ["layers.1"]]
    with closing(Trainer(_cfg(pipeline_parallel_schedule="gpipe"))) as trainer:
        assert trainer.pipeline is not None and trainer.pipeline.schedule_name == "GPipe"
    with closing(Trainer(_cfg(pipeline_parallel_schedule="ZBVZeroBubble"))) as trainer:
        v_shaped = trainer.pipeline
    assert v_shaped is not None and v_shaped.stage_indices == [0, 3]
    assert v_shaped.module_names == [["tok_embeddings"], ["norm", "output"]]


def test_pp_not_dividing_the_world_is_a_setup_error(fake_pg: Callable[[int], None]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(6)
    with pytest.raises(ValueError, match="pipeline_parallel_degree|pp") as err:
        Trainer(_cfg(data_parallel_shard_degree=-1, pipeline_parallel_degree=4))
    assert "6" in str(err.value) and "4" in str(err.value)


def test_a_stage_view_shares_the_parts_tensors_and_has_its_own_hooks() -> None:
    import torch

    from torchtitan_spmd.models import get_model_spec
    from torchtitan_spmd.techniques.pipeline_parallel import split_module, stage_view

    spec = get_model_spec("llama3")
    config = dataclasses.replace(spec.flavors["tiny"], max_seq_len=8)  # as the trainer: max_seq_len = seq_len
    part = split_module(spec.build(config), ["tok_embeddings", "layers.1"])  # a looped rank's part
    first, second = stage_view(part, ["tok_embeddings"]), stage_view(part, ["layers.1"])
    assert type(first) is type(part) and first.layers is not part.layers and first.output is None
    assert list(first.state_dict()) == ["tok_embeddings.weight"]  # the model's FQNs
    assert set(second.state_dict()) == {k for k in part.state_dict() if k.startswith("layers.1.")}
    assert second.layers["1"] is part.layers["1"]  # shared modules, so shared parameters
    assert first.tok_embeddings.weight is part.tok_embeddings.weight
    calls: list[str] = []
    first.register_forward_pre_hook(lambda *_: calls.append("first"))
    second.register_forward_pre_hook(lambda *_: calls.append("second"))
    h = first(torch.randint(0, 320, (1, 8)))
    second(h)
    assert calls == ["first", "second"]  # FSDP's root hooks of one stage never run for another
    assert h.shape == (1, 8, 64)

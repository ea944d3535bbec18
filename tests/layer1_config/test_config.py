"""Layer 1: the config sections (torchtitan's surface) and their validation.

``UPSTREAM`` is written from pytorch/torchtitan's ``torchtitan/config/configs.py`` and
``CheckpointManager.Config`` at a0c831c49: every field, its type and its default, in order.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import textwrap
import typing
import warnings
from typing import Any, Literal

import pytest

import torchtitan_spmd.config as config_pkg
import torchtitan_spmd.config.configs as configs
from torchtitan_spmd.config import (
    SPMD_BACKENDS,
    ActivationCheckpointConfig,
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    DebugConfig,
    FaultToleranceConfig,
    JobConfig,
    OptimizerConfig,
    ParallelismConfig,
    SpmdTypecheckingWarning,
    TrainingConfig,
)

_BF16_F32 = Literal["bfloat16", "float32"]

UPSTREAM: dict[type, list[tuple[str, Any, Any]]] = {
    TrainingConfig: [
        # Typed ``int | None`` here: None means "not set", resolved on construction against
        # the August token fields (one setting each); read back as upstream's ints.
        ("local_batch_size", int | None, 8),
        ("global_batch_size", int | None, -1),
        ("seq_len", int | None, 2048),
        ("max_norm", float | int, 1.0),
        ("steps", int, 10000),
        ("enable_cpu_offload", bool, False),
        ("dtype", _BF16_F32, "float32"),
        ("mixed_precision_param", _BF16_F32, "bfloat16"),
        ("mixed_precision_reduce", Literal["float32"], "float32"),
        ("gc_freq", int, 50),
        ("gc_debug", bool, False),
    ],
    ParallelismConfig: [
        ("data_parallel_replicate_degree", int, 1),
        ("data_parallel_shard_degree", int, -1),
        ("fsdp_reshard_after_forward", Literal["default", "always", "never"], "default"),
        ("enable_fsdp_symm_mem", bool, False),
        ("tensor_parallel_degree", int, 1),
        ("disable_loss_parallel", bool, False),
        ("enable_async_tensor_parallel", bool, False),
        ("enable_sequence_parallel", bool, True),
        # a0c831c49's choices plus b5bcd76's "partial_dtensor": upstream's own ConfigManager
        # (an August fork's) takes the choices from this Literal (test_surface_august.py)
        ("spmd_backend", Literal["default", "partial_dtensor", "full_dtensor", "spmd_types"], "default"),
        ("pipeline_parallel_degree", int, 1),
        ("module_fqns_per_model_part", list[list[str]] | None, None),
        ("pipeline_parallel_first_stage_less_layers", int, 1),
        ("pipeline_parallel_last_stage_less_layers", int, 1),
        ("pipeline_parallel_layers_per_stage", int | None, None),
        ("pipeline_parallel_schedule", str, "1F1B"),
        ("pipeline_parallel_schedule_csv", str | None, ""),
        ("pipeline_parallel_microbatch_size", int, 1),
        ("context_parallel_degree", int, 1),
        ("context_parallel_load_balancer", str | None, "headtail"),
        ("context_parallel_rotate_method", Literal["allgather", "alltoall"], "allgather"),
        ("expert_parallel_degree", int, 1),
    ],
    ActivationCheckpointConfig: [
        ("mode", Literal["selective", "full", "memory_budget", "none"], "selective"),
        ("per_op_sac_force_recompute_mm_shapes_by_fqns", list[str], ["moe.router.gate"]),
        ("early_stop", bool, False),
        ("memory_budget", float, 0.5),
        ("visualize_memory_budget_pareto", bool, False),
        ("preserve_rng_state", bool, True),
        ("determinism_check", str, "default"),
        ("debug", bool, False),
    ],
    CompileConfig: [
        ("enable", bool, False),
        ("components", list[str], ["model", "loss"]),
        ("backend", str, "inductor"),
    ],
    CommConfig: [
        ("init_timeout_seconds", int, 300),
        ("train_timeout_seconds", int, 100),
        ("trace_buf_size", int, 20000),
        ("save_traces_folder", str, "comm_traces"),
        ("save_traces_file_prefix", str, "rank_"),
        ("mode", Literal["default", "fake_backend", "local_tensor", "torchcomms"], "default"),
        ("fake_device_memory_gib", float, 80.0),
    ],
    DebugConfig: [
        ("seed", int | None, None),
        ("spmd_typechecking", bool, False),
        ("spmd_typechecking_steps", int | None, None),
        ("deterministic", bool, False),
        ("deterministic_warn_only", bool, False),
        ("moe_force_load_balance", bool, False),
        ("detect_anomaly", bool, False),
        ("batch_invariant", bool, False),
        ("print_config", bool, False),
        ("save_config_file", str | None, None),
        ("enable_structured_logging", bool, True),
    ],
    CheckpointConfig: [
        ("enable", bool, False),
        ("folder", str, "checkpoint"),
        ("interval", int, 500),
        ("initial_load_path", str | None, None),
        ("initial_load_model_only", bool, True),
        ("initial_load_in_hf", bool, False),
        ("initial_load_in_hf_quantized", bool, False),
        ("last_save_model_only", bool, True),
        ("last_save_in_hf", bool, False),
        ("export_dtype", Literal["float16", "bfloat16", "float32"], "float32"),
        ("async_mode", Literal["disabled", "async", "async_with_pinned_mem"], "disabled"),
        ("keep_latest_k", int, 10),
        ("load_step", int, -1),
        ("exclude_from_loading", list[str], []),
        ("enable_first_step_checkpoint", bool, False),
        ("create_seed_checkpoint", bool, False),
        ("load_only", bool, False),
    ],
    # upstream's TorchFTManager.Config then the experiment's FaultTolerance (torchtitan/experiments/torchft)
    FaultToleranceConfig: [
        ("enable", bool, False),
        ("process_group", str, "gloo"),
        ("process_group_timeout_ms", int, 10000),
        ("replica_id", int, 0),
        ("group_size", int, 0),
        ("min_replica_size", int, 1),
        ("semi_sync_method", str | None, None),
        ("sync_steps", int, 5),
        ("should_quantize", bool, False),
        ("fragment_sync_delay", int, 0),
        ("fragment_update_alpha", float, 0.0),
        ("module_fqns_per_model_fragment", list[list[str]], []),
        ("num_fragments", int, 1),
    ],
}

#: This library's own fields inside torchtitan's sections (``dataset``, ``dataset_path``:
#: torchtitan's ``[training]`` fields before a0c831c49 moved them to ``dataloader``).
OURS = {TrainingConfig: ["device", "dataset", "dataset_path"],
        ParallelismConfig: ["expert_tensor_parallel_degree"],
        CheckpointConfig: ["trust_checkpoint_folder", "lora_adapters_only"]}
#: Upstream b5bcd76's (August) fields, checked by tests/layer1_config/test_surface_august.py.
for _cls, _names in {
    TrainingConfig: ["num_tokens_per_microbatch_per_dp_rank", "num_tokens_per_train_step", "max_context_length",
                     "disable_cuda_graphs"],
    ParallelismConfig: ["num_pp_microbatches", "context_parallel_ptrr_mask_key"],
    CompileConfig: ["enable_async_tensor_parallel"],
}.items():
    OURS[_cls] = [*OURS.get(_cls, []), *_names]


@pytest.mark.parametrize("cls", list(UPSTREAM), ids=lambda c: c.__name__)
def test_sections_have_torchtitans_fields_types_and_defaults(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    instance = cls()
    got = [(f.name, hints[f.name], getattr(instance, f.name)) for f in dataclasses.fields(cls)]
    ours = OURS.get(cls, [])
    assert [g for g in got if g[0] not in ours] == UPSTREAM[cls]
    assert sorted(g[0] for g in got if g[0] in ours) == sorted(ours)
    assert all(f.kw_only for f in dataclasses.fields(cls))  # keyword-only, as torchtitan's


def test_importable_from_config_and_configs() -> None:
    for cls in UPSTREAM:
        assert getattr(config_pkg, cls.__name__) is cls
        assert getattr(configs, cls.__name__) is cls
    import torch

    assert config_pkg.TORCH_DTYPE_MAP == {
        "float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16,
    }


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string right after each annotated field) of ``cls``."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


@pytest.mark.parametrize("cls", [JobConfig, *JobConfig.section_types().values()], ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls: type) -> None:
    docs = _field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, missing


def test_field_docs_helper_sees_a_missing_docstring() -> None:
    @dataclasses.dataclass
    class Undocumented:
        a: int = 1
        """Documented."""
        b: int = 2

    assert _field_docs(Undocumented) == {"a": "Documented."}


def test_every_section_is_in_job_config() -> None:
    sections = JobConfig.section_types()
    assert set(UPSTREAM) <= set(sections.values())
    assert [*JobConfig.root_fields(), *sections] == [f.name for f in dataclasses.fields(JobConfig)]
    assert JobConfig().model.name == "llama3" and JobConfig().model.flavor == "debugmodel"


# --------------------------------------------------------------------------------------
# Validation (the Python API raises ValueError / TypeError naming the field).
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", SPMD_BACKENDS)
def test_each_backend_value_accepted(backend: str) -> None:
    assert ParallelismConfig(spmd_backend=backend).spmd_backend == backend  # type: ignore[arg-type]


def test_unknown_backend_names_field_value_choices_and_suggestion() -> None:
    with pytest.raises(ValueError) as err:
        ParallelismConfig(spmd_backend="spmd_type")  # type: ignore[arg-type]
    msg = str(err.value)
    assert "parallelism.spmd_backend" in msg and "'spmd_type'" in msg
    for choice in SPMD_BACKENDS:
        assert repr(choice) in msg
    assert "Did you mean 'spmd_types'?" in msg


def test_unknown_backend_rejected_on_assignment_too() -> None:
    p = ParallelismConfig()
    with pytest.raises(ValueError, match="full_dtensr"):
        p.spmd_backend = "full_dtensr"  # type: ignore[assignment]
    assert p.spmd_backend == "default"


def test_partial_dtensor_reads_back_as_written() -> None:
    p = ParallelismConfig(spmd_backend="partial_dtensor")  # type: ignore[arg-type]
    assert (p.spmd_backend, p.backend_name) == ("partial_dtensor", "default")


def test_sections_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ParallelismConfig(2)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cls", "kwargs", "needle"),
    [
        (ParallelismConfig, {"tensor_parallel_degree": "2"}, "expected int, got str"),
        (ParallelismConfig, {"tensor_parallel_degree": True}, "expected int, got bool"),
        (ParallelismConfig, {"enable_sequence_parallel": 1}, "expected bool, got int"),
        (ParallelismConfig, {"spmd_backend": 3}, "invalid value 3"),
        (ParallelismConfig, {"module_fqns_per_model_part": [["a"], "b"]}, "module_fqns_per_model_part[1]"),
        (ParallelismConfig, {"pipeline_parallel_layers_per_stage": "4"}, "expected int, got str"),
        (ParallelismConfig, {"context_parallel_rotate_method": "all2all"}, "Did you mean 'alltoall'?"),
        (CheckpointConfig, {"exclude_from_loading": "optimizer"}, "expected list[str], got str"),
        (CheckpointConfig, {"exclude_from_loading": ["optimizer", 3]}, "exclude_from_loading[1]: expected str"),
        (ActivationCheckpointConfig, {"mode": "partial"}, "'selective', 'full', 'memory_budget', 'none'"),
        (TrainingConfig, {"max_norm": "1"}, "expected float or int"),
        (CommConfig, {"mode": "fake_backnd"}, "Did you mean 'fake_backend'?"),
    ],
)
def test_wrong_types_name_the_field(cls: type, kwargs: dict, needle: str) -> None:
    with pytest.raises((TypeError, ValueError)) as err:
        cls(**kwargs)
    assert f"{cls.section_name}.{next(iter(kwargs))}" in str(err.value)  # type: ignore[attr-defined]
    assert needle in str(err.value)


def test_union_values_keep_their_type() -> None:
    assert type(TrainingConfig(max_norm=2).max_norm) is int  # float | int, as given
    assert type(TrainingConfig(max_norm=2.5).max_norm) is float
    assert ParallelismConfig(pipeline_parallel_schedule_csv=None).pipeline_parallel_schedule_csv is None


@pytest.mark.parametrize(
    ("cls", "field", "value", "needle"),
    [
        (ParallelismConfig, "tensor_parallel_degree", 0, "must be >= 1"),
        (ParallelismConfig, "data_parallel_shard_degree", -2, "or -1 to infer it"),
        (ParallelismConfig, "expert_parallel_degree", -1, "must be >= 1"),
        (ParallelismConfig, "context_parallel_load_balancer", "", "use None to disable"),
        (TrainingConfig, "steps", 0, "must be >= 1"),
        (TrainingConfig, "global_batch_size", 0, "or -1 for local_batch_size"),
        (TrainingConfig, "max_norm", -1.0, "must be a finite number >= 0"),
        (TrainingConfig, "max_norm", math.inf, "must be a finite number >= 0"),
        (OptimizerConfig, "lr", math.nan, "must be a finite number > 0"),
        (OptimizerConfig, "lr", -1.0, "must be a finite number > 0"),
        (OptimizerConfig, "lr", 0.0, "must be a finite number > 0"),
        (OptimizerConfig, "eps", 0.0, "must be a finite number > 0"),
        (OptimizerConfig, "eps", math.inf, "must be a finite number > 0"),
        (OptimizerConfig, "weight_decay", -0.1, "must be a finite number >= 0"),
        (DebugConfig, "seed", -5, "must be >= 0"),
        (DebugConfig, "seed", 2**64, "must be >= 0 and < 2**64"),
        (CommConfig, "init_timeout_seconds", 0, "must be in [1, "),
        (CommConfig, "init_timeout_seconds", 10**10, "must be in [1, "),
        (CommConfig, "trace_buf_size", -1, "must be >= 0"),
        (CheckpointConfig, "load_step", -2, "or -1 for the newest"),
        (ActivationCheckpointConfig, "memory_budget", 1.5, "must be in [0, 1]"),
        (ParallelismConfig, "pipeline_parallel_microbatch_size", 0, "must be >= 1"),
        (ParallelismConfig, "pipeline_parallel_layers_per_stage", 0, "or None to infer it"),
        (ParallelismConfig, "pipeline_parallel_first_stage_less_layers", -1, "must be >= 0"),
        (CheckpointConfig, "folder", " ", "cannot be empty"),
        (CheckpointConfig, "folder", "ck\0pt", "cannot contain a NUL character"),
        (CheckpointConfig, "folder", "runs/step-4", "cannot be named like a checkpoint (step-N or step-N.partial)"),
        (CheckpointConfig, "folder", "step-2.partial/", "cannot be named like a checkpoint"),
        (CheckpointConfig, "interval", -5, "must be >= 1"),
        (CheckpointConfig, "load_step", -7, "or -1 for the newest"),
        (CheckpointConfig, "interval", 0, "must be >= 1"),
        (CheckpointConfig, "keep_latest_k", 1, "0 (keep all) or >= 2"),
        (CheckpointConfig, "keep_latest_k", -1, "0 (keep all) or >= 2"),
        (CheckpointConfig, "exclude_from_loading", ["optimizer", "model"], "cannot contain 'model'"),
        (CommConfig, "train_timeout_seconds", 0, "must be in [1, "),
    ],
)
def test_range_checks_name_field_and_value(cls: type, field: str, value: Any, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        cls(**{field: value})
    msg = str(err.value)
    assert f"{cls.section_name}.{field}" in msg and repr(value) in msg and needle in msg  # type: ignore[attr-defined]


def test_fsdp_symmetric_memory_needs_a_capable_gpu() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("this GPU supports symmetric memory")
    with pytest.raises(ValueError, match="enable_fsdp_symm_mem=True needs a CUDA device"):
        ParallelismConfig(enable_fsdp_symm_mem=True)


def test_typechecking_with_pp_is_accepted() -> None:
    # Type checking per stage: each stage's forward is checked on its own (the runtime's tests).
    cfg = JobConfig(
        parallelism=ParallelismConfig(pipeline_parallel_degree=2, spmd_backend="spmd_types"),
        debug=DebugConfig(spmd_typechecking=True),
    )
    assert cfg.debug.spmd_typechecking and cfg.parallelism.pipeline_parallel_degree == 2


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_typechecking_without_spmd_types_warns_no_effect(backend: str) -> None:
    with pytest.warns(SpmdTypecheckingWarning, match="no effect") as rec:
        JobConfig(
            parallelism=ParallelismConfig(spmd_backend=backend),  # type: ignore[arg-type]
            debug=DebugConfig(spmd_typechecking=True),
        )
    assert rec[0].filename == __file__


def test_typechecking_with_spmd_types_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = JobConfig(
            parallelism=ParallelismConfig(spmd_backend="spmd_types"),
            debug=DebugConfig(spmd_typechecking=True),
        )
    assert cfg.debug.spmd_typechecking


def test_typechecking_steps_must_be_at_least_one_or_none() -> None:
    assert DebugConfig().spmd_typechecking_steps is None  # every step, as before
    assert DebugConfig(spmd_typechecking_steps=1).spmd_typechecking_steps == 1
    for bad in (0, -3):
        with pytest.raises(ValueError, match=rf"debug.spmd_typechecking_steps must be >= 1 .*got {bad}\."):
            DebugConfig(spmd_typechecking_steps=bad)
    with pytest.raises(TypeError, match="debug.spmd_typechecking_steps: expected int, got bool True"):
        DebugConfig(spmd_typechecking_steps=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="debug.spmd_typechecking_steps: expected int, got str"):
        JobConfig.from_dict({"debug": {"spmd_typechecking": True, "spmd_typechecking_steps": "2"}})


def test_typechecking_steps_without_typechecking_warns_no_effect() -> None:
    with pytest.warns(SpmdTypecheckingWarning, match=r"spmd_typechecking_steps=2 has no effect without "
                                                     r"debug.spmd_typechecking=True") as rec:
        JobConfig(parallelism=ParallelismConfig(spmd_backend="spmd_types"),
                  debug=DebugConfig(spmd_typechecking_steps=2))
    assert rec[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = JobConfig(parallelism=ParallelismConfig(spmd_backend="spmd_types"),
                        debug=DebugConfig(spmd_typechecking=True, spmd_typechecking_steps=2))
    assert cfg.debug.spmd_typechecking_steps == 2


def test_job_config_checks_section_types() -> None:
    with pytest.raises(TypeError, match="JobConfig.parallelism must be a ParallelismConfig, got DebugConfig"):
        JobConfig(parallelism=DebugConfig())  # type: ignore[arg-type]


def test_from_dict_roundtrip_covers_every_section() -> None:
    cfg = JobConfig.from_dict(
        {
            "parallelism": {"tensor_parallel_degree": 2, "module_fqns_per_model_part": [["a"], ["b"]]},
            "checkpoint": {"exclude_from_loading": ["optimizer"]},
            "activation_checkpoint": {"mode": "none"},
            "compile": {"components": ["model"]},
            "debug": {"seed": 3},
        }
    )
    again = JobConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert set(cfg.to_dict()) == {*JobConfig.section_types(), *JobConfig.root_fields()}


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        ({"paralelism": {}}, ["unknown config section [paralelism]", "Did you mean 'parallelism'"]),
        ({"checkpoint": {"enabled": True}}, ["[checkpoint]", "unknown key 'enabled'", "Did you mean 'enable'"]),
        ({"compile": 3}, ["[compile] must be a table"]),
    ],
)
def test_from_dict_errors(data: dict, needles: list[str]) -> None:
    with pytest.raises((TypeError, ValueError)) as err:
        JobConfig.from_dict(data)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize("cls", [JobConfig, *JobConfig.section_types().values()], ids=lambda c: c.__name__)
def test_a_none_default_is_not_described_as_another_value(cls: type) -> None:
    """``--help`` prints a field's dataclass default; a field whose default is None (resolved later)
    must not call another value "the default" (``-1 (the default)``, ``; default 8``) unless it
    says what None means (was: ``training.num_tokens_per_train_step``, shown "(default: None)")."""
    docs = _field_docs(cls)
    wrong = []
    for f in dataclasses.fields(cls):
        if f.default is not None:
            continue
        doc = " ".join(docs.get(f.name, "").split())
        called = [w for w in re.findall(r"([^\s(]+) \(the default\)", doc) if "None" not in w]
        numbered = re.search(r"\(default [^N)]|; default \d", doc)
        if called or (numbered and "unset" not in doc.lower() and "None" not in doc):
            wrong.append(f"{cls.__name__}.{f.name}: {doc[:120]}")
    assert not wrong, "\n".join(wrong)

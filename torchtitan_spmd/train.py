"""The trainer: ``torchrun --nproc-per-node=N -m torchtitan_spmd.train --module M --config C ...``.

Reads the layer-1 config (``--module llama3 --config llama3_debugmodel`` as upstream, or a
legacy ``--job.config_file F.toml``, then ``--section.field value`` overrides), builds the meshes (layer 2), the model family of
``model.name`` (flavour ``model.flavor``) with its sharding plan, and trains with
the tensor representation of ``parallelism.spmd_backend``. The composition of the
parallelism techniques is :meth:`Trainer.build_model`; one step is
:meth:`Trainer.step`. CPU runs use gloo; CUDA runs use nccl. Rank 0 logs one line
per step::

    step: 3  loss: 5.123456  grad_norm: 1.2345  lr: 4.0e-04  tps: 12345  memory: 812.3MiB
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import logging
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_spmd.checkpoint.manager import CheckpointManager, find_checkpoints
from torchtitan_spmd.config import (
    TORCH_DTYPE_MAP,
    ConfigManager,
    JobConfig,
    check_supported,
)
from torchtitan_spmd.config.manager import LIBRARY_FIRST
from torchtitan_spmd.data import build_dataloader, build_tokenizer, check_vocab_size
from torchtitan_spmd.distributed import comm
from torchtitan_spmd.distributed._mesh_compat import local_tensor_mode_active
from torchtitan_spmd.distributed.apply_plan import apply_plan
from torchtitan_spmd.distributed.inputs import document_positions, prepare_inputs, prepare_positions
from torchtitan_spmd.distributed.parallel_dims import ParallelDims
from torchtitan_spmd.distributed.representation import get_representation
from torchtitan_spmd.distributed.utils import (
    get_train_context,
    maybe_enable_amp,
    spmd_backend_scope,
)
from torchtitan_spmd.dry_run import (
    DryRunReport,
    SetupPhases,
    fake_world_size,
    run_dry_run,
    run_local_tensor,
)
from torchtitan_spmd.dry_run import dry_run as _dry_run_with
from torchtitan_spmd.models import get_model_spec, hf_config
from torchtitan_spmd.techniques.activation_checkpoint import apply_ac
from torchtitan_spmd.techniques.compile import (
    apply_compile,
    maybe_compile_loss,
    maybe_enable_async_tp,
    validate_async_tp,
    validate_compile,
)
from torchtitan_spmd.techniques.context_parallel import (
    ContextParallel,
    apply_context_parallel,
    validate_context_parallel,
)
from torchtitan_spmd.techniques.converters import (
    bind_converted,
    build_converters,
    convert_model,
    converter_plan,
)
from torchtitan_spmd.techniques.expert_parallel import (
    apply_expert_parallel,
    expert_parallel_plan,
    validate_expert_parallel,
)
from torchtitan_spmd.techniques.fault_tolerance import (
    FaultTolerance,
    ft_group_count,
    validate_fault_tolerance,
)
from torchtitan_spmd.techniques.fsdp import (
    apply_fsdp,
    set_gradient_sync,
)
from torchtitan_spmd.techniques.grad_norm import clip_grad_norm_
from torchtitan_spmd.techniques.loss import (
    cross_entropy_loss,
    global_loss_value,
    global_token_count,
    mask_document_boundaries,
)
from torchtitan_spmd.techniques.moe import (
    ExpertLoad,
    moe_blocks,
    set_force_load_balance,
    update_expert_bias,
)
from torchtitan_spmd.techniques.param_init import init_weights
from torchtitan_spmd.techniques.pipeline_parallel import (
    PipelineParallel,
    PipelineStages,
    StageBoundaries,
    states_of,
)
from torchtitan_spmd.tools.flops import flops_per_token, peak_flops
from torchtitan_spmd.tools.lr_scheduler import build_lr_scheduler
from torchtitan_spmd.tools.metrics import build_metrics_logger, check_metrics_extras
from torchtitan_spmd.tools.optimizer import build_optimizer, grouping, validate_param_groups
from torchtitan_spmd.tools.profiler import Profiler
from torchtitan_spmd.tools.signals import StoppedBySignal, StopRequest, signal_name
from torchtitan_spmd.tools.utils import GarbageCollection
from torchtitan_spmd.validate import ValidationRecord, Validator, validate_validator

if TYPE_CHECKING:
    from torchtitan_spmd.data.tokenizer import Tokenizer
    from torchtitan_spmd.distributed.plan import ShardingPlan
    from torchtitan_spmd.distributed.representation import StateLayout, TensorRepresentation
    from torchtitan_spmd.models import ModelSpec
    from torchtitan_spmd.models.state_dict_adapter import StateDictAdapter

logger = logging.getLogger("torchtitan_spmd")

__all__ = ["AgreedSetupError", "BuiltModel", "JobSetup", "NonFiniteStepError", "StepRecord", "Trainer",
           "build_optimizer", "compose_model", "degrees_line", "dry_run", "gradient_accumulation_steps", "main",
           "run_job", "validate_job"]


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step measured (identical on every rank except timing)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    peak_memory_mib: float
    #: MoE models: the step's fewest and most tokens of any expert (all ranks, all blocks).
    expert_load: ExpertLoad | None = None
    #: This rank's model TFLOP/s (upstream's FLOPs per token x tokens/s) and MFU (% of the peak).
    tflops: float | None = None
    mfu: float | None = None
    #: Seconds this step waited for its batch (the data loader).
    data_loading_s: float | None = None
    #: ``fault_tolerance.enable``: whether torchft committed the step (False: the weights did not
    #: change and the step is retried) and how many replica groups took part.
    committed: bool = True
    replica_groups: int | None = None

    def log_line(self) -> str:
        """The per-step log line; scripts parse ``step: <n>`` and ``loss: <float>``.

        MoE models add ``tokens/expert: <min>-<max>``."""
        line = (
            f"step: {self.step}  loss: {self.loss:.6f}  grad_norm: {self.grad_norm:.4f}  "
            f"lr: {self.lr:.2e}  tps: {self.tokens_per_s:.0f}  memory: {self.peak_memory_mib:.1f}MiB"
        )
        if self.tflops is not None and self.mfu is not None:
            line += f"  tflops: {self.tflops:.3f}  mfu: {self.mfu:.2f}%"
        if self.data_loading_s is not None:
            line += f"  data: {self.data_loading_s * 1e3:.1f}ms"
        if self.expert_load is not None:
            line += f"  tokens/expert: {self.expert_load.min}-{self.expert_load.max}"
        if self.replica_groups is not None:
            line += f"  groups: {self.replica_groups}{'' if self.committed else '  (not committed)'}"
        return line


def gradient_accumulation_steps(global_batch_size: int, local_batch_size: int, dp_degree: int, *,
                                num_pp_microbatches: int = 1) -> int:
    """Microbatches per step: ``global_batch_size / (local_batch_size * num_pp_microbatches * dp_degree)``
    (-1: 1), upstream b5bcd76's ``num_tokens_per_train_step / (num_tokens_per_microbatch_per_dp_rank *
    num_pp_microbatches * dp)`` counted in sequences (``num_pp_microbatches``: the pipeline microbatches
    of ``local_batch_size`` sequences an iteration, :attr:`PipelineStages.num_pp_microbatches`).

    Raises ``ValueError`` naming the fields when that is not a positive whole number.
    """
    per_microbatch = local_batch_size * num_pp_microbatches * dp_degree
    if global_batch_size < 0:
        return 1
    if global_batch_size < per_microbatch or global_batch_size % per_microbatch:
        pp = f" x parallelism.num_pp_microbatches={num_pp_microbatches}" if num_pp_microbatches != 1 else ""
        raise ValueError(
            f"training.global_batch_size={global_batch_size} must be a positive multiple of "
            f"training.local_batch_size={local_batch_size}{pp} x the data-parallel degree {dp_degree} "
            f"(= {per_microbatch}); the multiple is the number of gradient-accumulation microbatches."
        )
    return global_batch_size // per_microbatch


def _device_type(job_config: JobConfig) -> str:
    want = job_config.training.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device='cuda' but no CUDA device is visible; use 'cpu' or 'auto'.")
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return want


def _peak_memory_mib(device_type: str) -> float:
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _check_same_config(job_config: JobConfig) -> None:
    """Fail on every rank, naming the fields, if ranks were started with different configs."""
    mine = job_config.to_dict()
    mine["job"].pop("config_file", None)
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    diffs = []
    for rank, theirs in enumerate(everyone):
        if theirs is None:
            continue
        for section, table in mine.items():
            # a section's fields, or a root field (hf_assets_path) as itself
            pairs = table.items() if isinstance(table, dict) else [(None, table)]
            for key, value in pairs:
                other = theirs[section].get(key) if key is not None else theirs[section]
                if other != value:
                    name = f"{section}.{key}" if key is not None else section
                    diffs.append(f"{name}: rank {dist.get_rank()} has {value!r}, rank {rank} has {other!r}")
    if diffs:
        raise ValueError("ranks were started with different configs:\n  " + "\n  ".join(sorted(set(diffs))[:20]))


class NonFiniteStepError(ValueError):
    """A step's global loss or gradient norm is not finite: raised on every rank alike before
    the optimizer steps, so neither the parameters nor a checkpoint hold the poisoned update."""

    #: Read by :func:`run_job`: the same line is on every rank, so only rank 0 prints it.
    agreed = True

    def __init__(self, step: int, loss: float, grad_norm: float) -> None:
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(f"step {step}: the loss is {loss} and the gradient norm {grad_norm}: not finite, "
                         f"so the optimizer did not take step {step} and no checkpoint of it was written")


@dataclass
class JobSetup:
    """What :func:`validate_job` checked and derived from the config alone, the same on every
    rank: no mesh is built and no model exists yet (:class:`ParallelDims` holds the degrees).
    """

    parallel_dims: ParallelDims
    model_spec: ModelSpec
    model_config: Any
    tokenizer: Tokenizer
    representation: TensorRepresentation
    #: The sharding plan of the whole model (expert parallelism's restriction applied).
    plan: ShardingPlan
    #: The validated pipeline (None without pipeline parallelism).
    stages: PipelineStages | None
    gradient_accumulation_steps: int
    seed: int
    #: Sequences of one gradient-accumulation microbatch on one data-parallel rank: under pipeline
    #: parallelism the schedule's iteration (:attr:`PipelineStages.local_rows`), else
    #: ``training.local_batch_size``.
    local_rows: int


def packed_documents_eos(model_config: Any, tokenizer: Any, job_config: JobConfig) -> int | None:
    """The EOS id that splits packed documents when the model's ``attn_mask_type`` is
    ``"block_causal"`` (the tokenizer's ``eos_id``), else None. ValueError when the tokenizer
    has no EOS id (nothing would split the documents)."""
    if getattr(model_config, "attn_mask_type", "causal") != "block_causal":
        return None
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        raise ValueError(f"model {job_config.model.name}/{job_config.model.flavor} has attn_mask_type='block_causal', "
                         f"which splits documents at the tokenizer's EOS token, but the tokenizer of "
                         f"hf_assets_path={job_config.hf_assets_path!r} has no eos_id: name an EOS token in its "
                         "tokenizer_config.json, or use a flavour with attn_mask_type='causal'.")
    return int(eos)


def model_vocab_size(job_config: JobConfig, tokenizer: Any) -> int | None:
    """The vocabulary the model is built with: the tokenizer's (``model_vocab_size``: padded to a
    multiple of 64), or None, the flavour's own, in a dry run (``comm.mode="fake_backend"``) given
    no tokenizer (``hf_assets_path`` unset): it sizes the model the recipe names, not one with the
    byte tokenizer's 320 ids."""
    if job_config.comm.mode == "fake_backend" and job_config.hf_assets_path is None:
        return None
    return tokenizer.model_vocab_size


def validate_job(job_config: JobConfig, world_size: int, device_type: str) -> JobSetup:
    """Every check of ``job_config`` that can fail at setup, in one phase, before any mesh or
    model is built: each raises ``ValueError``/``TypeError`` naming the field.

    In order: every section's own checks (sections may be mutated after parsing), the fields
    whose feature this runtime lacks, the metrics backends' packages, the degrees against the world size, the model family
    and flavour (with the Hugging Face folder's ``config.json``), the tokenizer and its
    vocabulary, the backend, context parallelism, expert parallelism, the family's own limits
    (heads divisible by TP, ...), compile, the batch sizes, and pipeline parallelism against
    the model's parts (:meth:`ModelSpec.part_names`).
    """
    job_config.validate()
    check_supported(job_config)
    check_metrics_extras(job_config.metrics)  # a missing tensorboard/wandb extra: agreed, printed once
    par = job_config.parallelism
    parallel_dims = ParallelDims.from_config(par, world_size, device_type=device_type)
    model_spec = get_model_spec(job_config.model.name)
    # hf_assets_path's tokenizer.json, else the byte tokenizer; the model's vocabulary
    # is the tokenizer's (padded to a multiple of 64), or in a dry run without a tokenizer the flavour's.
    tokenizer = build_tokenizer(job_config.hf_assets_path)
    model_config = hf_config.resolve_model_config(
        model_spec, job_config, vocab_size=model_vocab_size(job_config, tokenizer),
        # RoPE tables sized to the run (upstream's update_from_config: max_seq_len = training.seq_len).
        max_seq_len=job_config.training.seq_len)
    check_vocab_size(model_config.vocab_size, tokenizer, model=f"{job_config.model.name}/{job_config.model.flavor}")
    packed_documents_eos(model_config, tokenizer, job_config)  # block_causal needs the tokenizer's EOS
    # The runtime of the backend exists (its meshes are resolved when first used, after build_mesh).
    representation = get_representation(par.spmd_backend)(parallel_dims)
    validate_context_parallel(job_config)  # a bad CP value is named whatever the torch
    representation.validate(job_config)
    validate_expert_parallel(model_config, job_config, parallel_dims)
    model_spec.validate(model_config, job_config, parallel_dims)
    if job_config.optimizer.param_groups:  # every pattern against the whole model's names
        with torch.device("meta"):
            validate_param_groups(job_config.optimizer, model_spec.build(model_config))
    validate_compile(job_config, representation)
    validate_async_tp(job_config, device_type)  # the dry run accepts it; a real run needs CUDA
    validate_fault_tolerance(job_config, parallel_dims, device_type)  # the ft extra, the replicate axis
    training = job_config.training
    stages = PipelineStages.from_config(job_config, parallel_dims, model_spec.part_names(model_config))
    steps = gradient_accumulation_steps(training.global_batch_size, training.local_batch_size,
                                        parallel_dims.dp_replicate * parallel_dims.dp_shard
                                        * ft_group_count(job_config),  # torchft: the groups share the batch
                                        num_pp_microbatches=stages.num_pp_microbatches if stages else 1)
    plan = expert_parallel_plan(model_spec.sharding_plan(
        model_config, sequence_parallel=par.enable_sequence_parallel,
        loss_parallel=not par.disable_loss_parallel,
    ), parallel_dims)
    validate_validator(job_config, stages)
    # the converters' checks (torchao, the GPU, their fields: one line), then their parameters' layouts
    plan = converter_plan(plan, build_converters(job_config.model.converters,
                                                 dry_run=job_config.comm.mode == "fake_backend"),
                          model_spec, model_config)
    return JobSetup(parallel_dims=parallel_dims, model_spec=model_spec, model_config=model_config,
                    tokenizer=tokenizer, representation=representation, plan=plan, stages=stages,
                    gradient_accumulation_steps=steps,
                    seed=job_config.debug.seed if job_config.debug.seed is not None else 0,
                    local_rows=stages.local_rows if stages else training.local_batch_size)


class AgreedSetupError(ValueError):
    """A setup error every rank knows, with the ranks that had it: rank 0 alone prints it."""

    #: Read by :func:`run_job`: the same text is on every rank, so only rank 0 prints it.
    agreed = True


def _agree_on_setup(job_config: JobConfig, world_size: int, device_type: str) -> JobSetup:
    """:func:`validate_job` on every rank, then every rank learns every rank's error (one
    ``all_gather_object`` of the messages, under the set-up timeout): a config is validated alike
    on every rank, but a file one node lacks (a tokenizer, a Hugging Face ``config.json``) fails
    there only. Raises :class:`AgreedSetupError` on every rank when any rank failed: the
    message, or each distinct message with the ranks that had it."""
    setup: JobSetup | None = None
    error: str | None = None
    try:
        setup = validate_job(job_config, world_size, device_type)
    except (ValueError, TypeError) as err:
        error = str(err)
    if world_size > 1:
        everyone: list[str | None] = [None] * world_size
        dist.all_gather_object(everyone, error)
    else:
        everyone = [error]
    failed: dict[str, list[int]] = {}
    for rank, message in enumerate(everyone):
        if message is not None:
            failed.setdefault(message, []).append(rank)
    if failed:
        if len(failed) == 1 and len(next(iter(failed.values()))) == world_size:
            raise AgreedSetupError(next(iter(failed)))
        raise AgreedSetupError("\n".join(
            f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}: {message}" for message, ranks in failed.items()))
    assert setup is not None
    return setup


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


@dataclass
class BuiltModel:
    """What :meth:`Trainer.build_model` builds."""

    #: This rank's model, sharded and initialised: the whole model, or under pipeline
    #: parallelism the part that holds this rank's stages.
    model: nn.Module
    #: The FSDP roots: ``[model]``, or under pipeline parallelism this rank's stage modules.
    parts: list[nn.Module]
    #: This rank's pipeline stages and schedule (None without pipeline parallelism).
    pipeline: PipelineParallel | None
    #: The layout and global shape of every parameter and buffer (checkpoints' views).
    state_layouts: dict[str, StateLayout]
    #: Whether the MoE load is pooled over the pipeline stages (PP with MoE blocks).
    moe_over_stages: bool


def compose_model(job_config: JobConfig, rep: TensorRepresentation, model_spec: ModelSpec, model_config: Any,
                  plan: ShardingPlan, parallel_dims: ParallelDims, context_parallel: ContextParallel | None,
                  pipeline: PipelineParallel | None, *, seed: int, device_type: str,
                  materialize: bool = True) -> BuiltModel:
    """:meth:`Trainer.build_model`'s composition, on this rank's meshes (built).

    ``materialize=False`` (the dry run, :mod:`torchtitan_spmd.dry_run`) stops before step 7: the
    parameters stay on the meta device, sharded as a real run shards them, and nothing is allocated.
    """
    cfg = job_config
    # DTensor's sharding caches key on mesh equality: an equal mesh of an earlier trainer in this
    # process (a notebook, a fake-process-group setup before a fork) must not come back from them
    # on this trainer's parameters. ParallelDims.build_mesh cleared them unless they can refer
    # only to the very meshes this trainer uses (distributed/mesh_reuse.py).
    parallel_dims.build_mesh()
    with torch.device("meta"):
        model = model_spec.build(model_config)
    # float8, LoRA: before every parallelism (a dry run sizes a GPU job: no GPU checks)
    convert_model(model, build_converters(cfg.model.converters, dry_run=cfg.comm.mode == "fake_backend"))
    set_force_load_balance(model, cfg.debug.moe_force_load_balance)
    moe_over_stages = pipeline is not None and bool(moe_blocks(model))
    if pipeline is not None:
        model, plan = pipeline.split(model, plan)
    apply_context_parallel(model, plan, context_parallel)
    state_layouts = apply_plan(model, plan, rep)
    bind_converted(model, state_layouts, parallel_dims, rep)
    apply_expert_parallel(model, rep, state_layouts)
    apply_ac(model, cfg.activation_checkpoint)
    if cfg.compile.enable and "model" in cfg.compile.components:
        maybe_enable_async_tp(cfg, parallel_dims, device_type)
        apply_compile(model, cfg.compile, fullgraph=not parallel_dims.ep_enabled)
    roots = pipeline.stage_modules(model) if pipeline is not None else [model]
    apply_fsdp(model, plan, rep,
               param_dtype=TORCH_DTYPE_MAP[cfg.training.mixed_precision_param],  # type: ignore[arg-type]
               reduce_dtype=TORCH_DTYPE_MAP[cfg.training.mixed_precision_reduce],  # type: ignore[arg-type]
               reshard_after_forward=False if pipeline is not None else None, roots=roots, layouts=state_layouts)
    if materialize:
        for root in roots:  # each FSDP root materialises its own parameters
            init_weights(root, states_of(root, state_layouts), rep, seed=seed, device=device_type)
    return BuiltModel(model=model, parts=list(roots), pipeline=pipeline, state_layouts=state_layouts,
                      moe_over_stages=moe_over_stages)


class Trainer:
    """Builds everything from a :class:`JobConfig` and trains; see :meth:`run`.

    Uses the default process group if one is initialised (tests, notebooks);
    otherwise initialises it from the torchrun environment. Set-up is, in order:

    1. the process group, and every rank started with the same config;
    2. **validation**, one phase before any mesh or model (:func:`validate_job`);
    3. the meshes (and their groups' set-up timeout);
    4. the model and its parallelisms (:meth:`build_model`);
    5. the optimizer, the learning-rate schedule, the loss and, under PP, the schedule;
    6. the data, the metrics and the train contexts (type checking);
    7. the checkpointer, and the checkpoint this run continues from.
    """

    def __init__(self, job_config: JobConfig) -> None:
        self.job_config = job_config
        self.device_type = _device_type(job_config)
        self._owns_pg = False
        #: Set by :func:`run_job`: SIGTERM/SIGINT stop the run after the step (and save) in progress.
        self.stop_request: StopRequest | None = None
        comm_cfg, training = job_config.comm, job_config.training
        #: Where the run is ("during setup", "in step 3") and the timeout in force, for failure reports.
        self.phase = "during setup"
        self.timeout_in_force = ("comm.init_timeout_seconds", comm_cfg.init_timeout_seconds)

        # 1. the process group (the config's own checks first: a bad value is named before
        # any process starts waiting for its peers; validate_job repeats them, as it stands alone)
        job_config.validate()
        check_supported(job_config)
        if not dist.is_initialized():
            comm.configure_flight_recorder(comm_cfg, job_config.job.dump_folder)
            comm.init_default_process_group("nccl" if self.device_type == "cuda" else "gloo",
                                            timedelta(seconds=comm_cfg.init_timeout_seconds))
            self._owns_pg = True
        # under LocalTensorMode (comm.mode="local_tensor") the rank is one symbolic value for every
        # simulated rank: this process speaks for rank 0 (its log lines, its files)
        self.rank = 0 if local_tensor_mode_active() else dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank)) % torch.cuda.device_count())
        if self.world_size > 1:
            _check_same_config(job_config)

        # 2. validation: every setup error of the config, before any mesh or model
        setup = _agree_on_setup(job_config, self.world_size, self.device_type)
        self.parallel_dims, self.representation = setup.parallel_dims, setup.representation
        self.model_spec, self.model_config, self.tokenizer = setup.model_spec, setup.model_config, setup.tokenizer
        self.plan, self.seed = setup.plan, setup.seed
        self.gradient_accumulation_steps = setup.gradient_accumulation_steps
        #: Sequences of one gradient-accumulation microbatch on this data-parallel rank (JobSetup.local_rows).
        self.local_rows = setup.local_rows
        #: block_causal: the EOS id that splits packed documents (None: causal).
        self.packed_documents_eos = packed_documents_eos(self.model_config, self.tokenizer, job_config)
        if self.rank == 0:  # the job's header: first, before the start-up lines of the steps below
            logger.info(f"job: {job_config.job.description}")
            logger.info(
                f"torchtitan_spmd: {self.world_size} rank(s) on {self.device_type}, "
                f"spmd_backend={job_config.parallelism.spmd_backend}, "
                f"model={job_config.model.name}/{job_config.model.flavor}, "
                f"degrees {degrees_line(self.parallel_dims)}"
            )

        # 3. the meshes; torch creates their groups with its default timeout (30 min): every
        # group gets comm.init_timeout_seconds until the first step is done
        self.parallel_dims.build_mesh()
        comm.set_pg_timeouts(timedelta(seconds=comm_cfg.init_timeout_seconds), self.parallel_dims,
                             barrier=False)
        self._train_timeout_set = False
        self.context_parallel = ContextParallel.from_config(job_config, self.parallel_dims)
        torch.manual_seed(self.seed)
        if job_config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
            # As upstream: deterministic kernels, but new buffers are not filled with NaN
            # (that fill only exposes reads of uninitialised memory, at the cost of a pass
            # over every torch.empty: 2% of a CPU step here).
            torch.utils.deterministic.fill_uninitialized_memory = False

        # 4. the model and its parallelisms
        with spmd_backend_scope(job_config.parallelism.spmd_backend):
            built = self.build_model(PipelineParallel.from_stages(setup.stages, self.parallel_dims))
        self.model: nn.Module = built.model
        self.model_parts, self.pipeline, self.state_layouts = built.parts, built.pipeline, built.state_layouts
        self._moe_over_stages = built.moe_over_stages

        # 5. the optimizer, the learning-rate schedule, the loss and the pipeline schedule
        self.optimizer = build_optimizer(self.model, job_config.optimizer, whole_model=self.pipeline is None)
        self.scheduler = build_lr_scheduler(self.optimizer, job_config.lr_scheduler, training.steps)
        self.loss_fn = maybe_compile_loss(cross_entropy_loss, job_config.compile)
        if self.pipeline is not None:  # the loss runs inside torch's schedule, on the last stage
            self._build_pipeline_schedule()
        self.amp = functools.partial(maybe_enable_amp, self.parallel_dims,
                                     training.mixed_precision_param, self.device_type)

        # 6. the data, the metrics and the train contexts (torchft's manager first: the data is
        # split over every replica group)
        #: ``fault_tolerance.enable``: this group's torchft wiring (:mod:`~torchtitan_spmd.techniques.fault_tolerance`).
        self.ft = FaultTolerance(job_config, device_type=self.device_type) if job_config.fault_tolerance.enable else None
        self.dataloader = self.build_dataloader()
        if self.ft is not None:  # what a returning group heals from a live peer
            self.ft.attach(self.model, self.optimizer, self.scheduler, self.dataloader)
        #: ``metrics.enable_tensorboard``: rank 0 writes the logged steps' scalars.
        self.metrics = build_metrics_logger(job_config.metrics, job_config.job.dump_folder, rank=self.rank,
                                            job_config=job_config.to_dict())
        self._build_flops_counter()
        self._build_train_contexts()
        #: ``validator.enable``: the evaluation loop (:mod:`torchtitan_spmd.validate`).
        self.validator = Validator(self) if job_config.validator.enable else None
        self.validations: list[ValidationRecord] = []

        # 7. the checkpointer, and the step this run continues after (0: from the start)
        self.checkpointer = self.build_checkpointer()
        self.start_step = 0
        if not job_config.checkpoint.create_seed_checkpoint:
            self.start_step = self.checkpointer.load(step=job_config.checkpoint.load_step)
        if self.ft is not None:  # torchft's step counts from the checkpoint's
            self.ft.resume(self.start_step)
        #: Python's automatic collector is off from here to :meth:`close` (``training.gc_freq``):
        #: last in set-up, so a set-up error leaves it as it was.
        self.gc_handler = GarbageCollection(training.gc_freq, debug=training.gc_debug)

    def _build_flops_counter(self) -> None:
        """Upstream's FLOPs per token of the whole model (built on the meta device) and the peak of
        one device, for the step line's TFLOP/s and MFU; rank 0 logs the peak and its source."""
        with torch.device("meta"), spmd_backend_scope(self.job_config.parallelism.spmd_backend):
            whole = self.model_spec.build(self.model_config)
        #: Training FLOPs per token (:func:`~torchtitan_spmd.tools.flops.flops_per_token`).
        self.flops_per_token = flops_per_token(whole, self.model_config, self.job_config.training.seq_len)
        self.peak_flops, source = peak_flops(self.device_type, self.job_config.metrics.cpu_peak_tflops)
        if self.rank == 0:
            logger.info(f"MFU: {self.flops_per_token:,} FLOPs per token, peak {self.peak_flops / 1e12:.3f} "
                        f"TFLOP/s per rank ({source})")

    def _build_pipeline_schedule(self) -> None:
        """Torch's schedule over this rank's stages, with the loss on the last stage and, under
        type checking, each stage's forward and the loss checked on their own (StageBoundaries)."""
        assert self.pipeline is not None
        cfg = self.job_config
        checked = (get_train_context(enable_loss_parallel=False, parallel_dims=self.parallel_dims,
                                     representation=self.representation, spmd_typechecking=True)
                   if cfg.debug.spmd_typechecking and self.representation.supports_typechecking
                   else None)
        self.pipeline.build_schedule(
            self.model, self.device_type, self.loss_fn,
            boundaries=StageBoundaries.from_plan(self.plan, self.representation, checked=checked),
            representation=self.representation, logits_layout=self.plan.output_layout())

    def build_dataloader(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches. Each step reads this rank's rows of the global batch at once; the
        step splits them into its microbatches of :attr:`local_rows`. The data depends only on
        the seed and the position (not on ``training.steps``), and the global batch is
        rank-major, so every layout sees the same data."""
        training = self.job_config.training
        batch_mesh = self.parallel_dims.get_optional_mesh("batch")
        dp_degree, dp_rank = (batch_mesh.size(), batch_mesh.get_local_rank()) if batch_mesh is not None else (1, 0)
        if self.ft is not None:  # this group's block of every group's shards
            dp_degree, dp_rank = self.ft.dp_info(dp_degree, dp_rank)
        return build_dataloader(
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            local_batch_size=self.local_rows * self.gradient_accumulation_steps,
            seq_len=training.seq_len, seed=self.seed,
            dataset=self.job_config.dataloader.dataset, dataset_path=self.job_config.dataloader.dataset_path, tokenizer=self.tokenizer,
        )

    def _build_train_contexts(self) -> None:
        """The contexts a step runs in: :attr:`train_context` (loss parallel, the backend's, type
        checking when asked), :attr:`schedule_context` (PP's, unchecked: each stage checks
        itself) and the ``debug.spmd_typechecking_steps`` countdown."""
        cfg, par = self.job_config, self.job_config.parallelism
        train_context = functools.partial(
            get_train_context,
            enable_loss_parallel=self.parallel_dims.tp_enabled and not par.disable_loss_parallel,
            parallel_dims=self.parallel_dims, representation=self.representation,
        )
        self.train_context = train_context(spmd_typechecking=cfg.debug.spmd_typechecking)
        self.schedule_context = train_context(spmd_typechecking=False)
        #: ``debug.spmd_typechecking_steps``: (steps still to type-check, the unchecked context).
        self._typecheck_countdown: tuple[int, Callable[[], AbstractContextManager[None]]] | None = None
        if cfg.debug.spmd_typechecking and cfg.debug.spmd_typechecking_steps is not None:
            self._typecheck_countdown = (cfg.debug.spmd_typechecking_steps,
                                         train_context(spmd_typechecking=False))

    def build_checkpointer(self) -> CheckpointManager:
        """The checkpoint technique over this trainer's state (``[checkpoint]``)."""
        cfg, pd = self.job_config, self.parallel_dims
        return CheckpointManager(
            cfg.checkpoint, base_folder=cfg.job.dump_folder, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.scheduler, dataloader=self.dataloader, representation=self.representation,
            state_layouts=self.state_layouts, device_type=self.device_type,
            timeout=timedelta(seconds=cfg.comm.init_timeout_seconds),
            sd_adapter=self._sd_adapter(), hf_assets_path=hf_config.hf_folder(cfg),
            other_stage_keys=self.pipeline.other_stage_keys if self.pipeline is not None else frozenset(),
            record={"model": f"{cfg.model.name}/{cfg.model.flavor}", "spmd_backend": cfg.parallelism.spmd_backend,
                    "seed": self.seed,
                    "degrees": {"dp_replicate": pd.dp_replicate, "dp_shard": pd.dp_shard, "tp": pd.tp},
                    **({"optimizer_groups": self._optimizer_grouping()} if cfg.checkpoint.enable else {})},
        )

    def _optimizer_grouping(self) -> dict[str, str]:
        """Every parameter's optimizer class and param-group pattern, over every rank (a pipeline
        stage holds only its part), for the checkpoints' record: a resume with another grouping
        is one line (:func:`~torchtitan_spmd.tools.optimizer.check_same_grouping`)."""
        mine = grouping(self.model, self.optimizer)
        if self.pipeline is None or self.world_size == 1:
            return mine
        everyone: list[dict[str, str] | None] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        return {k: v for theirs in everyone for k, v in (theirs or {}).items()}

    def _sd_adapter(self) -> StateDictAdapter | None:
        """The family's Hugging Face state-dict adapter for this model config (None: the family has none)."""
        adapter_cls = self.model_spec.state_dict_adapter
        return adapter_cls(self.model_config, hf_config.hf_folder(self.job_config)) if adapter_cls else None

    def build_model(self, pipeline: PipelineParallel | None) -> BuiltModel:
        """Build the model on the meta device, then compose the techniques, in this order.

        1. under pipeline parallelism, this rank's part of the model (its stages) and the plan
           restricted to it: the part goes through the same steps as a whole model;
        2. context parallelism's attention body (before the plan, so that the plan's
           local region wraps it), then the sharding plan: tensor, sequence, context
           and loss parallelism as it declares;
        3. expert parallelism: the experts sharded over ``ep``, their token exchange;
        4. activation checkpointing of every block (``activation_checkpoint.mode``);
        5. ``torch.compile`` of every block (``compile.enable``, ``"model"``);
        6. FSDP2, one call: the experts over ``efsdp``, then what the representation shards,
           with the mixed-precision policy;
        7. materialise on the device and initialise, each rank its shards of the
           full, seeded weights (the same whatever the layout).

        Returns what it built (:class:`BuiltModel`); it sets nothing on the trainer
        (:func:`compose_model` does the work, which the dry run shares).
        """
        return compose_model(self.job_config, self.representation, self.model_spec, self.model_config,
                             self.plan, self.parallel_dims, self.context_parallel, pipeline,
                             seed=self.seed, device_type=self.device_type)

    def step(self, step: int) -> StepRecord:
        """Run optimizer step number ``step`` (1-based).

        This rank's rows of the global batch are split into
        ``gradient_accumulation_steps`` microbatches of :attr:`local_rows` (``training.local_batch_size``;
        under pipeline parallelism the schedule's iteration, :func:`pipeline_rows`);
        each runs forward and backward, its loss divided by the token count of the
        whole global batch, and FSDP reduces the gradients after the last one only.
        """
        self._count_typechecked_step(step)
        start = time.perf_counter()
        tokens, labels = next(self.dataloader)
        data_loading_s = time.perf_counter() - start
        tokens, labels = tokens.to(self.device_type), labels.to(self.device_type)
        rep, n = self.representation, self.gradient_accumulation_steps
        micro, positions = self.prepare_batch(tokens, labels, n)
        with self.train_context():
            token_count = global_token_count([y for _, y in micro], rep)
        losses = []
        for i, ((inputs, targets), pos) in enumerate(zip(micro, positions, strict=True)):
            if self.pipeline is not None:  # the schedule's microbatches, its loss, its FSDP reduction
                with self.schedule_context(), self.amp():
                    losses.append(self.pipeline.forward_backward(inputs, targets, token_count, pos))
                continue
            set_gradient_sync(self.model, i == n - 1)
            with self.train_context():
                with self.amp():
                    logits = self.model(inputs) if pos is None else self.model(inputs, positions=pos)
                loss = self.loss_fn(logits, targets, rep, logits_layout=self.plan.output_layout(),
                                    token_count=token_count)
                del logits
                loss.backward()
            losses.append(loss.detach())
        ft_loss = group_loss = None
        if self.ft is not None and self.ft.semi_sync is None:  # torchft: average over the live groups
            group_loss = global_loss_value(sum(losses[1:], losses[0]), self.representation)
            ft_loss = self.ft.sync_gradients(self.model, group_loss)
        pp_group = self.pipeline.group if self.pipeline is not None else None
        grad_norm = clip_grad_norm_(self.model.parameters(), self.job_config.training.max_norm, rep,
                                    stage_group=pp_group)
        lr = self.scheduler.get_last_lr()[0]
        loss = sum(losses[1:], losses[0])
        if ft_loss is not None:
            loss_value = ft_loss
        else:
            loss_value = (global_loss_value(loss, rep) if self.pipeline is None
                          else self.pipeline.global_loss(loss, rep.sum_over_batch))
        # torchft: the step updates the weights only if every live group's every rank agrees
        committed = self.ft.should_commit() if ft_loss is not None else True
        if not committed and group_loss is not None:  # after an all-reduce error its buffer is garbage
            loss_value = group_loss
        # upstream HEAD (#3863, #4226): a non-finite step never reaches the optimizer; the loss
        # and the norm are global, the same on every rank, so every rank stops here alike
        if committed and not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            raise NonFiniteStepError(step, loss_value, grad_norm)
        expert_load = None
        if committed:
            self.optimizer.step()
            # MoE load balancing (no-op for dense models); under PP the logged load is every stage's
            expert_load = update_expert_bias(self.model, rep, stage_group=pp_group if self._moe_over_stages else None)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        tps = tokens.numel() / elapsed if elapsed > 0 else float("inf")
        return StepRecord(
            step=step, loss=loss_value, grad_norm=grad_norm, lr=lr, tokens_per_s=tps,
            peak_memory_mib=_peak_memory_mib(self.device_type), expert_load=expert_load,
            tflops=self.flops_per_token * tps / 1e12, mfu=100 * self.flops_per_token * tps / self.peak_flops,
            data_loading_s=data_loading_s, committed=committed,
            replica_groups=self.ft.num_participants() if self.ft is not None else None,
        )

    def prepare_batch(self, tokens: torch.Tensor, labels: torch.Tensor, n: int = 1
                      ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor | None]]:
        """This rank's rows of a batch (on the device) as the model takes them, in ``n`` microbatches:
        under context parallelism this rank's slice of every sequence and its RoPE positions
        (None without CP), then each microbatch's tokens and labels in the backend's form. With
        packed documents (``attn_mask_type="block_causal"``) the positions are per document and
        the label after each EOS is ignored.
        The training step and the validator both go through here."""
        rep = self.representation
        positions: list[torch.Tensor | None] = [None] * n
        if self.packed_documents_eos is not None:
            # block_causal: each token's position in its own document (RoPE and the attention
            # mask, every stage), and the label across each document boundary ignored (#4075)
            eos = self.packed_documents_eos
            labels = mask_document_boundaries(labels, tokens, eos)
            positions = [prepare_positions(p, rep) for p in document_positions(tokens, eos).chunk(n)]
        if self.context_parallel is not None:  # this rank's slice of every sequence, and its positions
            tokens, labels, cp_positions = self.context_parallel.shard_batch(tokens, labels)
            positions = [prepare_positions(p, rep) for p in cp_positions.chunk(n)]
        micro = [prepare_inputs(t, y, rep) for t, y in zip(tokens.chunk(n), labels.chunk(n), strict=True)]
        return micro, positions

    def _count_typechecked_step(self, step: int) -> None:
        """``debug.spmd_typechecking_steps=N``: the first N steps this trainer runs are type-checked;
        before the next one the unchecked train context takes over (one log line on rank 0)."""
        if self._typecheck_countdown is None:
            return
        left, unchecked = self._typecheck_countdown
        if left > 0:
            self._typecheck_countdown = (left - 1, unchecked)
            return
        self.train_context = unchecked
        self._typecheck_countdown = None
        if self.pipeline is not None and self.pipeline.boundaries is not None:
            self.pipeline.boundaries.checked = None
        if self.rank == 0:
            n = self.job_config.debug.spmd_typechecking_steps
            logger.info(f"type checking off from step {step} on: debug.spmd_typechecking_steps={n} "
                        f"checked the first {n} step(s) of this run")

    def run(self) -> list[StepRecord]:
        """Train from ``start_step + 1`` to ``training.steps``, saving checkpoints as
        ``[checkpoint]`` says; rank 0 logs each step. Returns the records of the steps run.

        With ``checkpoint.create_seed_checkpoint`` it only writes the seed checkpoint.
        """
        if self.job_config.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            return []
        records = []
        log_freq = self.job_config.metrics.log_freq
        steps = self.job_config.training.steps
        self._stop_if_signalled(self.start_step)  # a signal during set-up (a long load)
        #: ``[profiler]``: torch.profiler's windows and memory snapshots around the loop.
        self.profiler = Profiler(self.job_config.profiler, self.job_config.job.dump_folder, self.rank,
                                 self.device_type, start_step=self.start_step)
        with self.profiler, self._semi_sync():
            for step in self._steps(steps):
                self.phase = f"in step {step}"
                self.gc_handler.run(step)
                record = self.step(step)
                self.profiler.step()
                records.append(record)
                if not self._train_timeout_set:
                    self.use_train_timeout()
                if step % log_freq == 0 or step == steps:
                    if self.rank == 0:
                        logger.info(record.log_line())
                    self.metrics.log(record)  # rank 0's, or every rank's (metrics.save_for_all_ranks)
                if self.validator is not None and self.validator.should_validate(step):
                    self.phase = f"validating after step {step}"
                    validation = self.validator.validate(step)
                    self.validations.append(validation)
                    if self.rank == 0:
                        logger.info(validation.log_line())
                    self.metrics.log_validation(validation)
                if self.ft is None or (record.committed and self.ft.is_checkpoint_writer()):
                    self.checkpointer.save(step, last_step=step == steps)  # torchft: one group saves
                self._stop_if_signalled(step)
        self.checkpointer.wait()
        return records

    def _steps(self, steps: int) -> Iterator[int]:
        """The step numbers to run: ``start_step + 1 .. steps``; under torchft's synchronous
        replication, each step's quorum first (a returning group heals there and jumps to the
        peers' step), and an uncommitted step is retried under the same number."""
        if self.ft is None or self.ft.semi_sync is not None:
            yield from range(self.start_step + 1, steps + 1)
            return
        while self.ft.committed_steps() < steps:
            step = self.ft.start_step()
            if step > steps:  # healed to a peer that had finished
                return
            yield step

    def _semi_sync(self) -> AbstractContextManager[Any]:
        """torchft's LocalSGD or DiLoCo around the optimizer (``fault_tolerance.semi_sync_method``)."""
        if self.ft is None:
            return contextlib.nullcontext()
        return self.ft.semi_sync_context(self.model, self.optimizer)

    def _stop_if_signalled(self, step: int) -> None:
        """After each step and its save: if any rank got SIGTERM/SIGINT, every rank finishes a
        background save and raises :class:`StoppedBySignal` (one small all-reduce a step)."""
        if self.stop_request is None:
            return
        signum = self.stop_request.agreed(self.world_size, self.device_type)
        if signum is None:
            return
        self.checkpointer.wait()
        complete = sorted(find_checkpoints(self.checkpointer.folder)[0]) if self.checkpointer.enable else []
        newest = f"step-{complete[-1]}" if complete else "none (the next start begins afresh)"
        raise StoppedBySignal(signum, f"{signal_name(signum)}: stopped after step {step}; no save is in progress, "
                                      f"and the newest complete checkpoint, which the next start loads, is {newest}")

    def use_train_timeout(self) -> None:
        """After the first step (set-up and warm-up done), as upstream: every rank meets at a
        barrier, then every process group gets ``comm.train_timeout_seconds``."""
        seconds = self.job_config.comm.train_timeout_seconds
        comm.set_pg_timeouts(timedelta(seconds=seconds), self.parallel_dims)
        self.timeout_in_force = ("comm.train_timeout_seconds", seconds)
        self._train_timeout_set = True

    def close(self) -> None:
        """Finish checkpointing; destroy the process group if this trainer created it."""
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is not None:
            checkpointer.close()
        ft = getattr(self, "ft", None)
        if ft is not None:
            ft.close()
        gc_handler = getattr(self, "gc_handler", None)
        if gc_handler is not None:
            gc_handler.close()
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()


def _write_outputs(job_config: JobConfig) -> None:
    """Rank 0's start-up outputs under ``job.dump_folder``: the resolved config, as JSON
    (``JobConfig.from_dict(json.load(f))`` rebuilds it), to ``job_config.json`` and, when set, to
    ``debug.save_config_file``; with ``debug.print_config`` it is logged too."""
    folder = job_config.job.dump_folder
    text = json.dumps(job_config.to_dict(), indent=2, ensure_ascii=False)
    if job_config.debug.print_config:
        logger.info(f"Running with configs: {text}")
    names = ["job_config.json"]
    if job_config.debug.save_config_file is not None:
        names.append(job_config.debug.save_config_file)
    for name in names:
        path = os.path.join(folder, name)
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as err:
            raise ValueError(f"job.dump_folder: cannot write {path!r}: {err.strerror or err}.") from None
    logger.info(f"saved the resolved config to {os.path.join(folder, names[-1])}")


def _report_comm_failure(err: BaseException, trainer: Trainer | None, job_config: JobConfig) -> None:
    """One line on stderr naming this rank, the collective and the timeout; the flight record on disk."""
    if trainer is not None:
        rank, when, timeout = trainer.rank, trainer.phase, trainer.timeout_in_force
    else:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)
        when, timeout = "during setup", ("comm.init_timeout_seconds", job_config.comm.init_timeout_seconds)
    print(f"error: {comm.describe_comm_failure(err, rank=rank, when=when, timeout=timeout)}",
          file=sys.stderr, flush=True)
    comm.dump_flight_recorder(job_config.comm, job_config.job.dump_folder, rank)


@contextlib.contextmanager
def _silenced(quiet: bool) -> Iterator[None]:
    """With ``quiet``, this block's standard output, standard error and warnings are dropped."""
    if not quiet:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


#: The longest a rank other than 0 waits before exiting after an error that rank 0 prints: torchrun
#: stops the other ranks when the first one exits, and rank 0 must have printed by then. Under
#: torchrun the wait ends as soon as rank 0 exits (torchrun stops the rest), so a long bound costs
#: nothing; 2 s lost the race once on a loaded 2-core CI machine (rank 0 not yet through its
#: imports when rank 1 exited: no error box at all).
_PRINT_GRACE_S = 30.0


def _after_agreed_error() -> int:
    """Exit status 2 of an error every rank has and rank 0 prints: the other ranks wait for rank 0
    (a barrier when the process group is up, else :data:`_PRINT_GRACE_S`) so that torchrun, which
    stops the rest when one rank exits, cannot stop rank 0 before its line is out."""
    if dist.is_initialized():  # every rank meets rank 0 after its print
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to wait for
            pass
    elif _rank() != 0:
        time.sleep(_PRINT_GRACE_S)
    return 2


def degrees_line(parallel_dims: ParallelDims) -> str:
    """Every parallel degree, for the start-up line: ``dp_replicate=1 dp_shard=2 cp=1 tp=2 pp=1 ep=1``."""
    pd = parallel_dims
    return (f"dp_replicate={pd.dp_replicate} dp_shard={pd.dp_shard} cp={pd.cp} tp={pd.tp} pp={pd.pp} "
            f"ep={pd.ep}")


def _rank() -> int:
    """This process's global rank: the process group's, else torchrun's ``RANK`` (0 alone)."""
    if dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0


class _RankZeroLines(logging.Filter):
    """Keep a record on a rank other than 0 only when it is an error or marked ``every_rank`` (a line
    only that rank knows, which names its ranks): every rank runs the same job, so rank 0's copy of an
    informational line or a warning is the job's."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or bool(getattr(record, "every_rank", False))


def once_per_job(rank: int) -> None:
    """The command's lines once per job, not once per rank: on a rank other than 0 the root logger's
    handlers keep errors and ``every_rank`` records only, and Python's warnings are off unless asked for
    (``-W`` or ``PYTHONWARNINGS``: then every rank shows its own)."""
    if rank == 0:
        return
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _RankZeroLines) for f in handler.filters):
            handler.addFilter(_RankZeroLines())
    if not sys.warnoptions:
        warnings.simplefilter("ignore")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m torchtitan_spmd.train`` (normally under torchrun).

    Exit status of each process: 0 done; 1 a collective timed out or lost a peer (one line per
    rank says which, see :func:`~torchtitan_spmd.distributed.comm.describe_comm_failure`);
    2 a bad config or environment (one ``error:`` line, printed by rank 0 alone when every rank
    has it), a checkpoint that does not verify or load, or a save that failed (disk full, I/O
    error, no permission); ``128 + N`` stopped by signal N (SIGTERM 143, SIGINT 130) after the
    step and save in progress (a ``stopped:`` line). These are what a single process returns
    (``python -m torchtitan_spmd.train``). Under torchrun the shell sees torchrun's status: 0 when
    every rank returned 0, else 1 (torchrun then prints its own ``ChildFailedError`` summary naming
    each failed rank and its exit code: 2, 143, ...).
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not sys.warnoptions:
        warnings.simplefilter("default", DeprecationWarning)
    once_per_job(_rank())
    # Every rank parses the same command line: rank 0 alone shows what the parser prints
    # (tyro's error box, --help) and the deprecation warnings of legacy spellings.
    quiet = _rank() != 0
    try:
        with _silenced(quiet):
            job_config = ConfigManager(module_packages=LIBRARY_FIRST).parse_args(
                list(argv) if argv is not None else None)
    except (ValueError, TypeError, ImportError) as err:
        if _rank() == 0:  # every rank parses the same command line: one copy of the error
            print(f"error: {err}", file=sys.stderr)
        return _after_agreed_error()
    except SystemExit as exit_:  # tyro's own error box or --help, shown by rank 0 alone
        if exit_.code not in (0, None):
            _after_agreed_error()
        raise
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    if not threads.isdigit() or int(threads) < 1:
        print(f"error: environment variable OMP_NUM_THREADS={threads!r} must be an integer >= 1.",
              file=sys.stderr)
        return 2
    torch.set_num_threads(int(threads))
    return run_job(job_config)


def run_job(job_config: JobConfig) -> int:
    """Train ``job_config`` and return :func:`main`'s exit status (the one-line reports included).

    SIGTERM and SIGINT stop the run after the step, and the save, in progress: status
    ``128 + signal`` and one ``stopped:`` line (a second signal ends the process at once).
    """
    if job_config.comm.mode in ("fake_backend", "local_tensor"):
        return _dry_run(job_config)
    trainer = None
    comm_failed = False
    stop = StopRequest().install()
    try:
        trainer = Trainer(job_config)
        trainer.stop_request = stop
        if trainer.rank == 0:
            _write_outputs(job_config)
        records = trainer.run()
        if trainer.rank == 0 and records:
            logger.info(f"done: loss {records[0].loss:.4f} -> {records[-1].loss:.4f} in {len(records)} steps")
    except (ValueError, TypeError) as err:
        if not getattr(err, "agreed", False):
            print(f"error: {err}", file=sys.stderr)
            return 2
        if _rank() == 0:  # agreed: the same line on every rank, printed once
            print(f"error: {err}", file=sys.stderr, flush=True)
        return _after_agreed_error()
    except StoppedBySignal as stopped:
        print(f"stopped: {stopped}", file=sys.stderr)
        return stopped.exit_status
    except Exception as err:
        if not comm.is_comm_failure(err):
            raise
        comm_failed = True  # no clean-up: it would wait on the same peers
        _report_comm_failure(err, trainer, job_config)
        return 1
    finally:
        try:
            if trainer is not None and not comm_failed:
                trainer.close()
        finally:
            stop.uninstall()
    if stop.signum is not None:  # the signal came after the last step's check
        print(f"stopped: {signal_name(stop.signum)}: received at the end of the run, which completed",
              file=sys.stderr)
        return 128 + stop.signum
    return 0


def _dry_run(job_config: JobConfig) -> int:
    """``comm.mode="fake_backend"``: the set-up for ``$NGPU`` fake ranks in this process and its
    report (:mod:`torchtitan_spmd.dry_run`); 0, or 2 with the set-up error's one line.
    ``"local_tensor"``: the job trained for ``$NGPU`` ranks simulated in this process
    (:func:`~torchtitan_spmd.dry_run.run_local_tensor`; tensor parallelism alone, others a
    one-line setup error naming why)."""
    try:
        world_size = fake_world_size(job_config.comm.mode)
        if job_config.comm.mode == "local_tensor":
            run_local_tensor(job_config, world_size, SETUP_PHASES)
            return 0
        run_dry_run(job_config, world_size, SETUP_PHASES)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def _train_all(job_config: JobConfig) -> list[StepRecord]:
    """A whole run of ``job_config`` in this process (``comm.mode="local_tensor"``'s trainer)."""
    trainer = Trainer(job_config)
    try:
        return trainer.run()
    finally:
        trainer.close()


#: The set-up phases :mod:`torchtitan_spmd.dry_run` runs on fake ranks.
SETUP_PHASES = SetupPhases(validate=validate_job, compose=compose_model, train=_train_all)


def dry_run(job_config: JobConfig, world_size: int) -> DryRunReport:
    """``comm.mode="fake_backend"``'s set-up of ``job_config`` for ``world_size`` fake ranks in this
    process, and its report (:func:`torchtitan_spmd.dry_run.dry_run` with this trainer's phases)."""
    return _dry_run_with(job_config, world_size, SETUP_PHASES)


def _exit(status: int) -> None:
    """End the process with ``status`` without the interpreter's finalization.

    - **Status 1** (a communication failure): nothing more runs, not even the ``atexit``
      handlers, which would wait on the lost peers once more for every collective still queued.
    - **Any other status:** the ``atexit`` handlers run (logging's flush, W&B's and TensorBoard's
      closes), then the streams are flushed and the process ends.

    Why not a plain ``SystemExit``: once a functional collective has run (DTensor and FSDP2 use
    them), the gloo backend's C++ threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) outlive
    ``destroy_process_group()`` with no Python object left to free them (measured with torch
    2.14.1; pytorch/pytorch#179291 describes the hazard), and tearing them down during the
    interpreter's finalization aborted a rank now and then ("terminate called without an active
    exception", exit -6) after a run that had finished and printed ``done:``.
    """
    if status != 1:
        atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(status)


if __name__ == "__main__":
    _exit(main())

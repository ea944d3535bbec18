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

import functools
import json
import logging
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_spmd.checkpoint import hf as hf_checkpoint
from torchtitan_spmd.checkpoint.integrity import (
    StoppedBySignal,
    StopRequest,
    signal_name,
)
from torchtitan_spmd.checkpoint.manager import CheckpointManager, find_checkpoints
from torchtitan_spmd.config import (
    TORCH_DTYPE_MAP,
    ConfigManager,
    JobConfig,
    OptimizerConfig,
    check_supported,
)
from torchtitan_spmd.config.manager import LIBRARY_FIRST
from torchtitan_spmd.data import build_dataloader, build_tokenizer, check_vocab_size
from torchtitan_spmd.distributed import comm
from torchtitan_spmd.distributed.apply_plan import apply_plan
from torchtitan_spmd.distributed.inputs import prepare_inputs, prepare_positions
from torchtitan_spmd.distributed.parallel_dims import ParallelDims
from torchtitan_spmd.distributed.representation import get_representation
from torchtitan_spmd.distributed.utils import (
    get_train_context,
    maybe_enable_amp,
    spmd_backend_scope,
)
from torchtitan_spmd.models import get_model_spec
from torchtitan_spmd.techniques.activation_checkpoint import apply_ac
from torchtitan_spmd.techniques.compile import apply_compile, maybe_compile_loss, validate_compile
from torchtitan_spmd.techniques.context_parallel import ContextParallel, apply_context_parallel
from torchtitan_spmd.techniques.expert_parallel import (
    apply_expert_fsdp,
    apply_expert_parallel,
    expert_parallel_plan,
    validate_expert_parallel,
)
from torchtitan_spmd.techniques.fsdp import (
    apply_fsdp,
    clear_dtensor_sharding_caches,
    set_gradient_sync,
)
from torchtitan_spmd.techniques.grad_norm import clip_grad_norm_
from torchtitan_spmd.techniques.loss import (
    cross_entropy_loss,
    global_loss_value,
    global_token_count,
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
    StageBoundaries,
    states_of,
)
from torchtitan_spmd.tools.metrics import build_metrics_logger
from torchtitan_spmd.tools.utils import GarbageCollection

if TYPE_CHECKING:
    from torchtitan_spmd.models.state_dict_adapter import StateDictAdapter

logger = logging.getLogger("torchtitan_spmd")

__all__ = ["StepRecord", "Trainer", "build_lr_lambda", "build_optimizer", "gradient_accumulation_steps", "main",
           "run_job"]


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

    def log_line(self) -> str:
        """The per-step log line; scripts parse ``step: <n>`` and ``loss: <float>``.

        MoE models add ``tokens/expert: <min>-<max>``."""
        line = (
            f"step: {self.step}  loss: {self.loss:.6f}  grad_norm: {self.grad_norm:.4f}  "
            f"lr: {self.lr:.2e}  tps: {self.tokens_per_s:.0f}  memory: {self.peak_memory_mib:.1f}MiB"
        )
        if self.expert_load is not None:
            line += f"  tokens/expert: {self.expert_load.min}-{self.expert_load.max}"
        return line


def build_lr_lambda(warmup_steps: int, total_steps: int, min_lr_factor: float):  # noqa: ANN201
    """Linear warmup from 0 over ``warmup_steps``, then cosine decay to ``min_lr_factor``."""

    def factor(step: int) -> float:
        # ``step`` counts completed optimizer steps; the first step uses step=0.
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_lr_factor + (1 - min_lr_factor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters with ``optimizer.implementation`` (upstream's names).

    ``"for-loop"``: one parameter at a time; ``"foreach"``: torch's multi-tensor kernels;
    ``"fused"``: one fused kernel (CPU and CUDA). The state is float32 (the parameters'
    dtype, whatever ``training.mixed_precision_param``).
    """
    impl = config.implementation
    return torch.optim.AdamW(
        model.parameters(), lr=config.lr, eps=config.eps, weight_decay=config.weight_decay,
        betas=(0.9, 0.95), foreach=impl == "foreach", fused=impl == "fused",
    )


def gradient_accumulation_steps(global_batch_size: int, local_batch_size: int, dp_degree: int) -> int:
    """Microbatches per step: ``global_batch_size / (local_batch_size * dp_degree)`` (-1: 1).

    Raises ``ValueError`` naming the fields when that is not a positive whole number.
    """
    per_microbatch = local_batch_size * dp_degree
    if global_batch_size < 0:
        return 1
    if global_batch_size < per_microbatch or global_batch_size % per_microbatch:
        raise ValueError(
            f"training.global_batch_size={global_batch_size} must be a positive multiple of "
            f"training.local_batch_size={local_batch_size} x the data-parallel degree {dp_degree} "
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
            for key, value in table.items():
                if theirs[section].get(key) != value:
                    diffs.append(f"{section}.{key}: rank {dist.get_rank()} has {value!r}, rank {rank} has {theirs[section].get(key)!r}")
    if diffs:
        raise ValueError("ranks were started with different configs:\n  " + "\n  ".join(sorted(set(diffs))[:20]))


class Trainer:
    """Builds everything from a :class:`JobConfig` and trains; see :meth:`run`.

    Uses the default process group if one is initialised (tests, notebooks);
    otherwise initialises it from the torchrun environment.
    """

    def __init__(self, job_config: JobConfig) -> None:
        job_config.validate()  # every section's checks again: sections may be mutated after parsing
        check_supported(job_config)  # values of features the runtime does not implement yet
        self.job_config = job_config
        self.device_type = _device_type(job_config)
        self._owns_pg = False
        #: Set by :func:`run_job`: SIGTERM/SIGINT stop the run after the step (and save) in progress.
        self.stop_request: StopRequest | None = None
        comm_cfg = job_config.comm
        #: Where the run is ("during setup", "in step 3") and the timeout in force, for failure reports.
        self.phase = "during setup"
        self.timeout_in_force = ("comm.init_timeout_seconds", comm_cfg.init_timeout_seconds)
        if not dist.is_initialized():
            comm.configure_flight_recorder(comm_cfg, job_config.job.dump_folder)
            comm.init_default_process_group("nccl" if self.device_type == "cuda" else "gloo",
                                            timedelta(seconds=comm_cfg.init_timeout_seconds))
            self._owns_pg = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank)) % torch.cuda.device_count())
        if self.world_size > 1:
            _check_same_config(job_config)

        par = job_config.parallelism
        self.parallel_dims = ParallelDims.from_config(par, self.world_size, device_type=self.device_type)
        self.model_spec = get_model_spec(job_config.model.name)
        # model.hf_assets_path's tokenizer.json, else the byte tokenizer; the model's vocabulary
        # is the tokenizer's (padded to a multiple of 64).
        self.tokenizer = build_tokenizer(job_config.model.hf_assets_path)
        self.model_config = hf_checkpoint.resolve_model_config(
            self.model_spec, job_config, vocab_size=self.tokenizer.model_vocab_size,
            # RoPE tables sized to the run (upstream's update_from_config: max_seq_len = training.seq_len).
            max_seq_len=job_config.training.seq_len)
        check_vocab_size(self.model_config.vocab_size, self.tokenizer,
                         model=f"{job_config.model.name}/{job_config.model.flavor}")
        representation_cls = get_representation(par.spmd_backend)  # the runtime exists, before any mesh
        self.parallel_dims.build_mesh()
        # torch creates the mesh groups with its default timeout (30 min): every group
        # gets comm.init_timeout_seconds until the first step is done.
        comm.set_pg_timeouts(timedelta(seconds=comm_cfg.init_timeout_seconds), self.parallel_dims,
                             barrier=False)
        self._train_timeout_set = False
        # The context-parallel fields first: a bad value is named whatever the torch.
        self.context_parallel = ContextParallel.from_config(job_config, self.parallel_dims)
        self.representation = representation_cls(self.parallel_dims)
        self.representation.validate(job_config)
        validate_expert_parallel(self.model_config, job_config, self.parallel_dims)
        self.model_spec.validate(self.model_config, job_config, self.parallel_dims)
        validate_compile(job_config, self.representation)
        training = job_config.training
        batch_mesh = self.parallel_dims.get_optional_mesh("batch")
        dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
        dp_degree = batch_mesh.size() if batch_mesh is not None else 1
        self.gradient_accumulation_steps = gradient_accumulation_steps(
            training.global_batch_size, training.local_batch_size, dp_degree)

        self.seed = job_config.debug.seed if job_config.debug.seed is not None else 0
        torch.manual_seed(self.seed)
        if job_config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
            # As upstream: deterministic kernels, but new buffers are not filled with NaN
            # (that fill only exposes reads of uninitialised memory, at the cost of a pass
            # over every torch.empty: 2% of a CPU step here).
            torch.utils.deterministic.fill_uninitialized_memory = False
        self.plan = expert_parallel_plan(self.model_spec.sharding_plan(
            self.model_config, sequence_parallel=par.enable_sequence_parallel,
            loss_parallel=not par.disable_loss_parallel,
        ), self.parallel_dims)
        with spmd_backend_scope(par.spmd_backend):
            self.model: nn.Module = self.build_model()

        self.optimizer = build_optimizer(self.model, job_config.optimizer)
        self.loss_fn = maybe_compile_loss(cross_entropy_loss, job_config.compile)
        if self.pipeline is not None:  # the loss runs inside torch's schedule, on the last stage
            checked = (get_train_context(enable_loss_parallel=False, parallel_dims=self.parallel_dims,
                                         representation=self.representation, spmd_typechecking=True)
                       if job_config.debug.spmd_typechecking and self.representation.supports_typechecking
                       else None)  # type checking per stage (StageBoundaries)
            self.pipeline.build_schedule(
                self.model, self.device_type, self.loss_fn,
                boundaries=StageBoundaries.from_plan(self.plan, self.representation, checked=checked),
                representation=self.representation, logits_layout=self.plan.output_layout())
        self.amp = functools.partial(maybe_enable_amp, self.parallel_dims,
                                     training.mixed_precision_param, self.device_type)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            build_lr_lambda(job_config.lr_scheduler.warmup_steps, job_config.training.steps,
                            job_config.lr_scheduler.min_lr_factor),
        )
        # Each step reads this rank's rows of the global batch at once; the step splits
        # them into its microbatches of local_batch_size. The data depends only on the seed
        # and the position (not on training.steps), and the global batch is rank-major, so
        # every layout sees the same data.
        rows = training.local_batch_size * self.gradient_accumulation_steps
        self.dataloader = build_dataloader(
            dp_rank=dp_rank, dp_degree=dp_degree,
            local_batch_size=rows,
            seq_len=training.seq_len, seed=self.seed,
            dataset=training.dataset, dataset_path=training.dataset_path, tokenizer=self.tokenizer,
        )
        #: ``metrics.enable_tensorboard``: rank 0 writes the logged steps' scalars.
        self.metrics = build_metrics_logger(job_config.metrics, job_config.job.dump_folder, writes=self.rank == 0)
        train_context = functools.partial(
            get_train_context,
            enable_loss_parallel=self.parallel_dims.tp_enabled and not par.disable_loss_parallel,
            parallel_dims=self.parallel_dims, representation=self.representation,
        )
        self.train_context = train_context(spmd_typechecking=job_config.debug.spmd_typechecking)
        #: Under pipeline parallelism the schedule runs unchecked; each stage checks itself.
        self.schedule_context = train_context(spmd_typechecking=False)
        #: ``debug.spmd_typechecking_steps``: (steps still to type-check, the unchecked context).
        self._typecheck_countdown: tuple[int, Callable[[], AbstractContextManager[None]]] | None = None
        if job_config.debug.spmd_typechecking and job_config.debug.spmd_typechecking_steps is not None:
            self._typecheck_countdown = (job_config.debug.spmd_typechecking_steps,
                                         train_context(spmd_typechecking=False))
        self.checkpointer = self.build_checkpointer()
        #: The step this run continues after (0: from the start); see CheckpointManager.load.
        self.start_step = 0
        if not job_config.checkpoint.create_seed_checkpoint:
            self.start_step = self.checkpointer.load(step=job_config.checkpoint.load_step)
        #: Python's automatic collector is off from here to :meth:`close` (``training.gc_freq``):
        #: last in set-up, so a set-up error leaves it as it was.
        self.gc_handler = GarbageCollection(training.gc_freq, debug=training.gc_debug)

    def build_checkpointer(self) -> CheckpointManager:
        """The checkpoint technique over this trainer's state (``[checkpoint]``)."""
        cfg, pd = self.job_config, self.parallel_dims
        return CheckpointManager(
            cfg.checkpoint, base_folder=cfg.job.dump_folder, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.scheduler, dataloader=self.dataloader, representation=self.representation,
            state_layouts=self.state_layouts, device_type=self.device_type,
            timeout=timedelta(seconds=cfg.comm.init_timeout_seconds),
            sd_adapter=self._sd_adapter(), hf_assets_path=hf_checkpoint.hf_folder(cfg),
            other_stage_keys=self.pipeline.other_stage_keys if self.pipeline is not None else frozenset(),
            record={"model": f"{cfg.model.name}/{cfg.model.flavor}", "spmd_backend": cfg.parallelism.spmd_backend,
                    "degrees": {"dp_replicate": pd.dp_replicate, "dp_shard": pd.dp_shard, "tp": pd.tp}},
        )

    def _sd_adapter(self) -> StateDictAdapter | None:
        """The family's Hugging Face state-dict adapter for this model config (None: the family has none)."""
        adapter_cls = self.model_spec.state_dict_adapter
        return adapter_cls(self.model_config, hf_checkpoint.hf_folder(self.job_config)) if adapter_cls else None

    def build_model(self) -> nn.Module:
        """Build the model on the meta device, then compose the techniques, in this order.

        1. context parallelism's attention body (before the plan, so that the plan's
           local region wraps it), then the sharding plan: tensor, sequence, context
           and loss parallelism as it declares;
        2. activation checkpointing of every block (``activation_checkpoint.mode``);
        3. ``torch.compile`` of every block (``compile.enable``, ``"model"``);
        4. FSDP2 on what the representation shards, with the mixed-precision policy;
        5. materialise on the device and initialise, each rank its shards of the
           full, seeded weights (the same whatever the layout).

        Under pipeline parallelism the model is first split and this rank's stage (its part
        of the model, the plan restricted to it) goes through the same steps.
        """
        rep, cfg = self.representation, self.job_config
        # DTensor's sharding caches key on mesh equality: an equal mesh of an earlier trainer in this
        # process (a notebook, a fake-process-group setup before a fork) must not come back from them
        # on this trainer's parameters, with process groups that no longer exist.
        clear_dtensor_sharding_caches()
        with torch.device("meta"):
            model = self.model_spec.build(self.model_config)
        set_force_load_balance(model, cfg.debug.moe_force_load_balance)
        plan = self.plan
        #: This rank's pipeline stage and schedule (None without pipeline parallelism).
        self.pipeline = PipelineParallel.from_config(cfg, self.parallel_dims, model)
        #: Whether the MoE load is pooled over the stages (PP with MoE blocks, some maybe on other stages).
        self._moe_over_stages = self.pipeline is not None and bool(moe_blocks(model))
        if self.pipeline is not None:
            model, plan = self.pipeline.split(model, plan)
        apply_context_parallel(model, plan, self.context_parallel)
        self.state_layouts = apply_plan(model, plan, rep)
        apply_expert_parallel(model, rep, self.state_layouts)
        apply_ac(model, cfg.activation_checkpoint)
        if cfg.compile.enable and "model" in cfg.compile.components:
            apply_compile(model, cfg.compile, fullgraph=not self.parallel_dims.ep_enabled)
        roots = self.pipeline.stage_modules(model) if self.pipeline is not None else [model]
        param_dtype = TORCH_DTYPE_MAP[cfg.training.mixed_precision_param]
        reduce_dtype = TORCH_DTYPE_MAP[cfg.training.mixed_precision_reduce]
        reshard = False if self.pipeline is not None else None
        # EP: the experts over efsdp first, then the blocks over fsdp
        apply_expert_fsdp(model, rep, param_dtype=param_dtype, reduce_dtype=reduce_dtype,  # type: ignore[arg-type]
                          reshard_after_forward=reshard)
        apply_fsdp(model, plan, rep, param_dtype=param_dtype, reduce_dtype=reduce_dtype,  # type: ignore[arg-type]
                   reshard_after_forward=reshard, roots=roots)
        for root in roots:  # each FSDP root materialises its own parameters
            init_weights(root, states_of(root, self.state_layouts), rep, seed=self.seed, device=self.device_type)
        return model

    def step(self, step: int) -> StepRecord:
        """Run optimizer step number ``step`` (1-based).

        This rank's rows of the global batch are split into
        ``gradient_accumulation_steps`` microbatches of ``training.local_batch_size``;
        each runs forward and backward, its loss divided by the token count of the
        whole global batch, and FSDP reduces the gradients after the last one only.
        """
        self._count_typechecked_step(step)
        start = time.perf_counter()
        tokens, labels = next(self.dataloader)
        tokens, labels = tokens.to(self.device_type), labels.to(self.device_type)
        rep, n = self.representation, self.gradient_accumulation_steps
        positions: list[torch.Tensor | None] = [None] * n
        if self.context_parallel is not None:  # this rank's slice of every sequence, and its positions
            tokens, labels, cp_positions = self.context_parallel.shard_batch(tokens, labels)
            positions = [prepare_positions(p, rep) for p in cp_positions.chunk(n)]
        micro = [prepare_inputs(t, y, rep) for t, y in zip(tokens.chunk(n), labels.chunk(n), strict=True)]
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
        pp_group = self.pipeline.group if self.pipeline is not None else None
        grad_norm = clip_grad_norm_(self.model.parameters(), self.job_config.training.max_norm, rep,
                                    stage_group=pp_group)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        # MoE load balancing (no-op for dense models); under PP the logged load is every stage's
        expert_load = update_expert_bias(self.model, rep, stage_group=pp_group if self._moe_over_stages else None)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = sum(losses[1:], losses[0])
        loss_value = (global_loss_value(loss, rep) if self.pipeline is None
                      else self.pipeline.global_loss(loss, rep.sum_over_batch))
        elapsed = time.perf_counter() - start
        return StepRecord(
            step=step, loss=loss_value, grad_norm=grad_norm, lr=lr,
            tokens_per_s=tokens.numel() / elapsed if elapsed > 0 else float("inf"),
            peak_memory_mib=_peak_memory_mib(self.device_type), expert_load=expert_load,
        )

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
        for step in range(self.start_step + 1, steps + 1):
            self.phase = f"in step {step}"
            self.gc_handler.run(step)
            record = self.step(step)
            records.append(record)
            if not self._train_timeout_set:
                self.use_train_timeout()
            if self.rank == 0 and (step % log_freq == 0 or step == steps):
                logger.info(record.log_line())
                self.metrics.log(record)
            self.checkpointer.save(step, last_step=step == steps)
            self._stop_if_signalled(step)
        self.checkpointer.wait()
        return records

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m torchtitan_spmd.train`` (normally under torchrun).

    Exit status: 0 done; 1 a collective timed out or lost a peer (one line per rank
    says which, see :func:`~torchtitan_spmd.distributed.comm.describe_comm_failure`);
    2 a bad config or environment (one ``error:`` line), a checkpoint that does not verify
    or load, or a save that failed (disk full, I/O error, no permission); ``128 + N`` stopped
    by signal N (SIGTERM 143, SIGINT 130) after the step and save in progress (a ``stopped:`` line).
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not sys.warnoptions:
        warnings.simplefilter("default", DeprecationWarning)
    try:
        job_config = ConfigManager(module_packages=LIBRARY_FIRST).parse_args(list(argv) if argv is not None else None)
    except (ValueError, TypeError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
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
    trainer = None
    comm_failed = False
    stop = StopRequest().install()
    try:
        trainer = Trainer(job_config)
        trainer.stop_request = stop
        if trainer.rank == 0:
            par = asdict(job_config.parallelism)
            logger.info(f"job: {job_config.job.description}")
            logger.info(
                f"torchtitan_spmd: {trainer.world_size} rank(s) on {trainer.device_type}, "
                f"spmd_backend={par['spmd_backend']}, model={job_config.model.name}/{job_config.model.flavor}, "
                f"degrees dp_replicate={trainer.parallel_dims.dp_replicate} dp_shard={trainer.parallel_dims.dp_shard} "
                f"tp={trainer.parallel_dims.tp}"
                + (f" pp={trainer.parallel_dims.pp}" if trainer.parallel_dims.pp > 1 else "")
            )
            _write_outputs(job_config)
        records = trainer.run()
        if trainer.rank == 0 and records:
            logger.info(f"done: loss {records[0].loss:.4f} -> {records[-1].loss:.4f} in {len(records)} steps")
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
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


def _exit(status: int) -> None:
    """Exit with ``status``; after a communication failure without Python's clean-up, which
    would wait on the lost peers once more for every collective still queued."""
    if status == 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    raise SystemExit(status)


if __name__ == "__main__":
    _exit(main())

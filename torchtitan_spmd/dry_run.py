"""``comm.mode="fake_backend"``: a dry run of a whole job's set-up on fake ranks, in one process.

``NGPU=16384 python -m torchtitan_spmd.train --module llama3 --config C --comm.mode fake_backend``
runs the trainer's set-up for ``NGPU`` ranks (upstream's ``run_train.sh`` reads ``NGPU`` too)
on torch's fake process group: every config validation (:func:`~torchtitan_spmd.train.validate_job`,
so the first setup error is the one line a real run prints), the meshes, the pipeline split and
schedule, the sharding plan (TP/SP, CP), expert parallelism, activation checkpointing and FSDP2,
with the model on the meta device: no parameter memory is allocated.

It then reports, for each distinct rank role (each pipeline stage; every EP slice holds the same
number of experts, so one EP rank stands for all), measured on that rank's sharded meta parameters
(their local shapes, not formulas):

- the bytes of parameters, gradients (the parameters' local shapes and dtype, as FSDP2 leaves
  them) and optimizer states (torch's AdamW run for one step on the meta parameters: its states
  as it creates them, the ``step`` scalars included);
- an activation estimate for one microbatch (:func:`activation_bytes`, a formula: see there);
- the peak estimate against ``comm.fake_device_memory_gib`` (default 80 GiB);
- the bytes this rank sends in one step on each mesh axis (:func:`comm_bytes_per_step`: FSDP's
  collectives from its units, those inside the model counted on a meta copy, EP and PP by formula).

The report is printed and written as JSON to ``<job.dump_folder>/dry_run.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_spmd.config.activation_checkpoint import ac_section

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig

logger = logging.getLogger("torchtitan_spmd")

__all__ = ["DryRunReport", "RoleReport", "SetupPhases", "check_local_tensor", "dry_run", "fake_world_size", "run_dry_run",
           "run_local_tensor"]

#: The environment variable that gives the simulated world size (upstream's ``run_train.sh``).
WORLD_SIZE_ENV = "NGPU"


def fake_world_size(mode: str, environ: dict[str, str] | None = None) -> int:
    """The world size a simulated ``comm.mode`` runs for: ``$NGPU``, as upstream.

    Raises ``ValueError`` naming the variable when it is missing or not a positive integer."""
    env = os.environ if environ is None else environ
    value = env.get(WORLD_SIZE_ENV)
    if value is None:
        raise ValueError(f"comm.mode={mode!r} simulates the ranks in one process and takes their number from "
                         f"the environment variable {WORLD_SIZE_ENV} (e.g. {WORLD_SIZE_ENV}=64), which is not set.")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"environment variable {WORLD_SIZE_ENV}={value!r} (comm.mode={mode!r}) must be an "
                         "integer >= 1: the number of ranks to simulate.")
    return int(value)


@dataclass
class RoleReport:
    """One distinct rank role: what one of its ranks holds and moves (bytes)."""

    #: e.g. ``"pp stage 0 (rank 0)"``.
    role: str
    #: The simulated rank that stands for the role.
    rank: int
    #: How many ranks have this role.
    ranks: int
    #: The pipeline stages this rank holds (empty without PP) and their modules.
    stages: list[int]
    modules: list[str]
    #: Parameters on this rank (elements of the local shards, and bytes).
    param_numel: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    #: The activation estimate of one microbatch (bytes) and how it was obtained.
    activation_bytes: int
    activation_method: str
    #: Microbatches whose activations are alive at once at the peak (PP schedules: up to ``pp``).
    activation_microbatches_in_flight: int
    #: Parameters gathered for compute at once (FSDP: the largest unit, x2 for prefetch), bytes.
    gathered_param_bytes: int
    peak_bytes: int
    device_memory_bytes: int
    #: Bytes this rank sends per step on each mesh axis (``{"fsdp": ..., "tp": ...}``; ring
    #: algorithms, see :func:`ring_bytes`) and how they were obtained.
    comm_bytes_per_step: dict[str, int] = field(default_factory=dict)
    comm_method: str = ""
    #: What the model converters changed (:func:`~torchtitan_spmd.techniques.converters.converted_counts`):
    #: float8 linears, LoRA's adapters, the frozen parameters (counted in the peak, not as gradients).
    converted: dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether the peak estimate fits the device memory."""
        return self.peak_bytes <= self.device_memory_bytes


@dataclass
class DryRunReport:
    """What a dry run found: the job, its degrees and a :class:`RoleReport` per role."""

    model: str
    world_size: int
    degrees: dict[str, int]
    spmd_backend: str
    total_params: int
    roles: list[RoleReport]
    seconds: float = 0.0
    #: The vocabulary the model was sized with, and where it came from.
    vocabulary: str = ""

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON data (``fits`` of each role included)."""
        out = asdict(self)
        for role, data in zip(self.roles, out["roles"], strict=True):
            data["fits"] = role.fits
        return out

    def text(self) -> str:
        """The report as the dry run prints it."""
        gib = 2**30
        lines = [f"dry run: {self.model} on {self.world_size} fake ranks, spmd_backend={self.spmd_backend}, "
                 + " ".join(f"{k}={v}" for k, v in self.degrees.items()),
                 f"  model parameters: {self.total_params:,} ({self.total_params / 1e9:.2f} B)"]
        if self.vocabulary:
            lines.append(f"  vocabulary: {self.vocabulary}")
        for r in self.roles:
            comm_text = ", ".join(f"{k} {_size(v)}" for k, v in r.comm_bytes_per_step.items()) or "none"
            lines += [
                f"  {r.role} x {r.ranks} ranks: stages {r.stages or '-'}",
                f"    parameters {r.param_numel:,}: {r.param_bytes / gib:.3f} GiB  gradients {r.grad_bytes / gib:.3f} GiB  "
                f"optimizer {r.optimizer_bytes / gib:.3f} GiB",
                f"    activations {r.activation_bytes / gib:.3f} GiB a microbatch ({r.activation_method}), "
                f"{r.activation_microbatches_in_flight} in flight; gathered parameters {r.gathered_param_bytes / gib:.3f} GiB",
                f"    peak {r.peak_bytes / gib:.2f} GiB of {r.device_memory_bytes / gib:.0f} GiB: "
                f"{'fits' if r.fits else 'DOES NOT FIT'}",
                f"    sent a step per mesh axis: {comm_text}",
            ]
            if r.converted:  # model converters (float8, LoRA)
                lines.append("    converted: " + ", ".join(f"{k} {v:,}" for k, v in r.converted.items()))
        lines.append(f"  ({self.seconds:.1f} s)")
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at 1 or more (``"1.50 GiB"``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of every tensor in ``optimizer.state`` (local shards; ``step`` scalars included)."""
    return sum(_nbytes(v) for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _init_optimizer_states(job_config: JobConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Torch's AdamW, with the states a real first step creates: a zero gradient on each (meta)
    parameter, one ``step()``, then the gradients dropped. No memory is touched on meta.

    It runs one parameter at a time (``foreach=False, fused=False``): the fused kernel has no meta
    implementation, and every implementation creates the same states (``exp_avg`` and
    ``exp_avg_sq`` like the parameter, a float32 ``step`` scalar)."""
    opt = job_config.optimizer
    optimizer = torch.optim.AdamW(params, lr=opt.lr, eps=opt.eps, weight_decay=opt.weight_decay,
                                  betas=(0.9, 0.95), foreach=False, fused=False)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _roles(parallel_dims: Any) -> list[tuple[str, int, int]]:
    """(name, representative rank, ranks with the role): one role per pipeline rank (``pp`` is the
    outermost mesh axis, so pp rank ``p`` starts at rank ``p * world / pp``)."""
    world, pp = parallel_dims.world_size, parallel_dims.pp
    per = world // pp
    if pp == 1:
        return [("every rank", 0, world)]
    return [(f"pp rank {p}", p * per, per) for p in range(pp)]


def _init_fake(world_size: int, rank: int) -> None:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size)


@dataclass(frozen=True)
class SetupPhases:
    """The trainer's set-up phases the dry run runs (given by :mod:`torchtitan_spmd.train`, which
    imports this module: so this module imports nothing of the trainer's)."""

    #: ``validate_job(job_config, world_size, device_type) -> JobSetup``.
    validate: Callable[..., Any]
    #: ``compose_model(...) -> BuiltModel`` (called with ``materialize=False``).
    compose: Callable[..., Any]
    #: ``train(job_config) -> list of step records``: the whole run (``comm.mode="local_tensor"``).
    train: Callable[[Any], list[Any]] | None = None


def dry_run(job_config: JobConfig, world_size: int, phases: SetupPhases) -> DryRunReport:
    """The set-up of ``job_config`` for ``world_size`` ranks on a fake process group, and its
    report (see the module docstring). Raises the set-up's ``ValueError``/``TypeError`` as a
    real run does. Initialises (and destroys) torch's default process group: none may exist.
    With TP it runs a backward on the meta device (:func:`_counted_comm`), which starts autograd's
    threads: a process that forks ranks afterwards cannot train in them (run it in a clean child: ``launcher.run_isolated``)."""
    from torchtitan_spmd.techniques.context_parallel import ContextParallel
    from torchtitan_spmd.techniques.converters import converted_counts
    from torchtitan_spmd.techniques.pipeline_parallel import PipelineParallel
    validate_job, compose_model = phases.validate, phases.compose

    if dist.is_initialized():
        raise ValueError(f"comm.mode={job_config.comm.mode!r}: a process group already exists in this "
                         "process; the dry run creates its own fake one.")
    start = time.perf_counter()
    job_config.validate()
    _SAVED_CACHE.clear()
    roles: list[RoleReport] = []
    total_params = 0
    setup0 = validate_job(job_config, world_size, "cpu")  # the first error, before any process group
    pd0 = setup0.parallel_dims
    degrees = {k: getattr(pd0, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
    try:
        measured: dict[Any, tuple[int, int, int, int, dict[str, Any]]] = {}
        counted: tuple[dict[str, int], dict[str, int], str] | None = None
        for name, rank, count in _roles(setup0.parallel_dims):
            pp_names = None
            if setup0.stages is not None:
                pp_rank = rank // (world_size // setup0.parallel_dims.pp)
                pp_names = [setup0.stages.parts[i] for i in setup0.stages.indices_of(pp_rank)]
            # Stages of the same shape (as many blocks, the same other modules) hold the same bytes:
            # one build per shape (the middle stages of a deep pipeline share one).
            key = None if pp_names is None else tuple(
                (sum(n.startswith("layers.") for n in part), tuple(n for n in part if not n.startswith("layers.")))
                for part in pp_names)
            _init_fake(world_size, rank)
            setup = validate_job(job_config, world_size, "cpu")
            pd = setup.parallel_dims
            pd.build_mesh()
            pipeline = PipelineParallel.from_stages(setup.stages, pd)
            if not total_params:
                with torch.device("meta"):
                    total_params = sum(p.numel() for p in setup.model_spec.build(setup.model_config).parameters())
            if key not in measured or key is None:
                built = compose_model(job_config, setup.representation, setup.model_spec, setup.model_config,
                                      setup.plan, pd, ContextParallel.from_config(job_config, pd), pipeline,
                                      seed=setup.seed, device_type="cpu", materialize=False)
                if pipeline is not None:  # torch's schedule over this rank's stages (its own checks)
                    from torchtitan_spmd.techniques.loss import cross_entropy_loss  # noqa: PLC0415

                    pipeline.build_schedule(built.model, "cpu", cross_entropy_loss,
                                            representation=setup.representation,
                                            logits_layout=setup.plan.output_layout())
                params = [p for p in built.model.parameters() if p.requires_grad]
                optimizer = _init_optimizer_states(job_config, params)
                measured[key] = (sum(_local(p).numel() for p in params), sum(_nbytes(p) for p in params),
                                 optimizer_state_bytes(optimizer), _gathered_param_bytes(built, setup, job_config),
                                 built_comm(job_config, setup, built, pipeline), converted_counts(built.model))
                del built, optimizer, params
            numel, param_bytes, opt_bytes, gathered, from_built, converted = measured[key]
            if counted is None:  # the collectives inside the model: the same for every role
                counted = _counted_comm(job_config, setup, _microbatch(job_config, pipeline), axis_names(pd))
            comm, comm_method = comm_bytes_per_step(job_config, setup, pipeline, from_built, counted)
            act_bytes, act_method = activation_bytes(job_config, setup, None, pipeline)
            in_flight = _microbatches_in_flight(setup, pipeline)
            peak = param_bytes * 2 + opt_bytes + act_bytes * in_flight + gathered + converted.get("frozen_bytes", 0)
            roles.append(RoleReport(
                role=name, rank=rank, ranks=count,
                stages=list(pipeline.stage_indices) if pipeline is not None else [],
                modules=[m for names in pipeline.module_names for m in names] if pipeline is not None else [],
                param_numel=numel, param_bytes=param_bytes,
                grad_bytes=param_bytes, optimizer_bytes=opt_bytes,
                activation_bytes=act_bytes, activation_method=act_method,
                activation_microbatches_in_flight=in_flight, gathered_param_bytes=gathered,
                peak_bytes=peak, device_memory_bytes=int(job_config.comm.fake_device_memory_gib * 2**30),
                comm_bytes_per_step=comm, comm_method=comm_method, converted=converted,
            ))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return DryRunReport(model=f"{job_config.model.name}/{job_config.model.flavor}", world_size=world_size,
                        degrees=degrees, spmd_backend=job_config.parallelism.spmd_backend,
                        total_params=total_params, roles=roles, seconds=time.perf_counter() - start,
                        vocabulary=vocabulary_source(job_config, setup0))


def vocabulary_source(job_config: JobConfig, setup: Any) -> str:
    """The model's vocabulary and where it came from, as the report says it: the flavour's own when
    no tokenizer is given (``hf_assets_path`` unset), else the tokenizer's."""
    vocab = setup.model_config.vocab_size
    if job_config.model.flavor == "from_hf":
        return f"{vocab:,} ids, the Hugging Face folder's config.json"
    if job_config.hf_assets_path is None:
        return f"{vocab:,} ids, the flavour's own (no tokenizer: hf_assets_path is unset)"
    return (f"{vocab:,} ids, the tokenizer's of hf_assets_path={job_config.hf_assets_path!r} "
            f"({setup.tokenizer.vocab_size:,} ids padded to a multiple of 64)")


# ---------------------------------------------------------------------------------------------
# Estimates (formulas; each says what it counts)


def _microbatch(job_config: JobConfig, pipeline: Any) -> int:
    """Sequences per microbatch: the pipeline's microbatch, else ``training.local_batch_size``."""
    return pipeline.microbatch_rows if pipeline is not None else job_config.training.local_batch_size


def _microbatches_in_flight(setup: Any, pipeline: Any) -> int:
    """Microbatches whose saved activations are alive at once: 1 without PP; under a 1F1B-style
    schedule the first stage holds ``min(n_microbatches, pp - stage)`` (GPipe: all of them)."""
    if pipeline is None:
        return 1
    n, pp = pipeline.n_microbatches, setup.parallel_dims.pp
    if pipeline.schedule_name.lower() == "gpipe":
        return n * len(pipeline.stage_indices)
    first = min(pipeline.stage_indices)
    return max(1, min(n * len(pipeline.stage_indices), pp - first % pp))


def _gathered_param_bytes(built: Any, setup: Any, job_config: JobConfig) -> int:
    """Parameters FSDP holds unsharded at once: twice the largest FSDP unit's own parameters (the
    unit computing and the one prefetched), unsharded over that unit's shard mesh (``fsdp``, or
    ``efsdp`` for the experts) as ``fully_shard`` padded them, in its ``param_dtype``; 0 without FSDP."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    largest = 0
    for unit in (m for m in built.model.modules() if isinstance(m, FSDPModule)):
        state = unit._get_fsdp_state()  # torch's FSDP2 state: the unit's parameter groups
        for group in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:
            if group is None:
                continue
            numel = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
            item = (group.mp_policy.param_dtype or torch.float32).itemsize
            largest = max(largest, numel * group.mesh_info.shard_mesh_size * item)
    return 2 * largest


class _FlashAttentionSaves(torch.autograd.Function):
    """On meta, what a flash-attention kernel keeps for backward: ``q``, ``k``, ``v``, the output
    and a float32 log-sum-exp per query (the meta device would otherwise pick the math kernel,
    which keeps the ``seq x seq`` scores that no real kernel here keeps). With packed documents'
    ``positions`` (``attn_mask_type="block_causal"``) also the boolean mask it is given,
    ``[batch, 1, seq, seq]``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # noqa: D102
                positions: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        saved = [q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32)]
        if positions is not None:
            b, s = positions.shape
            saved.append(q.new_empty((b, 1, s, s), dtype=torch.bool))
        ctx.with_positions = positions is not None
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: D102
        q, k, v = ctx.saved_tensors[:3]
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        return (*grads, None) if ctx.with_positions else grads


def _balanced_expert_outputs(experts: nn.Module) -> Callable[..., torch.Tensor]:
    """``experts.expert_outputs`` with the rows split evenly over the experts: on meta the router's
    choice has no values, so the rows per expert (``counts``) cannot be read; balanced routing
    gives each expert ``rows / num_experts`` of them. What the experts save for backward depends
    only on the rows in all (each row's input once, four ``rows x hidden`` tensors of the SwiGLU)."""
    original = experts.expert_outputs

    def balanced(x: torch.Tensor, counts: torch.Tensor, *, grouped: bool | None = None) -> torch.Tensor:
        n = experts.num_experts
        even = torch.tensor([x.shape[0] // n + (e < x.shape[0] % n) for e in range(n)])
        return original(x, even, grouped=False)

    return balanced


#: :func:`_count_saved`'s results in this process, by (model config, batch, seq, dtype, selective AC).
_SAVED_CACHE: dict[tuple[Any, ...], tuple[list[int], int]] = {}


class _SelectiveSaves:
    """What selective AC keeps of one block's forward, counted on meta as the real run's
    ``create_selective_checkpoint_contexts`` keeps it: a dispatch mode asks the block's own per-op
    policy (:func:`~torchtitan_spmd.techniques.activation_checkpoint.selective_policy`, fresh for
    each forward, as each checkpoint's context) about every op and counts the outputs it saves;
    attention (a flash kernel's saves on meta, :class:`_FlashAttentionSaves`) counts as the SDPA
    op's output and log-sum-exp, which the policy saves. Plus the block's input, which the
    checkpoint keeps to recompute the rest. Under tensor parallelism (the copy is unsharded) each
    saved output counts ``1/tp`` of itself, except a rowwise linear's (the plan's weight
    ``S(1)@tp``), which is the whole pending sum on every TP rank, plus, under sequence
    parallelism, the ``1/tp`` its reduce-scatter returns (the policy saves reduce-scatters); the
    block's input counts ``1/tp`` under sequence parallelism."""

    def __init__(self, add: Callable[[torch.Tensor, float], None], tp: int, sequence_parallel: bool) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415
        from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext  # noqa: PLC0415

        self.policy: Callable[..., Any] | None = None
        self.in_attention = False
        #: inside a rowwise linear (weight ``S(1)@tp``): its output is the whole partial sum
        self.rowwise = False
        outer = self
        saving = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204, D105
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if outer.policy is None or outer.in_attention or func is torch.ops.aten.detach.default:
                    return out
                ctx = SelectiveCheckpointContext(is_recompute=False)
                if outer.policy(ctx, func, *args, **kwargs) in saving:
                    for t in torch.utils._pytree.tree_leaves(out):
                        if not isinstance(t, torch.Tensor):
                            continue
                        if outer.rowwise:  # the whole partial output; under SP also its reduce-scatter's
                            add(t, 1.0)
                            if tp > 1 and sequence_parallel:
                                add(t.new_empty(t.shape), 1.0 / tp)
                        else:  # colwise outputs, heads: 1/tp of the unsharded copy's
                            add(t, 1.0 / tp)
                return out

        self.mode = Mode()


def _count_saved(setup: Any, batch: int, seq: int, dtype: torch.dtype, selective: Any = None,
                 tp: int = 1, sequence_parallel: bool = True, ep: int = 1) -> tuple[list[int], int]:
    """Saved-for-backward bytes of each block of a short copy of the model and of everything else
    (embedding, final norm, output, loss; the parameters a layer saves are not counted; attention
    keeps what a flash kernel keeps: :class:`_FlashAttentionSaves`), counted: an unsharded copy on
    the meta device runs forward and the loss on ``batch x seq`` tokens under saved-tensor hooks;
    each saved storage counted once, in the block that saved it first. The copy has one block, or,
    when the first ``first_k_dense_replace`` blocks are dense and the rest MoE (DeepSeek-V3), those
    and one MoE block: block ``i`` of the model is then like block ``min(i, k)`` of the copy.

    ``selective`` (the ``activation_checkpoint`` section, mode ``"selective"``): a block keeps what
    selective AC keeps of it (:class:`_SelectiveSaves`: its input and the outputs of the ops its
    per-op policy saves), not what autograd would save without AC; then each block's bytes are
    this rank's under ``tp`` (``sequence_parallel``) already. Under expert parallelism (``ep > 1``)
    an MoE block's policy also saves its two all-to-alls' outputs (the rows dispatched to this
    rank's experts and the rows combined back), which the copy, unsharded, never runs: each is
    counted as ``tokens / tp x top_k`` rows of ``dim`` (balanced routing, as the communication
    estimate)."""
    import dataclasses  # noqa: PLC0415

    from torchtitan_spmd.models.common import ScaledDotProductAttention  # noqa: PLC0415
    from torchtitan_spmd.models.moe import GroupedExperts  # noqa: PLC0415
    from torchtitan_spmd.techniques.activation_checkpoint import selective_policy  # noqa: PLC0415

    key = (repr(setup.model_config), batch, seq, dtype, repr(selective), tp, sequence_parallel, ep)
    if key in _SAVED_CACHE:
        return _SAVED_CACHE[key]
    config = setup.model_config
    dense = getattr(config, "first_k_dense_replace", 0) if getattr(config, "num_experts", 0) else 0
    config = dataclasses.replace(config, n_layers=min(config.n_layers, dense + 1))
    with torch.device("meta"):
        model = setup.model_spec.build(config).to(dtype)
    blocks = list(model.layers.values())
    # parameters a layer saves for its backward are not activations
    seen: dict[int, int] = {p.untyped_storage()._cdata: 0 for p in model.parameters()}
    where = {"block": -1}
    per = [0] * (len(blocks) + 1)  # the blocks', then the rest's (index -1)

    alive: list[torch.Tensor] = []  # what is counted stays alive: a freed storage's address is reused

    def add(t: torch.Tensor, scale: float = 1.0) -> None:
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen[st._cdata] = st.nbytes()
            per[where["block"]] += int(st.nbytes() * scale)
            alive.append(t)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if selective is None or where["block"] < 0:  # under selective AC a block keeps only its policy's saves
            add(t)
        return t

    sac = _SelectiveSaves(add, tp, sequence_parallel) if selective is not None else None
    if sac is not None:  # the linears the plan makes rowwise: their output stays whole on every TP rank
        from torchtitan_spmd.distributed.layout import S  # noqa: PLC0415
        from torchtitan_spmd.distributed.plan import fqn_matches  # noqa: PLC0415

        rowwise = [pattern for pattern, plan in setup.plan.modules.items()
                   if (w := plan.params.get("weight")) is not None and w.axis_types.get("tp") == S(1)]
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and any(fqn_matches(p, name) for p in rowwise):
                module.register_forward_pre_hook(lambda *_: setattr(sac, "rowwise", True))
                module.register_forward_hook(lambda *_: setattr(sac, "rowwise", False))

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                  ) -> torch.Tensor:
        args = (q, k, v) if positions is None else (q, k, v, positions)
        if sac is None or sac.policy is None:
            return _FlashAttentionSaves.apply(*args)
        sac.in_attention = True
        try:
            out = _FlashAttentionSaves.apply(*args)
        finally:
            sac.in_attention = False
        add(out, 1.0 / tp)  # the SDPA op's outputs, which the policy saves: the output and the log-sum-exp
        add(q.new_empty(q.shape[:-1], dtype=torch.float32), 1.0 / tp)
        return out

    for module in model.modules():
        if isinstance(module, ScaledDotProductAttention):
            module.forward = attention  # type: ignore[method-assign]
        if isinstance(module, GroupedExperts):
            module.expert_outputs = _balanced_expert_outputs(module)  # type: ignore[method-assign]

    def enter(i: int, args: tuple[Any, ...]) -> None:
        where["block"] = i
        if sac is not None:
            add(args[0], 1.0 / tp if sequence_parallel else 1.0)  # the checkpoint keeps the block's input
            sac.policy = selective_policy(blocks[i], selective, f"layers.{i}")
            if ep > 1 and getattr(blocks[i], "moe_enabled", False):  # the saved all-to-alls (dispatch, combine)
                rows = batch * seq // tp * blocks[i].moe.router.top_k
                for _ in range(2):
                    add(torch.empty(rows, config.dim, dtype=dtype, device="meta"))

    def leave() -> None:
        where["block"] = -1
        if sac is not None:
            sac.policy = None

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda _m, args, i=i: enter(i, args))
        block.register_forward_hook(lambda *_: leave())
    x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    # packed documents (block_causal): per-document positions, from which each attention builds its mask
    kwargs = {"positions": x} if getattr(config, "attn_mask_type", "causal") == "block_causal" else {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
            sac.mode if sac is not None else contextlib.nullcontext()):
        logits = model(x, **kwargs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
    _SAVED_CACHE[key] = (per[:-1], per[-1])
    return _SAVED_CACHE[key]


def activation_bytes(job_config: JobConfig, setup: Any, built: Any, pipeline: Any) -> tuple[int, str]:
    """The saved activations of one microbatch on this rank (bytes) and how they were obtained.

    Counted (:func:`_count_saved`) on one unsharded block at this rank's tokens
    (``local_batch_size`` or the pipeline microbatch, times ``seq_len / cp``), then scaled by
    ``1 / tp`` (tensor and sequence parallelism shard what a block saves, to first order), times
    the blocks this rank holds. ``activation_checkpoint.mode="full"``: a block keeps only its input
    (``tokens x dim`` in the compute dtype, sequence-sharded under SP). ``"selective"``: a block
    keeps its input and the outputs its per-op policy saves, counted with the real run's policy
    (:class:`_SelectiveSaves`). The embedding, final norm, output and loss go to the rank holding the
    output. MoE blocks are counted as if routing were balanced (:func:`_balanced_expert_outputs`;
    under selective AC and EP with the all-to-all outputs the policy saves).
    """
    from torchtitan_spmd.config import TORCH_DTYPE_MAP  # noqa: PLC0415

    pd, training = setup.parallel_dims, job_config.training
    batch = pipeline.microbatch_rows if pipeline is not None else training.local_batch_size
    tokens = batch * training.seq_len // pd.cp
    dtype = TORCH_DTYPE_MAP[training.mixed_precision_param] if pd.dp_shard * pd.cp > 1 else torch.float32
    names = ([m for names in pipeline.module_names for m in names] if pipeline is not None
             else setup.model_spec.part_names(setup.model_config))
    indices = [int(m.split(".")[1]) for m in names if m.startswith("layers.")]
    holds_output = "output" in names
    ac = ac_section(job_config.activation_checkpoint)
    mode = ac.mode
    sp = job_config.parallelism.enable_sequence_parallel
    blocks, rest = _count_saved(setup, batch, training.seq_len // pd.cp, dtype,
                                selective=ac if mode == "selective" else None, tp=pd.tp, sequence_parallel=sp,
                                ep=pd.ep if mode == "selective" else 1)
    if mode == "full":
        dim = setup.model_config.dim
        per_block = tokens * dim * dtype.itemsize // (pd.tp if sp else 1)
        total = len(indices) * per_block
        how = "counted (full AC: each block keeps its input)"
    else:  # selective: the blocks' bytes are this rank's already
        total = sum(blocks[min(i, len(blocks) - 1)] for i in indices) // (1 if mode == "selective" else pd.tp)
        how = "counted on one block on meta, scaled by 1/tp" + (
            " (selective AC: the block's input and what its per-op policy saves)" if mode == "selective" else "")
    return total + (rest // pd.tp if holds_output else 0), how


# ---------------------------------------------------------------------------------------------
# Communication volume of one step, per mesh axis


#: The order in which a process group is named after a mesh axis: one group can serve several
#: axes (with ``cp = 1`` the ``fsdp``, ``batch`` and ``loss`` axes are the same ranks, one group).
COMM_AXIS_ORDER = ("tp", "fsdp", "cp", "ep", "efsdp", "pp", "dp_replicate", "loss", "batch", "dp_shard", "dp")


def axis_names(parallel_dims: Any) -> dict[str, str]:
    """Each process group's name -> the mesh axis it is reported under (the first of
    :data:`COMM_AXIS_ORDER` whose active mesh uses it)."""
    out: dict[str, str] = {}
    for axis in COMM_AXIS_ORDER:
        if axis in parallel_dims.mesh_axis_names:
            mesh = parallel_dims.get_optional_mesh(axis)
            if mesh is not None:
                out.setdefault(mesh.get_group(0).group_name, axis)
    return out


def ring_bytes(kind: str, nbytes: int, n: int) -> int:
    """The bytes one rank sends in a collective over ``n`` ranks under a ring algorithm (the
    convention of nccl-tests' bus bandwidth): an all-gather of an ``nbytes`` result and a
    reduce-scatter of an ``nbytes`` input send ``(n - 1) / n`` of it, an all-reduce twice that,
    an all-to-all the ``(n - 1) / n`` of its input that goes to other ranks (even splits), a
    send all of it."""
    if n <= 1:
        return 0
    share = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}.get(kind)
    if kind == "send":
        return nbytes
    if share is None:
        raise ValueError(f"ring_bytes: unknown collective {kind!r}")
    return share * nbytes * (n - 1) // n


class _CommCounter:
    """A dispatch mode over the meta step of :func:`_counted_comm`: each collective the step issues
    (the c10d ops and the functional ones DTensor desugars into; torch's ``CommDebugMode`` has the
    same structure, but counts calls, not bytes) as ``(group name, bytes sent)`` (:func:`ring_bytes`)."""

    _KINDS = {"_allgather_base_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
              "all_gather_into_tensor": ("all_gather_in", 0), "all_gather_into_tensor_coalesced": ("all_gather_in", 0),
              "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
              "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
              "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
              "all_reduce": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0),
              "alltoall_base_": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 0), "send": ("send", 0)}

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

        self.sent: list[tuple[str, int]] = []
        sent, kinds = self.sent, self._KINDS

        def size(t: Any) -> int:
            return sum(size(x) for x in t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204, D105
                from torch.distributed.tensor import DTensor  # noqa: PLC0415

                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented  # DTensor desugars into the collectives first
                kwargs = kwargs or {}
                name = func._schema.name.split("::")[-1]
                if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd") and name in kinds:
                    named = {**dict(zip([a.name for a in func._schema.arguments], args, strict=False)), **kwargs}
                    group = named.get("process_group", named.get("group_name"))
                    if isinstance(group, torch.ScriptObject):
                        group = dist.ProcessGroup.unbox(group)
                    if isinstance(group, str):
                        from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: PLC0415

                        group = _resolve_process_group(group)
                    kind, index = kinds[name]
                    n = group.size()
                    nbytes = size(args[index])
                    if kind == "all_gather_in":  # the functional all-gather takes the shard
                        kind, nbytes = "all_gather", nbytes * n
                    sent.append((group.group_name, ring_bytes(kind, nbytes, n)))
                return func(*args, **kwargs)

        self.mode = Mode()


def _add(into: dict[str, int], axis: str, nbytes: int, times: int = 1) -> None:
    if nbytes and times:
        into[axis] = into.get(axis, 0) + nbytes * times


def _fsdp_comm(built: Any, axes: dict[str, str], microbatches: int, pipelined: bool,
               out: dict[str, int]) -> None:
    """FSDP2's collectives of a step, from this rank's FSDP units as ``fully_shard`` set them up
    (their parameters' padded shards, dtypes and meshes; counted, not a formula over the model):

    - an all-gather of each unit's unsharded parameters (``param_dtype``) before each microbatch's
      forward, and again before its backward when the unit reshards after forward (not a root
      with the default policy: FSDP2 keeps the root gathered; under PP none reshards, and the
      parameters stay gathered across the schedule's microbatches: one all-gather a step);
    - a reduce-scatter of the unsharded gradients (``reduce_dtype``) once a step (gradient
      accumulation and the pipeline schedule sync only the last microbatch); with HSDP, then an
      all-reduce of the gradient shard over the replicas.
    """
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    units = [m for m in built.model.modules() if isinstance(m, FSDPModule)]
    inner = {id(m) for u in units for m in u.modules() if m is not u and isinstance(m, FSDPModule)}
    for unit in units:
        state = unit._get_fsdp_state()  # torch's FSDP2 state: the unit's parameter groups
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        for group in (g for g in groups if g is not None):
            info = group.mesh_info
            n = info.shard_mesh_size
            numel = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params) * n
            param_size = (group.mp_policy.param_dtype or torch.float32).itemsize
            reduce_size = (group.mp_policy.reduce_dtype or group.mp_policy.param_dtype or torch.float32).itemsize
            axis = axes.get(info.shard_process_group.group_name, "fsdp")
            root = id(unit) not in inner and state._auto_reshard_after_forward
            reshards = group.post_forward_mesh_info is not None and not root
            gathers = 1 if pipelined else microbatches * (2 if reshards else 1)
            _add(out, axis, ring_bytes("all_gather", numel * param_size, n), gathers)
            _add(out, axis, ring_bytes("reduce_scatter", numel * reduce_size, n))
            replicate = getattr(info, "replicate_process_group", None)
            if replicate is not None and replicate.size() > 1:
                _add(out, axes.get(replicate.group_name, "dp_replicate"),
                     ring_bytes("all_reduce", numel // n * reduce_size, replicate.size()))


def _counted_comm(job_config: JobConfig, setup: Any, batch: int, axes: dict[str, str],
                  ) -> tuple[dict[str, int], dict[str, int], str]:
    """The collectives one microbatch's forward, loss and backward issue inside the model (TP/SP,
    loss parallelism, CP's attention, AC's recompute), counted: copies of the model with one and
    with two blocks, on the meta device, with this rank's plan, CP and AC applied (no FSDP: that is
    :func:`_fsdp_comm`'s; MoE bodies stand in as identities: EP's formula in :func:`comm_bytes_per_step`),
    in the compute dtype (``mixed_precision_param`` under FSDP, as its cast makes it), run a
    step of ``batch x seq_len`` tokens on the fake process group under :class:`_CommCounter`;
    then the reduction of pending-sum gradients (``Partial``: replicated weights under sequence
    parallelism) that the gradient clipping does. Returns (one block's bytes, the rest's bytes,
    each per axis) and how they were obtained."""
    import dataclasses  # noqa: PLC0415

    from torch.distributed.tensor import DTensor, Replicate  # noqa: PLC0415

    from torchtitan_spmd.config import TORCH_DTYPE_MAP  # noqa: PLC0415
    from torchtitan_spmd.distributed.apply_plan import apply_plan  # noqa: PLC0415
    from torchtitan_spmd.distributed.inputs import prepare_inputs, prepare_positions  # noqa: PLC0415
    from torchtitan_spmd.distributed.utils import get_train_context  # noqa: PLC0415
    from torchtitan_spmd.techniques.activation_checkpoint import apply_ac  # noqa: PLC0415
    from torchtitan_spmd.techniques.context_parallel import ContextParallel, apply_context_parallel  # noqa: PLC0415
    from torchtitan_spmd.techniques.converters import build_converters, convert_model  # noqa: PLC0415
    from torchtitan_spmd.techniques.fsdp import clear_dtensor_sharding_caches  # noqa: PLC0415
    from torchtitan_spmd.techniques.loss import cross_entropy_loss  # noqa: PLC0415
    from torchtitan_spmd.techniques.moe import moe_blocks  # noqa: PLC0415
    from torchtitan_spmd.techniques.pipeline_parallel import part_plan  # noqa: PLC0415
    from torchtitan_spmd.techniques.quantization import targets_optional  # noqa: PLC0415

    pd, rep, seq = setup.parallel_dims, setup.representation, job_config.training.seq_len
    dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param] if pd.dp_shard * pd.cp > 1 else torch.float32
    if not (pd.tp_enabled or pd.cp_enabled):
        return {}, {}, "none in the model (no TP, no CP)"
    if pd.cp_enabled:  # measured: torch's ring attention has no meta kernel
        return {}, {}, ("inside the model NOT COUNTED under CP (its ring attention has no meta kernel): "
                        "TP and CP bytes are missing")
    counts = []
    for layers in (1, 2):
        clear_dtensor_sharding_caches()
        config = dataclasses.replace(setup.model_config, n_layers=layers)
        with torch.device("meta"):
            model = setup.model_spec.build(config).to(dtype)  # FSDP's param_dtype: activations in it
        with targets_optional():  # as compose_model: the plan names them (a cut-down model may hold no experts)
            convert_model(model, build_converters(job_config.model.converters, dry_run=True))
        for block in moe_blocks(model):
            block.forward = lambda x: x * 1.0  # type: ignore[method-assign]
        context_parallel = ContextParallel.from_config(job_config, pd)
        apply_context_parallel(model, setup.plan, context_parallel)
        # the plan's patterns this copy holds: DeepSeek-V3's first blocks are dense, so a one- or
        # two-block copy has no MoE for the plan's MoE patterns to match
        apply_plan(model, part_plan(setup.plan, model), rep)
        apply_ac(model, job_config.activation_checkpoint)
        tokens = torch.zeros(batch, seq // pd.cp, dtype=torch.long, device="meta")
        x, y = prepare_inputs(tokens, tokens, rep)
        kwargs = {} if context_parallel is None else {  # this rank's positions, as the trainer's step
            "positions": prepare_positions(context_parallel.positions(batch, seq, device="meta"), rep)}
        if getattr(setup.model_config, "attn_mask_type", "causal") == "block_causal":  # per-document positions
            kwargs["positions"] = prepare_positions(torch.zeros(batch, seq, dtype=torch.long, device="meta"), rep)
        context = get_train_context(enable_loss_parallel=pd.tp_enabled and not job_config.parallelism.disable_loss_parallel,
                                    parallel_dims=pd, representation=rep, spmd_typechecking=False)
        counter = _CommCounter()
        with context(), counter.mode:
            loss = cross_entropy_loss(model(x, **kwargs), y, rep, logits_layout=setup.plan.output_layout(),
                                      token_count=torch.ones((), device="meta"))
            loss.backward()
            for p in model.parameters():  # the gradient clipping's reduction of pending sums over tp
                # (those over the data-parallel axes, as full_dtensor's gradients have, are FSDP's
                # reduce-scatter in the real run: _fsdp_comm's)
                grad = p.grad
                if isinstance(grad, DTensor):
                    names = grad.device_mesh.mesh_dim_names or ()
                    tp_partial = [q.is_partial() and i < len(names) and names[i] == "tp"
                                  for i, q in enumerate(grad.placements)]
                    if any(tp_partial):
                        grad.redistribute(grad.device_mesh, [Replicate() if r else q for q, r in
                                                             zip(grad.placements, tp_partial, strict=True)])
        per: dict[str, int] = {}
        for group, nbytes in counter.sent:
            _add(per, axes.get(group, group), nbytes)
        counts.append(per)
    one, two = counts
    block = {k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two)}
    rest = {k: one.get(k, 0) - block.get(k, 0) for k in one}
    return ({k: v for k, v in block.items() if v}, {k: v for k, v in rest.items() if v},
            "counted: a one- and a two-block copy on meta run a microbatch under a dispatch mode")


def _grad_norm_comm(built: Any, setup: Any, axes: dict[str, str], pipelined: bool, out: dict[str, int]) -> None:
    """The scalars of a step: the global token count and the logged loss (a float32 each over the
    ``loss`` axis), the gradient norm (one all-reduce per group some gradient is sharded over, of one
    float32 per distinct set of such groups, as :mod:`~torchtitan_spmd.techniques.grad_norm` buckets
    them), the experts' load (one float32 per expert and MoE block) and, under PP, the norm's and
    the loss's sums over ``pp``."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from torchtitan_spmd.techniques.moe import moe_blocks  # noqa: PLC0415

    pd, rep = setup.parallel_dims, setup.representation
    loss_mesh = pd.get_optional_mesh("loss")
    blocks = moe_blocks(built.model)
    if loss_mesh is not None:
        group = loss_mesh.get_group(0)
        for nbytes in (4, 4, sum(b.experts.num_experts for b in blocks) * 4):
            _add(out, axes.get(group.group_name, "loss"), ring_bytes("all_reduce", nbytes, group.size()))
    keys: dict[tuple[str, ...], tuple[Any, ...]] = {}
    for p in built.model.parameters():
        if not p.requires_grad:
            continue
        if isinstance(p, DTensor):
            groups = tuple(p.device_mesh.get_group(i) for i, q in enumerate(p.placements)
                           if not q.is_replicate() and p.device_mesh.size(i) > 1)
        else:
            groups = tuple(rep.grad_shard_groups(p))
        keys.setdefault(tuple(g.group_name for g in groups), groups)
    seen: dict[str, Any] = {}
    for groups in keys.values():
        for g in groups:
            seen.setdefault(g.group_name, g)
    for name, group in seen.items():
        buckets = sum(1 for key in keys if name in key)
        _add(out, axes.get(name, name), ring_bytes("all_reduce", 4 * buckets, group.size()))
    if pipelined:
        pp = pd.get_optional_mesh("pp").get_group(0)
        for nbytes in (4, 4) + ((16,) if built.moe_over_stages else ()):
            _add(out, axes.get(pp.group_name, "pp"), ring_bytes("all_reduce", nbytes, pp.size()))


def built_comm(job_config: JobConfig, setup: Any, built: Any, pipeline: Any) -> dict[str, Any]:
    """What :func:`comm_bytes_per_step` reads from this rank's built (meta) model: FSDP's and the
    scalars' bytes per axis (:func:`_fsdp_comm`, :func:`_grad_norm_comm`) and its MoE blocks'
    ``(top_k, num_experts)``."""
    from torchtitan_spmd.techniques.moe import moe_blocks  # noqa: PLC0415

    axes = axis_names(setup.parallel_dims)
    microbatches = pipeline.n_microbatches if pipeline is not None else setup.gradient_accumulation_steps
    out: dict[str, int] = {}
    _fsdp_comm(built, axes, microbatches, pipeline is not None, out)
    _grad_norm_comm(built, setup, axes, pipeline is not None, out)
    return {"bytes": out, "moe": [(b.router.top_k, b.experts.num_experts) for b in moe_blocks(built.model)]}


def comm_bytes_per_step(job_config: JobConfig, setup: Any, pipeline: Any, built: dict[str, Any],
                        counted: tuple[dict[str, int], dict[str, int], str]) -> tuple[dict[str, int], str]:
    """The bytes this rank sends in one step on each mesh axis (:func:`ring_bytes`), and how:

    - FSDP's all-gathers and reduce-scatters, from this rank's FSDP units (:func:`_fsdp_comm`,
      read by :func:`built_comm` into ``built``);
    - the collectives inside the model (TP/SP, loss parallelism, CP), counted on meta
      (``counted``: :func:`_counted_comm`), times the blocks this rank holds and the microbatches
      of the step; what lies outside the blocks goes to the rank holding the output;
    - expert parallelism, a formula: per MoE block and microbatch, the dispatch and the combine
      all-to-all forward and backward (again forward under full AC) of ``tokens x top_k`` rows of
      ``dim`` in the compute dtype, ``(ep - 1) / ep`` of them to other ranks as if routing were
      balanced (the rows a rank sends depend on routing), and the all-to-all of the counts;
    - pipeline parallelism, a formula: each microbatch's stage output sent forward (not from the
      last stage) and its input gradient sent back (not from the first), ``microbatch x seq / cp x
      dim`` in the compute dtype (``/ tp`` under sequence parallelism);
    - the scalars (:func:`_grad_norm_comm`).
    """
    from torchtitan_spmd.config import TORCH_DTYPE_MAP  # noqa: PLC0415

    pd, training, par = setup.parallel_dims, job_config.training, job_config.parallelism
    axes = axis_names(pd)
    microbatches = pipeline.n_microbatches if pipeline is not None else setup.gradient_accumulation_steps
    batch = pipeline.microbatch_rows if pipeline is not None else training.local_batch_size
    dtype = TORCH_DTYPE_MAP[training.mixed_precision_param] if pd.dp_shard * pd.cp > 1 else torch.float32
    names = ([m for names in pipeline.module_names for m in names] if pipeline is not None
             else setup.model_spec.part_names(setup.model_config))
    n_blocks = sum(1 for m in names if m.startswith("layers."))
    out = dict(built["bytes"])
    block, rest, _ = counted
    for axis, nbytes in block.items():
        _add(out, axis, nbytes, n_blocks * microbatches)
    if "output" in names:
        for axis, nbytes in rest.items():
            _add(out, axis, nbytes, microbatches)
    tokens = batch * training.seq_len // pd.cp
    moe = built["moe"]
    if moe and pd.ep_enabled:
        ep = pd.get_optional_mesh("ep").get_group(0)
        top_k, experts = moe[0]
        rows = tokens // pd.tp * top_k * setup.model_config.dim * dtype.itemsize
        full_ac = ac_section(job_config.activation_checkpoint).mode == "full"
        per_block = (ring_bytes("all_to_all", rows, ep.size()) * (6 if full_ac else 4)
                     + ring_bytes("all_to_all", experts * 8, ep.size()) * (2 if full_ac else 1))
        _add(out, axes.get(ep.group_name, "ep"), per_block, len(moe) * microbatches)
    if pipeline is not None:
        pp = pd.get_optional_mesh("pp").get_group(0)
        boundary = tokens * setup.model_config.dim * dtype.itemsize // (pd.tp if par.enable_sequence_parallel else 1)
        last = pd.pp * len(pipeline.stage_indices) - 1
        sends = sum((s < last) + (s > 0) for s in pipeline.stage_indices)
        _add(out, axes.get(pp.group_name, "pp"), boundary, sends * microbatches)
    how = ("FSDP from its units; " + counted[2] + "; EP and PP by formula (balanced routing); "
           "bytes sent by this rank, ring algorithms")
    return dict(sorted(out.items())), how


def check_local_tensor(job_config: JobConfig, world_size: int, phases: SetupPhases) -> Any:
    """``comm.mode="local_tensor"``'s checks: the config validated for ``world_size`` ranks (the
    first setup error is a real run's), then the layouts it cannot simulate refused, in one line
    naming why. Returns the validated set-up. Simulated: tensor parallelism alone (every other
    degree 1) under the backends whose registry record says so (``default``, ``full_dtensor``),
    whose numbers equal the multi-process run's (tests/layer3_runtime/test_dry_run.py).

    - ``spmd_types``: measured failing (its set-up reads the symbolic rank as an integer).

    - FSDP (``dp_shard x cp > 1``, HSDP's ``dp_replicate``): LocalTensorMode cannot simulate
      FSDP2, which takes each shard's rank from the process group (every simulated rank would
      hold rank 0's shard: silently wrong numbers).
    - Pipeline and expert parallelism: not simulated (not verified: torch's pipeline schedule and
      the experts' token exchange read the rank and per-rank counts as Python numbers).
    """
    setup = phases.validate(job_config, world_size, "cpu")
    pd = setup.parallel_dims
    if not setup.representation.supports_local_tensor:
        raise ValueError(
            f"comm.mode='local_tensor' does not simulate spmd_backend={job_config.parallelism.spmd_backend!r} "
            "(measured: its set-up fails on the rank, which LocalTensorMode makes symbolic: 'LocalIntNode' object "
            "has no attribute 'int_'); "
            "simulate the layout under 'default' or 'full_dtensor', or size the job with comm.mode='fake_backend'.")
    if pd.dp_shard * pd.cp * pd.dp_replicate > 1:
        raise ValueError(
            f"comm.mode='local_tensor' cannot simulate this layout (dp_replicate={pd.dp_replicate}, "
            f"dp_shard={pd.dp_shard}, cp={pd.cp}): LocalTensorMode cannot simulate FSDP2, which takes each "
            "shard's rank from the process group; simulate the tensor-parallel layout alone (every data-parallel "
            "and context-parallel degree 1), or size the job with comm.mode='fake_backend'.")
    if pd.pp > 1 or pd.ep > 1:
        raise ValueError(
            f"comm.mode='local_tensor' does not simulate pipeline_parallel_degree={pd.pp} or "
            f"expert_parallel_degree={pd.ep} (only tensor parallelism is simulated: torch's pipeline schedule and "
            "the experts' token exchange read the rank and the tokens per rank as Python numbers); size the job "
            "with comm.mode='fake_backend'.")
    return setup


def run_local_tensor(job_config: JobConfig, world_size: int, phases: SetupPhases) -> list[Any]:
    """``comm.mode="local_tensor"``: the job trained for ``world_size`` ranks in this one process
    (:func:`check_local_tensor` first): torch's fake default process group and its
    ``LocalTensorMode``, under which every tensor holds each simulated rank's value and the
    collectives combine them. Returns the trainer's step records (``phases.train``)."""
    from torch.distributed._local_tensor import LocalTensorMode  # noqa: PLC0415

    check_local_tensor(job_config, world_size, phases)
    if phases.train is None:
        raise ValueError("comm.mode='local_tensor': no trainer was given (SetupPhases.train).")
    if dist.is_initialized():
        raise ValueError("comm.mode='local_tensor': a process group already exists in this process; the "
                         "simulation creates its own fake one.")
    _init_fake(world_size, 0)
    try:
        with LocalTensorMode(world_size):
            return phases.train(job_config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_dry_run(job_config: JobConfig, world_size: int, phases: SetupPhases) -> DryRunReport:
    """:func:`dry_run`, the report printed and written to ``<job.dump_folder>/dry_run.json``."""
    report = dry_run(job_config, world_size, phases)
    print(report.text(), flush=True)
    path = os.path.join(job_config.job.dump_folder, "dry_run.json")
    try:
        os.makedirs(job_config.job.dump_folder or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=2)
            f.write("\n")
    except OSError as err:
        raise ValueError(f"job.dump_folder: cannot write {path!r}: {err.strerror or err}.") from None
    logger.info(f"dry run: the report is in {path}")
    return report



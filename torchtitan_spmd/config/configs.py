"""The config sections, a drop-in for ``torchtitan.config.configs``.

Training, parallelism, checkpoint, activation checkpointing, compile, comm and
debug have torchtitan's fields, types and defaults (pytorch/torchtitan at
a0c831c49, June 2026); job, model, optimizer, lr_scheduler and metrics are this
library's own. Every section is a keyword-only dataclass that tyro can parse and
that checks its values on construction (see :mod:`._section`).

Fields for features this library does not implement yet keep torchtitan's
default; :func:`torchtitan_spmd.config.support.check_supported` rejects any
other value at setup, naming the feature.
"""

from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# Lines marked "compat hook" call into compat/ for the legacy `full_dtensor`
# spellings; deleting compat/ and those lines removes legacy support.
from torchtitan_spmd.compat import legacy as _legacy  # compat hook

from . import backends as _backends
from ._section import Section, invalid_choice

__all__ = [
    "DATASETS",
    "SPMD_BACKENDS",
    "SPMD_BACKEND_ALIASES",
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "DebugConfig",
    "JobSection",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "SpmdBackend",
    "TrainingConfig",
]

SpmdBackend = Literal["default", "full_dtensor", "spmd_types"]

#: The built-in values of ``parallelism.spmd_backend``, in documentation order
#: (:func:`.backends.backend_names` adds any registered later).
SPMD_BACKENDS: tuple[str, ...] = get_args(SpmdBackend)

#: The valid values of ``training.dataset`` (``"synthetic"``, the default, first).
DATASETS: tuple[str, ...] = ("synthetic", "c4_test", "text", "json", "parquet")

#: Spellings written by newer torchtitan releases, normalised on load
#: (the registry's table: ``"partial_dtensor"`` is upstream's later name for ``"default"``).
SPMD_BACKEND_ALIASES: dict[str, str] = _backends._ALIASES

if SPMD_BACKENDS != _backends.backend_names():  # pragma: no cover - a packaging error
    raise ImportError(f"SpmdBackend {SPMD_BACKENDS} and the registry {_backends.backend_names()} disagree.")


# --------------------------------------------------------------------------------------
# This library's own sections.
# --------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class JobSection(Section):
    """``[job]``: where a legacy TOML config came from and where outputs go."""

    section_name: typing.ClassVar[str] = "job"

    config_file: str | None = None
    """The TOML file this config was loaded from (``--job.config_file``, the pre-registry loader)."""

    dump_folder: str = "./outputs"
    """Folder for logs and other outputs of the run."""

    description: str = "torchtitan_spmd job"
    """Free-form description printed at start-up."""


@dataclass(kw_only=True)
class ModelConfig(Section):
    """``[model]``: which model family and size preset to build."""

    section_name: typing.ClassVar[str] = "model"

    name: str = "llama3"
    """Model family, e.g. ``"llama3"`` or ``"qwen3"``."""

    flavor: str = "debugmodel"
    """Size preset of the family, e.g. ``"debugmodel"``."""

    hf_assets_path: str | None = None
    """A Hugging Face assets folder (torchtitan's ``model.hf_assets_path``): its
    ``tokenizer.json`` (and ``tokenizer_config.json`` for BOS/EOS) is the tokenizer, through
    the ``tokenizers`` package (``pip install torchtitan-spmd[hf]``). None (this library's
    default; torchtitan's is ``"./tests/assets/tokenizer"``): the built-in byte tokenizer."""


@dataclass(kw_only=True)
class OptimizerConfig(Section):
    """``[optimizer]``: AdamW settings."""

    section_name: typing.ClassVar[str] = "optimizer"

    name: Literal["AdamW"] = "AdamW"
    """Optimizer class. Only ``"AdamW"`` is built in."""

    lr: float = 8e-4
    """Peak learning rate."""

    eps: float = 1e-8
    """AdamW epsilon."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""

    implementation: Literal["for-loop", "foreach", "fused", "fused_opt_states_bf16"] = "fused"
    """How the optimizer updates the parameters (upstream's ``optimizer.implementation``):
    ``"fused"`` (one fused kernel per step; CPU and CUDA), ``"foreach"`` (multi-tensor
    kernels) or ``"for-loop"`` (one parameter at a time). ``"fused_opt_states_bf16"``
    (bf16 moment buffers) is upstream's too."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_finite("lr", minimum=0, strict=True)
        self._require_finite("eps", minimum=0, strict=True)
        self._require_finite("weight_decay", minimum=0, strict=False)


@dataclass(kw_only=True)
class LRSchedulerConfig(Section):
    """``[lr_scheduler]``: linear warmup, then cosine decay."""

    section_name: typing.ClassVar[str] = "lr_scheduler"

    warmup_steps: int = 2
    """Steps of linear warmup from 0 to ``optimizer.lr``."""

    min_lr_factor: float = 0.1
    """Cosine decay ends at ``min_lr_factor * optimizer.lr``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self._require(0.0 <= self.min_lr_factor <= 1.0, "min_lr_factor", "must be in [0, 1]")


@dataclass(kw_only=True)
class MetricsConfig(Section):
    """``[metrics]``: logging."""

    section_name: typing.ClassVar[str] = "metrics"

    log_freq: int = 1
    """Log every ``log_freq`` steps (and always the last step)."""

    enable_tensorboard: bool = False
    """Write loss, grad norm, lr, tokens/s and memory of every step as TensorBoard scalars
    (torchtitan's field; needs ``pip install torchtitan-spmd[tensorboard]``)."""

    save_tb_folder: str = "tb"
    """Folder under ``job.dump_folder`` for the TensorBoard event files (torchtitan's field);
    each run writes a ``YYYYmmdd-HHMM`` subfolder, as torchtitan."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.log_freq >= 1, "log_freq", "must be >= 1")
        self._require(bool(self.save_tb_folder.strip()), "save_tb_folder", "must not be empty")


# --------------------------------------------------------------------------------------
# torchtitan's sections.
# --------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TrainingConfig(Section):
    """``[training]``: the training loop and its dtypes."""

    section_name: typing.ClassVar[str] = "training"

    local_batch_size: int = 8
    """Sequences per data-parallel rank per step."""

    global_batch_size: int = -1
    """Sequences per step over all ranks; -1 means ``local_batch_size`` times the
    data-parallel degree. A larger value means gradient accumulation."""

    seq_len: int = 2048
    """Tokens per sequence."""

    max_norm: float | int = 1.0
    """Gradient-norm clipping threshold over the global norm (0 disables clipping)."""

    steps: int = 10000
    """Number of optimizer steps."""

    enable_cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state on the CPU between uses (FSDP offload)."""

    dtype: Literal["bfloat16", "float32"] = "float32"
    """Dtype of parameters, gradients and optimizer state. ``"bfloat16"`` trains entirely
    in bf16 with no fp32 master copy (RoPE and logits stay fp32)."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of parameters under mixed precision (FSDP's ``param_dtype`` when
    parameters are sharded, ``torch.autocast`` under DDP or on one device)."""

    mixed_precision_reduce: Literal["float32"] = "float32"
    """Dtype of FSDP's gradient reductions under mixed precision."""

    gc_freq: int = 50
    """Run Python's garbage collector every ``gc_freq`` steps."""

    gc_debug: bool = False
    """Collect garbage at every step to find reference cycles holding device tensors."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``"auto"`` picks CUDA (nccl) when available, else CPU (gloo).
    (This library's own field.)"""

    dataset: str = "synthetic"
    """The training data (torchtitan's ``training.dataset`` before its config moved to
    ``dataloader.dataset``): ``"synthetic"`` (the default: generated in code, byte-level),
    ``"c4_test"`` (torchtitan's local test set: a folder of JSON lines with a ``text`` field,
    ``tests/assets/c4_test`` unless ``dataset_path``), or local files of one format read
    through the ``datasets`` package (``pip install torchtitan-spmd[hf]``) at ``dataset_path``:
    ``"text"`` (one document per line), ``"json"`` (JSON lines with a ``text`` field) or
    ``"parquet"`` (a ``text`` column). Nothing is downloaded."""

    dataset_path: str | None = None
    """Where the dataset's files are (a file, a folder or a glob pattern); required for
    ``"text"``, ``"json"`` and ``"parquet"``, not allowed for ``"synthetic"``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "local_batch_size", "seq_len", "gc_freq"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(
            self.global_batch_size == -1 or self.global_batch_size >= 1,
            "global_batch_size", "must be >= 1, or -1 for local_batch_size * data-parallel degree",
        )
        self._require_finite("max_norm", minimum=0, strict=False)
        if self.dataset in ("c4", "c4_validation"):
            raise ValueError(f"training.dataset={self.dataset!r} is torchtitan's download of allenai/c4; "
                             "nothing is downloaded here: use 'json' with training.dataset_path on a "
                             "local copy of its JSON lines, or 'c4_test'.")
        if self.dataset not in DATASETS:
            raise invalid_choice("training.dataset", self.dataset, DATASETS)
        if self.dataset == "synthetic" and self.dataset_path is not None:
            raise ValueError(f"training.dataset_path={self.dataset_path!r} needs a file dataset: set "
                             f"training.dataset to one of {', '.join(map(repr, DATASETS[1:]))}.")
        if self.dataset in ("text", "json", "parquet") and not self.dataset_path:
            raise ValueError(f"training.dataset={self.dataset!r} needs training.dataset_path "
                             "(a file, a folder or a glob pattern of local files).")


_DEGREES = (
    "data_parallel_replicate_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "expert_tensor_parallel_degree",
)


@_legacy.accept_legacy_parallelism_kwargs  # compat hook
@dataclass(kw_only=True)
class ParallelismConfig(
    _legacy.LegacyParallelismMixin,  # compat hook
    Section,
):
    """``[parallelism]``: parallel degrees, their options, and the SPMD backend."""

    _field_checks: typing.ClassVar[dict[str, typing.Callable[[Any, str], Any]]] = {
        "spmd_backend": lambda value, where: _backends.resolve_backend(value, where),
    }

    section_name: typing.ClassVar[str] = "parallelism"

    data_parallel_replicate_degree: int = 1
    """Replicated data-parallel degree (DDP; the outer axis of HSDP when
    ``data_parallel_shard_degree > 1``). 1 disables it."""

    data_parallel_shard_degree: int = -1
    """Sharded data-parallel (FSDP) degree; -1 uses the ranks left over by the other
    degrees. Only this degree may be -1; 1 disables sharding."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """When FSDP frees gathered parameters after forward: ``"default"`` (FSDP's own
    choice), ``"always"`` or ``"never"``."""

    enable_fsdp_symm_mem: bool = False
    """Use symmetric-memory communication for FSDP collectives (NVIDIA compute
    capability 9.0 or newer, or ROCm)."""

    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (Megatron-style column/row sharding). 1 disables it."""

    disable_loss_parallel: bool = False
    """Gather the vocab-sharded logits before the loss instead of a vocab-parallel loss."""

    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with compute (needs ``compile.enable``)."""

    enable_sequence_parallel: bool = True
    """Shard norms and residual activations along the sequence dim when TP is on."""

    spmd_backend: SpmdBackend = "default"
    """How parallelism is expressed: ``"default"`` (DTensor on TP/EP axes plus FSDP2),
    ``"full_dtensor"`` (every tensor a DTensor on the multi-axis mesh) or
    ``"spmd_types"`` (plain local tensors typed with ``spmd_types``)."""

    pipeline_parallel_degree: int = 1
    """Pipeline-parallel degree: the number of physical stages' ranks (looped schedules
    put several virtual stages on one rank). 1 disables it."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """Explicit split of the model for pipelining: one list of module names per model
    chunk, e.g. ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]``."""

    pipeline_parallel_first_stage_less_layers: int = 1
    """Layers fewer on the first stage, which also holds the embedding."""

    pipeline_parallel_last_stage_less_layers: int = 1
    """Layers fewer on the last stage, which also holds the output projection."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Layers per (virtual) stage; None infers it from the model, schedule and degree."""

    pipeline_parallel_schedule: str = "1F1B"
    """Name of a ``torch.distributed.pipelining`` schedule, e.g. ``"1F1B"`` or ``"Interleaved1F1B"``."""

    pipeline_parallel_schedule_csv: str | None = ""
    """Path of a CSV file describing a custom pipeline schedule (one row per pp rank of compute
    actions such as ``0F1``, run by torch's ``_PipelineScheduleRuntime``); empty for none.
    ``pipeline_parallel_schedule`` still sizes and places the stages: a schedule's name, or
    ``PipelineScheduleSingle`` / ``PipelineScheduleMulti`` (one stage a rank / several)."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch; ``local_batch_size`` must be a multiple of it."""

    context_parallel_degree: int = 1
    """Context-parallel degree (sequence split across ranks inside attention). 1 disables it."""

    context_parallel_load_balancer: str | None = "headtail"
    """Context-parallel load balancing: ``"headtail"`` (SDPA), ``"ptrr"`` (FlexAttention)
    or None for none. The empty string is rejected."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How context-parallel attention exchanges key/value shards."""

    expert_parallel_degree: int = 1
    """Expert-parallel degree for MoE layers. Not a factor of the world size: it reuses
    the ranks of ``dp_shard * cp * tp``, which it must divide. 1 disables it."""

    expert_tensor_parallel_degree: int = 1
    """Tensor-parallel degree of the experts under expert parallelism: 1 or
    ``tensor_parallel_degree`` (torchtitan's rule before a0c831c49, which dropped the field);
    only 1 runs (checked at setup)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in _DEGREES:
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(
            self.data_parallel_shard_degree >= 1 or self.data_parallel_shard_degree == -1,
            "data_parallel_shard_degree", "must be >= 1, or -1 to infer it",
        )
        for name in ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers"):
            self._require(getattr(self, name) >= 0, name, "must be >= 0")
        self._require(self.pipeline_parallel_microbatch_size >= 1, "pipeline_parallel_microbatch_size",
                      "must be >= 1")
        self._require(
            self.pipeline_parallel_layers_per_stage is None or self.pipeline_parallel_layers_per_stage >= 1,
            "pipeline_parallel_layers_per_stage", "must be >= 1, or None to infer it",
        )
        self._require(
            self.context_parallel_load_balancer != "", "context_parallel_load_balancer",
            "cannot be the empty string (use None to disable load balancing)",
        )
        if self.enable_fsdp_symm_mem and not _symm_mem_capable():
            raise ValueError(
                "parallelism.enable_fsdp_symm_mem=True needs a CUDA device of compute "
                "capability 9.0 or newer (or ROCm)."
            )

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "spmd_backend":
            value = _backends.resolve_backend(value)
        super().__setattr__(name, value)


def _symm_mem_capable() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    return torch.version.hip is not None or torch.cuda.get_device_capability() >= (9, 0)


@dataclass(kw_only=True)
class CheckpointConfig(Section):
    """``[checkpoint]``: torchtitan's ``CheckpointManager.Config``."""

    section_name: typing.ClassVar[str] = "checkpoint"

    enable: bool = False
    """Save (and resume from) checkpoints."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to the dump folder."""

    interval: int = 500
    """Save every ``interval`` steps."""

    initial_load_path: str | None = None
    """Checkpoint to start from when the run's own folder holds none (a full path,
    including the step folder)."""

    initial_load_model_only: bool = True
    """From ``initial_load_path`` load only the model, not optimizer or scheduler state."""

    initial_load_in_hf: bool = False
    """``initial_load_path`` is a Hugging Face safetensors checkpoint (model only)."""

    initial_load_in_hf_quantized: bool = False
    """The Hugging Face checkpoint has quantized keys to dequantize on load."""

    last_save_model_only: bool = True
    """The final save holds only the model (loadable with ``weights_only=True``)."""

    last_save_in_hf: bool = False
    """Write the final save as Hugging Face safetensors (needs ``last_save_model_only``)."""

    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    """Dtype of the final model-only save."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Blocking saves (``"disabled"``), ``async_save`` on a thread (``"async"``), or a
    separate process with pinned shared memory (``"async_with_pinned_mem"``)."""

    keep_latest_k: int = 10
    """Keep only the newest ``k`` checkpoints (0 keeps all; 1 is not allowed)."""

    load_step: int = -1
    """Step to load; -1 loads the newest."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not to load, e.g. ``optimizer,lr_scheduler`` on the command line;
    never ``model``."""

    enable_first_step_checkpoint: bool = False
    """Also save right after the first step, to check that saving works."""

    create_seed_checkpoint: bool = False
    """Initialise the unsharded model, save it as a seed checkpoint and exit (one rank)."""

    load_only: bool = False
    """Load checkpoints but never save."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(bool(self.folder.strip()), "folder", "cannot be empty")
        self._require("\0" not in self.folder, "folder", "cannot contain a NUL character")
        self._require(
            re.fullmatch(r"step-\d+(\.partial)?", os.path.basename(os.path.normpath(self.folder))) is None,
            "folder", "cannot be named like a checkpoint (step-N or step-N.partial): checkpoints go inside it",
        )
        self._require(self.interval >= 1, "interval", "must be >= 1")
        self._require(
            self.keep_latest_k == 0 or self.keep_latest_k >= 2, "keep_latest_k",
            "must be 0 (keep all) or >= 2 (the newest may still be being written)",
        )
        self._require("model" not in self.exclude_from_loading, "exclude_from_loading",
                      "cannot contain 'model'")
        self._require(self.load_step >= -1, "load_step", "must be a step >= 0, or -1 for the newest")


@dataclass(kw_only=True)
class ActivationCheckpointConfig(Section):
    """``[activation_checkpoint]``: recompute activations in backward to save memory."""

    section_name: typing.ClassVar[str] = "activation_checkpoint"

    mode: Literal["selective", "full", "memory_budget", "none"] = "selective"
    """Which activations to recompute: ``"selective"``, ``"full"``, ``"memory_budget"``
    (compiler-chosen) or ``"none"``."""

    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(
        default_factory=lambda: ["moe.router.gate"]
    )
    """Under per-op selective checkpointing, matmuls with the shapes of these Linear
    modules are always recomputed (any matmul of that shape, not only these modules)."""

    early_stop: bool = False
    """Stop recomputing once every needed activation has been rematerialised."""

    memory_budget: float = 0.5
    """For ``mode="memory_budget"``: 0.0 is the memory of full checkpointing, 1.0 that
    of no checkpointing."""

    visualize_memory_budget_pareto: bool = False
    """Write an SVG of the runtime/memory trade-off over budgets to the dump folder."""

    preserve_rng_state: bool = True
    """Stash and restore the RNG state around each checkpoint, for results identical
    to a run without checkpointing."""

    determinism_check: str = "default"
    """The determinism check of ``torch.utils.checkpoint``."""

    debug: bool = False
    """Record ``torch.utils.checkpoint`` debug information (slower)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(0.0 <= self.memory_budget <= 1.0, "memory_budget", "must be in [0, 1]")


@dataclass(kw_only=True)
class CompileConfig(Section):
    """``[compile]``: ``torch.compile``."""

    section_name: typing.ClassVar[str] = "compile"

    enable: bool = False
    """Compile the components below."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile, e.g. ``model,loss``."""

    backend: str = "inductor"
    """The ``torch.compile`` backend."""


#: About 31 years: far past any job, well inside what ``datetime.timedelta`` holds (larger
#: values raise OverflowError there).
_MAX_TIMEOUT_S = 10**9

#: torch.manual_seed's largest seed.
_MAX_SEED = 2**64 - 1


@dataclass(kw_only=True)
class CommConfig(Section):
    """``[comm]``: process-group set-up and communication timeouts."""

    section_name: typing.ClassVar[str] = "comm"

    init_timeout_seconds: int = 300
    """Timeout of collectives during initialisation and the first step."""

    train_timeout_seconds: int = 100
    """Timeout of collectives after the first step (usually tighter)."""

    trace_buf_size: int = 20000
    """Entries of the NCCL flight recorder's ring buffer; 0 turns it off."""

    save_traces_folder: str = "comm_traces"
    """Folder of the flight recorder's trace files."""

    save_traces_file_prefix: str = "rank_"
    """File-name prefix of the flight recorder's trace files."""

    mode: Literal["default", "fake_backend", "local_tensor", "torchcomms"] = "default"
    """``"default"`` (real communication), ``"fake_backend"`` (dry run), ``"local_tensor"``
    (one process simulating every rank) or ``"torchcomms"``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("init_timeout_seconds", "train_timeout_seconds"):
            self._require(1 <= getattr(self, name) <= _MAX_TIMEOUT_S, name, f"must be in [1, {_MAX_TIMEOUT_S}]")
        self._require(self.trace_buf_size >= 0, "trace_buf_size", "must be >= 0 (0 turns the recorder off)")


@dataclass(kw_only=True)
class DebugConfig(Section):
    """``[debug]``: seeds, determinism and checking switches."""

    section_name: typing.ClassVar[str] = "debug"

    seed: int | None = None
    """Base random seed; None lets rank 0 pick one."""

    spmd_typechecking: bool = False
    """Type-check the forward pass with ``spmd_types``' checker. Only the ``spmd_types``
    backend is checked; under pipeline parallelism each stage's forward is checked on its own."""

    spmd_typechecking_steps: int | None = None
    """With ``spmd_typechecking``: type-check only the first N steps this process runs
    (a resumed run checks its first N again), then train unchecked; a static step's
    types do not change. None checks every step. Needs ``spmd_typechecking`` (a
    warning otherwise)."""

    deterministic: bool = False
    """Use deterministic algorithms where they exist (slower)."""

    deterministic_warn_only: bool = False
    """With ``deterministic``, warn about ops with no deterministic version instead of failing."""

    moe_force_load_balance: bool = False
    """Route tokens round-robin so every expert gets the same load (MoE debugging)."""

    detect_anomaly: bool = False
    """Run autograd anomaly detection to locate NaN/Inf gradients (slow)."""

    batch_invariant: bool = False
    """Use batch-invariant kernels and a fixed collective reduction order."""

    print_config: bool = False
    """Print the resolved config at start-up."""

    save_config_file: str | None = None
    """Save the resolved config to this file under the dump folder."""

    enable_structured_logging: bool = True
    """Write the structured per-rank trace log."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.seed is None or 0 <= self.seed <= _MAX_SEED, "seed",
                      "must be >= 0 and < 2**64 (torch.manual_seed's range), or None")
        self._require(self.spmd_typechecking_steps is None or self.spmd_typechecking_steps >= 1,
                      "spmd_typechecking_steps",
                      "must be >= 1 (type-check the first N steps), or None (every step)")

"""The model registry: a model family is its module, its plan, its flavours and its validation.

In the spirit of upstream's ``ModelSpec``. Each built-in family is a package
``torchtitan_spmd.models.<family>`` that defines ``MODEL_SPEC`` (a
:class:`ModelSpec`) and a ``config_registry`` module of functions returning a
``JobConfig`` (``--module <family> --config <function>``). The trainer picks the
family with ``model.name`` and the flavour with ``model.flavor``::

    spec = get_model_spec("qwen3")
    config = spec.model_config("tiny", vocab_size=320)
    with torch.device("meta"):
        model = spec.build(config)
    plan = spec.sharding_plan(config, sequence_parallel=True, loss_parallel=True)

Built-in families: ``llama3`` (Llama 3 style), ``deepseek_v3`` (MLA, DeepSeek MoE) and ``qwen3`` (Qwen3 style: QK
RMSNorm per head, decoupled head width). A fork adds its own with
:func:`register_model_spec`. Importing this package imports no family.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan_spmd._errors import suggest

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.plan import ShardingPlan
    from torchtitan_spmd.models.state_dict_adapter import StateDictAdapter

__all__ = [
    "BUILTIN_FAMILIES",
    "ModelSpec",
    "cpu_job_config",
    "get_model_spec",
    "model_families",
    "register_model_spec",
    "replace_config",
]

def replace_config(config: Any, *, vocab_size: int | None = None, max_seq_len: int | None = None) -> Any:
    """``config`` (a model config dataclass) with ``vocab_size`` and ``max_seq_len`` replaced
    when given; ``max_seq_len`` only where the config has that field (the RoPE tables' rows)."""
    changes: dict[str, int] = {}
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    if max_seq_len is not None and any(f.name == "max_seq_len" for f in dataclasses.fields(config)):
        changes["max_seq_len"] = max_seq_len
    return dataclasses.replace(config, **changes) if changes else config


#: The families shipped with the library, each the package ``torchtitan_spmd.models.<name>``.
BUILTIN_FAMILIES: tuple[str, ...] = ("llama3", "qwen3", "deepseek_v3")


@dataclass(frozen=True)
class ModelSpec:
    """One model family, and the model contract every family meets.

    **The model contract.** What the trainer, the techniques and the checkpoints rely on,
    and so what a new family must provide (and nothing more):

    - **The config** (each flavour): a frozen dataclass with ``dim``, ``n_layers`` and
      ``vocab_size`` (``max_seq_len`` too if it has RoPE tables: the trainer sizes them to
      ``training.seq_len``).
    - **The modules**: ``tok_embeddings`` (token ids ``[batch, seq]`` in), ``layers`` (an
      ``nn.ModuleDict`` of ``n_layers`` blocks keyed ``"0"``, ``"1"``, ...; each block is an
      FSDP unit, an activation-checkpointing region, a compile unit and the PP split's
      grain), ``norm`` and ``output`` (logits ``[batch, seq, vocab]`` out), in that order:
      :meth:`part_names`. ``forward(tokens, positions=None)``: ``positions`` are the RoPE
      positions of the tokens, given under context parallelism, and per document with
      ``attn_mask_type="block_causal"`` (a config field; the attention's mask comes from them).
    - **Initial values**: ``init_weights(seed)`` and ``initial_value(fqn, shape, seed)``,
      the full, seeded value of any parameter or buffer, so that every rank can initialise
      its own shard and every layout starts from the same weights
      (:mod:`torchtitan_spmd.techniques.param_init`).
    - **The plan**: :attr:`sharding_plan` gives the layouts at module boundaries and of every
      parameter (:mod:`torchtitan_spmd.distributed.plan`); the representation of each backend
      interprets it, so a family never names a backend.
    - **MoE** (optional): MoE blocks are :class:`torchtitan_spmd.models.moe.MoE`, whose
      experts are :class:`~torchtitan_spmd.models.moe.GroupedExperts` (what expert parallelism
      shards, what the MoE runtime balances).
    - **Validation**: :attr:`validate` rejects, naming the field, what these degrees cannot
      shard (heads not divisible by TP, ...).
    - **Hugging Face** (optional): :attr:`state_dict_adapter`.

    Attributes:
        name: the family name (``model.name``).
        flavors: flavour name (``model.flavor``) -> model config (a frozen dataclass
            with a ``vocab_size`` field).
        build: model config -> the model, on the current device (the trainer builds
            on ``meta``), not yet initialised. The model provides
            ``initial_value(fqn, shape, seed)`` (see ``techniques/param_init.py``).
        sharding_plan: ``(config, *, sequence_parallel, loss_parallel)`` -> the plan.
        validate: ``(config, job_config, parallel_dims)``: raise ValueError, naming the
            field, for a config these degrees cannot shard (e.g. heads not divisible by TP).
        state_dict_adapter: the family's Hugging Face adapter class (upstream's field), built
            as ``adapter_cls(model_config, hf_assets_path)``; see
            :mod:`torchtitan_spmd.models.state_dict_adapter`. None: no HF interop.
        flavor: the flavour a recipe chose (upstream's ``ModelSpec.flavor``), set by
            :meth:`registry`; None on a family's ``MODEL_SPEC``.
        converters: the model converters' configs a recipe listed (:meth:`registry`): float8,
            LoRA, ... (:mod:`torchtitan_spmd.techniques.converters` applies them).
    """

    name: str
    flavors: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    sharding_plan: Callable[..., ShardingPlan]
    validate: Callable[[Any, JobConfig, ParallelDims], None]
    state_dict_adapter: type[StateDictAdapter] | None = None
    flavor: str | None = None
    converters: tuple[Any, ...] = ()

    def registry(self, flavor: str, converters: Sequence[Any] | None = None) -> ModelSpec:
        """Upstream's ``model_registry(flavor, converters=[...])``: this family with ``flavor`` chosen and
        the model converters (:mod:`torchtitan_spmd.config.converters`) listed, checked (known
        converters, valid fields, quantization before LoRA). A job takes it as
        ``job.model_spec = spec``, which sets ``model.name``, ``model.flavor`` and ``model.converters``."""
        from torchtitan_spmd.config.converters import check_converters

        self.model_config(flavor)  # an unknown flavour: the error listing the valid ones
        checked = check_converters(list(converters or ()), "model_registry(converters=...)")
        return dataclasses.replace(self, flavor=flavor, converters=tuple(checked))

    def model_config(self, flavor: str, *, vocab_size: int | None = None, max_seq_len: int | None = None) -> Any:
        """The config of ``flavor``, with ``vocab_size`` and ``max_seq_len`` replaced when given.

        ``max_seq_len`` (the rows of the RoPE tables, a config field of the built-in
        families) is what upstream's ``update_from_config`` sets from ``training.seq_len``:
        the trainer passes it, so a run's tables cover its sequences whatever the flavour's
        default. The tables are non-persistent buffers, so checkpoints do not depend on it.
        A config without that field ignores it. Raises ValueError for an unknown flavour,
        listing the valid ones.
        """
        if flavor not in self.flavors:
            raise ValueError(
                f"unknown model.flavor {flavor!r} for model.name={self.name!r}; valid flavors: "
                f"{', '.join(sorted(self.flavors))}.{suggest(flavor, self.flavors)}"
            )
        return replace_config(self.flavors[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len)

    def part_names(self, config: Any) -> list[str]:
        """The model's top-level parts by the contract, before any model is built:
        ``tok_embeddings``, ``layers.0`` ... ``layers.<n_layers - 1>``, ``norm``, ``output``
        (the names pipeline parallelism splits by)."""
        return ["tok_embeddings", *(f"layers.{i}" for i in range(config.n_layers)), "norm", "output"]

    def build_initialized(self, flavor: str, *, seed: int, vocab_size: int | None = None,
                          max_seq_len: int | None = None) -> nn.Module:
        """Flavour ``flavor`` built full-size on CPU (float32) and initialised with ``seed``
        (``vocab_size``, ``max_seq_len``: as :meth:`model_config`).

        Built on the meta device first, so the caller's RNG is left alone.
        """
        config = self.model_config(flavor, vocab_size=vocab_size, max_seq_len=max_seq_len)
        with torch.device("meta"):
            model = self.build(config)
        model.to_empty(device="cpu")
        model.init_weights(seed)  # type: ignore[operator]
        return model


_REGISTERED: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Make ``spec`` selectable as ``model.name=spec.name``; ValueError if the name is taken."""
    if spec.name in BUILTIN_FAMILIES or spec.name in _REGISTERED:
        raise ValueError(f"model family {spec.name!r} is already registered.")
    _REGISTERED[spec.name] = spec


def model_families() -> list[str]:
    """Every selectable family name: the built-in ones, then the registered ones."""
    return [*BUILTIN_FAMILIES, *_REGISTERED]


def get_model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of family ``name``; ValueError listing the families for an unknown one."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in BUILTIN_FAMILIES:
        families = model_families()
        raise ValueError(
            f"unknown model.name {name!r}; valid names: {', '.join(map(repr, families))}.{suggest(name, families)}"
        )
    spec = importlib.import_module(f"{__name__}.{name}").MODEL_SPEC
    if not isinstance(spec, ModelSpec) or spec.name != name:
        raise TypeError(f"{__name__}.{name}.MODEL_SPEC must be a ModelSpec named {name!r}.")
    return spec


def upstream_recipe(name: str, flavor: str, *, lr: float, local_batch_size: int, seq_len: int, steps: int,
                    checkpoint_interval: int, ac_mode: str, warmup_steps: int = 200, tensorboard: bool = False,
                    **parallelism: object) -> JobConfig:
    """A ``JobConfig`` with upstream's (a0c831c49) recipe values for family ``name``, flavour ``flavor``.

    Upstream's warm-up default (200 steps) unless given; parameters in upstream's bf16 mixed
    precision (sized for GPUs). What upstream's recipes add that this library lacks is named in
    the recipe's docstring (``ChunkedCELoss``: this library's cross-entropy gives the same loss
    unchunked; the profiler; the validator; ``c4``: nothing is downloaded here, so the data stays
    the config's default unless ``--training.dataset json --training.dataset_path`` name a local
    copy; ``hf_assets_path``: ``--hf_assets_path`` names the local folder).
    """
    from torchtitan_spmd.config import ActivationCheckpointConfig, JobConfig

    config = JobConfig()
    config.model.name = name
    config.model.flavor = flavor
    config.training.local_batch_size = local_batch_size
    config.training.seq_len = seq_len
    config.training.steps = steps
    config.optimizer.lr = lr
    config.lr_scheduler.warmup_steps = warmup_steps
    config.checkpoint.interval = checkpoint_interval
    config.activation_checkpoint = ActivationCheckpointConfig(mode=ac_mode)  # type: ignore[arg-type]
    config.metrics.enable_tensorboard = tensorboard
    for field, value in parallelism.items():
        setattr(config.parallelism, field, value)
    return config


def cpu_job_config(name: str, flavor: str, *, local_batch_size: int, seq_len: int, lr: float,
                   steps: int = 10, warmup_steps: int = 2) -> JobConfig:
    """A ``JobConfig`` for family ``name``, flavour ``flavor``, sized to train on a few CPU cores.

    What the families' ``config_registry`` functions return; every other field keeps
    its default (selective activation checkpointing, as upstream's debug model), and
    command-line overrides apply on top. Parameters compute in float32
    (``training.mixed_precision_param``): CPUs without native bf16 (AVX2) emulate bf16
    matmuls, measured 6.7x slower for torchtitan's own debug model (13.6 vs 2.03 s/step).
    """
    from torchtitan_spmd.config import JobConfig

    config = JobConfig()
    config.model.name = name
    config.model.flavor = flavor
    config.training.local_batch_size = local_batch_size
    config.training.seq_len = seq_len
    config.training.steps = steps
    config.training.mixed_precision_param = "float32"
    config.optimizer.lr = lr
    config.lr_scheduler.warmup_steps = warmup_steps
    return config

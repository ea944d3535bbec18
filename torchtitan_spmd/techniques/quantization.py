"""Technique: quantized training of the linears, upstream's quantization converters, through torchao.

``Float8LinearConverter`` swaps the model's ``nn.Linear`` modules (those the filter keeps) for
:class:`Float8Linear`, a subclass of torchao's own ``Float8Linear``: torchao casts every operand
of the three matmuls of a linear (output, input gradient, weight gradient) to float8 with dynamic
scales of the recipe's granularity (``rowwise``: one scale per row of each operand along the
contracted dimension) and runs them as scaled matmuls (emulated in high precision with
``emulate=True``, the CPU's and tests' path).

**Under tensor parallelism** a scale must be the one the unsharded operand would get. Where
the scaled axis of an operand is sharded over ``tp`` the local amax is only a part of it:

- a column-wise linear (``wq``/``wk``/``wv``/``w1``/``w3``, the output features sharded): the
  output gradient's rows and the weight's rows for the input gradient are scaled along the
  sharded output features;
- a row-wise linear (``wo``/``w2``, the contracted input features sharded): the input's rows
  and the weight's rows are scaled along the sharded input features, in the forward.

With DTensor parameters and activations (``full_dtensor``) DTensor computes those amaxes over the
mesh itself (torchao's float8 is DTensor-aware). On local shards (``default``'s module bodies,
``spmd_types``) :class:`_ShardedFloat8Matmul` runs torchao's casts and scaled matmuls operand by
operand, exactly as torchao's ``matmul_with_hp_or_float8_args`` does, and reduces each of those
amaxes with the ``max`` over ``tp`` that the representation provides (typed under ``spmd_types``).
That one piece is restated here because torchao offers no hook to reduce one operand's axiswise
amax over a group (its ``reduce_amax`` is per cast call, which its linear does not expose).

Data parallelism shards tokens: each rank's matmuls scale its own tokens, as in upstream's FSDP
(the weight gradient's per-column scales are those of the rank's batch).

``Float8GroupedExpertsConverter`` puts the MoE experts' grouped GEMMs in float8 rowwise: torchao's
``_Float8GroupedMM`` on an SM89+ GPU, or, with ``emulate=True``, the same casts emulated here
(torchao 0.18 has no emulated float8 grouped GEMM), with the amaxes along a tp-sharded hidden dim
reduced as the linears' are. ``MXFP8LinearConverter`` and ``MXFP8GroupedExpertsConverter`` run
torchao's MXFP8 kernels on local shards (SM100+, or torchao's emulated kernels). ``NVFP4LinearConverter``
runs torchao's NVFP4 training kernels (``nvfp4_mm_triton``, SM100+) or, with ``emulate=True``, the
same recipe emulated here (torchao's are Triton only), its per-tensor scales reduced over tp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from torchtitan_spmd.config.converters import (
    Float8GroupedExpertsConverterConfig,
    Float8LinearConverterConfig,
    MXFP8GroupedExpertsConverterConfig,
    MXFP8LinearConverterConfig,
    NVFP4LinearConverterConfig,
    QuantizationConverterConfig,
)

__all__ = [
    "FLOAT8_EXTRA",
    "FLOAT8_GROUP_MULTIPLE",
    "Float8GroupedExpertsConverter",
    "Float8Linear",
    "Float8LinearConverter",
    "MXFP8_BLOCK",
    "MXFP8GroupedExpertsConverter",
    "MXFP8LinearConverter",
    "NVFP4Linear",
    "NVFP4LinearConverter",
    "NVFP4_BLOCK",
    "QuantizationConverter",
    "MXFP8Linear",
    "bind_float8_experts",
    "bind_float8_shards",
    "bind_mxfp8_shards",
    "bind_nvfp4_shards",
    "is_float8_experts",
    "is_mxfp8_experts",
    "is_nvfp4_linear",
    "nvfp4_fake_quantize",
    "has_cuda_capability",
    "import_torchao_float8",
    "pushed",
    "targets_optional",
    "torchao_linears_getattr",
]

#: The extra that installs torchao (the one spelling every setup error names).
FLOAT8_EXTRA = 'pip install -e ".[float8]"'

#: Upstream's module names (b5bcd76's ``lm_head``, the config tree's fused ``wkv``) -> this library's.
UPSTREAM_MODULE_NAMES: dict[str, tuple[str, ...]] = {"lm_head": ("output",), "wkv": ("wk", "wv")}


class _TorchaoEnumConstantFilter(logging.Filter):
    """Drops one log record: torch >= 2.14's ``_pytree`` warning that torchao registers its own
    enums (``KernelPreference``) with ``register_constant``, which torch now deprecates for
    Enums (it treats them natively). torchao 0.18.0 does it as it is imported; nothing in this
    library or a job can act on it, and it is printed once per process, on every rank. Any other
    record, and this warning about a class that is not torchao's, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("%s is an Enum subclass and is now natively supported"):
            return True
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (isinstance(cls, type) and cls.__module__.startswith("torchao."))


@contextlib.contextmanager
def _quiet_torchao_enum_warning() -> Iterator[None]:
    """Within it, torch's ``_pytree`` logger drops its warning about torchao's enums, and only it."""
    pytree_log = logging.getLogger("torch.utils._pytree")
    quiet = _TorchaoEnumConstantFilter()
    pytree_log.addFilter(quiet)
    try:
        yield
    finally:
        pytree_log.removeFilter(quiet)


def import_torchao_float8(what: str) -> Any:
    """``torchao.float8``, or ImportError in one line naming ``what`` needs it and the extra.
    The first import drops torch's deprecation warning about torchao's enums
    (:class:`_TorchaoEnumConstantFilter`), and only it, only while torchao is imported."""
    try:
        with _quiet_torchao_enum_warning():
            import torchao.float8 as float8
    except ImportError:
        raise ImportError(f"{what} needs torchao, which is not installed: {FLOAT8_EXTRA}") from None
    return float8


def has_cuda_capability(major: int, minor: int) -> bool:
    """Whether this process sees a CUDA GPU of compute capability at least ``major.minor``."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (major, minor)


#: Off while a dry run builds the converters (:func:`hardware_checks_off`): it sizes a GPU job on a
#: CPU, as it does async TP; a real run keeps every check.
_HARDWARE_CHECKS = [True]


@contextlib.contextmanager
def pushed(stack: list[Any], value: Any) -> Iterator[None]:
    """Within it, ``stack[-1]`` is ``value``: the switches of this module (a list each, read at
    ``[-1]``, so that they nest) set for a block."""
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def hardware_checks_off() -> contextlib.AbstractContextManager[None]:
    """Within it, converters skip their GPU-capability checks (the dry run)."""
    return pushed(_HARDWARE_CHECKS, False)


#: Off while the dry run converts its one- and two-block models (:func:`targets_optional`): a
#: DeepSeek-V3's first blocks are dense, so they hold no experts a converter could find.
_TARGETS_REQUIRED = [True]


def targets_optional() -> contextlib.AbstractContextManager[None]:
    """Within it, a converter that finds nothing to convert (no experts, no linear its ``fqns``
    names) converts nothing instead of raising: for models cut down from the job's (the dry run)."""
    return pushed(_TARGETS_REQUIRED, False)


def _name_list(names: list[str], limit: int = 8) -> str:
    """``names`` joined by commas, past ``limit`` the first ones and how many more (one short line)."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def _needs_sm(converter: str, major: int, minor: int, what: str) -> None:
    if _HARDWARE_CHECKS[-1] and not has_cuda_capability(major, minor):
        raise ValueError(f"{converter} needs an NVIDIA GPU of compute capability {major}.{minor} or newer "
                         f"(SM{major}{minor}+) for {what}; this process has "
                         f"{_device_description()}.")


def _check_emulation(converter: str, config: Any, capability: tuple[int, int], what: str) -> Any:
    """A converter's ``emulate`` checked (one line each): not with compile; without it, the GPU of
    ``capability`` for ``what``. torchao's kernel preference for it (``EMULATED`` or ``AUTO``)."""
    with _quiet_torchao_enum_warning():  # its first import registers the enum (see import_torchao_float8)
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    if config.emulate and config.model_compile_enabled:
        raise ValueError(f"{converter}.Config: emulate=True is for eager mode; it does not run with "
                         "model_compile_enabled=True (compile.enable with 'model' in compile.components).")
    if not config.emulate:
        _needs_sm(converter, *capability, f"{what} (emulate=True runs anywhere, in eager mode)")
    return KernelPreference.EMULATED if config.emulate else KernelPreference.AUTO


def _device_description() -> str:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (SM{major}{minor})"


def expand_upstream_names(names: list[str]) -> list[str]:
    """``names`` with upstream's spellings of modules (``lm_head``, ``wkv``) replaced by this library's."""
    out: list[str] = []
    for name in names:
        out.extend(UPSTREAM_MODULE_NAMES.get(name, (name,)))
    return out


class QuantizationConverter:
    """Upstream's ``QuantizationConverter``: the base of the quantized-training converters."""

    Config: ClassVar[type[QuantizationConverterConfig]] = QuantizationConverterConfig

    def __init__(self, config: QuantizationConverterConfig) -> None:
        self.config = config

    def convert(self, model: nn.Module) -> list[str]:
        """Convert ``model`` in place (built, possibly on the meta device); the names converted."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- float8 linears
def _float8_linear_class() -> type[nn.Module]:
    float8 = import_torchao_float8("Float8LinearConverter")
    from torchao.float8.float8_linear import Float8Linear as TorchAOFloat8Linear

    global Float8Linear
    if Float8Linear is not None:
        return Float8Linear

    class _Float8Linear(TorchAOFloat8Linear):  # type: ignore[misc, valid-type]
        """torchao's ``Float8Linear``, able to compute on tensor-parallel local shards.

        ``tp_weight_shard_dim`` (0: column-wise, 1: row-wise, None: not sharded) and
        ``amax_reduce`` (the ``max`` over ``tp``) are set by :func:`bind_float8_shards` after
        the plan sharded the weight. Every forward is torchao's (its autocast cast of the input,
        the matmul, the bias) with the matmul run operand by operand by :func:`sharded_float8_matmul`,
        sharded or not: one path, whose autograd Function carries the type rule ``spmd_types``'
        checker needs (torchao's own Function has none: "not registered for SPMD type checking").
        """

        tp_weight_shard_dim: int | None = None
        amax_reduce: Callable[..., torch.Tensor] | None = None

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as torchao's forward: the output in the autocast dtype
                input = input.to(torch.get_autocast_gpu_dtype())
            return _local_shard_forward(self, input)

        def _local_mm(self, input: torch.Tensor, weight: torch.Tensor, sharded: int | None) -> torch.Tensor:
            return sharded_float8_matmul(input, weight.t(), self.linear_mm_config, self.config,
                                         None if sharded is None else 1 - sharded, self.amax_reduce)

    _Float8Linear.__name__ = _Float8Linear.__qualname__ = "Float8Linear"
    _Float8Linear.__module__ = __name__
    del float8
    Float8Linear = _Float8Linear
    return Float8Linear


#: The float8 linear class (torchao's subclass); None until first use or without torchao.
Float8Linear: Any = None


def _local_shard_forward(module: Any, input: torch.Tensor) -> torch.Tensor:
    """A quantized linear's forward (float8, MXFP8): its ``_local_mm(input, weight, tp shard dim of
    the weight)`` on plain tensors, or on DTensors' local shards (:func:`_dtensor_forward`), plus
    the bias."""
    from torch.distributed.tensor import DTensor

    if isinstance(module.weight, DTensor):
        return _dtensor_forward(module, input, module._local_mm)
    out = module._local_mm(input, module.weight, module.tp_weight_shard_dim)
    if module.bias is not None:
        out = out + module.bias.to(out.dtype)
    return out


def _dtensor_forward(module: Any, input: Any,
                     local_mm: Callable[[torch.Tensor, torch.Tensor, int | None], torch.Tensor]) -> Any:
    """A quantized linear on DTensors (``full_dtensor``): ``local_mm(input, weight, tp shard dim of
    the weight or None)`` on their local shards, as ``local_map`` would (float8:
    :class:`_ShardedFloat8Matmul`; MXFP8: :class:`_LocalMXFP8Matmul`). torchao's own DTensor path
    fails on an input sharded on the batch and the features at once (rowwise scales of a row-wise
    linear under FSDP x TP: "shape '[16, 1]' is invalid", torchao 0.18.0), so the DTensor is
    unwrapped here; the output has the placements the plan declares (the features sharded, or a
    pending sum over ``tp``)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    from torchtitan_spmd.distributed.representations._dtensor import local_grad_placements

    weight, mesh = module.weight, module.weight.device_mesh
    if not isinstance(input, DTensor):
        raise RuntimeError(f"{type(module).__name__}: a DTensor weight needs a DTensor input (full_dtensor).")
    names = mesh.mesh_dim_names or ()
    sharded = module.tp_weight_shard_dim
    tp = names.index("tp") if sharded is not None and "tp" in names else None
    out_placements = tuple(
        (Shard(input.dim() - 1) if sharded == 0 else Partial()) if i == tp else p
        for i, p in enumerate(input.placements))
    x = input.to_local(grad_placements=local_grad_placements(input.placements, out_placements))
    w = weight.to_local(grad_placements=local_grad_placements(weight.placements, out_placements))
    out = local_mm(x, w, None if tp is None else sharded)
    out = DTensor.from_local(out, mesh, out_placements, run_check=False)
    if module.bias is not None:
        out = out + module.bias.to(out.dtype)
    return out


def _max_over_tp(t: torch.Tensor, local: Callable[[], torch.Tensor], dim: int | None,
                 reduce: Callable[..., torch.Tensor] | None, typed: Callable[..., torch.Tensor] | None,
                 what: str) -> torch.Tensor:
    """The max over tp (``reduce``, along ``dim`` of the amax's kept dims) of this rank's amax of
    ``t``, ``local()``, typed as ``t`` by ``typed`` (the representation's ``local_amax``: spmd_types
    types a shard's amax as the shard) where given. RuntimeError where no reduction is bound."""
    if reduce is None:
        raise RuntimeError(f"{what}: a scale spans a dim sharded over tp, and no amax reduction is bound "
                           "(the converters' bind_converted was not called).")
    return reduce(typed(t, local) if typed is not None else local(), dim)


def _scale(t: torch.Tensor, cast_config: Any, axis: int, sharded_dim: int | None,
           reduce: Callable[..., torch.Tensor] | None, round_pow2: bool) -> torch.Tensor | None:
    """torchao's dynamic scale of ``t`` (``tensor_to_scale``) for ``cast_config`` along ``axis``, its
    amax reduced with ``reduce`` (the max over tp) where the scale spans ``sharded_dim`` (the dim
    sharded over tp); None where the recipe keeps the operand in high precision."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    if cast_config.scaling_type is ScalingType.DISABLED:
        return None
    granularity = cast_config.scaling_granularity
    axiswise_dim = get_maybe_axiswise_dim(axis, granularity)
    def local_amax() -> torch.Tensor:
        return tensor_to_amax(t, False, None, granularity, axiswise_dim)

    with torch.no_grad():
        spans_shard = sharded_dim is not None and (granularity is ScalingGranularity.TENSORWISE
                                                   or axiswise_dim % t.dim() == sharded_dim)
        if not spans_shard:
            amax = local_amax()
        else:  # the local part typed as a representation that types it says (spmd_types: V@tp)
            amax = _max_over_tp(t, local_amax, axiswise_dim % t.dim() if axiswise_dim is not None else None, reduce,
                                getattr(reduce, "local_amax", None), "Float8Linear")
        return amax_to_scale(amax, cast_config.target_dtype, round_scales_to_power_of_2=round_pow2)


def _to_float8(t: torch.Tensor, scale: torch.Tensor | None, cast_config: Any, mm_config: Any, role: Any,
               axis: int) -> torch.Tensor:
    """``t`` cast to float8 with ``scale`` (torchao's ``hp_tensor_and_scale_to_float8``); ``t`` itself
    where the recipe keeps it in high precision (``scale`` None)."""
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    if scale is None:
        return t
    axiswise_dim = get_maybe_axiswise_dim(axis, cast_config.scaling_granularity)
    return hp_tensor_and_scale_to_float8(t, scale, cast_config.target_dtype, mm_config, role, axiswise_dim)


def _cast(t: torch.Tensor, cast_config: Any, mm_config: Any, role: Any, axis: int, sharded_dim: int | None,
          reduce: Callable[..., torch.Tensor] | None, round_pow2: bool) -> torch.Tensor:
    """torchao's dynamic cast of ``t`` to float8 (``hp_tensor_to_float8_dynamic``), its amax
    reduced with ``reduce`` where the scale spans ``sharded_dim`` (the dim sharded over tp)."""
    scale = _scale(t, cast_config, axis, sharded_dim, reduce, round_pow2)
    return _to_float8(t, scale, cast_config, mm_config, role, axis)


def sharded_float8_matmul(input_hp: torch.Tensor, weight_hp_t: torch.Tensor, mm_config: Any, config: Any,
                          wt_shard_dim: int | None,
                          reduce: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """``input_hp @ weight_hp_t`` in float8 on tensor-parallel local shards. The forward's two
    scales are computed here, outside the autograd Function, so that under ``spmd_types`` the type
    checker sees each amax and its reduction over tp (typed V -> I): a scale left varying over tp
    multiplies the row-wise matmul's pending sum, which the checker rejects (P x V)."""
    pow2 = config.round_scales_to_power_of_2
    input_shard = input_hp.dim() - 1 if wt_shard_dim == 0 else None  # row-wise: the input's features
    scale_x = _scale(input_hp, config.cast_config_input, -1, input_shard, reduce, pow2)
    scale_w = _scale(weight_hp_t, config.cast_config_weight, 0, wt_shard_dim, reduce, pow2)
    return _ShardedFloat8Matmul.apply(input_hp, weight_hp_t, scale_x, scale_w, mm_config, config, wt_shard_dim,
                                      reduce)


def _input_labels(what: str, input_hp: Any) -> str:
    """A linear's input's einsum labels for its type rule: ``bsk``, or ``sk`` for a 2-D input."""
    if input_hp.ndim not in (2, 3):
        raise TypeError(f"{what} under spmd_types type checking: a 2-D or 3-D input.")
    return "bsk"[-input_hp.ndim:]


def _linear_type(what: str, input_hp: Any, weight_hp: Any) -> Any:
    """The types of ``input_hp @ weight_hp.t()``: a linear, multilinear in the input and the weight
    (a quantized matmul whose scales are each a block's own, on the rank that holds it)."""
    from spmd_types import rules

    x = _input_labels(what, input_hp)
    return rules.einsum(f"{x},nk->{x[:-1]}n", input_hp, weight_hp)


class _ShardedFloat8Matmul(torch.autograd.Function):
    """``input @ weight_t`` on tensor-parallel local shards, operand by operand as torchao's
    ``matmul_with_hp_or_float8_args`` (same casts, same axes, same scaled matmuls), with the
    amaxes whose axis is sharded over tp reduced (see the module docstring).

    ``wt_shard_dim``: the dim of ``weight_t`` (``[in, out]``) sharded over tp: 1 for a
    column-wise linear (the outputs), 0 for a row-wise one (the contracted inputs), None: no
    tensor parallelism (nothing to reduce).
    """

    @staticmethod
    def forward(ctx: Any, input_hp: torch.Tensor, weight_hp_t: torch.Tensor, scale_x: torch.Tensor | None,
                scale_w: torch.Tensor | None, mm_config: Any, config: Any, wt_shard_dim: int | None,
                reduce: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.save_for_backward(input_hp, weight_hp_t)
        ctx.mm_config, ctx.config, ctx.wt_shard_dim, ctx.reduce = mm_config, config, wt_shard_dim, reduce
        c = config
        x8 = _to_float8(input_hp, scale_x, c.cast_config_input, mm_config, GemmInputRole.INPUT, -1)
        w8 = _to_float8(weight_hp_t, scale_w, c.cast_config_weight, mm_config, GemmInputRole.WEIGHT, 0)
        shape = x8.shape
        out = torch.mm(x8.reshape(-1, shape[-1]), w8)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def spmd_typecheck(*, input_hp: Any, weight_hp_t: Any, scale_x: Any, scale_w: Any) -> Any:
        """The forward's types (``spmd_types``): a matmul multilinear in the input, the weight and
        their scales (the dequantisation multiplies the product by both). A row-wise linear's
        product is a pending sum over tp, so its scales must be the same on every tp rank."""
        from spmd_types import rules

        x = _input_labels("Float8Linear", input_hp)
        if scale_x is None or scale_w is None:
            raise TypeError("Float8Linear under spmd_types type checking: float8 scales on both forward operands.")
        return rules.einsum(f"{x},kn,{x[:-1]}z,zn->{x[:-1]}n", input_hp, weight_hp_t, scale_x, scale_w)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        from torchao.float8.float8_training_tensor import GemmInputRole

        input_hp, weight_hp_t = ctx.saved_tensors
        c, mm, reduce, pow2 = ctx.config, ctx.mm_config, ctx.reduce, ctx.config.round_scales_to_power_of_2
        wt_shard = ctx.wt_shard_dim
        go_shape = grad_output.shape
        go = grad_output.reshape(-1, go_shape[-1])
        go_shard = 1 if wt_shard == 1 else None  # column-wise: the output gradient's features
        in_shard = 1 if wt_shard == 0 else None  # row-wise: the input's features
        go8 = _cast(go, c.cast_config_grad_output, mm, GemmInputRole.GRAD_OUTPUT, -1, go_shard, reduce, pow2)
        w8 = _cast(weight_hp_t, c.cast_config_weight_for_grad_input, mm, GemmInputRole.WEIGHT, -1, wt_shard,
                   reduce, pow2)
        grad_input = torch.mm(go8, w8.t()).reshape(*go_shape[:-1], weight_hp_t.shape[0])
        x = input_hp.reshape(-1, input_hp.shape[-1])
        go8 = _cast(go, c.cast_config_grad_output_for_grad_weight, mm, GemmInputRole.GRAD_OUTPUT, 0, go_shard,
                    reduce, pow2)
        x8 = _cast(x, c.cast_config_input_for_grad_weight, mm, GemmInputRole.INPUT, 0, in_shard, reduce, pow2)
        grad_weight = torch.mm(go8.t(), x8)
        return grad_input, grad_weight.t(), None, None, None, None, None, None


class Float8LinearConverter(QuantizationConverter):
    """Upstream's ``Float8LinearConverter``: the linears to torchao's float8 training.

    Checks at construction, each a one-line error: torchao installed (the ``float8`` extra),
    and a GPU of compute capability 8.9+ unless ``emulate=True`` in eager mode.
    Unlike upstream b5bcd76, ``emulate=True`` keeps the recipe's scaling (upstream switches to
    torchao's tensorwise default there): the emulated run is the recipe's numerics.
    """

    Config: ClassVar[type[Float8LinearConverterConfig]] = Float8LinearConverterConfig

    def __init__(self, config: Float8LinearConverterConfig) -> None:
        super().__init__(config)
        float8 = import_torchao_float8("Float8LinearConverter (float8 training)")
        _check_emulation("Float8LinearConverter", config, (8, 9), "float8 matmuls")
        self.torchao_config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(config.recipe_name),
                                                  emulate=config.emulate)
        self.filter_fqns = expand_upstream_names(list(config.filter_fqns))
        if config.recipe_name == "rowwise" and config.model_compile_enabled:
            # as upstream: inductor rounds the rowwise casts as eager does (pytorch/pytorch#150859).
            # Compiled runs only: the flag is process-wide, and eager code never reads it.
            import torch._inductor.config as inductor_config

            inductor_config.emulate_precision_casts = True

    def keeps(self, fqn: str, module: nn.Module) -> bool:
        """Whether the linear ``fqn`` is converted: every dim divisible by 16, no filter name in its FQN."""
        if type(module) is not nn.Linear:
            return False
        if module.in_features % 16 or module.out_features % 16:
            return False
        return not any(f in fqn for f in self.filter_fqns)

    def convert(self, model: nn.Module) -> list[str]:
        cls = _float8_linear_class()
        converted = []
        for fqn, module in list(model.named_modules()):
            if not self.keeps(fqn, module):
                continue
            new = cls.from_float(module, config=self.torchao_config)
            _set_submodule(model, fqn, new)
            converted.append(fqn)
        return converted


def _set_submodule(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, name, new)


def _split(fqn: str, size: int, tp: int, multiple: int, dim_name: str = "") -> list[str]:
    """``[fqn (size / tp = shard)]`` where tp splits ``size`` (``dim_name``: what it is) into shards that
    are no multiple of ``multiple``; else ``[]``: an entry of a shard-size error."""
    from torchtitan_spmd.distributed.apply_plan import plain_fqn

    if size % (tp * multiple) == 0:
        return []
    return [f"{plain_fqn(fqn)} ({dim_name + ' ' if dim_name else ''}{size} / tp {tp} = {size / tp:g})"]


def _tp_shard_dim(state_layouts: dict[str, Any], fqn: str, param: str) -> int | None:
    """The dim of module ``fqn``'s parameter ``param`` that the plan shards over ``tp`` (from
    ``state_layouts``, the plan's layouts by name), or None."""
    from torchtitan_spmd.distributed.apply_plan import plain_fqn

    state = state_layouts.get(f"{plain_fqn(fqn)}.{param}")
    return None if state is None else state.layout.shard_dims().get("tp")


def bind_float8_shards(model: nn.Module, state_layouts: dict[str, Any],
                       amax_reduce: Callable[..., torch.Tensor] | None) -> int:
    """Tell each float8 linear how the plan sharded its weight over ``tp`` (from ``state_layouts``,
    the plan's layouts by name) and the ``max`` over ``tp`` to reduce its scales with (None: no
    tensor parallelism); the number of float8 linears whose weight is sharded over ``tp``."""
    if Float8Linear is None:
        return 0
    bound = 0
    for fqn, module in model.named_modules():
        if not isinstance(module, Float8Linear):
            continue
        dim = _tp_shard_dim(state_layouts, fqn, "weight") if amax_reduce is not None else None
        module.tp_weight_shard_dim = dim
        module.amax_reduce = amax_reduce if dim is not None else None
        bound += dim is not None
    return bound


# ----------------------------------------------------------------------------- MXFP8 linears
#: MXFP8's block: 32 consecutive elements along the contracted dim share one power-of-two scale.
MXFP8_BLOCK = 32


def _import_torchao_mxfp8(what: str) -> Any:
    """torchao's ``mxfp8_linear`` module, or ImportError in one line naming ``what`` and the extra."""
    import_torchao_float8(what)  # the one message for a missing torchao
    with _quiet_torchao_enum_warning():
        import torchao.prototype.moe_training.mxfp8_linear as mxfp8_linear
    return mxfp8_linear


class _LocalMXFP8Matmul(torch.autograd.Function):
    """``input @ weight.t()`` in MXFP8 on this rank's tensors: torchao's ``mx_mm`` (its forward and
    backward, the same three casts and scaled matmuls), with the type rule ``spmd_types``' checker
    needs (torchao's Function has none).

    Nothing is reduced across ranks. MXFP8's scales are per block of 32 along each matmul's
    contracted dim, and a tensor-parallel shard whose sharded dim is a multiple of 32 splits no
    block (:func:`bind_mxfp8_shards` checks it), so every block, and its scale, lies whole on
    one rank: the local matmul is the unsharded one's part (a shard of the output, or a term of
    its pending sum over tp)."""

    @staticmethod
    def forward(ctx: Any, input_hp: torch.Tensor, weight_hp: torch.Tensor, kernel_preference: Any,
                scale_mode: Any, wgrad_with_hp: bool) -> torch.Tensor:
        # both loaded, quietly, with the class (_mxfp8_linear_class): dictionary lookups here
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm
        from torchao.prototype.mx_formats.config import (
            MXFP8Dim0CastKernelChoice,
            MXFP8Dim1CastKernelChoice,
        )

        ctx.mx_mm = mx_mm
        e4m3 = torch.float8_e4m3fn  # as torchao's _to_mxfp8_then_scaled_mm: every operand e4m3, its kernels
        return mx_mm.forward(ctx, input_hp.contiguous(), weight_hp.contiguous(), e4m3, e4m3, e4m3, MXFP8_BLOCK,
                             kernel_preference, MXFP8Dim0CastKernelChoice.TRITON, MXFP8Dim1CastKernelChoice.CUDA,
                             scale_mode, wgrad_with_hp)

    @staticmethod
    def spmd_typecheck(*, input_hp: Any, weight_hp: Any) -> Any:
        """A linear's types (each block's scale is the block's own, on the rank that holds it)."""
        return _linear_type("MXFP8Linear", input_hp, weight_hp)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_input, grad_weight, *_ = ctx.mx_mm.backward(ctx, grad_output)
        return grad_input, grad_weight, None, None, None


def _mxfp8_linear_class() -> type[nn.Module]:
    mxfp8_linear = _import_torchao_mxfp8("MXFP8LinearConverter")

    global MXFP8Linear
    if MXFP8Linear is not None:
        return MXFP8Linear

    class _MXFP8Linear(mxfp8_linear.MXFP8Linear):  # type: ignore[misc, name-defined]
        """torchao's ``MXFP8Linear`` (its kernel preference, scale mode and weight-gradient
        precision), computing on local shards: on DTensors (``full_dtensor``) through their local
        tensors, on plain tensors (``spmd_types``, FSDP's unsharded weights) directly, through
        :class:`_LocalMXFP8Matmul`. ``tp_weight_shard_dim`` (0, 1 or None) is set by
        :func:`bind_mxfp8_shards` after the plan sharded the weight."""

        tp_weight_shard_dim: int | None = None

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return _local_shard_forward(self, input)

        def _local_mm(self, input: torch.Tensor, weight: torch.Tensor, sharded: int | None) -> torch.Tensor:
            tokens = input.numel() // input.shape[-1]
            if tokens % MXFP8_BLOCK:
                raise ValueError(f"MXFP8Linear: this rank's forward has {tokens} tokens, not a multiple of "
                                 f"{MXFP8_BLOCK} (MXFP8 scales the weight gradient's blocks along the tokens): "
                                 "make training.local_batch_size x training.seq_len per microbatch and "
                                 "context-parallel rank a multiple of 32.")
            return _LocalMXFP8Matmul.apply(input, weight, self.kernel_preference, self.scale_calculation_mode,
                                           self.wgrad_with_hp)

    _MXFP8Linear.__name__ = _MXFP8Linear.__qualname__ = "MXFP8Linear"
    _MXFP8Linear.__module__ = __name__
    MXFP8Linear = _MXFP8Linear
    return MXFP8Linear


#: The MXFP8 linear class (torchao's subclass); None until first use or without torchao.
MXFP8Linear: Any = None


class _NamedLinearsConverter(QuantizationConverter):
    """A converter of the linears ``fqns`` names (a linear whose fully qualified name contains one;
    empty: every linear it can take), each swapped for :meth:`_converted` on the same parameters.
    A linear whose dimensions are not multiples of :attr:`multiple` stays in high precision when
    ``fqns`` is empty and is a one-line error when ``fqns`` names it, as is a named linear another
    converter already converted and an ``fqns`` that names nothing."""

    #: every dimension of a converted linear is a multiple of this, for the reason ``multiple_why``
    multiple: int
    multiple_why: str

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.fqns = expand_upstream_names(list(config.fqns))

    def keeps(self, fqn: str, module: nn.Module) -> bool:
        """Whether the linear ``fqn`` is converted (raises ValueError for a named linear it cannot take)."""
        name = type(self).__name__
        named = any(f in fqn for f in self.fqns)
        if not isinstance(module, nn.Linear) or (self.fqns and not named):
            return False
        if type(module) is not nn.Linear:
            if named:
                raise ValueError(f"{name}.Config.fqns names {fqn!r}, already a "
                                 f"{type(module).__name__} (one quantization converter per linear).")
            return False
        if module.in_features % self.multiple or module.out_features % self.multiple:
            if named:
                raise ValueError(f"{name}.Config.fqns names {fqn!r} ({module.in_features} -> "
                                 f"{module.out_features}), whose dimensions are not multiples of {self.multiple} "
                                 f"({self.multiple_why}): leave it out of fqns.")
            return False
        return True

    def _converted(self, module: nn.Linear) -> nn.Module:
        """The converted linear of ``module``'s shape, built on the meta device."""
        raise NotImplementedError

    def convert(self, model: nn.Module) -> list[str]:
        converted = []
        for fqn, module in list(model.named_modules()):
            if not self.keeps(fqn, module):  # a plain nn.Linear from here on
                continue
            new = self._converted(module)
            new.weight = module.weight  # the same parameters: built on meta, or already initialised
            new.bias = module.bias
            _set_submodule(model, fqn, new)
            converted.append(fqn)
        if self.fqns and not converted and _TARGETS_REQUIRED[-1]:
            raise ValueError(f"{type(self).__name__}.Config.fqns: {self.config.fqns} name no linear of the model.")
        return converted


class MXFP8LinearConverter(_NamedLinearsConverter):
    """Upstream's ``MXFP8LinearConverter``: the linears to torchao's ``MXFP8Linear`` (dynamic MXFP8:
    e4m3 elements, one power-of-two scale per 32, on every operand of the three matmuls).

    Checks at construction, each a one-line error: torchao installed (the ``float8`` extra), and a
    GPU of compute capability 10.0+ unless ``emulate=True`` (not upstream's: torchao's emulated
    kernels, eager, on any device). Unlike upstream, a linear whose dimensions are not multiples of
    32 is left in high precision when ``fqns`` is empty (upstream converts it and torchao fails at
    the first step), and is a setup error when ``fqns`` names it.
    """

    Config: ClassVar[type[MXFP8LinearConverterConfig]] = MXFP8LinearConverterConfig
    multiple, multiple_why = MXFP8_BLOCK, "MXFP8's block"

    def __init__(self, config: MXFP8LinearConverterConfig) -> None:
        super().__init__(config)
        _import_torchao_mxfp8("MXFP8LinearConverter (MXFP8 training)")
        self.kernel_preference = _check_emulation("MXFP8LinearConverter", config, (10, 0), "MXFP8 matmuls")

    def _converted(self, module: nn.Linear) -> nn.Module:
        return _mxfp8_linear_class()(module.in_features, module.out_features, bias=module.bias is not None,
                                     device="meta", dtype=module.weight.dtype,
                                     kernel_preference=self.kernel_preference)


def bind_mxfp8_shards(model: nn.Module, state_layouts: dict[str, Any], tp: int) -> int:
    """Tell each MXFP8 linear how the plan sharded its weight over ``tp`` (``tp``: the degree; 1
    without tensor parallelism), after checking that no shard, of a linear or of MXFP8 experts'
    hidden dim, splits a block of 32 (ValueError, one line naming them all); the number of MXFP8
    linears whose weight is sharded over ``tp``."""

    bound, split = 0, []
    for fqn, module in model.named_modules():
        if is_mxfp8_experts(module):  # w1's hidden dim (w2's and w3's are sharded alike)
            hidden = module.quant_hidden_dim
            if tp > 1 and _tp_shard_dim(state_layouts, fqn, "w1") == 1:
                split += _split(fqn, hidden, tp, MXFP8_BLOCK, "hidden dim")
            continue
        if MXFP8Linear is None or not isinstance(module, MXFP8Linear):
            continue
        dim = _tp_shard_dim(state_layouts, fqn, "weight") if tp > 1 else None
        if dim is not None:  # the weight's sharded dim: its outputs (0) or its inputs (1)
            split += _split(fqn, (module.out_features, module.in_features)[dim], tp, MXFP8_BLOCK)
        module.tp_weight_shard_dim = dim
        bound += dim is not None
    if split:
        raise ValueError(f"MXFP8: tensor parallelism splits MXFP8's blocks of {MXFP8_BLOCK} in "
                         f"{_name_list(split)}: leave them out of MXFP8LinearConverter.Config.fqns (experts: drop "
                         "MXFP8GroupedExpertsConverter) or lower parallelism.tensor_parallel_degree.")
    return bound


def torchao_linears_getattr(module: str, names: tuple[str, ...]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``module`` that builds the linears ``names`` of
    ``Float8Linear`` and ``MXFP8Linear`` on first access: they subclass torchao's classes, so
    upstream's import paths export them without importing torchao at import time."""
    builders = {"Float8Linear": _float8_linear_class, "MXFP8Linear": _mxfp8_linear_class}

    def __getattr__(name: str) -> Any:
        if name in names:
            return builders[name]()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


# ----------------------------------------------------------------------------- quantized grouped experts
def _padded_positions(counts: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert, ``counts[e]`` of expert ``e``, each expert's group padded with zero rows
    to a multiple of ``multiple``: ``(each row's index in the padded rows, the padded counts)``."""
    padded = (counts + multiple - 1) // multiple * multiple
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    return torch.arange(expert.numel(), device=counts.device) + shift[expert], padded


def _check_offsets_typed(what: str, a: Any, offs: Any) -> None:
    """``spmd_types``: where the rows ``a`` are the same on every rank of an axis (R or I), their
    expert grouping ``offs`` must be too, or the ranks' outputs would differ under a type that says
    not (SpmdTypeError); ``offs`` itself then takes no part in the product's type."""
    from spmd_types import SpmdTypeError, rules

    rows, groups = rules.get_local_type(a), rules.get_local_type(offs)
    for axis, typ in rows.items():
        if typ in (rules.R, rules.I) and groups.get(axis, typ) not in (rules.R, rules.I):
            raise SpmdTypeError(f"{what}: the rows are {typ} on {axis} but their expert offsets are "
                                f"{groups[axis]}: each rank would group the same rows apart.")
    rules.ignore(offs)


class _QuantizedExperts(nn.Module):
    """The body shared by the quantized grouped experts (:class:`_Float8Experts`,
    :class:`_MXFP8Experts`), mixed in before the model's experts class: the three grouped GEMMs on
    this rank's experts and tokens, each expert's rows padded with zeros to ``quant_pad_multiple``
    (a scale along the tokens never mixes two experts; the GPU kernels' alignment), the padding
    dropped after. ``quant_hidden_dim``: the experts' global hidden dim (the tp-split checks)."""

    quant_pad_multiple: int = 16
    quant_hidden_dim: int = 0

    def _quantized_mm(self, a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                      contracts_hidden: bool) -> torch.Tensor:
        """``a``'s row groups (ending at ``offs``) through their experts' ``weight`` ``[E, out, in]``
        (nn.Linear's layout), quantized, the result in ``a``'s dtype. ``contracts_hidden``: ``w2``
        (the contracted dim is the hidden dim), not ``w1``/``w3`` (whose outputs are)."""
        raise NotImplementedError

    def expert_outputs(self, x: torch.Tensor, counts: torch.Tensor, *, grouped: bool | None = None) -> torch.Tensor:
        from torchtitan_spmd.models.moe import local_weight

        if x.shape[0] == 0:  # no rows here (expert parallelism): nothing to quantize
            return super().expert_outputs(x, counts, grouped=False)  # type: ignore[misc]
        w1, w2, w3 = local_weight(self.w1), local_weight(self.w2), local_weight(self.w3)
        where, padded = _padded_positions(counts.to(torch.long), self.quant_pad_multiple)
        rows = x.new_zeros(int(padded.sum()), x.shape[1]).index_copy(0, where, x)
        offs = torch.cumsum(padded, 0, dtype=torch.int32)
        h = torch.nn.functional.silu(self._quantized_mm(rows, w1, offs, False)) * self._quantized_mm(rows, w3, offs, False)
        return self._quantized_mm(h, w2, offs, True)[where]


_QUANTIZED_EXPERTS: dict[tuple[type, type], type] = {}


def _quantized_experts_class(mixin: type[_QuantizedExperts], prefix: str, base: type[nn.Module]) -> type[nn.Module]:
    """The subclass of grouped-experts class ``base`` with ``mixin``'s quantized GEMMs (cached),
    named ``prefix + base's name`` (upstream's ``Float8GroupedExperts``, ``MXFP8GroupedExperts``)."""
    key = (mixin, base)
    if key not in _QUANTIZED_EXPERTS:
        name = f"{prefix}{base.__name__}"
        cls = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name, "__doc__": mixin.__doc__})
        _QUANTIZED_EXPERTS[key] = cls
    return _QUANTIZED_EXPERTS[key]


def _convert_experts(converter: str, model: nn.Module, multiple: int, mixin: type[_QuantizedExperts],
                     prefix: str, **attributes: Any) -> list[str]:
    """Every grouped-experts module of ``model`` given ``mixin``'s quantized GEMMs and ``attributes``;
    their names. Experts whose dim or hidden dim is no multiple of ``multiple``, and a model with
    none, are one-line errors naming ``converter``."""
    from torchtitan_spmd.models.moe import GroupedExperts

    converted = []
    for fqn, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        hidden, dim = module.w1.shape[1], module.w1.shape[2]
        if dim % multiple or hidden % multiple:
            raise ValueError(f"{converter}: {fqn} has dim {dim} and hidden dim {hidden}; "
                             f"{prefix} grouped GEMMs need both multiples of {multiple}.")
        module.__class__ = _quantized_experts_class(mixin, prefix, type(module))
        module.quant_hidden_dim = hidden
        for key, value in attributes.items():
            setattr(module, key, value)
        converted.append(fqn)
    if not converted and _TARGETS_REQUIRED[-1]:
        raise ValueError(f"{converter}: the model has no MoE experts to convert.")
    return converted


# ----------------------------------------------------------------------------- float8 grouped experts
#: The float8 grouped GEMMs' alignment (upstream's ``PAD_MULTIPLE``): 16 bytes of e4m3, in every
#: dim of both operands and in each expert's token group (torchao's kernels).
FLOAT8_GROUP_MULTIPLE = 16


@functools.cache
def _float8_rowwise_cast() -> Any:
    """torchao's rowwise cast (e4m3, one scale per row along the scaled axis, power-of-two scales):
    every operand of torchao's float8 grouped GEMMs (``_Float8GroupedMM``) is cast so. Built once
    (every emulated grouped GEMM asks for it)."""
    float8 = import_torchao_float8("Float8GroupedExpertsConverter")
    return float8.Float8LinearConfig.from_recipe_name("rowwise").cast_config_input


def _dequantized(t: torch.Tensor, scale: torch.Tensor, cast: Any) -> torch.Tensor:
    """``t`` cast to ``cast``'s float8 dtype (e4m3) with ``scale`` and back, in float32: torchao's
    cast (``hp_tensor_and_scale_to_float8``) and its emulated matmul's dequantisation (``data / scale``)."""
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(t.float() * scale, cast.target_dtype).float() / scale


def _groups(offs: torch.Tensor) -> list[slice]:
    """Each expert's rows: the groups ending at ``offs``."""
    ends = offs.tolist()
    return [slice(start, end) for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def _per_group_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each row group of ``a`` (ending at ``offs``) times its expert's ``b[e]``, accumulated in
    float32, the product in bfloat16 (the scaled grouped GEMM's output dtype, as torchao's)."""
    out = a.new_empty(a.shape[0], b.shape[-1], dtype=torch.float32)
    for e, rows in enumerate(_groups(offs)):
        out[rows] = a[rows] @ b[e]
    return out.to(torch.bfloat16)


def _group_column_scales(t: torch.Tensor, offs: torch.Tensor, cast: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row group of ``t`` (ending at ``offs``) with its rowwise scales per column (``[1, cols]``):
    the weight gradient's casts scale along the tokens of one expert (torchao's per-group
    column-wise scales). An empty group's scales are 1 (they scale nothing)."""
    parts = [t[rows] for rows in _groups(offs)]
    return [(part, _scale(part, cast, 0, None, None, True) if part.shape[0] else t.new_ones(1, t.shape[1]))
            for part in parts]


class _GroupedFloat8Matmul(torch.autograd.Function):
    """Rows ``a`` ``[M, K]`` grouped by expert (groups ending at ``offs``) times their experts'
    ``weight_t`` ``[E, K, N]`` in float8, emulated: the casts of torchao's ``_Float8GroupedMM``
    (every operand e4m3 with power-of-two rowwise scales along the contracted dim; the weight
    gradient's operands scaled per column over one expert's tokens), dequantised and multiplied in
    float32, each product rounded to bfloat16 as torchao's ``out_dtype``.

    Under tensor parallelism the experts' hidden dim is sharded: ``w1``/``w3``'s outputs
    (``tp_dim="n"``) or ``w2``'s contracted dim (``tp_dim="k"``). A scale along it reduces its amax
    with ``reduce`` (the max over tp), so every scale is the unsharded one: the forward's two
    scales are computed outside (``scale_a``, ``scale_w``, for ``spmd_types``' checker to see the
    reduction), the backward's here."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor, scale_a: torch.Tensor,
                scale_w: torch.Tensor, tp_dim: str | None, reduce: Callable[..., torch.Tensor] | None,
                cast: Any) -> torch.Tensor:
        ctx.save_for_backward(a, weight_t, offs)
        ctx.tp_dim, ctx.reduce, ctx.cast = tp_dim, reduce, cast
        return _per_group_mm(_dequantized(a, scale_a, cast), _dequantized(weight_t, scale_w, cast), offs)

    @staticmethod
    def spmd_typecheck(*, a: Any, weight_t: Any, offs: Any, scale_a: Any, scale_w: Any, tp_dim: str | None) -> Any:
        """Each row through one expert's matmul, multilinear in the rows, the weights and their
        scales (the dequantisation multiplies by both). Inside the experts' local region a shard of
        the hidden dim is typed varying (V), not as a partition of one dim, so the einsum alone
        cannot see that ``w2`` (``tp_dim="k"``) contracts a sharded dim: on every axis where its
        weights vary (tp alone: tp-sharded experts run without expert parallelism), both scales
        must be the same on every rank (R or I), which only their typed reduction over tp makes
        them; a shard-local amax leaves them V (SpmdTypeError)."""
        from spmd_types import SpmdTypeError, rules

        if tp_dim == "k":
            for axis, typ in rules.get_local_type(weight_t).items():
                if typ is not rules.V:
                    continue
                for name, scale in (("rows'", scale_a), ("weights'", scale_w)):
                    got = rules.get_local_type(scale).get(axis)
                    if got not in (rules.R, rules.I):
                        raise SpmdTypeError(f"Float8 grouped experts: w2 contracts the hidden dim sharded over "
                                            f"{axis}, and its {name} scales are {got} there: an amax not "
                                            "reduced over tp (each rank would scale its shard alone).")
        _check_offsets_typed("Float8 grouped experts", a, offs)
        return rules.einsum("mk,ekn,mz,ezn->mn", a, weight_t, scale_a, scale_w)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        a, weight_t, offs = ctx.saved_tensors
        cast, reduce = ctx.cast, ctx.reduce
        g = grad_output.float()
        n_sharded = 1 if ctx.tp_dim == "n" else None
        # the input gradient: g [M, N] @ weight [E, N, K], both scaled along N (sharded in w1/w3)
        scale_g = _scale(g, cast, -1, n_sharded, reduce, True)
        scale_w = _scale(weight_t, cast, 2, 2 if ctx.tp_dim == "n" else None, reduce, True)
        grad_a = _per_group_mm(_dequantized(g, scale_g, cast), _dequantized(weight_t, scale_w, cast).transpose(-2, -1),
                               offs)
        # the weight gradient: a_e^T @ g_e per expert, both scaled per column over the expert's tokens
        grad_w = torch.stack([(_dequantized(pa, sa, cast).t() @ _dequantized(pg, sg, cast)).to(torch.bfloat16)
                              for (pa, sa), (pg, sg) in zip(_group_column_scales(a, offs, cast),
                                                            _group_column_scales(g, offs, cast), strict=True)])
        return grad_a, grad_w, None, None, None, None, None, None


class _TorchaoGroupedMatmul(torch.autograd.Function):
    """Rows ``a`` ``[M, K]`` grouped by expert (groups ending at ``offs``) times their experts'
    ``weight_t`` ``[E, K, N]`` through torchao's own grouped-GEMM Function ``grouped`` (its forward,
    given ``args`` after the operands, and its backward): ``_Float8GroupedMM`` on the GPU (float8
    rowwise) or ``_MXFP8GroupedMM`` (MXFP8), with the type rule ``spmd_types``' checker needs
    (torchao's Functions have none). ``what`` names the experts in a type error.

    torchao scales each operand on this rank's tensors: right for MXFP8, whose blocks of 32 a tp
    shard never splits (:func:`bind_mxfp8_shards`), and for float8 only where no scale spans a tp
    shard (:func:`bind_float8_experts`)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor, grouped: Any,
                args: tuple[Any, ...], what: str) -> torch.Tensor:
        ctx.grouped = grouped
        return grouped.forward(ctx, a, weight_t, offs, *args)

    @staticmethod
    def spmd_typecheck(*, a: Any, weight_t: Any, offs: Any, what: str) -> Any:
        """Each row through one expert's matmul: the types of ``a @ weight_t[e]``."""
        from spmd_types import rules

        _check_offsets_typed(what, a, offs)
        return rules.einsum("mk,ekn->mn", a, weight_t)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_a, grad_weight_t, *_ = ctx.grouped.backward(ctx, grad_output.contiguous())
        return grad_a, grad_weight_t, None, None, None, None


@functools.cache
def _torchao_float8_grouped() -> tuple[Any, tuple[Any, ...]]:
    """torchao's ``_Float8GroupedMM`` and its arguments after the operands, as upstream's
    ``Float8TrainingOpConfig()`` gives them (products in bfloat16, torchao's float8 dtype, no
    padding inside: the experts pad their groups). Built once."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.fp8_grouped_mm import _Float8GroupedMM

    op = Float8TrainingOpConfig()
    return _Float8GroupedMM, (op.out_dtype, op.float8_dtype, False)


class _Float8Experts(_QuantizedExperts):
    """Grouped experts whose three grouped GEMMs are float8 rowwise (upstream's
    ``Float8GroupedExperts``): torchao's ``_Float8GroupedMM`` on the GPU (:class:`_TorchaoGroupedMatmul`), or emulated
    (:class:`_GroupedFloat8Matmul`, ``emulate=True``), whose scales along a tp-sharded hidden dim
    are reduced over tp (``amax_reduce``, set by :func:`bind_float8_experts`)."""

    float8_emulate: bool = False
    float8_tp_sharded: bool = False  # the hidden dim sharded over tp (bind_float8_experts)
    amax_reduce: Callable[..., torch.Tensor] | None = None

    def _quantized_mm(self, a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                      contracts_hidden: bool) -> torch.Tensor:
        weight_t = weight.transpose(-2, -1)
        if not self.float8_emulate:
            grouped, args = _torchao_float8_grouped()
            return _TorchaoGroupedMatmul.apply(a, weight_t, offs, grouped, args, "Float8 grouped experts").to(a.dtype)
        tp_dim = ("k" if contracts_hidden else "n") if self.float8_tp_sharded else None
        cast, reduce = _float8_rowwise_cast(), self.amax_reduce
        scale_a = _scale(a, cast, -1, 1 if tp_dim == "k" else None, reduce, True)
        scale_w = _scale(weight_t, cast, 1, 1 if tp_dim == "k" else None, reduce, True)
        return _GroupedFloat8Matmul.apply(a, weight_t, offs, scale_a, scale_w, tp_dim, reduce, cast).to(a.dtype)


def bind_float8_experts(model: nn.Module, state_layouts: dict[str, Any], tp: int,
                        amax_reduce: Callable[..., torch.Tensor] | None) -> int:
    """Tell each float8 grouped-experts module whether the plan shards its hidden dim over ``tp``
    (``tp``: the degree, 1 without tensor parallelism) and the ``max`` over ``tp`` its emulated
    scales reduce with; the number so sharded. One-line ValueError naming them where a shard
    of the hidden dim is no multiple of 16 (torchao's alignment), or where the GPU's kernels
    (``emulate=False``) would scale the shards alone."""
    from torchtitan_spmd.distributed.apply_plan import plain_fqn

    bound, split, gpu = 0, [], []
    for fqn, module in model.named_modules():
        if not is_float8_experts(module):
            continue
        sharded = tp > 1 and _tp_shard_dim(state_layouts, fqn, "w1") == 1
        hidden = module.quant_hidden_dim
        if sharded:
            split += _split(fqn, hidden, tp, FLOAT8_GROUP_MULTIPLE, "hidden dim")
        if sharded and not module.float8_emulate:
            gpu.append(plain_fqn(fqn))
        module.float8_tp_sharded = sharded
        module.amax_reduce = amax_reduce if sharded else None
        bound += sharded
    if split:
        raise ValueError(f"Float8GroupedExpertsConverter: tensor parallelism shards the experts' hidden dim into "
                         f"no multiple of {FLOAT8_GROUP_MULTIPLE} in {_name_list(split)}: lower "
                         "parallelism.tensor_parallel_degree or use expert parallelism.")
    if gpu:
        raise ValueError(f"Float8GroupedExpertsConverter: tensor parallelism shards the hidden dim of {_name_list(gpu)}, "
                         "and torchao's float8 grouped kernels would scale each shard alone (not the recipe's "
                         "rowwise scales): use expert parallelism for the experts (parallelism."
                         "expert_parallel_degree, expert_tensor_parallel_degree 1) or emulate=True.")
    return bound


def is_float8_experts(module: nn.Module) -> bool:
    """Whether ``module`` is grouped experts converted by :class:`Float8GroupedExpertsConverter`."""
    return isinstance(module, _Float8Experts)


class Float8GroupedExpertsConverter(QuantizationConverter):
    """Upstream's ``Float8GroupedExpertsConverter``: the MoE experts' grouped GEMMs in float8 rowwise
    (torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm``), each expert's tokens padded to 16.

    Checks at construction, each a one-line error: torchao installed (the ``float8`` extra), and a
    GPU of compute capability 8.9+ unless ``emulate=True`` (not upstream's: the same casts emulated
    in eager mode on any device, as torchao 0.18 has no emulated float8 grouped GEMM). Experts whose
    dim or hidden dim is no multiple of 16 are a setup error naming them. Where upstream swaps the
    token dispatcher for one that pads, the experts pad their own groups here.

    Under tensor parallelism (the hidden dim sharded) the emulated GEMMs reduce every scale along
    the hidden dim over tp; torchao's GPU kernels scale each shard alone, so on the GPU that
    layout is a setup error (:func:`bind_float8_experts`), where upstream silently scales per shard.
    """

    Config: ClassVar[type[Float8GroupedExpertsConverterConfig]] = Float8GroupedExpertsConverterConfig

    def __init__(self, config: Float8GroupedExpertsConverterConfig) -> None:
        super().__init__(config)
        import_torchao_float8("Float8GroupedExpertsConverter (float8 MoE training)")
        with _quiet_torchao_enum_warning():
            import torchao.prototype.moe_training.fp8_grouped_mm  # noqa: F401
        _check_emulation("Float8GroupedExpertsConverter", config, (8, 9), "float8 grouped GEMMs")

    def convert(self, model: nn.Module) -> list[str]:
        return _convert_experts("Float8GroupedExpertsConverter", model, FLOAT8_GROUP_MULTIPLE, _Float8Experts,
                                "Float8", quant_pad_multiple=FLOAT8_GROUP_MULTIPLE,
                                float8_emulate=self.config.emulate)


# ----------------------------------------------------------------------------- MXFP8 grouped experts
class _MXFP8Experts(_QuantizedExperts):
    """Grouped experts whose three grouped GEMMs are MXFP8 (torchao's, upstream's
    ``MXFP8GroupedExperts``). Nothing is reduced across ranks: under expert parallelism each expert
    is whole on its rank, and a tensor-parallel shard of the hidden dim splits no block of 32
    (checked by :func:`bind_mxfp8_shards`)."""

    mxfp8_kernel_preference: Any = None

    def _quantized_mm(self, a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                      contracts_hidden: bool) -> torch.Tensor:
        """torchao's ``_MXFP8GroupedMM`` (RCEIL scales, products in bfloat16, as upstream's
        ``mxfp8_rceil``) through :class:`_TorchaoGroupedMatmul`."""
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _MXFP8GroupedMM
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

        args = (torch.bfloat16, self.mxfp8_kernel_preference, False, ScaleCalculationMode.RCEIL, False)
        return _TorchaoGroupedMatmul.apply(a, weight.transpose(-2, -1), offs, _MXFP8GroupedMM, args,
                                           "MXFP8 grouped experts").to(a.dtype)


def is_mxfp8_experts(module: nn.Module) -> bool:
    """Whether ``module`` is grouped experts converted by :class:`MXFP8GroupedExpertsConverter`."""
    return isinstance(module, _MXFP8Experts)


class MXFP8GroupedExpertsConverter(QuantizationConverter):
    """Upstream's ``MXFP8GroupedExpertsConverter``: the MoE experts' grouped GEMMs in MXFP8
    (torchao's ``_to_mxfp8_then_scaled_grouped_mm``, recipe ``mxfp8_rceil``), each expert's tokens
    padded to ``pad_multiple``.

    Checks at construction, each a one-line error: torchao installed (the ``float8`` extra), and a
    GPU of compute capability 10.0+ unless ``emulate=True`` (not upstream's: torchao's emulated
    grouped GEMMs, eager, any device). Experts whose dim or hidden dim is no multiple of 32 are a
    setup error naming them. Where upstream swaps the token dispatcher for one that pads, the
    experts pad their own groups here (the same rows reach the GEMMs).
    """

    Config: ClassVar[type[MXFP8GroupedExpertsConverterConfig]] = MXFP8GroupedExpertsConverterConfig

    def __init__(self, config: MXFP8GroupedExpertsConverterConfig) -> None:
        super().__init__(config)
        import_torchao_float8("MXFP8GroupedExpertsConverter (MXFP8 MoE training)")
        with _quiet_torchao_enum_warning():  # the grouped GEMM's module, imported once, quietly
            import torchao.prototype.moe_training.mxfp8_grouped_mm  # noqa: F401
        self.kernel_preference = _check_emulation("MXFP8GroupedExpertsConverter", config, (10, 0),
                                                  "MXFP8 grouped GEMMs")

    def convert(self, model: nn.Module) -> list[str]:
        return _convert_experts("MXFP8GroupedExpertsConverter", model, MXFP8_BLOCK, _MXFP8Experts, "MXFP8",
                                quant_pad_multiple=self.config.pad_multiple,
                                mxfp8_kernel_preference=self.kernel_preference)


# ----------------------------------------------------------------------------- NVFP4 linears
#: NVFP4's block: 16 consecutive elements along the contracted dim share one e4m3 scale (the
#: weight's blocks are 16 x 16), under one float32 scale for the whole tensor.
NVFP4_BLOCK = 16

#: torchao's NVFP4 Triton kernels need every local GEMM dim, the tokens included, a multiple of 128.
NVFP4_GPU_MULTIPLE = 128

#: The randomized Hadamard transform's signs: the NVFP4 v1 recipe's default, which upstream fixes
#: so that every rank has the same (a tp-sharded weight gradient's two operands must share it).
NVFP4_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

#: e2m1's magnitudes: the grid stochastic rounding picks a neighbour on.
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: Whether the emulated gradients' casts round stochastically (the recipe's). The tests that compare
#: a sharded run with one process turn it off: each rank draws its own noise for its own shard.
_STOCHASTIC_ROUNDING = [True]

#: The emulated products' dtype: bfloat16, the scaled matmul's output (the recipe's). The tests that
#: compare a tensor-parallel run with one process keep them in float32: each rank rounds its part
#: of a pending sum over tp before the sum, where one process rounds the whole sum once.
_PRODUCT_DTYPE = [torch.bfloat16]


def _import_torchao_nvfp4(what: str) -> None:
    """torchao's NVFP4 pieces (its ``mx_formats`` casts and ``nvfp4_training``), or ImportError in
    one line naming ``what`` and the extra."""
    import_torchao_float8(what)
    try:
        with _quiet_torchao_enum_warning():
            import torchao.prototype.moe_training.nvfp4_training.nvfp4_linear  # noqa: F401
            import torchao.prototype.mx_formats.nvfp4_tensor  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{what} needs torchao's NVFP4 training (torchao.prototype.moe_training.nvfp4_training), "
                          f"which this torchao lacks ({err}): {FLOAT8_EXTRA}") from None


def _e2m1_stochastic(scaled: torch.Tensor) -> torch.Tensor:
    """``scaled`` (within +-6) rounded to one of its two e2m1 neighbours, the upper one with
    probability its distance from the lower: unbiased, as the GPU's ``cvt.rs``. The noise is the
    default generator's (``torch.rand``), so a seeded run repeats."""
    grid = torch.tensor(_E2M1_GRID, device=scaled.device)
    mag = scaled.abs()
    lower = torch.clamp(torch.searchsorted(grid, mag, right=True) - 1, 0, len(_E2M1_GRID) - 1)
    upper = torch.clamp(lower + 1, max=len(_E2M1_GRID) - 1)
    lo, hi = grid[lower], grid[upper]
    step = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    up = torch.rand_like(mag) < (mag - lo) / step
    return torch.where(up, hi, lo) * torch.sign(scaled)


def nvfp4_fake_quantize(t: torch.Tensor, amax: torch.Tensor, *, tile_rows: int = 1,
                        stochastic: bool = False) -> torch.Tensor:
    """``t`` (2-D ``[rows, cols]``) cast to NVFP4 and back, in float32, as torchao's NVFP4 training
    kernels cast (``_nvfp4_quantize``, ``_nvfp4_2d_quantize``): blocks of ``tile_rows`` x 16 along the
    last dim, each scaled to e2m1's range by an e4m3 scale under the per-tensor scale of ``amax``
    (the tensor's absolute max, maybe reduced over tp: an operand's shards share it), then
    rounded to e2m1, to nearest (torchao's ``f32_to_f4_unpacked``) or stochastically. The value
    returned is what the scaled matmul multiplies: code x block scale x torchao's per-tensor scale.

    Hand-rolled: torchao's casts for NVFP4 training are Triton only, and its pure-torch
    ``nvfp4_quantize`` has no 16 x 16 blocks and no stochastic rounding."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

    rows, cols = t.shape
    fp32_max = torch.finfo(torch.float32).max
    amax = amax.float().reshape(())
    safe = torch.where(amax == 0, torch.ones_like(amax), amax)
    one = torch.ones_like(amax)
    # true divisions throughout (a Python number over a tensor is a reciprocal times it in torch,
    # off by an ulp, which moves e2m1's ties)
    encode = torch.where(amax == 0, one, torch.clamp(torch.full_like(safe, 448.0 * 6.0) / safe, max=fp32_max))
    blocks = t.float().reshape(rows // tile_rows, tile_rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    block_max = blocks.abs().amax(dim=(1, 3), keepdim=True)
    block_scale = torch.clamp(block_max / 6.0 * encode, torch.finfo(torch.float8_e4m3fn).tiny, 448.0)
    block_scale = block_scale.to(torch.float8_e4m3fn).float()
    scaled = torch.clamp(blocks * torch.clamp(one / (block_scale * (one / encode)), max=fp32_max), -6.0, 6.0)
    codes = _e2m1_stochastic(scaled) if stochastic else f4_unpacked_to_f32(f32_to_f4_unpacked(scaled))
    return (codes * block_scale * per_tensor_amax_to_scale(amax)).reshape(rows, cols)


def _rht(t: torch.Tensor) -> torch.Tensor:
    """The randomized Hadamard transform (torchao's ``get_rht_matrix`` of :data:`NVFP4_RHT_SIGNS`) of
    each block of 16 along ``t``'s last dim, in float32. Orthogonal: the weight gradient's two
    operands, both transformed along the tokens, give the same product."""
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix

    rht = get_rht_matrix(NVFP4_RHT_SIGNS, t.device, torch.float32, NVFP4_BLOCK)
    rows, cols = t.shape
    return (t.float().reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK) @ rht).reshape(rows, cols)


def _tensor_amax(t: torch.Tensor, sharded_dim: int | None, reduce: Callable[..., torch.Tensor] | None,
                 typed: Callable[..., torch.Tensor] | None, what: str, *, as_bf16: bool = False) -> torch.Tensor:
    """The absolute max of ``t`` in float32 (``as_bf16``: of ``t`` cast to bfloat16, as the kernels
    cast the forward's operands first), shaped ``[1] * t.dim()``, the max over tp (``reduce``) where
    ``sharded_dim`` is sharded over tp. ``typed``: the representation's ``local_amax``, which types
    this rank's amax as ``t`` (``spmd_types``), or None."""
    def local() -> torch.Tensor:
        amax = t.detach().abs().amax(dim=tuple(range(t.dim())), keepdim=True)
        return (amax.to(torch.bfloat16) if as_bf16 else amax).float()

    with torch.no_grad():
        if sharded_dim is None:
            return typed(t, local) if typed is not None else local()
        return _max_over_tp(t, local, sharded_dim % t.dim(), reduce, typed, what)


class _EmulatedNVFP4Matmul(torch.autograd.Function):
    """``input @ weight.t()`` in NVFP4, emulated: the three GEMMs of torchao's ``nvfp4_mm_triton``
    (NVFP4 v1), each operand cast by :func:`nvfp4_fake_quantize` and the product rounded to
    bfloat16 (the scaled matmul's output dtype):

    - output: the input in blocks of 16 along the features, the weight in blocks of 16 x 16;
    - input gradient: the output gradient in blocks of 16 along the outputs, rounded
      stochastically, times the forward's cast of the weight (its 16 x 16 blocks are its
      transpose's);
    - weight gradient: the output gradient and the input, each transposed and Hadamard-transformed
      along the tokens, in blocks of 16 along the tokens (the output gradient's rounded
      stochastically).

    ``wt_dim`` is the dim of the weight sharded over tp (0: a column-wise linear, 1: row-wise,
    None). Each per-tensor scale of an operand sharded over tp takes the max of its amax over tp
    (``reduce``), so it is the unsharded operand's: the forward's two computed outside (typed),
    the backward's three here."""

    @staticmethod
    def forward(ctx: Any, input_hp: torch.Tensor, weight_hp: torch.Tensor, amax_x: torch.Tensor,
                amax_w: torch.Tensor, wt_dim: int | None, reduce: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        x = input_hp.reshape(-1, input_hp.shape[-1]).to(torch.bfloat16)
        w = nvfp4_fake_quantize(weight_hp.to(torch.bfloat16), amax_w, tile_rows=NVFP4_BLOCK)
        out = (nvfp4_fake_quantize(x, amax_x) @ w.t()).to(_PRODUCT_DTYPE[-1])
        ctx.save_for_backward(x, w)
        ctx.wt_dim, ctx.reduce, ctx.shape = wt_dim, reduce, input_hp.shape
        ctx.dtypes = input_hp.dtype, weight_hp.dtype
        # in the input's dtype here, inside the Function: a row-wise linear's output is a pending sum
        # over tp, which a cast outside would take through a non-linear op (spmd_types rejects it)
        return out.reshape(*input_hp.shape[:-1], out.shape[-1]).to(input_hp.dtype)

    @staticmethod
    def spmd_typecheck(*, input_hp: Any, weight_hp: Any, amax_x: Any, amax_w: Any) -> Any:
        """A linear multilinear in the input, the weight and their per-tensor scales (the
        dequantisation multiplies the product by both). Each scale's own labels are apart from its
        operand's: a scale left sharded over tp (an amax not reduced) shards a second label on
        that axis, which the rule rejects, for a column-wise linear's weight as for a row-wise
        linear's input."""
        from spmd_types import rules

        x = _input_labels("NVFP4Linear", input_hp)
        return rules.einsum(f"{x},nk,{x[:-1]}z,yz->{x[:-1]}n", input_hp, weight_hp, amax_x, amax_w)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        reduce, wt_dim, sr = ctx.reduce, ctx.wt_dim, _STOCHASTIC_ROUNDING[-1]
        what = "NVFP4Linear"
        dy = grad_output.reshape(-1, grad_output.shape[-1]).to(torch.bfloat16)
        dy_dim = 1 if wt_dim == 0 else None  # column-wise: the output gradient's features are sharded
        dy_q = nvfp4_fake_quantize(dy, _tensor_amax(dy, dy_dim, reduce, None, what), stochastic=sr)
        grad_input = (dy_q @ w).to(_PRODUCT_DTYPE[-1]).reshape(ctx.shape).to(ctx.dtypes[0])
        dy_t, x_t = _rht(dy.t()), _rht(x.t())
        dy_t = nvfp4_fake_quantize(dy_t, _tensor_amax(dy_t, 0 if wt_dim == 0 else None, reduce, None, what), stochastic=sr)
        x_t = nvfp4_fake_quantize(x_t, _tensor_amax(x_t, 0 if wt_dim == 1 else None, reduce, None, what))
        grad_weight = (dy_t @ x_t.t()).to(_PRODUCT_DTYPE[-1]).to(ctx.dtypes[1])
        return grad_input, grad_weight, None, None, None, None


class _TorchaoNVFP4Matmul(torch.autograd.Function):
    """``input @ weight.t()`` through torchao's own ``nvfp4_mm_triton`` (its forward and backward: the
    GPU's NVFP4 v1 recipe, SM100+), with the type rule ``spmd_types``' checker needs. torchao takes
    every per-tensor scale on this rank's tensors, so it runs only where no operand is sharded over
    tp (:func:`bind_nvfp4_shards`)."""

    @staticmethod
    def forward(ctx: Any, input_hp: torch.Tensor, weight_hp: torch.Tensor, sr_seed: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_linear import nvfp4_mm_triton

        ctx.nvfp4, ctx.dtypes = nvfp4_mm_triton, (input_hp.dtype, weight_hp.dtype)
        out = nvfp4_mm_triton.forward(ctx, input_hp, weight_hp, None, sr_seed, NVFP4_RHT_SIGNS)
        return out.to(input_hp.dtype)  # inside the Function, as the emulated one's

    @staticmethod
    def spmd_typecheck(*, input_hp: Any, weight_hp: Any) -> Any:
        """A linear's types (no operand sharded over tp: :func:`bind_nvfp4_shards`)."""
        return _linear_type("NVFP4Linear", input_hp, weight_hp)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_input, grad_weight, *_ = ctx.nvfp4.backward(ctx, grad_output.to(torch.bfloat16))
        return grad_input.to(ctx.dtypes[0]), grad_weight.to(ctx.dtypes[1]), None


class NVFP4Linear(nn.Linear):
    """A linear whose three matmuls are NVFP4 (upstream's ``NVFP4Linear``, torchao's NVFP4 v1
    recipe): torchao's ``nvfp4_mm_triton`` on an SM100+ GPU, or emulated (``nvfp4_emulate``), on this
    rank's tensors (DTensors' local shards under ``full_dtensor``). ``tp_weight_shard_dim`` (0, 1
    or None), ``amax_reduce`` (the max over tp) and ``amax_typed`` (how ``spmd_types`` types an
    amax) are set by :func:`bind_nvfp4_shards`.

    Unlike torchao's and upstream's module it holds no buffers: the Hadamard signs are the fixed
    :data:`NVFP4_RHT_SIGNS`, and the stochastic rounding draws from the default generator
    (emulated) or a seed drawn on the first GPU forward (torchao's kernels), so checkpoints hold
    the weights alone."""

    tp_weight_shard_dim: int | None = None
    amax_reduce: Callable[..., torch.Tensor] | None = None
    amax_typed: Callable[..., torch.Tensor] | None = None
    nvfp4_emulate: bool = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _local_shard_forward(self, input)

    def _local_mm(self, input: torch.Tensor, weight: torch.Tensor, sharded: int | None) -> torch.Tensor:
        multiple = NVFP4_BLOCK if self.nvfp4_emulate else NVFP4_GPU_MULTIPLE
        tokens = input.numel() // input.shape[-1]
        if tokens % multiple:
            raise ValueError(f"NVFP4Linear: this rank's forward has {tokens} tokens, not a multiple of {multiple} "
                             "(the weight gradient's NVFP4 blocks run along the tokens): make "
                             "training.local_batch_size x training.seq_len per microbatch and context-parallel "
                             f"rank a multiple of {multiple}.")
        if not self.nvfp4_emulate:
            seed = getattr(self, "_nvfp4_sr_seed", None)
            if seed is None or seed.device != input.device:
                seed = torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=input.device)
                self._nvfp4_sr_seed = seed
            return _TorchaoNVFP4Matmul.apply(input, weight, seed)
        reduce = self.amax_reduce
        typed = self.amax_typed
        amax_x = _tensor_amax(input, -1 if sharded == 1 else None, reduce, typed, "NVFP4Linear", as_bf16=True)
        amax_w = _tensor_amax(weight, sharded, reduce, typed, "NVFP4Linear", as_bf16=True)
        return _EmulatedNVFP4Matmul.apply(input, weight, amax_x, amax_w, sharded, reduce)


def is_nvfp4_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear converted by :class:`NVFP4LinearConverter`."""
    return isinstance(module, NVFP4Linear)


class NVFP4LinearConverter(_NamedLinearsConverter):
    """Upstream's ``NVFP4LinearConverter`` (b5bcd76): the linears to :class:`NVFP4Linear`.

    Checks at construction, each a one-line error: torchao's NVFP4 training installed (the
    ``float8`` extra), and a GPU of compute capability 10.0+ unless ``emulate=True`` (not
    upstream's: the same recipe emulated, eager, on any device). A linear whose dimensions are
    not multiples of 128 (torchao's kernels; emulated: 16, NVFP4's block) stays in high precision
    when ``fqns`` is empty and is a setup error when ``fqns`` names it; upstream refuses it in
    both cases. Under tensor parallelism every per-tensor scale is the unsharded operand's
    (emulated; torchao's kernels would take each shard's, so they are a setup error there:
    :func:`bind_nvfp4_shards`)."""

    Config: ClassVar[type[NVFP4LinearConverterConfig]] = NVFP4LinearConverterConfig

    def __init__(self, config: NVFP4LinearConverterConfig) -> None:
        super().__init__(config)
        _import_torchao_nvfp4("NVFP4LinearConverter (NVFP4 training)")
        _check_emulation("NVFP4LinearConverter", config, (10, 0), "NVFP4 matmuls")
        self.multiple = NVFP4_BLOCK if config.emulate else NVFP4_GPU_MULTIPLE
        self.multiple_why = "NVFP4's blocks" if config.emulate else "torchao's NVFP4 kernels"
        if not config.emulate and not config.model_compile_enabled:
            logging.getLogger(__name__).warning("NVFP4LinearConverter: torchao's NVFP4 kernels are fastest compiled "
                                                "(compile.enable with 'model' in compile.components).")

    def _converted(self, module: nn.Linear) -> nn.Module:
        new = NVFP4Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta",
                          dtype=module.weight.dtype)
        new.nvfp4_emulate = self.config.emulate
        return new


def bind_nvfp4_shards(model: nn.Module, state_layouts: dict[str, Any], tp: int,
                      amax_reduce: Callable[..., torch.Tensor] | None,
                      amax_typed: Callable[..., torch.Tensor] | None = None) -> int:
    """Tell each NVFP4 linear how the plan sharded its weight over ``tp`` (``tp``: the degree, 1
    without tensor parallelism), the ``max`` over ``tp`` its per-tensor scales reduce with, and
    the representation's typing of an amax (``amax_typed``: ``local_amax``, or None); the number
    so sharded. One-line ValueError naming them where a shard is no multiple of the block
    (16 emulated, 128 on the GPU), or where torchao's kernels (``emulate=False``) would scale
    each shard alone."""
    from torchtitan_spmd.distributed.apply_plan import plain_fqn

    bound, split, gpu = 0, [], []
    for fqn, module in model.named_modules():
        if not is_nvfp4_linear(module):
            continue
        dim = _tp_shard_dim(state_layouts, fqn, "weight") if tp > 1 else None
        if dim is not None:  # the weight's sharded dim: its outputs (0) or its inputs (1)
            multiple = NVFP4_BLOCK if module.nvfp4_emulate else NVFP4_GPU_MULTIPLE
            split += _split(fqn, (module.out_features, module.in_features)[dim], tp, multiple)
            if not module.nvfp4_emulate:
                gpu.append(plain_fqn(fqn))
        module.tp_weight_shard_dim = dim
        module.amax_reduce = amax_reduce if dim is not None else None
        module.amax_typed = amax_typed
        bound += dim is not None
    if split:
        raise ValueError(f"NVFP4: tensor parallelism shards {_name_list(split)} into no multiple of NVFP4's "
                         "blocks: leave them out of NVFP4LinearConverter.Config.fqns or lower "
                         "parallelism.tensor_parallel_degree.")
    if gpu:
        raise ValueError(f"NVFP4LinearConverter: tensor parallelism shards {_name_list(gpu)}, and torchao's NVFP4 "
                         "kernels would take each shard's per-tensor scale (not the recipe's): leave them out of "
                         "fqns, drop tensor parallelism, or use emulate=True.")
    return bound

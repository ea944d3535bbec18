"""Model converters as data: what a recipe lists in ``model_registry(flavor, converters=[...])``.

Upstream torchtitan (a0c831c49 and b5bcd76 alike) turns on float8 training, MXFP8, NVFP4 and
LoRA as *model converters*: ``Float8LinearConverter.Config(...)``,
``LoRAConverter.Config(...)``, ... listed in a ``ModelSpec``. These are those configs, with
upstream's fields and defaults, as plain dataclasses (this is the config level: nothing here
imports torch or the runtime). What each converter does to a model is its technique module
(:mod:`torchtitan_spmd.techniques.float8`, :mod:`torchtitan_spmd.techniques.lora`);
upstream's import paths (``torchtitan_spmd.components.quantization``,
``torchtitan_spmd.components.lora``) name the converter classes, whose ``Config`` is the
dataclass here.

A job carries its converters in ``model.converters`` (a list of these configs); a recipe sets
them with ``job.model_spec = model_registry(flavor, converters=[...])`` as upstream writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

__all__ = [
    "CONVERTER_CONFIGS",
    "Float8GroupedExpertsConverterConfig",
    "Float8LinearConverterConfig",
    "LoRAConverterConfig",
    "MXFP8GroupedExpertsConverterConfig",
    "MXFP8LinearConverterConfig",
    "ModelConfigConverterConfig",
    "NVFP4LinearConverterConfig",
    "QuantizationConverterConfig",
    "CONVERTER_NAMES",
    "check_converters",
    "converter_to_dict",
    "nvfp4_bf16_tail_fqns",
]


@dataclass(kw_only=True)
class ModelConfigConverterConfig:
    """Upstream's ``ModelConfigConverter.Config``: the base of every converter's config."""

    #: The converter's name in error messages and the dry run (upstream's class name).
    converter: ClassVar[str] = "ModelConfigConverter"

    def check(self, where: str) -> None:
        """Raise ``ValueError`` naming ``where`` for a bad field (nothing to check here)."""


@dataclass(kw_only=True)
class QuantizationConverterConfig(ModelConfigConverterConfig):
    """Upstream's ``QuantizationConverter.Config``: quantized training converters."""

    converter: ClassVar[str] = "QuantizationConverter"

    model_compile_enabled: bool = False
    """Whether ``torch.compile`` compiles the model (upstream's recipes pass
    ``compile.enable and "model" in compile.components``)."""


def _is_positive_int(value: Any) -> bool:
    """Whether ``value`` is an int above zero (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_str_list(where: str, value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{where}: expected a list of str, got {value!r}.")


@dataclass(kw_only=True)
class Float8LinearConverterConfig(QuantizationConverterConfig):
    """Upstream's ``Float8LinearConverter.Config``: dynamic float8 training of the linears (torchao)."""

    converter: ClassVar[str] = "Float8LinearConverter"

    recipe_name: Literal["rowwise", "rowwise_with_gw_hp"] = "rowwise"
    """torchao's float8 recipe: ``rowwise`` (per-row scales on every operand) or
    ``rowwise_with_gw_hp`` (the weight gradient in high precision)."""

    filter_fqns: list[str] = field(default_factory=list)
    """Linears whose fully qualified name contains one of these stay in high precision
    (upstream's spellings ``lm_head`` and ``wkv`` name this library's ``output`` and ``wk``/``wv``).
    Linears with a dimension not divisible by 16 always stay."""

    emulate: bool = False
    """Emulate the float8 matmuls in high precision (any device, for tests; not with compile).
    Without it float8 needs an NVIDIA GPU of compute capability 8.9 (SM89) or newer."""

    def check(self, where: str) -> None:
        if self.recipe_name not in ("rowwise", "rowwise_with_gw_hp"):
            raise ValueError(f"{where}.recipe_name: invalid value {self.recipe_name!r}; valid choices are "
                             "'rowwise', 'rowwise_with_gw_hp'.")
        _check_str_list(f"{where}.filter_fqns", self.filter_fqns)


@dataclass(kw_only=True)
class Float8GroupedExpertsConverterConfig(QuantizationConverterConfig):
    """Upstream's ``Float8GroupedExpertsConverter.Config``: float8 grouped GEMMs of the MoE experts."""

    converter: ClassVar[str] = "Float8GroupedExpertsConverter"

    emulate: bool = False
    """Not upstream's: emulate the float8 grouped GEMMs (any device, eager; products in bfloat16, as
    torchao's). Without it they need an NVIDIA GPU of compute capability 8.9 (SM89) or newer
    (torchao's Triton kernels and ``torch._scaled_grouped_mm``)."""


@dataclass(kw_only=True)
class MXFP8LinearConverterConfig(QuantizationConverterConfig):
    """Upstream's ``MXFP8LinearConverter.Config``: dynamic MXFP8 training of the linears (torchao's
    ``MXFP8Linear``: float8 e4m3 elements with one power-of-two scale per block of 32)."""

    converter: ClassVar[str] = "MXFP8LinearConverter"

    fqns: list[str] = field(default_factory=list)
    """Linears whose fully qualified name contains one of these are converted; empty: every linear
    whose dimensions are multiples of 32 (MXFP8's block). A named linear that is not is a setup error."""

    emulate: bool = False
    """Not upstream's: run torchao's emulated MXFP8 kernels (any device, eager; the CPU's and tests'
    path). Without it MXFP8 needs an NVIDIA GPU of compute capability 10.0 (SM100) or newer."""

    def check(self, where: str) -> None:
        _check_str_list(f"{where}.fqns", self.fqns)


@dataclass(kw_only=True)
class MXFP8GroupedExpertsConverterConfig(QuantizationConverterConfig):
    """Upstream's ``MXFP8GroupedExpertsConverter.Config``: the MoE experts' grouped GEMMs in MXFP8
    (torchao's ``_to_mxfp8_then_scaled_grouped_mm``)."""

    converter: ClassVar[str] = "MXFP8GroupedExpertsConverter"

    recipe_name: Literal["mxfp8_rceil"] = "mxfp8_rceil"
    """The grouped GEMMs' MXFP8 recipe: ``mxfp8_rceil`` (scales rounded up, RCEIL)."""

    pad_multiple: int = 32
    """Each expert's token group padded to a multiple of this (MXFP8's block of 32, or a multiple of
    it: sm_100's CuTeDSL kernels need 128)."""

    emulate: bool = False
    """Not upstream's: torchao's emulated MXFP8 grouped GEMMs (any device, eager; products in
    bfloat16). Without it they need an NVIDIA GPU of compute capability 10.0 (SM100) or newer."""

    def check(self, where: str) -> None:
        if self.recipe_name != "mxfp8_rceil":
            raise ValueError(f"{where}.recipe_name: invalid value {self.recipe_name!r}; valid choices are "
                             "'mxfp8_rceil'.")
        if not _is_positive_int(self.pad_multiple) or self.pad_multiple % 32:
            raise ValueError(f"{where}.pad_multiple: expected a positive multiple of 32 (MXFP8's block), "
                             f"got {self.pad_multiple!r}.")


@dataclass(kw_only=True)
class NVFP4LinearConverterConfig(QuantizationConverterConfig):
    """Upstream's ``NVFP4LinearConverter.Config`` (b5bcd76): NVFP4 training of the linears (e2m1
    elements, one e4m3 scale per block of 16 under a per-tensor scale; the weight in blocks of
    16 x 16; stochastic rounding of the gradients and a Hadamard transform in the weight gradient)."""

    converter: ClassVar[str] = "NVFP4LinearConverter"

    fqns: list[str] = field(default_factory=list)
    """Linears whose fully qualified name contains one of these are converted (``"layers.1."``
    names block 1 alone); empty: every linear whose dimensions NVFP4 can take. A named linear it
    cannot take is a setup error."""

    emulate: bool = False
    """Not upstream's: emulate NVFP4's casts and matmuls in high precision (any device, eager; the
    CPU's and tests' path). Without it NVFP4 needs an NVIDIA GPU of compute capability 10.0
    (SM100) or newer (torchao's Triton kernels)."""

    def check(self, where: str) -> None:
        _check_str_list(f"{where}.fqns", self.fqns)


def nvfp4_bf16_tail_fqns(num_layers: int, bf16_tail_fraction: float) -> list[str]:
    """Upstream b5bcd76's helper (``torchtitan.components.quantization.nvfp4``): the
    ``NVFP4LinearConverter.Config.fqns`` naming the leading blocks, ``layers.0.`` to ``layers.{k-1}.``
    (the trailing dot keeps ``layers.1.`` from naming ``layers.10``), where the last
    ``ceil(num_layers * bf16_tail_fraction)`` blocks stay in high precision. ValueError in one
    line where that leaves no block to convert (an empty ``fqns`` would convert every linear)."""
    import math

    if not _is_positive_int(num_layers):
        raise ValueError(f"nvfp4_bf16_tail_fqns: num_layers must be a positive int, got {num_layers!r}.")
    if isinstance(bf16_tail_fraction, bool) or not isinstance(bf16_tail_fraction, (int, float)) or not (
            0 <= bf16_tail_fraction <= 1):
        raise ValueError(f"nvfp4_bf16_tail_fqns: bf16_tail_fraction must be a number in [0, 1], "
                         f"got {bf16_tail_fraction!r}.")
    convert = num_layers - math.ceil(num_layers * bf16_tail_fraction)
    if convert <= 0:
        raise ValueError(f"nvfp4_bf16_tail_fqns: bf16_tail_fraction={bf16_tail_fraction} keeps all {num_layers} "
                         "layers in high precision; nothing to convert to NVFP4.")
    return [f"layers.{i}." for i in range(convert)]


@dataclass(kw_only=True)
class LoRAConverterConfig(ModelConfigConverterConfig):
    """Upstream's ``LoRAConverter.Config``: low-rank adapters on the targeted linears, the rest frozen."""

    converter: ClassVar[str] = "LoRAConverter"

    rank: int = 8
    """Rank of the adapters' matrices."""

    alpha: float = 16.0
    """Scaling: the adapters' output is multiplied by ``alpha / rank``."""

    target_modules: list[str] | None = None
    """Linears to adapt, matched against the last part of their name (``["wq", "wo"]``; upstream's
    ``wkv`` names ``wk`` and ``wv``, ``lm_head`` names ``output``). None: every linear."""

    def check(self, where: str) -> None:
        if not _is_positive_int(self.rank):
            raise ValueError(f"{where}.rank: LoRA rank must be a positive int, got {self.rank!r}.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise TypeError(f"{where}.alpha: expected a number, got {self.alpha!r}.")
        if self.target_modules is not None:
            _check_str_list(f"{where}.target_modules", self.target_modules)


#: Every converter config, by upstream's converter name.
CONVERTER_CONFIGS: dict[str, type[ModelConfigConverterConfig]] = {
    c.converter: c for c in (Float8LinearConverterConfig, Float8GroupedExpertsConverterConfig,
                             MXFP8LinearConverterConfig, MXFP8GroupedExpertsConverterConfig,
                             NVFP4LinearConverterConfig, LoRAConverterConfig)
}


#: The names a TOML-era job (upstream before its Feb 2026 refactor) or the command line gives a
#: converter in ``model.converters = ["float8"]``: each means that converter with its defaults.
CONVERTER_NAMES: dict[str, str] = {
    "float8": "Float8LinearConverter",
    "quantize.linear.float8": "Float8LinearConverter",
    "quantize.grouped_mm.float8": "Float8GroupedExpertsConverter",
    "mx": "MXFP8LinearConverter",
    "quantize.linear.mx": "MXFP8LinearConverter",
    "quantize.grouped_mm.mx": "MXFP8GroupedExpertsConverter",
    "nvfp4": "NVFP4LinearConverter",
    "lora": "LoRAConverter",
    **{name: name for name in CONVERTER_CONFIGS},
}


def _from_name(name: str, where: str) -> ModelConfigConverterConfig:
    if name not in CONVERTER_NAMES:
        from torchtitan_spmd._errors import suggest

        raise ValueError(f"{where}: unknown converter {name!r}; valid names are "
                         f"{', '.join(map(repr, CONVERTER_NAMES))}.{suggest(name, CONVERTER_NAMES)}")
    return CONVERTER_CONFIGS[CONVERTER_NAMES[name]]()


def _from_dict(table: dict[str, Any], where: str) -> ModelConfigConverterConfig:
    """A TOML table ``{converter = "Float8LinearConverter", emulate = true, ...}``."""
    table = dict(table)
    name = table.pop("converter", None)
    if not isinstance(name, str):
        raise ValueError(f"{where}: a converter table needs its converter's name, e.g. "
                         f"converter = \"Float8LinearConverter\"; got {table!r}.")
    cls = type(_from_name(name, where))
    try:
        return cls(**table)
    except TypeError as err:
        raise TypeError(f"{where}: {err}") from None


def converter_to_dict(c: ModelConfigConverterConfig) -> dict[str, Any]:
    """``c`` as a TOML table (read back by :func:`check_converters`)."""
    import dataclasses

    return {"converter": c.converter, **dataclasses.asdict(c)}  # type: ignore[call-overload]


def check_converters(converters: Any, where: str = "model.converters") -> list[ModelConfigConverterConfig]:
    """``converters`` checked: a list of converter configs, each valid, quantization before LoRA
    (upstream's ``validate_converter_order``), at most one of each. Raises ``TypeError`` or
    ``ValueError`` naming the entry."""
    if not isinstance(converters, (list, tuple)):
        raise TypeError(f"{where}: expected a list of converter configs, got {converters!r}.")
    converters = [_from_name(c, f"{where}[{i}]") if isinstance(c, str) else
                  _from_dict(c, f"{where}[{i}]") if isinstance(c, dict) else c for i, c in enumerate(converters)]
    seen: set[str] = set()
    seen_lora = False
    for i, c in enumerate(converters):
        at = f"{where}[{i}]"
        if not isinstance(c, ModelConfigConverterConfig) or type(c) not in CONVERTER_CONFIGS.values():
            raise TypeError(f"{at}: expected one of {', '.join(n + '.Config' for n in CONVERTER_CONFIGS)}, "
                            f"got {c!r}.")
        c.check(at)
        if c.converter in seen:
            raise ValueError(f"{at}: {c.converter} is listed twice.")
        seen.add(c.converter)
        if isinstance(c, LoRAConverterConfig):
            seen_lora = True
        elif seen_lora:
            raise ValueError(f"{at}: {c.converter} must be applied before LoRAConverter. "
                             "Reorder the converters list.")
    return list(converters)

"""Model converters under ``spmd_types`` (issue 42): float8 against torchao's own single-process model
and LoRA, at FSDP 2 x TP 2 (the checks are layer 3's ``float8_helpers``)."""

from __future__ import annotations

from typing import Any

import pytest
import spmd_helpers  # noqa: F401 - puts layer 3's helpers on the path
import torch

pytest.importorskip("torchao.float8", reason='float8 needs the float8 extra: pip install -e ".[float8]"')

from float8_helpers import EP2, NV_STEP1_TOL, check_float8_parity, check_lora  # noqa: E402


def test_float8_type_checked_matches_torchaos_single_process_model() -> None:
    """Type-checked (``debug.spmd_typechecking``): each amax a scale takes over a tp-sharded axis is
    reduced by a typed all-gather (``S(dim)@tp -> R@tp``), and the float8 matmul's type rule takes
    the scales with the operands, so a dropped reduction is an ``SpmdTypeError``."""
    check_float8_parity("spmd_types-fsdp2_tp2-typechecked", "spmd_types", (), spmd_typechecking=True)


def test_float8_cp_tp_type_checked_matches_torchaos_single_process_model() -> None:
    """CP 2 x TP 2, type-checked: each rank's float8 matmuls scale its own (headtail) tokens, the
    amaxes over tp-sharded axes reduced by typed collectives, the ring attention between them."""
    check_float8_parity("spmd_types-cp2_tp2-typechecked", "spmd_types", (),
                        {"context_parallel_degree": 2, "tensor_parallel_degree": 2}, spmd_typechecking=True)


def test_float8_pp_selective_ac_matches_torchaos_single_process_model() -> None:
    """PP 2 x FSDP 2 with selective activation checkpointing, type-checked: each stage's float8
    linears on typed local shards (no tp: nothing to reduce), one row a microbatch."""
    check_float8_parity("spmd_types-pp2_fsdp2-ac_selective-typechecked", "spmd_types", (),
                        {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}, 1, ac="selective",
                        spmd_typechecking=True)


def test_float8_dense_layers_under_expert_parallelism_type_checked_match_torchaos_model() -> None:
    """The tiny MoE at FSDP 2 x TP 2 with EP 2, type-checked: the attention linears and the output
    float8 on typed local shards (their amaxes reduced over tp), the experts' tokens exchanged
    over ep in high precision, against torchao's own model of the same MoE on one process (both
    routing round-robin: ``float8_helpers.MODELS``)."""
    check_float8_parity("spmd_types-fsdp2_tp2_ep2-moe-typechecked", "spmd_types", (), EP2, model="qwen3",
                        spmd_typechecking=True)


def test_mxfp8_type_checked_matches_torchaos_single_process_model() -> None:
    """MXFP8 (emulated) at FSDP 2 x TP 2, type-checked: torchao's MXFP8 matmul on typed local
    shards, typed as the linear it is (no block spans a shard, so nothing is reduced: a row-wise
    linear's product is a pending sum over tp the checker follows), against torchao's own
    ``MXFP8Linear`` model on one process."""
    check_float8_parity("spmd_types-fsdp2_tp2-mxfp8-typechecked", "spmd_types", ("wk", "wv"), recipe="mxfp8",
                        spmd_typechecking=True)


@pytest.mark.parametrize("cell", ["fsdp4", "fsdp2_tp2"])
def test_mxfp8_experts_type_checked_match_torchaos_single_process_model(cell: str) -> None:
    """The tiny MoE's experts in MXFP8 (emulated), type-checked: the grouped GEMM typed as each row's
    expert matmul (under TP, ``w2``'s product a pending sum over tp the checker follows), against
    the same MoE on one process calling torchao's own MXFP8 grouped GEMM (tolerances: layer 3)."""
    from float8_helpers import F8_TOL, MX_EXPERTS_SHARDED_TOL

    parallelism = ({"data_parallel_shard_degree": 4} if cell == "fsdp4" else
                   {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2})
    check_float8_parity(f"spmd_types-{cell}-mxfp8_experts-typechecked", "spmd_types", (), parallelism,
                        model="qwen3", recipe="mxfp8_experts", tol=F8_TOL if cell == "fsdp4" else MX_EXPERTS_SHARDED_TOL,
                        spmd_typechecking=True)


@pytest.mark.parametrize("cell", ["fsdp4", "fsdp2_tp2"])
def test_float8_experts_type_checked_match_torchaos_single_process_model(cell: str) -> None:
    """The tiny MoE's experts in float8 rowwise (emulated), type-checked: under TP each scale along
    the sharded hidden dim reduced by a typed all-gather (``R@tp``) and taken into the grouped
    GEMM's type rule with its operand, against the same MoE on one process looping over torchao's
    float8 linear matmul (tolerances: layer 3). A dropped reduction:
    :func:`test_type_checker_catches_a_dropped_amax_reduction`."""
    from float8_helpers import F8_TOL, MX_EXPERTS_SHARDED_TOL

    parallelism = ({"data_parallel_shard_degree": 4} if cell == "fsdp4" else
                   {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2})
    check_float8_parity(f"spmd_types-{cell}-float8_experts-typechecked", "spmd_types", (), parallelism,
                        model="qwen3", recipe="float8_experts", tol=F8_TOL if cell == "fsdp4" else MX_EXPERTS_SHARDED_TOL,
                        spmd_typechecking=True)


def test_float8_lora_type_checked_trains_only_the_adapters_and_exports_merged(tmp_path: Any) -> None:
    """Upstream's ``llama3_debugmodel_float8_emulate_lora`` converters, type-checked: the row-wise
    adapters' pending sum over tp goes through a matmul the checker knows to be linear."""
    check_lora(tmp_path, "spmd_types", float8=True, spmd_typechecking=True)


def _dropped_amax_step(rank: int, world: int, cfg: Any, kind: str) -> str | None:
    """One type-checked step with every float8 linear's (``experts``: every float8 grouped experts';
    ``nvfp4``: every NVFP4 linear's) amax reduction over tp dropped (the plant: each rank scales by
    the amax of its own shard); the checker's first line, or None."""
    from spmd_types import SpmdTypeError

    from torchtitan_spmd.techniques import quantization
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    dropped = 0
    for module in trainer.model.modules():
        which = {"experts": quantization.is_float8_experts, "nvfp4": quantization.is_nvfp4_linear,
                 "linears": lambda m: isinstance(m, quantization.Float8Linear)}[kind](module)
        if which and module.amax_reduce is not None:
            def local_only(amax: torch.Tensor, dim: int | None = None) -> torch.Tensor:
                return amax

            local_only.local_amax = getattr(module.amax_reduce, "local_amax", None)  # type: ignore[attr-defined]
            module.amax_reduce = local_only
            dropped += 1
    # 2 blocks x (wq, wk, wv, wo, w1, w2, w3), and the output; or the tiny MoE's 2 blocks' experts
    assert dropped == (2 if kind == "experts" else 15), dropped
    try:
        trainer.step(1)
    except SpmdTypeError as err:
        return str(err).splitlines()[0]
    return None


@pytest.mark.parametrize("kind", ["linears", "experts", "nvfp4"])
def test_type_checker_catches_a_dropped_amax_reduction(kind: str) -> None:
    """The plant the checker exists for: float8 scales taken over a rank's shard of a tp-sharded
    axis (no max over tp). Untyped, that trains with wrong scales (the losses barely show it:
    layer 3's per-scale tests do); type-checked, it is an ``SpmdTypeError`` at the first row-wise
    float8 matmul (``experts``: the experts' ``w2`` grouped GEMM), whose pending sum over tp the
    varying scales would multiply. ``nvfp4``: NVFP4's per-tensor scale of a column-wise linear's
    weight, left sharded over tp, at the first NVFP4 matmul (``wq``)."""
    from float8_helpers import float8_job
    from parity_helpers import warm_parent

    from torchtitan_spmd.config.converters import (
        Float8GroupedExpertsConverterConfig,
        Float8LinearConverterConfig,
        NVFP4LinearConverterConfig,
    )
    from torchtitan_spmd.launcher import run_forked

    warm_parent()
    converter = {"experts": Float8GroupedExpertsConverterConfig(emulate=True),
                 "linears": Float8LinearConverterConfig(emulate=True),
                 "nvfp4": NVFP4LinearConverterConfig(emulate=True)}[kind]
    cfg = float8_job("spmd_types", [converter], parallelism={"tensor_parallel_degree": 2}, steps=1,
                     model="qwen3" if kind == "experts" else "llama3", spmd_typechecking=True)
    errors = run_forked(_dropped_amax_step, 2, cfg, kind, timeout_s=120)
    assert errors[0] is not None and errors == [errors[0]] * 2, errors
    want = {"experts": "w2 contracts the hidden dim sharded over",
            "linears": "shards both 'k' and 'z' in 'bsk,kn,bsz,zn->bsn'",
            "nvfp4": "shards both 'n' and 'y' in 'bsk,nk,bsz,yz->bsn'"}[kind]
    assert want in errors[0], errors[0]


def test_nvfp4_type_checked_matches_the_judges_single_process_model() -> None:
    """NVFP4 (emulated) at FSDP 2 x TP 2, type-checked: each per-tensor amax of a tp-sharded operand
    reduced by a typed all-gather (``R@tp``) and taken into the NVFP4 matmul's type rule with its
    own labels, against the judge's model on one process (layer 3's ``NV_CELLS``; a dropped
    reduction: :func:`test_type_checker_catches_a_dropped_amax_reduction`)."""
    check_float8_parity("spmd_types-fsdp2_tp2-nvfp4-typechecked", "spmd_types", (), recipe="nvfp4", tol=NV_STEP1_TOL,
                        spmd_typechecking=True)


def test_nvfp4_pp_type_checked_matches_the_judges_single_process_model() -> None:
    """NVFP4 (emulated) at PP 2 x FSDP 2, type-checked: each stage's NVFP4 linears on typed local
    tensors, one row of 32 tokens a microbatch (its own per-tensor scales), no tp: nothing reduced."""
    check_float8_parity("spmd_types-pp2_fsdp2-nvfp4-typechecked", "spmd_types", (),
                        {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}, 1, recipe="nvfp4", tol=NV_STEP1_TOL,
                        spmd_typechecking=True)


def test_nvfp4_lora_type_checked_trains_only_the_adapters_and_exports_merged(tmp_path: Any) -> None:
    """LoRA over NVFP4 (emulated) at FSDP 2 x TP 2, type-checked: the base frozen bit for bit, every
    adapter moved, only the adapters with optimizer state, the merged export's logits the model's."""
    from torchtitan_spmd.config.converters import NVFP4LinearConverterConfig

    check_lora(tmp_path, "spmd_types", quant=NVFP4LinearConverterConfig(emulate=True), spmd_typechecking=True)

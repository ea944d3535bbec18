"""Helpers for the converter tests: the trainer with model converters on forked gloo ranks, and the
judge it is compared with: torchao's own single-process ``Float8Linear`` model, which shares no
code with the library's float8 technique.

The judge is the tiny Llama (or the tiny MoE: :data:`MODELS`) built from the same seed (the family's ``initial_value``, which every
layout starts from), converted by ``torchao.float8.convert_to_float8_training`` with the same
recipe, trained with ``torch.optim.AdamW`` on the same global batches, the learning rate from the
reference's closed form (:func:`torchtitan_spmd.reference.lr_factor`). Each data-parallel rank's
rows go through the model as their own forward (float8 scales tokens per rank: the weight
gradient's per-column scales are those of the rank's batch, in a run as in upstream's FSDP); the
loss is the global token mean, so the gradients add up as FSDP's do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import grad_probe
import pytest
import torch
import torch.nn.functional as F
from parity_helpers import job_config, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.config.converters import (
    Float8GroupedExpertsConverterConfig,
    Float8LinearConverterConfig,
    LoRAConverterConfig,
    MXFP8GroupedExpertsConverterConfig,
    MXFP8LinearConverterConfig,
    NVFP4LinearConverterConfig,
)
from torchtitan_spmd.launcher import run_forked

__all__ = ["EP2", "F8_STEPS", "F8_TOL", "LORA", "NV_STEP1_TOL", "MODELS", "MX_EXPERTS_SHARDED_TOL", "PARALLELISM", "check_float8_parity", "check_lora",
           "float8_job", "run_trainer", "torchao_float8_experts", "torchao_float8_matmul", "torchao_mxfp8",
           "torchao_mxfp8_experts",
           "torchao_reference"]

PARALLELISM: dict[str, Any] = {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}
F8_STEPS = 3
LOCAL_BATCH = 2


#: model family -> (flavour, the linears torchao converts with nothing skipped, MoE routers):
#: ``llama3``'s tiny (7 linears a block, 2 blocks, the output) and ``qwen3``'s ``moe_tiny`` (the 4
#: attention linears a block, 2 blocks, the output; the experts are grouped weights, not linears,
#: and the router's 8 outputs are no multiple of 16).
#:
#: The MoE routes round-robin (``debug.moe_force_load_balance``, upstream's debug switch; in the
#: judge, each router's ``force_load_balance``): float8 with top-k routing is chaotic. A float8
#: element a rounding boundary away flips by an e4m3 step under a 1e-7 change, and a flipped
#: expert choice moves the loss. Measured: torchao's model against itself with its weights
#: perturbed by 1e-6 (relative) moved 1e-6, 4.2e-6 and 4.1e-5 over three steps; the trainer at
#: FSDP 2 x TP 2 against it, 1.7e-7, 3.8e-5 and 7.5e-5; with the routing forced, both 0.
MODELS: dict[str, tuple[str, int, int]] = {"llama3": ("tiny", 15, 0), "qwen3": ("moe_tiny", 9, 2)}

#: EP 2 within FSDP 2 x TP 2 (the ``ep`` pair borrowed from dp_shard x tp, as the EP compose tests'
#: ``ep2_sp``): the MoE's attention linears and output in float8, its experts exchanged in high precision.
EP2: dict[str, Any] = {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, "expert_parallel_degree": 2}


def float8_job(backend: str, converters: list[Any], *, parallelism: dict[str, Any] | None = None,
               steps: int = F8_STEPS, ac: str = "none", model: str = "llama3", **debug: Any) -> JobConfig:
    """The parity job (tiny Llama, or with ``model="qwen3"`` the tiny MoE, fp32, deterministic) of
    ``backend`` with ``converters``; ``ac``: ``activation_checkpoint.mode``."""
    cfg = job_config(backend, parallelism or PARALLELISM, local_batch=LOCAL_BATCH, steps=steps, model=model,
                     **debug)
    cfg.model.flavor = MODELS[model][0]
    cfg.debug.moe_force_load_balance = MODELS[model][2] > 0  # an MoE routes round-robin (see MODELS)
    cfg.model.converters = list(converters)
    cfg.activation_checkpoint.mode = ac
    cfg.validate()
    return cfg


def _train(rank: int, world: int, cfg: JobConfig, probe: str | None) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    extra: dict[str, Any] = {}
    if probe is not None:
        import importlib

        module, _, name = probe.partition(":")
        extra = getattr(importlib.import_module(module), name)(trainer)
    records = [trainer.step(s) for s in range(1, cfg.training.steps + 1)]
    out = {"records": [(r.loss, r.grad_norm) for r in records]}
    if probe is not None:
        out["probe"] = extra["result"]()
    trainer.close()
    return out


def run_trainer(cfg: JobConfig, world: int = 4, probe: str | None = None) -> tuple[list[dict[str, Any]], Any]:
    """Every rank's ``{"records", "probe"}`` and the pooled step-1 gradient trace (:mod:`grad_probe`)."""
    warm_parent()
    results = run_forked(grad_probe.probed(_train), world, cfg, probe, timeout_s=300)
    outs = [r for r, _ in results]
    for rank, out in enumerate(outs):
        assert out["records"] == outs[0]["records"], f"rank {rank} logged {out['records']}, rank 0 {outs[0]['records']}"
    return outs, grad_probe.merge([t for _, t in results])[0]


def _tokens_per_cp_rank(forward: Any, cp: int, x: torch.Tensor) -> torch.Tensor:
    """``forward`` (a float8 linear's) applied to each context-parallel rank's tokens on their own
    (headtail: rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``), so that the weight
    gradient's per-column scales, taken along the tokens, are those of one rank's tokens, as under
    CP, where each rank's matmuls see only its own. Per-token scales (the forward's input, the
    input gradient's output gradient) are the same either way."""
    chunks = x.chunk(2 * cp, dim=1)
    halves = [forward(torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=1)).chunk(2, dim=1) for r in range(cp)]
    return torch.cat([halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))], dim=1)


def _per_cp_rank(model: torch.nn.Module, cp: int) -> int:
    """Make every float8 linear of ``model`` see each CP rank's tokens on their own; how many."""
    wrapped = 0
    for module in model.modules():
        if type(module).__name__ in ("Float8Linear", "MXFP8Linear", "JudgeNVFP4Linear"):
            module.forward = functools.partial(_tokens_per_cp_rank, module.forward, cp)
            wrapped += 1
    return wrapped


def torchao_mxfp8(model: torch.nn.Module, skip: tuple[str, ...]) -> int:
    """Every linear of ``model`` not named in ``skip`` swapped for torchao's own ``MXFP8Linear``
    (emulated kernels), on the same weights; how many (every dim of the tiny models is a multiple of 32)."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    swapped = 0
    for fqn, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or fqn.rpartition(".")[2] in skip:
            continue
        new = MXFP8Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta",
                          kernel_preference=KernelPreference.EMULATED)
        new.weight, new.bias = module.weight, module.bias
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)
        swapped += 1
    return swapped


#: The judge's products' dtype (bfloat16, the recipe's; :func:`nvfp4_float32_products`).
_JUDGE_PRODUCT_DTYPE = [torch.bfloat16]


def nvfp4_round_to_nearest() -> contextlib.AbstractContextManager[None]:
    """Within it, the library's emulated NVFP4 rounds its gradients' casts to nearest, as the judge
    does (stochastic rounding draws each rank's noise for its own shard: no judge could match it)."""
    from torchtitan_spmd.techniques import quantization

    return quantization.pushed(quantization._STOCHASTIC_ROUNDING, False)


@contextlib.contextmanager
def nvfp4_float32_products() -> Iterator[None]:
    """Within it, the library's emulated NVFP4 and the judge keep their products in float32 (the
    recipe rounds them to bfloat16). Under tensor parallelism each rank rounds its part of a
    pending sum over tp, one process the whole sum: a bfloat16 step apart, which the next cast to
    NVFP4 can turn into an e2m1 step (measured at FSDP 2 x TP 2: 2.5e-2 on a gradient's norm with
    bfloat16 products, 5.2e-7 with float32 ones)."""
    from torchtitan_spmd.techniques import quantization

    with (quantization.pushed(quantization._PRODUCT_DTYPE, torch.float32),
          quantization.pushed(_JUDGE_PRODUCT_DTYPE, torch.float32)):
        yield


def _sylvester_rht(signs: tuple[int, ...]) -> torch.Tensor:
    """The 16 x 16 randomized Hadamard transform ``diag(signs) @ H / 4``, with ``H`` built by
    Sylvester's doubling (not torchao's table), in float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.diag(torch.tensor(signs, dtype=torch.float64)) @ h / 4.0


def _judge_e2m1(v: torch.Tensor) -> torch.Tensor:
    """``v`` (within +-6) to the nearest e2m1 value, a tie to the even code (the mantissa bit 0)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=v.dtype)
    dist = (v.abs().unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best
    odd_tie = ties.sum(-1) > 1  # two nearest: keep the even index
    index = torch.where(odd_tie, (ties * torch.arange(8)).amax(-1) // 2 * 2, dist.argmin(-1))
    return grid[index] * torch.sign(v)


def judge_nvfp4(t: torch.Tensor, tile_rows: int = 1) -> torch.Tensor:
    """``t`` (2-D, any float dtype) cast to NVFP4 with its own absolute max and back: blocks of
    ``tile_rows`` x 16 along the last dim (the weight's tiles of 16 x 16), each block's e4m3 scale
    and the elements' multiplier in float32 in the order torchao's Triton training kernels take
    (the encoding scale 448 x 6 / amax; a tie then rounds as theirs does), the elements rounded
    to e2m1 by :func:`_judge_e2m1`, the dequantised value in float64 with torchao's per-tensor
    decoding scale (amax / 2688)."""
    rows, cols = t.shape
    t32 = t.float()
    amax = t32.abs().max()
    one = torch.tensor(1.0)
    encode = torch.tensor(448.0 * 6.0) / amax  # tensor over tensor: a true division, as the kernel's
    decode = one / encode
    tiles = t32.reshape(rows // tile_rows, tile_rows, cols // 16, 16)
    block_max = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.clamp(block_max / 6.0 * encode, min=torch.finfo(torch.float8_e4m3fn).tiny, max=448.0)
    scale = scale.to(torch.float8_e4m3fn).float()
    codes = _judge_e2m1(torch.clamp(tiles * (one / (scale * decode)), -6.0, 6.0))
    return (codes.double() * scale.double() * (amax.double() / 2688.0)).reshape(rows, cols)


class JudgeNVFP4Matmul(torch.autograd.Function):
    """``x @ w.t()`` as the NVFP4 v1 recipe defines its three GEMMs, rounded to nearest (no stochastic
    rounding: a sharded run draws its own noise per shard), every operand first rounded to
    bfloat16, each product in float64 rounded to bfloat16: the input in rows of 16, the weight in
    tiles of 16 x 16 (its transpose the same), the output gradient in rows of 16 along the outputs,
    and for the weight gradient both operands transposed and Hadamard-transformed along the tokens,
    in rows of 16 there. Each cast's per-tensor scale is the whole operand's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        wq = judge_nvfp4(w.to(torch.bfloat16), tile_rows=16)
        ctx.save_for_backward(x2, wq)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        out = (judge_nvfp4(x2) @ wq.t()).to(_JUDGE_PRODUCT_DTYPE[-1])
        return out.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x2, wq = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1]).to(torch.bfloat16)
        grad_x = (judge_nvfp4(dy) @ wq).to(_JUDGE_PRODUCT_DTYPE[-1]).reshape(ctx.shape).to(ctx.dtype)
        from torchtitan_spmd.techniques.quantization import NVFP4_RHT_SIGNS

        rht = _sylvester_rht(NVFP4_RHT_SIGNS)

        def transformed(t: torch.Tensor) -> torch.Tensor:  # [tokens, f] -> [f, tokens], blocks of 16 transformed
            f, m = t.shape[1], t.shape[0]
            return (t.double().t().reshape(f, m // 16, 16) @ rht).reshape(f, m)

        grad_w = (judge_nvfp4(transformed(dy)) @ judge_nvfp4(transformed(x2)).t()).to(_JUDGE_PRODUCT_DTYPE[-1])
        return grad_x, grad_w.to(ctx.dtype)


class JudgeNVFP4Linear(torch.nn.Linear):
    """A linear whose matmuls are :class:`JudgeNVFP4Matmul` (the judge of the NVFP4 tests)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = JudgeNVFP4Matmul.apply(x, self.weight)
        return out if self.bias is None else out + self.bias


def judge_nvfp4_model(model: torch.nn.Module, skip: tuple[str, ...]) -> int:
    """Every linear of ``model`` not named in ``skip`` swapped for :class:`JudgeNVFP4Linear` on the same
    weights; how many."""
    swapped = 0
    for fqn, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or fqn.rpartition(".")[2] in skip:
            continue
        new = JudgeNVFP4Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        new.weight, new.bias = module.weight, module.bias
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)
        swapped += 1
    return swapped


def torchao_mxfp8_experts(model: torch.nn.Module) -> int:
    """Every grouped-experts module of ``model`` computing its three grouped GEMMs with torchao's own
    ``_quantize_then_scaled_grouped_mm`` (recipe ``mxfp8_emulated_rceil``, torchao padding each
    expert's group itself, products in bfloat16); how many."""
    import dataclasses

    import torch.nn.functional as F
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    config = dataclasses.replace(MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
                                 out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=True)

    def expert_outputs(experts: Any, x: torch.Tensor, counts: torch.Tensor, **_: Any) -> torch.Tensor:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _quantize_then_scaled_grouped_mm(a, w.transpose(-2, -1), config=config, offs=offs).to(a.dtype)

        return mm(F.silu(mm(x, experts.w1)) * mm(x, experts.w3), experts.w2)

    return _swap_expert_outputs(model, expert_outputs)


def _swap_expert_outputs(model: torch.nn.Module, expert_outputs: Any) -> int:
    """Every grouped-experts module of ``model`` computing ``expert_outputs(module, x, counts)``; how many."""
    swapped = 0
    for module in model.modules():
        if type(module).__name__ == "GroupedExperts":
            module.expert_outputs = functools.partial(expert_outputs, module)
            swapped += 1
    return swapped


class _Bfloat16Gradient(torch.autograd.Function):
    """The identity whose gradient is rounded to bfloat16: a grouped GEMM's operand, whose gradient
    the GEMM returns in its ``out_dtype`` (bfloat16, as torchao's ``_Float8GroupedMM``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(torch.bfloat16).to(grad.dtype)


def torchao_float8_matmul() -> Any:
    """``mm(x [T, K], w [N, K])``: torchao's own float8 linear matmul (``matmul_with_hp_or_float8_args``,
    recipe ``rowwise``, emulated) with the product and both gradients rounded to bfloat16: one
    expert's GEMM as torchao's float8 grouped GEMM computes it (the same rowwise casts along the
    contracted dim; the weight gradient's scaled per column over that expert's tokens)."""
    import torchao.float8 as f8
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    mm_config = Float8Linear.from_float(torch.nn.Linear(16, 16), config=config).linear_mm_config

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = matmul_with_hp_or_float8_args.apply(_Bfloat16Gradient.apply(x), _Bfloat16Gradient.apply(w).t(),
                                                  mm_config, config)
        return out.to(torch.bfloat16).to(x.dtype)

    return mm


def torchao_float8_experts(model: torch.nn.Module) -> int:
    """Every grouped-experts module of ``model`` looping over its experts, each expert's three GEMMs
    through :func:`torchao_float8_matmul` (torchao 0.18's float8 grouped GEMM is Triton only; its
    casts are those of torchao's float8 linear, per expert); how many."""
    mm = torchao_float8_matmul()

    def expert_outputs(experts: Any, x: torch.Tensor, counts: torch.Tensor, **_: Any) -> torch.Tensor:
        outs = [mm(F.silu(mm(rows, experts.w1[e])) * mm(rows, experts.w3[e]), experts.w2[e])
                for e, rows in enumerate(x.split(counts.tolist())) if rows.shape[0]]
        return torch.cat(outs) if outs else x.new_zeros(0, experts.w2.shape[1])

    return _swap_expert_outputs(model, expert_outputs)


@functools.cache
def torchao_reference(recipe: str, dp: int, steps: int = F8_STEPS, skip: tuple[str, ...] = (),
                      rows: int = LOCAL_BATCH, cp: int = 1, model_name: str = "llama3",
                      ) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[str, float], ...]]:
    """``((loss, grad_norm) per step, (name, step-1 gradient norm) per parameter)`` of torchao's own
    float8 model (emulated ``recipe``; ``"mxfp8"``: its ``MXFP8Linear``, emulated) on the parity job's data over ``dp`` data-parallel ranks;
    the linears whose name is in ``skip`` stay in high precision. ``rows``: the rows of one
    forward (a pipeline's microbatch: its own scales). ``cp``: each linear sees each of ``cp``
    context-parallel ranks' tokens on their own (headtail load balancing). ``model_name``: a
    family of :data:`MODELS` (``qwen3``: the tiny MoE, routed round-robin, so its expert biases
    never move: every expert gets the same tokens)."""
    from torchtitan_spmd import reference
    from torchtitan_spmd.data import build_tokenizer
    from torchtitan_spmd.models import get_model_spec

    cfg = float8_job("default", [], parallelism={"data_parallel_shard_degree": 1}, steps=steps, model=model_name)
    seed, vocab = cfg.debug.seed, build_tokenizer(None).model_vocab_size
    model = get_model_spec(model_name).build_initialized(cfg.model.flavor, seed=seed, vocab_size=vocab,
                                                         max_seq_len=cfg.training.seq_len)
    want = MODELS[model_name][1] - sum(2 if s in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") else 1 for s in skip)
    if recipe in ("mxfp8_experts", "float8_experts"):  # the tiny MoE's two blocks' experts; no linear
        judge = torchao_mxfp8_experts if recipe == "mxfp8_experts" else torchao_float8_experts
        assert judge(model) == 2, "the tiny MoE's two blocks' experts"
        want = 0
    elif recipe == "mxfp8":
        torchao_mxfp8(model, skip)
    elif recipe == "nvfp4":
        judge_nvfp4_model(model, skip)
    else:
        import torchao.float8 as f8

        config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        f8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: (
            m.in_features % 16 == 0 and m.out_features % 16 == 0 and fqn.rpartition(".")[2] not in skip))
    n_float8 = sum(type(m).__name__ in ("Float8Linear", "MXFP8Linear", "JudgeNVFP4Linear") for m in model.modules())
    routers = [m for m in model.modules() if hasattr(m, "force_load_balance")]
    assert len(routers) == MODELS[model_name][2], routers
    for router in routers:
        router.force_load_balance = True
    assert n_float8 == want, f"torchao converted {n_float8} linears, expected {want}"
    if cp > 1:
        assert _per_cp_rank(model, cp) == n_float8
    opt_cfg = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay,
                            betas=reference.ADAMW_BETAS, foreach=False)
    records, grad_norms = [], ()
    batches = reference.global_batches(cfg, dp * LOCAL_BATCH, seed)
    for step, (tokens, labels) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = opt_cfg.lr * reference.lr_factor(
                step, warmup_steps=cfg.lr_scheduler.warmup_steps, total_steps=steps,
                min_lr_factor=cfg.lr_scheduler.min_lr_factor, decay_ratio=cfg.lr_scheduler.decay_ratio,
                decay_type=cfg.lr_scheduler.decay_type)
        total = torch.zeros(())
        for r in range(dp * LOCAL_BATCH // rows):  # each rank's rows (microbatch): own forward, own scales
            chunk = slice(r * rows, (r + 1) * rows)
            logits = model(tokens[chunk])
            total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[chunk].reshape(-1),
                                            reduction="sum")
        loss = total / labels.numel()
        loss.backward()
        if step == 0:
            grad_norms = tuple((n, float(p.grad.norm())) for n, p in model.named_parameters())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg.training.max_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        records.append((float(loss.detach()), float(norm)))
    return tuple(records), grad_norms


#: The casts of one float8 linear's forward and backward: 2 + 4.
CASTS_PER_LINEAR = 6


def _recording(calls: list[tuple[str, list[float], tuple[int, ...]]], limit: int, real: Any) -> Any:
    def hp_tensor_and_scale_to_float8(hp_tensor: torch.Tensor, s: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if len(calls) < limit:
            role = args[2] if len(args) > 2 else kwargs.get("gemm_input_role")
            scale = s.to_local() if hasattr(s, "to_local") else s
            calls.append((str(role), [float(v) for v in scale.reshape(-1)], tuple(scale.shape)))
        return real(hp_tensor, s, *args, **kwargs)

    return hp_tensor_and_scale_to_float8


def scale_probe(trainer: Any) -> dict[str, Any]:
    """Every float8 cast's scale (role, values, local shape) of this rank's first forward and backward."""
    import torchao.float8.float8_training_tensor as tt

    n_linears = sum(type(m).__name__.endswith("Float8Linear") for m in trainer.model.modules())
    calls: list[tuple[str, list[float], tuple[int, ...]]] = []
    tt.hp_tensor_and_scale_to_float8 = _recording(calls, CASTS_PER_LINEAR * n_linears, tt.hp_tensor_and_scale_to_float8)
    return {"result": lambda: {"calls": calls, "tp_rank": trainer.parallel_dims.get_mesh("tp").get_local_rank()}}


def torchao_scales(recipe: str) -> list[tuple[str, list[float], tuple[int, ...]]]:
    """The same casts of torchao's single-process model: data-parallel rank 0's rows of step 1."""
    import torchao.float8 as f8
    import torchao.float8.float8_scaling_utils as su

    from torchtitan_spmd import reference
    from torchtitan_spmd.data import build_tokenizer
    from torchtitan_spmd.models import get_model_spec

    cfg = float8_job("default", [], parallelism={"data_parallel_shard_degree": 1}, steps=1)
    seed, vocab = cfg.debug.seed, build_tokenizer(None).model_vocab_size
    model = get_model_spec("llama3").build_initialized(cfg.model.flavor, seed=seed, vocab_size=vocab,
                                                       max_seq_len=cfg.training.seq_len)
    config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    f8.convert_to_float8_training(model, config=config)
    calls: list[tuple[str, list[float], tuple[int, ...]]] = []
    real = su.hp_tensor_and_scale_to_float8
    su.hp_tensor_and_scale_to_float8 = _recording(calls, 10**6, real)
    try:
        tokens, labels = reference.global_batches(cfg, 2 * LOCAL_BATCH, seed)[0]
        logits = model(tokens[:LOCAL_BATCH])
        # the rank's share of the global mean: its token sum over the global batch's tokens
        (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:LOCAL_BATCH].reshape(-1), reduction="sum")
         / labels.numel()).backward()
    finally:
        su.hp_tensor_and_scale_to_float8 = real
    return calls


def lora_probe(trainer: Any) -> dict[str, Any]:
    """After the steps: the Hugging Face export (the last, model-only save), every parameter's full
    value (rank 0), which parameters hold optimizer state, and which require gradients."""

    def result() -> dict[str, Any] | None:
        from torchtitan_spmd.distributed.apply_plan import plain_fqn

        steps = trainer.job_config.training.steps
        trainer.checkpointer.save(steps, last_step=True)
        trainer.checkpointer.wait()
        full = {k: v.full_tensor() for k, v in trainer.checkpointer._model_state().items()}
        names = {id(p): plain_fqn(n) for n, p in trainer.model.named_parameters()}
        with_state = sorted(names[id(p)] for p, s in trainer.optimizer.state.items() if s)
        trainable = sorted(plain_fqn(n) for n, p in trainer.model.named_parameters() if p.requires_grad)
        # every rank: under PP each holds its stages' parameters (the test merges them)
        return {"weights": {k: v.detach().tolist() for k, v in full.items()}, "with_state": with_state,
                "trainable": trainable}

    return {"result": result}


#: transformers' names of the LoRA targets of :data:`LORA` (``wkv``: ``wk`` and ``wv``).
_PEFT_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}


@functools.cache
def peft_reference(steps: int = F8_STEPS) -> tuple[tuple[tuple[str, float], ...], dict[str, tuple[Any, ...]]]:
    """``peft``'s LoRA on transformers' ``LlamaForCausalLM`` (the tiny model's initial weights
    through the family's Hugging Face names), trained single-process on the parity job's global
    batches with ``torch.optim.AdamW`` on the adapters alone: ``((adapter, step-1 gradient norm),
    ...)`` and the trained adapters ``{our name: values}`` (transformers' row order of ``wq``/``wk``
    mapped back). The adapters start from the LoRA model's ``lora_a`` (its initialisation) and
    zeros, as ours; nothing else is shared with the library's LoRA."""
    import peft
    import transformers

    from torchtitan_spmd import reference
    from torchtitan_spmd.models import get_model_spec
    from torchtitan_spmd.techniques.converters import build_converters, convert_model

    cfg = float8_job("default", [LORA], steps=steps)
    spec, seed, vocab = get_model_spec("llama3"), cfg.debug.seed, 320
    ours = spec.build_initialized(cfg.model.flavor, seed=seed, vocab_size=vocab, max_seq_len=cfg.training.seq_len)
    base = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    convert_model(ours, build_converters([LORA]))
    adapter = spec.state_dict_adapter(spec.model_config(cfg.model.flavor, vocab_size=vocab,
                                                        max_seq_len=cfg.training.seq_len))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(adapter.hf_config("float32")))
    hf.load_state_dict(adapter.to_hf(base), strict=True)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0,
                                                    target_modules=list(_PEFT_TARGETS.values()), bias="none"))
    names: dict[str, Any] = {}  # our adapter name -> peft's module (lora_A / lora_B)
    for fqn, module in ours.named_modules():
        leaf = fqn.rpartition(".")[2]
        if leaf not in _PEFT_TARGETS:
            continue
        layer = fqn.split(".")[1]
        target = model.base_model.model.model.layers[int(layer)].self_attn.get_submodule(_PEFT_TARGETS[leaf])
        names[f"{fqn}.lora_a"], names[f"{fqn}.lora_b"] = target.lora_A["default"], target.lora_B["default"]
        with torch.no_grad():
            target.lora_A["default"].weight.copy_(ours.initial_value(f"{fqn}.lora_a", tuple(module.lora_a.shape), seed))
            target.lora_B["default"].weight.zero_()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(names) == 16, (len(trainable), len(names))
    opt_cfg = cfg.optimizer
    opt = torch.optim.AdamW(trainable, lr=opt_cfg.lr, eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay,
                            betas=reference.ADAMW_BETAS, foreach=False)
    grad_norms: tuple[tuple[str, float], ...] = ()
    for step, (tokens, labels) in enumerate(reference.global_batches(cfg, 2 * LOCAL_BATCH, seed)):
        for group in opt.param_groups:
            group["lr"] = opt_cfg.lr * reference.lr_factor(
                step, warmup_steps=cfg.lr_scheduler.warmup_steps, total_steps=steps,
                min_lr_factor=cfg.lr_scheduler.min_lr_factor, decay_ratio=cfg.lr_scheduler.decay_ratio,
                decay_type=cfg.lr_scheduler.decay_type)
        logits = model(input_ids=tokens).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
        if step == 0:
            grad_norms = tuple((n, float(m.weight.grad.norm())) for n, m in names.items())
        torch.nn.utils.clip_grad_norm_(trainable, float(cfg.training.max_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    trained = {}
    for name, module in names.items():
        value = module.weight.detach()
        if name.endswith("lora_b"):  # transformers' rows of wq and wk -> ours (the family's permutation)
            rows = adapter.hf_rows(name.replace(".lora_b", ".weight"), value.shape[0])
            if rows is not None:
                value = value[torch.argsort(rows)]
        trained[name] = tuple(value.reshape(-1).tolist())
    return grad_norms, trained


#: The last part of the name of every linear of the tiny Llama (an MXFP8 converter's ``fqns``).
MXFP8_NAMES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")

#: Relative tolerance of the sharded float8 run against torchao's single-process model: the scales
#: are the same, so only float32 summation order differs (measured 1e-7 .. 7e-7).
F8_TOL = 1e-5

#: Relative tolerance of the MXFP8 cells after step 1 (step 1, every tensor's gradient included, is
#: held to :data:`F8_TOL`): float8's own noise, measured. A value within float32's rounding of an
#: e4m3 rounding boundary flips by an e4m3 step when the summation order changes, and AdamW carries
#: the flip on. torchao's own model with its weights perturbed by 1e-6 (relative) moves step 2's
#: gradient norm by 6.1e-4 and step 3's by 2.7e-4, in both formats. The MXFP8 cell (``wk`` and ``wv``
#: in high precision: tp 2 would split their blocks) lands at 5.8e-5 and 4.7e-4; so does the float8
#: run of the same cell, to the last digit (power-of-two scales make both formats round to e4m3's
#: mantissa alike), so the gap is the cell's summation order, not the format. Step 1, where no
#: flip has been carried, matches to 5e-7 per tensor.
MX_LATER_TOL = 1e-3

#: Relative tolerance of the NVFP4 cells at step 1 (every tensor's gradient norm): float32's summation
#: order moved across one e2m1 rounding boundary. The judge's model with its weights perturbed by
#: 1e-7 moves one tensor's step-1 gradient norm by 4.2e-5 with four data-parallel ranks' rows (0 with
#: two); the cells measure 1.9e-7 .. 6.2e-6 on this machine, where another CPU's float32 matmul may
#: sum in another order. A shard-local amax misses by 3.7e-2.
NV_STEP1_TOL = 2e-4

#: Relative tolerance of the NVFP4 cells after step 1 (step 1, every tensor's gradient included, is
#: held to :data:`NV_STEP1_TOL`): NVFP4's own noise, measured. An element within float32's rounding of an
#: e2m1 rounding boundary moves by an e2m1 step (a sixth to a third of its block's largest) when the
#: summation order changes, and AdamW carries it on: the judge's model with its weights perturbed by
#: 1e-6 (relative) moves step 2's gradient norm by 9.0e-4 and step 3's by 2.7e-3 at FSDP 2, by
#: 3.6e-3 and 1.2e-2 with each of two CP ranks' tokens on their own.
NV_LATER_TOL = 2e-2

#: Relative tolerance of the MXFP8 experts' cells whose experts are sharded (tensor or expert
#: parallelism), every tensor's gradient included; unsharded (FSDP 4) they are held to :data:`F8_TOL`
#: (measured 1.1e-6). The emulated grouped GEMMs return bfloat16 (torchao, as on the GPU):
#: - TP: each rank's ``w2`` product is a partial sum over the hidden dim, rounded to bfloat16 before
#:   the sum over tp, where the judge rounds the whole sum once: 2^-9 relative per element at most;
#:   measured 8.9e-4 (the router's gate);
#: - EP: an expert's tokens from two ranks share blocks of 32 along the tokens in the weight
#:   gradient (the judge blocks each rank's tokens apart): other scales, other underflows to
#:   zero; measured 1.2e-4.
#: The experts left in high precision (the plant) miss by 8.5e-3 to 1.4e-2 in every cell.
MX_EXPERTS_SHARDED_TOL = 2e-3

#: The LoRA of the tests: rank 4 on upstream's recipe's targets (``wkv``: ``wk`` and ``wv``).
LORA = LoRAConverterConfig(rank=4, alpha=16.0, target_modules=["wq", "wkv", "wo"])


def check_float8_parity(cell: str, backend: str, skip: tuple[str, ...], parallelism: dict[str, Any] | None = None,
                        rows: int = LOCAL_BATCH, ac: str = "none", model: str = "llama3", recipe: str = "rowwise",
                        tol: float = F8_TOL, **debug: Any) -> None:
    """FSDP 2 x TP 2, float8 rowwise emulated, 3 steps, against torchao's own ``Float8Linear`` model
    on one process: each step's loss and gradient norm, and every parameter's step-1 gradient norm.
    The scales a sharded matmul uses are the unsharded ones (reduced over tp where the recipe's
    axis is sharded), so only float32's summation order differs. ``model="qwen3"``: the tiny MoE,
    whose dense linears are float8 and whose experts stay in high precision (with EP: exchanged).
    ``recipe="mxfp8"``: MXFP8 (emulated) instead, its converter naming every linear but ``skip``,
    against torchao's own ``MXFP8Linear`` model; ``"mxfp8_experts"``: the MoE's experts in MXFP8
    (emulated), against the MoE whose experts call torchao's grouped GEMM (:func:`torchao_reference`);
    ``"float8_experts"``: the experts in float8 rowwise (emulated), against the MoE whose experts
    loop over torchao's float8 linear matmul (:func:`torchao_float8_experts`).
    ``"nvfp4"``: every linear but ``skip`` in NVFP4 (emulated), against the judge's model
    (:class:`JudgeNVFP4Linear`), both rounding to nearest in float32 products (:func:`nvfp4_float32_products`).
    After step 1 an MXFP8 run is held to ``MX_LATER_TOL`` at least, an NVFP4 run to
    ``NV_LATER_TOL``; ``tol`` holds the rest."""
    if backend == "full_dtensor":
        from parity_helpers import skip_full_dtensor_on_old_torch

        skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    converter = {"rowwise": Float8LinearConverterConfig(emulate=True, filter_fqns=list(skip)),
                 "mxfp8": MXFP8LinearConverterConfig(emulate=True, fqns=[n for n in MXFP8_NAMES if n not in skip]),
                 "mxfp8_experts": MXFP8GroupedExpertsConverterConfig(emulate=True),
                 "float8_experts": Float8GroupedExpertsConverterConfig(emulate=True),
                 "nvfp4": NVFP4LinearConverterConfig(emulate=True, fqns=[n for n in MXFP8_NAMES if n not in skip])}[recipe]
    cfg = float8_job(backend, [converter], parallelism=parallelism, ac=ac, model=model, **debug)
    degrees = parallelism or PARALLELISM
    dp = degrees.get("data_parallel_replicate_degree", 1) * degrees.get("data_parallel_shard_degree", 1)
    # NVFP4: both sides round to nearest in float32 products (see nvfp4_float32_products)
    with nvfp4_round_to_nearest(), nvfp4_float32_products() if recipe == "nvfp4" else contextlib.nullcontext():
        outs, trace = run_trainer(cfg)  # the forked ranks inherit both
        ref, ref_norms = torchao_reference(recipe, dp, skip=skip, rows=rows,
                                          cp=degrees.get("context_parallel_degree", 1), model_name=model)
    got = outs[0]["records"]
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, ref, strict=True), 1):
        rel = tol if step == 1 or recipe == "rowwise" else max(tol, NV_LATER_TOL if recipe == "nvfp4" else MX_LATER_TOL)
        assert loss == pytest.approx(want_loss, rel=rel), (cell, step, got, ref)
        assert norm == pytest.approx(want_norm, rel=rel), (cell, step, got, ref)
    want = dict(ref_norms)
    assert set(trace.grad_norms) == set(want)
    worst = max(abs(v - want[k]) / want[k] for k, v in trace.grad_norms.items())
    print(f"\n{cell}: loss {got[-1][0]:.6f} vs torchao {ref[-1][0]:.6f}; per-tensor grad norms max rel {worst:.1e}")
    for name, value in trace.grad_norms.items():
        assert value == pytest.approx(want[name], rel=tol), (cell, name, value, want[name])


def check_lora(tmp_path: Any, backend: str, *, float8: bool = False, parallelism: dict[str, Any] | None = None,
               quant: Any = None, **debug: Any) -> None:
    """LoRA (rank 4 on wq, wk, wv, wo; after float8 emulated with ``float8=True``, as upstream's
    ``llama3_debugmodel_float8_emulate_lora``, or after the quantization converter ``quant``) at
    FSDP 2 x TP 2, 3 steps, then the Hugging Face
    export: the frozen base is bit-identical to its initial weights, every adapter moved, only the
    adapters hold optimizer state, and transformers' logits of the merged export equal the LoRA
    model's (in high precision: the export holds the weights, not float8)."""
    from parity_helpers import skip_full_dtensor_on_old_torch
    from transformers import AutoModelForCausalLM

    from torchtitan_spmd.reference import initial_weights
    from torchtitan_spmd.techniques.converters import build_converters, convert_model

    if backend == "full_dtensor":
        skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    if float8:
        quant = Float8LinearConverterConfig(emulate=True)
    converters = [LORA] if quant is None else [quant, LORA]
    cfg = float8_job(backend, converters, parallelism=parallelism, **debug)
    cfg.job.dump_folder = str(tmp_path)
    cfg.checkpoint.enable, cfg.checkpoint.interval = True, 1000
    cfg.checkpoint.last_save_in_hf, cfg.checkpoint.export_dtype = True, "float32"
    cfg.validate()
    outs, trace = run_trainer(cfg, probe="float8_helpers:lora_probe")
    probe: dict[str, Any] = {"weights": {}, "with_state": set(), "trainable": set()}
    for out in outs:  # the ranks' parameters merged (one stage each under PP; all of them otherwise)
        probe["weights"].update(out["probe"]["weights"])
        for what in ("with_state", "trainable"):
            probe[what].update(out["probe"][what])
    probe["with_state"], probe["trainable"] = sorted(probe["with_state"]), sorted(probe["trainable"])
    weights = {k: torch.tensor(v) for k, v in probe["weights"].items()}
    adapters = sorted(k for k in weights if k.endswith(("lora_a", "lora_b")))
    assert len(adapters) == 2 * 4 * 2  # 2 blocks x (wq, wk, wv, wo) x (a, b)
    for what in ("trainable", "with_state"):  # the frozen base: no gradient, no optimizer state
        extra = sorted(set(probe[what]) - set(adapters))
        assert probe[what] == adapters, f"{what}: {len(extra)} beyond the adapters, e.g. {extra[:2]}"
    start = initial_weights("llama3", "tiny", cfg.debug.seed, 320)
    assert set(start) <= set(weights), f"no rank reported {sorted(set(start) - set(weights))[:3]}"
    for name, value in start.items():
        if name in weights:
            assert torch.equal(weights[name], value), f"the frozen {name} moved"
    for name in adapters:
        assert not torch.equal(weights[name], torch.zeros_like(weights[name])) and weights[name].abs().sum() > 0
    if quant is None:  # against peft's LoRA on transformers' model: the step-1 gradients and the trained adapters
        pytest.importorskip("peft", reason="the LoRA parity judge is peft (dev extra)")
        peft_norms, peft_trained = peft_reference()
        for name, want in peft_norms:
            assert trace.grad_norms[name] == pytest.approx(want, rel=F8_TOL), (backend, name, trace.grad_norms[name], want)
        worst = 0.0  # each adapter's largest difference against its largest value: AdamW divides by
        # sqrt(v), so an element whose gradient is near zero moves by the ratio of two float32 roundings
        for name, values in peft_trained.items():
            want_t = torch.tensor(values).reshape(weights[name].shape)
            gap = float((weights[name] - want_t).abs().max() / want_t.abs().max())
            worst = max(worst, gap)
            assert gap < 2e-4, (backend, name, gap)
        print(f"\n{backend}: LoRA vs peft after {F8_STEPS} steps: adapters max rel {worst:.1e}")
    # the LoRA model (unmerged, one process) against transformers on the merged export
    from torchtitan_spmd.models import get_model_spec

    ours = get_model_spec("llama3").build_initialized("tiny", seed=0)
    convert_model(ours, build_converters([LORA]))
    ours.load_state_dict(weights)
    export = next(p.parent for p in tmp_path.rglob("config.json"))
    hf = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    base = get_model_spec("llama3").build_initialized("tiny", seed=0)
    base.load_state_dict({k: v for k, v in weights.items() if k in start})
    with torch.no_grad():
        theirs = hf(tokens).logits
        gap, adapters_gap = (theirs - ours(tokens)).abs().max().item(), (theirs - base(tokens)).abs().max().item()
    print(f"\n{backend}: merged export vs the LoRA model: max |logit| gap {gap:.1e}; without the adapters "
          f"{adapters_gap:.1e}")
    assert gap < 1e-4 < 1e-2 < adapters_gap, (gap, adapters_gap)

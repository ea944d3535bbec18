"""Model converters on this CPU: loss curves, step time and LoRA's optimizer memory (docs/converters.md).

    PYTHONPATH=. python bench/converters_bench.py curves --flavor tiny --steps 50
    PYTHONPATH=. python bench/converters_bench.py curves --flavor debugmodel --configs fp32 mxfp8
    PYTHONPATH=. python bench/converters_bench.py curves --model qwen3 --flavor moe_tiny --configs fp32 float8_experts float8_moe
    PYTHONPATH=. python bench/converters_bench.py curves --flavor tiny --configs fp32 nvfp4 lora nvfp4_lora
    PYTHONPATH=. python bench/converters_bench.py time --flavor debugmodel --steps 8
    PYTHONPATH=. python bench/converters_bench.py memory --flavor debugmodel
    PYTHONPATH=. python bench/converters_bench.py gpu [--dim 4096 --tokens 8192 --layers 4]

``curves``: FSDP 2 x TP 2 (4 forked gloo ranks), fp32, float8 rowwise emulated, LoRA (rank 8 on wq,
wk, wv, wo) and float8 + LoRA, under each backend; prints each run's losses and the largest
relative loss gap after step 10 of float8 (and MXFP8, emulated: ``--configs`` picks the runs; the
tiny model's ``wk``/``wv`` are too narrow for MXFP8 under tp 2, so MXFP8 curves use the debug model)
against fp32 and of float8 + LoRA against LoRA; on an MoE (``--model qwen3 --flavor moe_tiny``)
the experts in float8 (``float8_experts``) and the experts and dense linears (``float8_moe``);
NVFP4 emulated (``nvfp4``, with stochastic rounding: the recipe) against fp32 and NVFP4 + LoRA
(``nvfp4_lora``) against LoRA.
``time``: the mean step time (steps 3..N) of fp32, float8, MXFP8 and NVFP4 emulated, side by side
in one process tree (``default``). ``memory``: the AdamW state bytes of LoRA against full fine-tuning (two fp32
moments per trainable parameter), from the model built on the meta device.
``gpu`` (the probe for a lent GPU, SM89+; ``--emulate`` runs it anywhere, small): one process, a stack
of bf16 linears, torchao's own ``Float8Linear`` (rowwise, real ``_scaled_mm``) against the
library's (``Float8LinearConverter``, the operand-by-operand matmul): the largest output and weight
gradient difference (the same casts: expected 0), and eager forward + backward times of bf16,
torchao's float8 and the library's float8. On an SM100+ GPU (or emulated) the same for MXFP8:
torchao's ``MXFP8Linear`` against the library's (``MXFP8LinearConverter``). Then 8 grouped experts
in float8 (``Float8GroupedExpertsConverter``): on the GPU against torchao's own
``_to_fp8_rowwise_then_scaled_grouped_mm``, and their times against high precision. On an SM100+
GPU, NVFP4: the library's emulated forward against torchao's ``nvfp4_mm_triton`` on the same
weights (the emulation's fidelity to the GPU's kernels: the output's largest difference relative
to its largest value, expected 0 but for ties e2m1 rounds apart), and the kernels' time.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.config.converters import (
    Float8GroupedExpertsConverterConfig,
    Float8LinearConverterConfig,
    LoRAConverterConfig,
    MXFP8LinearConverterConfig,
    NVFP4LinearConverterConfig,
)
from torchtitan_spmd.launcher import run_forked

FLOAT8 = Float8LinearConverterConfig(emulate=True)
FLOAT8_EXPERTS = Float8GroupedExpertsConverterConfig(emulate=True)
LORA = LoRAConverterConfig(rank=8, alpha=16.0, target_modules=["wq", "wkv", "wo"])
MXFP8 = MXFP8LinearConverterConfig(emulate=True)
NVFP4 = NVFP4LinearConverterConfig(emulate=True)
CONFIGS: dict[str, list[Any]] = {"fp32": [], "float8": [FLOAT8], "lora": [LORA], "float8_lora": [FLOAT8, LORA],
                                 "mxfp8": [MXFP8], "float8_experts": [FLOAT8_EXPERTS],
                                 "float8_moe": [FLOAT8, FLOAT8_EXPERTS], "nvfp4": [NVFP4],
                                 "nvfp4_lora": [NVFP4, LORA]}
#: The small flavours (local batch 2 x 32 tokens, lr 3e-3); the others: 4 x 256, lr 8e-4.
SMALL = ("tiny", "moe_tiny")


def job(backend: str, flavor: str, steps: int, converters: list[Any], model: str = "llama3") -> JobConfig:
    small = flavor in SMALL
    cfg = JobConfig.from_dict({
        "model": {"name": model, "flavor": flavor},
        "training": {"steps": steps, "local_batch_size": 2 if small else 4,
                     "seq_len": 32 if small else 256, "mixed_precision_param": "float32",
                     "max_norm": 1.0},
        "activation_checkpoint": {"mode": "none"},
        "optimizer": {"lr": 3e-3 if small else 8e-4},
        "lr_scheduler": {"warmup_steps": 2},
        "parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, "spmd_backend": backend},
        "debug": {"seed": 0},
    })
    cfg.model.converters = list(converters)
    cfg.validate()
    return cfg


def _run(rank: int, world: int, cfg: JobConfig) -> dict[str, list[float]]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    losses, times = [], []
    for step in range(1, cfg.training.steps + 1):
        start = time.perf_counter()
        losses.append(trainer.step(step).loss)
        times.append(time.perf_counter() - start)
    trainer.close()
    return {"losses": losses, "times": times}


def gap(a: list[float], b: list[float], after: int = 10) -> float:
    return max(abs(x - y) / abs(y) for x, y in list(zip(a, b, strict=True))[after:])


#: (run, its baseline) pairs whose loss gap ``curves`` prints, where both ran.
GAPS = (("float8", "fp32"), ("mxfp8", "fp32"), ("float8_lora", "lora"), ("float8_experts", "fp32"),
        ("float8_moe", "fp32"), ("nvfp4", "fp32"), ("nvfp4_lora", "lora"))


def curves(flavor: str, steps: int, backends: list[str], configs: list[str], model: str = "llama3") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend in backends:
        runs = {name: run_forked(_run, 4, job(backend, flavor, steps, CONFIGS[name], model), timeout_s=1800)[0]["losses"]
                for name in configs}
        out[backend] = {"losses": runs, **{f"{a}_vs_{b}": gap(runs[a], runs[b]) for a, b in GAPS
                                           if a in runs and b in runs}}
        print(json.dumps({backend: {k: v for k, v in out[backend].items() if k != "losses"},
                          "last": {k: v[-1] for k, v in runs.items()}}), flush=True)
    return out


def step_time(flavor: str, steps: int) -> dict[str, float]:
    out = {}
    for name in ("fp32", "float8", "mxfp8", "nvfp4"):
        times = run_forked(_run, 4, job("default", flavor, steps, CONFIGS[name]), timeout_s=1800)[0]["times"]
        out[name] = sum(times[2:]) / len(times[2:])
    print(json.dumps(out))
    return out


def memory(flavor: str) -> dict[str, int]:
    import torch

    from torchtitan_spmd.models import get_model_spec
    from torchtitan_spmd.techniques.converters import build_converters, convert_model

    spec = get_model_spec("llama3")
    out = {}
    for name, conv in (("full", []), ("lora", [LORA])):
        with torch.device("meta"):
            model = spec.build(spec.model_config(flavor))
        convert_model(model, build_converters(conv))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out[f"{name}_trainable_params"] = trainable
        out[f"{name}_adamw_state_bytes"] = 2 * 4 * trainable
    print(json.dumps(out))
    return out


def gpu_probe(dim: int, tokens: int, layers: int, emulate: bool, iters: int = 20) -> dict[str, Any]:
    import copy
    import dataclasses

    import torch
    import torchao.float8 as f8
    from torch import nn

    from torchtitan_spmd.techniques.converters import build_converters, convert_model
    from torchtitan_spmd.techniques.quantization import has_cuda_capability

    if not emulate and not has_cuda_capability(8, 9):
        raise SystemExit("converters_bench.py gpu: needs an SM89+ CUDA GPU (or --emulate).")
    device = "cuda" if torch.cuda.is_available() and not emulate else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)]).to(device, dtype)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    convert_model(ours, build_converters([Float8LinearConverterConfig(emulate=emulate)]))
    f8.convert_to_float8_training(theirs, config=dataclasses.replace(
        f8.Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate))
    x = torch.randn(tokens, dim, device=device, dtype=dtype)

    def step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in model.parameters():
            p.grad = None
        out = model(x)
        out.float().square().mean().backward()
        return out.detach(), [p.grad for p in model.parameters()]

    (o1, g1), (o2, g2) = step(ours), step(theirs)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (emulated)",
        "torch": torch.__version__, "torchao": getattr(__import__("torchao"), "__version__", "?"),
        "output_max_abs_diff": float((o1.float() - o2.float()).abs().max()),
        "weight_grad_max_abs_diff": max(float((a.float() - b.float()).abs().max()) for a, b in zip(g1, g2, strict=True)),
    }
    for name, model in (("bf16" if dtype == torch.bfloat16 else "fp32", base), ("torchao_float8", theirs),
                        ("library_float8", ours)):
        for _ in range(3):
            step(model)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            step(model)
        if device == "cuda":
            torch.cuda.synchronize()
        result[f"{name}_ms"] = 1e3 * (time.perf_counter() - start) / iters
    if emulate or has_cuda_capability(10, 0):
        result.update(_mxfp8_probe(base, x, step, emulate, iters, device == "cuda"))
    result.update(_float8_experts_probe(dim, tokens, emulate, iters, device, dtype))
    if device == "cuda" and has_cuda_capability(10, 0):
        result.update(_nvfp4_probe(base, x, step, iters))
    print(json.dumps(result))
    return result


def _nvfp4_probe(base: Any, x: Any, step: Any, iters: int) -> dict[str, Any]:
    """The library's NVFP4 on torchao's kernels (``NVFP4LinearConverter``) against its emulation on the
    GPU, the same weights: the forward's largest difference relative to its largest value (both
    round to nearest there), and eager forward + backward times of the kernels."""
    import copy

    import torch

    from torchtitan_spmd.techniques.converters import build_converters, convert_model

    kernels, emulated = copy.deepcopy(base), copy.deepcopy(base)
    convert_model(kernels, build_converters([NVFP4LinearConverterConfig(model_compile_enabled=True)]))
    convert_model(emulated, build_converters([NVFP4LinearConverterConfig(emulate=True)]))
    with torch.no_grad():
        o1, o2 = kernels(x), emulated(x)
    out: dict[str, Any] = {"nvfp4_forward_max_rel_diff_vs_emulated": float((o1.float() - o2.float()).abs().max()
                                                                           / o2.float().abs().max())}
    for _ in range(3):
        step(kernels)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step(kernels)
    torch.cuda.synchronize()
    out["library_nvfp4_ms"] = 1e3 * (time.perf_counter() - start) / iters
    return out


def _mxfp8_probe(base: Any, x: Any, step: Any, emulate: bool, iters: int, cuda: bool) -> dict[str, Any]:
    """torchao's ``MXFP8Linear`` stack against the library's (``MXFP8LinearConverter``) on ``base``'s
    weights: the largest output and weight-gradient difference (the same kernels: expected 0), and
    eager forward + backward times."""
    import copy

    import torch
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    from torchtitan_spmd.techniques.converters import build_converters, convert_model

    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    convert_model(ours, build_converters([MXFP8LinearConverterConfig(emulate=emulate)]))
    preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
    for i, linear in enumerate(base):
        new = MXFP8Linear(linear.in_features, linear.out_features, bias=False, device="meta",
                          kernel_preference=preference)
        new.weight = theirs[i].weight
        theirs[i] = new
    (o1, g1), (o2, g2) = step(ours), step(theirs)
    out: dict[str, Any] = {
        "mxfp8_output_max_abs_diff": float((o1.float() - o2.float()).abs().max()),
        "mxfp8_weight_grad_max_abs_diff": max(float((a.float() - b.float()).abs().max())
                                              for a, b in zip(g1, g2, strict=True)),
    }
    for name, model in (("torchao_mxfp8", theirs), ("library_mxfp8", ours)):
        for _ in range(3):
            step(model)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            step(model)
        if cuda:
            torch.cuda.synchronize()
        out[f"{name}_ms"] = 1e3 * (time.perf_counter() - start) / iters
    return out


def _float8_experts_probe(dim: int, tokens: int, emulate: bool, iters: int, device: str, dtype: Any,
                          experts: int = 8) -> dict[str, Any]:
    """8 experts (hidden dim = ``dim``), ``tokens`` rows split evenly, in float8 rowwise through the
    library's ``Float8GroupedExpertsConverter``; on the GPU against torchao's own
    ``_to_fp8_rowwise_then_scaled_grouped_mm`` on the same weights (the same kernels: expected 0),
    and eager forward + backward times of both and of high precision."""
    import copy

    import torch
    import torch.nn.functional as F

    from torchtitan_spmd.models.moe import GroupedExperts
    from torchtitan_spmd.techniques.converters import build_converters, convert_model

    torch.manual_seed(0)
    base = GroupedExperts(dim, dim, experts).to(device)
    with torch.no_grad():
        for w in (base.w1, base.w2, base.w3):
            w.copy_(torch.randn_like(w) * dim ** -0.5)
    base = base.to(dtype)
    ours = copy.deepcopy(base)
    convert_model(ours, build_converters([Float8GroupedExpertsConverterConfig(emulate=emulate)]))
    counts = torch.full((experts,), tokens // experts, device=device, dtype=torch.long)
    x = torch.randn(int(counts.sum()), dim, device=device, dtype=dtype)

    def step(run: Any, params: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        out = run()
        out.float().square().mean().backward()
        return out.detach(), [p.grad for p in params]

    runs: dict[str, tuple[Any, list[torch.Tensor]]] = {
        "hp_experts": (lambda: base.expert_outputs(x, counts), list(base.parameters())),
        "library_float8_experts": (lambda: ours.expert_outputs(x, counts), list(ours.parameters())),
    }
    out: dict[str, Any] = {}
    if not emulate:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        theirs = copy.deepcopy(base)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)

        def torchao_experts() -> torch.Tensor:
            def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return _to_fp8_rowwise_then_scaled_grouped_mm(a, w.transpose(-2, -1), offs, torch.bfloat16,
                                                               pad_token_groups_for_grouped_mm=False).to(a.dtype)

            return mm(F.silu(mm(x, theirs.w1)) * mm(x, theirs.w3), theirs.w2)

        runs["torchao_float8_experts"] = (torchao_experts, list(theirs.parameters()))
        (o1, g1), (o2, g2) = step(*runs["library_float8_experts"]), step(*runs["torchao_float8_experts"])
        out["float8_experts_output_max_abs_diff"] = float((o1.float() - o2.float()).abs().max())
        out["float8_experts_weight_grad_max_abs_diff"] = max(float((a.float() - b.float()).abs().max())
                                                             for a, b in zip(g1, g2, strict=True))
    for name, (run, params) in runs.items():
        for _ in range(3):
            step(run, params)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            step(run, params)
        if device == "cuda":
            torch.cuda.synchronize()
        out[f"{name}_ms"] = 1e3 * (time.perf_counter() - start) / iters
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["curves", "time", "memory", "gpu"])
    parser.add_argument("--model", default="llama3", help="curves: the family (qwen3 with --flavor moe_tiny: an MoE)")
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--backends", nargs="+", default=["default", "full_dtensor", "spmd_types"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["fp32", "float8", "lora", "float8_lora"])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--emulate", action="store_true", help="gpu: emulated float8 (any device)")
    args = parser.parse_args()
    if args.what == "gpu":
        gpu_probe(args.dim, args.tokens, args.layers, args.emulate)
    elif args.what == "curves":
        curves(args.flavor, args.steps, args.backends, args.configs, args.model)
    elif args.what == "time":
        step_time(args.flavor, args.steps)
    else:
        memory(args.flavor)


if __name__ == "__main__":
    main()

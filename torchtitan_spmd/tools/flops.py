"""FLOPs per token and the peak a run's MFU is measured against (upstream's count, a0c831c49).

:func:`flops_per_token` is upstream's ``get_dense_model_nparams_and_flops`` /
``get_moe_model_nparams_and_flops``: ``6 * matmul parameters + 6 * n_layers * n_heads *
(qk + v head dims) * seq_len``, the matmul parameters being every parameter but the
embedding's (with MoE: only the routed experts' ``top_k / num_experts`` share, plus the
router and shared experts). Causal sparsity and recomputation are not counted, as upstream.

:func:`peak_flops` is the peak of one device: a table of known GPUs (bf16 dense, as upstream's
``get_peak_flops``); on CPU, ``metrics.cpu_peak_tflops`` when set ("configured"), else a
timed float32 matmul on this process's threads ("measured", once per process and thread count).
The log says which.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import nn

__all__ = ["GPU_PEAK_TFLOPS", "flops_per_token", "peak_flops"]

#: bf16 dense peak TFLOP/s by device-name substring (the vendors' data sheets, as upstream).
GPU_PEAK_TFLOPS: dict[str, float] = {
    "GB200": 2450.0, "B200": 2250.0, "H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    "H20": 148.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "MI300X": 1307.0, "MI325X": 1307.0,
    "MI250X": 191.5,
}


def flops_per_token(model: nn.Module, model_config: Any, seq_len: int) -> int:
    """Training FLOPs per token of the whole ``model`` (it may be on the meta device)."""
    embedding = experts = router = shared = dense = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if "embedding" in name:
            embedding += n
        elif "moe.shared_experts" in name:
            shared += n
        elif "moe.router" in name:
            router += n
        elif "moe.experts" in name:
            experts += n
        else:
            dense += n
    num_experts = int(getattr(model_config, "num_experts", 0) or 0)
    active = router + shared + (experts * int(getattr(model_config, "top_k", 1)) // num_experts if num_experts
                                else experts)
    matmul = dense + active  # the embedding is a lookup, not a matmul
    head_dim = int(getattr(model_config, "head_dim", model_config.dim // model_config.n_heads))
    return 6 * matmul + 6 * model_config.n_layers * model_config.n_heads * (2 * head_dim) * seq_len


def peak_flops(device_type: str, configured_cpu_tflops: float | None) -> tuple[float, str]:
    """``(peak FLOP/s of one device, where it comes from)``: a GPU from :data:`GPU_PEAK_TFLOPS`
    ("table: <name>"), a CPU from ``configured_cpu_tflops`` ("configured") or a timed matmul
    ("measured")."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"table: {name}"
        return 312e12, f"table: {name} unknown, A100's 312 TFLOP/s assumed"
    if configured_cpu_tflops is not None:
        return configured_cpu_tflops * 1e12, "configured (metrics.cpu_peak_tflops)"
    threads = torch.get_num_threads()
    return _measured_cpu_peak(threads), f"measured (a {_N}x{_N} float32 matmul on {threads} thread(s))"


#: The side of the square matmul :func:`peak_flops` times on a CPU.
_N = 512


@functools.cache
def _measured_cpu_peak(threads: int) -> float:
    """FLOP/s of the best of five ``_N x _N`` float32 matmuls on ``threads`` threads (this
    process's count when called), after one warm-up.

    Measured once per process and thread count: every trainer of a process (a notebook, a
    validator, a test's ranks) logs the same peak, and a process forked after the measurement
    (the ranks of ``torchtitan_spmd.launcher.run_forked``) inherits it instead of timing its own.
    """
    rng = torch.Generator().manual_seed(0)  # its own: the measurement leaves the global RNG as it was
    a, b = torch.randn(_N, _N, generator=rng), torch.randn(_N, _N, generator=rng)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * _N**3 / best

"""Layer 3 on CUDA (run by ``nox -s gpu_tests``): one rank, nccl, each DTensor backend.

Skipped, with the reason, where no CUDA device is visible (every CPU machine).
"""

from __future__ import annotations

import pytest
import torch

from torchtitan_spmd.config import JobConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nox -s gpu_tests)")


@cuda
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_single_gpu_training_steps(backend: str) -> None:
    import os

    from torchtitan_spmd.train import Trainer

    os.environ.setdefault("MASTER_PORT", "29631")
    cfg = JobConfig.from_dict(
        {
            "model": {"flavor": "debugmodel"},
            "training": {"steps": 5, "local_batch_size": 4, "seq_len": 256, "device": "cuda"},
            "parallelism": {"spmd_backend": backend, "data_parallel_shard_degree": 1},
            "debug": {"seed": 0},
        }
    )
    trainer = Trainer(cfg)
    try:
        records = trainer.run()
    finally:
        trainer.close()
    assert trainer.device_type == "cuda"
    assert records[-1].loss < records[0].loss
    assert all(r.peak_memory_mib > 0 for r in records)


@cuda
def test_grouped_mm_trains_like_the_loop_over_experts_on_cuda() -> None:
    """MoE experts in bf16 on sm90+: ``torch._grouped_mm`` (forward and backward) against the loop.
    (Written without a GPU to run it on: the CPU test compares the two forwards only.)"""
    from torchtitan_spmd.models.moe import grouped_mm_available
    from torchtitan_spmd.models.qwen3 import build_model

    experts = build_model("moe_tiny", seed=3).layers["0"].moe.experts.to("cuda", torch.bfloat16)
    counts = torch.tensor([5, 0, 3, 7, 1, 0, 4, 4], device="cuda")
    x = torch.randn(int(counts.sum()), experts.w1.shape[2], device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_available(x):
        pytest.skip("torch._grouped_mm needs bf16 on sm90+")
    results = []
    for grouped in (True, False):
        experts.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = experts.expert_outputs(xi, counts, grouped=grouped)
        out.float().square().sum().backward()
        results.append((out.float(), xi.grad.float(), experts.w1.grad.float()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))

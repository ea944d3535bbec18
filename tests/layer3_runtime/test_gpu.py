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

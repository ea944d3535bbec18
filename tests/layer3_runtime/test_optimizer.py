"""Layer 3: ``optimizer.implementation`` selects torch's AdamW kernel, and each is exact.

Single process, a few thousand parameters: each implementation's parameters after three
steps against AdamW written out here from its definition (decoupled weight decay,
bias-corrected moments), which shares no code with torch's optimizers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtitan_spmd.config import OptimizerConfig
from torchtitan_spmd.train import build_optimizer

BETAS = (0.9, 0.95)


def _reference_adamw(params: list[torch.Tensor], grads: list[list[torch.Tensor]], cfg: OptimizerConfig,
                     ) -> list[torch.Tensor]:
    params = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2 = BETAS
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            g = g.double()
            params[i] *= 1 - cfg.lr * cfg.weight_decay
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            params[i] -= cfg.lr * m_hat / (v_hat.sqrt() + cfg.eps)
    return params


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
def test_each_implementation_is_adamw_and_is_the_one_selected(implementation: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8))
    start = [p.detach().clone() for p in model.parameters()]
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, eps=1e-8, implementation=implementation)
    opt = build_optimizer(model, cfg)
    group = opt.param_groups[0]
    assert (bool(group["foreach"]), bool(group["fused"])) == {
        "for-loop": (False, False), "foreach": (True, False), "fused": (False, True)}[implementation]
    assert group["betas"] == BETAS
    grads = []
    for _ in range(3):
        step = [torch.randn_like(p) for p in model.parameters()]
        for p, g in zip(model.parameters(), step, strict=True):
            p.grad = g.clone()
        opt.step()
        grads.append(step)
    want = _reference_adamw(start, grads, cfg)
    assert all((w - s.double()).abs().max() > 1e-3 for w, s in zip(want, start, strict=True))  # it moved
    for got, ref in zip(model.parameters(), want, strict=True):
        assert got.dtype == torch.float32 and all(s.dtype == torch.float32 for s in opt.state[got].values()
                                                  if s.dim() > 0)
        err = (got.double() - ref).abs().max().item()
        assert err < 1e-6, (implementation, err)


def test_the_default_is_fused_as_upstream() -> None:
    assert OptimizerConfig().implementation == "fused"

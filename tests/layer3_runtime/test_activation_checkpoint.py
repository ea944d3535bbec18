"""Layer 3: what each ``activation_checkpoint.mode`` recomputes (single process, milliseconds).

A block of four bias-free Linears (shapes alternating 8->16, 16->8) with ReLUs in between:
its forward runs 4 matmuls and 3 ReLUs. Counting ``aten.mm`` and ``aten.relu`` during
backward, against ``none``: ``full`` recomputes all 4 matmuls and 3 ReLUs; ``selective``
(upstream's policy: every second matmul kept, everything cheap recomputed) 2 and 3;
forcing the 8->16 Linears' shape recomputes those 2 matmuls plus one of the other 2.
The loss tests (``test_training_features.py``) show the recompute changes nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_spmd.config import ActivationCheckpointConfig
from torchtitan_spmd.techniques.activation_checkpoint import apply_ac


class _CountMM(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.mm = self.relu = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.mm += func is torch.ops.aten.mm.default
        self.relu += func is torch.ops.aten.relu.default
        return func(*args, **(kwargs or {}))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        block = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False), nn.ReLU(),
                              nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
        self.layers = nn.ModuleDict({"0": block})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["0"](x)


def _backward_ops(**ac: Any) -> tuple[tuple[int, int], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = apply_ac(_Model(), ActivationCheckpointConfig(**ac))
    x = torch.randn(4, 8)
    loss = model(x).square().sum()
    with _CountMM() as counter:
        loss.backward()
    return (counter.mm, counter.relu), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("ac", "recomputed"), [
    ({"mode": "full"}, (4, 3)),
    ({"mode": "selective"}, (2, 3)),
    ({"mode": "selective", "per_op_sac_force_recompute_mm_shapes_by_fqns": ["layers.0.0"]}, (3, 3)),
])
def test_each_mode_recomputes_what_it_should_and_changes_no_gradient(ac: dict, recomputed: tuple) -> None:
    base, base_grads = _backward_ops(mode="none")
    got, grads = _backward_ops(**ac)
    assert (got[0] - base[0], got[1] - base[1]) == recomputed
    for g, b in zip(grads, base_grads, strict=True):
        torch.testing.assert_close(g, b, rtol=0, atol=0)


def test_forcing_a_module_that_is_not_a_linear_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"matches 'layers.0.1', a ReLU; it must name nn.Linear modules"):
        apply_ac(_Model(), ActivationCheckpointConfig(mode="selective",
                                                      per_op_sac_force_recompute_mm_shapes_by_fqns=["layers.0.1"]))


def _backward_ops_of(policy: Any) -> tuple[int, int]:
    torch.manual_seed(0)
    model = apply_ac(_Model(), policy)
    loss = model(torch.randn(4, 8)).square().sum()
    with _CountMM() as counter:
        loss.backward()
    return counter.mm, counter.relu


def test_upstreams_policy_configs_recompute_as_junes_modes() -> None:
    """upstream b5bcd76's policies (#3674) applied by this library's technique: the same recompute
    counts as June's modes above, written out."""
    from torchtitan_spmd.techniques.activation_checkpoint import FullAC, SelectiveAC

    base = _backward_ops_of(None)  # upstream's "none"
    assert base == _backward_ops(mode="none")[0]
    for policy, recomputed in [(FullAC.Config(), (4, 3)), (SelectiveAC.Config(), (2, 3)),
                               (SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=["layers.0.0"]), (3, 3))]:
        got = _backward_ops_of(policy)
        assert (got[0] - base[0], got[1] - base[1]) == recomputed, policy


def test_memory_budget_policy_is_refused_naming_it() -> None:
    from torchtitan_spmd.techniques.activation_checkpoint import MemoryBudgetAC

    with pytest.raises(ValueError, match=r"MemoryBudgetAC.Config\(\) \(activation-checkpoint:memory-budget\)"):
        apply_ac(_Model(), MemoryBudgetAC.Config())

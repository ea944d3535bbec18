"""Layer 4 parity of ``deepseek_v3`` (``tiny``) under ``spmd_types``, every step type-checked.

One combined layout per cell (CI time), 2 steps each, 4 real forked gloo ranks, against the float64
reference (:mod:`torchtitan_spmd.reference`): loss within 1e-5 and gradient norm within 1e-4 at every
step, every parameter's step-1 gradient norm within 1e-5 (:mod:`grad_probe`: the norms of the plain
annotated shards reduced over the groups they are sharded on), the expert biases after every step,
and the loss going down:

- FSDP 4, and FSDP 4 x EP 4;
- FSDP 2 x TP 2 with selective activation checkpointing (MLA's heads and the experts sharded over ``tp``);
- FSDP 2 x TP 2 x EP 4 (the typed exchange over ``dp_shard x tp``; the routed output of each TP
  rank's token slice typed ``P`` on ``tp`` where the shared experts' output adds to it);
- HSDP 2 x 2 x EP 2 with full activation checkpointing (selective AC with typed EP is a setup error);
- PP 2 x FSDP 2 x EP 2;
- CP 2 x TP 2 x EP 4 (ring attention on MLA's heads, values padded to the query/key width; the
  experts' rows typed varying over ``cp``).

Each rank's attention modules are observed running with the checker on at every step.
"""

from __future__ import annotations

from typing import Any

import pytest
from spmd_helpers import torch_at_least  # first: puts tests/layer3_runtime on sys.path

# isort: split
from deepseek_helpers import LAYOUTS, check_probed, deepseek_config  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types")]

STEPS = 2
#: layout -> activation checkpointing mode
CELLS = {"fsdp4": "none", "fsdp2_tp2": "selective", "fsdp4_ep4": "none", "fsdp2_tp2_ep4": "none",
         "hsdp2x2_ep2": "full", "pp2_fsdp2_ep2": "none", "cp2_tp2_ep4": "none"}


def _train_typed(rank: int, world: int, cfg: Any) -> list[tuple[float, float, bool]]:
    """Train ``cfg``; per step ``(loss, grad_norm, typed)``, ``typed``: the checker was on when this
    rank's attention modules began their forwards (every stage's, under pipeline parallelism; not
    counting activation checkpointing's recompute, which runs in backward, unchecked, as upstream)."""
    import spmd_types
    import torch

    from torchtitan_spmd.models.deepseek_v3.model import LatentAttention
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    seen: list[bool] = []
    attention = [m for m in trainer.model.modules() if isinstance(m, LatentAttention)]
    assert attention, "no attention module on this rank"
    for m in attention:  # the forwards only: not activation checkpointing's recompute in backward
        m.register_forward_pre_hook(lambda *_: seen.append(spmd_types.is_type_checking())
                                    if torch._C._current_graph_task_id() == -1 else None)
    out = []
    try:
        for step in range(1, cfg.training.steps + 1):
            seen.clear()
            record = trainer.step(step)
            out.append((record.loss, record.grad_norm, bool(seen) and all(seen)))
    finally:
        trainer.close()
    return out


def _run(cfg: Any, world: int) -> Any:
    """Per-step ``(loss, grad_norm, typed)`` of rank 0 as a :class:`parity_helpers.Run` with the ranks'
    pooled probe trace; every rank must agree on the values and have run typed."""
    import grad_probe
    import spmd_types.checker  # noqa: F401  (the checker's imports, once, before forking)
    from parity_helpers import warm_parent, with_trace

    from torchtitan_spmd.launcher import run_forked

    warm_parent()
    results = run_forked(grad_probe.probed(_train_typed), world, cfg, timeout_s=300)
    per_rank = [r for r, _ in results]
    for rank, records in enumerate(per_rank):
        assert all(r[2] for r in records), f"rank {rank} ran a step's attention without the checker: {records}"
        if [r[:2] for r in records] != [r[:2] for r in per_rank[0]]:
            raise AssertionError(f"rank {rank} logged {records}, rank 0 logged {per_rank[0]}")
    run = with_trace(per_rank[0], [t for _, t in results])
    grad_probe.check_schedules([cfg], [run.trace])
    return run


@pytest.mark.parametrize("layout", list(CELLS))
def test_deepseek_v3_spmd_types_typed_parity_with_the_reference(layout: str) -> None:
    if not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    world, _ = LAYOUTS[layout]
    cfg = deepseek_config("spmd_types", layout, steps=STEPS, ac=CELLS[layout], spmd_typechecking=True)
    got = _run(cfg, world)
    loss_diff, norm_diff, grad_diff = check_probed(got, layout, f"deepseek_v3 spmd_types {layout}")
    print(f"\ndeepseek_v3 spmd_types {layout} (AC {CELLS[layout]}, typed): max rel diff loss {loss_diff:.1e} "
          f"grad_norm {norm_diff:.1e} per-tensor grads {grad_diff:.1e} ({len(got.trace.grad_norms)} tensors)")

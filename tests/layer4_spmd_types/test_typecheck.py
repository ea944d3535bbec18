"""The checker earns its keep: a planted Megatron bug is a type error, not a wrong gradient.

A 2-rank tensor-parallel MLP on local tensors (colwise ``w1``, rowwise ``w2``):

1. ``x = convert(x, tp, src=I, dst=R)`` -- no-op forward, all-reduce backward;
2. ``h = relu(x @ w1_local.T)``; ``o = h @ w2_local.T`` (a partial sum);
3. ``all_reduce(o, tp, src=P, dst=I)``.

Leaving out step 1 keeps the forward exact but silently leaves each rank with
only its own part of the input gradient; ``typecheck(local=False)`` rejects it.
"""

from __future__ import annotations

import pytest
import torch
from spmd_helpers import in_child, warm_parent

from torchtitan_spmd.launcher import run_forked

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types")]

DIM, HIDDEN = 8, 16


def _full_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, DIM, generator=gen)
    w1 = torch.randn(HIDDEN, DIM, generator=gen)
    w2 = torch.randn(DIM, HIDDEN, generator=gen)
    return x, w1, w2


def _mlp_rank(rank: int, world: int, drop_convert: bool, check: bool) -> dict:
    import spmd_types as st
    import torch.distributed as dist
    import torch.nn.functional as F
    from spmd_types import I, P, R, S
    from spmd_types.checker import typecheck

    tp = dist.group.WORLD
    x_full, w1_full, w2_full = _full_weights()
    x = x_full.clone().requires_grad_(True)
    w1 = w1_full.chunk(world, dim=0)[rank].clone().requires_grad_(True)
    w2 = w2_full.chunk(world, dim=1)[rank].clone().requires_grad_(True)
    st.assert_type(x, {tp: I})
    st.assert_type(w1, {tp: S(0)})
    st.assert_type(w2, {tp: S(1)})

    def forward() -> torch.Tensor:
        h = x if drop_convert else st.convert(x, tp, src=I, dst=R)
        o = F.relu(h @ w1.T) @ w2.T
        return st.all_reduce(o, tp, src=P, dst=I)

    try:
        if check:
            with typecheck(local=False):
                out = forward()
        else:
            out = forward()
    except st.SpmdTypeError as err:
        return {"error": str(err)}
    out.sum().backward()
    return {"out": out.detach().tolist(), "x_grad": x.grad.tolist()}


def _reference_lists() -> tuple[list, list]:
    x_full, w1_full, w2_full = _full_weights()
    x = x_full.clone().requires_grad_(True)
    out = torch.relu(x @ w1_full.T) @ w2_full.T
    out.sum().backward()
    return out.detach().tolist(), x.grad.tolist()


def _reference() -> tuple[torch.Tensor, torch.Tensor]:
    # No backward in the test process itself (see spmd_helpers.in_child).
    out, grad = in_child(_reference_lists)
    return torch.tensor(out), torch.tensor(grad)


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    warm_parent()
    import spmd_types.checker  # noqa: F401


def test_correct_mlp_passes_the_checker_and_matches() -> None:
    ref_out, ref_grad = _reference()
    for rank_result in run_forked(_mlp_rank, 2, False, True):
        assert "error" not in rank_result, rank_result
        torch.testing.assert_close(torch.tensor(rank_result["out"]), ref_out)
        torch.testing.assert_close(torch.tensor(rank_result["x_grad"]), ref_grad)


def test_missing_convert_is_silently_wrong_without_the_checker() -> None:
    ref_out, ref_grad = _reference()
    results = run_forked(_mlp_rank, 2, True, False)
    for r in results:
        # The forward is still exact...
        torch.testing.assert_close(torch.tensor(r["out"]), ref_out)
    # ...but each rank's input gradient is only its own shard's contribution.
    errors = [float((torch.tensor(r["x_grad"]) - ref_grad).abs().max()) for r in results]
    print(f"\nmax |x.grad - reference| per rank without the checker: {errors}")
    assert min(errors) > 0.5
    # The missing backward all-reduce: the per-rank gradients sum to the right one.
    torch.testing.assert_close(sum(torch.tensor(r["x_grad"]) for r in results), ref_grad)


def test_missing_convert_is_a_type_error_under_the_checker() -> None:
    for r in run_forked(_mlp_rank, 2, True, True):
        assert "error" in r, r
        assert "Invariant type" in r["error"] and "[I, V]" in r["error"], r["error"]
        # The checker even names the missing call.
        assert "convert(tensor" in r["error"] and "src=I, dst=R" in r["error"], r["error"]

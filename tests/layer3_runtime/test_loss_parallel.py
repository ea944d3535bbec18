"""The loss technique's vocab-parallel cross-entropy on local shards matches torch's ``loss_parallel()``.

Uneven vocab splits (``torch.chunk`` order, as DTensor's ``Shard``), labels with
``ignore_index=-100``, the loss and the gradient of every logit, on real gloo
ranks. It runs under ``spmd_types``' ``typecheck(local=False)``, which also checks
its typing rule (vocab-sharded logits + invariant labels give an invariant loss).
"""

from __future__ import annotations

import pytest
import torch
from parity_helpers import warm_parent

from torchtitan_spmd.launcher import run_forked

pytestmark = pytest.mark.multiproc

N = 12


def _data(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(N, vocab, generator=gen) * 3
    labels = torch.randint(0, vocab, (N,), generator=gen)
    labels[[1, 5, 6]] = -100  # ignored rows
    labels[0] = vocab - 1  # the last (smallest) shard owns a target
    return logits, labels


def _rank(rank: int, world: int, vocab: int) -> dict:
    import spmd_types as st
    import torch.distributed as dist
    import torch.nn.functional as F
    from spmd_types import I, S
    from spmd_types.checker import typecheck
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from torchtitan_spmd.techniques.loss import vocab_parallel_cross_entropy

    logits, labels = _data(vocab)
    tp = dist.group.WORLD

    # torch: DTensor logits sharded on the vocab dim, under loss_parallel().
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    d_logits = distribute_tensor(logits.clone(), mesh, [Shard(1)]).requires_grad_(True)
    d_labels = distribute_tensor(labels, mesh, [Replicate()])
    with loss_parallel():
        ref = F.cross_entropy(d_logits, d_labels, ignore_index=-100)
        ref.backward()
    ref_grad = d_logits.grad.to_local()

    # Ours: this rank's vocab chunk, a plain tensor, under the checker.
    local = logits.chunk(world, dim=1)[rank].clone().requires_grad_(True)
    st.assert_type(local, {tp: S(1)})
    st.assert_type(labels, {tp: I})
    with typecheck(local=False):
        per_token = vocab_parallel_cross_entropy(local, labels, tp)
        loss = per_token.sum() / (labels != -100).float().sum()
        out_type = {str(k): v.name for k, v in st.get_local_type(loss).items()}
        loss.backward()
    return {
        "ref": float(ref.full_tensor()),
        "loss": float(loss),
        "ref_grad": ref_grad.tolist(),
        "grad": local.grad.tolist(),
        "local_vocab": local.shape[1],
        "per_token_ignored": per_token.detach()[[1, 5, 6]].tolist(),
        "loss_type": out_type,
    }


@pytest.mark.parametrize(("world", "vocab"), [(2, 11), (3, 7)])
def test_matches_torch_loss_parallel_uneven_vocab_and_ignored_labels(world: int, vocab: int) -> None:
    warm_parent()
    results = run_forked(_rank, world, vocab)
    sizes = [r["local_vocab"] for r in results]
    assert sum(sizes) == vocab and len(set(sizes)) > 1, sizes  # really uneven
    logits, labels = _data(vocab)
    plain = float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100))
    for r in results:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-6, abs=1e-7)
        assert r["loss"] == pytest.approx(plain, rel=1e-6)
        torch.testing.assert_close(torch.tensor(r["grad"]), torch.tensor(r["ref_grad"]), rtol=1e-5, atol=1e-7)
        assert r["per_token_ignored"] == [0.0, 0.0, 0.0]
        assert set(r["loss_type"].values()) == {"I"}, r["loss_type"]

"""Layer 3: context parallelism -- the algorithm, its setup errors, and full_dtensor parity.

- The algorithm (one process, no collectives): which tokens a rank holds under each load
  balancer, and that attention of a rank's queries over every rank's keys, under
  :meth:`ContextParallel.attention_mask`, equals that rank's rows of full causal attention.
- Setup errors: default + CP names the CP backends; bad balancer, rotate method, seq_len.
- full_dtensor: CP 2, CP 2 x TP 2 (sequence parallel) and FSDP 2 x CP 2 within 1e-5 of
  one process (default backend, no CP) over 5 steps, ranks identical (real gloo ranks).
  The spmd_types runs are in ``tests/layer4_spmd_types/test_context_parallel_spmd.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from cp_helpers import CP_CONFIGS, check_cp_parity, cp_job_config
from parity_helpers import run_config
from version_helpers import torch_at_least

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed.context_parallel import ContextParallel, seq_len_divisor


# --------------------------------------------------------------------------- the algorithm
@pytest.mark.parametrize(
    ("balancer", "expected"),
    [
        # seq 8, cp 2: headtail cuts 4 chunks of 2; rank r holds chunks r and 3 - r.
        ("headtail", {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}),
        (None, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}),
    ],
)
def test_which_tokens_a_rank_holds(balancer: str | None, expected: dict[int, list[int]]) -> None:
    seq = torch.arange(100, 108).unsqueeze(0)
    for rank, idx in expected.items():
        cp = ContextParallel(degree=2, rank=rank, load_balancer=balancer)
        assert cp.global_index(8).tolist() == idx
        assert cp.shard(seq).tolist() == [[100 + i for i in idx]]
        assert cp.positions(3, 8).tolist() == [idx] * 3


@pytest.mark.parametrize("balancer", ["headtail", None])
@pytest.mark.parametrize("degree", [2, 4])
def test_masked_attention_over_gathered_keys_is_causal_attention(balancer: str | None, degree: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ranks = [ContextParallel(degree=degree, rank=r, load_balancer=balancer) for r in range(degree)]
    k_all = torch.cat([cp.shard(k, dim=2) for cp in ranks], dim=2)  # the all-gather, in rank order
    v_all = torch.cat([cp.shard(v, dim=2) for cp in ranks], dim=2)
    for cp in ranks:
        mask = cp.attention_mask(16 // degree, 16, dtype=q.dtype, device=q.device)
        got = F.scaled_dot_product_attention(cp.shard(q, dim=2), k_all, v_all, attn_mask=mask)
        torch.testing.assert_close(got, cp.shard(full, dim=2), rtol=1e-12, atol=1e-12)


def test_attention_without_the_gather_is_a_clear_error() -> None:
    cp = ContextParallel(degree=2, rank=0)
    with pytest.raises(ValueError, match=r"keys and values must be gathered over cp first"):
        cp.attention_mask(8, 8, dtype=torch.float32, device=torch.device("cpu"))


# --------------------------------------------------------------------------- setup errors
def _cfg(backend: str, seq_len: int = 16, **parallelism: object) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"flavor": "tiny"},
        "training": {"steps": 1, "local_batch_size": 1, "seq_len": seq_len, "device": "cpu"},
        "parallelism": {"spmd_backend": backend, "data_parallel_shard_degree": 1, **parallelism},
    })


def test_default_backend_with_cp_names_the_cp_backends(fake_pg: Callable[[int], None]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(2)
    with pytest.raises(ValueError) as err:
        Trainer(_cfg("default", context_parallel_degree=2))
    msg = str(err.value)
    assert "Context Parallel requires" in msg and "got 'default'" in msg, msg
    assert "parallelism.spmd_backend='full_dtensor'" in msg, msg
    assert "context_parallel_degree=1" in msg, msg


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"context_parallel_rotate_method": "alltoall"},
         ["context_parallel_rotate_method='alltoall'", "ring attention", "'allgather'"]),
        ({"context_parallel_load_balancer": "ptrr"},
         ["context_parallel_load_balancer='ptrr'", "'headtail', None"]),
        ({"seq_len": 12}, ["training.seq_len=12", "divisible by 8 = 2 x context_parallel_degree (4)"]),
        ({"seq_len": 36, "tensor_parallel_degree": 2, "context_parallel_degree": 2},
         ["training.seq_len=36", "divisible by 8 = tensor_parallel_degree (2, sequence parallel) x 2 x "
          "context_parallel_degree (2)"]),
    ],
)
def test_bad_cp_configs_fail_at_setup(fake_pg: Callable[[int], None], overrides: dict, needles: list[str]) -> None:
    from torchtitan_spmd.train import Trainer

    par = {"context_parallel_degree": 4, **overrides}
    seq_len = par.pop("seq_len", 16)
    fake_pg(par["context_parallel_degree"] * par.get("tensor_parallel_degree", 1))
    with pytest.raises(ValueError) as err:
        Trainer(_cfg("full_dtensor", seq_len=seq_len, **par))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_seq_len_divisor_is_torchtitans() -> None:
    par = _cfg("full_dtensor", context_parallel_degree=4, tensor_parallel_degree=2).parallelism
    assert seq_len_divisor(par) == 2 * 2 * 4  # tp * 2 * cp
    par.context_parallel_load_balancer = None
    assert seq_len_divisor(par) == 2 * 4


# --------------------------------------------------------------------------- parity (full_dtensor)
def _skip_old_torch() -> None:
    from torchtitan_spmd.distributed.representations import full_dtensor as fd

    if fd.DataParallelMeshDims is None:  # CP shards parameters over dp_shard x cp
        pytest.skip(f"full_dtensor CP needs torch >= {fd.FSDP_MIN_TORCH} (fully_shard(dp_mesh_dims=...)); "
                    f"this is torch {torch.__version__}")


@pytest.mark.multiproc
@pytest.mark.parametrize("config_name", sorted(CP_CONFIGS))
def test_full_dtensor_cp_parity_with_single_process(config_name: str) -> None:
    _skip_old_torch()
    world, _ = CP_CONFIGS[config_name]
    got = run_config(cp_job_config("full_dtensor", config_name), world)  # ranks identical, or it raises
    loss_diff, norm_diff = check_cp_parity(got, config_name)
    print(f"\nfull_dtensor {config_name}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")


@pytest.mark.parametrize(("dp_shard", "cp"), [(1, 2), (2, 2)])
def test_fsdp_shards_parameters_over_dp_shard_x_cp(fake_pg: Callable[[int], None], dp_shard: int, cp: int) -> None:
    """Parameters are sharded over every rank that holds different tokens (torchtitan's ``fsdp`` axis);
    parity cannot see this (FSDP would still sum the gradients over a replicated ``cp``)."""
    from torchtitan_spmd.distributed.context_parallel import context_parallel_backends
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.representation import get_representation

    fake_pg(dp_shard * cp)
    # FSDP over CP needs fully_shard(dp_mesh_dims=...) (torch >= 2.13) and, over
    # spmd_types-annotated plain tensors, torch >= 2.14; older torch is a setup error (tested).
    needs = {"full_dtensor": "2.13", "spmd_types": "2.14"}
    backends = [b for b in context_parallel_backends() if torch_at_least(needs[b])]
    if not backends:
        pytest.skip(f"FSDP over dp_shard x cp needs torch >= 2.13 (this is torch {torch.__version__})")
    for backend in backends:
        pd = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=1, pp=1, ep=1, world_size=dp_shard * cp,
                          spmd_backend=backend, device_type="cpu")
        pd.build_mesh()
        spec = get_representation(backend)(pd).fsdp_spec()
        assert spec is not None and spec.dp_mesh_dims is not None, backend
        shard = spec.dp_mesh_dims.shard
        shard = (shard,) if isinstance(shard, str) else tuple(shard or ())
        names = spec.mesh.mesh_dim_names or ()
        assert "cp" in shard, (backend, shard)
        assert math.prod(spec.mesh.size(names.index(a)) for a in shard) == dp_shard * cp, (backend, shard)

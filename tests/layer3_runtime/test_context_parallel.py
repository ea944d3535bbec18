"""Layer 3: context parallelism -- the algorithm, its setup errors, RoPE sizing, full_dtensor parity.

- The algorithm: which tokens a rank holds under each load balancer; torch's ring attention
  (:meth:`ContextParallel.attention`) on real gloo ranks at cp 2 and 4, both rotate methods,
  both balancers, GQA: output and gradients equal one process's causal attention rows.
- Setup errors: default + CP names the CP backends; bad balancer, rotate method, seq_len;
  ``seq_len_divisor`` has one definition; RoPE tables follow ``training.seq_len``.
- full_dtensor parity with the independent reference (float64) within 1e-5 over 5 steps
  (:data:`cp_helpers.CP_CELLS`: cp 2, cp 4, CP 2 x TP 2, FSDP 2 x CP 2, each rotate method,
  both families), ranks identical (real gloo ranks); no tensor of ``S x S/cp`` elements is
  allocated in a training step. The spmd_types runs are in
  ``tests/layer4_spmd_types/test_context_parallel_spmd.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from cp_helpers import (
    CP_CELLS,
    CP_CONFIGS,
    MASK_SEQ,
    check_cp_parity,
    check_no_sequence_squared_tensor,
    cp_job_config,
)
from parity_helpers import run_config
from version_helpers import torch_at_least

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked
from torchtitan_spmd.techniques.context_parallel import ContextParallel, seq_len_divisor


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


def _ring_vs_full(rank: int, world: int, cases: list[tuple[str, str | None, int]]) -> list[list[float]]:
    """Per case ``(rotate, balancer, kv_heads)``: the largest differences of this rank's output and
    query/key/value gradients of :meth:`ContextParallel.attention` from its rows of one
    process's causal SDPA on the full sequence (float64 inputs)."""
    import torch.distributed as dist

    from torchtitan_spmd.techniques.context_parallel import _torch_cp

    sent: list[int] = []  # what torch's rotaters exchange (keys and values, or their gradients)
    for cls in (_torch_cp._AllGatherRotater, _torch_cp._AllToAllRotater):
        real = cls.exchange_buffers

        def spy(self: object, buffer: torch.Tensor, _real: object = real) -> None:
            sent.append(buffer.numel())
            _real(self, buffer)  # type: ignore[operator]

        cls.exchange_buffers = spy  # type: ignore[method-assign]
    out = []
    for rotate, balancer, kv_heads in cases:
        sent.clear()
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 32, 8, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(2, kv_heads, 32, 8, generator=gen, dtype=torch.float64) for _ in range(2))
        grad = torch.randn(2, 4, 32, 8, generator=gen, dtype=torch.float64)
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        full = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=kv_heads != 4)
        full.backward(grad)
        cp = ContextParallel(degree=world, rank=rank, load_balancer=balancer, rotate_method=rotate,
                             group=dist.group.WORLD)
        ql, kl, vl = (cp.shard(t, dim=2).requires_grad_() for t in (q, k, v))
        got = cp.attention(ql, kl, vl)
        got.backward(cp.shard(grad, dim=2))
        # GQA: every exchanged buffer is this rank's keys and values with n_kv_heads (no repeat)
        assert sent and set(sent) == {2 * kl.numel()}, (set(sent), kl.shape)
        pairs = [(got, full), (ql.grad, qf.grad), (kl.grad, kf.grad), (vl.grad, vf.grad)]
        out.append([(a - cp.shard(b, dim=2)).abs().max().item() for a, b in pairs])
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("degree", [2, 4])
def test_ring_attention_is_causal_attention(degree: int) -> None:
    """torch's ring attention on real gloo ranks, both rotate methods, both balancers, GQA and
    MHA: output and every gradient equal full causal attention's rows of this rank (the
    diagonal chunk causal, chunk order, the LSE merge, dK/dV rotated back to their owners)."""
    cases = [(r, b, h) for r in ("allgather", "alltoall") for b in ("headtail", None) for h in (4, 2)]
    per_rank = run_forked(_ring_vs_full, degree, cases, timeout_s=120)
    for rank, diffs in enumerate(per_rank):
        for case, d in zip(cases, diffs, strict=True):
            # float32 merge (torch's convert_to_f32) of float64 inputs: ~1e-6 off.
            assert max(d) < 1e-5, (rank, case, d)


def test_ring_attention_names_bad_arguments() -> None:
    from torchtitan_spmd.techniques.context_parallel import ring_attention

    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match=r"rotate_method='ring'; valid values are 'allgather', 'alltoall'"):
        ring_attention(q, q, q, None, rotate_method="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3"):
        ring_attention(q, torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 8), None)  # type: ignore[arg-type]
    cp = ContextParallel(degree=2, rank=0)
    with pytest.raises(ValueError, match="needs the cp process group"):
        cp.attention(q, q, q)
    with pytest.raises(ValueError, match=r"rotate_method='alltoal'; valid values are 'allgather', 'alltoall'"):
        ContextParallel(degree=2, rank=0, rotate_method="alltoal")


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
        ({"context_parallel_rotate_method": "all_to_all"},
         ["parallelism.context_parallel_rotate_method", "'all_to_all'", "'allgather', 'alltoall'"]),
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
        cfg = _cfg("full_dtensor", seq_len=seq_len, **par)  # a misspelt rotate method fails here
        Trainer(cfg)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_seq_len_divisor_is_torchtitans_and_has_one_definition(fake_pg: Callable[[int], None]) -> None:
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

    par = _cfg("full_dtensor", context_parallel_degree=4, tensor_parallel_degree=2).parallelism
    assert seq_len_divisor(par) == 2 * 2 * 4  # tp * 2 * cp
    pd = ParallelDims.from_config(par, 8, device_type="cpu")
    assert pd.seq_len_divisor == seq_len_divisor(par)  # the mesh layer's view agrees
    par.context_parallel_load_balancer = None
    assert seq_len_divisor(par) == 2 * 4
    par.enable_sequence_parallel = False
    assert seq_len_divisor(par) == 4  # TP without SP does not split the sequence
    par.context_parallel_degree, par.context_parallel_load_balancer = 1, "headtail"
    assert seq_len_divisor(par) == 1  # no CP: no chunks
    # ParallelDims.seq_len_divisor is upstream's property for a fork's code, upstream's formula
    # tp * (cp * 2) at every cp (issue 46; cp = 1 included); the library's own check is the function.
    no_cp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2, device_type="cpu")
    assert no_cp.seq_len_divisor == 2 * (1 * 2)


def test_the_cp_backend_check_has_one_home() -> None:
    """``representation.py`` does not import ``context_parallel`` (which imports it): the backend
    check runs once, in ``validate_context_parallel``, not again in ``TensorRepresentation.validate``."""
    import ast
    import inspect

    from torchtitan_spmd.distributed import representation

    tree = ast.parse(inspect.getsource(representation))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.endswith("context_parallel") for m in imported), imported


def _rope_rows(rank: int, world: int, cfg: JobConfig) -> tuple[int, tuple[int, ...], list[str]]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    try:
        model = trainer.model
        return trainer.model_config.max_seq_len, tuple(model.rope_cos.shape), list(model.state_dict())
    finally:
        trainer.close()


def test_rope_tables_cover_training_seq_len() -> None:
    """``training.seq_len`` beyond the flavour's ``max_seq_len`` (512 for ``tiny``) sizes the RoPE
    tables (upstream's ``update_from_config``); they are buffers, not checkpoint state. (A
    forked rank: a Trainer built in the test process would leave state its later forks inherit.)"""
    for model in ("llama3", "qwen3"):
        cfg = _cfg("full_dtensor", seq_len=2048)
        cfg.model.name = model
        [(rows, shape, keys)] = run_forked(_rope_rows, 1, cfg, timeout_s=120)
        assert rows == 2048 and shape[0] == 2048, (model, rows, shape)
        assert keys and not any("rope" in k for k in keys), model


# --------------------------------------------------------------------------- parity (full_dtensor)
def _skip_old_torch() -> None:
    from torchtitan_spmd.distributed.representations import full_dtensor as fd

    if fd.DataParallelMeshDims is None:  # CP shards parameters over dp_shard x cp
        pytest.skip(f"full_dtensor CP needs torch >= {fd.FSDP_MIN_TORCH} (fully_shard(dp_mesh_dims=...)); "
                    f"this is torch {torch.__version__}")


@pytest.mark.multiproc
@pytest.mark.parametrize(("config_name", "rotate", "model"), CP_CELLS["full_dtensor"])
def test_full_dtensor_cp_parity_with_reference(config_name: str, rotate: str, model: str) -> None:
    _skip_old_torch()
    world, _ = CP_CONFIGS[config_name]
    cfg = cp_job_config("full_dtensor", config_name, model=model, context_parallel_rotate_method=rotate)
    got = run_config(cfg, world)  # ranks identical, or it raises
    loss_diff, norm_diff = check_cp_parity(got, config_name, model=model)
    print(f"\nfull_dtensor {config_name} {rotate} {model}: max rel diff loss {loss_diff:.1e} "
          f"grad_norm {norm_diff:.1e}")


@pytest.mark.parametrize(("dp_shard", "cp"), [(1, 2), (2, 2)])
def test_fsdp_shards_parameters_over_dp_shard_x_cp(fake_pg: Callable[[int], None], dp_shard: int, cp: int) -> None:
    """Parameters are sharded over every rank that holds different tokens (torchtitan's ``fsdp`` axis);
    parity cannot see this (FSDP would still sum the gradients over a replicated ``cp``)."""
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.representation import get_representation
    from torchtitan_spmd.techniques.context_parallel import context_parallel_backends

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


@pytest.mark.multiproc
def test_no_sequence_squared_tensor_in_a_cp_step() -> None:
    """No op of a training step returns a tensor of ``S x S/cp`` elements (the old additive
    mask was ``[S/cp, S]``): the largest is the logits."""
    _skip_old_torch()
    numel, op = check_no_sequence_squared_tensor("full_dtensor")
    print(f"\nlargest tensor of a cp 2 step at seq {MASK_SEQ}: {numel} ({op}); S x S/cp = {MASK_SEQ ** 2 // 2}")

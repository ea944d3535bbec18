"""Layer 4 setup: parameters, annotations, plan validation, FSDP meshes and setup errors.

Single process on torch's fake process group (no real communication): enough for
shapes, annotations, plan validation and type checking, in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from typing import Any

import pytest
import spmd_types as st
import torch
import torch.distributed as dist
from spmd_helpers import in_child, requires_torch
from spmd_types import I, P, R, S, V
from torch import nn

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed.apply_plan import apply_plan
from torchtitan_spmd.distributed.inputs import prepare_inputs
from torchtitan_spmd.distributed.layout import SpmdLayout
from torchtitan_spmd.distributed.parallel_dims import ParallelDims
from torchtitan_spmd.distributed.plan import ModulePlan, Redistribute, ShardingPlan
from torchtitan_spmd.distributed.representation import StateLayout, get_representation
from torchtitan_spmd.distributed.representations import spmd_types as sb
from torchtitan_spmd.distributed.representations.spmd_types import (
    mesh_context,
    redistribute,
    typecheck,
)
from torchtitan_spmd.models.llama3 import FLAVORS, Transformer, build_model, llama3_plan
from torchtitan_spmd.models.qwen3 import qwen3_plan
from torchtitan_spmd.techniques.fsdp import apply_fsdp, clear_dtensor_sharding_caches
from torchtitan_spmd.techniques.loss import cross_entropy_loss

pytestmark = pytest.mark.backend("spmd_types")

#: FSDP2 over spmd_types-annotated plain tensors (FACTS: absent from 2.13.0).
needs_fsdp = requires_torch("2.14", "FSDP over spmd_types-annotated tensors")


def _cfg(**parallelism: Any) -> JobConfig:
    return JobConfig.from_dict(
        {
            "model": {"flavor": "tiny"},
            "training": {"steps": 1, "local_batch_size": 2, "seq_len": 16, "device": "cpu"},
            "parallelism": {"spmd_backend": "spmd_types", **parallelism},
        }
    )


def _dims(world: int, *, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1) -> ParallelDims:
    pd = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1,
                      world_size=world, spmd_backend="spmd_types", device_type="cpu")
    pd.build_mesh()
    return pd


def _rep(pd: ParallelDims) -> sb.SpmdTypesRepresentation:
    return sb.SpmdTypesRepresentation(pd)


def _axis(pd: ParallelDims, name: str) -> Any:
    return st.MeshAxis.of(_rep(pd).forward_mesh.get_group(name))


def _parallelize(pd: ParallelDims, model: nn.Module, plan: ShardingPlan | None = None,
                 ) -> tuple[sb.SpmdTypesRepresentation, dict[str, StateLayout]]:
    """The trainer's composition on an already-initialised CPU model: plan, then FSDP."""
    rep, plan = _rep(pd), plan or llama3_plan()
    states = apply_plan(model, plan, rep)
    apply_fsdp(model, plan, rep)
    return rep, states


# --------------------------------------------------------------------------- registry
def test_representation_is_registered_and_imports_the_library() -> None:
    assert get_representation("spmd_types") is sb.SpmdTypesRepresentation
    assert sb.REPRESENTATION.name == "spmd_types"
    assert sb.st.__name__ == "spmd_types"  # the library, not this package


# --------------------------------------------------------------------------- setup errors
def test_default_backend_with_cp_names_both_cp_backends(fake_world: Callable[[int], None]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_world(2)
    cfg = JobConfig.from_dict({
        "model": {"flavor": "tiny"},
        "training": {"steps": 1, "local_batch_size": 1, "seq_len": 16, "device": "cpu"},
        "parallelism": {"spmd_backend": "default", "data_parallel_shard_degree": 1, "context_parallel_degree": 2},
    })
    with pytest.raises(ValueError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert ("Context Parallel requires parallelism.spmd_backend='full_dtensor' or "
            "parallelism.spmd_backend='spmd_types', got 'default'") in msg, msg


@pytest.mark.parametrize("typechecking", [True, False])
def test_typechecking_with_compile_is_a_setup_error(fake_world: Callable[[int], None],
                                                    typechecking: bool) -> None:
    from torchtitan_spmd.train import Trainer

    fake_world(2)
    cfg = _cfg(tensor_parallel_degree=2)
    cfg.debug.spmd_typechecking = typechecking
    cfg.compile.enable = True
    cfg.compile.backend = "aot_eager"
    cfg.training.mixed_precision_param = "float32"
    cfg.activation_checkpoint.mode = "none"
    if not typechecking:  # compile alone sets up (the model is built, nothing compiled yet)
        Trainer(cfg).close()
        return
    with pytest.raises(ValueError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert "debug.spmd_typechecking=True" in msg and "compile.enable=True" in msg, msg


def test_old_torch_with_data_parallel_fails_at_setup(fake_world: Callable[[int], None],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan_spmd.train import Trainer

    fake_world(4)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    with pytest.raises(ValueError) as err:
        Trainer(_cfg(data_parallel_shard_degree=2, tensor_parallel_degree=2))
    msg = str(err.value)
    assert "torch >= 2.14" in msg and "torch 2.13" in msg and "dp_shard=2" in msg, msg


@pytest.mark.parametrize(("version", "mode", "fails"), [
    ("2.11.0+cu130", "selective", True), ("2.11.0+cu130", "full", True), ("2.11.0+cu130", "none", False),
    ("2.13.0+cpu", "selective", False),
])
def test_typechecking_through_activation_checkpointing_needs_torch_2_13(
        fake_world: Callable[[int], None], monkeypatch: pytest.MonkeyPatch, version: str, mode: str,
        fails: bool) -> None:
    """Measured on torch 2.11: the checker rejects torch.utils.checkpoint's _NoopSaveInputs."""
    fake_world(2)
    cfg = _cfg(tensor_parallel_degree=2)
    cfg.debug.spmd_typechecking = True
    cfg.activation_checkpoint.mode = mode
    monkeypatch.setattr(torch, "__version__", version)
    if not fails:
        _rep(_dims(2, tp=2)).validate(cfg)
        return
    with pytest.raises(ValueError) as err:
        _rep(_dims(2, tp=2)).validate(cfg)
    msg = str(err.value)
    assert (f"activation_checkpoint.mode={mode!r}" in msg and "debug.spmd_typechecking=True" in msg
            and "torch >= 2.13" in msg and "torch 2.11" in msg), msg


@pytest.mark.parametrize(
    "version", ["2.14.1+cu130", "2.14.0a0+git1234", "2.14.0.dev20260601", "2.15.0a0+git1234", "3.0.0"])
def test_new_enough_torch_with_data_parallel_is_fine(fake_world: Callable[[int], None],
                                                     monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    fake_world(4)
    pd = _dims(4, dp_shard=2, tp=2)
    monkeypatch.setattr(torch, "__version__", version)
    _rep(pd).validate(_cfg(data_parallel_shard_degree=2, tensor_parallel_degree=2))


def test_fsdp_on_old_torch_is_a_clear_error_even_without_validate(
        fake_world: Callable[[int], None], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_world(4)
    rep = _rep(_dims(4, dp_shard=2, tp=2))
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    with pytest.raises(ValueError, match="needs torch >= 2.14"):
        apply_fsdp(build_model("tiny", seed=0), llama3_plan(), rep)


def test_old_torch_without_data_parallel_is_fine(fake_world: Callable[[int], None],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake_world(2)
    pd = _dims(2, tp=2)
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    _rep(pd).validate(_cfg(data_parallel_shard_degree=1, tensor_parallel_degree=2))


def test_typechecking_with_pipeline_parallel_is_accepted() -> None:
    # Each stage's forward is type-checked on its own (tests/layer3_runtime/test_pipeline_backends.py).
    cfg = JobConfig.from_dict({"parallelism": {"spmd_backend": "spmd_types", "pipeline_parallel_degree": 2},
                               "debug": {"spmd_typechecking": True}})
    assert cfg.debug.spmd_typechecking and cfg.parallelism.pipeline_parallel_degree == 2


# --------------------------------------------------------------------------- parameters
def test_parameters_are_typed_local_shards_and_keep_requires_grad(fake_world: Callable[[int], None]) -> None:
    fake_world(2)
    pd = _dims(2, tp=2)
    model = build_model("tiny", seed=0)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.tok_embeddings.weight.requires_grad_(False)  # frozen: must stay frozen
    model.layers["0"].attention_norm.weight.requires_grad_(False)
    _parallelize(pd, model)
    tp = _axis(pd, "tp")
    params = dict(model.named_parameters())
    assert not params["tok_embeddings.weight"].requires_grad
    assert not params["layers.0.attention_norm.weight"].requires_grad
    assert all(p.requires_grad for n, p in params.items()
               if n not in ("tok_embeddings.weight", "layers.0.attention_norm.weight"))
    for name, p in params.items():
        assert type(p) is nn.Parameter, name  # plain local shards, not DTensors
        assert tp in st.get_local_type(p), name
    # colwise S(0), rowwise S(1), vocab-parallel output S(0); the rest replicated.
    wq = params["layers.0.attention.wq.weight"]
    torch.testing.assert_close(wq, full["layers.0.attention.wq.weight"].chunk(2, 0)[0])
    assert st.get_local_type(wq)[tp] is V and st.get_partition_spec(wq)[0] == tp
    wo = params["layers.0.attention.wo.weight"]
    torch.testing.assert_close(wo, full["layers.0.attention.wo.weight"].chunk(2, 1)[0])
    assert st.get_partition_spec(wo)[1] == tp
    assert params["output.weight"].shape[0] == full["output.weight"].shape[0] // 2
    assert st.get_local_type(params["norm.weight"])[tp] is R
    assert st.get_local_type(model.rope_cos)[tp] is R


@needs_fsdp
def test_frozen_parameter_stays_frozen_under_fsdp(fake_world: Callable[[int], None]) -> None:
    fake_world(4)
    pd = _dims(4, dp_shard=2, tp=2)
    model = build_model("tiny", seed=0)
    model.layers["1"].feed_forward.w1.weight.requires_grad_(False)
    _parallelize(pd, model)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["layers.1.feed_forward.w1.weight"]


def test_uneven_shards_follow_dtensor_chunking(fake_world: Callable[[int], None]) -> None:
    fake_world(4)
    pd = _dims(4, tp=4)
    full = torch.arange(6.0)
    local = _rep(pd).distribute(full, SpmdLayout({"tp": S(0)}))
    assert local.tolist() == [0.0, 1.0]  # chunk 0 of [2, 2, 2] (torch.chunk of 6 into 4)
    # Two axes on one dim, in partition-spec order (dp outer, tp inner) on a 2x2 mesh.
    dist.destroy_process_group()
    clear_dtensor_sharding_caches()
    fake_world(4)
    pd = _dims(4, dp_shard=2, tp=2)
    layout = SpmdLayout({"dp": V, "tp": V}, partition_spec=(("dp", "tp"),))
    local = _rep(pd).distribute(torch.arange(8.0), layout)
    assert local.tolist() == [0.0, 1.0]
    spec = st.get_partition_spec(local)
    assert spec[0] == (_axis(pd, "dp"), _axis(pd, "tp"))


def _typed_train_step(model: nn.Module, rep: sb.SpmdTypesRepresentation, plan: ShardingPlan | None = None,
                      *, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """One type-checked forward, loss and backward; returns ``(logits, loss)``."""
    plan = plan or llama3_plan()
    tokens, labels = prepare_inputs(torch.randint(0, 320, (2, seq)), torch.randint(0, 320, (2, seq)), rep)
    with rep.train_context(rep.forward_mesh, loss_parallel=True, typechecking=True):
        logits = model(tokens)
        loss = cross_entropy_loss(logits, labels, rep, logits_layout=plan.output_layout())
        loss.backward()
    return logits, loss


def _loss_types(loss: torch.Tensor, pd: ParallelDims) -> dict[str, Any]:
    axes = {st.MeshAxis.of(_rep(pd).forward_mesh.get_group(a)): a for a in ("dp", "tp") if pd.axis_size(a) > 1}
    return {axes[k]: v for k, v in st.get_local_type(loss).items()}


def _child_world(world: int) -> None:
    """In a forked child: a fresh fake process group (the parent has none)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world)


def _annotations_survive() -> None:
    from torchtitan_spmd.techniques.param_init import init_weights

    _child_world(2)
    pd = _dims(2, tp=2)
    with torch.device("meta"):  # as the trainer builds it
        model = Transformer(FLAVORS["tiny"])
    rep, states = _parallelize(pd, model)
    before = {n: (st.get_local_type(p), st.get_partition_spec(p)) for n, p in model.named_parameters()}
    assert all(p.is_meta for p in model.parameters())
    # Materialising replaces every parameter and buffer; the representation types them again.
    init_weights(model, states, rep, seed=0, device="cpu")
    after = {n: (st.get_local_type(p), st.get_partition_spec(p)) for n, p in model.named_parameters()}
    assert after == before and not any(p.is_meta for p in model.parameters())
    assert st.get_local_type(model.rope_cos)[_axis(pd, "tp")] is R
    # A buffer replaced later is typed again on request (the rest is left alone).
    model.rope_sin = torch.zeros_like(model.rope_sin)
    assert not st.has_local_type(model.rope_sin)
    assert rep.reannotate(model, states) == 1 and st.has_local_type(model.rope_sin)

    _, loss = _typed_train_step(model, rep)
    assert set(st.get_local_type(loss).values()) == {I}
    assert all(p.grad is not None for p in model.parameters())


def _typed_step_fsdp_tp(family: str) -> None:
    from torchtitan_spmd.models import get_model_spec

    _child_world(4)
    pd = _dims(4, dp_shard=2, tp=2)
    spec = get_model_spec(family)
    model, plan = spec.build_initialized("tiny", seed=0), spec.sharding_plan(None)
    rep, _ = _parallelize(pd, model, plan)
    logits, loss = _typed_train_step(model, rep, plan)
    assert logits.shape[-1] == 160  # vocab-parallel: this rank's half
    # Each rank's loss is its share of the global mean: partial on dp, invariant on tp.
    assert _loss_types(loss, pd) == {"dp": P, "tp": I}


def _typed_step_no_sp_no_loss_parallel() -> None:
    _child_world(2)
    pd = _dims(2, tp=2)
    model = build_model("tiny", seed=0)
    plan = llama3_plan(sequence_parallel=False, loss_parallel=False)
    rep, _ = _parallelize(pd, model, plan)
    logits, loss = _typed_train_step(model, rep, plan)
    assert logits.shape[-1] == 320  # gathered (I@tp) for a plain cross-entropy
    assert _loss_types(loss, pd) == {"tp": I}


def _replicated_loss_is_rejected() -> None:
    _child_world(2)
    pd = _dims(2, tp=2)
    rep = _rep(pd)
    tp = rep.forward_mesh.get_group("tp")
    x = torch.ones(3, requires_grad=True)
    st.assert_type(x, {tp: R})
    y = torch.ones(3, requires_grad=True)
    st.assert_type(y, {tp: S(0)})
    with rep.train_context(rep.forward_mesh, loss_parallel=True, typechecking=True):
        loss = (x * 2).sum()
        with pytest.raises(st.SpmdTypeError, match="only an invariant"):
            loss.backward()
        # A loss reduced to I is fine, and the backward itself runs unchecked.
        st.all_reduce((y * 2).sum(), tp, src=P, dst=I).backward()
    assert y.grad is not None


# Type-checked backward passes run in forked children (see spmd_helpers.in_child).
def test_annotations_survive_meta_init() -> None:
    in_child(_annotations_survive)


@needs_fsdp
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_typed_step_with_fsdp_and_tp(family: str) -> None:
    """The whole plan, FSDP included, passes the checker (fake collectives: types only)."""
    in_child(_typed_step_fsdp_tp, family)


def test_typed_step_without_sequence_or_loss_parallel() -> None:
    in_child(_typed_step_no_sp_no_loss_parallel)


def test_backward_of_a_replicated_loss_is_rejected() -> None:
    in_child(_replicated_loss_is_rejected)


# --------------------------------------------------------------------------- plan validation
@pytest.mark.parametrize("make_plan", [llama3_plan, qwen3_plan])
def test_family_plans_validate(make_plan: Callable[..., ShardingPlan]) -> None:
    for sp in (True, False):
        for lp in (True, False):
            redistribute.validate_redistributions(make_plan(sequence_parallel=sp, loss_parallel=lp))


def test_shard_order_change_is_rejected_at_setup() -> None:
    a = SpmdLayout({"dp": V, "tp": V}, partition_spec=(("dp", "tp"),))
    b = SpmdLayout({"dp": V, "tp": V}, partition_spec=(("tp", "dp"),))
    plan = ShardingPlan(modules={"block": ModulePlan(inputs=(Redistribute(a, b),))}, mesh_axes=("dp", "tp"))
    with pytest.raises(ValueError, match=r"plan 'block' input #0: .*shard order of tensor dim 0 \(the axes of tensor dim 0 would end in the wrong order"):
        redistribute.validate_redistributions(plan)
    # Moving a non-innermost axis also needs more than its own collective.
    c = SpmdLayout({"tp": S(0), "dp": S(1)})
    plan = ShardingPlan(modules={"block": ModulePlan(output=Redistribute(a, c))}, mesh_axes=("dp", "tp"))
    with pytest.raises(ValueError, match=r"plan 'block' output: .*axis 'dp' must move but is not the innermost axis of tensor dim 0"):
        redistribute.validate_redistributions(plan)
    # The same change is fine when one of the axes is size 1 on this mesh.
    redistribute.validate_redistributions(plan, mesh_axes=["dp"])


def test_rejected_plan_fails_parallelize(fake_world: Callable[[int], None]) -> None:
    fake_world(4)
    pd = _dims(4, dp_shard=2, tp=2)
    a = SpmdLayout({"dp": V, "tp": V}, partition_spec=(("dp", "tp"),))
    b = SpmdLayout({"dp": V, "tp": V}, partition_spec=(("tp", "dp"),))
    bad = ShardingPlan(modules={"norm": ModulePlan(inputs=(Redistribute(a, b),))})
    with pytest.raises(ValueError, match="shard order"):
        apply_plan(build_model("tiny", seed=0), bad, _rep(pd))


def test_one_collective_per_changed_axis(fake_world: Callable[[int], None], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_world(4)
    pd = _dims(4, dp_shard=2, tp=2)
    mesh = _rep(pd).forward_mesh
    calls: list[tuple[str, Any, Any]] = []

    def fake_redistribute(x: torch.Tensor, group: Any, *, src: Any, dst: Any,
                          backward_options: Any = None) -> torch.Tensor:
        assert backward_options is None  # float32: no reduced-precision gradient reduction
        name = next(n for n in ("dp", "tp") if mesh.get_group(n) is group)
        calls.append((name, src, dst))
        return x

    monkeypatch.setattr(redistribute.st, "redistribute", fake_redistribute)
    x = torch.zeros(4, 4)

    def run(src: Any, dst: Any) -> list[tuple[str, Any, Any]]:
        calls.clear()
        redistribute.redistribute_per_axis(x, mesh, src, dst)
        return list(calls)

    assert run({"tp": P}, {"tp": S(1)}) == [("tp", P, S(1))]  # reduce_scatter
    assert run({"tp": S(1)}, {"tp": R}) == [("tp", S(1), R)]  # all_gather
    assert run({"tp": R}, {"tp": S(1)}) == [("tp", R, S(1))]  # convert (local slice)
    assert run({"tp": P}, {"tp": R}) == [("tp", P, R)]  # all_reduce
    assert run({"tp": I}, {"tp": R}) == [("tp", I, R)]  # convert
    assert run({"tp": S(1)}, {"tp": S(1)}) == []
    # Two axes on one dim: unshard innermost (tp) first, then dp.
    both = SpmdLayout({"dp": V, "tp": V}, partition_spec=(("dp", "tp"),))
    assert run(both, SpmdLayout()) == [("tp", S(0), R), ("dp", S(0), R)]
    assert run(SpmdLayout(), both) == [("dp", R, S(0)), ("tp", R, S(0))]
    assert redistribute.redistribute_per_axis(x, None, {"tp": P}, {"tp": R}) is x


# --------------------------------------------------------------------------- FSDP meshes
@pytest.mark.parametrize(
    ("world", "degrees", "axes", "shard", "replicate"),
    [
        (1, {}, None, None, None),
        (4, {"dp_shard": 4}, ("dp_shard",), "dp_shard", None),
        (4, {"dp_shard": 2, "tp": 2}, ("dp_shard", "tp"), "dp_shard", None),
        (4, {"dp_replicate": 2, "dp_shard": 2}, ("dp_replicate", "dp_shard"), "dp_shard", "dp_replicate"),
        (4, {"dp_replicate": 2, "tp": 2}, ("dp_replicate", "tp"), None, "dp_replicate"),
        (2, {"tp": 2}, None, None, None),
    ],
)
@needs_fsdp
def test_fsdp_storage_mesh_holds_only_active_axes(fake_world: Callable[[int], None], world: int,
                                                  degrees: dict, axes: tuple, shard: Any, replicate: Any) -> None:
    fake_world(world)
    spec = _rep(_dims(world, **degrees)).fsdp_spec()
    if axes is None:
        assert spec is None  # no data parallelism: no FSDP
        return
    assert spec.mesh.mesh_dim_names == axes
    assert (spec.dp_mesh_dims.shard, spec.dp_mesh_dims.replicate) == (shard, replicate)


# --------------------------------------------------------------------------- runtime helpers
def test_current_mesh_stack_and_train_context(fake_world: Callable[[int], None]) -> None:
    fake_world(4)
    pd = _dims(4, dp_shard=2, tp=2)
    rep = _rep(pd)
    mesh = rep.forward_mesh
    mc = mesh_context
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert mc.current_spmd_mesh() is None
    with mc.set_current_spmd_mesh(mesh):
        assert mc.current_spmd_mesh() is mesh and st.current_mesh() is not None
        with mc.set_current_spmd_mesh(None):
            assert mc.current_spmd_mesh() is None
        assert mc.current_spmd_mesh() is mesh
    assert mc.current_spmd_mesh() is None and st.current_mesh() is None
    assert torch.autograd.is_multithreading_enabled()
    with rep.train_context(mesh, loss_parallel=True, typechecking=True):
        assert mc.current_spmd_mesh() is mesh
        assert not torch.autograd.is_multithreading_enabled()
        assert st.is_type_checking()
    assert torch.autograd.is_multithreading_enabled() and not st.is_type_checking()
    with rep.train_context(mesh, loss_parallel=True, typechecking=False):
        assert not st.is_type_checking()


@pytest.mark.parametrize(
    ("src", "dst", "groups"),
    [
        ((2, 32, 32), (2, 32, 2, 16), [([0], [0]), ([1], [1]), ([2], [2, 3])]),
        ((2, 32, 16), (2, 32, 1, 16), [([0], [0]), ([1], [1]), ([2], [2, 3])]),
        ((2, 32, 1, 2, 16), (2, 32, 2, 16), [([0], [0]), ([1], [1]), ([2, 3], [2]), ([4], [3])]),
        ((6,), (4,), None),
    ],
)
def test_view_groups(src: tuple, dst: tuple, groups: Any) -> None:
    assert typecheck._view_groups(src, dst) == groups


@pytest.mark.parametrize("typechecking", [True, False])
def test_the_trainer_type_checks_exactly_when_debug_spmd_typechecking_says(
        fake_world: Callable[[int], None], typechecking: bool) -> None:
    from torchtitan_spmd.train import Trainer

    fake_world(2)
    cfg = _cfg(data_parallel_shard_degree=1, tensor_parallel_degree=2)
    cfg.debug.spmd_typechecking = typechecking
    with closing(Trainer(cfg)) as trainer:
        assert not st.is_type_checking()
        with trainer.train_context():  # what the trainer's step runs forward and loss in
            assert st.is_type_checking() is typechecking

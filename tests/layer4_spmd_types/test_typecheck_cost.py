"""What makes the type checker cheaper checks no less.

- ``debug.spmd_typechecking_steps=N``: the trainer type-checks its first N steps,
  then trains unchecked. A type error planted to appear only from step 2 on is
  caught with the option unset (every step checked) and with N=2, and passes with N=1.
- The decision cache (``typecheck.DECISION_CACHE``): an op seen again with the same
  argument types, shapes and values gets the types the checker gave it the first
  time. In audit mode every replayed decision is compared with the checker's own,
  over whole type-checked steps of both model families; a planted bug still raises
  after the correct code filled the cache; errors, in-place ops and retyped inputs
  are never replayed.

Single process on torch's fake process group (types only), each in a forked child
(see ``spmd_helpers.in_child``), plus one 2-rank gloo run of the Megatron MLP.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from spmd_helpers import in_child, requires_torch

from torchtitan_spmd.launcher import run_forked

pytestmark = pytest.mark.backend("spmd_types")

needs_fsdp = requires_torch("2.14", "FSDP over spmd_types-annotated tensors")


def _child_world(world: int) -> None:
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world)


def _trainer(steps: int, checked_steps: int | None, model: str = "llama3", **parallelism: Any) -> Any:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.train import Trainer

    cfg = JobConfig.from_dict({
        "model": {"name": model, "flavor": "tiny"},
        "training": {"steps": steps, "local_batch_size": 2, "seq_len": 16, "device": "cpu"},
        "activation_checkpoint": {"mode": "none"},
        "parallelism": {"spmd_backend": "spmd_types", **parallelism},
        "debug": {"seed": 0, "spmd_typechecking": True, "spmd_typechecking_steps": checked_steps},
    })
    return Trainer(cfg)


# --------------------------------------------------------------------------- first N steps
def _checked_per_step(checked_steps: int | None, plant_from_step: int | None) -> dict[str, Any]:
    """Three steps on a fake 2-rank TP mesh; per step whether the checker was on in the
    forward. With ``plant_from_step``, from that step on the first block adds an invariant
    zero to its (sequence-sharded, varying) output: numerically nothing, a type error."""
    import spmd_types as st

    _child_world(2)
    trainer = _trainer(3, checked_steps, tensor_parallel_degree=2)
    tp = trainer.representation.forward_mesh.get_group("tp")
    zero = torch.zeros((), requires_grad=True)  # an invariant with a gradient cannot meet a varying
    st.assert_type(zero, {tp: st.I})
    step = [0]
    seen: list[bool] = []
    trainer.model.register_forward_pre_hook(lambda *_: seen.append(st.is_type_checking()))
    if plant_from_step is not None:
        trainer.model.layers["0"].register_forward_hook(
            lambda _m, _i, out: out + zero if step[0] >= plant_from_step else None)
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_spmd").addHandler(handler)
    logging.getLogger("torchtitan_spmd").setLevel(logging.INFO)
    try:
        for step[0] in range(1, 4):
            trainer.step(step[0])
    except st.SpmdTypeError as err:
        return {"seen": seen, "error_step": step[0], "error": str(err), "logs": logs}
    return {"seen": seen, "error_step": None, "logs": logs}


@pytest.mark.parametrize(("checked_steps", "expected"), [
    (None, [True, True, True]),
    (1, [True, False, False]),
    (2, [True, True, False]),
    (5, [True, True, True]),  # more than the run has
])
def test_the_trainer_type_checks_its_first_n_steps(checked_steps: int | None, expected: list[bool]) -> None:
    got = in_child(_checked_per_step, checked_steps, None)
    assert got["seen"] == expected and got["error_step"] is None
    off = [m for m in got["logs"] if "type checking off" in m]
    if False in expected:
        first_off = expected.index(False) + 1
        assert off == [f"type checking off from step {first_off} on: debug.spmd_typechecking_steps="
                       f"{checked_steps} checked the first {checked_steps} step(s) of this run"]
    else:
        assert off == []


@pytest.mark.parametrize(("checked_steps", "error_step"), [(None, 2), (2, 2), (1, None)])
def test_a_type_error_from_step_2_on_is_caught_only_while_checking(checked_steps: int | None,
                                                                   error_step: int | None) -> None:
    got = in_child(_checked_per_step, checked_steps, 2)
    assert got["error_step"] == error_step, got
    if error_step is not None:
        assert "Invariant type" in got["error"], got["error"]
    else:
        assert got["seen"] == [True, False, False]  # the plant ran unchecked on steps 2 and 3


# --------------------------------------------------------------------------- decision cache
def _audited_steps(family: str, world: int, parallelism: dict[str, int]) -> dict[str, int]:
    """Two type-checked train steps with every replayed decision checked against the checker."""
    from torchtitan_spmd.distributed.representations.spmd_types.typecheck import DECISION_CACHE

    _child_world(world)
    trainer = _trainer(2, None, family, **parallelism)
    DECISION_CACHE.clear()
    DECISION_CACHE.audit = True
    per_step = []
    for step in (1, 2):
        hits, misses = DECISION_CACHE.hits, DECISION_CACHE.misses
        trainer.step(step)  # raises AssertionError on any replayed decision the checker disagrees with
        per_step.append((DECISION_CACHE.hits - hits, DECISION_CACHE.misses - misses))
    return {"step1": per_step[0], "step2": per_step[1], "entries": len(DECISION_CACHE)}


@needs_fsdp
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_replayed_decisions_are_the_checkers_own(family: str) -> None:
    got = in_child(_audited_steps, family, 4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
                   timeout_s=120)
    (hits1, misses1), (hits2, misses2) = got["step1"], got["step2"]
    # Step 1 checks each distinct op once (the blocks repeat it); step 2 checks nothing new.
    assert misses1 > 0 and hits1 > misses1, got
    assert misses2 == 0 and hits2 > hits1, got


def test_replayed_decisions_without_data_parallel() -> None:
    got = in_child(_audited_steps, "llama3", 2, {"tensor_parallel_degree": 2})
    assert got["step2"][1] == 0 and got["step2"][0] > 0, got


def _megatron_rank(rank: int, world: int) -> dict[str, Any]:
    """The Megatron MLP of test_typecheck.py under the trainer's train context: twice
    correct (the second time every op is replayed), then without the ``convert``."""
    import spmd_types as st
    import torch.nn.functional as F
    from spmd_types import I, P, R, S
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_spmd.distributed.representations.spmd_types.typecheck import (
        DECISION_CACHE,
        spmd_train_context,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = mesh.get_group("tp")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).requires_grad_(True)
    w1 = torch.randn(16, 8, generator=gen).chunk(world, dim=0)[rank].clone().requires_grad_(True)
    w2 = torch.randn(8, 16, generator=gen).chunk(world, dim=1)[rank].clone().requires_grad_(True)
    st.assert_type(x, {tp: I})
    st.assert_type(w1, {tp: S(0)})
    st.assert_type(w2, {tp: S(1)})

    def forward(drop_convert: bool) -> torch.Tensor:
        h = x if drop_convert else st.convert(x, tp, src=I, dst=R)
        return st.all_reduce(F.relu(h @ w1.T) @ w2.T, tp, src=P, dst=I)

    DECISION_CACHE.clear()
    out: dict[str, Any] = {}
    with spmd_train_context(mesh, typechecking=True):
        forward(False)
        out["first"] = (DECISION_CACHE.hits, DECISION_CACHE.misses)
        forward(False)
        out["second"] = (DECISION_CACHE.hits, DECISION_CACHE.misses)
        try:
            forward(True)
        except st.SpmdTypeError as err:
            out["error"] = str(err)
    return out


@pytest.mark.multiproc
def test_a_planted_bug_is_caught_after_the_correct_code_filled_the_cache() -> None:
    import spmd_types.checker  # noqa: F401  (imported once, before forking)

    for r in run_forked(_megatron_rank, 2, timeout_s=120):
        first_hits, first_misses = r["first"]
        assert first_misses > 0 and r["second"] == (first_hits + first_misses, first_misses), r
        assert "Invariant type" in r["error"] and "[I, V]" in r["error"], r


def _cache_rules() -> dict[str, Any]:
    import spmd_types as st
    from spmd_types import I, P, R, S, V
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_spmd.distributed.representations.spmd_types.typecheck import (
        _ALWAYS_CHECK,
        DECISION_CACHE,
        _DecisionCache,
        spmd_train_context,
    )

    _child_world(2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp = mesh.get_group("tp")

    def typed(typ: Any, *shape: int, grad: bool = False) -> torch.Tensor:
        t = torch.ones(*(shape or (4, 6)), requires_grad=grad)
        st.assert_type(t, {tp: typ})
        return t

    # Typed outside the checker (inside it, torch.ones is typed R by itself).
    r, r64, s0, s1, inv = typed(R), typed(R).double(), typed(S(0)), typed(S(1)), typed(I, grad=True)
    i0, p0 = typed(I), typed(P)  # no partition spec, like r: only their local types tell them apart
    r_t, c = typed(R, 6, 4), typed(R)
    out: dict[str, Any] = {}
    DECISION_CACHE.clear()
    with spmd_train_context(mesh, typechecking=True):
        key = DECISION_CACHE.key
        # Everything the checker reads is in the key.
        out["keys_differ"] = len({
            key(torch.Tensor.add, (r, r), {}), key(torch.Tensor.add, (s0, r), {}),
            key(torch.Tensor.add, (s1, r), {}), key(torch.Tensor.add, (r, r_t.t()), {}),
            key(torch.Tensor.add, (r, r), {"alpha": 2}), key(torch.Tensor.add, (r, r), {"alpha": 2.0}),
            key(torch.Tensor.mul, (r, r), {}), key(torch.Tensor.add, (r, r64), {}),
            key(torch.Tensor.add, (i0, r), {}), key(torch.Tensor.add, (p0, r), {}),
            key(torch.Tensor.add, (inv, r), {}),
        })
        with torch.no_grad():
            out["grad_mode_in_key"] = key(torch.Tensor.add, (r, r), {}) != _key_in_grad_mode(key, r)
        # Never keyed: in-place, out=, autograd Functions, property reads, undescribable arguments.
        out["unkeyed"] = [
            key(torch.Tensor.add_, (r, r), {}), key(torch.add, (r, r), {"out": r}),
            key(torch.Tensor.__iadd__, (r, r), {}), key(torch.Tensor.add, (r, object()), {}),
            key(torch.Tensor.add, (r, st.Scalar(1.0, {tp: R})), {}),
        ]
        # The result types are the checker's; replayed they are the same.
        a = s0 + s0
        hits = DECISION_CACHE.hits
        b = s0 + s0
        out["replayed"] = (DECISION_CACHE.hits == hits + 1 and st.get_local_type(a) == st.get_local_type(b)
                           and st.get_partition_spec(a) == st.get_partition_spec(b) is not None)
        # An error is never recorded: the same bad op raises each time.
        errors = 0
        for _ in range(2):
            try:
                inv + s0
            except st.SpmdTypeError:
                errors += 1
        out["errors"] = errors
        # An in-place op goes to the checker every time (and is validated there).
        hits = DECISION_CACHE.hits
        c.mul_(2.0)
        c.mul_(2.0)
        out["inplace_hits"] = DECISION_CACHE.hits - hits
    # A result that is its input, retyped by the checker (a mutation), is never replayed.
    cache = _DecisionCache()
    x = typed(R)
    cache._record("k", {id(x): (((st.MeshAxis.of(tp), V),), None)}, x)
    out["retyped_input"] = cache._entries["k"] is _ALWAYS_CHECK
    return out


def _key_in_grad_mode(key: Any, r: torch.Tensor) -> Any:
    with torch.enable_grad():
        return key(torch.Tensor.add, (r, r), {})


def test_the_cache_key_and_what_is_never_replayed() -> None:
    got = in_child(_cache_rules)
    assert got["keys_differ"] == 11, got
    assert got["grad_mode_in_key"], got
    assert got["unkeyed"] == [None] * 5, got
    assert got["replayed"] and got["errors"] == 2 and got["inplace_hits"] == 0 and got["retyped_input"], got


def _declared_types_rules() -> dict[str, Any]:
    import spmd_types as st
    from spmd_types import R, S, V
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_spmd.distributed.representations.spmd_types import typecheck

    _child_world(2)
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)).get_group("tp")
    calls = [0]
    real = st.assert_type

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    typecheck.st.assert_type = counting  # the module's view of the library: count, then delegate
    try:
        declared = typecheck.DeclaredTypes()
        s0, key = {tp: S(0)}, typecheck.DeclaredTypes.key({tp: S(0)}, None)

        def typed(typ: Any) -> torch.Tensor:
            t = torch.ones(4, 6)
            real(t, {tp: typ})
            return t

        out: dict[str, Any] = {}
        for _ in range(3):  # already S(0): asserted once, then known to change nothing
            declared(typed(S(0)), s0, None, key)
        out["noop_calls"] = calls[0]
        calls[0] = 0
        refined = []
        for _ in range(2):  # V refined to S(0) each time: never skipped
            t = typed(V)
            declared(t, s0, None, key)
            refined.append(st.get_partition_spec(t) is not None)
        out["refined"], out["refine_calls"] = refined, calls[0]
        errors = 0
        for _ in range(2):  # a contradiction raises each time
            try:
                declared(typed(R), s0, None, key)
            except st.SpmdTypeError:
                errors += 1
        out["errors"] = errors
    finally:
        typecheck.st.assert_type = real
    return out


def test_declared_types_skip_only_asserts_that_change_nothing() -> None:
    got = in_child(_declared_types_rules)
    assert got == {"noop_calls": 1, "refined": [True, True], "refine_calls": 2, "errors": 2}, got

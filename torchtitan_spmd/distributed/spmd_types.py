"""Backend ``spmd_types``: plain local shards typed with ``spmd_types``, explicit collectives.

The fourth interpreter of the sharding plan (after ``default`` and ``full_dtensor``).
Nothing here is a DTensor during forward and backward: every parameter, buffer and
activation is a plain ``torch.Tensor`` holding this rank's shard, annotated with
its per-axis ``spmd_types`` type, and every change of layout is one explicit
``spmd_types`` collective. With ``--debug.spmd_typechecking`` the forward and the
loss run under ``spmd_types.checker.typecheck(local=False)``, which proves each of
those collectives is where it must be (a missing ``all_reduce`` is a type error
instead of a silently wrong gradient).

Interpretation of the plan on the forward/backward mesh ``(dp, cp, tp)`` of
:class:`~torchtitan_spmd.distributed.parallel_dims.ParallelDims` (active axes only):

- parameters and buffers: sliced in partition-spec order (``torch.chunk``
  semantics, as DTensor's ``Shard``) and annotated ``R`` on the data-parallel axes
  and the plan's type on the model axes; ``requires_grad`` is kept;
- inputs: tokens ``S(0)@dp, S(1)@cp, R@tp``; labels the same but ``I@tp``;
- module boundaries: a forward pre-hook (inputs) and a forward hook (output)
  issue one collective per changed axis (:func:`spmd_redistribute_per_axis`):
  ``P->S(d)`` reduce_scatter, ``S(d)->R`` all_gather, ``R->S(d)`` convert (a local
  slice), ``P->R`` all_reduce, ``I->R`` convert, ``S(i)->S(j)`` all_to_all.
  Plans needing anything else are rejected at setup
  (:func:`spmd_validate_redistributions`);
- ``local_compute`` modules run under ``spmd_types.local()`` and their output is
  stamped with the declared layout;
- FSDP2 ``fully_shard`` on the storage mesh (the active ones of
  ``dp_replicate, dp_shard, tp``) with ``DataParallelMeshDims`` (torch >= 2.14).
  FSDP also all-reduces, over ``tp``, the gradients of parameters replicated on
  ``tp`` (their gradient type is ``P``); without FSDP a gradient hook does it;
- the loss: vocab-parallel cross-entropy on local shards
  (:class:`VocabParallelCrossEntropy`), summed, all-reduced over ``dp`` to an
  invariant global sum and divided by the global count of non-ignored labels,
  so the loss *is* the global mean on every rank and FSDP must sum (not average)
  gradients;
- gradient clipping over the true global norm: per-parameter local sums of
  squares, all-reduced only over the axes the (storage) gradient is sharded on.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import spmd_types as st  # the library (absolute import), not this module
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spmd_types import I, P, R, S, V
from spmd_types.types import Shard
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from ._dtensor_common import clear_dtensor_sharding_caches
from .backends import SpmdBackendRuntime, describe_unsupported, reject_unimplemented_parallelism
from .layout import SpmdLayout, spmd_layout_to_dtensor_placements
from .plan import ModulePlan, Redistribute, ShardingPlan, boundary_dst, boundary_src

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig

    from .parallel_dims import ParallelDims

if not hasattr(st, "assert_type"):  # pragma: no cover - a packaging error
    raise ImportError(
        "torchtitan_spmd.distributed.spmd_types imported itself instead of the "
        "spmd_types library; do not run it with its own directory on sys.path."
    )

__all__ = [
    "BACKEND",
    "FSDP_MIN_TORCH",
    "SpmdTypesBackend",
    "VocabParallelCrossEntropy",
    "annotate_input_spmd_types",
    "annotate_module_states",
    "current_spmd_mesh",
    "resolve_fsdp_mesh",
    "set_current_spmd_mesh",
    "spmd_distribute_tensor",
    "spmd_forward_mesh",
    "spmd_layout_to_dtensor_placements",
    "spmd_mesh_size",
    "spmd_redistribute_per_axis",
    "spmd_validate_redistributions",
    "torch_version",
    "vocab_parallel_cross_entropy",
]

#: FSDP2 learned to shard spmd_types-annotated plain tensors in this torch release.
FSDP_MIN_TORCH: tuple[int, int] = (2, 14)

_DP = "dp"
_DP_STORAGE_AXES = ("dp_replicate", "dp_shard")
_FORWARD_AXES = ("dp", "cp", "tp")
_IGNORE_INDEX = -100


# ======================================================================================
# The current mesh (thread-local, like spmd_types' own stack).
# ======================================================================================
_TLS = threading.local()


def _mesh_stack() -> list[DeviceMesh | None]:
    stack = getattr(_TLS, "mesh_stack", None)
    if stack is None:
        stack = _TLS.mesh_stack = []
    return stack


def current_spmd_mesh() -> DeviceMesh | None:
    """The mesh set by the innermost :func:`set_current_spmd_mesh` on this thread, or None."""
    stack = _mesh_stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def set_current_spmd_mesh(mesh: DeviceMesh | None) -> Iterator[None]:
    """Make ``mesh`` the current mesh of this thread, here and in ``spmd_types``.

    ``None`` (a single-rank run: no active axis) is allowed and shadows outer meshes.
    The mesh is thread-local: autograd worker threads do not see it, which is why
    the train context turns autograd multithreading off.
    """
    stack = _mesh_stack()
    stack.append(mesh)
    try:
        if mesh is None or all(s == 1 for s in mesh.shape):
            yield
        else:
            with st.set_current_mesh(mesh):
                yield
    finally:
        popped = stack.pop()
        if popped is not mesh:
            raise RuntimeError("set_current_spmd_mesh contexts exited out of order.")


def spmd_mesh_size(axis: str) -> int:
    """The size of ``axis`` in the current mesh; 1 if there is none or it lacks the axis."""
    mesh = current_spmd_mesh()
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.size(names.index(axis)) if mesh is not None and axis in names else 1


def spmd_forward_mesh(parallel_dims: ParallelDims) -> DeviceMesh | None:
    """The forward/backward mesh: the active ones of ``(dp, cp, tp)``; None on one rank."""
    return parallel_dims.resolve_mesh(list(_FORWARD_AXES))


def _names(mesh: DeviceMesh | None) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def _active(mesh: DeviceMesh | None, axis: str) -> bool:
    names = _names(mesh)
    return mesh is not None and axis in names and mesh.size(names.index(axis)) > 1


def _group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    return mesh.get_group(axis)


# ======================================================================================
# Layouts -> spmd_types types.
# ======================================================================================
def _axis_kind(layout: SpmdLayout, axis: str) -> Any:
    """``R``, ``I``, ``P`` or ``S(dim)`` of ``axis`` in ``layout`` (``V`` spec axes -> ``S``)."""
    dims = layout.shard_dims()
    if axis in dims:
        return S(dims[axis])
    return layout.types.get(axis, R)


def _spmd_type(
    layout: SpmdLayout,
    mesh: DeviceMesh,
    *,
    axes: Sequence[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> tuple[dict[Any, Any], st.PartitionSpec | None]:
    """``(types, partition_spec)`` for ``assert_type``, keyed by process group.

    ``axes``: the axes to describe (default: those ``layout`` mentions); ``defaults``:
    types for axes ``layout`` does not mention (e.g. ``R`` on dp for parameters).
    Inactive axes are left out (spmd_types drops singleton axes anyway).
    """
    names = _names(mesh)
    if axes is None:
        axes = [a for a in names if a in layout.types or a in layout.shard_dims()]
        axes += [a for a in (defaults or {}) if a in names and a not in axes]
    types: dict[Any, Any] = {}
    spec: st.PartitionSpec | None = None
    multi = layout.partition_spec is not None and any(
        len(layout.shard_order(d)) > 1 for d in set(layout.shard_dims().values())
    )
    for axis in axes:
        if not _active(mesh, axis):
            continue
        if axis not in layout.types and axis not in layout.shard_dims() and defaults and axis in defaults:
            typ = defaults[axis]
        else:
            typ = _axis_kind(layout, axis)
        types[_group(mesh, axis)] = V if (multi and isinstance(typ, Shard)) else typ
    if multi:
        entries = []
        for entry in layout.partition_spec or ():
            group = (entry,) if isinstance(entry, str) else (entry or ())
            live = tuple(_group(mesh, a) for a in group if _active(mesh, a))
            entries.append(None if not live else live[0] if len(live) == 1 else live)
        spec = st.PartitionSpec(*entries)
    return types, spec


def _chunk(tensor: torch.Tensor, n: int, dim: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``n`` along ``dim``, as DTensor's ``Shard`` (empty past the end)."""
    chunks = torch.chunk(tensor, n, dim=dim)
    if index < len(chunks):
        return chunks[index]
    shape = list(tensor.shape)
    shape[dim] = 0
    return tensor.new_empty(shape)


def spmd_distribute_tensor(
    tensor: torch.Tensor,
    mesh: DeviceMesh | None,
    layout: SpmdLayout,
) -> torch.Tensor:
    """This rank's shard of the full ``tensor`` under ``layout``, annotated.

    Axes sharding the same dim are applied in partition-spec order (outermost
    first): ``(dp, tp)`` on dim 0 chunks by ``dp``, then each ``dp`` chunk by ``tp``.
    Chunking follows ``torch.chunk`` like DTensor's ``Shard`` (uneven splits give the
    last ranks smaller, possibly empty, shards). The result is annotated with
    ``spmd_types.assert_type`` on every active axis of ``mesh``: the layout's
    types, and ``R`` on the axes it does not mention (the data-parallel axes must
    be ``R`` for FSDP, and FSDP wants every storage axis annotated).
    """
    if mesh is None:
        return tensor
    with torch.no_grad():
        local = tensor
        dims = layout.shard_dims()
        for dim in sorted(set(dims.values())):
            for axis in layout.shard_order(dim):
                if _active(mesh, axis):
                    local = _chunk(local, mesh.size(_names(mesh).index(axis)), dim,
                                   mesh.get_local_rank(axis))
        if local is tensor:
            local = tensor.detach()
        local = local.contiguous()
    types, spec = _state_type(layout, mesh)
    if types:
        st.assert_type(local, types, partition_spec=spec)
    return local


def _state_type(layout: SpmdLayout, mesh: DeviceMesh) -> tuple[dict[Any, Any], st.PartitionSpec | None]:
    """The type of a parameter/buffer: ``layout`` on its axes, ``R`` on every other active axis."""
    return _spmd_type(layout, mesh, axes=[a for a in _names(mesh) if _active(mesh, a)],
                      defaults=dict.fromkeys(_names(mesh), R))


def _annotate(tensor: torch.Tensor, types: dict[Any, Any], spec: st.PartitionSpec | None) -> None:
    if types and isinstance(tensor, torch.Tensor) and not _is_dtensor(tensor):
        st.assert_type(tensor, types, partition_spec=spec)


def _is_dtensor(x: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


# ======================================================================================
# Inputs.
# ======================================================================================
def annotate_input_spmd_types(
    parallel_dims: ParallelDims,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    extra_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Annotate a local batch: tokens (and ``positions``) ``S(0)@dp, S(1)@cp, R@tp``;
    labels ``S(0)@dp, S(1)@cp, I@tp`` (every TP rank computes the same loss).

    Returns ``(inputs, labels, extra_kwargs)`` (annotated in place).
    """
    extra_kwargs = dict(extra_kwargs or {})
    mesh = spmd_forward_mesh(parallel_dims)
    if mesh is None:
        return inputs, labels, extra_kwargs
    base = {"dp": S(0), "cp": S(1)}
    tokens_t = {_group(mesh, a): t for a, t in {**base, "tp": R}.items() if _active(mesh, a)}
    labels_t = {_group(mesh, a): t for a, t in {**base, "tp": I}.items() if _active(mesh, a)}
    if tokens_t:
        st.assert_type(inputs, tokens_t)
        st.assert_type(labels, labels_t)
        positions = extra_kwargs.get("positions")
        if isinstance(positions, torch.Tensor):
            st.assert_type(positions, tokens_t)
    return inputs, labels, extra_kwargs


# ======================================================================================
# Redistribution: validation at setup, one collective per changed axis at run time.
# ======================================================================================
#: The one spmd_types operation behind each per-axis change (kinds: R, I, P, S).
_OPS: dict[tuple[str, str], str] = {
    ("P", "R"): "all_reduce",
    ("P", "I"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("S", "R"): "all_gather",
    ("S", "I"): "all_gather",
    ("S", "S"): "all_to_all",
    ("S", "P"): "convert (zero-pad)",
    ("R", "S"): "convert (local slice)",
    ("I", "S"): "convert (local slice)",
    ("R", "I"): "convert",
    ("I", "R"): "convert",
    ("R", "P"): "convert",
    ("I", "P"): "convert",
}


def _kind(typ: Any) -> str:
    return "S" if isinstance(typ, Shard) else repr(typ)


@dataclass(frozen=True)
class _Step:
    """One single-axis ``spmd_types.redistribute`` of a boundary."""

    axis: str
    src: Any
    dst: Any
    op: str


def _plan_steps(src: SpmdLayout, dst: SpmdLayout, axes: Sequence[str] | None, where: str) -> list[_Step]:
    """The ordered single-axis steps from ``src`` to ``dst``, or ValueError.

    ``axes``: the mesh axes that exist (others are size 1 and skipped); None: all.
    Unsharding steps run innermost-first, then re-shardings, then new shardings,
    each checked against the per-dim shard order so that every collective acts on
    the innermost axis of its tensor dim (the only one a single collective can move).
    """
    mentioned = set(src.types) | set(src.shard_dims()) | set(dst.types) | set(dst.shard_dims())
    if axes is not None:
        mentioned &= set(axes)
    changed: dict[str, tuple[Any, Any]] = {}
    for axis in sorted(mentioned):
        a, b = _axis_kind(src, axis), _axis_kind(dst, axis)
        if a != b:
            pair = (_kind(a), _kind(b))
            if pair not in _OPS:
                raise ValueError(
                    f"{where}: changing mesh axis {axis!r} from {a!r} to {b!r} needs more than "
                    "one collective; spmd_redistribute_per_axis issues exactly one per axis. "
                    "Split it over two plan boundaries or write the collectives explicitly."
                )
            changed[axis] = (a, b)

    def order(layout: SpmdLayout) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for dim in set(layout.shard_dims().values()):
            live = [a for a in layout.shard_order(dim) if axes is None or a in axes]
            if live:
                out[dim] = live
        return out

    state, want = order(src), order(dst)
    removals = [a for a, (x, y) in changed.items() if isinstance(x, Shard) and not isinstance(y, Shard)]
    moves = [a for a, (x, y) in changed.items() if isinstance(x, Shard) and isinstance(y, Shard)]
    additions = [a for a, (x, y) in changed.items() if not isinstance(x, Shard) and isinstance(y, Shard)]
    others = [a for a in changed if a not in removals + moves + additions]
    # Innermost-first removal: deeper in the src shard order goes first.
    depth = {a: i for dim_axes in state.values() for i, a in enumerate(dim_axes)}
    removals.sort(key=lambda a: -depth[a])
    dst_depth = {a: i for dim_axes in want.values() for i, a in enumerate(dim_axes)}
    additions.sort(key=lambda a: dst_depth[a])

    steps: list[_Step] = []

    def fail(dim: int, axis: str | None = None) -> ValueError:
        why = (f"mesh axis {axis!r} must move but is not the innermost axis of tensor dim {dim}"
               if axis is not None else
               f"the axes of tensor dim {dim} would end in the wrong order")
        return ValueError(
            f"{where}: redistributing {src!r} -> {dst!r} changes the shard order of tensor dim "
            f"{dim} ({why}); spmd_redistribute_per_axis only moves the innermost axis of a dim, "
            "one collective per axis. Write this boundary as explicit collectives instead."
        )

    for axis in removals + moves:
        a, b = changed[axis]
        if state.get(a.dim, [None])[-1] != axis:
            raise fail(a.dim, axis)
        state[a.dim].pop()
        if not state[a.dim]:
            del state[a.dim]
        if isinstance(b, Shard) and axis in moves:
            continue
        steps.append(_Step(axis, a, b, _OPS[(_kind(a), _kind(b))]))
    for axis in moves + additions:
        a, b = changed[axis]
        state.setdefault(b.dim, []).append(axis)
        steps.append(_Step(axis, a, b, _OPS[(_kind(a), _kind(b))]))
    if state != want:
        raise fail(min(d for d in set(state) | set(want) if state.get(d) != want.get(d)))
    for axis in others:
        a, b = changed[axis]
        steps.append(_Step(axis, a, b, _OPS[(_kind(a), _kind(b))]))
    return steps


def spmd_validate_redistributions(plan: ShardingPlan, mesh_axes: Sequence[str] | None = None) -> None:
    """Reject, at setup, plan boundaries :func:`spmd_redistribute_per_axis` cannot run.

    Every ``Redistribute(src, dst)`` must change each mesh axis with exactly one
    collective and may only move the innermost axis of a tensor dim (no change of
    shard order, e.g. ``(dp, tp) -> (tp, dp)`` on one dim). ``mesh_axes``: the axes
    that exist (size-1 axes are skipped); None checks every axis.

    Raises ValueError naming the module pattern and the boundary.
    """
    for pattern, mplan in plan.modules.items():
        bounds = [(f"input #{i}", b) for i, b in enumerate(mplan.inputs)] + [("output", mplan.output)]
        for what, b in bounds:
            if isinstance(b, Redistribute):
                _plan_steps(b.src, b.dst, mesh_axes, f"plan {pattern!r} {what}")


def spmd_redistribute_per_axis(
    x: torch.Tensor,
    mesh: DeviceMesh | None,
    src: SpmdLayout | Mapping[str, Any],
    dst: SpmdLayout | Mapping[str, Any],
) -> torch.Tensor:
    """Redistribute local tensor ``x`` from ``src`` to ``dst``: one collective per changed axis.

    ``src``/``dst`` are :class:`SpmdLayout` s or ``{axis name: R|I|P|S(d)}`` mappings.
    Axes of size 1 or missing from ``mesh`` are skipped. Each step is one
    ``spmd_types.redistribute`` on that axis's process group (reduce_scatter,
    all_gather, all_reduce, all_to_all, or a local convert); see the module docstring.
    """
    if mesh is None:
        return x
    src_l = src if isinstance(src, SpmdLayout) else SpmdLayout(dict(src))
    dst_l = dst if isinstance(dst, SpmdLayout) else SpmdLayout(dict(dst))
    live = [a for a in _names(mesh) if _active(mesh, a)]
    for step in _plan_steps(src_l, dst_l, live, "spmd_redistribute_per_axis"):
        x = st.redistribute(x, _group(mesh, step.axis), src=step.src, dst=step.dst)
    return x


# ======================================================================================
# The interpreter: parameters, buffers and boundary hooks.
# ======================================================================================
def _set_module_tensor(module: nn.Module, name: str, value: torch.Tensor,
                       types: dict[Any, Any], spec: st.PartitionSpec | None) -> None:
    """Replace parameter/buffer ``name`` with ``value`` (same kind, same ``requires_grad``), annotated."""
    if name in module._parameters:
        old = module._parameters[name]
        param = nn.Parameter(value, requires_grad=old.requires_grad if old is not None else True)
        _annotate(param, types, spec)
        module._parameters[name] = param
    else:
        _annotate(value, types, spec)
        module._buffers[name] = value


@dataclass
class _StateSpec:
    module: nn.Module
    name: str
    types: dict[Any, Any]
    spec: st.PartitionSpec | None


def annotate_module_states(model: nn.Module) -> int:
    """(Re-)annotate every parameter and buffer that :func:`apply_spmd_plan` typed but
    which lost its annotation (``to_empty()`` and re-initialisation replace buffers).

    Plain tensors only (FSDP's DTensor storage is skipped: FSDP restores the types of
    the parameters it gathers). Returns how many tensors were annotated. Runs
    automatically before every type-checked forward.
    """
    count = 0
    for s in getattr(model, "_spmd_state_specs", ()):
        t = s.module._parameters.get(s.name) if s.name in s.module._parameters else s.module._buffers.get(s.name)
        if isinstance(t, torch.Tensor) and not _is_dtensor(t) and not st.has_local_type(t):
            _annotate(t, s.types, s.spec)
            count += 1
    return count


def _root_pre_hook(model: nn.Module, args: tuple[Any, ...]) -> None:
    if st.is_type_checking():
        annotate_module_states(model)


def _check_arrival(x: Any, layout: SpmdLayout | None, mesh: DeviceMesh, axes: Sequence[str]) -> None:
    """Under the checker, assert the plan's declared layout on the plan axes."""
    if layout is None or not isinstance(x, torch.Tensor) or not st.is_type_checking():
        return
    types, spec = _spmd_type(layout, mesh, axes=[a for a in axes if _active(mesh, a)])
    if types and spec is None:
        st.assert_type(x, types)
    elif types:
        st.assert_type(x, types, partition_spec=spec)


def _install_hooks(fqn: str, module: nn.Module, mplan: ModulePlan, mesh: DeviceMesh,
                   axes: Sequence[str]) -> None:
    def move(x: Any, b: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        _check_arrival(x, boundary_src(b), mesh, axes)
        if isinstance(b, Redistribute):
            x = spmd_redistribute_per_axis(x, mesh, b.src, b.dst)
        return x

    def pre_hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(args)
        for i, b in enumerate(mplan.inputs[: len(args)]):
            out[i] = move(args[i], b)
        return tuple(out)

    def post_hook(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return move(output, mplan.output)

    if mplan.inputs:
        module.register_forward_pre_hook(pre_hook)
    if mplan.output is not None:
        module.register_forward_hook(post_hook)
    if mplan.local_compute:
        out_layout = boundary_dst(mplan.output)
        if out_layout is None:
            raise ValueError(f"plan for {fqn!r}: local_compute needs an output layout.")
        forward = module.forward
        dp_types = {a: S(0) for a in ("dp",) if _active(mesh, a)}

        @functools.wraps(forward)
        def local_forward(*args: Any, **kwargs: Any) -> Any:
            if not st.is_type_checking():
                return forward(*args, **kwargs)
            with st.local():
                out = forward(*args, **kwargs)
            # Back to global typing: stamp the declared layout (batch S(0) on dp).
            full = out_layout.with_types(**dp_types) if dp_types else out_layout
            types, spec = _spmd_type(full, mesh, axes=[a for a in _names(mesh) if _active(mesh, a)])
            if types:
                st.assert_type(out, types, partition_spec=spec)
            return out

        module.forward = local_forward  # type: ignore[method-assign]


def _param_grad_allreduce_hook(group: dist.ProcessGroup) -> Any:
    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)

    return hook


def apply_spmd_plan(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh | None,
                    *, gather_logits: bool = False) -> nn.Module:
    """Shard ``model``'s parameters/buffers per ``plan`` on ``mesh`` and install the hooks.

    ``gather_logits``: all-gather the vocab-sharded logits (loss parallel off).
    Validates the plan's redistributions first (:func:`spmd_validate_redistributions`).
    """
    live = [a for a in _names(mesh) if _active(mesh, a)]
    spmd_validate_redistributions(plan, live)
    if mesh is None:
        return model
    specs: list[_StateSpec] = []
    for _, module, name, layout in plan.param_layouts(model):
        full = getattr(module, name)
        if full is None:
            continue
        local = spmd_distribute_tensor(full.detach(), mesh, layout)
        types, spec = _state_type(layout, mesh)
        _set_module_tensor(module, name, local, types, spec)
        specs.append(_StateSpec(module, name, types, spec))
    model._spmd_state_specs = specs  # type: ignore[assignment]
    model.register_forward_pre_hook(_root_pre_hook)
    for fqn, module, mplan in plan.resolve(model):
        _install_hooks(fqn, module, mplan, mesh, plan.mesh_axes)
    if gather_logits and _active(mesh, "tp"):
        out_layout = boundary_dst(dict((f, p) for f, _, p in plan.resolve(model))[plan.output_module].output)
        vocab = out_layout.shard_dims().get("tp") if out_layout is not None else None
        if vocab is not None:
            tp = _group(mesh, "tp")

            def gather(_: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
                # dst=I: every TP rank then computes the same loss; the backward is a slice.
                return st.all_gather(out, tp, src=S(vocab), dst=I)

            model.register_forward_hook(gather)
    return model


def _register_tp_grad_reduction(model: nn.Module, mesh: DeviceMesh) -> None:
    """Without FSDP: sum, over ``tp``, the gradients of parameters replicated on ``tp``.

    Their gradient type is ``P@tp`` (each TP rank holds the contribution of its
    sequence/vocab shard); FSDP does this itself when it is applied.
    """
    if not _active(mesh, "tp"):
        return
    tp = _group(mesh, "tp")
    tp_axis = st.MeshAxis.of(tp)
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if st.get_local_type(param).get(tp_axis, R) is R:
            param.register_post_accumulate_grad_hook(_param_grad_allreduce_hook(tp))


# ======================================================================================
# FSDP.
# ======================================================================================
def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch (a seam for tests)."""
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match is None:  # pragma: no cover - odd local builds
        return (0, 0)
    return int(match.group(1)), int(match.group(2))


def _check_fsdp_support(parallel_dims: ParallelDims) -> None:
    if not parallel_dims.dp_enabled:
        return
    have = torch_version()
    if have < FSDP_MIN_TORCH:
        need = ".".join(map(str, FSDP_MIN_TORCH))
        raise ValueError(
            describe_unsupported(
                "spmd_types",
                f"data-parallel sharding (dp_replicate={parallel_dims.dp_replicate}, "
                f"dp_shard={parallel_dims.dp_shard}) on torch {'.'.join(map(str, have))}",
                f"it needs torch >= {need} (FSDP2's support for spmd_types-annotated plain "
                f"tensors). Upgrade torch to {need} or newer, or use "
                "parallelism.spmd_backend='default'.",
            )
        )


def resolve_fsdp_mesh(parallel_dims: ParallelDims) -> tuple[DeviceMesh, Any | None]:
    """The FSDP storage mesh and its ``DataParallelMeshDims`` (None for a 1-rank mesh).

    The storage mesh holds only axes larger than 1 among ``dp_replicate, dp_shard,
    tp`` (a size-1 axis in it makes FSDP reject the annotations as incomplete);
    with none, it is the 1-rank ``dp_shard`` mesh and no mesh dims are passed.
    """
    from torch.distributed.fsdp import DataParallelMeshDims

    names = [a for a in (*_DP_STORAGE_AXES, "tp") if parallel_dims.axis_size(a) > 1]
    if not names:
        mesh = parallel_dims.get_optional_mesh("dp_shard", include_singleton_axes=True)
        assert mesh is not None
        return mesh, None
    mesh = parallel_dims.get_optional_mesh(names, include_singleton_axes=True)
    assert mesh is not None
    dp = [a for a in names if a in _DP_STORAGE_AXES]
    if not dp:
        return mesh, None
    return mesh, DataParallelMeshDims(
        shard="dp_shard" if "dp_shard" in dp else None,
        replicate="dp_replicate" if "dp_replicate" in dp else None,
    )


def _apply_fsdp(model: nn.Module, plan: ShardingPlan, parallel_dims: ParallelDims) -> None:
    from torch.distributed.fsdp import fully_shard

    storage, dims = resolve_fsdp_mesh(parallel_dims)
    clear_dtensor_sharding_caches()
    kwargs: dict[str, Any] = {"mesh": storage}
    if dims is not None and storage.size() > 1:
        kwargs["dp_mesh_dims"] = dims
    for unit in [*plan.fsdp_unit_modules(model), model]:
        fully_shard(unit, **kwargs)
        # The loss is already the global mean (see compute_loss): FSDP must sum
        # across DP, not average (and gloo has no PREMUL_SUM for a divide factor).
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


# ======================================================================================
# Loss: vocab-parallel cross-entropy on local shards.
# ======================================================================================
class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits, on local tensors.

    ``logits``: ``[N, V_local]`` (this TP rank's contiguous vocab chunk, ``torch.chunk``
    order, so uneven splits work); ``labels``: ``[N]`` global ids, the same on every
    TP rank (``I@tp``); rows whose label is ``ignore_index`` give 0. Returns ``[N]``
    float32 losses, identical on every TP rank (``I@tp``), so the backward needs no
    collective. Forward: one MAX all-reduce (row maxima, and the chunk size) and one
    SUM all-reduce (exp-sums and target logits) over ``group``.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,
                group: dist.ProcessGroup, ignore_index: int) -> torch.Tensor:
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        n, v_local = logits.shape
        rank = dist.get_rank(group)
        # One MAX all-reduce: the row maxima and the chunk size (rank 0's, the largest).
        packed = torch.cat([
            logits.amax(dim=1) if v_local else logits.new_full((n,), float("-inf")),
            logits.new_tensor([float(v_local)]),
        ])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        row_max, chunk = packed[:n], int(packed[n].item())
        start = rank * chunk
        shifted = logits - row_max.unsqueeze(1)
        exp = shifted.exp()
        in_range = (labels >= start) & (labels < start + v_local)
        local_idx = torch.where(in_range, labels - start, torch.zeros_like(labels))
        target = shifted.gather(1, local_idx.unsqueeze(1)).squeeze(1) if v_local else shifted.new_zeros(n)
        target = torch.where(in_range, target, torch.zeros_like(target))
        sums = torch.stack([exp.sum(dim=1), target])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target = sums[0], sums[1]
        valid = labels != ignore_index
        loss = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target))
        softmax = exp.div_(sum_exp.unsqueeze(1))
        ctx.save_for_backward(softmax, in_range & valid, local_idx, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, hit, local_idx, valid = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[1]:
            grad.scatter_add_(1, local_idx.unsqueeze(1), -hit.to(grad.dtype).unsqueeze(1))
        grad.mul_((grad_out * valid.to(grad.dtype)).unsqueeze(1))
        return grad.to(ctx.input_dtype), None, None, None

    @staticmethod
    def spmd_typecheck(out: torch.Tensor, *, logits: torch.Tensor, labels: torch.Tensor,
                       group: dist.ProcessGroup) -> None:
        """Vocab-sharded (``V``, last dim) logits and invariant labels give invariant losses."""
        st.assert_type(logits, {group: S(-1)})
        st.assert_type(labels, {group: I})
        st.assert_type_like(out, labels)


st.register_autograd_function(VocabParallelCrossEntropy)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                 group: dist.ProcessGroup, *,
                                 ignore_index: int = _IGNORE_INDEX) -> torch.Tensor:
    """Per-token losses ``[N]`` of vocab-sharded ``logits [N, V_local]`` (see the class)."""
    return VocabParallelCrossEntropy.apply(logits, labels, group, ignore_index)


# ======================================================================================
# The train context.
# ======================================================================================
def _loss_parallel_stack() -> list[bool]:
    stack = getattr(_TLS, "loss_parallel", None)
    if stack is None:
        stack = _TLS.loss_parallel = []
    return stack


@contextlib.contextmanager
def _loss_parallel(enabled: bool) -> Iterator[None]:
    stack = _loss_parallel_stack()
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()


def _view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair up the dims of a view ``src -> dst`` into minimal groups of equal size.

    Returns ``[(src dims, dst dims), ...]`` covering both shapes in order, or None
    if the shapes do not line up (not a plain view). Size-1 dims join the group
    that follows them (or the last one).
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi: list[int] = []
        gj: list[int] = []
        a = b = 1
        while not (gi and gj and a == b != 1):
            if a <= b and i < len(src):
                a *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                b *= dst[j]
                gj.append(j)
                j += 1
            elif i < len(src):
                a *= src[i]
                gi.append(i)
                i += 1
            else:
                break
        if a != b:
            return None
        if groups and (not gi or not gj or a == 1):
            groups[-1][0].extend(gi)
            groups[-1][1].extend(gj)
        else:
            groups.append((gi, gj))
    return groups


_VIEW_FUNCS = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape)


def _view_target(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], numel: int) -> list[int] | None:
    """The resolved target shape of ``view``/``reshape`` (``-1`` filled in), or None."""
    if func is torch.reshape:
        sizes = args[1] if len(args) > 1 else kwargs.get("shape")
    elif len(args) == 2 and not isinstance(args[1], int):
        sizes = args[1]
    else:
        sizes = args[1:] or kwargs.get("size") or kwargs.get("shape")
    if not isinstance(sizes, tuple | list | torch.Size) or not all(isinstance(d, int) for d in sizes):
        return None  # e.g. view(dtype), or symbolic sizes
    out = list(sizes)
    if out.count(-1) == 1:
        known = math.prod(d for d in out if d != -1)
        if known == 0:
            return None
        out[out.index(-1)] = numel // known
    return out if math.prod(out) == numel else None


def _global_view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view/reshape that splits or merges a sharded dim, typed by the even-shard rule.

    ``typecheck(local=False)`` propagates shardings through DTensor's view rules, and
    the checker refuses to split a sharded dim (``[b, s, features/tp] -> [b, s,
    heads/tp, head_dim]``) because it cannot know that the shards are even. They are
    here (every rank's local shape is the same), so a local view keeps the shard on
    the outermost dim of its group (the heads): the op runs under
    ``spmd_types.local()`` and the result gets the moved partition spec. Returns
    ``NotImplemented`` where that rule does not apply; the checker then decides.
    """
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return NotImplemented
    spec = st.get_partition_spec(x)
    if spec is None or all(e is None for e in spec):
        return NotImplemented
    target = _view_target(func, args, kwargs, x.numel())
    groups = _view_groups(tuple(x.shape), target) if target is not None else None
    if groups is None:
        return NotImplemented
    new_spec: list[Any] = [None] * len(target)
    for gi, gj in groups:
        sharded = [d for d in gi if spec[d] is not None]
        if len(gi) == 1 and len(gj) == 1:
            new_spec[gj[0]] = spec[gi[0]]
        elif sharded:
            first = sharded[0]
            # Exact only for one sharded dim that is outermost (all dims before it are 1).
            if len(sharded) > 1 or any(x.shape[d] != 1 for d in gi[: gi.index(first)]) or not gj:
                return NotImplemented
            new_spec[gj[0]] = spec[first]
    if all(len(gi) == 1 and len(gj) == 1 for gi, gj in groups if any(spec[d] is not None for d in gi)):
        return NotImplemented  # sharded dims map 1:1: the checker's own rule handles it
    with st.local():
        out = func(*args, **kwargs)
    st.assert_type(out, dict(st.get_local_type(out)) or dict(st.get_local_type(x)),
                   partition_spec=st.PartitionSpec(*new_spec))
    return out


class _GlobalTypingShim(TorchFunctionMode):
    """Pushed inside ``typecheck(local=False)``; sees every op first.

    - ``backward()``: checks the loss is ``I`` or ``P`` on every axis (the implicit
      1.0 seed is invariant), then runs the whole backward (collectives' backwards,
      FSDP's reduce-scatters) under ``no_typecheck()``: only forward and loss are typed.
      ``torch.autograd.grad`` runs unchecked too.
    - ``view``/``reshape`` that split a sharded dim (attention's head split): see
      :func:`_global_view`.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.autograd.grad:
            with st.no_typecheck():
                return func(*args, **kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            loss = args[0] if args else kwargs.get("tensors")
            explicit = kwargs.get("gradient", kwargs.get("grad_tensors", args[1] if len(args) > 1 else None))
            if isinstance(loss, torch.Tensor) and explicit is None and st.is_type_checking():
                for axis, typ in st.get_local_type(loss).items():
                    if typ is not I and typ is not P:
                        raise st.SpmdTypeError(
                            f"backward() on a loss typed {typ} on mesh axis {axis}: only an "
                            "invariant (I) or partial (P) loss gives correct gradients with the "
                            "implicit 1.0 seed. Reduce it with all_reduce(..., dst=I)."
                        )
            with st.no_typecheck():
                return func(*args, **kwargs)
        if func in _VIEW_FUNCS and st.is_type_checking():
            out = _global_view(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if _is_autograd_apply(func):
            # A bare ``Function.apply`` does not re-dispatch to the modes below this
            # one (the checker) by itself: hand it on explicitly.
            tensors = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            if tensors and has_torch_function(tensors):
                return handle_torch_function(func, tensors, *args, **kwargs)
        return func(*args, **kwargs)


def _is_autograd_apply(func: Any) -> bool:
    owner = getattr(func, "__self__", None)
    return (getattr(func, "__name__", None) == "apply" and isinstance(owner, type)
            and issubclass(owner, torch.autograd.Function))


@contextlib.contextmanager
def _train_context(mesh: DeviceMesh | None, loss_parallel: bool, typechecking: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        # The current mesh is thread-local: keep autograd (and activation-checkpoint
        # recompute) on this thread, or collectives would silently see no mesh.
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(set_current_spmd_mesh(mesh))
        stack.enter_context(_loss_parallel(loss_parallel))
        if typechecking:
            from spmd_types.checker import typecheck

            stack.enter_context(typecheck(local=False))
            stack.enter_context(_GlobalTypingShim())
        yield


# ======================================================================================
# The backend.
# ======================================================================================
_AXIS_ORDER = ("pp", "dp_replicate", "dp_shard", "dp", "fsdp", "cp", "tp", "efsdp", "ep")


def _is_shard(placement: Any) -> bool:
    """``Shard`` or ``_StridedShard`` (FSDP's dp shard under TP; not a ``Shard`` subclass)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def _axis_order(name: str) -> tuple[int, str]:
    return (_AXIS_ORDER.index(name) if name in _AXIS_ORDER else len(_AXIS_ORDER), name)


def _clip_grad_norm(model: nn.Module, max_norm: float, mesh: DeviceMesh | None) -> float:
    """Clip over the global 2-norm of local gradient shards; return the norm.

    Each gradient's local sum of squares is summed over exactly the axes its
    (storage) layout shards it on: DTensor gradients (FSDP) by their ``Shard``
    placements, plain ones by their ``V`` spmd_types axes. Replicated axes are
    never summed, so nothing is counted twice.
    """
    from torch.distributed.tensor import DTensor, Partial

    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    axis_names: dict[Any, str] = {}  # MeshAxis -> name, for plain (non-FSDP) gradients
    groups: dict[str, dist.ProcessGroup] = {}
    for name in _names(mesh):
        if _active(mesh, name):
            assert mesh is not None
            axis_names[st.MeshAxis.of(_group(mesh, name))] = name
            groups[name] = _group(mesh, name)
    # Buckets keyed by the names of the axes to sum over, in one rank-independent
    # order, so that every rank issues the same collectives in the same order.
    buckets: dict[tuple[str, ...], list[torch.Tensor]] = {}
    grads: list[torch.Tensor] = []
    for p in params:
        g = p.grad
        reduce_over: list[str] = []
        if isinstance(g, DTensor):
            dim_names = g.device_mesh.mesh_dim_names or ()
            for i, placement in enumerate(g.placements):
                if isinstance(placement, Partial):
                    raise RuntimeError("clip_grad_norm_: a gradient is still Partial after backward.")
                if _is_shard(placement) and g.device_mesh.size(i) > 1:
                    reduce_over.append(dim_names[i])
                    groups.setdefault(dim_names[i], g.device_mesh.get_group(i))
            local = g.to_local()
        else:
            local = g
            reduce_over = [axis_names[a] for a, t in st.get_local_type(p).items()
                           if t is V and a in axis_names]
        key = tuple(sorted(reduce_over, key=_axis_order))
        buckets.setdefault(key, []).append(local.detach().float().pow(2).sum())
        grads.append(g)
    keys = list(buckets)
    sums = torch.stack([torch.stack(buckets[k]).sum() for k in keys])
    for name in sorted({n for k in keys for n in k}, key=_axis_order):
        idx = [i for i, k in enumerate(keys) if name in k]
        sub = sums[idx].clone()
        dist.all_reduce(sub, group=groups[name])
        sums[idx] = sub
    total = sums.sum().sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            if isinstance(g, DTensor):
                g.to_local().mul_(coef)
            else:
                g.mul_(coef)
    return float(total)


class SpmdTypesBackend(SpmdBackendRuntime):
    """Plain local shards typed with spmd_types; see the module docstring."""

    name: ClassVar[str] = "spmd_types"

    def validate_config(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        reject_unimplemented_parallelism(self.name, parallel_dims)
        _check_fsdp_support(parallel_dims)

    def parallelize(self, model: nn.Module, parallel_dims: ParallelDims, plan: ShardingPlan,
                    job_config: JobConfig) -> nn.Module:
        _check_fsdp_support(parallel_dims)
        mesh = spmd_forward_mesh(parallel_dims)
        apply_spmd_plan(model, plan, mesh,
                        gather_logits=job_config.parallelism.disable_loss_parallel)
        if parallel_dims.dp_enabled:
            _apply_fsdp(model, plan, parallel_dims)
        elif mesh is not None:
            _register_tp_grad_reduction(model, mesh)
        return model

    def prepare_inputs(self, tokens: torch.Tensor, labels: torch.Tensor,
                       parallel_dims: ParallelDims) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, labels, _ = annotate_input_spmd_types(parallel_dims, tokens, labels)
        return tokens, labels

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The global mean cross-entropy, invariant on every axis.

        Inside the train context (which sets the mesh and loss parallel): local
        per-token losses are summed, all-reduced over ``dp`` (``P -> I``) and divided
        by the all-reduced count of non-ignored labels.
        """
        mesh = current_spmd_mesh()
        stack = _loss_parallel_stack()
        loss_parallel = bool(stack and stack[-1])
        flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten(0, 1)
        if loss_parallel and _active(mesh, "tp"):
            assert mesh is not None
            per_token = vocab_parallel_cross_entropy(flat_logits, flat_labels, _group(mesh, "tp"))
        else:
            per_token = F.cross_entropy(flat_logits.float(), flat_labels, reduction="none",
                                        ignore_index=_IGNORE_INDEX)
        total = per_token.sum()
        count = (flat_labels != _IGNORE_INDEX).to(total.dtype).sum()
        if _active(mesh, _DP):
            assert mesh is not None
            dp = _group(mesh, _DP)
            total = st.all_reduce(total, dp, src=P, dst=I)
            count = st.all_reduce(count, dp, src=P, dst=I)
        return total / count

    def loss_value(self, loss: torch.Tensor, parallel_dims: ParallelDims) -> float:
        return float(loss.detach())

    def train_context(self, *, enable_loss_parallel: bool, parallel_dims: ParallelDims | None,
                      spmd_typechecking: bool) -> AbstractContextManager[None]:
        mesh = spmd_forward_mesh(parallel_dims) if parallel_dims is not None else None
        return _train_context(mesh, enable_loss_parallel, spmd_typechecking)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, parallel_dims: ParallelDims) -> float:
        return _clip_grad_norm(model, max_norm, spmd_forward_mesh(parallel_dims))


BACKEND = SpmdTypesBackend()

"""The redistribution planner: one ``spmd_types`` collective per changed mesh axis.

A plan boundary ``Redistribute(src, dst)`` becomes single-axis steps, each one
``spmd_types.redistribute`` on that axis's group: ``P->S(d)`` reduce_scatter,
``S(d)->R|I`` all_gather, ``R|I->S(d)`` convert (a local slice), ``P->R|I``
all_reduce, ``I<->R`` convert, ``S(i)->S(j)`` all_to_all. Boundaries that need
more than one collective on an axis, or that change the order in which axes
shard one tensor dim, are rejected at setup (:func:`validate_redistributions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import spmd_types as st  # the library (absolute import), not this package
import torch
from spmd_types.types import Shard
from torch.distributed.device_mesh import DeviceMesh

from ...layout import SpmdLayout
from ...plan import Redistribute, ShardingPlan
from .layout_types import axis_kind
from .mesh_context import active, axis_names, group

__all__ = ["redistribute_per_axis", "validate_redistributions"]

#: The per-axis changes one spmd_types collective can make (kinds: R, I, P, S).
_ONE_COLLECTIVE: frozenset[tuple[str, str]] = frozenset({
    ("P", "R"), ("P", "I"), ("P", "S"), ("S", "R"), ("S", "I"), ("S", "S"), ("S", "P"),
    ("R", "S"), ("I", "S"), ("R", "I"), ("I", "R"), ("R", "P"), ("I", "P"),
})


def _kind(typ: Any) -> str:
    return "S" if isinstance(typ, Shard) else repr(typ)


@dataclass(frozen=True)
class _Step:
    """One single-axis ``spmd_types.redistribute`` of a boundary."""

    axis: str
    src: Any
    dst: Any


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
        a, b = axis_kind(src, axis), axis_kind(dst, axis)
        if a != b:
            if (_kind(a), _kind(b)) not in _ONE_COLLECTIVE:
                raise ValueError(
                    f"{where}: changing mesh axis {axis!r} from {a!r} to {b!r} needs more than "
                    "one collective; the spmd_types runtime issues exactly one per axis. "
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
            f"{dim} ({why}); the spmd_types runtime only moves the innermost axis of a dim, "
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
        steps.append(_Step(axis, a, b))
    for axis in moves + additions:
        a, b = changed[axis]
        state.setdefault(b.dim, []).append(axis)
        steps.append(_Step(axis, a, b))
    if state != want:
        raise fail(min(d for d in set(state) | set(want) if state.get(d) != want.get(d)))
    for axis in others:
        a, b = changed[axis]
        steps.append(_Step(axis, a, b))
    return steps


def validate_redistributions(plan: ShardingPlan, mesh_axes: Sequence[str] | None = None) -> None:
    """Reject, at setup, plan boundaries :func:`redistribute_per_axis` cannot run.

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


def redistribute_per_axis(
    x: torch.Tensor,
    mesh: DeviceMesh | None,
    src: SpmdLayout | Mapping[str, Any],
    dst: SpmdLayout | Mapping[str, Any],
) -> torch.Tensor:
    """Redistribute local tensor ``x`` from ``src`` to ``dst``: one collective per changed axis.

    ``src``/``dst`` are :class:`SpmdLayout` s or ``{axis name: R|I|P|S(d)}`` mappings.
    Axes of size 1 or missing from ``mesh`` are skipped. A bf16/fp16 ``x`` reduces its
    gradient in its own dtype.
    """
    if mesh is None:
        return x
    src_l = src if isinstance(src, SpmdLayout) else SpmdLayout(dict(src))
    dst_l = dst if isinstance(dst, SpmdLayout) else SpmdLayout(dict(dst))
    live = [a for a in axis_names(mesh) if active(mesh, a)]
    compiling = torch.compiler.is_compiling()
    for step in _plan_steps(src_l, dst_l, live, "redistribute_per_axis"):
        pg = group(mesh, step.axis)
        if compiling:
            x = _traced_redistribute(x, pg.group_name, _encode(step.src), _encode(step.dst))
        else:
            x = st.redistribute(x, pg, src=step.src, dst=step.dst, backward_options=_backward_options(x))
    return x


def _backward_options(x: torch.Tensor) -> dict[str, Any] | None:
    """Reduced-precision activations (mixed precision) reduce their gradients in their own
    dtype, as DTensor does and upstream passes; spmd_types asks for it explicitly."""
    if x.is_floating_point() and x.element_size() < 4:
        return {"op_dtype": x.dtype}
    return None


def _encode(typ: Any) -> str:
    """``R``, ``I``, ``P`` or ``S(d)`` as a string (what Dynamo passes into a non-strict call)."""
    return f"S({typ.dim})" if isinstance(typ, Shard) else repr(typ)


def _decode(text: str) -> Any:
    return {"R": st.R, "I": st.I, "P": st.P}.get(text) or st.S(int(text[2:-1]))


def _redistribute_by_name(x: torch.Tensor, group_name: str, src: str, dst: str) -> torch.Tensor:
    """One ``spmd_types.redistribute`` step, its arguments as strings.

    Under ``torch.compile`` the plan's collectives go through here, marked
    ``nonstrict_trace``: Dynamo does not step into spmd_types' Python (it reads
    ``grad_fn``, which Dynamo cannot trace); AOT autograd traces the collective and
    its backward into the block's graph instead. No types are asserted there: type
    checking and compile are exclusive.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return st.redistribute(x, _resolve_process_group(group_name), src=_decode(src), dst=_decode(dst),
                           backward_options=_backward_options(x))


_traced_redistribute = torch._dynamo.nonstrict_trace(_redistribute_by_name)

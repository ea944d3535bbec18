"""Type checking the forward and the loss with ``spmd_types``' checker, and the train context.

``typecheck(local=False)`` propagates every forward op's types. Two things it
cannot decide by itself are settled here, in one ``TorchFunctionMode``
(:class:`_GlobalTypingShim`) pushed inside it:

- ``backward()`` runs unchecked, after checking that the loss is ``I`` or ``P`` on
  every axis (only those give correct gradients with the implicit 1.0 seed);
- a ``view``/``reshape`` that splits a sharded dim into an outer sharded one and
  inner unsharded ones (attention's head split) is typed by the even-shard rule.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import spmd_types as st  # the library (absolute import), not this package
import torch
from spmd_types import I, P
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from .mesh_context import set_current_spmd_mesh

__all__ = ["spmd_train_context"]


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
def spmd_train_context(mesh: DeviceMesh | None, typechecking: bool) -> Iterator[None]:
    """Forward, loss and backward on ``mesh``; with ``typechecking``, forward and loss type-checked."""
    with contextlib.ExitStack() as stack:
        # The current mesh is thread-local: keep autograd (and activation-checkpoint
        # recompute) on this thread, or collectives would silently see no mesh.
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(set_current_spmd_mesh(mesh))
        if typechecking:
            from spmd_types.checker import typecheck

            stack.enter_context(typecheck(local=False))
            stack.enter_context(_GlobalTypingShim())
        yield

"""Type checking the forward and the loss with ``spmd_types``' checker, and the train context.

``typecheck(local=False)`` propagates every forward op's types. Two things it
cannot decide by itself are settled here, in one ``TorchFunctionMode``
(:class:`_GlobalTypingShim`) pushed inside it:

- ``backward()`` runs unchecked, after checking that the loss is ``I`` or ``P`` on
  every axis (only those give correct gradients with the implicit 1.0 seed);
- a ``view``/``reshape`` that splits a sharded dim into an outer sharded one and
  inner unsharded ones (attention's head split) is typed by the even-shard rule.

The same shim remembers the checker's decisions (:class:`_DecisionCache`): a
plain torch op is fully checked the first time it is seen with given argument
types, shapes and values, and afterwards only its result is typed as the checker
typed it. Almost all of the checker's cost under ``local=False`` is DTensor
sharding propagation on meta tensors for every op and mesh axis (measured in
``docs/benchmarks.md``, "Type checker cost"); a training step repeats the same
ops with the same types (across layers, microbatches and steps), so only the
first of each is propagated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import spmd_types as st  # the library (absolute import), not this package
import torch
from spmd_types import I, P

# The library's own internals, as its checker uses them: the mode's flags (read: part of
# a decision's key) and the raw setters the checker types its results with.
from spmd_types import _state as _st_state
from spmd_types._type_attr import set_local_type as _set_local_type
from spmd_types.runtime import (  # in 0.2.1 and 0.3.x
    _set_partition_spec,
    get_partition_spec,
    has_local_type,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from .mesh_context import set_current_spmd_mesh

__all__ = ["DECISION_CACHE", "DeclaredTypes", "spmd_train_context"]

#: Whether this spmd_types has the checker-state internals a decision's key reads (0.3.x);
#: without them (0.2.1, upstream a0c831c49's pin) every op is checked in full, as the
#: checker itself does: the same errors, only slower.
_CACHE_INTERNALS: bool = all(hasattr(_st_state, n) for n in ("_current_mode", "_current_local_axes"))


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
    spec = get_partition_spec(x)
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
            # The size-1 dims before it (they join the group that follows them: a one-row batch,
            # [1, s/cp, f] -> [1, s/cp, h, d]) pair up with the leading size-1 dims of the target;
            # the shard goes to the dim after those (which may itself be 1 locally: one KV head a rank).
            j = 0
            while j < gi.index(first) and j < len(gj) - 1 and target[gj[j]] == 1:
                j += 1
            new_spec[gj[j]] = spec[first]
    if all(len(gi) == 1 and len(gj) == 1 for gi, gj in groups if any(spec[d] is not None for d in gi)):
        return NotImplemented  # sharded dims map 1:1: the checker's own rule handles it
    with st.local():
        out = func(*args, **kwargs)
    st.assert_type(out, dict(st.get_local_type(out)) or dict(st.get_local_type(x)),
                   partition_spec=st.PartitionSpec(*new_spec))
    return out


#: Non-tensor argument types whose value fully describes them (the key holds them, tagged
#: with their type so that ``1``, ``1.0`` and ``True`` stay apart).
_VALUE_TYPES = frozenset({int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype,
                          torch.device, torch.memory_format, torch.layout})
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
#: Marks a key whose op the checker must always see: it left the result untyped, retyped an
#: input it returned (a mutation), or returned something :func:`_result_leaves` cannot describe.
_ALWAYS_CHECK = object()


def _arg_key(x: Any) -> Hashable | None:
    """A hashable description of one argument, or None where it cannot be described.

    A plain tensor is described by what the checker reads from it: its type
    (``None`` if it has none; typed-but-empty is ``()``), partition spec, shape,
    strides, dtype, device, ``requires_grad`` and its class. Tensor subclasses
    (DTensor, fake tensors), ``spmd_types.Scalar`` and any other object: None.
    Call with torch functions disabled (tensor attribute reads would dispatch).
    """
    t = type(x)
    if t in _VALUE_TYPES:
        return (t, x)
    if t is torch.Tensor or t is nn.Parameter:
        typ = tuple(st.get_local_type(x).items()) if has_local_type(x) else None
        return (t, typ, get_partition_spec(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    if t is tuple or t is list or t is torch.Size:
        parts = []
        for item in x:
            k = _arg_key(item)
            if k is None:
                return None
            parts.append(k)
        return (t, tuple(parts))
    if t is slice:
        parts = (_arg_key(x.start), _arg_key(x.stop), _arg_key(x.step))
        return None if None in parts else (slice, parts)
    return None


def _result_leaves(out: Any) -> list[torch.Tensor] | None:
    """The tensors of a result, in order: a plain tensor, or a flat tuple/list of plain
    tensors; ``[]`` for a result without tensors (a number, a shape, None); None otherwise."""
    t = type(out)
    if t is torch.Tensor or t is nn.Parameter:
        return [out]
    if t in _VALUE_TYPES or t is torch.Size:
        return []
    if isinstance(out, tuple | list):
        if all(type(o) in _PLAIN_TENSORS for o in out):
            return list(out)
        if all(type(o) in _VALUE_TYPES for o in out):
            return []
    return None


def _tensors_in(values: Sequence[Any]) -> Iterator[torch.Tensor]:
    """The tensors in ``values`` and in the tuples and lists among them, at any depth."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, tuple | list):
            yield from _tensors_in(v)


def _is_inplace_name(func: Any) -> bool:
    """The checker's in-place naming rule (``add_``, ``__iadd__``)."""
    name = getattr(func, "__name__", "") or ""
    return (name.endswith("_") and not name.startswith("__")) or (
        name.startswith("__i") and name.endswith("__") and len(name) > 5)


class _DecisionCache:
    """The checker's decisions on plain torch ops, replayed when the same op comes again.

    ``typecheck(local=False)`` decides an op's result types from the op, its
    arguments' types, partition specs, shapes and non-tensor values, and the
    mode's state (current mesh, local axes, local/strict flags, grad mode):
    nothing else. Its decision is a pure function of those, so this cache keys on
    all of them (:func:`_arg_key`). A miss runs the op through the checker and
    records the types it gave the result; a hit runs the op with the checker
    paused and gives the result the recorded types, as the checker's own setters do.
    Errors are never recorded: an op the checker rejects is checked (and
    rejected) every time.

    Never cached, always checked: autograd Functions (collectives, the loss's
    custom rules), ``spmd_types``' own functions, property reads, in-place and
    ``out=`` ops, ops whose result is an input the checker retyped (a mutation),
    results that are not tensors, flat tuples of them or plain values, untyped
    results, and ops with arguments that cannot be described (tensor subclasses
    such as DTensor, ``spmd_types.Scalar``, process groups, callables).

    ``audit``: on every hit, run the op through the checker anyway and raise
    ``AssertionError`` if the checker's types differ from the recorded ones (the
    tests use it to prove the key is complete on the real models).
    Set ``enabled = False`` to check every op in full.
    """

    def __init__(self, limit: int = 16384) -> None:
        self.limit = limit
        self.enabled = True
        self.audit = False
        self._entries: dict[Hashable, Any] = {}
        self.hits = self.misses = self.unkeyed = 0

    def clear(self) -> None:
        """Forget every decision (e.g. after registering new typing rules) and reset the counters."""
        self._entries.clear()
        self.hits = self.misses = self.unkeyed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable | None:
        """The decision's key, or None where the op must always be checked."""
        if ("out" in kwargs or _is_inplace_name(func) or getattr(func, "__name__", None) == "__get__"
                or _is_autograd_apply(func)
                or (getattr(func, "__module__", None) or "").startswith("spmd_types")):
            return None
        if not _CACHE_INTERNALS:  # an spmd_types without the internals the key reads (0.2.x)
            return None
        mode = _st_state._current_mode()
        if mode is None or not all(hasattr(mode, flag) for flag in ("_local", "_strict")):
            return None
        with torch._C.DisableTorchFunction():
            parts = []
            for a in args:
                k = _arg_key(a)
                if k is None:
                    return None
                parts.append(k)
            for name, v in kwargs.items():
                k = _arg_key(v)
                if k is None:
                    return None
                parts.append((name, k))
        return (func, tuple(parts), st.current_mesh(), _st_state._current_local_axes(), mode._local,
                mode._strict, torch.is_grad_enabled())

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 decide: Callable[[], Any] | None = None) -> Any:
        """Run ``func`` as the checker would: ``decide()`` (by default the call itself, which
        the checker below sees), or a replay of what it decided for this key before."""
        decide = decide or (lambda: func(*args, **kwargs))
        key = self.key(func, args, kwargs) if self.enabled else None
        if key is None:
            self.unkeyed += 1
            return decide()
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            before = {id(a): (tuple(st.get_local_type(a).items()), get_partition_spec(a))
                      for a in _tensors_in((*args, *kwargs.values()))}
            out = decide()  # the checker decides (and raises on a type error)
            self._record(key, before, out)
            return out
        if entry is _ALWAYS_CHECK:
            self.unkeyed += 1
            return decide()
        self.hits += 1
        if self.audit:
            out = decide()
            got = self._types_of(out)
            if got != entry:
                raise AssertionError(f"type-check cache: {func} recorded {entry}, the checker now gives {got}")
            return out
        with st.no_typecheck():
            out = func(*args, **kwargs)
        leaves = _result_leaves(out)
        if leaves is None or len(leaves) != len(entry):
            raise AssertionError(f"type-check cache: {func} returned {type(out).__name__}, recorded "
                                 f"{len(entry)} tensors")
        for leaf, (typ, spec) in zip(leaves, entry, strict=True):
            if not has_local_type(leaf):  # a fresh result: typed as the checker typed it
                _set_local_type(leaf, dict(typ))
                _set_partition_spec(leaf, spec)
            elif tuple(st.get_local_type(leaf).items()) != typ or get_partition_spec(leaf) != spec:
                # An input returned as the result keeps its types (see _record): anything else
                # means the key missed something. Never guess: fail loudly.
                raise AssertionError(f"type-check cache: {func} returned a tensor typed "
                                     f"{st.get_local_type(leaf)}, recorded {dict(typ)}")
        return out

    @staticmethod
    def _types_of(out: Any) -> tuple[tuple[tuple[Any, ...], Any], ...] | None:
        """Per result tensor ``(type items, partition spec)``; None if a result tensor is untyped
        or the result is not one :func:`_result_leaves` describes."""
        leaves = _result_leaves(out)
        if leaves is None or not all(has_local_type(t) for t in leaves):
            return None
        return tuple((tuple(st.get_local_type(t).items()), get_partition_spec(t)) for t in leaves)

    def _record(self, key: Hashable, before: dict[int, Any], out: Any) -> None:
        entry: Any = self._types_of(out)
        # A result that is one of the inputs (``x.float()`` of a float tensor): replayable only
        # if the checker left its types as they were (otherwise it treated the op as a mutation).
        if entry is not None and any(id(t) in before and before[id(t)] != rec
                                     for t, rec in zip(_result_leaves(out) or (), entry, strict=True)):
            entry = None
        if len(self._entries) >= self.limit:
            self._entries.clear()  # shapes keep changing: start again rather than grow
        self._entries[key] = _ALWAYS_CHECK if entry is None else entry


#: The process's decision cache (shared by every type-checked train context: a decision
#: depends only on its key).
DECISION_CACHE = _DecisionCache()


def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view/reshape by :func:`_global_view`'s rule where it applies, else the checker's."""
    out = _global_view(func, args, kwargs)
    return func(*args, **kwargs) if out is NotImplemented else out


class DeclaredTypes:
    """``spmd_types.assert_type`` of declared layouts, skipped where it is known to change nothing.

    ``assert_type`` reads only the tensor's type, partition spec and rank and either
    raises, refines the tensor's types, or leaves them as they are; the last outcome
    is remembered per (declared types, the tensor's types), so the same boundary
    check on the same incoming types costs a lookup. Errors and refinements are
    never remembered.
    """

    def __init__(self) -> None:
        self._unchanged: set[Hashable] = set()

    @staticmethod
    def key(types: dict[Any, Any], spec: st.PartitionSpec | None) -> Hashable:
        """The hashable identity of declared ``types`` (keyed by process group) and ``spec``."""
        return tuple((st.MeshAxis.of(g), t) for g, t in types.items()), spec

    def __call__(self, x: torch.Tensor, types: dict[Any, Any], spec: st.PartitionSpec | None,
                 key: Hashable) -> None:
        """``assert_type(x, types, partition_spec=spec)``; ``key``: :meth:`key` of the two."""
        state = _type_state(x)
        if (key, state) in self._unchanged:
            return
        st.assert_type(x, types, partition_spec=spec)
        if state[0] is not None and _type_state(x) == state:
            self._unchanged.add((key, state))


def _type_state(x: torch.Tensor) -> tuple[Any, ...]:
    """What ``assert_type`` reads from ``x``: its type (None if untyped), partition spec and rank."""
    with torch._C.DisableTorchFunction():
        typ = tuple(st.get_local_type(x).items()) if has_local_type(x) else None
        return typ, get_partition_spec(x), x.dim()


class _GlobalTypingShim(TorchFunctionMode):
    """Pushed inside ``typecheck(local=False)``; sees every op first.

    - ``backward()``: checks the loss is ``I`` or ``P`` on every axis (the implicit
      1.0 seed is invariant), then runs the whole backward (collectives' backwards,
      FSDP's reduce-scatters) under ``no_typecheck()``: only forward and loss are typed.
      ``torch.autograd.grad`` runs unchecked too.
    - ``view``/``reshape`` that split a sharded dim (attention's head split): see
      :func:`_global_view`.
    - plain torch ops (views included): through :data:`DECISION_CACHE`.
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
        if _is_autograd_apply(func):
            # A bare ``Function.apply`` does not re-dispatch to the modes below this
            # one (the checker) by itself: hand it on explicitly.
            tensors = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            if tensors and has_torch_function(tensors):
                return handle_torch_function(func, tensors, *args, **kwargs)
            return func(*args, **kwargs)
        if not st.is_type_checking():
            return func(*args, **kwargs)
        if func in _VIEW_FUNCS:
            return DECISION_CACHE(func, args, kwargs, lambda: _view(func, args, kwargs))
        return DECISION_CACHE(func, args, kwargs)


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

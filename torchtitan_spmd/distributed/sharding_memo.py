"""DTensor's sharding propagation, remembered across the processes a launcher forks.

DTensor decides each operator's output placements, and the redistributions its inputs need, by
*sharding propagation* (``ShardingPropagator.propagate_op_sharding_non_cached``): it runs the
operator on fake tensors for the output's metadata, expands the operator's single-axis
strategies over the mesh and prices every candidate's input redistributions. torch caches the
result per process (an LRU keyed by the ``OpSchema``, and a C++ cache in front of it), so a
training run pays it once per distinct operator call, in its first step.

The test suite pays it in every launch: :func:`torchtitan_spmd.launcher.run_forked` forks fresh
ranks for each case, and each starts with empty caches. Profiled on rank 0 of the nine
``test_parity.py`` launches (cProfile), 717 propagations took 17.9 of the 33.5 s the ranks spent
in their test functions, and most of them repeat ones the same pytest worker's earlier launches
computed: same operators, same shapes, same placements, same mesh layout.

This module keeps the results in the launching process, so every later fork inherits them:

* :func:`install` (in each rank, by the launcher) wraps the propagator's uncached entry point:
  a result found in :data:`_ENTRIES` is returned, else torch computes it and it is recorded;
* :func:`take_new` hands the launcher the rank's new results, which it writes next to the
  rank's return value; :func:`merge` adds them to the launching process's table.

**The key** is everything propagation reads, serialised with :mod:`pickle`: the operator's name,
the ``OpSchema``'s arguments (the ``DTensorSpec`` of each tensor: placements, global shape,
stride, dtype; every non-tensor argument), the strategy torch has registered for the operator,
and for each mesh its layout (ranks, shape, axis names, device type: what ``DeviceMesh.__eq__``
compares) and *this rank's coordinate in it*. The coordinate matters: a view of an unevenly
sharded tensor is rewritten to this rank's local shape. Two calls with the same key get the
same result from torch, on any rank, in any process forked from the same parent.

**The value** is torch's ``OutputSharding``, pickled with each mesh replaced by a reference to
the caller's mesh of the same layout, and the caller's own ``OpSchema`` (torch returns it for
``_local_scalar_dense``) by a reference to the caller's. So a result is always bound to the
meshes of the call that asks, never to the process group of the call that computed it (the
trap of torch's own cache with two equal meshes: :mod:`.mesh_reuse`).

Not remembered (torch computes them every time, as without this module): calls while tracing
(symbolic shapes), calls whose arguments hold a plain tensor or anything that does not pickle,
and results that refer to a mesh or an operator the call does not hold.

``TORCHTITAN_SPMD_SHARDING_MEMO=0`` turns it off; :func:`unsupported_reason` says why a torch
whose propagator differs is left alone. ``tests/layer2_mesh/test_sharding_memo.py`` checks that
remembered results equal torch's own over a grid of operators and placements.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["DIR_ENV", "ENV", "MAX_ENTRIES", "install", "load_shared", "merge", "publish", "read", "take_new",
           "unsupported_reason", "write_new"]

#: ``0`` leaves torch's sharding propagation as it is.
ENV = "TORCHTITAN_SPMD_SHARDING_MEMO"

#: The table stops growing at this many results (about 1.6 KB each, measured).
MAX_ENTRIES = 50_000

_MARK = "_torchtitan_spmd_sharding_memo"

#: key -> pickled ``OutputSharding``: inherited by every process forked after it was filled.
_ENTRIES: dict[bytes, bytes] = {}
#: what this process added since the last :func:`take_new`.
_NEW: dict[bytes, bytes] = {}
#: lookups in this process: [hits, misses] (for tests and the profile).
STATS = [0, 0]


class _Unkeyable(Exception):
    """A call this module does not remember (a plain tensor, a symbolic size, no pickle)."""


def _propagator() -> Any:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - heavy import

    return DTensor._op_dispatcher.sharding_propagator


def unsupported_reason() -> str | None:
    """Why this torch's sharding propagation cannot be wrapped (its shape differs), or ``None``."""
    try:
        from torch.distributed.tensor import _sharding_prop  # noqa: PLC0415
        prop = _propagator()
    except (ImportError, AttributeError) as err:  # pragma: no cover - torch without DTensor
        return f"torch has no DTensor sharding propagator ({err})"
    for name in ("propagate_op_sharding_non_cached", "propagate_op_sharding",
                 "op_strategy_funcs", "op_single_dim_strategy_funcs"):
        if not hasattr(prop, name):
            return f"ShardingPropagator has no {name}"
    if not isinstance(getattr(_sharding_prop, "LocalLRUCache", None), type):
        return "torch.distributed.tensor._sharding_prop has no LocalLRUCache"
    return None


def _layout(mesh: Any) -> tuple[Any, ...]:
    """What ``DeviceMesh.__eq__`` compares, less the thread id (the same in every fork)."""
    return (mesh._flatten_rank_map, mesh._layout, mesh._device_type, mesh._mesh_dim_names)


def _strategy_name(prop: Any, op: Any) -> tuple[str, ...]:
    names = []
    for table in (prop.op_single_dim_strategy_funcs, prop.op_strategy_funcs, prop.op_to_rules):
        fn = table.get(op)
        fn = getattr(fn, "func", fn)  # a single-dim strategy's info holds its function
        names.append(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
                     if fn is not None else "")
    return tuple(names)


def _spec_reducer(obj: Any) -> Any:
    """A ``DTensorSpec`` by its fields, without the hash it caches: string hashes differ between
    processes, so a cached hash would make the bytes of equal specs differ."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec  # noqa: PLC0415

    if type(obj) is DTensorSpec:
        return DTensorSpec, (obj.mesh, obj.placements, obj.tensor_meta, obj.shard_order,
                             obj.use_strided_shard_as_shard_order)
    return NotImplemented


class _SpecPickler(pickle.Pickler):
    """What the key and the value picklers share: specs by their fields, and no tensor or
    symbolic size (a call holding one is not remembered)."""

    def __init__(self, buf: io.BytesIO, mesh_cls: type, op_cls: type) -> None:
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self._mesh_cls, self._op_cls = mesh_cls, op_cls

    def reducer_override(self, obj: Any) -> Any:
        return _spec_reducer(obj)

    @staticmethod
    def _refuse_tensors(obj: Any) -> None:
        import torch  # noqa: PLC0415

        if isinstance(obj, torch.Tensor | torch.SymInt | torch.SymFloat | torch.SymBool):
            raise _Unkeyable(type(obj).__name__)


class _KeyPickler(_SpecPickler):
    """Pickles a call's arguments; meshes become (layout, this rank's coordinate)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, self._mesh_cls):
            return ("mesh", _layout(obj), tuple(obj.get_coordinate() or ()))
        if isinstance(obj, self._op_cls):
            return ("op", str(obj))
        self._refuse_tensors(obj)
        return None


class _ValuePickler(_SpecPickler):
    """Pickles a result; meshes, the operator and the caller's schema become references."""

    def __init__(self, buf: io.BytesIO, call: Any, mesh_cls: type, op_cls: type) -> None:
        super().__init__(buf, mesh_cls, op_cls)
        self._call = call

    def persistent_id(self, obj: Any) -> Any:
        if obj is self._call:
            return ("call",)
        if isinstance(obj, self._mesh_cls):
            return ("mesh", _layout(obj))
        if isinstance(obj, self._op_cls):
            if obj is not self._call.op:
                raise _Unkeyable(f"a result naming another operator ({obj})")
            return ("op",)
        self._refuse_tensors(obj)
        return None


class _ValueUnpickler(pickle.Unpickler):
    def __init__(self, blob: bytes, call: Any, meshes: dict[tuple[Any, ...], Any]) -> None:
        super().__init__(io.BytesIO(blob))
        self._call, self._meshes = call, meshes

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "call":
            return self._call
        if pid[0] == "op":
            return self._call.op
        if pid[0] == "mesh":
            return self._meshes[pid[1]]  # KeyError: the call holds no such mesh, so recompute
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")


def _call_meshes(call: Any, mesh_cls: type) -> dict[tuple[Any, ...], Any]:
    """The call's meshes by layout: the first of each layout, as torch's strategies take it."""
    found: dict[tuple[Any, ...], Any] = {}

    def visit(value: Any) -> None:
        mesh = getattr(value, "mesh", None)
        if isinstance(mesh, mesh_cls):
            found.setdefault(_layout(mesh), mesh)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(call.args_schema)
    visit(tuple(call.kwargs_schema.values()))
    return found


def _wrap(prop: Any, compute: Callable[[Any], Any]) -> Callable[[Any], Any]:
    from torch._ops import OpOverload  # noqa: PLC0415
    from torch.distributed._functional_collectives import _are_we_tracing  # noqa: PLC0415
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    def propagate_op_sharding_non_cached(op_schema: Any) -> Any:
        if _are_we_tracing():
            return compute(op_schema)
        try:
            buf = io.BytesIO()
            _KeyPickler(buf, DeviceMesh, OpOverload).dump(
                (str(op_schema.op), _strategy_name(prop, op_schema.op), op_schema.args_schema,
                 op_schema.kwargs_schema, op_schema.schema_info))
            key = buf.getvalue()
        except Exception:  # noqa: BLE001 - _Unkeyable, or an argument that does not pickle
            return compute(op_schema)
        blob = _ENTRIES.get(key)
        if blob is not None:
            try:
                value = _ValueUnpickler(blob, op_schema, _call_meshes(op_schema, DeviceMesh)).load()
            except Exception:  # noqa: BLE001 - a mesh the call does not hold: torch computes it
                value = None
            if value is not None:
                STATS[0] += 1
                return value
        STATS[1] += 1
        value = compute(op_schema)
        if len(_ENTRIES) < MAX_ENTRIES:
            try:
                out = io.BytesIO()
                _ValuePickler(out, op_schema, DeviceMesh, OpOverload).dump(value)
            except Exception:  # noqa: BLE001 - not remembered; torch's result is returned as is
                return value
            _ENTRIES[key] = _NEW[key] = out.getvalue()
        return value

    propagate_op_sharding_non_cached.__wrapped__ = compute  # type: ignore[attr-defined]
    return propagate_op_sharding_non_cached


def install() -> bool:
    """Wrap this process's sharding propagation (idempotent); ``True`` when on.

    Off when ``TORCHTITAN_SPMD_SHARDING_MEMO=0`` or when this torch's propagator is not the shape
    this module knows (:func:`unsupported_reason`). Called by the launcher in each forked rank
    once its process group is up.
    """
    if os.environ.get(ENV, "1") == "0":
        return False
    if unsupported_reason() is not None:
        return False
    from torch.distributed.tensor import _sharding_prop  # noqa: PLC0415

    prop = _propagator()
    if getattr(prop, _MARK, None):
        return True
    wrapped = _wrap(prop, prop.propagate_op_sharding_non_cached)
    prop.propagate_op_sharding_non_cached = wrapped
    prop.propagate_op_sharding = _sharding_prop.LocalLRUCache(wrapped)
    setattr(prop, _MARK, True)
    return True


def take_new() -> dict[bytes, bytes]:
    """The results this process computed since the last call (and forgets that they are new)."""
    new = dict(_NEW)
    _NEW.clear()
    return new


def merge(entries: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """Add results (another process's :func:`take_new`) to this process's table, up to the cap;
    returns those that were new here."""
    room = MAX_ENTRIES - len(_ENTRIES)
    added: dict[bytes, bytes] = {}
    for key, blob in entries.items():
        if room <= 0:
            break
        if key not in _ENTRIES:
            _ENTRIES[key] = added[key] = blob
            room -= 1
    return added


def write_new(path: str) -> None:
    """Write :func:`take_new` to ``path`` (nothing when there is nothing new)."""
    new = take_new()
    if new:
        _write(path, new)


def _write(path: str, entries: dict[bytes, bytes]) -> None:
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        pickle.dump(entries, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(partial, path)  # whole or not at all: a reader never sees a partial file


def _load(path: str) -> dict[bytes, bytes]:
    try:
        with open(path, "rb") as f:
            entries = pickle.load(f)
    except Exception:  # noqa: BLE001 - a file this module did not write whole: skipped
        return {}
    return entries if isinstance(entries, dict) else {}


def read(paths: Iterable[str]) -> None:
    """:func:`merge` what the ranks' :func:`write_new` wrote at each existing path (a damaged
    file is skipped), and :func:`publish` what was new to this process."""
    added: dict[bytes, bytes] = {}
    for path in paths:
        if os.path.exists(path):
            added.update(merge(_load(path)))
    publish(added)


#: The results of sibling processes (pytest-xdist workers, the stack check's prefixes) are
#: shared through this folder when it is set: each writes its ranks' new results there, and
#: reads the others' before each launch. It must be empty at the start of a run: results are
#: valid only for the code and torch that computed them (``nox`` makes a fresh one per session).
DIR_ENV = "TORCHTITAN_SPMD_SHARDING_MEMO_DIR"

_SEEN: set[str] = set()
_PUBLISHED = [0]


def publish(entries: dict[bytes, bytes]) -> None:
    """Write ``entries`` into the shared folder (``TORCHTITAN_SPMD_SHARDING_MEMO_DIR``), if set."""
    folder = os.environ.get(DIR_ENV)
    if not folder or not entries or os.environ.get(ENV, "1") == "0":
        return
    _PUBLISHED[0] += 1
    name = f"{os.getpid()}-{_PUBLISHED[0]}.memo"
    _SEEN.add(name)
    try:
        os.makedirs(folder, exist_ok=True)
        _write(os.path.join(folder, name), entries)
    except OSError:  # a full or read-only disk: the siblings compute these themselves
        pass


def load_shared() -> None:
    """Merge the results sibling processes published since the last call (see :data:`DIR_ENV`)."""
    folder = os.environ.get(DIR_ENV)
    if not folder or os.environ.get(ENV, "1") == "0":
        return
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".memo") and n not in _SEEN)
    except OSError:  # not created yet
        return
    for name in names:
        _SEEN.add(name)
        merge(_load(os.path.join(folder, name)))

"""``SpmdLayout``: the one layout language every backend interprets.

A layout says, per mesh axis, which ``spmd_types`` type a tensor has there:

====== =========================================== ==================
type   meaning                                     DTensor placement
====== =========================================== ==================
``R``  replicated (gradient is partial)            ``Replicate()``
``I``  invariant (same value, invariant gradient)  ``Replicate()``
``V``  varying, unrelated to any global tensor     (none)
``P``  partial: a pending sum                      ``Partial()``
``S(d)`` varying, concatenated on tensor dim ``d`` ``Shard(d)``
====== =========================================== ==================

Axes not mentioned are ``R``. Instead of ``S(d)``, a layout may give an explicit
partition spec (one entry per tensor dim: ``None``, an axis, or a tuple of axes
in sharding order) with those axes typed ``V``; that is the only way to shard
one dim over several axes.

Examples::

    SpmdLayout({"tp": S(0)})                         # colwise weight
    SpmdLayout({"dp": S(0), "cp": S(1)})             # tokens
    SpmdLayout({"dp": V, "tp": V}, partition_spec=(("dp", "tp"), None))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from spmd_types import I, MeshAxis, P, R, S, V
from spmd_types.types import PerMeshAxisLocalSpmdType, Shard

#: A per-axis type: ``R``, ``I``, ``V``, ``P`` or ``S(d)``.
AxisType: TypeAlias = PerMeshAxisLocalSpmdType | Shard
#: One partition-spec entry: unsharded, one axis, or several axes in sharding order.
SpecEntry: TypeAlias = str | tuple[str, ...] | None

__all__ = [
    "I",
    "P",
    "R",
    "S",
    "SpmdLayout",
    "V",
    "dtensor_placement",
    "spmd_layout_to_dtensor_placements",
]


def _is_axis_type(value: object) -> bool:
    return isinstance(value, Shard | PerMeshAxisLocalSpmdType)


def _is_axis(axis: Any) -> bool:
    """A mesh axis as a layout may key it: a name, or the ``MeshAxis`` spmd_types reports.

    Upstream b5bcd76's own code builds ``SpmdLayout(axis_types=spmd.get_local_type(t), ...)``
    (``protocols/module.py``, saving buffers' types across ``to_empty``), whose keys are
    spmd_types ``MeshAxis`` objects, not names.
    """
    return isinstance(axis, (str, MeshAxis))


@dataclass(frozen=True)
class SpmdLayout:
    """Per-mesh-axis ``spmd_types`` types plus an optional partition spec. Immutable.

    Args:
        axis_types: mapping of mesh axis (a name: ``str`` or ``MeshAxisName``; or an
            spmd_types ``MeshAxis``, as ``spmd_types.get_local_type`` reports) to ``R``,
            ``I``, ``V``, ``P`` or ``S(d)``. Axes not listed are ``R``. Also readable
            as :attr:`types`.
        partition_spec: optional; one entry per tensor dim. Mutually exclusive
            with ``S(d)`` types.

    Raises:
        TypeError: a type is not an spmd_types per-axis type, or an axis is not a str.
        ValueError: ``S(d)`` mixed with a partition spec; two axes shard the same
            dim without a spec; an axis repeated in the spec; a spec axis typed
            other than ``V``; ``V`` without a spec entry.
    """

    axis_types: Mapping[str, AxisType] = field(default_factory=dict)
    partition_spec: tuple[SpecEntry, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.axis_types, Mapping):
            raise TypeError(
                f"SpmdLayout.axis_types must be a mapping, got {type(self.axis_types).__name__}."
            )
        items = tuple(self.axis_types.items())
        for axis, typ in items:
            if not _is_axis(axis):
                raise TypeError(f"SpmdLayout: mesh axes must be names (str) or spmd_types MeshAxis objects, "
                                f"got {type(axis).__name__} {axis!r}.")
            if not _is_axis_type(typ):
                raise TypeError(
                    f"SpmdLayout: axis {axis!r} has type {typ!r}; expected one of "
                    "spmd_types R, I, V, P or S(dim)."
                )
        # Freeze: a read-only, hashable view of the mapping.
        object.__setattr__(self, "axis_types", _FrozenTypes(items))
        if self.partition_spec is not None:
            self._validate_spec(items)
        else:
            seen: dict[int, str] = {}
            for axis, typ in items:
                if isinstance(typ, Shard):
                    if typ.dim in seen:
                        raise ValueError(
                            f"SpmdLayout: axes {seen[typ.dim]!r} and {axis!r} both shard tensor "
                            f"dim {typ.dim}; give a partition_spec to fix their order."
                        )
                    seen[typ.dim] = axis

    def _validate_spec(self, items: tuple[tuple[str, AxisType], ...]) -> None:
        spec = tuple(self.partition_spec or ())
        for axis, typ in items:
            if isinstance(typ, Shard):
                raise ValueError(
                    f"SpmdLayout: axis {axis!r} is S({typ.dim}) and a partition_spec is given; "
                    "use V for spec axes or drop the spec."
                )
        seen: set[str] = set()
        normalised: list[SpecEntry] = []
        for dim, entry in enumerate(spec):
            axes = (entry,) if _is_axis(entry) else (entry or ())
            if not isinstance(axes, tuple) or not all(_is_axis(a) for a in axes):
                raise TypeError(
                    f"SpmdLayout: partition_spec[{dim}] must be None, an axis name or a tuple "
                    f"of axis names, got {entry!r}."
                )
            for axis in axes:
                if axis in seen:
                    raise ValueError(f"SpmdLayout: axis {axis!r} appears twice in partition_spec.")
                seen.add(axis)
                typ = self.axis_types.get(axis, V)
                if typ is not V:
                    raise ValueError(
                        f"SpmdLayout: axis {axis!r} is in partition_spec but typed {typ!r}; "
                        "spec axes must be V."
                    )
            normalised.append(entry if entry is None or _is_axis(entry) else tuple(entry))
        object.__setattr__(self, "partition_spec", tuple(normalised))

    # ----------------------------------------------------------------------------------
    @property
    def types(self) -> Mapping[str, AxisType]:
        """The per-axis types as given (:attr:`axis_types`, torchtitan's name)."""
        return self.axis_types

    def axes(self) -> tuple[str, ...]:
        """The axes named in :attr:`axis_types`, in order (as torchtitan's ``SpmdLayout.axes``)."""
        return tuple(self.axis_types)

    def per_axis_spmd_types(self) -> dict[str, AxisType]:
        """Per-axis types with each partition-spec axis written as ``S(dim)``.

        ``{DP: R, CP: V}`` with spec ``(None, CP)`` gives ``{DP: R, CP: S(1)}``.
        Several axes on one dim all become ``S(dim)``, so the shard order is lost:
        this is the form ``spmd_types.redistribute`` takes, not a full description.
        Keys are the objects given (``str`` or ``MeshAxisName``).
        """
        result: dict[str, AxisType] = dict(self.axis_types)
        for dim, entry in enumerate(self.partition_spec or ()):
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                result[axis] = S(dim)
        return result

    def _axes_on_dim(self, dim: int) -> tuple[str, ...]:
        return tuple(a for a, d in self.shard_dims().items() if d == dim)

    def shard_dims(self) -> dict[str, int]:
        """Map of each sharding axis to the tensor dim it shards."""
        if self.partition_spec is None:
            return {a: t.dim for a, t in self.axis_types.items() if isinstance(t, Shard)}
        out: dict[str, int] = {}
        for dim, entry in enumerate(self.partition_spec):
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                out[axis] = dim
        return out

    def shard_order(self, dim: int) -> tuple[str, ...]:
        """Axes sharding tensor dim ``dim``, outermost first."""
        if self.partition_spec is None:
            return self._axes_on_dim(dim)
        if dim >= len(self.partition_spec):
            return ()
        entry = self.partition_spec[dim]
        return (entry,) if isinstance(entry, str) else (entry or ())

    def with_types(self, **types: AxisType) -> SpmdLayout:
        """A copy with some axes' types replaced (the partition spec is kept)."""
        merged = dict(self.axis_types)
        merged.update(types)
        return SpmdLayout(merged, self.partition_spec)

    def placements(self, mesh_dim_names: Sequence[str]) -> tuple[Any, ...]:
        """DTensor placements on a mesh with these dim names.

        Raises ValueError for ``V`` (no DTensor equivalent) and for a dim sharded
        over several axes in an order other than the mesh's.
        """
        # Immutable, and asked for on every plan boundary of every step: computed once per
        # mesh (the cache lives outside the dataclass fields, so equality is unchanged).
        cache: dict[tuple[str, ...], tuple[Any, ...]] = self.__dict__.setdefault("_placements_by_mesh", {})
        key = tuple(mesh_dim_names)
        if key not in cache:
            cache[key] = self._placements(key)
        return cache[key]

    def _placements(self, mesh_dim_names: tuple[str, ...]) -> tuple[Any, ...]:
        from torch.distributed.tensor import Shard as DShard

        dims = self.shard_dims()
        out: list[Any] = []
        for axis in mesh_dim_names:
            if axis in dims:
                order = [a for a in self.shard_order(dims[axis]) if a in mesh_dim_names]
                mesh_order = [a for a in mesh_dim_names if a in order]
                if order != mesh_order:
                    raise ValueError(
                        f"SpmdLayout: tensor dim {dims[axis]} is sharded over {tuple(order)} but "
                        f"the mesh orders those axes {tuple(mesh_order)}; DTensor cannot express it."
                    )
                out.append(DShard(dims[axis]))
                continue
            out.append(dtensor_placement(axis, self.axis_types.get(axis, R)))
        return tuple(out)

    def __repr__(self) -> str:
        body = ", ".join(f"{a}={t!r}" for a, t in self.axis_types.items())
        spec = f", partition_spec={self.partition_spec!r}" if self.partition_spec is not None else ""
        return f"SpmdLayout({body}{spec})"


def dtensor_placement(axis: str, typ: AxisType) -> Any:
    """The DTensor placement of one per-axis type: R/I -> Replicate, P -> Partial, S(d) -> Shard(d).

    Raises ValueError for ``V``, which has no DTensor placement.
    """
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor import Shard as DShard

    if isinstance(typ, Shard):
        return DShard(typ.dim)
    if typ is R or typ is I:
        return Replicate()
    if typ is P:
        return Partial()
    raise ValueError(
        f"SpmdLayout: axis {axis!r} is V with no shard dim; DTensor has no placement for it."
    )


def spmd_layout_to_dtensor_placements(layout: SpmdLayout) -> dict[str, Any]:
    """DTensor placements keyed by mesh axis, as torchtitan's function of that name.

    From :meth:`SpmdLayout.per_axis_spmd_types` (so the shard order of a dim
    sharded over several axes is not kept); the logical ``dp`` axis is given to
    both ``dp_replicate`` and ``dp_shard``. Raises ValueError for a ``V`` axis.
    """
    result: dict[str, Any] = {}
    for axis, typ in layout.per_axis_spmd_types().items():
        placement = dtensor_placement(axis, typ)
        if str(axis) == "dp":
            result["dp_replicate"] = placement
            result["dp_shard"] = placement
        else:
            result[axis] = placement
    return result


class _FrozenTypes(Mapping[str, AxisType]):
    """A hashable, read-only ordered mapping of axis name to type."""

    __slots__ = ("_items", "_dict")

    def __init__(self, items: tuple[tuple[str, AxisType], ...]) -> None:
        self._items = items
        self._dict = dict(items)

    def __getitem__(self, key: str) -> AxisType:
        return self._dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._dict) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._dict)

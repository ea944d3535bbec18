"""Parallel degrees and the device meshes each SPMD backend needs (layer 2 of the stack).

A drop-in for ``torchtitan.distributed.parallel_dims``::

    pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1,
                      world_size=8, spmd_backend="default")
    pd.build_mesh()
    tp_mesh = pd.get_mesh("tp")

Rank layout
    Ranks are laid out row-major over the five *base axes*
    ``(pp, dp_replicate, dp_shard, cp, tp)``: ``tp`` neighbours are adjacent
    ranks, ``pp`` stages are the farthest apart. Every other axis is carved out
    of that one layout: ``batch``/``dp`` merge ``dp_replicate`` and
    ``dp_shard``; ``loss`` merges ``dp_replicate``, ``dp_shard`` and ``cp``;
    ``fsdp`` merges ``dp_shard`` and ``cp``; ``efsdp`` and ``ep`` split the ranks
    of ``dp_shard*cp*tp`` into ``(dp_shard*cp*tp // ep, ep)``. So EP reuses
    those ranks and is not a factor of ``world_size``.

Meshes as data
    What differs between backends is a table in the backend registry
    (:class:`~torchtitan_spmd.config.backends.BackendMeshes`): its global meshes and
    their axes, the axes that always get a real process group, the axes
    ``resolve_mesh`` keeps, and the axes of ``spmd_meshes()``. The class itself
    never branches on the backend's name.

Built once, per rank
    ``build_mesh()`` creates, for each distinct set of ranks, only the group this
    rank belongs to (``new_group(use_local_synchronization=True)``: no other rank
    takes part), so its cost does not grow with the world size; an axis over the
    whole world is the default group, and with a device-bound NCCL default group
    each axis is one ``split_group``, as torch does (:func:`_mesh_compat.init_axis_group`).
    Every mesh (the 5-axis world mesh, the global meshes, every sub-mesh) is a
    view over the same rank map that points at those groups. Axes with the same
    ranks share a group (``batch`` and ``dp``; ``ep`` and ``tp`` when
    ``ep == tp``; all size-1 fake axes), where upstream unflattens the world four
    times and has every rank create every subgroup again for each view. Groups
    made with ``new_group`` get the default group's timeout.

Real and fake axes
    An axis is *active* when it has a real process group: when its size is
    above 1, and always for ``fsdp`` (default), ``dp_shard`` (full_dtensor and
    spmd_types) and, when ``ep > 1``, ``efsdp`` (so FSDP can apply mixed
    precision at size 1). Other axes get groups of torch's ``"fake"`` backend,
    which exist only so that every mesh axis has a group.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_spmd._errors import suggest
from torchtitan_spmd.compat.parallel_dims import legacy_parallel_dims  # compat hook
from torchtitan_spmd.config.backends import BackendMeshes, backend
from torchtitan_spmd.config.surface import check_backend_spelling, get_surface

from . import _mesh_compat, mesh_reuse, planner_memo
from .layout import SpmdLayout

if TYPE_CHECKING:
    from torchtitan_spmd.config import ParallelismConfig

__all__ = [
    "MeshAxisName",
    "ParallelDims",
    "ParallelDimsError",
    "SpmdLayout",
    "SpmdMeshUnavailableError",
    "device_type",
    "seq_len_divisor",
    "unfold_dp_axes",
    "unfold_dp_axis",
]

#: The device type of meshes built by a ``ParallelDims`` created without one:
#: ``"cuda"`` when CUDA is available, else ``"cpu"``. Read when the ``ParallelDims``
#: is created, so patching it (as torchtitan's tests patch theirs) takes effect.
device_type: str = "cuda" if torch.cuda.is_available() else "cpu"


class ParallelDimsError(ValueError, AssertionError):
    """Invalid parallel degrees: a ``ValueError`` that is also an ``AssertionError``.

    torchtitan's ``ParallelDims`` asserts its degrees; this library raises a
    ``ValueError`` naming them, and keeps ``except AssertionError`` working.
    """


class SpmdMeshUnavailableError(ValueError, KeyError):
    """The backend has no such SPMD mesh: a ``ValueError`` that is also upstream's ``KeyError``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MeshAxisName(enum.StrEnum):
    """Logical names of mesh axes that tensors and modules are placed on."""

    DP = "dp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    FSDP = "fsdp"
    TP = "tp"
    CP = "cp"
    PP = "pp"
    EP = "ep"
    EFSDP = "efsdp"


def unfold_dp_axis(axis: MeshAxisName | str) -> tuple[MeshAxisName, ...]:
    """One logical axis as the concrete dense axes it stands for: ``dp`` is ``(dp_replicate, dp_shard)``.

    Upstream's name and semantics at b5bcd76 (its sharding protocol reads it). An axis that
    is not a :class:`MeshAxisName` is a ``ValueError`` naming it and the valid names.

    >>> unfold_dp_axis("dp")
    (<MeshAxisName.DP_REPLICATE: 'dp_replicate'>, <MeshAxisName.DP_SHARD: 'dp_shard'>)
    >>> unfold_dp_axis("tp")
    (<MeshAxisName.TP: 'tp'>,)
    """
    try:
        name = MeshAxisName(axis)
    except ValueError:
        raise ValueError(f"unfold_dp_axis: {axis!r} is not a mesh axis name; valid names: "
                         f"{[a.value for a in MeshAxisName]}") from None
    if name == MeshAxisName.DP:
        return (MeshAxisName.DP_REPLICATE, MeshAxisName.DP_SHARD)
    return (name,)


def unfold_dp_axes(axes: Iterable[str]) -> list[str]:
    """Replace a logical ``"dp"`` with ``"dp_replicate", "dp_shard"``, keeping the order.

    >>> unfold_dp_axes(["dp", "cp", "tp"])
    ['dp_replicate', 'dp_shard', 'cp', 'tp']
    """
    out: list[str] = []
    for axis in axes:
        name = str(axis)
        if name == MeshAxisName.DP:
            out += [MeshAxisName.DP_REPLICATE.value, MeshAxisName.DP_SHARD.value]
        else:
            out.append(name)
    return out


# --------------------------------------------------------------------------------------
# The tables.
# --------------------------------------------------------------------------------------
#: The base axes, outermost first; ranks are laid out row-major over them.
_BASE_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class _AxisRecipe:
    """How one mesh axis is carved out of the row-major layout of the base axes."""

    #: Consecutive base axes merged (row-major) into this axis.
    span: tuple[str, ...]
    #: Split the span into ``(size // ep, ep)`` and keep the outer or the inner part.
    ep_part: Literal["outer", "inner"] | None = None
    #: The axis whose size decides whether this one is active (default: itself).
    activated_by: str | None = None


_AXES: dict[str, _AxisRecipe] = {
    "pp": _AxisRecipe(("pp",)),
    "dp_replicate": _AxisRecipe(("dp_replicate",)),
    "dp_shard": _AxisRecipe(("dp_shard",)),
    "cp": _AxisRecipe(("cp",)),
    "tp": _AxisRecipe(("tp",)),
    "batch": _AxisRecipe(("dp_replicate", "dp_shard")),
    "dp": _AxisRecipe(("dp_replicate", "dp_shard")),
    "loss": _AxisRecipe(("dp_replicate", "dp_shard", "cp")),
    "fsdp": _AxisRecipe(("dp_shard", "cp")),
    "efsdp": _AxisRecipe(("dp_shard", "cp", "tp"), ep_part="outer", activated_by="ep"),
    "ep": _AxisRecipe(("dp_shard", "cp", "tp"), ep_part="inner"),
}


#: The dim name of the loss mesh, as torchtitan's (``_flatten("loss_mesh")``); its axis is ``loss``.
_DIM_NAMES: dict[str, str] = {"loss": "loss_mesh"}


def _dim_names(axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_DIM_NAMES.get(a, a) for a in axes)


_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
_FROZEN_AFTER_BUILD = (*_DEGREES, "world_size", "spmd_backend", "device_type")


def _ensure_fake_backend_registered() -> None:
    # Importing this module registers torch's "fake" process-group backend
    # (torch 2.14: it is listed in Backend.backend_list but has no creator until then).
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


# --------------------------------------------------------------------------------------
# ParallelDims.
# --------------------------------------------------------------------------------------
@legacy_parallel_dims  # compat hook
@dataclass
class ParallelDims:
    """Parallel degrees, their validation, and the device meshes of one SPMD backend.

    Args:
        dp_replicate: replicated data-parallel degree (the outer axis of HSDP).
        dp_shard: sharded data-parallel (FSDP) degree; ``-1`` infers
            ``world_size // (dp_replicate * cp * tp * pp)``.
        cp: context-parallel degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        ep: expert-parallel degree. Not a factor of ``world_size``: EP reuses the
            ranks of ``dp_shard * cp * tp``, which it must divide.
        world_size: the number of ranks.
        spmd_backend: ``"default"`` (or upstream's August spelling ``"partial_dtensor"``),
            ``"full_dtensor"`` or ``"spmd_types"``; read back as written. Default: the
            fork's surface's (``"default"`` under ``june``, ``"spmd_types"`` under ``august``;
            see :mod:`torchtitan_spmd.config.surface`).
        device_type: device of the meshes; default: the module-level
            :data:`device_type` (``"cuda"`` when CUDA is available, else ``"cpu"``).
            Also chooses the process-group backend (:attr:`pg_backend`) if
            ``build_mesh`` has to initialise one.

    Raises:
        ParallelDimsError: (a ``ValueError`` and an ``AssertionError``) a degree below 1
            (``dp_shard`` may be -1); ``dp_shard=-1`` with the other degrees not dividing
            ``world_size``; degrees whose product is not ``world_size``; ``ep`` not
            dividing ``dp_shard * cp * tp``.
        ValueError: an unknown ``spmd_backend``.
        TypeError: a degree that is not an int.

    The degrees are fixed once the meshes are built.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    spmd_backend: str = field(default_factory=lambda: get_surface().default_backend)
    device_type: str | None = field(default=None, kw_only=True)

    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _meshes: dict[tuple[str, ...], DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _groups: dict[tuple[_mesh_compat.AxisLayout, str | None], str] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    # ---------------------------------------------------------------- construction
    def __post_init__(self) -> None:
        if self.device_type is None:
            self.device_type = device_type  # the module-level default
        if not (isinstance(self.device_type, str) and self.device_type.isalpha()):
            raise ValueError(
                f"ParallelDims: device_type must be a device type such as 'cpu' or 'cuda' "
                f"(no index), got {self.device_type!r}."
            )
        self._validate()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "spmd_backend":
            value = self._check_backend(value)
        if name in _FROZEN_AFTER_BUILD and getattr(self, "_world_mesh", None) is not None:
            if getattr(self, name) != value:
                raise RuntimeError(
                    f"ParallelDims.{name} cannot change after build_mesh(); "
                    "create a new ParallelDims instead."
                )
        super().__setattr__(name, value)

    @staticmethod
    def _check_backend(value: Any) -> str:
        return check_backend_spelling(value, "ParallelDims: spmd_backend")

    def _validate(self) -> None:
        for name in (*_DEGREES, "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"ParallelDims: {name} must be an int, got {type(value).__name__} {value!r}."
                )
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise ParallelDimsError(f"ParallelDims: {name} must be >= 1, got {getattr(self, name)}.")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ParallelDimsError(
                f"ParallelDims: dp_shard must be >= 1, or -1 to infer it, got {self.dp_shard}."
            )
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelDimsError(
                    "ParallelDims: cannot infer dp_shard (-1): dp_replicate "
                    f"({self.dp_replicate}) * cp ({self.cp}) * tp ({self.tp}) * pp ({self.pp}) "
                    f"= {others} does not divide world_size ({self.world_size})."
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ParallelDimsError(
                f"ParallelDims: dp_replicate ({self.dp_replicate}) * dp_shard ({self.dp_shard}) * "
                f"cp ({self.cp}) * tp ({self.tp}) * pp ({self.pp}) = {product}, "
                f"but world_size is {self.world_size}. (ep is not a factor: it reuses "
                "the dp_shard * cp * tp ranks.)"
            )
        region = self.dp_shard * self.cp * self.tp
        if region % self.ep:
            raise ParallelDimsError(
                # upstream b5bcd76's words first (its unit test matches them), then the arithmetic
                f"ParallelDims: expert_parallel_degree ({self.ep}) must divide dp_shard * cp * tp "
                f"({region}): ep ({self.ep}) must divide dp_shard * cp * tp = "
                f"{self.dp_shard} * {self.cp} * {self.tp} = {region}, because expert "
                "parallelism reuses those ranks."
            )

    @classmethod
    def from_config(
        cls,
        parallelism_config: ParallelismConfig,
        world_size: int,
        *,
        device_type: str | None = None,
    ) -> ParallelDims:
        """Build from a ``[parallelism]`` config section and the world size."""
        c = parallelism_config
        return cls(
            dp_replicate=c.data_parallel_replicate_degree,
            dp_shard=c.data_parallel_shard_degree,
            cp=c.context_parallel_degree,
            tp=c.tensor_parallel_degree,
            pp=c.pipeline_parallel_degree,
            ep=c.expert_parallel_degree,
            world_size=world_size,
            spmd_backend=c.spmd_backend,
            device_type=device_type,
        )

    # ---------------------------------------------------------------- the tables
    @property
    def _table(self) -> BackendMeshes:
        return backend(self.spmd_backend).meshes

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        """The single-axis mesh names of this backend, in table order."""
        names: dict[str, None] = {}
        for axes in self._table.global_meshes.values():
            names.update(dict.fromkeys(axes))
        return tuple(names)

    def axis_size(self, axis: str) -> int:
        """The size of mesh axis ``axis`` (any name of :data:`_AXES`, e.g. ``"efsdp"``)."""
        recipe = _AXES[self._known(axis, _AXES)]
        size = math.prod(getattr(self, base) for base in recipe.span)
        if recipe.ep_part == "inner":
            return self.ep
        if recipe.ep_part == "outer":
            return size // self.ep
        return size

    def is_axis_active(self, axis: str) -> bool:
        """Whether ``axis`` has a real process group (otherwise a fake one).

        True when the axis is larger than 1, and always for ``fsdp`` (default) and
        ``dp_shard`` (full_dtensor, spmd_types); ``efsdp`` is active iff ``ep > 1``.
        """
        name = self._known(axis, _AXES)
        if name in self._table.always_active:
            return True
        return self.axis_size(_AXES[name].activated_by or name) > 1

    def _axis_layout(self, axis: str) -> _mesh_compat.AxisLayout:
        recipe = _AXES[axis]
        # Row-major: a base axis' stride is the product of the degrees inside it.
        strides = {
            base: math.prod(getattr(self, inner) for inner in _BASE_AXES[i + 1 :])
            for i, base in enumerate(_BASE_AXES)
        }
        sizes = tuple(getattr(self, b) for b in recipe.span)
        span = _mesh_compat.axis_layout(sizes, tuple(strides[b] for b in recipe.span))
        if recipe.ep_part is None:
            return span
        outer, inner = _mesh_compat.split_axis(span, math.prod(sizes) // self.ep, self.ep)
        return outer if recipe.ep_part == "outer" else inner

    @staticmethod
    def _known(axis: Any, valid: Iterable[str]) -> str:
        name = str(axis)
        if name not in valid:
            raise ValueError(
                f"ParallelDims: unknown mesh axis {axis!r}; valid names are "
                f"{', '.join(map(repr, valid))}.{suggest(name, valid)}"
            )
        return name

    def _names(self, dims: str | Sequence[str]) -> tuple[str, ...]:
        """Validate mesh axis names against this backend's; return them as plain str."""
        names = (str(dims),) if isinstance(dims, str) else tuple(str(d) for d in dims)
        if not names:
            raise ValueError("ParallelDims: no mesh axis requested.")
        valid = self.mesh_axis_names
        for name in names:
            if name not in valid:
                raise ValueError(
                    f"ParallelDims: Invalid mesh dim: {name!r} under spmd_backend="
                    f"{self.spmd_backend!r}. Valid dimensions are: {list(valid)}."
                    f"{suggest(name, valid)}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"ParallelDims: mesh axes {names} repeat an axis.")
        return names

    # ---------------------------------------------------------------- building
    @property
    def pg_backend(self) -> str:
        """The process-group backend for :attr:`device_type`: gloo on CPU, nccl on CUDA."""
        return dist.Backend.default_device_backend_map.get(str(self.device_type), "gloo")

    def build_mesh(self) -> DeviceMesh:
        """Create every mesh of this backend (idempotent); return the world mesh.

        Initialises the default process group with :attr:`pg_backend` if there is
        none (``env://``, as set by torchrun). Raises ``ValueError`` if it has a
        different world size, and ``RuntimeError`` if a built mesh or one of its
        groups does not have the expected size.
        """
        if self._world_mesh is not None:
            return self._world_mesh
        if not dist.is_initialized():
            dist.init_process_group(self.pg_backend)
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims: world_size is {self.world_size} but the default process "
                f"group has {dist.get_world_size()} ranks."
            )
        planner_memo.install()  # DTensor's redistribution planner, each edge priced once
        key = self._reuse_key()
        built = mesh_reuse.reusable(key)
        if built is not None:
            # The previous build's layout on the same world: its very mesh objects and groups,
            # so DTensor's sharding caches stay valid (distributed/mesh_reuse.py).
            self._world_mesh, self._meshes, self._groups = built.world_mesh, built.meshes, built.groups
            mesh_reuse.settle_caches(reused=True)
            return built.world_mesh
        rank_map = torch.arange(self.world_size, dtype=torch.int)
        world = self._new_mesh(_BASE_AXES, rank_map, root=None)
        self._check_mesh(_BASE_AXES, world)
        self._world_mesh = world
        self._meshes = {_BASE_AXES: world}
        try:
            # Every axis of the backend is in a global mesh, so this creates every
            # group; other sub-meshes are views created (and cached) on request.
            for axes in self._table.global_meshes.values():
                self._mesh(axes)
        except BaseException:
            self._world_mesh, self._meshes = None, {}
            raise
        mesh_reuse.remember(key, mesh_reuse.BuiltMeshes(
            dist.distributed_c10d._get_default_group(), world, self._meshes, self._groups))
        mesh_reuse.settle_caches(reused=False)  # new mesh objects: nothing cached may refer to them
        return world

    def _reuse_key(self) -> tuple[Any, ...]:
        """What decides every mesh and group of :meth:`build_mesh` (besides the default group)."""
        return (*(getattr(self, name) for name in _DEGREES), self.world_size, self.spmd_backend,
                self.device_type)

    def _mesh(self, axes: tuple[str, ...]) -> DeviceMesh:
        """The cached mesh over ``axes`` (in mesh order), created and checked on first use."""
        mesh = self._meshes.get(axes)
        if mesh is None:
            world = self.build_mesh()
            mesh = self._new_mesh(axes, world._rank_map, root=world)
            self._check_mesh(axes, mesh)
            self._meshes[axes] = mesh
            if len(axes) == 1 and axes[0] not in _BASE_AXES and self.is_axis_active(axes[0]):
                # Lets DTensor find a flattened group for a multi-axis collective, and
                # makes torch's own ``_flatten`` of the same ranks reuse this mesh. Never
                # a fake-backed axis: DTensor picks a flattened mesh by its ranks alone
                # (e.g. inactive ``efsdp`` has the ranks of ``(dp_shard, cp, tp)``), and its
                # collectives would then silently do nothing.
                world._flatten_mapping.setdefault(_dim_names(axes)[0], mesh)
        return mesh

    def _new_mesh(
        self, axes: tuple[str, ...], rank_map: torch.Tensor, root: DeviceMesh | None
    ) -> DeviceMesh:
        """A mesh over ``axes``, a view of ``root``'s ranks, using the pooled groups."""
        mesh = DeviceMesh(
            str(self.device_type),
            _layout=_mesh_compat.mesh_layout(
                [self._axis_layout(a) for a in axes],
                flattened=len(axes) == 1 and axes[0] not in _BASE_AXES,
            ),
            _rank_map=rank_map,
            mesh_dim_names=_dim_names(axes),
            _root_mesh=root,
            _init_backend=False,
        )
        if root is None:
            # As init_device_mesh does before creating groups: select the current
            # CUDA device (from LOCAL_RANK) so NCCL communicators bind to it.
            setup = getattr(mesh, "_setup_world_group_and_device", None)
            if setup is not None:
                setup()
        else:
            # Same ranks as the root: share its copy of the rank tuple (DeviceMesh
            # keeps one per mesh; ~36 MB each at a million ranks).
            mesh._flatten_rank_map = root._flatten_rank_map
        mesh._dim_group_names = [self._group_name(a, rank_map) for a in axes]
        registry = (root or mesh)._pg_registry
        for name in mesh._dim_group_names:
            registry.setdefault(name, dist.distributed_c10d._resolve_process_group(name))
        return mesh

    def _group_name(self, axis: str, rank_map: torch.Tensor) -> str:
        """The group of ``axis`` for this rank, created once per (ranks, real/fake)."""
        layout = self._axis_layout(axis)
        backend = None if self.is_axis_active(axis) else "fake"
        key = (layout, backend)
        if key not in self._groups:
            if backend == "fake":
                _ensure_fake_backend_registered()
            # This rank's group only (or the default group, or one split_group when
            # the default group has a bound device), once per rank set; new_group's
            # get the default group's timeout (the trainer sets its own on every
            # group after build_mesh: comm.set_pg_timeouts).
            timeout = _mesh_compat.default_group_timeout(str(self.device_type))
            name = _mesh_compat.init_axis_group(layout, rank_map, axis, backend, timeout)
            if name is None:
                raise RuntimeError(
                    f"ParallelDims: rank {dist.get_rank()} is in no {axis!r} process group."
                )
            self._groups[key] = name
        return self._groups[key]

    def _check_mesh(self, axes: tuple[str, ...], mesh: DeviceMesh) -> None:
        expected = tuple(self.axis_size(a) for a in axes)
        groups = tuple(mesh.get_group(i).size() for i in range(len(axes)))
        if mesh.mesh_dim_names != _dim_names(axes) or mesh.shape != expected or groups != expected:
            raise RuntimeError(
                f"ParallelDims: the {axes} mesh came out with axes {mesh.mesh_dim_names}, "
                f"shape {mesh.shape} and group sizes {groups}; expected shape {expected} "
                f"for {self!r}."
            )

    # ---------------------------------------------------------------- getters
    @property
    def world_mesh(self) -> DeviceMesh:
        """The 5-axis ``(pp, dp_replicate, dp_shard, cp, tp)`` root mesh (built on first use).

        Every other mesh is a view of it. Its flattened axes (``batch``, ``loss``,
        ``fsdp``, ``efsdp``, ``ep``, ...) are registered as torch flattened meshes.
        """
        return self.build_mesh()

    @property
    def global_meshes(self) -> dict[str, DeviceMesh]:
        """This backend's global meshes by name (e.g. ``dense``, ``sparse``, ``data``, ``loss``)."""
        self.build_mesh()
        return {name: self._meshes[axes] for name, axes in self._table.global_meshes.items()}

    @property
    def _global_meshes(self) -> dict[str, DeviceMesh]:
        """torchtitan's ``_global_meshes``, by its keys; empty before ``build_mesh``.

        ``dataloading`` ``(pp, batch, cp, tp)``, ``loss`` (the 1-D ``loss_mesh``),
        ``dense`` (the mesh FSDP shards: ``(pp, dp_replicate, fsdp, tp)`` under default,
        ``(pp, dp_replicate, dp_shard, cp, tp)`` otherwise), ``sparse``
        ``(pp, dp_replicate, efsdp, ep)`` and, under spmd_types, ``spmd_dense_for_fwdbwd``
        ``(dp, cp, tp)`` (size-1 axes included), which torchtitan's
        ``get_train_context`` and ``annotate_input_spmd_types`` read.
        """
        if self._world_mesh is None:
            return {}
        table = self._table
        return {
            name: self._mesh(axes)
            for name, axes in table.upstream_global_meshes.items()
            if self.ep > 1 or name not in table.upstream_ep_only
        }

    @property
    def _single_axis_meshes(self) -> dict[str, DeviceMesh]:
        """Every 1-D mesh by axis name, fake-backed ones included; empty before ``build_mesh``.

        The name and contents of torchtitan's attribute, which its tests and some
        forks read; prefer :meth:`get_optional_mesh`.
        """
        if self._world_mesh is None:
            return {}
        return {name: self._mesh((name,)) for name in self.mesh_axis_names}

    def get_optional_mesh(
        self,
        dims: str | Sequence[str],
        *,
        include_singleton_axes: bool = False,
    ) -> DeviceMesh | None:
        """The mesh over axis ``dims`` (a name or a sequence of names), or None.

        Builds the meshes first if needed. Returns None when a requested axis is
        inactive (see :meth:`is_axis_active`) unless ``include_singleton_axes``. A
        multi-axis mesh is sliced from the first global mesh that contains every
        requested axis, with the axes in that mesh's order (whatever the order
        requested). Results are cached: the same request returns the same object.

        Raises:
            ValueError: an unknown axis name (``"Invalid mesh dim: ..."``, listing this
                backend's names), a repeated axis, or axes that no global mesh combines.
        """
        names = self._names(dims)
        self.build_mesh()
        if len(names) > 1:
            for axes in self._table.global_meshes.values():
                if set(names) <= set(axes):
                    names = tuple(a for a in axes if a in names)
                    break
            else:
                raise ValueError(
                    f"ParallelDims: Invalid mesh name combinations {list(names)}: no mesh of "
                    f"spmd_backend={self.spmd_backend!r} combines them; its global meshes are "
                    + ", ".join(f"{k}={v}" for k, v in self._table.global_meshes.items())
                    + "."
                )
        if not include_singleton_axes and not all(self.is_axis_active(n) for n in names):
            return None
        return self._mesh(names)

    def get_mesh(self, dims: str | Sequence[str]) -> DeviceMesh:
        """Like :meth:`get_optional_mesh`, but raise ``ValueError`` when the mesh is unavailable."""
        mesh = self.get_optional_mesh(dims)
        if mesh is None:
            inactive = [
                f"{n} (size {self.axis_size(n)})"
                for n in self._names(dims)
                if not self.is_axis_active(n)
            ]
            raise ValueError(
                f"Mesh {dims!r} is not available under spmd_backend={self.spmd_backend!r}: "
                f"inactive axes {', '.join(inactive)}. Ensure the corresponding parallelism "
                "dimension is enabled (size > 1); an axis is active when it has a real process "
                "group (see is_axis_active; get_optional_mesh returns None instead)."
            )
        return mesh

    def get_activated_mesh(self, axes: str | Sequence[str]) -> DeviceMesh | None:
        """The mesh over the active ones of ``axes``; None if none is active.

        Unlike :meth:`get_optional_mesh`, which returns None as soon as one axis is inactive.
        As torchtitan's, names this backend has no axis for are dropped too (e.g.
        ``["dp_replicate", "fsdp"]`` under full_dtensor, which has ``dp_shard`` instead
        of ``fsdp``: the ``dp_replicate`` mesh, or None).
        """
        self.build_mesh()
        valid = self.mesh_axis_names
        requested = (str(axes),) if isinstance(axes, str) else tuple(str(a) for a in axes)
        names = [n for n in requested if n in valid and self.is_axis_active(n)]
        return self.get_optional_mesh(names) if names else None

    def resolve_mesh(self, axes: str | Sequence[str]) -> DeviceMesh | None:
        """The mesh a tensor placed on logical ``axes`` lives on under this backend.

        - default: keeps ``tp`` and ``ep`` (FSDP handles the data-parallel axes);
        - full_dtensor: keeps every axis, with ``dp`` unfolded into ``dp_replicate,
          dp_shard``; the result must be one of :meth:`spmd_meshes`, so a tensor
          that leaves out an active axis of its mesh raises ``ValueError``;
        - spmd_types: keeps ``dp``, ``cp``, ``tp`` and ``ep``.

        Inactive axes, and names this backend has no axis for, are dropped (as
        torchtitan's); returns None if nothing is left.
        """
        names = [str(a) for a in ((axes,) if isinstance(axes, str) else axes)]
        table = self._table
        if table.unfold_dp:
            names = unfold_dp_axes(names)
        if table.in_band is not None:
            names = [n for n in names if n in table.in_band]
        if not names:
            return None
        mesh = self.get_activated_mesh(names)
        if mesh is not None and table.resolve_to_spmd_mesh_only:
            spmd = self.spmd_meshes()
            if not any(mesh is m for m in spmd):
                raise ValueError(
                    f"ParallelDims.resolve_mesh({list(map(str, axes))}) resolved to axes "
                    f"{mesh.mesh_dim_names}, which is not one of the SPMD meshes of "
                    f"spmd_backend={self.spmd_backend!r}: "
                    f"{[m.mesh_dim_names for m in spmd]}. Name every active axis of the "
                    "tensor's mesh (use R for replicated axes)."
                )
        return mesh

    def resolve_shared_mesh(self, placements: Iterable[SpmdLayout | None]) -> DeviceMesh | None:
        """The mesh shared by the layouts of one module boundary (``None`` entries skipped).

        Every layout must name the same axes, in the same order (their types may
        differ: that is a redistribution on one mesh). Returns :meth:`resolve_mesh`
        of those axes, or None when every entry is None or no axis is kept.

        Raises:
            ValueError: two layouts name different axes (torchtitan asserts).
        """
        layouts = [p for p in placements if p is not None]
        if not layouts:
            return None
        axes = layouts[0].axes()
        for other in layouts[1:]:
            if other.axes() != axes:
                raise ValueError(
                    "ParallelDims.resolve_shared_mesh: Inconsistent mesh axes within a boundary: "
                    f"{[str(a) for a in axes]} vs {[str(a) for a in other.axes()]}."
                )
        return self.resolve_mesh(axes)

    def spmd_meshes(self) -> list[DeviceMesh]:
        """The SPMD meshes of this backend, dense then sparse, restricted to active axes.

        As torchtitan's, built on first use:

        - default: ``(dp_replicate, fsdp, tp)`` and ``(dp_replicate, efsdp, ep)``;
        - full_dtensor: ``(dp_replicate, dp_shard, cp, tp)`` and ``(dp_replicate, efsdp, ep)``;
        - spmd_types: ``(dp, cp, tp)`` and ``(dp_replicate, efsdp, ep)``.

        Inactive axes are dropped (``fsdp`` and, except under default, ``dp_shard``
        are always active; ``efsdp`` is active iff ``ep > 1``), and a mesh with no
        active axis is left out. ``pp`` is never part of them: each pipeline stage
        holds different modules, so no tensor spans stages. Under ``full_dtensor``,
        :meth:`resolve_mesh` returns one of these objects or raises.
        """
        out: list[DeviceMesh] = []
        for axes in self._table.spmd_meshes:
            mesh = self.get_activated_mesh(axes)
            if mesh is not None and not any(mesh is m for m in out):
                out.append(mesh)
        return out

    # ---------------------------------------------------------------- upstream b5bcd76 (August)
    def _spmd_fwdbwd_mesh(self, axes: tuple[str, ...]) -> DeviceMesh | None:
        self.build_mesh()
        if self._table.spmd_fwdbwd_singletons:
            return self._mesh(axes)
        return self.get_activated_mesh(axes)

    def spmd_dense_mesh(self) -> DeviceMesh:
        """The dense mesh of the forward and backward (upstream b5bcd76's ``spmd_dense_mesh()``).

        - spmd_types: ``(dp, cp, tp)`` with its size-1 axes, upstream's
          ``_global_meshes["spmd_dense_for_fwdbwd"]`` (the same object);
        - full_dtensor (this library's extension; upstream removed the backend): the active
          axes of ``(dp_replicate, dp_shard, cp, tp)``, ``spmd_meshes()[0]``;
        - default / partial_dtensor: no such mesh (upstream: ``KeyError``).

        Raises:
            SpmdMeshUnavailableError: (a ``KeyError`` and a ``ValueError``) under a backend
                with no dense SPMD mesh.
        """
        axes = self._table.spmd_dense
        if axes is None:
            raise SpmdMeshUnavailableError(
                f"ParallelDims.spmd_dense_mesh(): spmd_backend={self.spmd_backend!r} has no dense SPMD "
                "mesh (upstream b5bcd76 defines it under 'spmd_types' only; this library under "
                "'full_dtensor' too). Use get_dense_tp_mesh() or get_mesh('tp')."
            )
        mesh = self._spmd_fwdbwd_mesh(axes)
        if mesh is None:  # every axis inactive: nothing is distributed
            raise SpmdMeshUnavailableError(
                f"ParallelDims.spmd_dense_mesh(): no axis of {axes} is active under "
                f"spmd_backend={self.spmd_backend!r} ({self!r})."
            )
        return mesh

    def spmd_sparse_mesh(self) -> DeviceMesh | None:
        """The experts' mesh of the forward and backward (upstream b5bcd76's ``spmd_sparse_mesh()``).

        ``(dp_replicate, efsdp, ep)`` when ``ep > 1`` (under spmd_types with its size-1 axes,
        upstream's ``_global_meshes["spmd_sparse_for_fwdbwd"]``; under full_dtensor its active
        axes), else None; None under default / partial_dtensor, as upstream.
        """
        axes = self._table.spmd_sparse
        if axes is None or self.ep == 1:
            return None
        return self._spmd_fwdbwd_mesh(axes)

    def get_dense_tp_mesh(self) -> DeviceMesh:
        """The 1-D ``tp`` mesh of the dense forward and backward (upstream b5bcd76's).

        Under a backend with a dense SPMD mesh that keeps size-1 axes (spmd_types) it is
        that mesh's ``tp`` axis, even at ``tp == 1``; otherwise :meth:`get_mesh` ``("tp")``,
        which raises when TP is off, as upstream.
        """
        table = self._table
        if table.spmd_dense is not None and table.spmd_fwdbwd_singletons and "tp" in table.spmd_dense:
            self.build_mesh()
            return self._mesh(("tp",))  # the dense mesh's tp axis, sharing its group
        return self.get_mesh("tp")

    def get_all_one_dimensional_meshes(self) -> dict[str, DeviceMesh]:
        """The 1-D meshes of size > 1 with a real process group, by axis name.

        As torchtitan's since its #4068 (after a0c831c49): fake-backed axes are left
        out (``efsdp`` when ``ep == 1``, whatever its size), so every group reported
        can carry a collective (e.g. a timeout set on each).
        """
        self.build_mesh()
        return {
            name: mesh
            for name, mesh in self._single_axis_meshes.items()
            if mesh.size() > 1 and self.is_axis_active(name)
        }

    # ---------------------------------------------------------------- properties
    @property
    def dp_enabled(self) -> bool:
        """Data parallelism of either kind (``dp_replicate > 1`` or ``dp_shard > 1``)."""
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """``dp_replicate > 1``."""
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """``dp_shard > 1``."""
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        """``cp > 1``."""
        return self.cp > 1

    @property
    def dp_cp_enabled(self) -> bool:
        """``dp_enabled or cp_enabled`` (torchtitan's name)."""
        return self.dp_enabled or self.cp_enabled

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded over ``dp_shard * cp`` ranks (``> 1``)."""
        return self.dp_shard > 1 or self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        """``tp > 1``."""
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        """``pp > 1``."""
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        """``ep > 1``."""
        return self.ep > 1

    @property
    def non_data_parallel_size(self) -> int:
        """``cp * tp * pp``: ranks that see the same batch shard."""
        return self.cp * self.tp * self.pp

    @property
    def seq_len_divisor(self) -> int:
        """torchtitan's ``ParallelDims.seq_len_divisor``, the same at a0c831c49 (June) and b5bcd76
        (August): ``tp * (cp * 2)``, whatever ``cp`` (so ``2 * tp`` without CP).

        This library's own check of ``training.seq_len`` is the module's :func:`seq_len_divisor`,
        which knows the load balancer and sequence parallelism (without CP there are no head-tail
        chunks: ``tp``); this property keeps upstream's value for a fork that reads it."""
        return self.tp * (self.cp * 2)


def seq_len_divisor(*, cp: int, tp: int, load_balancer: str | None = "headtail",
                    sequence_parallel: bool = True) -> int:
    """What ``training.seq_len`` must be a multiple of under these CP and TP degrees (the one definition).

    ``headtail`` CP cuts a sequence into ``2 * cp`` chunks (no balancing: ``cp``; no CP: 1);
    sequence parallelism then splits each rank's slice over ``tp`` (without it, TP does
    not split the sequence). torchtitan's ``seq_len_divisor`` is the first case, ``tp * 2 * cp``.
    """
    divisor = 2 * cp if load_balancer == "headtail" and cp > 1 else cp
    return divisor * tp if sequence_parallel else divisor

"""The backend registry: the one place that knows each ``parallelism.spmd_backend``.

One :class:`Backend` record per backend says everything the layers above need to
know about it by name, as plain data (no torch import), so every layer can read it:

- ``module``: the module whose ``REPRESENTATION`` implements it (the runtime's
  :func:`~torchtitan_spmd.distributed.representation.get_representation` imports it);
- ``meshes``: its device meshes as a table (:class:`BackendMeshes`), which
  ``ParallelDims`` (the mesh layer) interprets without ever branching on the name;
- ``typechecking`` / ``context_parallel`` / ``pipeline_parallel``: whether
  ``debug.spmd_typechecking`` checks anything and whether it runs ``context_parallel_degree > 1``
  / ``pipeline_parallel_degree > 1``; the representation's ``supports_typechecking`` /
  ``supports_context_parallel`` / ``supports_pipeline_parallel`` read them from here;
  ``local_tensor``: whether ``comm.mode="local_tensor"`` simulates it (``supports_local_tensor``).

:func:`resolve_backend` is the one check of a backend name (aliases, unknown names)
that the config sections, the command line, ``ParallelDims`` and the runtime share.
A fourth backend is one representation module and one :func:`register_backend` call::

    register_backend(dataclasses.replace(backend("default"), name="mine", module="my_fork.mine"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan_spmd._errors import suggest

__all__ = [
    "Backend",
    "BackendMeshes",
    "backend",
    "backend_names",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
]


@dataclass(frozen=True)
class BackendMeshes:
    """One backend's device meshes, as data (read by ``ParallelDims``).

    Axis names are ``ParallelDims``'s (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``,
    ``tp``, ``batch``, ``dp``, ``loss``, ``fsdp``, ``efsdp``, ``ep``).
    """

    #: Global meshes by name, each an ordered tuple of axes. Multi-axis requests are
    #: sliced from the first one (in this order) that contains every requested axis.
    global_meshes: dict[str, tuple[str, ...]]
    #: torchtitan's ``ParallelDims._global_meshes`` by its keys (``dataloading``,
    #: ``loss``, ``dense``, ``sparse``, and ``spmd_dense_for_fwdbwd`` under spmd_types).
    upstream_global_meshes: dict[str, tuple[str, ...]]
    #: Axes that have a real process group even at size 1.
    always_active: frozenset[str]
    #: The axes ``resolve_mesh`` keeps; ``None`` keeps every axis.
    in_band: frozenset[str] | None
    #: ``resolve_mesh`` first replaces a logical ``dp`` with ``dp_replicate, dp_shard``.
    unfold_dp: bool
    #: The axes of each mesh in ``spmd_meshes()`` (dense, then sparse), before inactive
    #: axes are dropped; torchtitan's candidates.
    spmd_meshes: tuple[tuple[str, ...], ...]
    #: ``resolve_mesh`` raises unless its result is one of ``spmd_meshes()``.
    resolve_to_spmd_mesh_only: bool
    #: The axes of ``spmd_dense_mesh()`` (upstream b5bcd76's forward/backward mesh), or None:
    #: the backend has none (upstream's ``partial_dtensor``).
    spmd_dense: tuple[str, ...] | None = None
    #: The axes of ``spmd_sparse_mesh()`` when ``ep > 1`` (None otherwise), or None: never.
    spmd_sparse: tuple[str, ...] | None = None
    #: ``spmd_dense_mesh()`` / ``spmd_sparse_mesh()`` keep size-1 axes (upstream's, under
    #: spmd_types); otherwise inactive axes are dropped, as in ``spmd_meshes()``.
    spmd_fwdbwd_singletons: bool = False
    #: Keys of ``upstream_global_meshes`` that exist only when ``ep > 1``.
    upstream_ep_only: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Backend:
    """Everything the library knows about one backend by its name."""

    name: str
    """The ``parallelism.spmd_backend`` value."""

    module: str
    """The module that defines ``REPRESENTATION``, its ``TensorRepresentation`` subclass."""

    meshes: BackendMeshes
    """Its device meshes."""

    typechecking: bool = False
    """Whether ``debug.spmd_typechecking`` checks anything under it."""

    context_parallel: bool = False
    """Whether it runs context parallelism (``parallelism.context_parallel_degree > 1``)."""

    pipeline_parallel: bool = False
    """Whether it runs pipeline parallelism (``parallelism.pipeline_parallel_degree > 1``)."""

    local_tensor: bool = False
    """Whether ``comm.mode="local_tensor"`` simulates it (its numbers measured equal to the
    multi-process run's; bench/local_tensor_bench.py)."""


_BASE = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_DATA = ("pp", "batch", "cp", "tp")  # data loading: which batch shard a rank reads
_LOSS = ("loss",)  # loss all-reduce over every data-parallel rank
_SPARSE = ("pp", "dp_replicate", "efsdp", "ep")  # MoE experts
_SPARSE_SPMD = ("dp_replicate", "efsdp", "ep")  # the sparse SPMD mesh (pp never is one)
_RUNTIME = "torchtitan_spmd.distributed.representations"

_REGISTRY: dict[str, Backend] = {}
#: Spellings written by newer torchtitan releases, normalised on load.
#: ``"partial_dtensor"`` is upstream's later name for ``"default"``.
_ALIASES: dict[str, str] = {"partial_dtensor": "default"}


def register_backend(entry: Backend) -> Backend:
    """Add (or replace) a backend; return it. Its name becomes valid everywhere at once."""
    if not (isinstance(entry, Backend) and isinstance(entry.name, str) and entry.name.isidentifier()):
        raise TypeError(f"register_backend expects a Backend with an identifier name, got {entry!r}.")
    if entry.name in _ALIASES:
        raise ValueError(f"register_backend: {entry.name!r} is an alias of {_ALIASES[entry.name]!r}.")
    _REGISTRY[entry.name] = entry
    return entry


def unregister_backend(name: str) -> None:
    """Remove a backend added with :func:`register_backend` (not a built-in one)."""
    if name in _BUILTIN:
        raise ValueError(f"unregister_backend: {name!r} is built in.")
    _REGISTRY.pop(name, None)


def backend_names() -> tuple[str, ...]:
    """Every registered backend name, built-in ones first."""
    return tuple(_REGISTRY)


def resolve_backend(value: Any, where: str = "parallelism.spmd_backend") -> str:
    """``value`` as a registered backend name (aliases normalised), else ``ValueError``.

    The message names ``where``, the value, every valid choice and the closest one.
    """
    if isinstance(value, str):
        value = _ALIASES.get(value, value)
        if value in _REGISTRY:
            return value
    choices = backend_names()
    raise ValueError(
        f"{where}: invalid value {value!r}; valid choices are "
        f"{', '.join(map(repr, choices))}.{suggest(value, choices)}"
    )


def backend(name: Any) -> Backend:
    """The registry record of backend ``name`` (validated by :func:`resolve_backend`)."""
    return _REGISTRY[resolve_backend(name)]


# --------------------------------------------------------------------------- built-ins
register_backend(Backend(
    "default", f"{_RUNTIME}.default",
    BackendMeshes(
        global_meshes={"dense": ("pp", "dp_replicate", "fsdp", "tp"), "sparse": _SPARSE, "data": _DATA,
                       "loss": _LOSS},
        upstream_global_meshes={"dataloading": _DATA, "loss": _LOSS,
                                "dense": ("pp", "dp_replicate", "fsdp", "tp"), "sparse": _SPARSE},
        always_active=frozenset({"fsdp"}),
        in_band=frozenset({"tp", "ep"}),
        unfold_dp=False,
        spmd_meshes=(("dp_replicate", "fsdp", "tp"), _SPARSE_SPMD),
        resolve_to_spmd_mesh_only=False,
    ),
    pipeline_parallel=True,
    local_tensor=True,
))
register_backend(Backend(
    "full_dtensor", f"{_RUNTIME}.full_dtensor",
    BackendMeshes(
        global_meshes={"dense": _BASE, "sparse": _SPARSE, "data": _DATA, "loss": _LOSS},
        upstream_global_meshes={"dataloading": _DATA, "loss": _LOSS, "dense": _BASE, "sparse": _SPARSE},
        always_active=frozenset({"dp_shard"}),
        in_band=None,
        unfold_dp=True,
        spmd_meshes=(("dp_replicate", "dp_shard", "cp", "tp"), _SPARSE_SPMD),
        resolve_to_spmd_mesh_only=True,
        spmd_dense=("dp_replicate", "dp_shard", "cp", "tp"),  # this library's extension
        spmd_sparse=_SPARSE_SPMD,
    ),
    context_parallel=True,
    pipeline_parallel=True,
    local_tensor=True,
))
register_backend(Backend(
    "spmd_types", f"{_RUNTIME}.spmd_types",
    BackendMeshes(
        global_meshes={"storage": _BASE, "dense": ("pp", "dp", "cp", "tp"), "sparse": _SPARSE, "data": _DATA,
                       "loss": _LOSS},
        upstream_global_meshes={"dataloading": _DATA, "loss": _LOSS, "dense": _BASE, "sparse": _SPARSE,
                                "spmd_dense_for_fwdbwd": ("dp", "cp", "tp"),
                                "spmd_sparse_for_fwdbwd": _SPARSE_SPMD},
        always_active=frozenset({"dp_shard"}),
        in_band=frozenset({"dp", "cp", "tp", "ep"}),
        unfold_dp=False,
        spmd_meshes=(("dp", "cp", "tp"), _SPARSE_SPMD),
        resolve_to_spmd_mesh_only=False,
        spmd_dense=("dp", "cp", "tp"),
        spmd_sparse=_SPARSE_SPMD,
        spmd_fwdbwd_singletons=True,
        upstream_ep_only=frozenset({"spmd_sparse_for_fwdbwd"}),
    ),
    typechecking=True,
    context_parallel=True,
    pipeline_parallel=True,
))
_BUILTIN = frozenset(_REGISTRY)

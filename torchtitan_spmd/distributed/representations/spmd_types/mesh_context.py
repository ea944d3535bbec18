"""The current mesh of ``spmd_types`` (thread-local, like the library's own stack), and mesh helpers.

``spmd_types``' checker and collectives read the library's current mesh; the
train context sets it to the representation's forward mesh. Nothing in this
runtime reads it back: the representation holds its own mesh.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import spmd_types as st  # the library (absolute import), not this package
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["active", "axis_names", "current_spmd_mesh", "group", "set_current_spmd_mesh"]

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
    the train context turns autograd multithreading off. Contexts must exit in
    the reverse order of entry (RuntimeError otherwise).
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


def axis_names(mesh: DeviceMesh | None) -> tuple[str, ...]:
    """The dim names of ``mesh`` (none for no mesh)."""
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def active(mesh: DeviceMesh | None, axis: str) -> bool:
    """Whether ``mesh`` has dim ``axis`` with more than one rank."""
    names = axis_names(mesh)
    return mesh is not None and axis in names and mesh.size(names.index(axis)) > 1


def group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    """The process group of dim ``axis`` of ``mesh``."""
    return mesh.get_group(axis)

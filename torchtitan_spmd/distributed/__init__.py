"""Device meshes and the SPMD backends (layer 2 of the stack and up).

A drop-in for ``torchtitan.distributed``::

    from torchtitan_spmd.distributed import ParallelDims

Importing this package imports :mod:`.parallel_dims` (and so ``torch.distributed``)
and nothing else; the backend runtimes are imported on first use.
"""

from .parallel_dims import ParallelDims

__all__ = ["ParallelDims"]

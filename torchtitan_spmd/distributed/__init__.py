"""Device meshes (layer 2) and the SPMD runtime (layers 3 and 4).

A drop-in for ``torchtitan.distributed``::

    from torchtitan_spmd.distributed import ParallelDims

The package, by role:

- meshes and layouts: :mod:`.parallel_dims` (``ParallelDims``), :mod:`.layout` (``SpmdLayout``);
- the plan language: :mod:`.plan`;
- how a backend represents tensors: :mod:`.representation` (the interface and the
  registry) and :mod:`.representations` (``default``, ``full_dtensor``, ``spmd_types``);
- one module per technique: :mod:`.apply_plan`, :mod:`.fsdp`, :mod:`.loss`,
  :mod:`.grad_norm`, :mod:`.inputs`, :mod:`.param_init`;
- upstream's names for forks: :mod:`.utils`.

Importing this package imports :mod:`.parallel_dims` (and so ``torch.distributed``)
and nothing else; the runtime is imported on first use.
"""

from .parallel_dims import ParallelDims

__all__ = ["ParallelDims"]

"""What sits below the models: device meshes, layouts, the plan language and the tensor representations.

A drop-in for ``torchtitan.distributed``::

    from torchtitan_spmd.distributed import ParallelDims

The package, by role:

- meshes and layouts: :mod:`.parallel_dims` (``ParallelDims``), :mod:`.layout` (``SpmdLayout``),
  :mod:`._mesh_compat` (torch-version differences of ``DeviceMesh``);
- the plan language and its one hook installer: :mod:`.plan`, :mod:`.apply_plan`;
- how a backend represents tensors: :mod:`.representation` (the interface, and the lookup
  of the module the backend registry :mod:`torchtitan_spmd.config.backends` names) and :mod:`.representations` (``default``, ``full_dtensor``, ``spmd_types``),
  with the model inputs' layouts (:mod:`.inputs`) and the expert exchange a representation
  provides (:mod:`.expert_exchange`);
- collectives' timeouts and failures: :mod:`.comm`;
- upstream's names for forks: :mod:`.utils`, :mod:`.spmd_types`.

The techniques that use them (FSDP, PP, CP, EP, the MoE runtime, AC, compile, the loss, the
gradient norm, parameter init) sit above the models in :mod:`torchtitan_spmd.techniques`, and
checkpointing in :mod:`torchtitan_spmd.checkpoint`. Nothing here imports either, nor the models.

Importing this package imports :mod:`.parallel_dims` (and so ``torch.distributed``)
and nothing else; the runtime is imported on first use.
"""

from .parallel_dims import ParallelDims

__all__ = ["ParallelDims"]

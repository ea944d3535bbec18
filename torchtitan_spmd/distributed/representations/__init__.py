"""One module per SPMD backend, each a :class:`~torchtitan_spmd.distributed.representation.TensorRepresentation`.

- :mod:`.default`: DTensor on the ``tp`` mesh inside modules with parameters, plain
  local tensors between them; FSDP2 on the data-parallel mesh.
- :mod:`.full_dtensor`: every tensor a DTensor on the dense mesh; FSDP2 with
  ``dp_mesh_dims``.
- :mod:`.spmd_types` (layer 4): plain local shards typed with ``spmd_types``.

Found by name through :func:`~torchtitan_spmd.distributed.representation.get_representation`;
nothing is imported here.
"""

"""The parallelisms and training techniques, above the models.

One module per technique, each written once against the tensor representation of
:mod:`torchtitan_spmd.distributed.representation`: :mod:`.fsdp`, :mod:`.pipeline_parallel`,
:mod:`.context_parallel`, :mod:`.expert_parallel`, :mod:`.moe` (the MoE runtime),
:mod:`.activation_checkpoint`, :mod:`.compile`, :mod:`.loss`, :mod:`.grad_norm` and
:mod:`.param_init`. Importing the package imports none of them.
"""

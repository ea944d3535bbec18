"""torchtitan_spmd: torchtitan's SPMD backend selection as a drop-in library.

Layers (see ``stack/``): ``config`` (+ ``compat``), ``distributed`` (meshes),
the runtime (``models``, ``train``) and the ``spmd_types`` backend.
Importing the top-level package imports nothing heavy.
"""

__version__ = "0.1.0"

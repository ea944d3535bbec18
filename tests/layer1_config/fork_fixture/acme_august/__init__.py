"""A stand-in for a fork that merged upstream torchtitan up to b5bcd76 (August 2026).

It switched its imports to torchtitan_spmd and declares its surface in one line, in its
launch environment: ``TORCHTITAN_SPMD_SURFACE=august`` (or ``set_surface("august")`` in code).
Its configs use August's spellings (``partial_dtensor``, token budgets) and its code
compares ``spmd_backend == "partial_dtensor"`` as upstream's does.
"""

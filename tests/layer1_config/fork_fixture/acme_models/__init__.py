"""A stand-in for ``torchtitan_spmd.models``: ``--module llama9`` finds ``llama9.config_registry``."""

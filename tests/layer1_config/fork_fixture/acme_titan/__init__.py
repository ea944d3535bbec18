"""A stand-in for a fork of torchtitan that switched its imports to torchtitan_spmd.

Its trainer config is its own root dataclass (``AcmeTrainerConfig``) that embeds
torchtitan_spmd's sections next to a section of its own; its configs are functions
in ``acme_titan.config_registry``, selected with ``--module acme_titan --config NAME``.
"""

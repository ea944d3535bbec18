"""A package without a config registry: not a ``--module`` short name."""

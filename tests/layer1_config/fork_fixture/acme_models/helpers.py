"""A plain module: not a ``--module`` short name."""

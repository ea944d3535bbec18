"""Imports a missing dependency: the error must reach the user as it is."""

import acme_missing_dependency  # noqa: F401


def broken_debug() -> None:
    """Never reached."""

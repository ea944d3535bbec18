"""Test utilities shipped with the library so forks can reuse them."""

"""A model family with a config registry."""

"""A fork package whose config registry needs a dependency that is not installed."""

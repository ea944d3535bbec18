"""A fork package that itself needs a dependency that is not installed."""

import acme_missing_dependency  # noqa: F401

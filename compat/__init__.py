"""Legacy-spelling support for torchtitan_spmd, importable as ``torchtitan_spmd.compat``.

``compat/`` sits at the repository top level so reviewers can see (and one day
delete) everything that exists only for backwards compatibility. It is shipped
inside the package through the ``torchtitan_spmd/compat`` symlink; no top-level
``compat`` package is installed.

- :mod:`torchtitan_spmd.compat.legacy` translates ``full_dtensor`` spellings at runtime.
- :mod:`torchtitan_spmd.compat.migrate` rewrites a fork's files to the new spelling.
"""

from .legacy import REMOVAL_RELEASE, LegacySpellingWarning, deprecation_message

__all__ = ["REMOVAL_RELEASE", "LegacySpellingWarning", "deprecation_message"]

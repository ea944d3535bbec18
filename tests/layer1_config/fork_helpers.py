"""Layer-1 test helpers: the fork fixture packages on ``sys.path``, and their ``--module/--config``.

Importing this module puts ``fork_fixture/`` on ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Folder holding ``acme_titan`` (a stand-in fork) and ``acme_models`` (a stand-in model registry).
FORK_DIR = Path(__file__).parent / "fork_fixture"
if str(FORK_DIR) not in sys.path:
    sys.path.insert(0, str(FORK_DIR))

#: Selects the fork's small config.
FORK = ["--module", "acme_titan", "--config", "acme_debug"]


def fork_env() -> dict[str, str]:
    """The environment of a subprocess that must import the fork fixture."""
    path = os.pathsep.join(p for p in (str(FORK_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}

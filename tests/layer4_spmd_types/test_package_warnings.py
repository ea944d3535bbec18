"""Layer 4: the spmd_types backend prints none of spmd_types' own deprecation noise.

spmd_types 0.3.1 calls torch's functional collectives by their deprecated names, and torch
warns (``FutureWarning``) on every rank: 8 lines in a 4-rank run. The representation filters
exactly those; a user's own FutureWarnings still show.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.backend("spmd_types")

_SCRIPT = textwrap.dedent("""
    import warnings
    import torch, torch.distributed as dist
    import spmd_types as st
    from spmd_types import R, S
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def gather_and_warn():
        with warnings.catch_warnings(record=True) as rec:
            warnings.filterwarnings("always", append=True)  # after any filter already there
            x = torch.ones(2, 3, requires_grad=True)
            st.all_gather(x, dist.group.WORLD, src=S(0), dst=R)  # funcol.all_gather_tensor inside
            warnings.warn("the user's own FutureWarning", FutureWarning)
        return [str(w.message) for w in rec]

    print("BARE", gather_and_warn())
    import torchtitan_spmd.distributed.representations.spmd_types  # noqa: F401
    print("BACKEND", gather_and_warn())
    dist.destroy_process_group()
""")


def test_spmd_types_collective_deprecations_are_silenced_user_warnings_are_not() -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    bare, backend = proc.stdout.splitlines()[-2:]
    # the noise exists before the backend is imported (else this test could not fail)
    assert bare.startswith("BARE") and "all_gather_tensor` is deprecated" in bare, bare
    assert backend.startswith("BACKEND") and "is deprecated" not in backend, backend
    assert "the user's own FutureWarning" in backend

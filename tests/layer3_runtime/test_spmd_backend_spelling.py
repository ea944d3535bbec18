"""Layer 3: upstream's ``get_spmd_backend`` reads back the spelling a fork wrote, under either
upstream surface (moved here from tests/layer2_mesh: ``distributed/utils.py`` is layer 3)."""

from __future__ import annotations

from torchtitan_spmd.config.surface import set_surface


def test_get_spmd_backend_reads_back_the_spelling() -> None:
    """Upstream b5bcd76's loss asserts ``get_spmd_backend() == "partial_dtensor"``."""
    from torchtitan_spmd.distributed.utils import (
        get_spmd_backend,
        set_spmd_backend,
        spmd_backend_scope,
    )

    with spmd_backend_scope("partial_dtensor"):
        assert get_spmd_backend() == "partial_dtensor"
    with spmd_backend_scope("default"):
        assert get_spmd_backend() == "default"
    set_surface("august")
    try:
        import torchtitan_spmd.distributed.utils as utils

        saved = utils._process_default
        utils._process_default = None
        assert get_spmd_backend() == "spmd_types"  # upstream's August process default
        set_spmd_backend("partial_dtensor")
        assert get_spmd_backend() == "partial_dtensor"
    finally:
        utils._process_default = saved
        set_surface(None)

"""Layer 3 (issue 41): an untied model's embedding and output are vocab-parallel under TP, as a
tied model's table, through the same mechanism (``VocabShardedEmbedding`` and the plan's
``S(0)@tp`` rows), as upstream's plans shard both.

At FSDP 2 x TP 2 with sequence and loss parallel, on real gloo ranks, under every backend
(``spmd_types`` type-checked): each rank stores a quarter of each table, the logits are
vocab-sharded, and every step's loss and every parameter's step-1 gradient norm equal the float64
reference's (``tied_helpers.check_untied``). Checkpoints reshard between TP degrees with the
sharded tables: ``test_checkpoint.py``'s base run saves at FSDP 2 x TP 2 (now vocab-sharded
tables) and its cross-layout cells resume it at TP 1 (one process, FSDP 2) and TP 2.
"""

from __future__ import annotations

import pytest
from parity_helpers import skip_full_dtensor_on_old_torch
from tied_helpers import check_untied

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("backend", ["default", "full_dtensor", "spmd_types"])
def test_untied_model_is_vocab_parallel_and_matches_the_reference(backend: str) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    if backend == "spmd_types":
        from torchtitan_spmd.distributed.representation import torch_at_least

        if not torch_at_least("2.14"):
            pytest.skip("spmd_types with FSDP needs torch >= 2.14")
    typed = {"spmd_typechecking": True} if backend == "spmd_types" else {}
    gaps = check_untied(backend, **typed)
    print(f"\nuntied llama3 {backend} fsdp2_tp2: loss {gaps['loss_rel']:.1e}, grad norms {gaps['grad_rel']:.1e}")

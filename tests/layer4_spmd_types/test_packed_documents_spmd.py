"""Packed documents (``attn_mask_type="block_causal"``) under spmd_types: the trainer against the
independent reference on windows of two to four documents, real gloo ranks, FSDP 2 x TP 2 and
PP 2 x FSDP 2, the first step type-checked (the per-document positions are typed as the tokens; the
mask is built from them inside the attention kernel's local region). See
``tests/layer3_runtime/test_packed_documents.py`` for the other backends and the checks of the pieces.
"""

from __future__ import annotations

import pytest
from spmd_helpers import run_config, run_mixed, torch_at_least

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types")]

from packed_helpers import LOCAL_BATCH, check_packed_parity, packed_config  # noqa: E402  (spmd_helpers' path)

TYPED_STEPS = 1


def test_block_causal_parity_fsdp2_tp2_typechecked() -> None:
    if not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    cfg = packed_config("spmd_types", {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
                        spmd_typechecking=True)
    got = run_mixed(cfg, 4, typed_steps=TYPED_STEPS)
    assert [g[3] for g in got] == [True] * TYPED_STEPS + [False] * (len(got) - TYPED_STEPS)
    loss, norm = check_packed_parity(got, LOCAL_BATCH * 2, "block_causal spmd_types fsdp2_tp2")
    print(f"\nblock_causal spmd_types fsdp2_tp2: max rel diff loss {loss:.1e} grad_norm {norm:.1e}")


def test_block_causal_parity_pp2_fsdp2_typechecked() -> None:
    """Under PP each stage gets the per-document positions as a schedule keyword, typed as the tokens
    (the first step type-checked)."""
    if not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    cfg = packed_config("spmd_types", {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2,
                                       "pipeline_parallel_microbatch_size": 1,
                                       "pipeline_parallel_schedule": "1F1B"},
                        spmd_typechecking=True, spmd_typechecking_steps=1)
    cfg.training.global_batch_size = LOCAL_BATCH * 2
    got = run_config(cfg, 4)
    loss, norm = check_packed_parity(got, LOCAL_BATCH * 2, "block_causal spmd_types pp2_fsdp2")
    print(f"\nblock_causal spmd_types pp2_fsdp2: max rel diff loss {loss:.1e} grad_norm {norm:.1e}")

"""Layer 3: upstream b5bcd76's token budgets drive the trainer as its batch fields do.

``training.num_tokens_per_microbatch_per_dp_rank`` / ``num_tokens_per_train_step`` /
``max_context_length`` (#4121) are one setting with ``local_batch_size`` / ``global_batch_size``
/ ``seq_len``: the gradient-accumulation count is upstream's formula, written out here
(``num_tokens_per_train_step // (num_tokens_per_microbatch_per_dp_rank * dp)``), and an
accumulation run spelled in tokens trains exactly the run spelled in sequences.
"""

from __future__ import annotations

import pytest
from feature_helpers import (
    LOCAL_BATCH,
    WORLD,
    baseline,
    feature_config,
    losses_and_norms,
    run_steps,
)

from torchtitan_spmd.config import TrainingConfig
from torchtitan_spmd.train import gradient_accumulation_steps


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_accumulation_steps_are_upstreams(dp: int, accumulate: int) -> None:
    per_rank, context = 2 * 512, 512
    step = per_rank * dp * accumulate
    t = TrainingConfig(num_tokens_per_microbatch_per_dp_rank=per_rank, max_context_length=context,
                       num_tokens_per_train_step=step)
    upstream = step // (per_rank * dp)  # b5bcd76's Trainer.__init__
    assert gradient_accumulation_steps(t.global_batch_size, t.local_batch_size, dp) == upstream == accumulate


def test_default_step_budget_is_one_iteration() -> None:
    t = TrainingConfig(num_tokens_per_microbatch_per_dp_rank=4096, max_context_length=1024)
    assert gradient_accumulation_steps(t.global_batch_size, t.local_batch_size, 4) == 1


@pytest.mark.backend("default")
def test_token_spelled_accumulation_trains_the_sequence_spelled_run() -> None:
    """2 microbatches of 1 sequence per rank, spelled in tokens, on FSDP 2 x TP 2: identical to the
    baseline's 2-sequence batch (the library's accumulation run, spelled in sequences)."""
    seq = feature_config("default").training.seq_len
    cfg = feature_config("default", parallelism__spmd_backend="partial_dtensor",  # August's spelling
                         training__num_tokens_per_microbatch_per_dp_rank=(LOCAL_BATCH // 2) * seq,
                         training__num_tokens_per_train_step=LOCAL_BATCH * (WORLD // 2) * seq)
    assert cfg.parallelism.spmd_backend == "partial_dtensor"
    got = run_steps(cfg, 2)["records"]
    ref = baseline("default")[:2]
    loss, norm = losses_and_norms(got)
    ref_loss, ref_norm = losses_and_norms(ref)
    assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5), (got, ref)

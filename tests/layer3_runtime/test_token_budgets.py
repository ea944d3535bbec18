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


# ------------------------------------------------------------------ upstream's PP microbatches (#3856)
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("num_pp_microbatches", [1, 2, 4])
def test_accumulation_counts_the_pp_microbatches(dp: int, num_pp_microbatches: int) -> None:
    """b5bcd76's ``Trainer.__init__``: ``num_tokens_per_train_step // (num_tokens_per_microbatch_per_dp_rank
    * num_pp_microbatches * dp)``, written out."""
    per_mb, context, accumulate = 2 * 64, 64, 3
    step = per_mb * num_pp_microbatches * dp * accumulate
    t = TrainingConfig(num_tokens_per_microbatch_per_dp_rank=per_mb, max_context_length=context,
                       num_tokens_per_train_step=step)
    got = gradient_accumulation_steps(t.global_batch_size, t.local_batch_size, dp,
                                      num_pp_microbatches=num_pp_microbatches)
    assert got == step // (per_mb * num_pp_microbatches * dp) == accumulate


@pytest.mark.parametrize(("num_pp", "mb", "local", "want"), [
    (None, 1, 4, (4, 1)),  # June: local_batch_size a step's rows, microbatches of pipeline_parallel_microbatch_size
    (None, 2, 4, (4, 2)),
    (1, 1, 4, (4, 4)),  # August's default: one microbatch of the token budget
    (2, 1, 4, (8, 4)),  # two microbatches of 4 sequences: 8 sequences an iteration
    (4, 1, 1, (4, 1)),
    (2, 2, 4, (8, 2)),  # June's microbatch size splits each of them further
])
def test_pipeline_rows(num_pp: int | None, mb: int, local: int, want: tuple[int, int]) -> None:
    from torchtitan_spmd.config import ParallelismConfig
    from torchtitan_spmd.techniques.pipeline_parallel import pipeline_rows

    par = ParallelismConfig(pipeline_parallel_degree=2, num_pp_microbatches=num_pp,
                            pipeline_parallel_microbatch_size=mb)
    assert pipeline_rows(par, TrainingConfig(local_batch_size=local, seq_len=64)) == want


def test_pipeline_microbatch_size_must_divide_upstreams_microbatch() -> None:
    from torchtitan_spmd.config import ParallelismConfig
    from torchtitan_spmd.techniques.pipeline_parallel import pipeline_rows

    par = ParallelismConfig(pipeline_parallel_degree=2, num_pp_microbatches=2, pipeline_parallel_microbatch_size=3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_microbatch_size=3 does not divide the 4 sequences.*"
                                         r"num_pp_microbatches=2.*num_tokens_per_microbatch_per_dp_rank=256"):
        pipeline_rows(par, TrainingConfig(num_tokens_per_microbatch_per_dp_rank=4 * 64, max_context_length=64))


@pytest.mark.backend("default")
def test_num_pp_microbatches_trains_upstreams_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """An August job at PP 2 (1F1B, 2 ranks): 2 pipeline microbatches of one 32-token sequence each,
    2 accumulation iterations (``num_tokens_per_train_step`` = 2 x 2 x 32): 4 sequences a step, against
    the reference on the same 4-sequence global batch; the schedule runs 2 microbatches."""
    from parity_helpers import (
        NORM_TOL,
        SEQ_LEN,
        TOL,
        check_grad_norms,
        max_rel,
        reference_with_trace,
        run_config,
    )

    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.config.surface import ENV_VAR, set_surface

    monkeypatch.delenv(ENV_VAR, raising=False)
    set_surface("august")
    try:
        cfg = JobConfig.from_dict({
            "model": {"name": "llama3", "flavor": "tiny"},
            "training": {"steps": 3, "num_tokens_per_microbatch_per_dp_rank": SEQ_LEN, "max_context_length": SEQ_LEN,
                         "num_tokens_per_train_step": 2 * 2 * SEQ_LEN, "device": "cpu", "max_norm": 1.0,
                         "mixed_precision_param": "float32"},
            "activation_checkpoint": {"mode": "none"},
            "optimizer": {"lr": 3e-3},
            "lr_scheduler": {"warmup_steps": 2},
            "parallelism": {"data_parallel_shard_degree": 1, "pipeline_parallel_degree": 2,
                            "pipeline_parallel_schedule": "1F1B", "num_pp_microbatches": 2,
                            "spmd_backend": "partial_dtensor"},
            "debug": {"seed": 1234, "deterministic": True},
        })
    finally:
        set_surface(None)
    assert (cfg.parallelism.num_pp_microbatches, cfg.training.local_batch_size, cfg.training.global_batch_size) == (2, 1, 4)
    got = run_config(cfg, 2)
    assert got.trace.n_microbatches == 2
    ref, ref_trace = reference_with_trace(4, steps=3)
    check_grad_norms(got, ref_trace, "num_pp_microbatches=2")
    assert max_rel([g[0] for g in got], [r[0] for r in ref]) < TOL, (got, ref)
    assert max_rel([g[1] for g in got], [r[1] for r in ref]) < NORM_TOL, (got, ref)

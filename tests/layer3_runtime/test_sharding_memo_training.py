"""Training with DTensor's sharding propagation remembered across launches changes no number.

The suite's forked launches inherit the sharding propagations earlier launches computed
(``torchtitan_spmd.distributed.sharding_memo``). The same full_dtensor FSDP 2 x TP 2 run (the
backend that puts every operator through DTensor) is launched three times: with the memo off
(torch computes every propagation), with it on and empty (torch computes, the memo records),
and with it on and filled (the memo answers). Losses, gradient norms and every parameter's
step-1 gradient norm must be bitwise the same, and the third launch must have added nothing
to the table: every propagation it asked for was answered.
"""

from __future__ import annotations

from typing import Any

import pytest
from parity_helpers import PARITY_CONFIGS, job_config, run_config

from torchtitan_spmd.distributed import sharding_memo

pytestmark = pytest.mark.skipif(sharding_memo.unsupported_reason() is not None,
                                reason=f"no memo for this torch: {sharding_memo.unsupported_reason()}")


@pytest.fixture
def empty_memo(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process's table empty, and no folder shared with sibling processes (the suite's)."""
    monkeypatch.delenv(sharding_memo.DIR_ENV, raising=False)
    saved = dict(sharding_memo._ENTRIES)
    sharding_memo._ENTRIES.clear()
    yield
    sharding_memo._ENTRIES.clear()
    sharding_memo._ENTRIES.update(saved)


def test_remembered_propagations_train_bitwise_like_torchs_own(
        empty_memo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    world, parallelism = PARITY_CONFIGS["fsdp2_tp2"]
    cfg = job_config("full_dtensor", parallelism, steps=3)
    monkeypatch.setenv(sharding_memo.ENV, "0")
    off = run_config(cfg, world)
    assert not sharding_memo._ENTRIES, "the memo recorded while it was off"
    monkeypatch.delenv(sharding_memo.ENV)
    cold = run_config(cfg, world)
    recorded = len(sharding_memo._ENTRIES)
    assert recorded > 100, f"only {recorded} propagations recorded"
    warm = run_config(cfg, world)
    assert len(sharding_memo._ENTRIES) == recorded, (
        f"the filled memo missed {len(sharding_memo._ENTRIES) - recorded} propagations")
    for name, run in (("empty memo", cold), ("filled memo", warm)):
        assert list(run) == list(off), f"{name}: (loss, grad norm) per step {list(run)} != {list(off)}"
        assert run.trace.grad_norms == off.trace.grad_norms, f"{name}: per-tensor gradient norms differ"
    assert off.trace.grad_norms, "no per-tensor gradient norms recorded"

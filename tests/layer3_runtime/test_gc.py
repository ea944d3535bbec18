"""Layer 3: scheduled garbage collection (``training.gc_freq``, ``training.gc_debug``) and
the deterministic-mode flags, as upstream's trainer sets them.

The collector is off while a trainer lives and collects generation 1 on every
``gc_freq``-th step (never on step 1); ``gc_debug`` collects generation 2 on every
step; ``close()`` turns it back on. ``debug.deterministic`` turns deterministic
algorithms on but does not fill new buffers (``fill_uninitialized_memory``).
"""

from __future__ import annotations

import gc

import pytest
from parity_helpers import job_config, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked
from torchtitan_spmd.tools.utils import GarbageCollection


@pytest.fixture
def collections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The generations of every ``gc.collect`` call; the collector's state is restored after."""
    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    was = gc.isenabled()
    yield calls
    if was:
        gc.enable()
    else:
        gc.disable()


def test_collector_is_off_and_collects_every_gc_freq_steps(collections: list[int]) -> None:
    gc.enable()
    handler = GarbageCollection(3)
    assert not gc.isenabled()
    assert collections == [1]  # the initial collection
    ran = [step for step in range(1, 10) if handler.run(step)]
    assert ran == [3, 6, 9]
    assert collections == [1, 1, 1, 1]
    handler.close()
    assert gc.isenabled()


def test_gc_freq_one_never_collects_on_step_one(collections: list[int]) -> None:
    handler = GarbageCollection(1)
    assert [s for s in range(1, 4) if handler.run(s)] == [2, 3]
    handler.close()


def test_gc_debug_collects_every_generation_every_step(collections: list[int]) -> None:
    handler = GarbageCollection(50, debug=True)
    collections.clear()
    assert all(handler.run(s) for s in range(1, 4))
    assert collections == [2, 2, 2]
    handler.close()


def test_close_leaves_a_disabled_collector_disabled(collections: list[int]) -> None:
    gc.disable()
    GarbageCollection(5).close()
    assert not gc.isenabled()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_bad_gc_freq_is_a_value_error_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match=r"training\.gc_freq must be an integer >= 1, got"):
        GarbageCollection(bad)  # type: ignore[arg-type]


def test_config_rejects_gc_freq_below_one() -> None:
    with pytest.raises(ValueError, match="gc_freq"):
        JobConfig.from_dict({"training": {"gc_freq": 0}})


def _trainer_gc(rank: int, world: int, cfg: object) -> dict[str, object]:
    import torch

    from torchtitan_spmd.train import Trainer

    gc.enable()
    calls: list[int] = []
    real_collect = gc.collect
    gc.collect = lambda generation=2: calls.append(generation) or real_collect(generation)
    seen: list[bool] = []
    trainer = Trainer(cfg)  # type: ignore[arg-type]
    inner = trainer.step

    def step(n: int):  # noqa: ANN202
        seen.append(gc.isenabled())
        return inner(n)

    trainer.step = step  # type: ignore[method-assign]
    collections_at_start = len(calls)
    trainer.run()
    out = {
        "enabled_during_steps": seen,
        "collections_in_run": len(calls) - collections_at_start,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
    }
    trainer.close()
    out["enabled_after_close"] = gc.isenabled()
    return out


def test_trainer_runs_with_the_collector_off_and_restores_it() -> None:
    warm_parent()
    cfg = job_config("default", {}, steps=5)
    cfg.training.gc_freq = 2
    (out,) = run_forked(_trainer_gc, 1, cfg, timeout_s=300)
    assert out == {
        "enabled_during_steps": [False] * 5,
        "collections_in_run": 2,  # steps 2 and 4
        "deterministic": True,
        "fill_uninitialized_memory": False,
        "enabled_after_close": True,
    }

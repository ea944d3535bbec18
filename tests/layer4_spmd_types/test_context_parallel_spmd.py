"""Layer 4: context parallelism under spmd_types, type-checked.

- Parity with the independent reference within 1e-5 over 5 steps (:data:`cp_helpers.CP_CELLS`:
  cp 2, cp 4, CP 2 x TP 2, FSDP 2 x CP 2, each rotate method, both families), ranks
  identical; the first step of each runs under ``debug.spmd_typechecking`` (forward and
  loss type-checked: the ring attention's declared types, the loss sums over ``dp`` and
  ``cp``) and must pass.
- ``context_parallel_load_balancer=None`` (with the ring) gives headtail's numbers.
- No tensor of ``S x S/cp`` elements in a step.
- A plan that gathers keys and values before the ring kernel is a clear error.
- default + CP names both CP backends (``test_setup.py``).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
from spmd_helpers import max_rel, run_mixed, torch_at_least, warm_parent

_LAYER3 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "layer3_runtime")
if _LAYER3 not in sys.path:
    sys.path.insert(0, _LAYER3)

from cp_helpers import (  # noqa: E402
    CP_CELLS,
    CP_CONFIGS,
    TOL,
    check_cp_parity,
    check_no_sequence_squared_tensor,
    cp_job_config,
)

from torchtitan_spmd.launcher import run_forked  # noqa: E402

pytestmark = [pytest.mark.backend("spmd_types")]


def _skip_old_torch() -> None:
    if not torch_at_least("2.14"):  # CP shards parameters over dp_shard x cp
        pytest.skip("FSDP over spmd_types-annotated tensors (CP: dp_shard x cp) needs torch >= 2.14")


@pytest.mark.multiproc
@pytest.mark.parametrize(("config_name", "rotate", "model"), CP_CELLS["spmd_types"])
def test_spmd_types_cp_parity_with_reference(config_name: str, rotate: str, model: str) -> None:
    _skip_old_torch()
    world, _ = CP_CONFIGS[config_name]
    cfg = cp_job_config("spmd_types", config_name, model=model, context_parallel_rotate_method=rotate)
    got = run_mixed(cfg, world, typed_steps=1)  # ranks identical
    assert [g[3] for g in got] == [True] + [False] * (len(got) - 1)  # the first step was type-checked
    loss_diff, norm_diff = check_cp_parity(got, config_name, model=model)
    print(f"\nspmd_types {config_name} {rotate} {model}: typed step {got[0][2]:.2f}s; max rel diff loss "
          f"{loss_diff:.1e} grad_norm {norm_diff:.1e}")


@pytest.mark.multiproc
def test_no_load_balancing_gives_headtails_numbers() -> None:
    _skip_old_torch()
    headtail = run_mixed(cp_job_config("spmd_types", "cp2"), 2, typed_steps=0)
    plain = run_mixed(cp_job_config("spmd_types", "cp2", context_parallel_load_balancer=None,
                                    context_parallel_rotate_method="alltoall"), 2, typed_steps=1)
    check_cp_parity(plain, "cp2")
    assert max_rel([p[0] for p in plain], [h[0] for h in headtail]) < TOL
    assert max_rel([p[1] for p in plain], [h[1] for h in headtail]) < TOL


@pytest.mark.multiproc
def test_no_sequence_squared_tensor_in_a_cp_step() -> None:
    """As layer 3's full_dtensor check: no op of a step returns ``S x S/cp`` elements."""
    _skip_old_torch()
    check_no_sequence_squared_tensor("spmd_types")


def _planted_kv_gather(rank: int, world: int, cfg: object) -> str:
    """One type-checked step with a plan that gathers the attention kernel's keys and values
    over ``cp`` at its boundary (``S(2)@cp -> R@cp``, the old layout) before the ring kernel."""
    import torchtitan_spmd.train as train
    from torchtitan_spmd.distributed.layout import R, S, SpmdLayout
    from torchtitan_spmd.distributed.plan import Redistribute

    real = train.get_model_spec

    def spec_with_gather(name: str):  # noqa: ANN202
        spec = real(name)

        def plan(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            p = spec.sharding_plan(*args, **kwargs)
            sdpa = p.modules["layers.*.attention.sdpa"]
            q = sdpa.inputs[0]
            gather = Redistribute(q, SpmdLayout({"cp": R, "tp": S(1)}))
            modules = {**p.modules, "layers.*.attention.sdpa": dataclasses.replace(sdpa, inputs=(q, gather, gather))}
            return dataclasses.replace(p, modules=modules)

        return dataclasses.replace(spec, sharding_plan=plan)

    train.get_model_spec = spec_with_gather
    try:
        trainer = train.Trainer(cfg)
        trainer.step(1)
    except Exception as err:  # noqa: BLE001 - report what happened
        return f"{type(err).__name__}: {err}"
    finally:
        train.get_model_spec = real
    return "no error"


@pytest.mark.multiproc
def test_keys_and_values_gathered_in_the_plan_are_a_clear_error() -> None:
    _skip_old_torch()
    warm_parent()
    import spmd_types.checker  # noqa: F401

    msgs = run_forked(_planted_kv_gather, 2, cp_job_config("spmd_types", "cp2"), timeout_s=300)
    for msg in msgs:
        assert msg.startswith("ValueError") and "do not gather them in the plan" in msg, msg

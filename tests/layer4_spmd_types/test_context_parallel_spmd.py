"""Layer 4: context parallelism under spmd_types, type-checked.

- CP 2, CP 2 x TP 2 (sequence parallel) and FSDP 2 x CP 2 within 1e-5 of one process
  (default backend, no CP) over 5 steps, ranks identical; the first step of each runs
  under ``debug.spmd_typechecking`` (forward and loss type-checked: the typed KV
  all-gather, the loss sums over ``dp`` and ``cp``) and must pass.
- ``context_parallel_load_balancer=None`` gives headtail's numbers.
- A plan that declares the keys and values gathered (``R@cp``) without the gather is an
  ``SpmdTypeError`` under the checker.
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

from cp_helpers import CP_CONFIGS, TOL, check_cp_parity, cp_job_config  # noqa: E402

from torchtitan_spmd.launcher import run_forked  # noqa: E402

pytestmark = [pytest.mark.backend("spmd_types")]


def _skip_old_torch() -> None:
    if not torch_at_least("2.14"):  # CP shards parameters over dp_shard x cp
        pytest.skip("FSDP over spmd_types-annotated tensors (CP: dp_shard x cp) needs torch >= 2.14")


@pytest.mark.multiproc
@pytest.mark.parametrize("config_name", sorted(CP_CONFIGS))
def test_spmd_types_cp_parity_with_single_process(config_name: str) -> None:
    _skip_old_torch()
    world, _ = CP_CONFIGS[config_name]
    got = run_mixed(cp_job_config("spmd_types", config_name), world, typed_steps=1)  # ranks identical
    assert [g[3] for g in got] == [True] + [False] * (len(got) - 1)  # the first step was type-checked
    loss_diff, norm_diff = check_cp_parity(got, config_name)
    print(f"\nspmd_types {config_name}: typed step {got[0][2]:.2f}s; max rel diff loss {loss_diff:.1e} "
          f"grad_norm {norm_diff:.1e}")


@pytest.mark.multiproc
def test_no_load_balancing_gives_headtails_numbers() -> None:
    _skip_old_torch()
    headtail = run_mixed(cp_job_config("spmd_types", "cp2"), 2, typed_steps=0)
    plain = run_mixed(cp_job_config("spmd_types", "cp2", context_parallel_load_balancer=None), 2, typed_steps=0)
    check_cp_parity(plain, "cp2")
    assert max_rel([p[0] for p in plain], [h[0] for h in headtail]) < TOL
    assert max_rel([p[1] for p in plain], [h[1] for h in headtail]) < TOL


def _planted_missing_kv_gather(rank: int, world: int, cfg: object) -> str:
    """One type-checked step with a plan whose attention kernel declares ``R@cp`` keys and
    values but never gathers them (the ``Redistribute`` replaced by its destination)."""
    import spmd_types as st

    import torchtitan_spmd.train as train
    from torchtitan_spmd.distributed.plan import Redistribute

    real = train.get_model_spec

    def spec_without_gather(name: str):  # noqa: ANN202
        spec = real(name)

        def plan(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            p = spec.sharding_plan(*args, **kwargs)
            sdpa = p.modules["layers.*.attention.sdpa"]
            inputs = tuple(i.dst if isinstance(i, Redistribute) else i for i in sdpa.inputs)
            assert inputs != sdpa.inputs  # the plant took
            modules = {**p.modules, "layers.*.attention.sdpa": dataclasses.replace(sdpa, inputs=inputs)}
            return dataclasses.replace(p, modules=modules)

        return dataclasses.replace(spec, sharding_plan=plan)

    train.get_model_spec = spec_without_gather
    try:
        trainer = train.Trainer(cfg)
        trainer.step(1)
    except st.SpmdTypeError as err:
        return f"SpmdTypeError: {err}"
    except Exception as err:  # noqa: BLE001 - report what else happened
        return f"{type(err).__name__}: {err}"
    finally:
        train.get_model_spec = real
    return "no error"


@pytest.mark.multiproc
def test_missing_kv_gather_is_a_type_error() -> None:
    _skip_old_torch()
    warm_parent()
    import spmd_types.checker  # noqa: F401

    cfg = cp_job_config("spmd_types", "cp2")
    msgs = run_forked(_planted_missing_kv_gather, 2, cfg, timeout_s=300)
    print(f"\nplanted missing KV gather, rank 0: {msgs[0][:400]}")
    for msg in msgs:
        assert msg.startswith("SpmdTypeError"), msg

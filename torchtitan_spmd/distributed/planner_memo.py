"""DTensor's redistribution planner, memoised: the same plans, each edge's cost computed once.

Whenever a placement is a ``_StridedShard`` (FSDP over TP on one tensor dimension) or a shard
order is not the default, torch (2.12 and later) plans a redistribution with a Dijkstra search
over placement states (``DTensorRedistributePlanner.find_min_cost_path``). DTensor's sharding
propagation asks for many such plans on its first sight of each operator: the cost of every
candidate strategy's input redistributions. torch caches the *plans* per (source, target) spec
and the *planner* per (mesh, tensor metadata), but not the planner's edges: every search expands
its states again (``get_next_state``) and prices every edge again (``cost_function``, which
builds two ``DTensorSpec`` objects per call).

Measured on one rank of the full_dtensor CP 2 x TP 2 parity cell (llama3 debug model, 5 steps):
120,601 edge prices for 4,026 distinct edges, and 23,748 state expansions for 1,674 distinct
ones; the cell's first step was nearly all this planning (docs/benchmarks.md, "The test suite").

:func:`install` memoises both, per planner instance, so the memo lives and dies with torch's own
planner cache:

* ``cost_function(src, dst)`` is a pure function of the two states and the planner's mesh and
  tensor metadata, fixed for a planner;
* ``get_next_state(placements, order)`` also reads two sets the planner grows as it is asked for
  new targets (``strided_shard_placements_in_target``, ``partial_reduce_ops_in_target``), so they
  are part of its key. The caller mutates the returned dict; each call gets a copy.

One layer up, strategy selection's ``redistribute_cost(current, target)`` (the price of each
candidate strategy's input redistributions) is memoised per spec pair across planners, the key
torch's own plan cache uses; it is bounded, skipped while tracing, and cleared with DTensor's
sharding caches (``mesh_reuse.clear_dtensor_sharding_caches``), since its keys hold meshes.

The plans are the same objects torch would compute (``tests/layer2_mesh/test_planner_memo.py``
compares them over a grid of placements on 1-, 2- and 3-axis meshes). :func:`install` checks the
planner's shape first and leaves torch alone when it differs (another torch version); the
environment variable ``TORCHTITAN_SPMD_PLANNER_MEMO=0`` turns it off.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

__all__ = ["ENV", "clear", "install", "installed", "uninstall", "unsupported_reason"]

#: ``0`` leaves torch's planner as it is.
ENV = "TORCHTITAN_SPMD_PLANNER_MEMO"

_MARK = "_torchtitan_spmd_memo"


def _planner_class() -> Any:
    try:
        from torch.distributed.tensor import _redistribute  # noqa: PLC0415 - heavy import
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return getattr(_redistribute, "DTensorRedistributePlanner", None)


def _strategy_utils() -> Any:
    from torch.distributed.tensor._ops import utils  # noqa: PLC0415 - heavy import

    return utils


def unsupported_reason() -> str | None:
    """Why this torch's planner cannot be memoised (its shape differs), or ``None``."""
    cls = _planner_class()
    if cls is None:
        return "torch has no DTensorRedistributePlanner"
    for name in ("setup_cost_callbacks", "get_next_state", "find_min_cost_path"):
        if not callable(getattr(cls, name, None)):
            return f"DTensorRedistributePlanner has no {name}"
    params = list(inspect.signature(cls.get_next_state).parameters)
    if params != ["self", "placements", "tensor_mesh_dim_tuple"]:
        return f"DTensorRedistributePlanner.get_next_state takes {params}"
    if not callable(getattr(_strategy_utils(), "redistribute_cost", None)):
        return "torch.distributed.tensor._ops.utils has no redistribute_cost"
    names = set(cls.__init__.__code__.co_names) | set(cls.setup_cost_callbacks.__code__.co_names)
    for attr in ("strided_shard_placements_in_target", "partial_reduce_ops_in_target", "cost_function"):
        if attr not in names:
            return f"DTensorRedistributePlanner sets no {attr}"
    return None


def installed() -> bool:
    """Whether this process's planner is memoised."""
    cls = _planner_class()
    return cls is not None and bool(getattr(cls, _MARK, False))


def _memoised_cost(cost_function: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    prices: dict[tuple[Any, Any], Any] = {}

    @functools.wraps(cost_function)
    def cost(src_state: Any, dst_state: Any) -> Any:
        key = (src_state, dst_state)
        try:
            return prices[key]
        except KeyError:
            price = prices[key] = cost_function(src_state, dst_state)
            return price

    return cost


#: ``redistribute_cost`` results by (current spec, target spec), for strategy selection; bounded.
_COSTS: dict[tuple[Any, Any], float] = {}
_COSTS_MAX = 1 << 17


def clear() -> None:
    """Forget the memoised redistribution costs (with DTensor's own caches: mesh_reuse)."""
    _COSTS.clear()


def _memoised_redistribute_cost(redistribute_cost: Callable[[Any, Any], float]) -> Callable[[Any, Any], float]:
    from torch.distributed._functional_collectives import _are_we_tracing  # noqa: PLC0415

    @functools.wraps(redistribute_cost)
    def cost(current_spec: Any, target_spec: Any) -> float:
        if _are_we_tracing():  # symbolic shapes: torch plans these uncached too
            return redistribute_cost(current_spec, target_spec)
        key = (current_spec, target_spec)
        try:
            return _COSTS[key]
        except KeyError:
            pass
        value = redistribute_cost(current_spec, target_spec)
        if len(_COSTS) >= _COSTS_MAX:
            _COSTS.clear()
        _COSTS[key] = value
        return value

    cost._torchtitan_spmd_memo = redistribute_cost  # type: ignore[attr-defined]
    return cost


def install() -> bool:
    """Memoise the planner's edge costs and state expansions (idempotent); ``True`` when on.

    Off when ``TORCHTITAN_SPMD_PLANNER_MEMO=0`` or when this torch's planner is not the shape
    this module knows (:func:`unsupported_reason`).
    """
    if os.environ.get(ENV, "1") == "0":
        return False
    cls = _planner_class()
    if cls is not None and getattr(cls, _MARK, False):
        return True
    if cls is None or unsupported_reason() is not None:
        return False
    setup = cls.setup_cost_callbacks
    expand = cls.get_next_state

    @functools.wraps(setup)
    def setup_cost_callbacks(self: Any) -> None:
        setup(self)
        self.cost_function = _memoised_cost(self.cost_function)
        self._torchtitan_spmd_next_states = {}

    @functools.wraps(expand)
    def get_next_state(self: Any, placements: Any, tensor_mesh_dim_tuple: Any) -> dict[Any, Any]:
        memo = getattr(self, "_torchtitan_spmd_next_states", None)
        try:
            key = (placements, tensor_mesh_dim_tuple,
                   frozenset(self.strided_shard_placements_in_target),
                   frozenset(self.partial_reduce_ops_in_target))
            hash(key)
        except TypeError:  # a list of placements: not a key, so not memoised
            memo = None
        if memo is None:
            return expand(self, placements, tensor_mesh_dim_tuple)
        states = memo.get(key)
        if states is None:
            states = memo[key] = expand(self, placements, tensor_mesh_dim_tuple)
        return dict(states)  # find_min_cost_path adds to what it is given

    cls.setup_cost_callbacks = setup_cost_callbacks
    cls.get_next_state = get_next_state
    setattr(cls, _MARK, (setup, expand))
    utils = _strategy_utils()
    utils.redistribute_cost = _memoised_redistribute_cost(utils.redistribute_cost)
    return True


def uninstall() -> None:
    """Put torch's planner back (for tests that compare the two)."""
    cls = _planner_class()
    saved = getattr(cls, _MARK, None) if cls is not None else None
    if not saved:
        return
    cls.setup_cost_callbacks, cls.get_next_state = saved
    delattr(cls, _MARK)
    utils = _strategy_utils()
    utils.redistribute_cost = getattr(utils.redistribute_cost, "_torchtitan_spmd_memo", utils.redistribute_cost)
    clear()

"""Technique: apply a sharding plan (tensor, sequence and loss parallelism as it declares).

The one hook installer, written against
:class:`~torchtitan_spmd.distributed.representation.TensorRepresentation`:

1. every parameter and buffer becomes ``representation.distribute(tensor, layout)``
   (unplanned ones are replicated);
2. every planned module gets a forward pre-hook: each declared input
   ``arrive``-s with its layout and, at a :class:`Redistribute`, is
   ``redistribute``-d to the layout the module needs;
3. and a forward hook: the output is redistributed if declared so, then
   ``depart``-s with its layout;
4. ``local_compute`` modules have their body wrapped in
   ``representation.local_region``. That is the place for kernels that must see
   local shards (attention's SDPA); a context-parallel technique replaces the
   body of that region (ring attention) and keeps the boundary;
5. every other planned module's body goes through ``representation.module_body``
   (the ``default`` backend runs it on local shards; the others leave it as it is).

Works on a model built on the meta device: nothing here reads values.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .plan import ModulePlan, Redistribute, ShardingPlan, boundary_dst, boundary_src
from .representation import StateLayout, TensorRepresentation

__all__ = ["apply_plan", "plain_fqn", "resolve_state", "state_layouts"]

#: The attribute through which torch's ``checkpoint_wrapper`` holds the wrapped block.
_WRAPPED = "_checkpoint_wrapped_module"


def plain_fqn(name: str) -> str:
    """``name`` (from ``model.named_parameters()``) as :func:`state_layouts` and torch's
    state-dict helpers name it: without the ``_checkpoint_wrapped_module.`` parts that
    activation checkpointing put in."""
    return ".".join(part for part in name.split(".") if part != _WRAPPED)


def resolve_state(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """``(module, tensor name)`` of the parameter or buffer ``fqn`` as :func:`state_layouts` names it.

    Names are those of the model before activation checkpointing: a wrapper that
    ``checkpoint_wrapper`` put in between (``layers.0._checkpoint_wrapped_module.``)
    is looked through.
    """
    *path, name = fqn.split(".")
    module = model
    for part in path:
        while part not in module._modules and _WRAPPED in module._modules:
            module = module._modules[_WRAPPED]  # type: ignore[assignment]
        child = module._modules.get(part)
        if child is None:
            raise KeyError(f"{type(model).__name__} has no submodule for state {fqn!r}.")
        module = child
    while name not in module._parameters and name not in module._buffers and _WRAPPED in module._modules:
        module = module._modules[_WRAPPED]  # type: ignore[assignment]
    return module, name


def state_layouts(model: nn.Module, plan: ShardingPlan) -> dict[str, StateLayout]:
    """The layout and full shape of every parameter and buffer of ``model`` (before sharding).

    Keys are fully-qualified names (``layers.0.attention.wq.weight``).
    """
    out: dict[str, StateLayout] = {}
    for fqn, module, name, layout in plan.param_layouts(model):
        tensor = getattr(module, name)
        if tensor is not None:
            out[f"{fqn}.{name}" if fqn else name] = StateLayout(layout, tensor.shape)
    return out


def apply_plan(model: nn.Module, plan: ShardingPlan, representation: TensorRepresentation) -> dict[str, StateLayout]:
    """Shard ``model`` in place per ``plan`` and install the boundary hooks.

    Returns :func:`state_layouts` of the model (what the initialisation and the
    state-dict views need). Raises ValueError at setup for a plan that does not
    match the model or that the representation cannot run. Without a forward
    mesh (nothing distributed) the model is left as it is.
    """
    states = state_layouts(model, plan)
    representation.check_plan(plan)
    if representation.forward_mesh is None:
        return states
    done: dict[int, tuple[Any, Any]] = {}  # a tensor shared by two modules (tied weights): once
    for fqn, module, name, layout in plan.param_layouts(model):
        table = module._parameters if name in module._parameters else module._buffers
        tensor = table[name]
        if tensor is None:
            continue
        if id(tensor) in done:
            first_layout, distributed = done[id(tensor)]
            if first_layout != layout:
                raise ValueError(f"the plan lays out {fqn}.{name} as {layout}, but the same tensor (shared with "
                                 f"another module: tied weights) as {first_layout}; one tensor has one layout.")
            table[name] = distributed
            continue
        table[name] = representation.distribute(tensor, layout)  # type: ignore[assignment]
        done[id(tensor)] = (layout, table[name])
    for fqn, module, mplan in plan.resolve(model):
        _install(fqn or "<model>", module, mplan, representation)
    return states


def _install(fqn: str, module: nn.Module, mplan: ModulePlan, rep: TensorRepresentation) -> None:
    # The messages' module names are made here, not in the hooks: a hook that formats ``fqn`` makes
    # Dynamo guard on it, and every block (same code, another name) then compiles anew (see
    # techniques/compile.py). Passed along unread, they cost the traced graph nothing.
    input_wheres = [f"{fqn} input #{i}" for i in range(len(mplan.inputs))]
    output_where = f"{fqn} output"

    def pre_hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(args)
        for i, b in enumerate(mplan.inputs[: len(args)]):
            src = boundary_src(b)
            if src is None:
                continue
            where = input_wheres[i]
            x = rep.arrive(args[i], src, module=module, where=where)
            if isinstance(b, Redistribute):
                x = rep.redistribute(x, b.src, b.dst, where=where)
            out[i] = x
        return tuple(out)

    def post_hook(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        b, where = mplan.output, output_where
        if isinstance(b, Redistribute):
            output = rep.redistribute(output, b.src, b.dst, where=where)
        return rep.depart(output, boundary_dst(b), where=where)

    if mplan.inputs:
        module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook)
    if mplan.local_compute:
        # What the body produces: a redistributing output boundary moves it on afterwards.
        out_layout = boundary_src(mplan.output)
        if out_layout is None:
            raise ValueError(f"plan for {fqn!r}: local_compute needs an output layout.")
        module.forward = rep.local_region(module.forward, out_layout, where=fqn)  # type: ignore[method-assign]
    else:
        body = rep.module_body(module, module.forward, boundary_src(mplan.output), where=fqn)
        if body is not None:
            module.forward = body  # type: ignore[method-assign]

"""Observers installed on a built Trainer inside a forked rank (see ``feature_helpers.run_steps``).

Each takes the trainer, installs hooks, and returns ``{"result": callable}`` whose
value (plain Python data) comes back to the test.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan_spmd.distributed.apply_plan import resolve_state

__all__ = ["block_calls", "compiled_graphs", "dtypes", "gradient_sync"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def dtypes(trainer: Any) -> dict[str, Any]:
    """The dtype each matmul of the first block computes in, and the stored dtypes after the steps."""
    seen: list[str] = []
    wq, _ = resolve_state(trainer.model, "layers.0.attention.wq.weight")

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        seen.append(str(_local(output).dtype))

    wq.register_forward_hook(hook)
    losses: list[str] = []
    real_loss = trainer.loss_fn

    def loss_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = real_loss(*args, **kwargs)
        losses.append(str(loss.dtype))
        return loss

    trainer.loss_fn = loss_fn

    def result() -> dict[str, Any]:
        state = [v for s in trainer.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {
            "matmul_outputs": sorted(set(seen)),
            "loss": sorted(set(losses)),
            "params": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "optimizer_state": sorted({str(v.dtype) for v in state}),
        }

    return {"result": result}


def gradient_sync(trainer: Any) -> dict[str, Any]:
    """Per microbatch: whether FSDP synchronises its gradients, and whether any sharded
    parameter already holds a gradient when that microbatch starts."""
    import torchtitan_spmd.train as train_module

    calls: list[tuple[bool, bool]] = []
    real = train_module.set_gradient_sync

    def recording(model: torch.nn.Module, enabled: bool) -> None:
        calls.append((enabled, any(p.grad is not None for p in model.parameters())))
        real(model, enabled)

    train_module.set_gradient_sync = recording
    return {"result": lambda: calls}


def _inner_block(trainer: Any, name: str = "0") -> torch.nn.Module:
    """Block ``name`` of ``trainer.model.layers``, inside any checkpoint wrapper."""
    block = trainer.model.layers[name]
    return getattr(block, "_checkpoint_wrapped_module", block)


def _per_step(trainer: Any, counter: list[int]) -> list[int]:
    """Wrap ``trainer.step`` so that ``counter[0]`` is recorded and reset at each step."""
    per_step: list[int] = []
    real_step = trainer.step

    def step(n: int) -> Any:
        counter[0] = 0
        record = real_step(n)
        per_step.append(counter[0])
        return record

    trainer.step = step
    return per_step


def block_calls(trainer: Any) -> dict[str, Any]:
    """How many times the first block's body runs per step (2 when backward recomputes it)."""
    counter = [0]

    def hook(*_: Any) -> None:
        counter[0] += 1

    _inner_block(trainer).register_forward_pre_hook(hook)
    per_step = _per_step(trainer, counter)
    return {"result": lambda: per_step}


def compiled_graphs(trainer: Any) -> dict[str, Any]:
    """How many distinct graphs Dynamo compiled in this rank, and why it compiled a function
    again (the guard failures since set-up: every block of the model runs the same code, so a
    block that compiles anew guards on something that differs between blocks)."""
    from torch._dynamo.utils import counters, guard_failures

    before = {code: len(reasons) for code, reasons in list(guard_failures.items())}

    def since_setup() -> list[str]:  # each function's reasons past those it had at set-up
        return [reason for code, reasons in list(guard_failures.items()) for reason in reasons[before.get(code, 0):]]

    return {"result": lambda: {"graphs": int(counters["stats"]["unique_graphs"]), "recompiles": since_setup()}}

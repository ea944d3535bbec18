"""Pieces shared by the two DTensor backends (``default`` and ``full_dtensor``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def dtensor_clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """Clip over the global norm of (possibly DTensor) gradients; return the norm.

    Every gradient must live on the same mesh (true for both DTensor backends:
    FSDP's mesh, or the one dense mesh). The DTensor norm is reduced with
    ``full_tensor()``, so sharded and replicated axes are each counted once.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in model.parameters() if p.grad is not None], max_norm, total
        )
    return float(total)


@contextlib.contextmanager
def maybe_loss_parallel(enabled: bool) -> Iterator[None]:
    """torch's ``loss_parallel()`` when ``enabled``; otherwise nothing."""
    if enabled:
        with loss_parallel():
            yield
    else:
        yield


def set_module_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` of ``module`` (keeping its kind)."""
    if name in module._parameters:
        old = module._parameters[name]
        requires_grad = old.requires_grad if old is not None else True
        module.register_parameter(name, nn.Parameter(value, requires_grad=requires_grad))
    else:
        persistent = name not in module._non_persistent_buffers_set
        module.register_buffer(name, value, persistent=persistent)

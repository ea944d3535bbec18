"""Helpers for the dry-run tests: the real run's per-rank bytes on forked gloo ranks.

The measurement shares nothing with :mod:`torchtitan_spmd.dry_run`: it is the real trainer's
materialised parameters, the gradients as they stand when the optimizer steps (FSDP has reduced
them), and the optimizer's states after that step, each summed from the tensors themselves; and
the bytes the second step's collectives send, logged as the process issues them
(:class:`_CollectiveLog`), per mesh axis.
"""

from __future__ import annotations

from typing import Any

from parity_helpers import warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked


def _nbytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _measure(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    _record_selective_contexts()  # this forked rank only
    trainer = Trainer(cfg)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    seen: dict[str, int] = {}
    step = trainer.optimizer.step

    def counting_step(*args: Any, **kwargs: Any) -> Any:
        seen["grad_bytes"] = sum(_nbytes(p.grad) for p in params if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = counting_step  # type: ignore[method-assign]
    saved = _saved_activation_bytes(trainer) if trainer.pipeline is None else None
    trainer.step(1)
    # the second step's collectives: the first one's also set things up (under PP, torch's
    # schedule infers the stages' shapes and FSDP gathers again)
    recorder = _CollectiveLog()
    with recorder.mode:
        trainer.step(2)
    comm = _per_axis(recorder.log, trainer.parallel_dims)
    optimizer_bytes = sum(_nbytes(v) for s in trainer.optimizer.state.values() for v in s.values()
                          if hasattr(v, "numel"))
    pp_rank = trainer.pipeline.group.rank() if trainer.pipeline is not None else 0
    out = {"rank": rank, "pp_rank": pp_rank, "param_bytes": sum(_nbytes(p) for p in params),
           "grad_bytes": seen["grad_bytes"], "optimizer_bytes": optimizer_bytes, "saved_bytes": saved,
           "comm": comm}
    trainer.close()
    return out


#: The forward contexts of torch's selective checkpointing that this rank's blocks created.
_SAC_CONTEXTS: list[Any] = []


def _record_selective_contexts() -> None:
    """Keep each forward context ``create_selective_checkpoint_contexts`` hands selective AC: its
    ``storage`` holds what the block keeps (the outputs its policy saves)."""
    import torchtitan_spmd.techniques.activation_checkpoint as ac

    original = ac.create_selective_checkpoint_contexts

    def recording(*args: Any, **kwargs: Any) -> Any:
        forward, recompute = original(*args, **kwargs)
        _SAC_CONTEXTS.append(forward)
        return forward, recompute

    ac.create_selective_checkpoint_contexts = recording


def _cached_tensors(tree: Any) -> list[Any]:
    """The tensors inside a selective-checkpoint storage (its ``_VersionWrapper`` values)."""
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _cached_tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _cached_tensors(v)]
    val = getattr(tree, "val", None)
    return _cached_tensors(val) if val is not None else []


def _saved_activation_bytes(trainer: Any) -> int:
    """What one microbatch's forward and loss save for backward on this rank, measured with
    saved-tensor hooks on the real tensors: each storage once, the (gathered) parameters not counted.
    Under selective AC a block keeps, instead, its input (the checkpoint's, to recompute from) and
    what torch's selective-checkpoint context cached (its ``storage``), read after the forward."""
    import torch

    from torchtitan_spmd.distributed.inputs import prepare_inputs
    from torchtitan_spmd.techniques.loss import global_token_count

    model, rep = trainer.model, trainer.representation
    tokens, labels = next(iter(trainer.build_dataloader()))
    n = trainer.gradient_accumulation_steps
    x, y = prepare_inputs(tokens.chunk(n)[0], labels.chunk(n)[0], rep)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        st = local.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    def keep(t: Any) -> None:
        st = _local(t).untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())

    from torchtitan_spmd.config.activation_checkpoint import ac_section

    selective = ac_section(trainer.job_config.activation_checkpoint).mode == "selective"
    handles = [block.register_forward_pre_hook(lambda _m, args: keep(args[0]))
               for block in model.layers.values()] if selective else []
    _SAC_CONTEXTS.clear()
    with trainer.train_context():
        token_count = global_token_count([y], rep)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(x)
            loss = trainer.loss_fn(logits, y, rep, logits_layout=trainer.plan.output_layout(),
                                   token_count=token_count)
        for context in _SAC_CONTEXTS:
            for t in _cached_tensors(dict(context.storage)):
                keep(t)
        loss.backward()
    for handle in handles:
        handle.remove()
    trainer.optimizer.zero_grad(set_to_none=True)
    return sum(seen.values())


def _local(t: Any) -> Any:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def measure(cfg: JobConfig, world: int) -> list[dict[str, Any]]:
    """Every rank's parameter, gradient and optimizer-state bytes after one real step."""
    warm_parent()
    return run_forked(_measure, world, cfg, timeout_s=240)


# ---------------------------------------------------------------------------------------------
# What the real run's collectives move, per mesh axis (shares nothing with the dry run's estimate)


class _CollectiveLog:
    """A dispatch mode that logs each collective the process issues: the c10d ops FSDP2 and
    ``torch.distributed`` call, and the functional ones DTensor calls (it lets DTensor desugar
    first, as torch's ``CommDebugMode`` does). Each entry: (op, group name, bytes this rank sends
    under a ring algorithm). Received-only ops (``recv_``) send nothing."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        log: list[tuple[str, str, int]] = []
        self.log = log

        def nbytes(t: Any) -> int:
            if isinstance(t, (list, tuple)):
                return sum(nbytes(x) for x in t)
            return t.numel() * t.element_size()

        def group_of(value: Any) -> Any:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _resolve_process_group

            if isinstance(value, torch.ScriptObject):
                return dist.ProcessGroup.unbox(value)
            return value if isinstance(value, dist.ProcessGroup) else _resolve_process_group(value)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                from torch.distributed.tensor import DTensor

                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                kwargs = kwargs or {}
                if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                    named = dict(zip([a.name for a in func._schema.arguments], args, strict=False))
                    named.update(kwargs)
                    group_arg = named.get("process_group", named.get("group_name"))
                    name = func._schema.name.split("::")[1]
                    if group_arg is not None and name not in ("recv_", "barrier"):
                        group = group_of(group_arg)
                        n, me = group.size(), group.rank()
                        if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
                            sent = nbytes(args[0]) * (n - 1) // n  # the gathered output
                        elif name == "allgather_":
                            sent = nbytes(args[1]) * (n - 1)
                        elif name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
                            sent = nbytes(args[0]) * (n - 1)  # the input, one shard
                        elif name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
                            sent = nbytes(args[1]) * (n - 1) // n
                        elif name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
                            sent = nbytes(args[0]) * (n - 1) // n
                        elif name in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"):
                            sent = 2 * nbytes(args[0]) * (n - 1) // n
                        elif name in ("alltoall_base_", "all_to_all_single"):
                            t = args[1] if name == "alltoall_base_" else args[0]
                            splits = list(named["input_split_sizes"])
                            row = nbytes(t) // max(1, t.shape[0]) if t.dim() else nbytes(t)
                            sent = (nbytes(t) * (n - 1) // n if not splits
                                    else row * (sum(splits) - splits[me]))
                        elif name == "send":
                            sent = nbytes(args[0])
                        else:
                            sent = nbytes([a for a in args if isinstance(a, torch.Tensor)])
                        log.append((name, group.group_name, int(sent)))
                return func(*args, **kwargs)

        self.mode = Mode()


def axis_of_group(parallel_dims: Any) -> dict[str, str]:
    """Each process group's name -> the first mesh axis (in this order) whose group it is."""
    order = ("tp", "fsdp", "cp", "ep", "efsdp", "pp", "dp_replicate", "loss", "batch", "dp_shard", "dp")
    out: dict[str, str] = {}
    for axis in order:
        if axis not in parallel_dims.mesh_axis_names:
            continue
        mesh = parallel_dims.get_optional_mesh(axis)
        if mesh is not None:
            out.setdefault(mesh.get_group(0).group_name, axis)
    return out


def _per_axis(log: list[tuple[str, str, int]], parallel_dims: Any) -> dict[str, int]:
    """:class:`_CollectiveLog`'s entries summed per mesh axis (:func:`axis_of_group`)."""
    import torch.distributed as dist

    axes = axis_of_group(parallel_dims)
    axes.setdefault(dist.group.WORLD.group_name, "world")
    per_axis: dict[str, int] = {}
    for _, group, sent in log:
        per_axis[axes.get(group, group)] = per_axis.get(axes.get(group, group), 0) + sent
    return per_axis

"""Technique: fault tolerance with torchft (``[fault_tolerance]``; upstream's ``torchtitan/experiments/torchft``).

Each replica group is its own launch (its own gloo or NCCL world, running FSDP/TP/... inside it as
usual); the data-parallel *replicate* axis across the groups is torchft's: a
:class:`torchft.Manager` per rank, a reconfigurable :class:`torchft.ProcessGroupGloo` between the
ranks of equal group rank, and a Lighthouse (``TORCHFT_LIGHTHOUSE``) that forms each step's
quorum from the groups alive. What torchft does, and this module only wires:

- **quorum** at the start of every step (synchronous quorum: a group that returns heals before
  its first step back); a group that died or stalls past the Lighthouse's heartbeat timeout is
  left out of the next quorum;
- **gradients** (and the loss) averaged over the groups *that take part in the step*, one
  all-reduce of every local gradient shard and the loss in one flat buffer, through
  ``Manager.allreduce`` (an error there makes the step uncommitted, not a hang: every operation
  has ``process_group_timeout_ms``);
- **commit**: the optimizer steps only if ``Manager.should_commit()`` (every rank of every live
  group agrees); an uncommitted step is retried under the same step number with the next batch;
- **heal**: a group that joins late loads, from a live peer and through torchft's checkpoint
  transport (HTTP), this module's state: every parameter's local shard, the optimizer's state,
  the learning-rate schedule, the data position and the step (torchft's own ``step`` and
  ``batches_committed``);
- **checkpoints**: only the group of participating rank 0 (the smallest live replica id) saves;
- **semi-synchronous** (``semi_sync_method``): torchft's ``LocalSGD`` or ``DiLoCo`` (fragments,
  ``fragment_sync_delay``, ``fragment_update_alpha``) around the inner optimizer, as upstream's
  ``maybe_semi_sync_training`` builds them (outer SGD lr 0.7, momentum 0.9, Nesterov).

Not hand-rolled: quorum, the managed process group, the heal transfer and the semi-synchronous
algorithms are torchft's. This module's own parts are the state the heal moves (local shards, so
it does not depend on DTensor pickling) and the flat gradient buffer (one all-reduce per step).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_spmd._errors import MissingExtraError, install_hint
from torchtitan_spmd.config import JobConfig

if TYPE_CHECKING:
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

logger = logging.getLogger("torchtitan_spmd")

__all__ = ["LIGHTHOUSE_ENV", "FaultTolerance", "ft_group_count", "validate_fault_tolerance"]

#: torchft's environment variable naming the Lighthouse (``http://host:port``).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

#: upstream's DiLoCo outer optimizer (``maybe_semi_sync_training``): SGD, lr 0.7, Nesterov momentum 0.9.
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def ft_group_count(job_config: JobConfig) -> int:
    """How many replica groups share the global batch: ``fault_tolerance.group_size`` when enabled, else 1."""
    ft = job_config.fault_tolerance
    return ft.group_size if ft.enable else 1


def validate_fault_tolerance(job_config: JobConfig, parallel_dims: ParallelDims, device_type: str) -> None:
    """Setup checks of ``[fault_tolerance]`` (one line each): the extra, the in-launch replicate
    degree, the process group against the device, the features torchft's managed replicate axis
    cannot take here. No-op unless ``fault_tolerance.enable``."""
    ft = job_config.fault_tolerance
    if not ft.enable:
        return
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        raise MissingExtraError(f"fault_tolerance.enable needs the 'torchft' package (0.2.0): {install_hint('ft')} "
                                f"({err}).") from None
    if parallel_dims.dp_replicate != 1:
        raise ValueError(
            "fault_tolerance.enable: parallelism.data_parallel_replicate_degree must be 1 (got "
            f"{parallel_dims.dp_replicate}); the replicate axis is across the replica groups "
            f"(fault_tolerance.group_size = {ft.group_size}), one launch per group.")
    if ft.process_group == "mccl":
        raise ValueError("fault_tolerance.process_group='mccl' needs torchcomms, which this library does not "
                         "support; use 'gloo' (CPU) or 'nccl' (CUDA).")
    if ft.process_group == "nccl" and device_type != "cuda":
        raise ValueError(f"fault_tolerance.process_group='nccl' needs CUDA; this run is on {device_type}: "
                         "use 'gloo'.")
    if ft.process_group == "gloo" and device_type == "cuda":
        raise ValueError("fault_tolerance.process_group='gloo' with CUDA tensors: the gradients would be "
                         "all-reduced from the GPU through gloo; use 'nccl'.")
    if parallel_dims.pp > 1:
        raise ValueError("fault_tolerance.enable with pipeline parallelism (parallelism.pipeline_parallel_degree="
                         f"{parallel_dims.pp}) is not supported here: each stage would need its own replicate group "
                         "and heal; use FSDP/TP inside a group.")
    if ft.should_quantize and device_type != "cuda":
        raise ValueError("fault_tolerance.should_quantize needs CUDA (torchft quantizes with Triton kernels); "
                         "set it to False on CPU.")
    if ft.semi_sync_method is not None:
        method = ft.semi_sync_method.lower()
        n = len(ft.module_fqns_per_model_fragment) or ft.num_fragments
        if method == "diloco" and ft.sync_steps % n:
            raise ValueError(f"fault_tolerance.sync_steps ({ft.sync_steps}) must be a multiple of the number of "
                             f"DiLoCo fragments ({n}): torchft syncs one fragment every sync_steps / fragments steps.")
        if method == "diloco" and ft.fragment_sync_delay >= ft.sync_steps // n:
            raise ValueError(f"fault_tolerance.fragment_sync_delay ({ft.fragment_sync_delay}) must be below "
                             f"sync_steps / fragments (= {ft.sync_steps // n}).")
        if method == "local_sgd" and (ft.num_fragments != 1 or ft.module_fqns_per_model_fragment):
            raise ValueError("fault_tolerance.num_fragments / module_fqns_per_model_fragment are DiLoCo's; "
                             "semi_sync_method='local_sgd' syncs the whole model.")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _group_store(rank: int) -> tuple[str, int]:
    """A TCPStore for this group's torchft managers (torchft needs one; the launch may use a file
    store): rank 0 hosts it on a free port, every rank learns the port over the group's world."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = None
    port = [0]
    if rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        port = [store.port]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(port, src=0)
    _group_store.keep = store  # type: ignore[attr-defined]  # the server lives as long as the process
    return host, port[0]


class FaultTolerance:
    """One rank's torchft wiring (see the module docstring); built by the trainer when enabled.

    Attributes:
        manager: the :class:`torchft.Manager`.
        replica_id: this group's ``fault_tolerance.replica_id``.
        group_size: ``fault_tolerance.group_size``.
        heals: the steps at which this group healed from a peer (the step it resumed after).
    """

    def __init__(self, job_config: JobConfig, *, device_type: str) -> None:
        import torchft

        ft = job_config.fault_tolerance
        self.config = ft
        self.replica_id, self.group_size = ft.replica_id, ft.group_size
        self.semi_sync = ft.semi_sync_method.lower() if ft.semi_sync_method else None
        if not os.environ.get(LIGHTHOUSE_ENV):
            raise ValueError(f"fault_tolerance.enable needs the Lighthouse's address in ${LIGHTHOUSE_ENV} "
                             "(e.g. http://127.0.0.1:29510; `python -m torchtitan_spmd.tools.ft_launch` starts one).")
        timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
        pg = (torchft.ProcessGroupGloo(timeout=timeout) if ft.process_group == "gloo"
              else torchft.ProcessGroupNCCL(timeout=timeout))
        rank = dist.get_rank()
        host, port = _group_store(rank)
        self.heals: list[int] = []
        self._init_timeout = timedelta(seconds=job_config.comm.init_timeout_seconds)
        self._first_quorum = True
        self._objects: dict[str, Any] = {}
        self.manager = torchft.Manager(
            pg=pg, min_replica_size=ft.min_replica_size, load_state_dict=None, state_dict=None,
            # synchronous quorum: a returning group heals before its first step back (DiLoCo needs it too)
            use_async_quorum=False,
            # every group initialises the same weights from debug.seed: no transfer at step 0
            init_sync=False,
            # collectives and RPCs: process_group_timeout_ms; a quorum: comm.train_timeout_seconds
            # (the first one, while the groups start, comm.init_timeout_seconds; see start_step)
            timeout=timeout, connect_timeout=self._init_timeout,
            quorum_timeout=timedelta(seconds=job_config.comm.train_timeout_seconds),
            rank=rank, world_size=dist.get_world_size(), store_addr=host, store_port=port,
            replica_id=f"torchtitan_ft_{ft.replica_id}", hostname=socket.gethostname(),
        )
        self.device_type = device_type
        #: Bytes this rank handed to torchft's cross-group all-reduce (gradients or DiLoCo/LocalSGD
        #: pseudo-gradients, and the loss): the payload, not gloo's wire bytes.
        self.allreduce_bytes = 0
        inner_allreduce = self.manager.allreduce

        def counted_allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.allreduce_bytes += tensor.numel() * tensor.element_size()
            return inner_allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted_allreduce  # type: ignore[method-assign]

    # -- data -----------------------------------------------------------------------------------
    def dp_info(self, dp_degree: int, dp_rank: int) -> tuple[int, int]:
        """This rank's data shard among every group's (upstream's ``get_dp_info``): the in-group
        degree times ``group_size``, and ``replica_id``'s block of it."""
        return dp_degree * self.group_size, dp_degree * self.replica_id + dp_rank

    # -- state the heal moves ---------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, dataloader: Any) -> None:
        """Register what a healing group loads from a live peer: parameters, optimizer state,
        learning-rate schedule and data position (torchft adds its step and batches committed)."""
        self._objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "dataloader": dataloader}
        self.manager.register_state_dict_fn("torchtitan_spmd", self._load_state, self._state)

    def _params(self) -> dict[str, nn.Parameter]:
        return dict(self._objects["model"].named_parameters())

    def _state(self) -> dict[str, Any]:
        """The heal's state, as local tensors (every group has the same layout, so shards match)."""
        optimizer = self._objects["optimizer"]
        optim_sd = optimizer.state_dict()
        optim_sd["state"] = {k: {n: _local(v) if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                             for k, s in optim_sd["state"].items()}
        dataloader = self._objects["dataloader"]
        return {
            "model": {name: _local(p.detach()) for name, p in self._params().items()},
            "optimizer": optim_sd,
            "scheduler": self._objects["scheduler"].state_dict(),
            "dataloader": dataloader.state_dict() if hasattr(dataloader, "state_dict") else None,
        }

    @torch.no_grad()
    def _load_state(self, state: dict[str, Any]) -> None:
        params = self._params()
        for name, value in state["model"].items():
            _local(params[name]).copy_(value)
        optimizer = self._objects["optimizer"]
        ordered = [p for group in optimizer.param_groups for p in group["params"]]
        optim_sd = state["optimizer"]
        for index, entry in optim_sd["state"].items():
            param = ordered[int(index)]
            for key, value in list(entry.items()):
                if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
                    entry[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                    shape=param.shape, stride=param.stride())
        optimizer.load_state_dict(optim_sd)
        self._objects["scheduler"].load_state_dict(state["scheduler"])
        dataloader = self._objects["dataloader"]
        if state["dataloader"] is not None and hasattr(dataloader, "load_state_dict"):
            dataloader.load_state_dict(state["dataloader"])

    # -- the step -------------------------------------------------------------------------------
    def committed_steps(self) -> int:
        """Steps committed so far (torchft's step; after a heal, the peer's)."""
        return self.manager.current_step()

    def resume(self, step: int) -> None:
        """After loading a checkpoint of ``step``: torchft's step counter starts there."""
        if step:
            self.manager.load_state_dict({"step": step, "batches_committed": step * self.group_size})

    def start_step(self) -> int:
        """The quorum for the next step (a returning group heals here); returns its step number."""
        before = self.manager.current_step()
        # the first quorum waits for the other groups' start-up (comm.init_timeout_seconds)
        self.manager.start_quorum(timeout=self._init_timeout if self._first_quorum else None)
        self._first_quorum = False
        after = self.manager.current_step()
        if after != before:
            self.heals.append(after)
            if dist.get_rank() == 0:
                logger.info(f"fault_tolerance: replica group {self.replica_id} healed from a live peer at its "
                            f"step {after} (parameters sha256 {self.params_digest()[:16]} on rank 0)")
        return after + 1

    @torch.no_grad()
    def sync_gradients(self, model: nn.Module, loss: float) -> float:
        """Average every local gradient shard and the loss over the groups in this step's quorum
        (one all-reduce); returns the averaged loss. On an error torchft marks the step
        uncommitted (its buffer is then garbage, and the optimizer does not step)."""
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads]
                         + [torch.tensor([loss], dtype=torch.float32, device=grads[0].device if grads else "cpu")])
        self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        flat /= max(self.manager.num_participants(), 1)  # the live groups, not group_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return float(flat[offset])

    def params_digest(self) -> str:
        """sha256 of this rank's parameter shards (by name), to compare groups bitwise."""
        h = hashlib.sha256()
        for _, p in sorted(self._params().items()):
            h.update(_local(p.detach()).cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def should_commit(self) -> bool:
        """Whether this step may update the weights: every rank of every group in the quorum agrees."""
        return self.manager.should_commit()

    def is_checkpoint_writer(self) -> bool:
        """Whether this group saves checkpoints: the one of participating rank 0 (smallest live id)."""
        return self.manager.participating_rank() == 0

    def num_participants(self) -> int:
        """Groups in the current quorum."""
        return self.manager.num_participants()

    # -- semi-synchronous training ----------------------------------------------------------------
    def semi_sync_context(self, model: nn.Module, optimizer: torch.optim.Optimizer
                          ) -> contextlib.AbstractContextManager[Any]:
        """torchft's ``LocalSGD`` / ``DiLoCo`` around ``optimizer`` (a null context when
        ``semi_sync_method`` is None), as upstream's ``maybe_semi_sync_training``."""
        from torchft import local_sgd

        ft = self.config
        if self.semi_sync is None:
            return contextlib.nullcontext()
        if self.semi_sync == "local_sgd":
            return local_sgd.LocalSGD(manager=self.manager, model=model, optimizer=optimizer,
                                      sync_every=ft.sync_steps)
        fragments = model_fragments(model, ft.module_fqns_per_model_fragment, ft.num_fragments)
        outer = [torch.optim.SGD([p for p in f.parameters() if p.requires_grad], lr=OUTER_LR,
                                 momentum=OUTER_MOMENTUM, nesterov=True) for f in fragments]
        return local_sgd.DiLoCo(manager=self.manager, model_fragments=fragments, inner_optimizer=optimizer,
                                outer_optimizer=outer, sync_every=ft.sync_steps, should_quantize=ft.should_quantize,
                                fragment_sync_delay=ft.fragment_sync_delay,
                                fragment_update_alpha=ft.fragment_update_alpha)

    def close(self) -> None:
        """Stop torchft's manager server, checkpoint server and quorum thread."""
        self.manager.shutdown(wait=False)


class _Fragment(nn.Module):
    """A DiLoCo fragment: some of the model's modules under their own names (no forward)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({name.replace(".", "__"): m for name, m in modules.items()})


def model_fragments(model: nn.Module, fqns: list[list[str]], num_fragments: int) -> list[nn.Module]:
    """DiLoCo's fragments: ``fqns`` (module names per fragment) or else ``num_fragments`` runs of
    consecutive top-level modules (``layers.*`` counted one by one), upstream's ``fragment_fn`` idea;
    one fragment is the model itself. A name that is not a module is one line."""
    if not fqns and num_fragments == 1:
        return [model]
    modules = dict(model.named_modules())
    if fqns:
        missing = [n for group in fqns for n in group if n not in modules]
        if missing:
            raise ValueError(f"fault_tolerance.module_fqns_per_model_fragment: no module named "
                             f"{', '.join(map(repr, missing))} in the model.")
        return [_Fragment({n: modules[n] for n in group}) for group in fqns]
    units = list(_units(model))
    if num_fragments > len(units):
        raise ValueError(f"fault_tolerance.num_fragments={num_fragments} exceeds the model's {len(units)} "
                         "top-level modules and blocks.")
    size, extra = divmod(len(units), num_fragments)
    out, start = [], 0
    for i in range(num_fragments):
        end = start + size + (1 if i < extra else 0)
        out.append(_Fragment(dict(units[start:end])))
        start = end
    return out


def _units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The model's top-level modules with parameters, a container of blocks split into its blocks."""
    for name, child in model.named_children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, nn.ModuleDict | nn.ModuleList):
            for sub, block in child.named_children():
                yield f"{name}.{sub}", block
        else:
            yield name, child

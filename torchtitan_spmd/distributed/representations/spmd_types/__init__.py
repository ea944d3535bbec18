"""Backend ``spmd_types``: plain local shards typed with ``spmd_types``, explicit collectives.

Nothing here is a DTensor during forward and backward: every parameter, buffer
and activation is a plain ``torch.Tensor`` holding this rank's shard, annotated
with its per-axis ``spmd_types`` type, and every change of layout is one explicit
``spmd_types`` collective. With ``--debug.spmd_typechecking`` the forward and the
loss run under ``spmd_types.checker.typecheck(local=False)``, which proves each of
those collectives is where it must be (a missing ``all_reduce`` is a type error
instead of a silently wrong gradient).

On the forward/backward mesh ``(dp, cp, tp)`` (active axes only):

- parameters and buffers: sliced in partition-spec order (``torch.chunk``
  semantics, as DTensor's ``Shard``), annotated ``R`` on the data-parallel axes
  and the plan's type on the model axes;
- data: ``S(0)`` on ``dp``, the plan's layout elsewhere (tokens ``R@tp``, labels ``I@tp``);
- boundaries: one collective per changed axis (:mod:`.redistribute`); plans
  needing anything else are rejected at setup; under the checker every declared
  layout is asserted;
- local regions run under ``spmd_types.local()`` and their output is stamped
  with the declared layout;
- FSDP2 on the storage mesh (the active ones of ``dp_replicate, dp_shard, cp, tp``)
  with ``DataParallelMeshDims`` (torch >= 2.14), sharding over ``dp_shard x cp``.
  FSDP also all-reduces, over ``tp``, the gradients of parameters replicated on
  ``tp`` (their gradient type is ``P``); without FSDP a gradient hook does it;
- context parallelism: data is ``S(1)@cp``; the attention kernel's ring attention is
  one autograd Function whose ``spmd_typecheck`` types its key/value exchange over
  ``cp`` (``V -> R``) and its ``V@cp`` output; the loss and token count are
  all-reduced over ``dp`` and ``cp`` (``P -> I`` on each).

Modules: :mod:`.mesh_context` (the library's current mesh), :mod:`.layout_types`
(layouts as annotations), :mod:`.redistribute` (the planner), :mod:`.typecheck`
(the checker shim and the train context).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import spmd_types as st  # the library (absolute import), not this package
import torch
import torch.distributed as dist
from spmd_types import I, P, R, V
from spmd_types.runtime import has_local_type  # top-level only from 0.3 on; here in 0.2.1 too
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan_spmd.config.activation_checkpoint import ac_section

from ...apply_plan import resolve_state
from ...expert_exchange import ExpertExchange
from ...layout import SpmdLayout
from ...representation import (
    FsdpSpec,
    StateLayout,
    TensorRepresentation,
    as_parameter_like,
)
from .expert_exchange import TypedExpertExchange
from .layout_types import annotate, distribute_tensor, layout_type, state_type, with_batch_axis
from .mesh_context import active, axis_names, group
from .redistribute import redistribute_per_axis, validate_redistributions
from .typecheck import DeclaredTypes, spmd_train_context

# spmd_types 0.3.1 calls torch's functional collectives by their deprecated names
# (`all_gather_tensor`, `reduce_scatter_tensor`, ...), and torch says so with a FutureWarning
# on every rank at the first collective of each kind: 8 lines a 4-rank run, about a package
# the user does not call. Silence exactly those (spmd_types' own modules, that message), and
# nothing a user's code or torch itself warns about otherwise.
warnings.filterwarnings(
    "ignore",
    message=r"`torch\.distributed\.(_functional_collectives\.)?\w+` is deprecated\. Please use ",
    category=FutureWarning,
    module=r"spmd_types(\.|$)",
)

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig

    from ...parallel_dims import ParallelDims
    from ...plan import ShardingPlan

if not hasattr(st, "assert_type"):  # pragma: no cover - a packaging error
    raise ImportError(
        "torchtitan_spmd.distributed.representations.spmd_types imported itself instead of the "
        "spmd_types library; do not run it with its own directory on sys.path."
    )

__all__ = ["FSDP_MIN_TORCH", "REPRESENTATION", "TYPECHECK_AC_MIN_TORCH", "SpmdTypesRepresentation"]

#: FSDP2 learned to shard spmd_types-annotated plain tensors in this torch release.
FSDP_MIN_TORCH = "2.14"
#: Type checking through activation checkpointing (torch 2.11's checkpoint is not checkable).
TYPECHECK_AC_MIN_TORCH = "2.13"
#: The spmd_types line whose checker this library's typed plan passes. Measured on 0.2.3
#: (upstream b5bcd76's pin): untyped training runs; the checker rejects the vocab-parallel
#: loss's autograd Function (0.2.x requires register_local_autograd_function) and mixing
#: P with I under FSDP (measured on the FSDP 2 x TP 2, FSDP 4, HSDP and TP 2 parity runs).
TYPECHECK_MIN_SPMD_TYPES = (0, 3)


def spmd_types_version() -> tuple[str, tuple[int, ...]]:
    """The installed spmd_types version as text and as a tuple of its leading numbers."""
    import importlib.metadata

    try:
        text = importlib.metadata.version("spmd-types")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - an unpackaged checkout
        text = getattr(st, "__version__", "0")
    numbers = tuple(int(part) for part in text.split(".")[:3] if part.isdigit())
    return text, numbers

_DP = "dp"
#: Marks a parameter whose gradient hook is installed (hooks belong to the tensor object).
_TP_GRAD_HOOKED = "_torchtitan_spmd_tp_grad_hooked"
#: The axes of the storage mesh FSDP is given (the active ones), data-parallel ones first.
_STORAGE_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
#: The axes the loss and the token count are summed over (torchtitan's ``(batch, cp)`` loss mesh).
_LOSS_AXES = (_DP, "cp")


class SpmdTypesRepresentation(TensorRepresentation):
    """Plain local shards typed with spmd_types; see the package docstring."""

    name: ClassVar[str] = "spmd_types"

    def __init__(self, parallel_dims: ParallelDims) -> None:
        super().__init__(parallel_dims)
        #: Per (use, layout): the types asserted (the forward mesh is fixed; computing them
        #: reads the mesh, whose tensor ops each pass through the checker).
        self._layout_types: dict[tuple[str, SpmdLayout], Any] = {}
        self._declared = DeclaredTypes()

    @staticmethod
    def resolve_forward_mesh(parallel_dims: ParallelDims) -> DeviceMesh | None:
        return parallel_dims.resolve_mesh(["dp", "cp", "tp"])

    def _live(self) -> list[str]:
        return [a for a in axis_names(self.forward_mesh) if active(self.forward_mesh, a)]

    # ------------------------------------------------------------------ setup
    def validate(self, job_config: JobConfig) -> None:
        super().validate(job_config)
        self._check_fsdp_support()
        text, version = spmd_types_version()
        if job_config.debug.spmd_typechecking and version[:2] < TYPECHECK_MIN_SPMD_TYPES:
            raise ValueError(
                f"debug.spmd_typechecking=True needs spmd_types >= 0.3 (installed: spmd-types {text}): "
                "the 0.2 line's checker rejects this library's typed plan (its vocab-parallel loss "
                "Function is unregistered there, and P does not mix with I under FSDP). Train "
                "unchecked on 0.2.x (debug.spmd_typechecking=False), or pip install 'spmd-types>=0.3.1,<0.4'."
            )
        mode = ac_section(job_config.activation_checkpoint).mode
        if job_config.debug.spmd_typechecking and mode != "none":
            # Measured: on torch 2.11 the checker stops at torch.utils.checkpoint's
            # _NoopSaveInputs ("tensor argument 'args' was not accounted for"); 2.13 and 2.14 pass.
            self.require_torch(
                TYPECHECK_AC_MIN_TORCH,
                f"debug.spmd_typechecking=True with activation_checkpoint.mode={mode!r}",
                "its activation checkpointing applies an autograd Function the type checker rejects",
                "Set activation_checkpoint.mode='none' for the type-checked run, or upgrade torch.",
            )

    def _check_fsdp_support(self) -> None:
        self.require_torch_for_data_parallel(
            FSDP_MIN_TORCH, "FSDP2's support for spmd_types-annotated plain tensors")

    def check_plan(self, plan: ShardingPlan) -> None:
        validate_redistributions(plan, self._live())

    # ------------------------------------------------------------------ tensors
    def distribute(self, tensor: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        mesh = self._mesh()
        value = as_parameter_like(tensor, distribute_tensor(tensor, mesh, layout))
        annotate(value, *state_type(layout, mesh))
        if isinstance(value, nn.Parameter):
            self._sync_tp_grads(value)
        return value

    def _mesh(self) -> DeviceMesh:
        if self.forward_mesh is None:
            raise RuntimeError("spmd_types: no forward mesh (nothing is distributed).")
        return self.forward_mesh

    def _data_type(self, layout: SpmdLayout) -> tuple[dict[Any, Any], st.PartitionSpec | None]:
        cached = self._layout_types.get(("data", layout))
        if cached is None:
            mesh = self._mesh()
            full = with_batch_axis(layout) if active(mesh, _DP) else layout
            cached = self._layout_types["data", layout] = layout_type(full, mesh, axes=self._live())
        return cached

    def from_local(self, x: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        if self.forward_mesh is not None:
            annotate(x, *self._data_type(layout))
        return x

    def _check(self, x: Any, layout: SpmdLayout, where: str | None = None) -> None:
        """Under the checker, assert the declared layout on the model axes (all but ``dp``);
        a type error names the boundary (``where``: the module and its input or output)."""
        if not isinstance(x, torch.Tensor) or not st.is_type_checking():
            return
        cached = self._layout_types.get(("model", layout))
        if cached is None:
            types, spec = layout_type(layout, self._mesh(), axes=[a for a in self._live() if a != _DP])
            cached = self._layout_types["model", layout] = (types, spec, DeclaredTypes.key(types, spec))
        types, spec, key = cached
        if not types:  # as annotate(): nothing to assert without types
            return
        try:
            self._declared(x, types, spec, key)
        except st.SpmdTypeError as err:
            if where is None:
                raise
            raise st.SpmdTypeError(f"{where} (declared {layout}): {err}") from err

    def arrive(self, x: Any, layout: SpmdLayout, *, module: nn.Module, where: str) -> Any:
        self._check(x, layout, where)
        return x

    def redistribute(self, x: Any, src: SpmdLayout, dst: SpmdLayout, *, where: str) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        self._check(x, src, where)
        return redistribute_per_axis(x, self._mesh(), src, dst)

    def depart(self, x: Any, layout: SpmdLayout | None, *, where: str) -> Any:
        if layout is not None:
            self._check(x, layout, where)
        return x

    def local_region(self, forward: Callable[..., Any], out_layout: SpmdLayout, *,
                     where: str) -> Callable[..., Any]:
        @functools.wraps(forward)
        def local_forward(*args: Any, **kwargs: Any) -> Any:
            if not st.is_type_checking():
                return forward(*args, **kwargs)
            with st.local():
                out = forward(*args, **kwargs)
            annotate(out, *self._data_type(out_layout))  # back to global typing
            return out

        return local_forward

    def to_local(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def amax_max_over_tp(self) -> Callable[..., torch.Tensor]:
        """The max over ``tp`` of a float8 scale's amax (:mod:`torchtitan_spmd.techniques.quantization`),
        typed: each rank's amax over its shard keeps the shard's type (``S(dim)@tp``: the ranks' amaxes
        side by side along the scaled ``dim``), an all-gather makes them ``R@tp`` and their max is
        the unsharded amax. A dropped reduction leaves the scale varying over tp where the float8
        matmul's type rule needs it the same on every tp rank."""
        mesh = self.forward_mesh
        assert mesh is not None
        tp = group(mesh, "tp")

        def reduce(amax: torch.Tensor, dim: int) -> torch.Tensor:
            return st.all_gather(amax, tp, src=st.S(dim), dst=R).amax(dim, keepdim=True)

        reduce.local_amax = self.local_amax  # type: ignore[attr-defined]
        return reduce

    @staticmethod
    def local_amax(t: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()``, an amax over this rank's part of ``t`` shaped as ``t`` with every reduced
        dim kept, typed as ``t`` (DTensor's rule would call it a pending max, which spmd_types does
        not type): the ranks' amaxes side by side along each sharded dim. An NVFP4 per-tensor amax
        of a batch-sharded input is one (each rank's matmul scales its own tokens)."""
        with st.no_typecheck():
            amax = compute()
        if has_local_type(t):
            from spmd_types.runtime import get_partition_spec

            st.assert_type(amax, dict(st.get_local_type(t)), partition_spec=get_partition_spec(t))
        return amax

    def sum_over_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks holding different tokens: ``P -> I`` on ``dp`` and on ``cp``."""
        mesh = self.forward_mesh
        for axis in _LOSS_AXES:
            if active(mesh, axis):
                assert mesh is not None
                x = st.all_reduce(x, group(mesh, axis), src=P, dst=I)
        return x

    # ------------------------------------------------------------------ FSDP and gradients
    def fsdp_spec(self) -> FsdpSpec | None:
        """The storage mesh (only axes larger than 1: a size-1 axis in it makes FSDP
        reject the annotations as incomplete) and its ``DataParallelMeshDims``."""
        pd = self.parallel_dims
        if not pd.dp_cp_enabled:
            return None
        self._check_fsdp_support()
        from torch.distributed.fsdp import DataParallelMeshDims  # torch >= 2.13 (checked above)

        names = [a for a in _STORAGE_AXES if pd.axis_size(a) > 1]
        mesh = pd.get_optional_mesh(names, include_singleton_axes=True)
        assert mesh is not None
        shard = tuple(a for a in ("dp_shard", "cp") if a in names)
        return FsdpSpec(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(
            shard=shard if len(shard) > 1 else (shard[0] if shard else None),
            replicate="dp_replicate" if "dp_replicate" in names else None,
        ))

    def grad_shard_groups(self, param: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
        """The groups of the axes on which ``param`` (hence its gradient) is ``V``, in mesh order."""
        mesh = self.forward_mesh
        if mesh is None:
            return ()
        by_axis = {st.MeshAxis.of(group(mesh, a)): group(mesh, a) for a in self._live()}
        types = st.get_local_type(param) if has_local_type(param) else {}
        return tuple(by_axis[a] for a, t in types.items() if t is V and a in by_axis)

    def _sync_tp_grads(self, param: torch.Tensor) -> None:
        """Without FSDP: sum, over ``tp``, the gradient of a parameter replicated on ``tp``.

        Its gradient is ``P@tp`` (each TP rank holds the contribution of its sequence
        or vocab shard); FSDP does this itself when it is applied. Once per tensor. Each
        backward's contribution is reduced before it is accumulated into ``.grad``, so
        gradient accumulation over microbatches sums each contribution once.
        """
        mesh = self.forward_mesh
        if (self.parallel_dims.dp_cp_enabled or not active(mesh, "tp") or not param.requires_grad
                or getattr(param, _TP_GRAD_HOOKED, False)):
            return
        assert mesh is not None
        tp = group(mesh, "tp")
        if st.get_local_type(param).get(st.MeshAxis.of(tp), R) is not R:
            return

        def hook(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=tp)
            return grad

        param.register_hook(hook)
        setattr(param, _TP_GRAD_HOOKED, True)

    # ------------------------------------------------------------------ expert parallelism
    def _sparse_storage(self) -> tuple[DeviceMesh, Any]:
        """The experts' FSDP storage mesh ``(dp_replicate, efsdp, ep)`` (``dp_replicate`` when active;
        ``efsdp`` always: it spans the ranks of ``ep`` times its size) and its ``DataParallelMeshDims``."""
        from torch.distributed.fsdp import DataParallelMeshDims  # torch >= 2.13 (checked at setup)

        pd = self.parallel_dims
        names = ["dp_replicate", "efsdp", "ep"] if pd.dp_replicate_enabled else ["efsdp", "ep"]
        mesh = pd.get_mesh(names)
        return mesh, DataParallelMeshDims(shard="efsdp", replicate="dp_replicate" if pd.dp_replicate_enabled else None)

    def distribute_experts(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's experts as a plain tensor typed ``S(0)`` on ``ep`` and ``R`` on the expert
        data-parallel axes (what FSDP's storage wants; the MoE body reads them in a local region)."""
        mesh, _ = self._sparse_storage()
        layout = SpmdLayout({"ep": st.S(0)})
        value = as_parameter_like(tensor, distribute_tensor(tensor, mesh, layout))
        annotate(value, *state_type(layout, mesh))
        return value

    def expert_exchange(self, group: dist.ProcessGroup) -> ExpertExchange:
        """:class:`TypedExpertExchange`: the expert side typed on ``(dp_replicate, efsdp, ep)``."""
        pd = self.parallel_dims
        mesh, _ = self._sparse_storage()
        sparse = [mesh.get_group(n) for n in mesh.mesh_dim_names or () if pd.axis_size(n) > 1]
        dense = self._mesh()
        from .mesh_context import group as axis_group  # (``group`` is the argument here)

        home = [axis_group(dense, a) for a in (*_LOSS_AXES, "tp") if active(dense, a)]  # the axes the tokens are on
        split = axis_group(dense, "tp") if active(dense, "tp") else None
        return TypedExpertExchange(group, home, sparse, mesh, split)

    def expert_fsdp_spec(self) -> FsdpSpec | None:
        if not self.parallel_dims.ep_enabled:
            return None
        mesh, dims = self._sparse_storage()
        return FsdpSpec(mesh=mesh, dp_mesh_dims=dims)

    # ------------------------------------------------------------------ state
    def materialize(self, model: nn.Module, states: Mapping[str, StateLayout],
                    device: torch.device | str) -> None:
        """``to_empty`` replaces parameters and buffers: type them again and re-hook the gradients."""
        super().materialize(model, states, device)
        self.reannotate(model, states)

    def reannotate(self, model: nn.Module, states: Mapping[str, StateLayout]) -> int:
        """Type again every plain state of ``model`` whose annotation is gone (``to_empty()``
        and re-initialisation replace tensors); returns how many.

        FSDP's DTensor storage is skipped: FSDP restores the types of what it gathers.
        """
        if self.forward_mesh is None:
            return 0
        count = 0
        for fqn, state in states.items():
            module, name = resolve_state(model, fqn)
            t = module._parameters[name] if name in module._parameters else module._buffers.get(name)
            if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                continue
            if not has_local_type(t):
                annotate(t, *state_type(state.layout, self.forward_mesh))
                count += 1
            if isinstance(t, nn.Parameter):
                self._sync_tp_grads(t)
        return count

    def to_dtensor(self, tensor: torch.Tensor, state: StateLayout) -> torch.Tensor:
        if isinstance(tensor, DTensor) or self.forward_mesh is None:
            return tensor
        mesh = self.forward_mesh
        placements = state.layout.placements(mesh.mesh_dim_names or ())
        return DTensor.from_local(tensor, mesh, placements, run_check=False, shape=state.global_shape,
                                  stride=torch.empty(state.global_shape, device="meta").stride())

    # ------------------------------------------------------------------ train step
    @classmethod
    def train_context(cls, forward_mesh: DeviceMesh | None, *, loss_parallel: bool,
                      typechecking: bool) -> AbstractContextManager[None]:
        # Loss parallelism is the plan's (vocab-sharded logits); nothing to enter here.
        return spmd_train_context(forward_mesh, typechecking)


REPRESENTATION = SpmdTypesRepresentation

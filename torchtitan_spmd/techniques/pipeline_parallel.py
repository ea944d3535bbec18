"""Technique: pipeline parallelism with torch's pipelining (``torch.distributed.pipelining``).

As upstream's ``pipeline_llm`` (torchtitan ``distributed/pipeline_parallel.py`` at a0c831c49):

- the model, built on the meta device, is split by module names: ``module_fqns_per_model_part``,
  or upstream's rule (:func:`generate_llm_fqn_per_model_part`: the layers spread evenly over
  the stages, the embedding counting ``pipeline_parallel_first_stage_less_layers`` layers on
  the first stage and ``norm`` + ``output`` ``pipeline_parallel_last_stage_less_layers`` on the
  last). A part keeps the model's class and FQNs: the modules it does not hold are ``None``
  (``tok_embeddings``, ``norm``, ``output``) or removed from ``layers``, so checkpoints have
  the model's keys whatever the split;
- each part is then parallelized by the same plan and techniques as a whole model (the plan
  restricted to the modules the part holds), FSDP with ``reshard_after_forward=False``;
- ``pp`` is the outermost mesh axis (:class:`~torchtitan_spmd.distributed.parallel_dims.ParallelDims`);
  the stage is a ``PipelineStage`` on the ``pp`` group and the schedule torch's
  (``get_schedule_class``), built with ``scale_grads=False``: the loss of every microbatch
  is already its share of the global mean (:mod:`.loss`).

Training semantics: every stage reads the same rows as without PP (the data-parallel rank
does not depend on the stage), the loss is computed on the last stage, and
:meth:`PipelineParallel.global_loss` / the ``stage_group`` of :func:`~.grad_norm.clip_grad_norm_`
sum the loss and the squared gradient norm over ``pp`` too, so every rank logs the true global
values. Gradient accumulation runs the schedule once per iteration's rows (:func:`pipeline_rows`:
June's ``training.local_batch_size`` split by ``pipeline_parallel_microbatch_size``, or upstream
b5bcd76's ``num_pp_microbatches`` microbatches of ``num_tokens_per_microbatch_per_dp_rank`` each).
Validation runs the same schedule forward only (torch's ``eval``, :meth:`PipelineParallel.evaluate`),
its token-weighted loss agreed as the training loss is.

Built: every schedule of ``get_schedule_class`` (measured on gloo) under every backend whose
registry record says ``pipeline_parallel``. Under a multi-stage schedule a rank's stages are views
of its one part (:func:`stage_view`), each an FSDP root. ``pipeline_parallel_schedule_csv`` runs
a CSV of actions with torch's ``_PipelineScheduleRuntime`` (:func:`csv_schedule`), the stages
sized and placed by ``pipeline_parallel_schedule`` as upstream.

Stage boundaries (:class:`StageBoundaries`): torch's pipelining only ever sends, receives and
splits plain local tensors; each stage's forward takes what it receives into the backend's form
with the layout the plan declares for it (``ShardingPlan.stage_boundary``) and returns its local
value (copied where it is a view: the split-backward schedules detach it in place). With ``debug.spmd_typechecking`` each stage's forward (and the loss) is type-checked on
its own, its inputs typed from those layouts.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_spmd.config.activation_checkpoint import ac_section
from torchtitan_spmd.distributed.apply_plan import plain_fqn
from torchtitan_spmd.distributed.plan import ShardingPlan, boundary_dst, fqn_matches

if TYPE_CHECKING:
    from torchtitan_spmd.distributed.layout import SpmdLayout
    from torchtitan_spmd.distributed.representation import TensorRepresentation

__all__ = [
    "PipelineStages",
    "model_part_names",
    "BUILT_SCHEDULES",
    "CSV_BASE_SCHEDULES",
    "PipelineParallel",
    "StageBoundaries",
    "csv_schedule",
    "generate_llm_fqn_per_model_part",
    "pipeline_rows",
    "split_module",
]

logger = logging.getLogger("torchtitan_spmd")

#: The schedules that run a block's backward in two passes (input, then weight gradients):
#: torch's selective activation checkpointing allows one backward a region ("Trying to
#: backward an extra time", measured), so they are a setup error with it.
SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

#: The schedules this runtime runs: every concrete schedule of torch's ``get_schedule_class``
#: (each measured on gloo against the reference, tests/layer3_runtime/test_pipeline_parallel.py).
BUILT_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                    "ZBVZeroBubble", "DualPipeV")
#: The model's input and output modules (upstream names the output ``lm_head``; ours is ``output``).
INPUT_MODULES: tuple[str, ...] = ("tok_embeddings",)
OUTPUT_MODULES: tuple[str, ...] = ("norm", "output")


def _schedule_class_or_none(name: str) -> type | None:
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        return get_schedule_class(name)
    except ValueError:
        return None


#: With ``pipeline_parallel_schedule_csv``, upstream's names for "one stage a rank" and "several
#: (loop placement)": torch's abstract schedule classes, which only size and place the stages.
CSV_BASE_SCHEDULES: tuple[str, ...] = ("PipelineScheduleSingle", "PipelineScheduleMulti")


def _csv_path(csv: str | None) -> str:
    """``pipeline_parallel_schedule_csv`` checked at setup: "" (or None) for none, else an existing file."""
    if not csv:
        return ""
    if not os.path.isfile(csv):
        raise ValueError(f"parallelism.pipeline_parallel_schedule_csv={csv!r}: no such file.")
    return csv


def _csv_base_schedule(schedule_class: type | None) -> str | None:
    """The name of an abstract schedule class that a CSV schedule may run on (None otherwise)."""
    return next((n for n in CSV_BASE_SCHEDULES if schedule_class is not None
                 and _schedule_class_or_none(n) is schedule_class), None)


def _csv_splits_backward(path: str) -> bool:
    """Whether the CSV at ``path`` has input/weight backward actions (``I``, ``W``); what does not
    parse counts as not (:func:`csv_schedule` reports it)."""
    import csv

    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, _Action

    with open(path, newline="") as f:
        cells = [cell for row in csv.reader(f) for cell in row]
    for cell in cells:
        try:
            action = _Action.from_str(cell)
        except RuntimeError:
            continue
        if action is not None and action.computation_type in (BACKWARD_INPUT, BACKWARD_WEIGHT):
            return True
    return False


def csv_schedule(path: str, stages: Sequence[Any], n_microbatches: int, loss_fn: Callable[..., torch.Tensor], *,
                 placement: Mapping[int, int], num_stages: int) -> Any:
    """Torch's ``_PipelineScheduleRuntime`` over ``stages`` running the actions of the CSV at ``path``.

    As upstream (``_build_pipeline_schedule``): torch's ``_load_csv`` reads one row per pp rank
    of compute actions (``0F1``: stage 0 forward of microbatch 1; ``B`` full backward, ``I`` /
    ``W`` input / weight backward), validates them and adds the sends, receives and FSDP
    actions. At setup, each a ``ValueError`` naming the field and the file: what torch's
    validation and lowering reject (an unparsable action, a row count other than the pp
    degree, a stage or microbatch count other than this run's, a backward before its forward,
    an order whose sends and receives deadlock), and a stage the file places on another rank
    than ``pipeline_parallel_schedule`` does (``placement``: stage -> pp rank), which would
    otherwise hang or fail in the first step.
    """
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    field = f"parallelism.pipeline_parallel_schedule_csv={path!r}"
    pp = len(set(placement.values()))
    what = f"{num_stages} stages on pipeline_parallel_degree={pp} ranks, {n_microbatches} microbatches"
    schedule = _PipelineScheduleRuntime(list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn,
                                        scale_grads=False)
    try:
        schedule._load_csv(path)
    except (AssertionError, RuntimeError, KeyError, IndexError, ValueError) as err:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, KeyError):
            detail = f"stage {err} does not exist"
        raise ValueError(f"{field}: not a schedule of this run ({what}): {detail}") from None
    got = dict(schedule.stage_index_to_group_rank)
    wrong = {s: r for s, r in sorted(got.items()) if placement.get(s) != r}
    if wrong:
        s, r = next(iter(wrong.items()))
        raise ValueError(f"{field}: places stage {s} on pp rank {r}, but this run's stages are placed "
                         f"{dict(sorted(placement.items()))} (stage: pp rank; set by "
                         f"parallelism.pipeline_parallel_schedule).")
    return schedule


def generate_llm_fqn_per_model_part(num_stages: int, num_layers: int, input_weight: int = 1,
                                    output_weight: int = 1) -> list[list[str]]:
    """Module names of each of ``num_stages`` parts of a decoder of ``num_layers`` layers (upstream's rule).

    The embedding counts as ``input_weight`` layers on the first part, ``norm`` + ``output``
    as ``output_weight`` on the last; the ``num_layers + input_weight + output_weight``
    effective layers are spread evenly, the first parts taking one more where they do not
    divide. ``ValueError`` (naming the numbers) when a part would be empty or a weight
    exceeds the layers of a part.
    """
    if num_stages < 1:
        raise ValueError(f"pipeline parallelism: the number of stages must be >= 1, got {num_stages}.")
    layers = [f"layers.{i}" for i in range(num_layers)]
    if num_stages == 1:
        return [[*INPUT_MODULES, *layers, *OUTPUT_MODULES]]
    effective = num_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, num_stages)
    numbers = (f"{num_stages} stages, {num_layers} layers, pipeline_parallel_first_stage_less_layers="
               f"{input_weight}, pipeline_parallel_last_stage_less_layers={output_weight}")
    if per_stage == 0:
        raise ValueError(f"pipeline parallelism: {numbers}: {effective} effective layers leave a stage empty; "
                         "use fewer stages or less layers' weight on the first/last stage.")
    for name, weight in (("pipeline_parallel_first_stage_less_layers", input_weight),
                         ("pipeline_parallel_last_stage_less_layers", output_weight)):
        if weight > per_stage:
            raise ValueError(f"pipeline parallelism: {name}={weight} exceeds the {per_stage} effective layers "
                             f"of a stage ({numbers}).")
    parts: list[list[str]] = []
    it = iter(layers)
    for stage in range(num_stages):
        count = per_stage + (1 if stage < extra else 0)
        part: list[str] = []
        if stage == 0:
            part.extend(INPUT_MODULES)
            count -= input_weight
        elif stage == num_stages - 1:
            count -= output_weight
        part.extend(name for _, name in zip(range(count), it, strict=False))
        if stage == num_stages - 1:
            part.extend(OUTPUT_MODULES)
        parts.append(part)
    return parts


def split_module(model: nn.Module, module_names: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` holding only ``module_names`` (``"layers.3"`` names one entry of a
    ``ModuleDict``/``ModuleList``); other children become ``None``, other entries are removed, and
    every kept parameter keeps its FQN. Call on the meta device (the copy is free there)."""
    part = copy.deepcopy(model)
    keep = set(module_names)
    for name, child in list(part.named_children()):
        if isinstance(child, nn.ModuleDict | nn.ModuleList):
            entries = {n.split(".", 1)[1] for n in keep if n.startswith(f"{name}.")}
            if isinstance(child, nn.ModuleDict):
                for key in list(child.keys()):
                    if key not in entries:
                        del child[key]
            else:  # a ModuleList would renumber its entries: keep the FQNs with a ModuleDict
                setattr(part, name, nn.ModuleDict({str(i): m for i, m in enumerate(child) if str(i) in entries}))
        elif name not in keep:
            setattr(part, name, None)
    return part


#: nn.Module's per-instance hook tables: a stage view gets its own (FSDP installs its hooks there).
_HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
                "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


def stage_view(part: nn.Module, module_names: Sequence[str]) -> nn.Module:
    """A module of ``part``'s class that runs only ``module_names`` of ``part`` (one stage of a
    looped schedule), sharing ``part``'s submodules, parameters and buffers, with its own hooks.

    ``part`` keeps every stage's modules under their FQNs (the optimizer, checkpoints and the
    gradient norm see it); torch's pipelining runs each view as a stage. Hand-written because
    torch has no "view of a module subset": a deep copy would duplicate the parameters.
    """
    view = copy.copy(part)  # the same _parameters/_buffers tables and submodule objects
    for table in _HOOK_TABLES:
        if table in vars(part):
            setattr(view, table, type(getattr(part, table))())
    keep = set(module_names)
    modules = type(part._modules)()
    for name, child in part._modules.items():
        if isinstance(child, nn.ModuleDict):
            modules[name] = nn.ModuleDict({k: m for k, m in child.items() if f"{name}.{k}" in keep})
        else:
            modules[name] = child if name in keep else None
    view._modules = modules
    return view


def states_of(module: nn.Module, states: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``states`` (by FQN, wrappers' names left out) that ``module`` holds."""
    names = {plain_fqn(n) for n, _ in [*module.named_parameters(), *module.named_buffers()]}
    return {k: v for k, v in states.items() if k in names}


def model_part_names(model: nn.Module) -> list[str]:
    """``model``'s top-level modules, with each entry of a ``ModuleDict``/``ModuleList`` (``layers.<i>``)."""
    known = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleDict | nn.ModuleList):
            known.extend(f"{name}.{key}" for key, _ in child.named_children())
        else:
            known.append(name)
    return known


def _check_fqns(parts: Sequence[Sequence[str]], known: Sequence[str]) -> None:
    """Every name of ``parts`` one of the model's ``known`` part names, each in exactly one part."""
    known = list(known)
    seen: dict[str, int] = {}
    for i, part in enumerate(parts):
        for name in part:
            if name not in known:
                raise ValueError(f"parallelism.module_fqns_per_model_part[{i}]: unknown module {name!r}; the "
                                 f"model's modules are {known}.")
            if name in seen:
                raise ValueError(f"parallelism.module_fqns_per_model_part: {name!r} is in parts {seen[name]} "
                                 f"and {i}; each module belongs to one part.")
            seen[name] = i
    missing = [name for name in known if name not in seen]
    if missing:
        raise ValueError(f"parallelism.module_fqns_per_model_part: modules {missing} are in no part.")


def part_plan(plan: ShardingPlan, part: nn.Module) -> ShardingPlan:
    """``plan`` restricted to the patterns that match a module ``part`` holds."""
    names = [fqn for fqn, _ in part.named_modules()]
    return replace(plan, modules={pattern: mplan for pattern, mplan in plan.modules.items()
                                  if any(fqn_matches(pattern, fqn) for fqn in names)})


class _StepLoss:
    """The schedule's ``loss_fn(output, target)``: this microbatch's share of the global mean.

    ``token_count`` (the global batch's label count) is set before each schedule step.
    ``boundaries``: the last stage's local logits and the microbatch's local labels enter
    the loss in the backend's form, in the stage's (checked) context.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], boundaries: StageBoundaries | None = None,
                 **kwargs: Any) -> None:
        self.loss_fn, self.kwargs, self.boundaries = loss_fn, kwargs, boundaries
        self.token_count: torch.Tensor | None = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.boundaries is None:
            return self.loss_fn(output, target, token_count=self.token_count, **self.kwargs)
        with self.boundaries.context():
            output, target = self.boundaries.loss_inputs(output, target)
            return self.loss_fn(output, target, token_count=self.token_count, **self.kwargs)


# ----------------------------------------------------------------------------- stage boundaries
def _not_a_view(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied where it is a view of another tensor (a DTensor's ``to_local`` is one).

    A schedule that splits the backward in two (``I`` then ``W`` actions: InterleavedZeroBubble,
    ZBVZeroBubble, DualPipeV, or a CSV with them) frees each stage output's graph after the
    input backward with ``Tensor.detach_()`` (torch's ``stage_backward_input``), which autograd
    refuses on a view ("Can't detach views in-place"). A copy is not a view; it costs one
    activation copy a microbatch, and nothing where the output is already its own tensor."""
    return x.clone() if x._is_view() else x


@dataclass
class StageBoundaries:
    """How each stage's forward meets torch's pipelining under one representation.

    torch's pipelining sends, receives and splits plain local tensors only: every stage's
    forward returns ``representation.to_local`` of its output (what is sent), and takes what
    it is given -- the previous stage's activation, or on the first stage this microbatch's
    tokens -- as ``representation.from_local(x, layout)`` with the layout the plan declares:
    ``plan.stage_boundary`` for an activation, the input layouts (:mod:`.inputs`) for the
    tokens, labels and positions, the plan's output layout for the logits (a returned view is
    copied, see :func:`_not_a_view`). A ``full_dtensor``
    stage thus receives the DTensor its first module expects (the plan, not metadata sent
    along with the tensor, decides its placements: upstream's ``get_mesh`` callback is not
    needed), an ``spmd_types`` stage a tensor typed as the plan says, and a ``default`` stage
    the local tensor as it is.

    ``checked``: the type-checked train context (``debug.spmd_typechecking``), or None. Each
    stage's forward, and the loss on the last stage, run in it on their own (inputs typed
    at the boundary, then every op checked); the schedule's sends, receives, microbatch
    splits and backward run outside it.
    """

    representation: TensorRepresentation
    #: The activation between stages (``ShardingPlan.stage_boundary``).
    activation: SpmdLayout
    tokens: SpmdLayout
    labels: SpmdLayout
    logits: SpmdLayout | None
    #: Keyword inputs every stage receives, split by the schedule like the tokens (``positions``).
    kwargs: Mapping[str, SpmdLayout] = field(default_factory=dict)
    checked: Callable[[], AbstractContextManager[None]] | None = None

    @classmethod
    def from_plan(cls, plan: ShardingPlan, representation: TensorRepresentation, *,
                  checked: Callable[[], AbstractContextManager[None]] | None = None) -> StageBoundaries:
        """The boundaries ``plan`` declares; ``ValueError`` (at setup) where it declares none, or
        one that is not what its input module (``tok_embeddings``) produces."""
        from torchtitan_spmd.distributed.inputs import LABELS, POSITIONS, TOKENS

        layout = plan.stage_boundary
        if layout is None:
            raise ValueError("pipeline parallelism: the sharding plan declares no stage_boundary (the layout of "
                             "the activation between pipeline stages); set ShardingPlan.stage_boundary.")
        produced = [boundary_dst(plan.modules[m].output) for m in INPUT_MODULES if m in plan.modules]
        if any(p is not None and p != layout for p in produced):
            raise ValueError(f"pipeline parallelism: the sharding plan's stage_boundary {layout} is not the "
                             f"layout {INPUT_MODULES[0]} outputs ({produced[0]}); fix the plan.")
        return cls(representation, layout, TOKENS, LABELS, plan.output_layout(), {"positions": POSITIONS},
                   checked)

    def context(self) -> AbstractContextManager[None]:
        """The context a stage's forward and the loss run in (the checked one, or none)."""
        return self.checked() if self.checked is not None else nullcontext()

    def install(self, module: nn.Module, *, first: bool) -> None:
        """Hook one stage's module as described above: a pre-hook ahead of every other (FSDP's
        root included) enters :meth:`context` and takes the inputs into the backend's form, a
        hook after every other returns the local output and leaves the context (``always_call``:
        on errors too). FSDP must see the typed inputs and gather the parameters inside the
        checker (it types what it gathers only then); wrapping the module instead would hide
        the FSDP module from torch's pipelining."""
        rep = self.representation
        layout = self.tokens if first else self.activation
        open_contexts: list[contextlib.ExitStack] = []

        def enter(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
            stack = contextlib.ExitStack()
            stack.enter_context(self.context())
            open_contexts.append(stack)
            x, *rest = args
            kwargs = {k: rep.from_local(v, self.kwargs[k]) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}
            return (rep.from_local(x, layout), *rest), kwargs

        def leave(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if open_contexts:
                open_contexts.pop().close()
            return _not_a_view(rep.to_local(output)) if isinstance(output, torch.Tensor) else output

        module.register_forward_pre_hook(enter, prepend=True, with_kwargs=True)
        module.register_forward_hook(leave, always_call=True)

    def loss_inputs(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's local logits and the local labels in the backend's form."""
        rep = self.representation
        if self.logits is not None:
            logits = rep.from_local(logits, self.logits)
        return logits, rep.from_local(labels, self.labels)

    def to_local(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """What the schedule is given: this rank's local value of a batch tensor."""
        return None if x is None else self.representation.to_local(x)


@dataclass(frozen=True)
class PipelineStages:
    """The validated pipeline of a config, the same on every rank: how many stages, which
    modules each holds, the schedule and the microbatches. Built by :meth:`from_config`
    before any mesh; :meth:`PipelineParallel.from_stages` binds it to this rank's ``pp`` rank."""

    schedule_name: str
    num_stages: int
    pp: int
    #: Whether the schedule places stages in a V (``ZBVZeroBubble``, ``DualPipeV``): 2 a rank.
    v_shaped: bool
    #: The module names of every stage, in stage order.
    parts: tuple[tuple[str, ...], ...]
    n_microbatches: int
    schedule_csv: str = ""
    #: Sequences of one schedule iteration on one data-parallel rank (:func:`pipeline_rows`).
    local_rows: int = 1
    #: Upstream b5bcd76's pipeline microbatches of ``training.local_batch_size`` sequences in one
    #: iteration (``parallelism.num_pp_microbatches``); 1 under June's spelling.
    num_pp_microbatches: int = 1

    def indices_of(self, pp_rank: int) -> list[int]:
        """The stages ``pp_rank`` holds, in order: ``pp_rank + s * pp`` for looped schedules,
        ``(pp_rank, num_stages - 1 - pp_rank)`` for the V-shaped ones."""
        if self.v_shaped:
            return [pp_rank, self.num_stages - 1 - pp_rank]
        return [pp_rank + s * self.pp for s in range(self.num_stages // self.pp)]

    @classmethod
    def from_config(cls, job_config: Any, parallel_dims: Any,
                    module_names: Sequence[str]) -> PipelineStages | None:
        """Validate the ``parallelism.pipeline_parallel_*`` fields against the model's top-level
        module names (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``: the model
        contract) and the degrees; None when ``pipeline_parallel_degree`` is 1. No mesh is
        needed. (Which backends run PP is the representation's check, from the backend registry.)
        """
        par, training = job_config.parallelism, job_config.training
        pp = parallel_dims.pp
        if pp <= 1:
            return None
        csv = _csv_path(par.pipeline_parallel_schedule_csv)
        name = par.pipeline_parallel_schedule
        schedule_class = _schedule_class_or_none(name)  # torch's lookup ignores case
        canonical = next((n for n in BUILT_SCHEDULES if _schedule_class_or_none(n) is schedule_class), None)
        if csv and canonical is None:
            canonical = _csv_base_schedule(schedule_class)
        if schedule_class is None or canonical is None:
            what = "unknown schedule" if schedule_class is None else "not a schedule (an abstract base class)"
            choices = [*BUILT_SCHEDULES, *(CSV_BASE_SCHEDULES if csv else ())]
            raise ValueError(f"parallelism.pipeline_parallel_schedule={name!r}: {what}; valid choices are "
                             f"{choices}.")
        name = canonical
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        single = issubclass(schedule_class, PipelineScheduleSingle)
        num_layers = sum(1 for n in module_names if n.startswith("layers."))
        first, last = par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
        layers_per_stage = par.pipeline_parallel_layers_per_stage
        if par.module_fqns_per_model_part is not None:
            num_stages = len(par.module_fqns_per_model_part)
        elif layers_per_stage is not None:
            num_stages = math.ceil((num_layers + first + last) / layers_per_stage)
        else:
            num_stages = pp * (1 if single else 2)
        where = ("module_fqns_per_model_part has" if par.module_fqns_per_model_part is not None else
                 f"pipeline_parallel_layers_per_stage={layers_per_stage} with {num_layers} layers "
                 f"(+{first} first, +{last} last) gives")
        if num_stages % pp:
            raise ValueError(f"parallelism: {where} {num_stages} stages, not a multiple of "
                             f"pipeline_parallel_degree={pp}.")
        per_rank = num_stages // pp
        if single and per_rank != 1:
            raise ValueError(f"parallelism.pipeline_parallel_schedule={name!r} is a single-stage schedule (one "
                             f"stage a rank), but {where} {num_stages} stages, {per_rank} a rank at "
                             f"pipeline_parallel_degree={pp}.")
        if not single and per_rank < 2:
            raise ValueError(f"parallelism.pipeline_parallel_schedule={name!r} is a multi-stage schedule (>= 2 "
                             f"stages a rank), but {where} {num_stages} stages, {per_rank} a rank at "
                             f"pipeline_parallel_degree={pp}.")
        ac_mode = ac_section(job_config.activation_checkpoint).mode
        if csv and ac_mode == "selective" and _csv_splits_backward(csv):
            raise ValueError(f"parallelism.pipeline_parallel_schedule_csv={csv!r} splits backwards in two (I and W "
                             f"actions), which activation_checkpoint.mode='selective' cannot run; use mode 'full' or "
                             f"'none', or full backwards (B).")
        if name in SPLIT_BACKWARD_SCHEDULES and ac_mode == "selective" and not csv:
            raise ValueError(f"parallelism.pipeline_parallel_schedule={name!r} splits each backward in two, which "
                             f"activation_checkpoint.mode='selective' cannot run; use mode 'full' or 'none', or a "
                             f"schedule of {[n for n in BUILT_SCHEDULES if n not in SPLIT_BACKWARD_SCHEDULES]}.")
        parts = par.module_fqns_per_model_part
        if parts is None:
            parts = generate_llm_fqn_per_model_part(num_stages, num_layers, first, last)
        _check_fqns(parts, module_names)
        rows, mb = pipeline_rows(par, training)
        from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

        v_shaped = issubclass(schedule_class, ScheduleZBVZeroBubble | ScheduleDualPipeV)
        if v_shaped and per_rank != 2:  # V-shaped: 2 stages a rank
            raise ValueError(f"parallelism.pipeline_parallel_schedule={name!r} places 2 stages a rank, but "
                             f"{where} {num_stages} stages, {per_rank} a rank at pipeline_parallel_degree={pp}.")
        return cls(schedule_name=name, num_stages=num_stages, pp=pp, v_shaped=v_shaped,
                   parts=tuple(tuple(p) for p in parts), n_microbatches=rows // mb,
                   schedule_csv=csv, local_rows=rows, num_pp_microbatches=rows // training.local_batch_size)


def pipeline_rows(parallelism: Any, training: Any) -> tuple[int, int]:
    """Under pipeline parallelism: the sequences of one schedule iteration (one gradient-accumulation
    microbatch) on one data-parallel rank, and the sequences of one pipeline microbatch.

    - June's spelling (``parallelism.num_pp_microbatches`` None, a0c831c49): ``training.local_batch_size``
      sequences an iteration, in microbatches of ``pipeline_parallel_microbatch_size``;
    - upstream b5bcd76's (#3856, #4121; ``num_pp_microbatches`` M, an int, ``1`` by default under the
      ``august`` surface): M microbatches an iteration, each
      ``training.num_tokens_per_microbatch_per_dp_rank`` tokens (``local_batch_size`` sequences), so
      ``M * local_batch_size`` sequences an iteration. ``pipeline_parallel_microbatch_size`` (June's
      field, which August removed) left at 1 keeps upstream's microbatch; above 1 it splits each of
      them further (the same tokens and losses, more schedule microbatches).

    Raises ``ValueError`` naming the fields when a microbatch is not a whole number of sequences.
    """
    local, mb = training.local_batch_size, parallelism.pipeline_parallel_microbatch_size
    m = parallelism.num_pp_microbatches
    if m is None:
        if local % mb:
            raise ValueError(f"parallelism.pipeline_parallel_microbatch_size={mb} does not divide "
                             f"training.local_batch_size={local}.")
        return local, mb
    if mb > 1 and local % mb:
        raise ValueError(f"parallelism.pipeline_parallel_microbatch_size={mb} does not divide the "
                         f"{local} sequences of a pipeline microbatch (parallelism.num_pp_microbatches={m} "
                         f"microbatches of training.num_tokens_per_microbatch_per_dp_rank="
                         f"{training.num_tokens_per_microbatch_per_dp_rank} tokens each); leave it at 1.")
    return m * local, mb if mb > 1 else local


@dataclass
class PipelineParallel:
    """This rank's pipeline: its stage, its part of the model and the schedule (see the module docstring).

    Build with :meth:`from_config` (None without PP), then :meth:`split` the meta model,
    parallelize the part, and :meth:`build_schedule`; :meth:`forward_backward` runs one
    local batch through the schedule, :meth:`evaluate` the same forward only (validation).
    """

    schedule_name: str
    num_stages: int
    #: This rank's stages (one for single-stage schedules; ``pp_rank + s * pp`` for looped
    #: ones, ``(pp_rank, num_stages - 1 - pp_rank)`` for the V-shaped ones), in order.
    stage_indices: list[int]
    #: The module names of each of this rank's stages.
    module_names: list[list[str]]
    n_microbatches: int
    group: dist.ProcessGroup
    #: Sequences of one pipeline microbatch (:func:`pipeline_rows`).
    microbatch_rows: int = 1
    schedule: Any = None
    loss: _StepLoss | None = None
    #: ``pipeline_parallel_schedule_csv``: the schedule's actions from this file (torch's
    #: ``_PipelineScheduleRuntime``), "" for the schedule class of ``schedule_name``.
    schedule_csv: str = ""
    #: The global ranks that hold this rank's stages (this rank among them), for the one start-up
    #: line per stage group; empty: this rank alone.
    stage_ranks: list[int] = field(default_factory=list)
    #: The model's state-dict keys the other stages hold (set by :meth:`split`).
    other_stage_keys: frozenset[str] = frozenset()
    #: How the stages meet the schedule (set by :meth:`build_schedule`).
    boundaries: StageBoundaries | None = None
    _views: list[nn.Module] | None = None

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (it reads the tokens)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss)."""
        return self.num_stages - 1 in self.stage_indices

    @classmethod
    def from_stages(cls, stages: PipelineStages | None, parallel_dims: Any) -> PipelineParallel | None:
        """This rank's pipeline from the validated ``stages`` (None without PP): its stage
        indices from its ``pp`` rank. ``parallel_dims`` must have built its meshes."""
        if stages is None:
            return None
        pp_mesh = parallel_dims.get_mesh("pp")
        indices = stages.indices_of(pp_mesh.get_local_rank())
        world = parallel_dims.world_mesh  # pp is its outermost axis: the ranks of one pp rank
        same = world.mesh[pp_mesh.get_local_rank()].flatten().tolist() if world.mesh.dim() else []
        return cls(schedule_name=stages.schedule_name, num_stages=stages.num_stages, stage_indices=indices,
                   stage_ranks=[int(r) for r in same],
                   module_names=[list(stages.parts[i]) for i in indices], n_microbatches=stages.n_microbatches,
                   group=pp_mesh.get_group(), schedule_csv=stages.schedule_csv,
                   microbatch_rows=stages.local_rows // stages.n_microbatches)

    def split(self, model: nn.Module, plan: ShardingPlan) -> tuple[nn.Module, ShardingPlan]:
        """This stage's part of ``model`` (meta) and the plan restricted to it."""
        part = split_module(model, [n for names in self.module_names for n in names])
        self.other_stage_keys = frozenset(model.state_dict()) - frozenset(part.state_dict())
        return part, part_plan(plan, part)

    def build_schedule(self, part: nn.Module, device: torch.device | str,
                       loss_fn: Callable[..., torch.Tensor], *, boundaries: StageBoundaries | None = None,
                       **loss_kwargs: Any) -> None:
        """The ``PipelineStage`` of the parallelized ``part`` and torch's schedule over it.

        ``loss_fn(output, target, token_count=..., **loss_kwargs)`` runs on the last stage.
        ``boundaries``: how each stage's forward meets the schedule (:class:`StageBoundaries`);
        None: the stages compute on what torch's pipelining hands them, as it is.
        """
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        modules = self.stage_modules(part)
        self.boundaries = boundaries
        if boundaries is not None:
            for module, index in zip(modules, self.stage_indices, strict=True):
                boundaries.install(module, first=index == 0)
        stages = [PipelineStage(m, i, self.num_stages, torch.device(device), group=self.group)
                  for m, i in zip(modules, self.stage_indices, strict=True)]
        self.loss = _StepLoss(loss_fn, boundaries, **loss_kwargs)
        if self.schedule_csv:
            self.schedule = csv_schedule(self.schedule_csv, stages, self.n_microbatches, self.loss,
                                         placement=self.placement(), num_stages=self.num_stages)
            self._log_stages(f"schedule from {self.schedule_csv}, {self.n_microbatches} microbatches a local batch")
            return
        schedule_class = get_schedule_class(self.schedule_name)
        try:
            self.schedule = schedule_class(stages[0] if len(stages) == 1 else stages,
                                           n_microbatches=self.n_microbatches, loss_fn=self.loss, scale_grads=False)
        except ValueError as err:  # torch's own checks of the schedule (e.g. DualPipeV's microbatch count)
            raise ValueError(f"parallelism.pipeline_parallel_schedule={self.schedule_name!r} with "
                             f"{self.n_microbatches} microbatches (of {self.microbatch_rows} sequences: "
                             f"parallelism.num_pp_microbatches, or training.local_batch_size / "
                             f"pipeline_parallel_microbatch_size) and {self.num_stages} stages: {err}") from None
        self._log_stages(f"schedule {self.schedule_name}, {self.n_microbatches} microbatches a local batch")

    def _log_stages(self, schedule: str) -> None:
        """One line per group of ranks holding the same stages, logged by its lowest rank, naming them all."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        ranks = self.stage_ranks or [rank]
        if rank == min(ranks):
            logger.info(f"pipeline: stages {self.stage_indices} of {self.num_stages} on rank"
                        f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} hold {self.module_names}; "
                        f"{schedule}", extra={"every_rank": True})

    def placement(self) -> dict[int, int]:
        """Every stage's pp rank: ``s % pp`` (loop placement), V-shaped schedules ``s`` for the
        first ``pp`` stages and ``2 pp - 1 - s`` for the others (upstream's)."""
        from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

        pp = self.group.size()
        v_shaped = issubclass(_schedule_class_or_none(self.schedule_name) or type, ScheduleZBVZeroBubble |
                              ScheduleDualPipeV)
        return {s: (s if s < pp else 2 * pp - 1 - s) if v_shaped else s % pp for s in range(self.num_stages)}

    def stage_modules(self, part: nn.Module) -> list[nn.Module]:
        """The module each of this rank's stages runs: ``part`` itself for one stage a rank; for
        several, one view of ``part`` per stage (:func:`stage_view`), built once (after the plan,
        activation checkpointing and compile, before FSDP: each view is an FSDP root)."""
        if len(self.stage_indices) == 1:
            return [part]
        if self._views is None:
            self._views = [stage_view(part, names) for names in self.module_names]
        return self._views

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         token_count: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run one iteration's rows (:attr:`PipelineStages.local_rows`) through the schedule.

        ``positions``: the tokens' RoPE positions (context parallelism), given to every stage.
        Returns the sum of its microbatch losses on the last stage, 0 elsewhere (no gradient).
        """
        return self._run(False, inputs, targets, token_count, positions)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 token_count: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run one local batch forward only, through the schedule's ``eval`` (torch's forward-only
        iteration of the same schedule: no backward, no gradient), the loss on the last stage.

        As :meth:`forward_backward`, each microbatch's loss is its share of the global mean
        (its per-token loss sum over ``token_count``, the validation batch's global label count),
        so their sum is token-weighted whatever each microbatch's count. Call under
        ``torch.no_grad`` with the stages in eval mode. Returns the sum on the last stage, 0
        elsewhere; :meth:`global_loss` then agrees it over ``pp``.
        """
        return self._run(True, inputs, targets, token_count, positions)

    def _run(self, forward_only: bool, inputs: torch.Tensor, targets: torch.Tensor,
             token_count: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """One schedule iteration (``step``, or ``eval`` when ``forward_only``): the summed losses."""
        assert self.loss is not None and self.schedule is not None
        self.loss.token_count = token_count
        if self.boundaries is not None:  # the schedule splits and sends plain local tensors
            inputs, targets = self.boundaries.to_local(inputs), self.boundaries.to_local(targets)
            positions = self.boundaries.to_local(positions)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        kwargs: dict[str, Any] = {"positions": positions} if positions is not None else {}
        target, out = (targets, losses) if self.is_last else (None, None)
        if forward_only:  # torch's eval takes no return_outputs (a keyword would be a model input)
            self.schedule.eval(*args, target=target, losses=out, **kwargs)
        else:
            self.schedule.step(*args, target=target, losses=out, return_outputs=False, **kwargs)
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=targets.device)
        return torch.stack([x.detach().float() for x in losses]).sum()

    def global_loss(self, loss: torch.Tensor, sum_over_batch: Callable[[torch.Tensor], torch.Tensor]) -> float:
        """The global mean loss on every rank: ``loss`` summed over the batch, then over ``pp``
        (only the last stage holds a non-zero one)."""
        total = sum_over_batch(loss.detach()).detach().clone()
        dist.all_reduce(total, group=self.group)
        return float(total)

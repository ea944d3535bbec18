"""Layer 1: ``check_supported`` — the one table of config values the trainer does not implement."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, get_args, get_origin

import pytest
from fork_helpers import FORK

from torchtitan_spmd.config import (
    ActivationCheckpointConfig,
    CommConfig,
    CompileConfig,
    ConfigManager,
    DebugConfig,
    JobConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
    check_supported,
)
from torchtitan_spmd.config.support import UNSUPPORTED, Unsupported


def other_value(section: type, name: str) -> Any:
    """A valid value of ``section.name`` other than its default (and its allowed values)."""
    tp = typing.get_type_hints(section)[name]
    row = next((r for r in UNSUPPORTED if r.section is section and r.field == name), None)
    default = row.default() if row else getattr(section(), name)
    taken = [default, *(row.also_allowed if row else ())]
    members = [m for m in get_args(tp) if m is not type(None)] if get_origin(tp) is not Literal else []
    if get_origin(tp) is Literal:
        return next(c for c in get_args(tp) if c not in taken)
    if tp is bool:
        return not default
    if default is None:
        return 2 if int in members else "x"
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2
    if isinstance(default, str):
        return default + "x"
    if isinstance(default, list):
        return [] if default else [["a"]] if "list[list" in str(tp) else ["a"]
    raise AssertionError(f"no other value for {section.__name__}.{name}: {tp}")


def test_defaults_pass_for_the_library_root_and_a_forks_root() -> None:
    check_supported(JobConfig())
    check_supported(ConfigManager().parse_args(FORK))


def test_upstream_defaults_pass() -> None:
    cfg = JobConfig()
    assert cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.activation_checkpoint.mode == "selective"
    check_supported(cfg)


def test_implemented_training_features_pass() -> None:
    cfg = JobConfig(
        training=TrainingConfig(mixed_precision_param="float32", global_batch_size=64),
        activation_checkpoint=ActivationCheckpointConfig(mode="full"),
        compile=CompileConfig(enable=True, components=["model", "loss"]),
        optimizer=OptimizerConfig(implementation="foreach"),
        debug=DebugConfig(enable_structured_logging=False, seed=3, deterministic=True),
        parallelism=ParallelismConfig(spmd_backend="spmd_types", disable_loss_parallel=True),
    )
    check_supported(cfg)
    for mode in ("none", "selective"):
        check_supported(ActivationCheckpointConfig(mode=mode))
    check_supported(OptimizerConfig(implementation="for-loop"))


@pytest.mark.parametrize("row", UNSUPPORTED, ids=lambda r: f"{r.section.__name__}.{r.field}")
def test_each_row_rejects_a_non_default_value(row: Unsupported) -> None:
    value = other_value(row.section, row.field)
    name = {cls: key for key, cls in JobConfig.section_types().items()}[row.section]
    cfg = JobConfig()
    object.__setattr__(getattr(cfg, name), row.field, value)  # past the section's own checks
    with pytest.raises(ValueError) as err:
        check_supported(cfg)
    msg = str(err.value)
    assert f"{name}.{row.field}={value!r}" in msg and row.feature in msg
    assert "not implemented by torchtitan_spmd yet" in msg and repr(row.default()) in msg
    check_supported(JobConfig())  # the table did not change state


def test_every_problem_is_listed_with_its_path_in_a_forks_root() -> None:
    cfg = ConfigManager().parse_args(
        [*FORK, "--activation_checkpoint.mode", "memory_budget", "--comm.mode", "torchcomms"]
    )
    with pytest.raises(ValueError) as err:
        check_supported(cfg)
    lines = str(err.value).splitlines()
    assert lines[0] == "unsupported config values:"
    assert lines[1:] == [
        "  activation_checkpoint.mode='memory_budget': memory-budget activation checkpointing (the "
        "compiler's min-cut recomputation) is not implemented by torchtitan_spmd yet; use 'selective', "
        "'none' or 'full'.",
        "  comm.mode='torchcomms': communication through torchcomms is not implemented by "
        "torchtitan_spmd yet; use 'default', 'fake_backend' or 'local_tensor'.",
    ]


def test_a_single_section_can_be_checked() -> None:
    # a lone section is named by its section_name, as in a whole config
    with pytest.raises(ValueError, match=r"^unsupported config values:\n  debug\.deterministic_warn_only=True"):
        check_supported(DebugConfig(deterministic_warn_only=True))
    check_supported(CommConfig())


def test_table_rows_name_real_fields_of_torchtitans_sections() -> None:
    seen = set()
    for row in UNSUPPORTED:
        assert row.field in {f.name for f in dataclasses.fields(row.section)}
        assert (row.section, row.field) not in seen, row
        seen.add((row.section, row.field))
    # spmd_backend, the degrees and the fields the runtime reads are not in the table
    names = {row.field for row in UNSUPPORTED}
    assert not names & {"spmd_backend", "tensor_parallel_degree", "seed", "steps", "mixed_precision_param",
                        "global_batch_size", "components"}


def test_every_unsupported_fields_help_says_so() -> None:
    """``--help`` of a field in :data:`UNSUPPORTED` says that the trainer refuses it: its docstring (what
    tyro prints) contains "not implemented by torchtitan_spmd", and names the refused values of a
    field that also allows some (a help text describing the feature as available was the bug)."""
    import ast
    import inspect
    import textwrap

    wrong = []
    for row in UNSUPPORTED:
        body = ast.parse(textwrap.dedent(inspect.getsource(row.section))).body[0].body  # type: ignore[attr-defined]
        doc = next(nxt.value.value for node, nxt in zip(body, body[1:], strict=False)
                   if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                   and node.target.id == row.field and isinstance(nxt, ast.Expr))
        flat = " ".join(doc.split())
        note = flat.lower().partition("not implemented by torchtitan_spmd")[2]
        if not note:
            wrong.append(f"{row.section.__name__}.{row.field}: the help does not say it is not implemented")
            continue
        allowed = {row.default(), *row.also_allowed}
        refused = [v for v in get_args(typing.get_type_hints(row.section)[row.field]) if v not in allowed]
        if row.also_allowed and not all(f'"{v}"' in note for v in refused):
            wrong.append(f"{row.section.__name__}.{row.field}: the note does not name {refused}")
    assert not wrong, "\n".join(wrong)

"""Layer 1: a fork at upstream's June surface (a0c831c49) and one at its August surface (b5bcd76).

Each backend spelling of every generation read back as written, with the warnings upstream's
history calls for; each surface's default; b5bcd76's config fields with upstream's types and
defaults; the token budgets as one setting with the batch fields; an August fork fixture
(``fork_fixture/acme_august``) beside the June one (``acme_titan``). Expected values come from
upstream's sources at those commits, written out here.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from collections.abc import Iterator
from typing import Literal

import pytest

from torchtitan_spmd.compat.legacy import LegacySpellingWarning
from torchtitan_spmd.config import (
    ActivationCheckpointConfig,
    CompileConfig,
    JobConfig,
    ParallelismConfig,
    TrainingConfig,
    check_supported,
)
from torchtitan_spmd.config.surface import (
    ENV_VAR,
    UpstreamRemovedWarning,
    UpstreamRenamedWarning,
    get_surface,
    set_surface,
)


@pytest.fixture
def surface(monkeypatch: pytest.MonkeyPatch) -> Iterator[typing.Callable[[str], None]]:
    """``surface("june" | "august")`` for one test; the environment's surface again afterwards."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    yield set_surface
    set_surface(None)


# ------------------------------------------------------------------ spellings and defaults
#: (surface, spelling, warning category or None): upstream's history written out.
SPELLINGS = [
    ("june", "default", None),
    ("june", "full_dtensor", None),
    ("june", "spmd_types", None),
    ("june", "partial_dtensor", None),  # a newer spelling, accepted quietly
    ("august", "partial_dtensor", None),
    ("august", "spmd_types", None),
    ("august", "default", UpstreamRenamedWarning),  # #4085
    ("august", "full_dtensor", UpstreamRemovedWarning),  # #4217
]


@pytest.mark.parametrize(("name", "spelling", "category"), SPELLINGS)
def test_each_spelling_reads_back_as_written(surface, name: str, spelling: str, category) -> None:
    surface(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = ParallelismConfig(spmd_backend=spelling)  # type: ignore[arg-type]
    assert p.spmd_backend == spelling
    assert p.backend_name == ("default" if spelling == "partial_dtensor" else spelling)
    got = [w.category for w in caught if issubclass(w.category, DeprecationWarning)]
    assert got == ([category] if category else [])
    if category is UpstreamRemovedWarning:
        assert "#4217" in str(caught[0].message) and "extension" in str(caught[0].message)
    if category is not None:
        assert caught[0].filename == __file__  # blamed on the fork's line


@pytest.mark.parametrize(("name", "spelling"), [("june", "partial_dtensor"), ("august", "default")])
def test_assignment_reads_back_as_written(surface, name: str, spelling: str) -> None:
    surface(name)
    p = ParallelismConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p.spmd_backend = spelling  # type: ignore[assignment]
    assert p.spmd_backend == spelling
    assert JobConfig(parallelism=p).parallelism.spmd_backend == spelling  # validate keeps it


@pytest.mark.parametrize(("name", "default"), [("june", "default"), ("august", "spmd_types")])
def test_default_follows_the_surface(surface, name: str, default: str) -> None:
    surface(name)
    assert ParallelismConfig().spmd_backend == default
    assert JobConfig().parallelism.spmd_backend == default


@pytest.mark.parametrize(("env", "default"), [("june", "default"), ("august", "spmd_types"), ("", "default")])
def test_surface_from_the_environment(monkeypatch: pytest.MonkeyPatch, env: str, default: str) -> None:
    monkeypatch.setenv(ENV_VAR, env)
    set_surface(None)
    try:
        assert ParallelismConfig().spmd_backend == default
    finally:
        monkeypatch.delenv(ENV_VAR)
        set_surface(None)


def test_bad_surface_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="set_surface: invalid surface 'agust'.*Did you mean 'august'"):
        set_surface("agust")
    monkeypatch.setenv(ENV_VAR, "july")
    set_surface(None)
    try:
        with pytest.raises(ValueError, match=f"{ENV_VAR}='july': invalid surface"):
            ParallelismConfig()
    finally:
        monkeypatch.delenv(ENV_VAR)
        set_surface(None)
    assert get_surface().name == "june"


@pytest.mark.parametrize("name", ["june", "august"])
def test_legacy_bool_still_warns_on_both_surfaces(surface, name: str) -> None:
    surface(name)
    with pytest.warns(LegacySpellingWarning, match="full_dtensor"):
        p = ParallelismConfig(full_dtensor=False)  # type: ignore[call-arg]
    # the same backend, spelled in the fork's surface
    assert p.spmd_backend == {"june": "default", "august": "partial_dtensor"}[name]
    assert p.backend_name == "default"


# ------------------------------------------------------------------ b5bcd76's fields
#: b5bcd76's fields of its sections that a0c831c49 did not have: (name, type, default).
AUGUST_FIELDS = {
    TrainingConfig: [
        ("num_tokens_per_microbatch_per_dp_rank", 16384),
        ("num_tokens_per_train_step", -1),
        ("max_context_length", 2048),
        ("disable_cuda_graphs", False),
    ],
    ParallelismConfig: [("context_parallel_ptrr_mask_key", None)],
    CompileConfig: [("enable_async_tensor_parallel", False)],
}


@pytest.mark.parametrize("cls", list(AUGUST_FIELDS), ids=lambda c: c.__name__)
def test_august_fields_and_defaults(cls: type) -> None:
    instance = cls()
    names = {f.name for f in dataclasses.fields(cls)}
    for name, default in AUGUST_FIELDS[cls]:
        assert name in names
        assert getattr(instance, name) == default
    check_supported(instance)  # the defaults run


def test_august_backend_literal_and_default(surface) -> None:
    surface("august")
    hints = typing.get_type_hints(ParallelismConfig)
    assert set(typing.get_args(Literal["partial_dtensor", "spmd_types"])) <= set(typing.get_args(hints["spmd_backend"]))
    assert ParallelismConfig().spmd_backend == "spmd_types"


@pytest.mark.parametrize("spelling", ["partial_dtensor", "spmd_types"])
def test_upstreams_own_tyro_parse_takes_august_spellings(surface, spelling: str) -> None:
    """An August fork parses with upstream's ``ConfigManager``: plain tyro, none of this library's rules.

    (Found running b5bcd76's trainer on this library: tyro read the choices from the field's
    ``Literal`` and rejected ``--parallelism.spmd_backend partial_dtensor``.)
    """
    import tyro

    surface("august")
    plain = tyro.constructors.ConstructorRegistry()
    parsed = tyro.cli(ParallelismConfig, args=["--spmd_backend", spelling], registry=plain)
    assert parsed.spmd_backend == spelling
    assert tyro.cli(ParallelismConfig, args=[], registry=plain).spmd_backend == "spmd_types"


@pytest.mark.parametrize(("field", "value", "feature"), [
    ("disable_cuda_graphs", True, "CUDA graphs"),
])
def test_unimplemented_august_fields_are_setup_errors(field: str, value: object, feature: str) -> None:
    with pytest.raises(ValueError, match=f"training.{field}.*{feature}"):
        check_supported(JobConfig(training=TrainingConfig(**{field: value})))
    # August's async TP field is implemented (issue 41): the trainer's set-up decides (CUDA only,
    # a dry run accepts it; tests/layer3_runtime/test_async_tp.py), not the table of refusals.
    check_supported(JobConfig(compile=CompileConfig(enable=True, components=["model"],
                                                    enable_async_tensor_parallel=True)))


@pytest.mark.parametrize("fields", [{}, {"enable": True, "components": ["loss"]}, {"components": ["model"]}])
def test_async_tp_requires_model_compile_as_upstream(fields: dict[str, object]) -> None:
    """b5bcd76's ``CompileConfig.__post_init__`` (#4045): its words, then the fields as given."""
    with pytest.raises(ValueError, match=r"^Async TP requires 'model' in --compile.components and "
                                         r"--compile.enable \(compile.enable_async_tensor_parallel=True") as err:
        CompileConfig(enable_async_tensor_parallel=True, **fields)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
    assert CompileConfig(enable=True, components=["model"], enable_async_tensor_parallel=True).enable


@pytest.mark.parametrize(("name", "default"), [("june", None), ("august", 1)])
def test_num_pp_microbatches_default_follows_the_surface(surface, name: str, default: int | None) -> None:
    """August's default is upstream's int 1 (b5bcd76's trainer does ``num_pp_microbatches <= 0``)."""
    surface(name)
    assert ParallelismConfig().num_pp_microbatches == default
    JobConfig(parallelism=ParallelismConfig(pipeline_parallel_degree=2))


@pytest.mark.parametrize("value", [1, 2, 4])
def test_num_pp_microbatches_reads_back_with_and_without_pp(value: int) -> None:
    """Mapped onto this library's pipeline (``pipeline_rows``, tests/layer3_runtime/test_token_budgets.py)."""
    assert JobConfig(parallelism=ParallelismConfig(num_pp_microbatches=value)).parallelism.num_pp_microbatches == value
    pp = JobConfig(parallelism=ParallelismConfig(num_pp_microbatches=value, pipeline_parallel_degree=2))
    assert pp.parallelism.num_pp_microbatches == value
    with pytest.raises(ValueError, match=r"parallelism.num_pp_microbatches must be >= 1, or None \(not set\), got 0"):
        ParallelismConfig(num_pp_microbatches=0)


def test_june_removed_fields_keep_working(surface) -> None:
    surface("august")  # even an August fork may still set them
    p = ParallelismConfig(disable_loss_parallel=True, context_parallel_rotate_method="alltoall")
    assert (p.disable_loss_parallel, p.context_parallel_rotate_method) == (True, "alltoall")


# ------------------------------------------------------------------ token budgets
@pytest.mark.parametrize(("args", "want"), [
    # (seq_len, local_batch_size, num_tokens_per_microbatch_per_dp_rank)
    (["--num_tokens_per_microbatch_per_dp_rank", "1024", "--max_context_length", "256"], (256, 4, 1024)),
    (["--max_context_length", "256"], (256, 64, 16384)),  # the token budget is kept
    ([], (2048, 8, 16384)),
])
def test_upstreams_own_tyro_overrides_one_member_of_a_pair(surface, args: list[str], want: tuple) -> None:
    """Upstream's ``ConfigManager``: ``tyro.cli(TrainingConfig, default=config)`` passes every field back.

    The member the library filled in gives way to the one overridden (it was refused as a
    disagreement when b5bcd76's trainer ran on this library); two given members still must agree.
    """
    import tyro

    surface("august")
    plain = tyro.constructors.ConstructorRegistry()
    written = TrainingConfig(num_tokens_per_microbatch_per_dp_rank=8 * 2048, max_context_length=2048, steps=10)
    got = tyro.cli(TrainingConfig, args=args, default=written, registry=plain)
    assert (got.seq_len, got.local_batch_size, got.num_tokens_per_microbatch_per_dp_rank) == want
    assert got.max_context_length == got.seq_len and got.steps == 10
    replaced = dataclasses.replace(written, max_context_length=512)
    assert (replaced.seq_len, replaced.local_batch_size) == (512, 32)
    with pytest.raises(ValueError, match="training.seq_len=512 and training.max_context_length=256 disagree"):
        TrainingConfig(seq_len=512, max_context_length=256)


@pytest.mark.parametrize(("kwargs", "june"), [
    # upstream's llama3 registry: 8 * 2048 tokens, context 2048 -> 8 sequences of 2048
    (dict(num_tokens_per_microbatch_per_dp_rank=8 * 2048, max_context_length=2048), (8, -1, 2048)),
    (dict(num_tokens_per_microbatch_per_dp_rank=2 * 8192, max_context_length=8192), (2, -1, 8192)),
    (dict(num_tokens_per_microbatch_per_dp_rank=4 * 64, max_context_length=64, num_tokens_per_train_step=32 * 64),
     (4, 32, 64)),
    (dict(local_batch_size=4, seq_len=64, global_batch_size=32), (4, 32, 64)),
])
def test_token_budgets_are_the_batch_fields(kwargs: dict, june: tuple[int, int, int]) -> None:
    t = TrainingConfig(**kwargs)
    assert (t.local_batch_size, t.global_batch_size, t.seq_len) == june
    lbs, gbs, seq = june
    assert (t.num_tokens_per_microbatch_per_dp_rank, t.num_tokens_per_train_step, t.max_context_length) == (
        lbs * seq, -1 if gbs == -1 else gbs * seq, seq)
    for key, value in kwargs.items():
        assert getattr(t, key) == value  # read back as written
    assert TrainingConfig.from_dict(t.to_dict()) == t  # the dict round trip agrees with itself


@pytest.mark.parametrize(("kwargs", "names"), [
    (dict(local_batch_size=2, num_tokens_per_microbatch_per_dp_rank=4 * 2048),
     ("training.local_batch_size=2", "training.num_tokens_per_microbatch_per_dp_rank=8192")),
    (dict(seq_len=128, max_context_length=256), ("training.seq_len=128", "training.max_context_length=256")),
    (dict(global_batch_size=16, num_tokens_per_train_step=8 * 2048),
     ("training.global_batch_size=16", "training.num_tokens_per_train_step=16384")),
])
def test_inconsistent_budgets_name_both_fields(kwargs: dict, names: tuple[str, str]) -> None:
    with pytest.raises(ValueError) as info:
        TrainingConfig(**kwargs)
    assert all(n in str(info.value) for n in names), str(info.value)


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(num_tokens_per_microbatch_per_dp_rank=1000), "not a multiple of training.max_context_length"),
    # upstream b5bcd76's words (its test_config_manager.py matches them), naming the field
    (dict(num_tokens_per_microbatch_per_dp_rank=0), "num_tokens_per_microbatch_per_dp_rank must be greater than 0"),
    (dict(num_tokens_per_train_step=-5), "num_tokens_per_train_step must be -1 or greater than 0, got -5"),
    (dict(num_tokens_per_train_step=0), "num_tokens_per_train_step must be -1 or greater than 0, got 0"),
    (dict(max_context_length=0), "training.max_context_length must be greater than 0, got 0"),
    (dict(max_context_length=-1), "training.max_context_length must be greater than 0, got -1"),
])
def test_bad_budgets(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TrainingConfig(**kwargs)


def test_later_assignment_moves_the_partner() -> None:
    august = TrainingConfig(num_tokens_per_microbatch_per_dp_rank=16384, max_context_length=2048)
    august.max_context_length = 4096  # upstream's meaning: the token budget stays, sequences halve
    assert (august.num_tokens_per_microbatch_per_dp_rank, august.local_batch_size, august.seq_len) == (16384, 4, 4096)
    june = TrainingConfig(local_batch_size=8, seq_len=2048)
    june.seq_len = 4096  # June's meaning: the sequences stay, the token count doubles
    assert (june.local_batch_size, june.num_tokens_per_microbatch_per_dp_rank) == (8, 32768)
    june.num_tokens_per_train_step = 4 * 32768
    assert june.global_batch_size == 32


# ------------------------------------------------------------------ activation checkpointing (#3674)
#: upstream b5bcd76's policy spellings -> June's mode, written out from its activation_checkpoint.py
AC_POLICIES = [
    ("SelectiveAC", "selective", "selective"),
    ("FullAC", "full", "full"),
    ("MemoryBudgetAC", "memory-budget", "memory_budget"),
    (None, "none", "none"),
]


def _policy(name: str | None) -> object:
    import torchtitan_spmd.config as config

    return None if name is None else getattr(config, name).Config()


@pytest.mark.parametrize(("cls", "subcommand", "mode"), AC_POLICIES)
def test_each_ac_policy_reads_back_as_written_and_means_junes_mode(cls: str | None, subcommand: str, mode: str) -> None:
    from torchtitan_spmd.config import ac_section

    written = _policy(cls)
    cfg = JobConfig(activation_checkpoint=written)
    assert cfg.activation_checkpoint is written  # an August fork's isinstance checks keep working
    assert ac_section(cfg.activation_checkpoint).mode == mode
    assert JobConfig.from_dict(cfg.to_dict()).activation_checkpoint.mode == mode  # one meaning, June's table
    june = JobConfig(activation_checkpoint=ActivationCheckpointConfig(mode=mode))  # June's spelling still works
    assert june.activation_checkpoint.mode == mode and ac_section(june.activation_checkpoint) is june.activation_checkpoint


def test_ac_policy_fields_map_to_junes() -> None:
    from torchtitan_spmd.config import FullAC, MemoryBudgetAC, SelectiveAC, ac_section

    sel = ac_section(SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=["mlp.w1"], preserve_rng_state=False))
    assert (sel.mode, sel.per_op_sac_force_recompute_mm_shapes_by_fqns, sel.preserve_rng_state) == (
        "selective", ["mlp.w1"], False)
    full = ac_section(FullAC.Config(debug=True, determinism_check="none"))
    assert (full.mode, full.debug, full.determinism_check, full.early_stop) == ("full", True, "none", False)
    assert ac_section(MemoryBudgetAC.Config(memory_budget=0.3)).memory_budget == 0.3
    # upstream's fields, not June's: FullAC.Config has no memory_budget
    with pytest.raises(TypeError, match="memory_budget"):
        FullAC.Config(memory_budget=0.3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="activation_checkpoint.force_recompute_mm_shapes_by_fqns: expected list"):
        SelectiveAC.Config(force_recompute_mm_shapes_by_fqns="mlp.w1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"activation_checkpoint.memory_budget must be in \[0, 1\]"):
        MemoryBudgetAC.Config(memory_budget=2.0)
    with pytest.raises(TypeError, match="FullAC.Config .*whose mode is 'full'"):
        FullAC.Config().mode = "none"  # type: ignore[misc]
    with pytest.raises(TypeError, match="JobConfig.activation_checkpoint must be an ActivationCheckpointConfig"):
        JobConfig(activation_checkpoint="full")  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "expected"), [("june", "ActivationCheckpointConfig"), ("august", "SelectiveAC.Config")])
def test_ac_default_follows_the_surface(surface, name: str, expected: str) -> None:
    """Both defaults are selective checkpointing; August's is upstream's ``SelectiveAC.Config()``."""
    from torchtitan_spmd.config import ac_section

    surface(name)
    ac = JobConfig().activation_checkpoint
    assert type(ac).__qualname__ == expected and ac_section(ac).mode == "selective"


def test_memory_budget_policy_is_a_setup_error_naming_it() -> None:
    from torchtitan_spmd.config import MemoryBudgetAC

    with pytest.raises(ValueError, match=r"activation_checkpoint=MemoryBudgetAC.Config\(\) "
                                         r"\(activation-checkpoint:memory-budget\): memory-budget activation"):
        check_supported(JobConfig(activation_checkpoint=MemoryBudgetAC.Config()))
    with pytest.raises(ValueError, match="activation_checkpoint.mode='memory_budget'"):  # June's spelling, as before
        check_supported(JobConfig(activation_checkpoint=ActivationCheckpointConfig(mode="memory_budget")))
    for ok in ("SelectiveAC", "FullAC", None):
        check_supported(JobConfig(activation_checkpoint=_policy(ok)))


@pytest.mark.parametrize(("name", "args", "cls", "mode"), [
    # August's subcommands (upstream's tyro names), options in any order around them
    ("june", ["activation-checkpoint:full", "--training.steps", "3"], "FullAC.Config", "full"),
    ("june", ["activation_checkpoint:none"], "NoneType", "none"),
    ("june", ["activation-checkpoint:selective", "--activation-checkpoint.force-recompute-mm-shapes-by-fqns",
              "mlp.w1"], "SelectiveAC.Config", "selective"),
    ("august", ["activation-checkpoint:memory-budget", "--activation_checkpoint.memory_budget", "0.25"],
     "MemoryBudgetAC.Config", "memory_budget"),
    ("august", ["--activation_checkpoint.debug"], "SelectiveAC.Config", "selective"),  # the default's own fields
    # June's flags, over either surface's default
    ("june", ["--activation_checkpoint.mode", "full"], "ActivationCheckpointConfig", "full"),
    ("august", ["--activation_checkpoint.mode", "none"], "ActivationCheckpointConfig", "none"),
    ("august", ["--activation-checkpoint.per-op-sac-force-recompute-mm-shapes-by-fqns", "mlp.w1"],
     "ActivationCheckpointConfig", "selective"),
])
def test_ac_spellings_on_the_command_line(surface, name: str, args: list[str], cls: str, mode: str) -> None:
    from torchtitan_spmd.config import ConfigManager, ac_section

    surface(name)
    cfg = ConfigManager().parse_overrides(JobConfig(training=TrainingConfig(steps=10)), args)
    assert type(cfg.activation_checkpoint).__qualname__ == cls
    assert ac_section(cfg.activation_checkpoint).mode == mode
    assert cfg.training.steps == (3 if "--training.steps" in args else 10)
    if "mlp.w1" in args:
        assert ac_section(cfg.activation_checkpoint).per_op_sac_force_recompute_mm_shapes_by_fqns == ["mlp.w1"]
    if "0.25" in args:
        assert cfg.activation_checkpoint.memory_budget == 0.25
    if "--activation_checkpoint.debug" in args:
        assert cfg.activation_checkpoint.debug is True

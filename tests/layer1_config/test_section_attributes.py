"""Config sections reject unknown attributes, as upstream's ``slots=True`` dataclasses do.

A typo such as ``job.training.step = 3`` must raise (upstream raises ``AttributeError``), not
train the default number of steps; the legacy spellings ``compat/`` keeps still warn and map.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from torchtitan_spmd.compat.legacy import LegacySpellingWarning
from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.config.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC
from torchtitan_spmd.config.configs import ParamGroupConfig

_SECTIONS = sorted(JobConfig.section_types().items())


def test_the_newcomers_typo_raises_naming_section_attribute_and_closest_field() -> None:
    job = JobConfig()
    with pytest.raises(AttributeError) as info:
        job.training.step = 3  # type: ignore[attr-defined]
    message = str(info.value)
    assert "[training]" in message and "'step'" in message and "Did you mean 'steps'?" in message
    assert "\n" not in message
    assert job.training.steps == 10000  # nothing was set on the side


@pytest.mark.parametrize(("name", "cls"), _SECTIONS, ids=[n for n, _ in _SECTIONS])
def test_every_section_rejects_a_typo_of_each_field(name: str, cls: type) -> None:
    section = cls()
    fields = [f.name for f in dataclasses.fields(section)]
    for field in fields:
        typo = field + "s"
        with pytest.raises(AttributeError, match=rf"\[{name}\].*'{typo}'"):
            setattr(section, typo, 1)
        assert typo not in vars(section)
    if fields:  # the closest field is named (a section with fields only: [tokenizer] has none)
        with pytest.raises(AttributeError, match=f"Did you mean '{fields[0]}'"):
            setattr(section, fields[0] + "s", 1)


def test_a_sections_own_fields_and_bookkeeping_stay_assignable() -> None:
    job = JobConfig()
    job.training.steps = 3
    job.parallelism.tensor_parallel_degree = 2
    job.training._note = "private names are the library's own"  # type: ignore[attr-defined]
    assert (job.training.steps, job.parallelism.tensor_parallel_degree) == (3, 2)


@pytest.mark.parametrize("cls", [JobConfig, SelectiveAC.Config, FullAC.Config, MemoryBudgetAC.Config])
def test_the_root_and_the_policy_configs_reject_typos(cls: type) -> None:
    obj = cls()
    with pytest.raises(AttributeError, match="has no field 'trainings'"):
        obj.trainings = 1


def test_a_param_group_rejects_a_typo() -> None:
    group = ParamGroupConfig(pattern="router", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})
    with pytest.raises(AttributeError, match="optimizer.param_groups.*'patern'.*Did you mean 'pattern'"):
        group.patern = "x"  # type: ignore[attr-defined]


def test_a_class_variable_is_not_an_instance_field() -> None:
    with pytest.raises(AttributeError, match="has no field 'section_name'"):
        JobConfig().training.section_name = "other"  # type: ignore[misc]


def _one_legacy_warning(record: list[warnings.WarningMessage]) -> str:
    legacy = [w for w in record if issubclass(w.category, LegacySpellingWarning)]
    assert len(legacy) == 1, [str(w.message) for w in record]
    assert legacy[0].filename == __file__  # attributed to the user's line
    return str(legacy[0].message)


def test_legacy_full_dtensor_property_still_warns_and_maps() -> None:
    job = JobConfig()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        job.parallelism.full_dtensor = True  # type: ignore[attr-defined]
    assert "spmd_backend = 'full_dtensor'" in _one_legacy_warning(record)
    assert job.parallelism.spmd_backend == "full_dtensor"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        value = job.parallelism.full_dtensor  # type: ignore[attr-defined]
    assert value is True
    assert "full_dtensor" in _one_legacy_warning(record)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        job.parallelism.full_dtensor = False  # type: ignore[attr-defined]
    _one_legacy_warning(record)
    assert job.parallelism.backend_name == "default"


@pytest.mark.parametrize(
    ("section", "old", "new_section", "new"),
    [("training", "dataset", "dataloader", "dataset"),
     ("training", "dataset_path", "dataloader", "dataset_path"),
     ("model", "hf_assets_path", None, "hf_assets_path")],
)
def test_legacy_renamed_fields_stay_assignable_warn_and_move(section: str, old: str, new_section: str | None,
                                                             new: str) -> None:
    job = JobConfig()
    setattr(getattr(job, section), old, "c4_test")
    if old == "dataset_path":  # a path needs a file dataset, in the same legacy place
        job.training.dataset = "text"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        job.validate()
    assert f"{section}.{old} is deprecated" in _one_legacy_warning(
        [w for w in record if f"{section}.{old} " in str(w.message)])
    owner = getattr(job, new_section) if new_section else job
    assert getattr(owner, new) == "c4_test" and getattr(getattr(job, section), old) is None

"""The ``full_dtensor`` -> ``spmd_backend`` codemod (``torchtitan_spmd.compat.migrate``).

Fixture inputs live in ``fixtures/migrate``; each ``NAME.expected`` was written
by hand and is the exact text the codemod must produce from ``NAME``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchtitan_spmd.compat.migrate import (
    NOT_REVIEW,
    MigrationError,
    MigrationResult,
    main,
    migrate_cli_text,
    migrate_file,
    migrate_path,
    migrate_python,
    migrate_toml,
)

FIXTURES = Path(__file__).parent / "fixtures" / "migrate"
INPUTS = ["ci.yaml", "eager.toml", "llama3_debug.toml", "run_train.sh", "train_spec.py"]


def expected(name: str) -> str:
    return (FIXTURES / f"{name}.expected").read_text()


def migrate_as(name: str, text: str) -> MigrationResult:
    """Migrate ``text`` the way a file called ``name`` is migrated."""
    suffix = Path(name).suffix
    if suffix == ".py":
        return migrate_python(text)
    if suffix == ".toml":
        return migrate_toml(text)
    return migrate_cli_text(text)


@pytest.fixture
def fork(tmp_path: Path) -> Path:
    """A copy of the fixture inputs (without the expected outputs)."""
    root = tmp_path / "fork"
    root.mkdir()
    for name in INPUTS:
        shutil.copy(FIXTURES / name, root / name)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def py(source: str) -> str:
    return migrate_python(textwrap.dedent(source)).text


# --------------------------------------------------------------------------------------
# The fixture files, end to end.
# --------------------------------------------------------------------------------------
def test_fixture_set_is_complete() -> None:
    inputs = sorted(p.name for p in FIXTURES.iterdir() if p.suffix != ".expected")
    assert inputs == INPUTS
    for name in INPUTS:
        assert (FIXTURES / f"{name}.expected").is_file()
        assert (FIXTURES / name).read_text() != expected(name)


def test_rewrites_in_place(fork: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(fork)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"rewrote {len(INPUTS)} file(s)"
    for name in INPUTS:
        assert (fork / name).read_text() == expected(name), name


@pytest.mark.parametrize("name", INPUTS)
def test_expected_output_is_a_fixed_point(name: str) -> None:
    result = migrate_as(name, expected(name))
    assert result.text == expected(name)
    assert not any(site.message == NOT_REVIEW for site in result.review_sites)


def test_second_run_rewrites_nothing(fork: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(fork)]) == 0
    before = snapshot(fork)
    capsys.readouterr()
    assert main([str(fork)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "rewrote 0 file(s)"
    assert snapshot(fork) == before


def test_check_exit_codes(fork: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(fork)
    assert main(["--check", str(fork)]) == 1
    out = capsys.readouterr().out
    assert snapshot(fork) == before  # --check writes nothing
    for name in INPUTS:
        assert f"would rewrite {fork / name}" in out
    assert f"{len(INPUTS)} file(s) would be rewritten" in out

    assert main([str(fork)]) == 0
    capsys.readouterr()
    assert main(["--check", str(fork)]) == 0
    assert "0 file(s) would be rewritten" in capsys.readouterr().out


def test_diff_writes_nothing(fork: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(fork)
    assert main(["--diff", str(fork)]) == 0
    out = capsys.readouterr().out
    assert snapshot(fork) == before
    assert f"--- a/{fork / 'llama3_debug.toml'}" in out
    assert f"+++ b/{fork / 'llama3_debug.toml'}" in out
    assert "-full_dtensor = true  # see docs/full_dtensor.md\n" in out
    assert '+spmd_backend = "full_dtensor"  # see docs/full_dtensor.md\n' in out
    assert '+    if job_config.parallelism.spmd_backend == "full_dtensor":\n' in out
    assert "rewrote" not in out


def test_diff_with_check_exits_1(fork: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(fork)
    assert main(["--check", "--diff", str(fork / "eager.toml")]) == 1
    out = capsys.readouterr().out
    assert '+  spmd_backend="default"\n' in out
    assert snapshot(fork) == before


def test_review_sites_are_reported_with_file_and_line(
    fork: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = fork / "train_spec.py"
    assert main([str(fork)]) == 0
    err = capsys.readouterr().err
    # Lines 73, 77 and 78 of train_spec.py hold `not <cfg>.full_dtensor`.
    for line in (73, 77, 78):
        assert f"{spec}:{line}: review: {NOT_REVIEW}" in err
    assert "spmd_types" in NOT_REVIEW and "confirm" in NOT_REVIEW
    # Line 38 forwards the config value, now including "spmd_types".
    assert f"{spec}:38: review: full_dtensor=X.full_dtensor became spmd_backend=X.spmd_backend" in err
    # Line 23 of run_train.sh passes a value only known at run time.
    assert f"{fork / 'run_train.sh'}:23: review: legacy flag --parallelism.full_dtensor left unchanged" in err
    assert len(err.strip().splitlines()) == 5


def test_review_sites_of_migrate_python() -> None:
    source = textwrap.dedent(
        """\
        x = 1

        if not cfg.full_dtensor:
            pass
        y = cfg.full_dtensor or (
            not cfg.parallelism.full_dtensor
        )
        """
    )
    result = migrate_python(source)
    assert [(s.line, s.message) for s in result.review_sites] == [(3, NOT_REVIEW), (6, NOT_REVIEW)]


def test_migrate_path_reports_without_writing(fork: Path) -> None:
    before = snapshot(fork)
    migrations = migrate_path(fork)
    assert snapshot(fork) == before
    assert sorted(m.path.name for m in migrations if m.changed) == INPUTS
    assert all(m.result.text == expected(m.path.name) for m in migrations)
    migrate_path(fork / "eager.toml", write=True)
    assert (fork / "eager.toml").read_text() == expected("eager.toml")


# --------------------------------------------------------------------------------------
# Python conversions.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("before", "after"),
    [
        # keyword arguments of the config and mesh API
        ("ParallelDims(full_dtensor=True)", 'ParallelDims(spmd_backend="full_dtensor")'),
        ("ParallelismConfig(full_dtensor=False)", 'ParallelismConfig(spmd_backend="default")'),
        ("ParallelDims(a, full_dtensor = (True))", 'ParallelDims(a, spmd_backend = "full_dtensor")'),
        ("pd.ParallelDims(full_dtensor=flag)", 'pd.ParallelDims(spmd_backend="full_dtensor" if flag else "default")'),
        (
            "ParallelDims(full_dtensor=a if b else c)",
            'ParallelDims(spmd_backend="full_dtensor" if (a if b else c) else "default")',
        ),
        ("ParallelDims(full_dtensor=cfg.full_dtensor)", "ParallelDims(spmd_backend=cfg.spmd_backend)"),
        (
            "ParallelismConfig(full_dtensor=not cfg.full_dtensor)",
            'ParallelismConfig(spmd_backend="full_dtensor" if cfg.spmd_backend != "full_dtensor" else "default")',
        ),
        (
            "from torchtitan_spmd.distributed import ParallelDims as PD\nPD(full_dtensor=True)",
            'from torchtitan_spmd.distributed import ParallelDims as PD\nPD(spmd_backend="full_dtensor")',
        ),
        ("ns = SimpleNamespace(tp=1, full_dtensor=False)", 'ns = SimpleNamespace(tp=1, spmd_backend="default")'),
        (
            "class ParallelDims:\n    @classmethod\n    def from_config(cls, c):\n        return cls(full_dtensor=c.flag)",
            'class ParallelDims:\n    @classmethod\n    def from_config(cls, c):\n'
            '        return cls(spmd_backend="full_dtensor" if c.flag else "default")',
        ),
        # a keyword passed elsewhere: its value is still a config read, now a bool again
        ("f(full_dtensor=cfg.full_dtensor)", 'f(full_dtensor=cfg.spmd_backend == "full_dtensor")'),
        # reads in boolean and expression contexts
        ("if cfg.full_dtensor:\n    pass", 'if cfg.spmd_backend == "full_dtensor":\n    pass'),
        ("x = a.full_dtensor and b", 'x = a.spmd_backend == "full_dtensor" and b'),
        ("x = a or b.c.full_dtensor", 'x = a or b.c.spmd_backend == "full_dtensor"'),
        ("x = y if cfg.full_dtensor else z", 'x = y if cfg.spmd_backend == "full_dtensor" else z'),
        ("assert (cfg.full_dtensor)", 'assert (cfg.spmd_backend == "full_dtensor")'),
        ("x = 1 + cfg.full_dtensor", 'x = 1 + (cfg.spmd_backend == "full_dtensor")'),
        ("x = a == cfg.full_dtensor", 'x = a == (cfg.spmd_backend == "full_dtensor")'),
        ("x = cfg.full_dtensor.real", 'x = (cfg.spmd_backend == "full_dtensor").real'),
        ("x = cfg.full_dtensor()", 'x = (cfg.spmd_backend == "full_dtensor")()'),
        ("x = cfg.full_dtensor[0]", 'x = (cfg.spmd_backend == "full_dtensor")[0]'),
        ("x = -cfg.full_dtensor", 'x = -(cfg.spmd_backend == "full_dtensor")'),
        ("x = [cfg.full_dtensor]", 'x = [cfg.spmd_backend == "full_dtensor"]'),
        ("f(flag=cfg.full_dtensor)", 'f(flag=cfg.spmd_backend == "full_dtensor")'),
        # `not`
        ("x = not cfg.full_dtensor", 'x = cfg.spmd_backend != "full_dtensor"'),
        ("x = (not (cfg.full_dtensor))", 'x = (cfg.spmd_backend != "full_dtensor")'),
        ("x = a and not cfg.full_dtensor", 'x = a and cfg.spmd_backend != "full_dtensor"'),
        ("x = not not cfg.full_dtensor", 'x = not cfg.spmd_backend != "full_dtensor"'),
        # assignments
        ("cfg.full_dtensor = True", 'cfg.spmd_backend = "full_dtensor"'),
        ("cfg.full_dtensor = False", 'cfg.spmd_backend = "default"'),
        (
            "a.p.full_dtensor = world > 8",
            'a.p.spmd_backend = "full_dtensor" if world > 8 else "default"',
        ),
        ("a.full_dtensor = b.full_dtensor", "a.spmd_backend = b.spmd_backend"),
        ("a.full_dtensor = b.full_dtensor = True", 'a.spmd_backend = b.spmd_backend = "full_dtensor"'),
        ("self.full_dtensor = full_dtensor", 'self.spmd_backend = "full_dtensor" if full_dtensor else "default"'),
        # CLI flags in strings
        ('args = "--parallelism.full_dtensor --x"', 'args = "--parallelism.spmd_backend full_dtensor --x"'),
        ("argv.append('--parallelism.full_dtensor')", "argv.append('--parallelism.spmd_backend=full_dtensor')"),
        (
            'argv = ("--parallelism.full-dtensor", "False", "--y")',
            'argv = ("--parallelism.spmd_backend=default", "--y")',
        ),
        ('cmd = f"run {x} --parallelism.no-full_dtensor"', 'cmd = f"run {x} --parallelism.spmd_backend default"'),
    ],
)
def test_python_conversion(before: str, after: str) -> None:
    result = migrate_python(before + "\n")
    assert result.text == after + "\n"
    assert migrate_python(result.text).text == result.text  # idempotent


@pytest.mark.parametrize(
    "source",
    [
        "import torchtitan_spmd.distributed.full_dtensor",
        "import torchtitan_spmd.distributed.full_dtensor as fd",
        "from torchtitan_spmd.distributed import full_dtensor",
        "from torchtitan_spmd.distributed.full_dtensor import apply",
        "from . import full_dtensor",
        "x = torchtitan_spmd.distributed.full_dtensor.apply(model)",
        "x = distributed.full_dtensor",
        "x = full_dtensor.apply(model)",
        'x = getattr(cfg, "full_dtensor")',
        "x = 1  # cfg.full_dtensor stays in comments",
        "x = cfg.spmd_backend == 'full_dtensor'",
        "x = ['--parallelism.full_dtensor_overlap', '--other.full_dtensor']",
    ],
)
def test_python_left_alone(source: str) -> None:
    result = migrate_python(source + "\n")
    assert result.text == source + "\n"
    assert result.review_sites == []


@pytest.mark.parametrize(
    ("source", "lines", "needle"),
    [
        ("def f(full_dtensor: bool = False):\n    return full_dtensor", [1], "parameter full_dtensor of f()"),
        ("class C:\n    full_dtensor: bool = False", [2], "field full_dtensor of class C"),
        ("class C:\n    full_dtensor = False", [2], "field full_dtensor of class C"),
        (
            "class ParallelDims:\n    full_dtensor: bool = False",
            [2],
            "field full_dtensor of class ParallelDims is the legacy field itself",
        ),
        (
            "class M:\n    def __init__(self, full_dtensor):\n        self.full_dtensor = full_dtensor",
            [2],
            "parameter full_dtensor of M.__init__()",
        ),
    ],
)
def test_declarations_are_left_and_reported(source: str, lines: list[int], needle: str) -> None:
    result = migrate_python(source + "\n")
    assert result.text == source + "\n"
    assert [s.line for s in result.review_sites] == lines
    assert needle in result.review_sites[0].message and "declaration left unchanged" in result.review_sites[0].message


def test_own_attribute_of_a_declaring_class_is_left() -> None:
    source = textwrap.dedent(
        """\
        class Rep:
            def __init__(self, mesh, full_dtensor=False):
                self.full_dtensor = full_dtensor

            def go(self, cfg):
                if self.full_dtensor and cfg.full_dtensor:
                    return 1


        class Other:
            def go(self):
                return self.full_dtensor
        """
    )
    text = migrate_python(source).text
    assert "self.full_dtensor = full_dtensor" in text
    assert 'if self.full_dtensor and cfg.spmd_backend == "full_dtensor":' in text
    assert 'return self.spmd_backend == "full_dtensor"' in text  # Other declares nothing


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        (
            "def run(*, full_dtensor):\n    ...\n\nrun(full_dtensor=True)",
            "run is this tree's own function with a full_dtensor parameter (declared at line 1)",
        ),
        (
            "class Rep:\n    def __init__(self, full_dtensor=False): ...\n\nRep(full_dtensor=True)",
            "Rep is this tree's own class with a full_dtensor parameter (declared at line 2)",
        ),
        (
            "@dataclass\nclass Cfg:\n    full_dtensor: bool = False\n\nCfg(full_dtensor=True)",
            "Cfg is this tree's own class",
        ),
        ("dataclasses.replace(cfg, full_dtensor=True)", "the callee replace is neither ParallelismConfig"),
        ("make()(full_dtensor=True)", "the callee (an expression) is neither"),
    ],
)
def test_keyword_to_any_other_callee_is_left_and_reported(source: str, needle: str) -> None:
    result = migrate_python(source + "\n")
    assert result.text == source + "\n"
    call_line = source.count("\n") + 1
    notes = [s.message for s in result.review_sites if s.line == call_line]
    assert len(notes) == 1 and needle in notes[0], result.review_sites
    assert "full_dtensor= left unchanged" in notes[0]


def test_definitions_from_other_files_are_named() -> None:
    from torchtitan_spmd.compat.migrate import find_definitions

    defs = find_definitions("def helper(x, full_dtensor=False): ...\n", "pkg/helpers.py")
    result = migrate_python("helper(1, full_dtensor=True)\n", definitions=defs)
    assert result.text == "helper(1, full_dtensor=True)\n"
    assert "declared at pkg/helpers.py:1" in result.review_sites[0].message


def test_python_formatting_is_preserved() -> None:
    source = textwrap.dedent(
        """\
        #!/usr/bin/env python
        # header comment


        def build(cfg):  # trailing comment
            '''Docstring.'''

            dims = ParallelDims(
                dp=2,   # odd spacing kept
                # a comment between arguments
                full_dtensor=True,
                tp  =  1,
            )


            return dims if cfg.full_dtensor else None  # end
        """
    )
    assert migrate_python(source).text == source.replace(
        "full_dtensor=True", 'spmd_backend="full_dtensor"'
    ).replace("if cfg.full_dtensor else", 'if cfg.spmd_backend == "full_dtensor" else')


def test_python_crlf_line_endings_are_kept() -> None:
    source = "if cfg.full_dtensor:\r\n    ParallelDims(full_dtensor=False)\r\n"
    assert migrate_python(source).text == (
        'if cfg.spmd_backend == "full_dtensor":\r\n    ParallelDims(spmd_backend="default")\r\n'
    )


def test_python_sites_left_for_a_human() -> None:
    source = textwrap.dedent(
        """\
        cfg.full_dtensor |= other
        ParallelDims(full_dtensor=True, spmd_backend="spmd_types")
        a.full_dtensor, b = True, 1
        x = f"--parallelism.full_dtensor={flag}"
        match value:
            case cfg.full_dtensor:
                pass
        """
    )
    result = migrate_python(source)
    assert result.text == source
    assert [s.line for s in result.review_sites] == [1, 2, 3, 4, 6]
    assert "spmd_backend=" in result.review_sites[1].message


def test_python_without_legacy_name_is_returned_untouched() -> None:
    source = "x = (  1 )\n"
    result = migrate_python(source)
    assert result.text is source
    assert result.review_sites == []


def test_python_syntax_error() -> None:
    with pytest.raises(MigrationError, match="cannot parse"):
        migrate_python("def f(:\n    cfg.full_dtensor\n")


def test_missing_libcst_names_the_extra(
    fork: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "libcst", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[migrate\]" \(in '):
        migrate_python("x = cfg.full_dtensor\n")
    assert migrate_python("x = 1\n").text == "x = 1\n"  # nothing to do, libcst not needed
    before = snapshot(fork)
    assert main([str(fork / "train_spec.py")]) == 2
    assert 'pip install -e ".[migrate]"' in capsys.readouterr().err
    assert snapshot(fork) == before


# --------------------------------------------------------------------------------------
# TOML.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("[parallelism]\nfull_dtensor = true\n", '[parallelism]\nspmd_backend = "full_dtensor"\n'),
        ("[parallelism]\nfull_dtensor = false\n", '[parallelism]\nspmd_backend = "default"\n'),
        ("[ parallelism ]  # c\nfull-dtensor=true", '[ parallelism ]  # c\nspmd_backend="full_dtensor"'),
        ('["parallelism"]\n"full_dtensor" = false\n', '["parallelism"]\nspmd_backend = "default"\n'),
        ("a = 1\nparallelism.full_dtensor = true\n", 'a = 1\nparallelism.spmd_backend = "full_dtensor"\n'),
        ("[parallelism]\r\nfull_dtensor = true\r\n", '[parallelism]\r\nspmd_backend = "full_dtensor"\r\n'),
    ],
)
def test_toml_conversion(before: str, after: str) -> None:
    result = migrate_toml(before)
    assert result.text == after
    assert migrate_toml(after).text == after


@pytest.mark.parametrize(
    "text",
    [
        "[experimental]\nfull_dtensor = true\n",
        "[parallelism.extra]\nfull_dtensor = true\n",
        "[[parallelism_runs]]\nfull_dtensor = true\n",
        "full_dtensor = true\n[parallelism]\ntp = 2\n",
        "[job]\nparallelism.full_dtensor = true\n",
    ],
)
def test_toml_other_tables_left_alone(text: str) -> None:
    assert migrate_toml(text) == MigrationResult(text, [])


def test_toml_sites_left_for_a_human() -> None:
    conflict = '[parallelism]\nspmd_backend = "spmd_types"\nfull_dtensor = true\n'
    result = migrate_toml(conflict)
    assert result.text == conflict
    assert [s.line for s in result.review_sites] == [3]
    odd = "[parallelism]\nfull_dtensor = 1\n"
    assert migrate_toml(odd).text == odd
    assert [s.line for s in migrate_toml(odd).review_sites] == [2]


# --------------------------------------------------------------------------------------
# CLI flags in shell and YAML text.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("run --parallelism.full_dtensor", "run --parallelism.spmd_backend full_dtensor"),
        ("run --parallelism.full-dtensor --x", "run --parallelism.spmd_backend full_dtensor --x"),
        ("run --parallelism.full_dtensor true", "run --parallelism.spmd_backend full_dtensor"),
        ("run --parallelism.full_dtensor false --x 1", "run --parallelism.spmd_backend default --x 1"),
        ("run --parallelism.full_dtensor=True", "run --parallelism.spmd_backend=full_dtensor"),
        ("run --parallelism.full_dtensor=false", "run --parallelism.spmd_backend=default"),
        ("run --parallelism.no-full_dtensor", "run --parallelism.spmd_backend default"),
        ("run --parallelism.no_full_dtensor --x", "run --parallelism.spmd_backend default --x"),
        ("run --parallelism.no-full-dtensor\n", "run --parallelism.spmd_backend default\n"),
        ("A=('--parallelism.full_dtensor')", "A=('--parallelism.spmd_backend=full_dtensor')"),
        ("args:\n  - --parallelism.full_dtensor\n", "args:\n  - --parallelism.spmd_backend=full_dtensor\n"),
        ("run --parallelism.full_dtensor \\\n  --x", "run --parallelism.spmd_backend full_dtensor \\\n  --x"),
    ],
)
def test_cli_conversion(before: str, after: str) -> None:
    result = migrate_cli_text(before)
    assert result.text == after
    assert result.review_sites == []
    assert migrate_cli_text(after).text == after


@pytest.mark.parametrize(
    "text",
    [
        "run --parallelism.full_dtensor_overlap",
        "run --parallelism.full_dtensorx",
        "run --other.full_dtensor",
        "run --parallelism.spmd_backend full_dtensor",
        "run parallelism.full_dtensor",
    ],
)
def test_cli_left_alone(text: str) -> None:
    assert migrate_cli_text(text) == MigrationResult(text, [])


@pytest.mark.parametrize(
    "text",
    [
        "x\nrun --parallelism.full_dtensor $FLAG",
        "x\nrun --parallelism.full_dtensor=${{ matrix.flag }}",
        "x\nrun --parallelism.no-full_dtensor=true",
    ],
)
def test_cli_sites_left_for_a_human(text: str) -> None:
    result = migrate_cli_text(text)
    assert result.text == text
    assert [s.line for s in result.review_sites] == [2]


# --------------------------------------------------------------------------------------
# Paths and the command line.
# --------------------------------------------------------------------------------------
def test_missing_path_exits_2(fork: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(fork)
    missing = fork / "no_such_dir"
    assert main([str(fork), str(missing)]) == 2
    assert f"no such file or directory: {missing}" in capsys.readouterr().err
    assert snapshot(fork) == before  # nothing is written when a path is missing


def test_skips_vcs_nox_venv_and_cache_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    legacy = "run --parallelism.full_dtensor\n"
    skipped = [".git/hooks/x.sh", ".nox/lint/x.sh", ".venv/x.sh", "__pycache__/x.sh", "env/x.sh"]
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "pyvenv.cfg").write_text("home = /usr\n")
    for rel in [*skipped, "src/run.sh", "README.md"]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(legacy)
    assert main([str(tmp_path)]) == 0
    assert "rewrote 1 file(s)" in capsys.readouterr().out
    assert (tmp_path / "src/run.sh").read_text() == "run --parallelism.spmd_backend full_dtensor\n"
    for rel in [*skipped, "README.md"]:
        assert (tmp_path / rel).read_text() == legacy, rel


def test_unparsable_python_is_reported_and_others_still_migrate(
    fork: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (fork / "broken.py").write_text("def f(:\n    cfg.full_dtensor\n")
    assert main([str(fork)]) == 2
    assert f"error: {fork / 'broken.py'}: cannot parse" in capsys.readouterr().err
    assert (fork / "eager.toml").read_text() == expected("eager.toml")


def test_unsupported_file_named_directly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("--parallelism.full_dtensor\n")
    assert main([str(notes)]) == 2
    assert "unsupported file type '.md'" in capsys.readouterr().err
    with pytest.raises(MigrationError):
        migrate_file(notes)


def test_module_entry_point(fork: Path) -> None:
    cmd = [sys.executable, "-m", "torchtitan_spmd.compat.migrate", "--check", str(fork)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert f"would rewrite {fork / 'train_spec.py'}" in proc.stdout
    assert f"{fork / 'train_spec.py'}:73: review:" in proc.stderr


# --------------------------------------------------------------------------------------
# A fork's tree with its own `full_dtensor` parameters (fixtures/migrate_tree/acme_fork).
# --------------------------------------------------------------------------------------
TREE = Path(__file__).parent / "fixtures" / "migrate_tree"
TREE_SOURCES = ["__init__.py", "experiment.py", "loss_checks.py", "simple_fsdp.py", "train.py"]

#: (file, line, what the note says) for every site the codemod must leave and report.
TREE_REVIEW = [
    ("experiment.py", 8, "declaration left unchanged: field full_dtensor of class ExperimentConfig"),
    ("experiment.py", 15, "ExperimentConfig is this tree's own class with a full_dtensor parameter (declared at {}experiment.py:8)"),
    ("loss_checks.py", 5, "declaration left unchanged: parameter full_dtensor of LossChecks._run_one()"),
    ("loss_checks.py", 9, "_run_one is this tree's own function with a full_dtensor parameter (declared at {}loss_checks.py:5)"),
    ("loss_checks.py", 12, "_run_one is this tree's own function"),
    ("simple_fsdp.py", 5, "declaration left unchanged: parameter full_dtensor of ReplicateComputation.__init__()"),
    ("simple_fsdp.py", 13, "declaration left unchanged: parameter full_dtensor of data_parallel()"),
    ("simple_fsdp.py", 14, "ReplicateComputation is this tree's own class with a full_dtensor parameter (declared at {}simple_fsdp.py:5)"),
    ("train.py", 19, "full_dtensor=X.full_dtensor became spmd_backend=X.spmd_backend"),
    ("train.py", 21, "data_parallel is this tree's own function with a full_dtensor parameter (declared at {}simple_fsdp.py:13)"),
    ("train.py", 28, NOT_REVIEW),
]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the fork tree (inputs only)."""
    root = tmp_path / "tree"
    shutil.copytree(TREE, root, ignore=shutil.ignore_patterns("*.expected", "__pycache__"))
    return root


def _summary(root: Path, *python_flags: str) -> str:
    """``acme_fork.train.summary()`` of the tree at ``root``, run in a fresh interpreter."""
    code = "import json, acme_fork.train as t; print(json.dumps(t.summary(), sort_keys=True))"
    proc = subprocess.run(
        [sys.executable, *python_flags, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_tree_fixture_is_complete() -> None:
    assert sorted(p.name for p in (TREE / "acme_fork").glob("*.py")) == TREE_SOURCES
    assert sorted(p.name for p in (TREE / "acme_fork").glob("*.expected")) == ["train.py.expected"]


def test_tree_migrates_the_api_and_leaves_and_reports_the_forks_own(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = tree / "acme_fork"
    before = {name: (package / name).read_text() for name in TREE_SOURCES}
    assert main([str(tree)]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == "rewrote 1 file(s)"
    assert (package / "train.py").read_text() == (TREE / "acme_fork" / "train.py.expected").read_text()
    for name in TREE_SOURCES:
        if name != "train.py":
            assert (package / name).read_text() == before[name], name
    notes = err.strip().splitlines()
    assert len(notes) == len(TREE_REVIEW), err
    for (name, line, needle), note in zip(TREE_REVIEW, notes, strict=True):
        assert note.startswith(f"{package / name}:{line}: review: "), note
        assert needle.format(f"{package}/") in note, note
    assert main([str(tree)]) == 0  # idempotent
    assert capsys.readouterr().out.strip().splitlines()[-1] == "rewrote 0 file(s)"


def test_migrate_path_names_definitions_in_other_files(tree: Path) -> None:
    migrations = {m.path.name: m for m in migrate_path(tree)}
    notes = [site.message for site in migrations["train.py"].result.review_sites if site.line == 21]
    assert len(notes) == 1 and f"declared at {tree / 'acme_fork' / 'simple_fsdp.py'}:13" in notes[0]


def _mesh_layer_present() -> bool:
    """Whether ``ParallelDims`` (layer 2) can be imported: not in layer 1's own stack prefix."""
    try:
        return importlib.util.find_spec("torchtitan_spmd.distributed.parallel_dims") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _mesh_layer_present(), reason="the fork tree's code uses ParallelDims (layer 2)")
def test_migrated_tree_runs_the_same_without_a_deprecation(tree: Path) -> None:
    """No edit breaks a call: the fork's code gives the same answers after the rewrite,
    with every legacy spelling of torchtitan_spmd's API gone."""
    legacy = _summary(tree)
    assert main([str(tree)]) == 0
    assert _summary(tree, "-W", "error::DeprecationWarning") == legacy
    assert '"dims": true' in legacy and '"wrapper": "full"' in legacy

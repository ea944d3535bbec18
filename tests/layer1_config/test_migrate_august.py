"""Layer 1: the codemod's second step, upstream June spellings (a0c831c49) -> August (b5bcd76).

Fixtures are written in upstream's own shapes (its config registries, its comparisons); the
expected text is b5bcd76's at those sites, written out here.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from torchtitan_spmd.compat.migrate import main, migrate_file, migrate_path
from torchtitan_spmd.compat.migrate_august import (
    migrate_cli_text_august,
    migrate_python_august,
    migrate_toml_august,
)

pytest.importorskip("libcst")

JUNE = textwrap.dedent('''\
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.utils import get_spmd_backend


    def llama3_debugmodel():
        return Trainer.Config(
            training=TrainingConfig(
                local_batch_size=8,
                seq_len=2048,
                steps=10,
            ),
            parallelism=ParallelismConfig(spmd_backend="default"),
        )


    def big(seq):
        return TrainingConfig(local_batch_size=2, global_batch_size=-1, seq_len=seq + 1)


    def loss(parallel_dims, cfg):
        assert get_spmd_backend() == "default"
        if parallel_dims.spmd_backend != 'default':
            cfg.parallelism.spmd_backend = "default"
        dense = parallel_dims.spmd_meshes()[0]
        sparse = parallel_dims.spmd_meshes()[-1]
        every = parallel_dims.spmd_meshes()
        if parallel_dims.spmd_backend == "full_dtensor":
            pass
        return TrainingConfig(local_batch_size=4)
''')

AUGUST = textwrap.dedent('''\
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.utils import get_spmd_backend


    def llama3_debugmodel():
        return Trainer.Config(
            training=TrainingConfig(
                num_tokens_per_microbatch_per_dp_rank=8 * 2048,
                max_context_length=2048,
                steps=10,
            ),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        )


    def big(seq):
        return TrainingConfig(num_tokens_per_microbatch_per_dp_rank=2 * (seq + 1), num_tokens_per_train_step=-1, max_context_length=seq + 1)


    def loss(parallel_dims, cfg):
        assert get_spmd_backend() == "partial_dtensor"
        if parallel_dims.spmd_backend != 'partial_dtensor':
            cfg.parallelism.spmd_backend = "partial_dtensor"
        dense = parallel_dims.spmd_dense_mesh()
        sparse = parallel_dims.spmd_sparse_mesh()
        every = parallel_dims.spmd_meshes()
        if parallel_dims.spmd_backend == "full_dtensor":
            pass
        return TrainingConfig(local_batch_size=4)
''')


def test_python_step() -> None:
    result = migrate_python_august(JUNE)
    assert result.text == AUGUST
    notes = [(s.line, s.message.split(":")[0].split(" ")[0]) for s in result.review_sites]
    assert notes == [(24, "spmd_meshes()"), (25, "spmd_meshes()"), (26, "spmd_meshes()"),
                     (27, "a"), (29, "local_batch_size")]
    assert migrate_python_august(result.text).text == result.text  # idempotent


def test_cli_and_toml_steps() -> None:
    sh = "torchrun train.py --parallelism.spmd_backend default --training.seq_len 4096 --training.local_batch_size 2\n"
    out = migrate_cli_text_august(sh)
    assert out.text == ("torchrun train.py --parallelism.spmd_backend partial_dtensor "
                        "--training.max_context_length 4096 --training.local_batch_size 2\n")
    assert [s.line for s in out.review_sites] == [1]
    assert migrate_cli_text_august("--parallelism.spmd-backend=default").text == \
        "--parallelism.spmd-backend=partial_dtensor"
    toml = '[parallelism]\nspmd_backend = "default"  # keep\n[training]\nseq_len = 64\nlocal_batch_size = 2\n'
    out = migrate_toml_august(toml)
    assert out.text == '[parallelism]\nspmd_backend = "partial_dtensor"  # keep\n[training]\nmax_context_length = 64\n' \
                       'local_batch_size = 2\n'
    assert [s.line for s in out.review_sites] == [5]
    assert migrate_toml_august(out.text).text == out.text


def test_both_steps_from_before_june(tmp_path: Path) -> None:
    """A fork from before the June PR (``full_dtensor: bool``) goes to August in one run."""
    src = tmp_path / "fork.py"
    src.write_text("cfg = ParallelismConfig(full_dtensor=False)\nok = cfg.spmd_backend == 'default'\n")
    migration = migrate_file(src, to="august")
    assert migration.result.text == ('cfg = ParallelismConfig(spmd_backend="partial_dtensor")\n'
                                     "ok = cfg.spmd_backend == 'partial_dtensor'\n")
    assert migrate_file(src, to="june").result.text.startswith('cfg = ParallelismConfig(spmd_backend="default")')


def test_cli_entry_point_is_idempotent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "registry.py").write_text(JUNE)
    assert main(["--to", "august", str(tmp_path)]) == 0
    assert (tmp_path / "registry.py").read_text() == AUGUST
    assert main(["--to", "august", "--check", str(tmp_path)]) == 0  # nothing left to change
    assert not [m for m in migrate_path(tmp_path, to="august") if m.changed]
    assert "review: spmd_meshes() is gone upstream" in capsys.readouterr().err

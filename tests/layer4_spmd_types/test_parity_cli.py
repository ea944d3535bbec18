"""``python -m torchtitan_spmd.parity``: the three-way parity report for users.

One real run (2 forked ranks, TP 2 with sequence parallel, 3 steps, all three
backends) checks the report end to end and that the three backends agree with
each other directly; the table, the plot and the missing-matplotlib path are
also checked on canned results, for free.
"""

from __future__ import annotations

import sys

import pytest
from spmd_helpers import LOCAL_BATCH, SEQ_LEN, warm_parent

from torchtitan_spmd import parity

pytestmark = pytest.mark.backend("spmd_types")

CANNED = parity.ParityResult(
    runs={
        "default": [(5.0, 2.0), (4.5, 1.5)],
        "full_dtensor": [(5.0, 2.0), (4.5, 1.5000003)],
        "spmd_types": [(5.00001, 2.0), (4.5, 1.5)],
    },
    nproc=4,
    description="tiny, 4 rank(s)",
)


def test_table_reports_the_maximum_relative_difference() -> None:
    text = parity.format_table(CANNED)
    lines = text.splitlines()
    assert lines[0].split() == ["step", "default", "full_dtensor", "spmd_types", "max", "rel", "diff"]
    assert "2.00e-06" in lines[2]  # step 1: spmd_types is 1e-5 / 5 off
    assert lines[3].rstrip().endswith("0.00e+00")
    assert "loss 2.00e-06" in text and "grad_norm 2.00e-07" in text
    assert parity.max_rel_diff(CANNED) == pytest.approx(2e-6)


def test_plot_is_written(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss.png"
    assert parity.write_plot(CANNED, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_plot_is_skipped_with_a_note(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(parity, "collect", lambda *a, **k: CANNED)
    path = tmp_path / "loss.png"
    assert parity.main(["--model.flavor", "tiny", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed" in out and "torchtitan-spmd[plot]" in out
    assert "max relative difference vs default" in out
    assert not path.exists()


def test_tolerance_and_bad_arguments(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr(parity, "collect", lambda *a, **k: CANNED)
    assert parity.main(["--no-plot", "--tol", "1e-5"]) == 0
    assert parity.main(["--no-plot", "--tol", "1e-7"]) == 1
    assert parity.main(["--no-plot", "--backends", "default,dtensor"]) == 2
    assert parity.main(["--no-plot", "--parallelism.tensor_paralel_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert "Unrecognized options" in err and "tensor-parallel-degree" in err  # tyro's words


def test_default_nproc_is_the_product_of_degrees(monkeypatch) -> None:  # noqa: ANN001
    seen = {}

    def fake_collect(base, *, nproc, **kwargs):  # noqa: ANN001, ANN202
        seen["nproc"] = nproc
        seen["device"] = base.training.device
        return CANNED

    monkeypatch.setattr(parity, "collect", fake_collect)
    parity.main(["--no-plot", "--parallelism.data_parallel_shard_degree", "2",
                 "--parallelism.tensor_parallel_degree", "2"])
    assert seen == {"nproc": 4, "device": "cpu"}
    parity.main(["--no-plot", "--nproc", "8", "--parallelism.tensor_parallel_degree", "2"])
    assert seen["nproc"] == 8


@pytest.mark.multiproc
def test_three_backends_agree_end_to_end(tmp_path, capsys) -> None:  # noqa: ANN001
    warm_parent()
    path = tmp_path / "parity.png"
    rc = parity.main([
        "--model.flavor", "tiny", "--training.steps", "3", "--training.seq_len", str(SEQ_LEN),
        "--training.local_batch_size", str(LOCAL_BATCH), "--optimizer.lr", "3e-3",
        "--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
        "--debug.seed", "1234", "--debug.deterministic", "--debug.spmd_typechecking",
        "--plot", str(path), "--tol", "1e-5",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    for row in rows:
        losses = [float(x) for x in row[1:4]]
        assert max(losses) - min(losses) <= 1e-5 * min(losses), row
    assert "max relative difference vs default" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert path.exists() and f"wrote {path}" in out

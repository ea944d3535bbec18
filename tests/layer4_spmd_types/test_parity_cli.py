"""``python -m torchtitan_spmd.parity``: the parity report against the independent reference.

One real run (2 forked ranks, TP 2 with sequence parallel, 3 steps, the reference and all
three backends) checks the report end to end; the table, the gate (loss and gradient norm,
NaN, runs of another length), the plot path and the missing-matplotlib path are checked on
canned results, for free.
"""

from __future__ import annotations

import math
import sys

import pytest
from spmd_helpers import LOCAL_BATCH, SEQ_LEN, torch_at_least, warm_parent

from torchtitan_spmd import parity, reference

pytestmark = pytest.mark.backend("spmd_types")

CANNED = parity.ParityResult(
    runs={
        "reference": [(5.0, 2.0), (4.5, 1.5)],
        "default": [(5.0, 2.0), (4.5, 1.5)],
        "full_dtensor": [(5.0, 2.0), (4.5, 1.5000003)],
        "spmd_types": [(5.00001, 2.0), (4.5, 1.5)],
    },
    nproc=4,
    description="tiny, 4 rank(s)",
    steps=2,
)


def _canned(**runs: list[tuple[float, float]]) -> parity.ParityResult:
    return parity.ParityResult(runs={"reference": CANNED.runs["reference"], **runs}, nproc=2,
                               description="canned", steps=2)


def _main(monkeypatch: pytest.MonkeyPatch, result: parity.ParityResult, *args: str) -> int:
    monkeypatch.setattr(parity, "collect", lambda *a, **k: result)
    return parity.main(["--no-plot", *args])


def test_table_reports_the_maximum_relative_difference() -> None:
    text = parity.format_table(CANNED)
    lines = text.splitlines()
    assert lines[0].split() == ["loss", "reference", "default", "full_dtensor", "spmd_types", "max", "rel", "diff"]
    assert "2.00e-06" in lines[2]  # step 1: spmd_types is 1e-5 / 5 off the reference
    assert lines[3].rstrip().endswith("0.00e+00")
    assert lines[5].split()[:2] == ["grad_norm", "reference"]
    assert lines[8].rstrip().endswith("2.00e-07")  # step 2: full_dtensor's norm is 3e-7 / 1.5 off
    assert "max relative difference vs reference: loss 2.00e-06, grad_norm 2.00e-07" in text
    assert parity.max_rel_diff(CANNED) == pytest.approx(2e-6)
    assert parity.max_rel_diff(CANNED, 1) == pytest.approx(2e-7)


def test_the_tolerance_is_exact_for_the_loss_and_the_grad_norm(monkeypatch, capsys) -> None:  # noqa: ANN001
    # A loss 2e-5 off fails --tol 1e-5 (no slack), and passes --tol 3e-5.
    loss_off = _canned(default=[(5.0001, 2.0), (4.5, 1.5)])
    assert _main(monkeypatch, loss_off, "--tol", "1e-5") == 1
    assert "default: loss 2.00e-05 from reference at step 1 > --tol 1e-05" in capsys.readouterr().err
    assert _main(monkeypatch, loss_off, "--tol", "3e-5") == 0
    # The case: losses exact, the gradient norm halved (a divide-by-2 bug).
    halved = _canned(full_dtensor=[(5.0, 1.0), (4.5, 0.75)])
    assert _main(monkeypatch, halved, "--tol", "1e-5") == 1
    assert "full_dtensor: grad_norm 5.00e-01 from reference at step 1 > --grad-norm-tol 1e-05" in capsys.readouterr().err
    assert _main(monkeypatch, halved, "--tol", "1e-5", "--grad-norm-tol", "0.6") == 0
    assert _main(monkeypatch, CANNED, "--tol", "2e-6") == 0
    assert _main(monkeypatch, CANNED, "--tol", "1e-7") == 1


def test_a_passing_report_ends_with_one_pass_line_a_failing_one_with_none(monkeypatch, capsys) -> None:  # noqa: ANN001
    assert _main(monkeypatch, CANNED, "--tol", "2e-6") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("PASS: 3 run(s) against the reference over 2 steps; largest relative difference: "
                       "loss 2.0e-06, grad norm 2.0e-07; --tol 2e-06, --grad-norm-tol 2e-06")
    assert _main(monkeypatch, CANNED) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "no tolerance given (--tol), so only NaNs and run lengths were gated")
    assert _main(monkeypatch, CANNED, "--tol", "1e-7") == 1
    assert "PASS" not in capsys.readouterr().out


def test_a_seeded_run_confirms_every_backend_loaded_the_seed(monkeypatch, capsys, tmp_path) -> None:  # noqa: ANN001
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    args = ("--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path", seed)
    every = dict.fromkeys(("default", "full_dtensor", "spmd_types"), seed)
    loaded = parity.ParityResult(runs=CANNED.runs, nproc=4, description="seeded", steps=2, loaded=every)
    assert _main(monkeypatch, loaded, *args) == 0
    out = capsys.readouterr().out
    for backend in every:
        assert f"seed: {backend} started from {seed}" in out
    assert f"seed: the reference read its initial weights from {seed}" in out
    # one backend resumed its own folder's checkpoint instead (the trainer's rule): a failure
    own = parity.ParityResult(runs=CANNED.runs, nproc=4, description="seeded", steps=2,
                              loaded={**every, "full_dtensor": "outputs/checkpoint/step-2"})
    assert _main(monkeypatch, own, *args) == 1
    captured = capsys.readouterr()
    assert ("FAIL: full_dtensor: started from outputs/checkpoint/step-2, not the seed checkpoint "
            f"checkpoint.initial_load_path={seed!r}") in captured.err
    assert "PASS" not in captured.out
    none = parity.ParityResult(runs=CANNED.runs, nproc=4, description="seeded", steps=2,
                               loaded={**every, "default": None})
    assert _main(monkeypatch, none, *args) == 1
    assert "FAIL: default: started from no checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["run", "reference", "both"])
def test_a_nan_never_scores_zero(monkeypatch, capsys, where: str) -> None:  # noqa: ANN001
    nan = [(5.0, 2.0), (math.nan, 1.5)]
    runs = {"reference": nan if where != "run" else CANNED.runs["reference"],
            "default": nan if where != "reference" else CANNED.runs["default"]}
    result = parity.ParityResult(runs=runs, nproc=2, description="nan", steps=2)
    assert parity.max_rel_diff(result) == math.inf
    assert "inf" in parity.format_table(result).splitlines()[3]
    assert _main(monkeypatch, result) == 1  # without --tol too
    assert "loss is nan at step 2" in capsys.readouterr().err
    assert _main(monkeypatch, result, "--tol", "1e3") == 1


def test_runs_of_another_length_fail(monkeypatch, capsys) -> None:  # noqa: ANN001
    short = _canned(default=[(5.0, 2.0)])
    assert parity.max_rel_diff(short) == math.inf
    assert parity.format_table(short).splitlines()[3].split()[2] == "-"
    assert _main(monkeypatch, short) == 1
    assert "default: 1 steps, expected 2" in capsys.readouterr().err


def test_plot_is_written(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss"  # no extension: written exactly there, as PNG
    assert parity.write_plot(CANNED, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _no_runs(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise AssertionError("nothing may run before the plot path is checked")


def test_an_unwritable_plot_path_fails_before_any_run(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(parity, "collect", _no_runs)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = blocker / "plot.png"  # its parent is a file: cannot be created, even as root
    assert parity.main(["--plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"--plot: cannot write {str(target)!r}: {str(blocker)!r} is a file, not a directory." in err


def test_a_plot_directory_gets_the_default_name_and_reports_it(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(parity, "collect", lambda *a, **k: CANNED)
    assert parity.main(["--plot", str(tmp_path)]) == 0
    written = tmp_path / parity.PLOT_NAME
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {written}" in capsys.readouterr().out
    # Without --plot: under job.dump_folder.
    dump = tmp_path / "dump"
    assert parity.main(["--job.dump_folder", str(dump)]) == 0
    assert (dump / parity.PLOT_NAME).exists() and f"wrote {dump / parity.PLOT_NAME}" in capsys.readouterr().out


def test_without_matplotlib_the_plot_is_skipped_with_a_note(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(parity, "collect", lambda *a, **k: CANNED)
    path = tmp_path / "loss.png"
    assert parity.main(["--model.flavor", "tiny", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed" in out and 'pip install -e ".[plot]"' in out
    assert "max relative difference vs reference" in out
    assert not path.exists()


def test_bad_arguments(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr(parity, "collect", _no_runs)
    assert parity.main(["--no-plot", "--backends", "default,dtensor"]) == 2
    assert parity.main(["--no-plot", "--parallelism.tensor_paralel_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert "Unrecognized options" in err and "tensor-parallel-degree" in err  # tyro's words
    assert parity.main(["--no-plot", "--tol", "nan"]) == 2
    assert "--tol: must be a finite number >= 0, got 'nan'" in capsys.readouterr().err


def test_a_family_without_a_reference_needs_no_reference(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr(reference, "ARCHITECTURES", {"qwen3": reference.ARCHITECTURES["qwen3"]})
    monkeypatch.setattr(parity, "collect", _no_runs)
    assert parity.main(["--no-plot"]) == 2
    assert "pass --no-reference" in capsys.readouterr().err
    seen = {}

    def fake_collect(base, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.update(kwargs)
        return parity.ParityResult(runs={k: v for k, v in CANNED.runs.items() if k != "reference"}, nproc=4,
                                   description="", steps=2)

    monkeypatch.setattr(parity, "collect", fake_collect)
    assert parity.main(["--no-plot", "--no-reference", "--tol", "1e-5"]) == 0
    assert seen["reference"] is False
    assert "max relative difference vs default" in capsys.readouterr().out


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
        # torch 2.11 cannot type-check through activation checkpointing (a setup error, tested)
        *([] if torch_at_least("2.13") else ["--activation_checkpoint.mode", "none"]),
    ])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["loss"])
    assert lines[head].split()[1:5] == ["reference", "default", "full_dtensor", "spmd_types"]
    rows = [line.split() for line in lines[head + 2 : head + 5]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    for row in rows:
        losses = [float(x) for x in row[1:5]]
        assert max(losses) - min(losses) <= 1e-5 * min(losses), row
    assert "max relative difference vs reference" in out
    assert lines[-1].startswith("PASS: 3 run(s) against the reference over 3 steps; largest relative "
                                "difference: loss "), lines[-1]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert path.exists() and f"wrote {path}" in out

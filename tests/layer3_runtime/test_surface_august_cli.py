"""Layer 3: the June and August surfaces through the command line, which needs a model registry.

``--module llama3`` (upstream's registry) and the August fork fixture (``fork_fixture/acme_august``)
parsed under each surface. The surface's fields, spellings and budgets themselves are layer 1's
(``tests/layer1_config/test_surface_august.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchtitan_spmd.config import ConfigManager
from torchtitan_spmd.config.surface import ENV_VAR, set_surface

#: The stand-in forks (layer 1's fixture folder): ``acme_august`` is the August one.
FORK_DIR = Path(__file__).parents[1] / "layer1_config" / "fork_fixture"


@pytest.fixture
def surface(monkeypatch: pytest.MonkeyPatch) -> Iterator[typing.Callable[[str], None]]:
    """``surface("june" | "august")`` for one test; the environment's surface again afterwards."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    yield set_surface
    set_surface(None)


@pytest.mark.parametrize(("name", "args", "expected"), [
    ("june", [], "default"),
    ("august", [], "spmd_types"),
    ("june", ["--parallelism.spmd_backend", "partial_dtensor"], "partial_dtensor"),
    ("august", ["--parallelism.spmd_backend", "partial_dtensor"], "partial_dtensor"),
])
def test_through_tyro(surface, name: str, args: list[str], expected: str) -> None:
    surface(name)
    cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *args])
    assert cfg.parallelism.spmd_backend == expected


def test_august_choices_in_tyro_error(surface, capsys: pytest.CaptureFixture[str]) -> None:
    surface("august")
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel",
                                    "--parallelism.spmd_backend", "partial_dtenser"])
    err = capsys.readouterr().err
    assert "'partial_dtensor'" in err and "Did you mean 'partial_dtensor'?" in err


def test_tyro_overrides_one_member_of_a_pair(surface) -> None:
    surface("august")
    base = ["--module", "llama3", "--config", "llama3_debugmodel"]  # writes June's batch fields
    cfg = ConfigManager().parse_args([*base, "--training.max_context_length", "128",
                                      "--training.num_tokens_per_train_step", "4096"])
    t = cfg.training
    assert (t.seq_len, t.max_context_length, t.global_batch_size, t.num_tokens_per_train_step) == (128, 128, 32, 4096)


# ------------------------------------------------------------------ the August fork fixture
_FORK_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("error", DeprecationWarning)
from torchtitan_spmd.config import ConfigManager
from acme_august.trainer import microbatch_sequences, recomputes_whole_blocks, uses_partial_dtensor
out = {}
for name in ("august_debug", "august_partial_dtensor"):
    cfg = ConfigManager().parse_args(["--module", "acme_august", "--config", name])
    out[name] = [cfg.parallelism.spmd_backend, uses_partial_dtensor(cfg), microbatch_sequences(cfg),
                 cfg.training.local_batch_size, cfg.training.global_batch_size, cfg.training.seq_len]
for sub in ("full", "selective", "none"):  # upstream's subcommands over the fork's own root
    cfg = ConfigManager().parse_args(["--module", "acme_august", "--config", "august_debug",
                                      f"activation-checkpoint:{sub}", "--training.steps", "3"])
    out[sub] = [type(cfg.activation_checkpoint).__qualname__, recomputes_whole_blocks(cfg), cfg.training.steps]
print(json.dumps(out))
"""


def test_august_fork_fixture_drops_in_with_one_line() -> None:
    import json

    path = os.pathsep.join(p for p in (str(FORK_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, ENV_VAR: "august"}  # the fork's one line
    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["august_debug"] == ["spmd_types", False, 2, 2, 16, 64]
    assert out["august_partial_dtensor"] == ["partial_dtensor", True, 2, 2, 16, 64]
    assert out["full"] == ["FullAC.Config", True, 3]
    assert out["selective"] == ["SelectiveAC.Config", False, 3]
    assert out["none"] == ["NoneType", False, 3]

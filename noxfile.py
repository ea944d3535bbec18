"""nox sessions for torchtitan_spmd.

    nox -s cpu_tests     # the test matrix on CPU (gloo): common + every backend, one pytest run
    nox -s cpu_tests -- --backend=spmd_types    # one tier of it (common, default, ...)
    nox -s gpu_tests     # the same on CUDA; skips (exit 0) when no GPU is visible
    nox -s lint          # ruff
    nox -s stack         # per-layer checks of the stacked series (stack/)
    nox -s train         # README command 1: a 4-rank CPU training run
    nox -s docs_long     # the docs' long examples (tests/docs with DOCS_LONG=1); not in CI

The CPU sessions share one virtualenv (``.nox/_shared-cpu``) so torch is
installed once. They pin ``torch==2.14.1`` (a local wheel on the project's
machines). To run them on another torch, set ``TORCHTITAN_SPMD_TORCH`` to a
requirement::

    TORCHTITAN_SPMD_TORCH=torch==2.11.0 nox -s cpu_tests   # the GPU machines' torch
    TORCHTITAN_SPMD_TORCH=torch==2.13.0 nox -s cpu_tests

Each such requirement gets its own virtualenv (``.nox/_shared-cpu-torch-2.11.0``),
so the pinned one is never reinstalled. A torch that is not on local disk is a
download of several GB: that is why CI runs only the pin. Tests of a feature that
needs a newer torch skip with a reason naming the version.

Every pytest session fails when it collects no test (pytest's exit code 5).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
BACKENDS = ("default", "full_dtensor", "spmd_types")
DEFAULT_TORCH_SPEC = "torch==2.14.1"
TORCH_SPEC = os.environ.get("TORCHTITAN_SPMD_TORCH", "").strip() or DEFAULT_TORCH_SPEC


def shared_venv(torch_spec: str) -> Path:
    """The CPU virtualenv for ``torch_spec``: one per requirement, the pin's has no suffix."""
    if torch_spec == DEFAULT_TORCH_SPEC:
        return ROOT / ".nox" / "_shared-cpu"
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", torch_spec).strip("-") or "torch"
    return ROOT / ".nox" / f"_shared-cpu-{slug}"


SHARED_VENV = shared_venv(TORCH_SPEC)

nox.options.sessions = ["lint", "cpu_tests", "stack"]
nox.options.reuse_existing_virtualenvs = True


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _install_stamp(extra: str) -> str:
    text = (ROOT / "pyproject.toml").read_bytes() + TORCH_SPEC.encode() + extra.encode()
    return hashlib.sha256(text).hexdigest()


#: ``pip`` installs the shared CPU venv with pip itself; ``uv`` (the default) with uv, which pip
#: installs into the venv first. uv takes the packages pip would (see :func:`uv_settings`) in
#: 45 s of wall time against pip's 104 on the project's 2-core machines, most of it the 5.5 GB
#: of the CUDA build of torch 2.14.1 (docs/benchmarks.md, "Round seven").
INSTALLER_ENV = "TORCHTITAN_SPMD_INSTALLER"
INSTALLERS = ("uv", "pip")
UV_SPEC = "uv>=0.5,<1"

#: pip settings that change nothing about what is installed, so uv has no need of them.
_PIP_SETTINGS_WITHOUT_EFFECT = frozenset({
    "disable-pip-version-check", "no-color", "progress-bar", "quiet", "verbose", "no-input",
    "root-user-action", "no-python-version-warning", "cache-dir", "no-cache-dir", "log",
    "config-file",
})

#: pip settings holding a whitespace-separated list, and the uv flag each item is passed with.
_PIP_LIST_SETTINGS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
                      "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}


def uv_settings(pip_config_listing: str) -> tuple[list[str], dict[str, str]] | str:
    """Translate pip's configuration (``pip config list``) into ``uv pip install`` arguments.

    Returns ``(args, env)``, or a one-line reason naming the first setting uv cannot be told
    (the caller then installs with pip). pip's listing has already merged its files; as pip
    does, a setting of the ``[install]`` section overrides the same one of ``[global]``, and an
    environment variable (``:env:``, e.g. ``PIP_FIND_LINKS``) overrides both; other commands'
    sections do not apply. ``--index-strategy unsafe-best-match`` makes uv choose as pip does,
    the best version across every index (uv's default stops at the first index that has the
    package: older releases from a local mirror). Settings with no effect on what is installed
    (:data:`_PIP_SETTINGS_WITHOUT_EFFECT`) are dropped.
    """
    precedence = {"global": 0, "install": 1, ":env:": 2}
    chosen: dict[str, tuple[int, str]] = {}
    for raw in pip_config_listing.splitlines():
        line = raw.strip()
        if not line:
            continue
        match = re.fullmatch(r"(?P<section>:env:|[A-Za-z0-9_-]+)\.(?P<key>[A-Za-z0-9_-]+)=(?P<value>.*)", line)
        try:
            value = ast.literal_eval(match["value"]) if match else None
        except (SyntaxError, ValueError):
            value = None
        if match is None or not isinstance(value, str):
            return f"pip config list printed {line!r}, which this noxfile cannot read"
        order = precedence.get(match["section"])
        if order is not None and order >= chosen.get(match["key"], (-1, ""))[0]:
            chosen[match["key"]] = (order, value)
    args = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    for key, (_, value) in sorted(chosen.items()):
        if key in _PIP_SETTINGS_WITHOUT_EFFECT:
            continue
        if key == "index-url":
            args += ["--index-url", value]
        elif key in _PIP_LIST_SETTINGS:
            for item in value.split():
                args += [_PIP_LIST_SETTINGS[key], item]
        elif key == "no-index":
            if value.strip().lower() in ("1", "true", "yes", "on"):
                args.append("--no-index")
        elif key == "cert":
            env["SSL_CERT_FILE"] = value
        elif key in ("timeout", "default-timeout"):
            env["UV_HTTP_TIMEOUT"] = value
        else:
            return f"pip's setting {key!r} has no uv equivalent here"
    return args, env


def _installer() -> str:
    name = os.environ.get(INSTALLER_ENV, "").strip() or "uv"
    if name not in INSTALLERS:
        raise SystemExit(f"{INSTALLER_ENV}={name!r}: expected one of {', '.join(INSTALLERS)}")
    return name


def install(session: nox.Session, python: str, requirements: list[str]) -> None:
    """Install ``requirements`` into the venv of ``python`` with the chosen installer."""
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if _installer() == "uv":
        listing = session.run(python, "-m", "pip", "config", "list", silent=True, external=True)
        settings = uv_settings(str(listing or ""))
        if isinstance(settings, str):
            session.log(f"{settings}: installing with pip ({INSTALLER_ENV}=pip to choose it)")
        else:
            args, env = settings
            session.run(*pip, UV_SPEC, external=True)
            session.run(python, "-m", "uv", "pip", "install", "-q", "--python", python,
                        "--compile-bytecode", *args, *requirements, external=True, env=env)
            return
    session.run(*pip, *requirements, external=True)


def _shared_cpu_python(session: nox.Session) -> str:
    """Create (once) and return the shared CPU venv's interpreter."""
    python = _venv_python(SHARED_VENV)
    stamp = SHARED_VENV / ".torchtitan_spmd-stamp"
    want = _install_stamp("cpu")
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(SHARED_VENV), external=True)
    if not stamp.exists() or stamp.read_text() != want:
        install(session, str(python), [TORCH_SPEC, "-e", f"{ROOT}[dev]", "numpy"])
        session.run(str(python), "-c", "import torch; print('torch', torch.__version__)",
                    external=True)
        stamp.write_text(want)
    return str(python)


#: The environment of the test sessions (``cpu_tests``, ``stack``, ``docs_long``): Python may write
#: its bytecode caches (``__pycache__``, ignored by git) even where ``PYTHONDONTWRITEBYTECODE`` is
#: set, as on the project's machines. Without them every fresh interpreter of the suite (the
#: ``torchrun`` ranks, the CLI and docs subprocesses, each xdist worker and stack prefix, whose
#: pytest also rewrites every test module's asserts) compiles the package and the tests again from
#: source: 13.6 CPU s against 8.3 for one collection of ``tests/``, 0.35 s for each
#: ``import torchtitan_spmd.train`` (docs/benchmarks.md, "Round five").
BYTECODE_ENV = {"PYTHONDONTWRITEBYTECODE": ""}


#: The folder through which the test processes of one session (the pytest-xdist workers, the
#: stack check's prefixes) share DTensor's sharding propagations
#: (``torchtitan_spmd/distributed/sharding_memo.py``): made empty for each session and removed
#: after it, since a result is valid only for the code and torch that computed it.
SHARDING_MEMO_DIR_ENV = "TORCHTITAN_SPMD_SHARDING_MEMO_DIR"


@contextlib.contextmanager
def _fresh_sharding_memo() -> Iterator[dict[str, str]]:
    """The environment naming a new, empty sharding-memo folder; the folder goes afterwards."""
    folder = tempfile.mkdtemp(prefix="tts-sharding-memo-")
    try:
        yield {SHARDING_MEMO_DIR_ENV: folder}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: pytest-xdist workers for ``cpu_tests``: one per core by default (CI's machine has 2);
#: ``TORCHTITAN_SPMD_TEST_WORKERS=1`` runs every test in one process (e.g. to debug).
TEST_WORKERS_ENV = "TORCHTITAN_SPMD_TEST_WORKERS"


def _xdist_args() -> list[str]:
    """``-n N --dist loadfile`` for N > 1 workers, else nothing (one pytest process).

    Whole files to a worker: a module's shared fixtures (one training run read by many tests,
    e.g. tests/layer3_runtime/test_once_per_job.py) and its cached references then run once, not
    once per worker that got one of its tests.

    Each worker runs its tests' torch on one thread (``OMP_NUM_THREADS=1``, as the forked ranks
    and torchrun's children already do): N workers on N cores, not N x N threads. Measured in
    docs/benchmarks.md ("The test suite").
    """
    raw = os.environ.get(TEST_WORKERS_ENV, "").strip() or str(os.cpu_count() or 1)
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"{TEST_WORKERS_ENV}={raw!r}: expected a whole number >= 1")
    workers = int(raw)
    return [] if workers == 1 else ["-n", str(workers), "--dist", "loadfile"]


@nox.session(venv_backend="none")
def cpu_tests(session: nox.Session) -> None:
    """The CPU test matrix in one pytest run: backend-agnostic tests once, then each backend's.

    ``-- --backend=NAME`` keeps one tier (``common``, ``default``, ``full_dtensor``,
    ``spmd_types``); any other pytest option goes there too. One run, not one per tier: the
    tiers share one collection and their cached references, and pytest-xdist spreads them over
    the cores (:data:`TEST_WORKERS_ENV`).

    On the pinned torch by default; ``TORCHTITAN_SPMD_TORCH=torch==2.11.0`` runs
    them on that torch, in its own virtualenv (a large download: not for CI).
    """
    python = _shared_cpu_python(session)
    xdist = _xdist_args()
    with _fresh_sharding_memo() as memo_env:
        session.run(
            python, "-m", "pytest", "tests", *xdist, *session.posargs,
            external=True,  # exit 5 (no test collected) fails the session
            env={**BYTECODE_ENV, **memo_env, **_spmd_types_env(session, python),
                 **({"OMP_NUM_THREADS": "1"} if xdist else {})},
        )


#: ``TORCHTITAN_SPMD_SPMD_TYPES=spmd-types==0.2.3`` runs the CPU sessions on that spmd_types
#: (upstream b5bcd76's pin) instead of the venv's 0.3.x: installed with ``--no-deps`` into its
#: own folder under ``.nox/`` and put first on ``PYTHONPATH`` (small, pure Python; torch is
#: the shared venv's).
SPMD_TYPES_SPEC = os.environ.get("TORCHTITAN_SPMD_SPMD_TYPES", "").strip()


def _spmd_types_env(session: nox.Session, python: str) -> dict[str, str]:
    if not SPMD_TYPES_SPEC:
        return {}
    target = ROOT / ".nox" / ("_" + re.sub(r"[^A-Za-z0-9.]+", "-", SPMD_TYPES_SPEC))
    if not (target / "spmd_types").is_dir():
        session.run(python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
                    "--target", str(target), SPMD_TYPES_SPEC, external=True)
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    session.log(f"spmd_types from {target} ({SPMD_TYPES_SPEC})")
    return {"PYTHONPATH": path}


@nox.session(venv_backend="none")
@nox.parametrize("backend", ["common", *BACKENDS])
def gpu_tests(session: nox.Session, backend: str) -> None:
    """Run the tests on CUDA, reusing the system's preinstalled torch.

    Skips with exit 0 when no CUDA device is visible.
    """
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        reason = "torch is not importable" if probe.returncode not in (0, 3) else "no CUDA device"
        session.skip(f"gpu_tests skipped: {reason} for {sys.executable}.")
    venv = ROOT / ".nox" / "_shared-gpu"
    python = _venv_python(venv)
    if not python.exists():
        session.run(
            sys.executable, "-m", "venv", "--system-site-packages", str(venv), external=True
        )
        # Reuse the preinstalled torch (right CUDA build); do not let pip replace it.
        session.run(str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT),
                    external=True)
    session.run(
        str(python), "-m", "pytest", "tests", f"--backend={backend}", "--device=cuda",
        *session.posargs, external=True,  # exit 5 (no test collected) fails the session
        env={"TORCHTITAN_SPMD_DEVICE": "cuda"},
    )


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check over the package, compat/, tests/, stack/ and bench/."""
    python = _shared_cpu_python(session)
    session.run(python, "-m", "ruff", "check", "torchtitan_spmd", "compat", "tests", "stack",
                "bench", "noxfile.py", external=True)


@nox.session(venv_backend="none")
def stack(session: nox.Session) -> None:
    """Check the stacked series: layer ownership, upward imports, each prefix green."""
    python = _shared_cpu_python(session)
    with _fresh_sharding_memo() as memo_env:
        session.run(python, "-m", "stack", "check", *session.posargs, external=True,
                    env={**BYTECODE_ENV, **memo_env})


@nox.session(venv_backend="none")
def train(session: nox.Session) -> None:
    """README command 1: a multi-process CPU training run on the debug model."""
    python = _shared_cpu_python(session)
    args = session.posargs or [
        "--parallelism.data_parallel_shard_degree", "2",
        "--parallelism.tensor_parallel_degree", "2",
        "--training.steps", "50",
    ]
    if not {"--module", "--job.config_file", "--job.config-file"} & {a.split("=")[0] for a in args}:
        args = ["--module", "llama3", "--config", "llama3_debugmodel", *args]
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    session.run(*torchrun, "-m", "torchtitan_spmd.train", *args, external=True,
                env={"OMP_NUM_THREADS": "1"})


@nox.session(venv_backend="none")
def docs_long(session: nox.Session) -> None:
    """Run every code block of README.md and docs/ tagged ``ci`` or ``long`` (not a default session).

    The long ones are the multi-process training runs, the checkpoint chain, the Hugging Face
    round trip and long-context CP: tens of minutes on 2 cores. ``cpu_tests`` runs the ``ci`` ones.
    """
    python = _shared_cpu_python(session)
    session.run(python, "-m", "pytest", "tests/docs", "-p", "no:cacheprovider", "-s", *session.posargs,
                external=True, env={**BYTECODE_ENV, "DOCS_LONG": "1"})

"""The nox sessions: a session that collects no test fails; another torch gets its own venv.

The real noxfile runs under the real nox, in a scratch project whose shared venv is
this interpreter (so nothing is installed) and whose tests are tiny.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("nox")

_CONFTEST = '''
def pytest_addoption(parser):
    parser.addoption("--backend", default="all")
'''


def _noxfile_values(root: Path, torch_spec: str) -> dict[str, str]:
    """The noxfile's torch pin, shared venv and install stamp, read in a fresh process."""
    code = (
        "import json, runpy, sys\n"
        "m = runpy.run_path(sys.argv[1])\n"
        "print(json.dumps({'spec': m['TORCH_SPEC'], 'venv': str(m['SHARED_VENV']),\n"
        "                  'stamp': m['_install_stamp']('cpu'),\n"
        "                  'range': str(m['shared_venv']('torch>=2.13,<2.14'))}))\n"
    )
    env = {**os.environ, "TORCHTITAN_SPMD_TORCH": torch_spec}
    proc = subprocess.run([sys.executable, "-c", code, str(root / "noxfile.py")], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _scratch_project(tmp_path: Path, test_body: str) -> Path:
    """A copy of noxfile.py + pyproject.toml whose shared venv runs this interpreter."""
    root = tmp_path / "proj"
    (root / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "noxfile.py", root / "noxfile.py")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    (root / "tests" / "conftest.py").write_text(_CONFTEST)
    (root / "tests" / "test_it.py").write_text(test_body)
    values = _noxfile_values(root, "")
    venv = Path(values["venv"])
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (venv / ".torchtitan_spmd-stamp").write_text(values["stamp"])
    return root


def _nox(root: Path, session: str, *posargs: str, workers: str = "1") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k != "TORCHTITAN_SPMD_TORCH" and not k.endswith("_PROFILE")}  # not the outer profile's
    env["TORCHTITAN_SPMD_TEST_WORKERS"] = workers
    return subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(root / "noxfile.py"), "-s", session,
         *(["--", *posargs] if posargs else [])],
        cwd=root, capture_output=True, text=True, timeout=120, env=env,
    )


def test_cpu_tests_fail_when_no_test_is_collected(tmp_path: Path) -> None:
    root = _scratch_project(tmp_path, "X = 1  # no tests here\n")
    proc = _nox(root, "cpu_tests", "--backend=common")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "no tests ran" in out and "Session cpu_tests failed" in out, out


def test_cpu_tests_pass_when_tests_pass(tmp_path: Path) -> None:
    root = _scratch_project(tmp_path, "def test_ok():\n    assert True\n")
    proc = _nox(root, "cpu_tests", "--backend=common")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed" in out, out


def test_cpu_tests_spread_over_the_workers_asked_for(tmp_path: Path) -> None:
    """Two workers: pytest-xdist starts two, each test's torch on one thread; a bad count is one line."""
    root = _scratch_project(tmp_path, "import os\n\n\ndef test_a():\n    assert os.environ['OMP_NUM_THREADS'] == '1'\n\n\n"
                                      "def test_b():\n    assert os.environ['PYTEST_XDIST_WORKER']\n")
    proc = _nox(root, "cpu_tests", workers="2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "2 workers [2 items]" in out and "2 passed" in out, out
    bad = _nox(root, "cpu_tests", workers="two")
    assert bad.returncode != 0 and "TORCHTITAN_SPMD_TEST_WORKERS='two': expected a whole number >= 1" in \
        bad.stdout + bad.stderr


def test_cpu_tests_cache_bytecode_where_the_environment_says_not_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``PYTHONDONTWRITEBYTECODE=1`` (the project's machines set it) the session's pytest and
    the interpreters it starts still write their bytecode caches, so no fresh rank or subprocess
    compiles the package again; the test module's own rewritten cache appears in ``__pycache__``."""
    body = ("import subprocess, sys\n\n\n"
            "def test_writes():\n"
            "    assert sys.dont_write_bytecode is False\n"
            "    child = subprocess.run([sys.executable, '-c', 'import sys; print(sys.dont_write_bytecode)'],\n"
            "                           capture_output=True, text=True, check=True)\n"
            "    assert child.stdout.strip() == 'False'\n")
    root = _scratch_project(tmp_path, body)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    proc = _nox(root, "cpu_tests", "--backend=common")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed" in out, out
    assert list((root / "tests" / "__pycache__").glob("test_it.*.pyc")), out


def test_cpu_tests_share_a_fresh_sharding_memo_folder_each_run(tmp_path: Path) -> None:
    """The session's test processes get one empty folder for DTensor's sharding propagations
    (``torchtitan_spmd/distributed/sharding_memo.py``), never a folder an earlier run filled
    (its results may come from other code), and it is gone after the session."""
    seen = tmp_path / "seen.txt"
    body = ("import os\nfrom pathlib import Path\n\n\n"
            "def test_fresh():\n"
            "    folder = Path(os.environ['TORCHTITAN_SPMD_SHARDING_MEMO_DIR'])\n"
            "    assert folder.is_dir() and not any(folder.iterdir()), list(folder.iterdir())\n"
            "    (folder / '1-1.memo').write_bytes(b'from this run')\n"
            f"    with open({str(seen)!r}, 'a') as f:\n"
            "        f.write(str(folder) + '\\n')\n")
    root = _scratch_project(tmp_path, body)
    for _ in range(2):
        proc = _nox(root, "cpu_tests", "--backend=common")
        assert proc.returncode == 0 and "1 passed" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    folders = seen.read_text().split()
    assert len(folders) == 2 and not any(Path(f).exists() for f in folders), folders


def test_another_torch_gets_its_own_venv() -> None:
    pinned = _noxfile_values(ROOT, "")
    assert pinned["spec"] == "torch==2.14.1"
    assert pinned["venv"] == str(ROOT / ".nox" / "_shared-cpu")
    other = _noxfile_values(ROOT, "torch==2.11.0")
    assert other["spec"] == "torch==2.11.0"
    assert other["venv"] == str(ROOT / ".nox" / "_shared-cpu-torch-2.11.0")
    assert other["range"] == str(ROOT / ".nox" / "_shared-cpu-torch-2.13-2.14")
    assert other["stamp"] != pinned["stamp"]


@pytest.fixture(scope="module")
def noxfile_module() -> dict[str, Any]:
    import runpy

    return runpy.run_path(str(ROOT / "noxfile.py"))


def test_uv_is_told_the_settings_pip_would_use(noxfile_module: dict[str, Any]) -> None:
    uv_settings = noxfile_module["uv_settings"]
    listing = "\n".join([
        ":env:.cert='/c.pem'", ":env:.find-links='/w'", ":env:.disable-pip-version-check='1'",
        ":env:.default-timeout='180'", ":env:.config-file='/p.conf'",
        "download.dest='/x'", "global.find-links='/old'", "global.constraint='/k.txt'",
        "global.extra-index-url='file:///a/simple file:///b/simple'", "install.no-index='false'",
        "global.index-url='https://g/simple'", "install.index-url='https://i/simple'",
    ])
    args, env = uv_settings(listing)
    assert args == ["--index-strategy", "unsafe-best-match", "--constraint", "/k.txt",
                    "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
                    "--find-links", "/w", "--index-url", "https://i/simple"]
    assert env == {"SSL_CERT_FILE": "/c.pem", "UV_HTTP_TIMEOUT": "180"}
    # the environment overrides [install], which overrides [global]
    args, _ = uv_settings("global.index-url='https://g'\n:env:.index-url='https://e'\n"
                          "install.index-url='https://i'\ninstall.no-index='1'")
    assert args[-3:] == ["--index-url", "https://e", "--no-index"]


@pytest.mark.parametrize(("line", "named"), [
    ("global.pre='true'", "'pre'"),                 # changes what is chosen: not dropped
    ("install.require-hashes='1'", "'require-hashes'"),
    ("global.find-links /w", "global.find-links /w"),  # not pip's format
])
def test_a_pip_setting_uv_cannot_be_told_is_named(noxfile_module: dict[str, Any], line: str,
                                                   named: str) -> None:
    reason = noxfile_module["uv_settings"](f"global.cert='/c.pem'\n{line}")
    assert isinstance(reason, str) and named in reason, reason


def _tiny_wheel(folder: Path) -> Path:
    """A pure-Python wheel ``tts_probe`` 1.0, written by hand (no build backend needed)."""
    import base64
    import hashlib
    import zipfile

    files = {"tts_probe/__init__.py": b"VALUE = 7\n",
             "tts_probe-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tts-probe\nVersion: 1.0\n",
             "tts_probe-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                              b"Tag: py3-none-any\n"}
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}\n" for name, data in files.items())
    files["tts_probe-1.0.dist-info/RECORD"] = (record + "tts_probe-1.0.dist-info/RECORD,,\n").encode()
    folder.mkdir(parents=True)
    wheel = folder / "tts_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def test_uv_installs_from_where_pip_is_configured_to_look(noxfile_module: dict[str, Any],
                                                          tmp_path: Path) -> None:
    """pip's own listing, translated, lets uv find a package only pip's settings point at."""
    _tiny_wheel(tmp_path / "wheels")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nno-index = true\nfind-links = {tmp_path / 'wheels'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env["PIP_CONFIG_FILE"] = str(conf)
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, check=True,
                             capture_output=True, text=True, timeout=60).stdout
    settings = noxfile_module["uv_settings"](listing)
    assert not isinstance(settings, str), settings
    args, uv_env = settings
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True,
                   timeout=60)
    python = tmp_path / "venv" / "bin" / "python"
    env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    proc = subprocess.run([sys.executable, "-m", "uv", "pip", "install", "-q", "--python", str(python),
                           "--compile-bytecode", *args, "tts-probe"], env={**env, **uv_env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([str(python), "-c", "import tts_probe; print(tts_probe.VALUE)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "7", out.stderr

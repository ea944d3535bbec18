"""Fixtures for the stack tool's tests; the helpers live in ``stack_synth``."""

from __future__ import annotations

from pathlib import Path

import pytest
from stack_synth import Repo, make_repo


@pytest.fixture
def synthetic_repo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Repo:
    return make_repo(tmp_path / "proj", capsys)

"""Under CI=true a missing data directory fails the suite; locally it is a clear skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEEDS_DATA = "tests/test_ci.py::test_the_data_directory_holds_sst2"  # light: no training imports


def test_the_data_directory_holds_sst2(data_dir: Path) -> None:
    assert (data_dir / "sst2" / "train.tsv").is_file()


@pytest.mark.parametrize("ci, outcome", [("true", "1 error"), ("", "1 skipped")])
def test_missing_data_fails_under_ci_and_skips_locally(ci: str, outcome: str, tmp_path: Path) -> None:
    env = {**os.environ, "CI": ci, "FINETUNE_DATA_DIR": str(tmp_path / "no-data")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", NEEDS_DATA],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert outcome in proc.stdout, proc.stdout[-2000:]
    assert "data directory not found" in proc.stdout
    assert proc.returncode == (1 if ci else 0)

"""The code stays linted, formatted and typed: ruff and mypy run as tests (config in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )


@pytest.mark.timeout(120)
def test_ruff_check():
    result = run_tool("ruff", "check", ".", timeout_s=90)
    assert result.returncode == 0, f"`ruff check .` failed:\n{result.stdout}{result.stderr}"


@pytest.mark.timeout(120)
def test_ruff_format():
    result = run_tool("ruff", "format", "--check", ".", timeout_s=90)
    assert result.returncode == 0, (
        f"`ruff format --check .` failed (run `ruff format`):\n{result.stdout}{result.stderr}"
    )


@pytest.mark.timeout(300)
def test_mypy():
    result = run_tool("mypy", timeout_s=240)
    assert result.returncode == 0, f"`mypy` failed:\n{result.stdout}{result.stderr}"

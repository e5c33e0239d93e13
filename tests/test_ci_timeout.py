"""A hung test fails on its own within the per-test timeout, instead of eating CI's 90 minutes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_the_suite_has_a_per_test_timeout():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 60 <= int(options["timeout"]) <= 600


def test_a_hanging_test_is_stopped_and_fails(tmp_path):
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hang():\n    time.sleep(600)\n")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-o", "timeout=2", str(tmp_path / "test_hang.py")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Timeout" in result.stdout and "1 failed" in result.stdout
    assert time.monotonic() - start < 120  # generous: proves it stopped, not how fast

"""``tools/test.sh`` never installs into a global interpreter without being told to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _global_python() -> Path | None:
    base = Path(sys.base_prefix) / "bin" / "python3"
    return base if sys.prefix != sys.base_prefix and base.exists() else None


@pytest.mark.skipif(_global_python() is None, reason="the suite itself runs outside a venv")
def test_refuses_a_global_interpreter(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": str(_global_python())}
    env.pop("ALLOW_GLOBAL_INSTALL", None)
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run(
        ["bash", str(REPO / "tools" / "test.sh"), "--collect-only"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "is not a virtual environment; not installing into it" in result.stderr
    assert "python3 -m venv .venv" in result.stderr
    assert "ALLOW_GLOBAL_INSTALL=1" in result.stderr
    assert "installing the dev tools" not in result.stderr  # refused before pip ran

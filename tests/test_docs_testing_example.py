"""docs/testing.md's downstream example runs, as a downstream project would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "test_summarizer.py"


def test_the_downstream_example_passes(tmp_path: Path) -> None:
    # Outside the repository (no conftest, no pyproject of ours): only the installed library
    # and its pytest plugin.
    env = {k: v for k, v in os.environ.items() if not re.match(r"^(LLM|PGW)_|__", k)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE),
         "-o", "asyncio_mode=auto", "--rootdir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


def test_the_doc_shows_the_example_and_names_the_api() -> None:
    doc = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
    assert "examples/test_summarizer.py" in doc
    for name in ("script(", "set_default(", "Reply.ok(", "Reply.error(", "fake_upstream",
                 "received(", "requests(", "wait_for_requests("):  # fmt: skip
        assert name in doc, name

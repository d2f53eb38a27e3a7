"""The soak harness lives in tools/soak (scripts, not a package): its modules are imported
from there."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "soak"))

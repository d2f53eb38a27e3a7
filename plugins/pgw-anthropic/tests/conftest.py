"""The contract module's asserts are rewritten for readable failures."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("polygateway.testing.contracts")

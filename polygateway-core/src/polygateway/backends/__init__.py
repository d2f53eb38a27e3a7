"""Governance and cache backends shipped with the core (``memory``).

The argument checks every backend shares live in ``polygateway.validation`` (public, so that
plugins use the same ones).
"""

from __future__ import annotations

from polygateway.validation import MAX_TOKENS, check_token_count

__all__ = ["MAX_TOKENS", "check_token_count"]

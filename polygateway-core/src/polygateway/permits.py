"""The bookkeeping every rate-limiter backend's permit shares (public: plugins build on it).

A permit (``ports.Permit``) is one admitted attempt. Its ``settle`` and ``release`` must act
once and be no-ops afterwards (a retry layer may call them again on an error path), ``settle``
must refuse a bad token count before anything changes, and it only matters when the actual
count differs from the estimate charged at admission. ``OnceOnlyPermit`` does all of that; a
backend subclasses it and writes only its effects: ``_apply_settle(delta)`` and
``_apply_release()``, both synchronous (the memory backend changes its counters, the Redis
backend queues a write).
"""

from __future__ import annotations

from polygateway.validation import MAX_TOKENS, check_token_count


class OnceOnlyPermit:
    """Base of ``ports.Permit`` implementations: ``settle`` and ``release`` act once."""

    __slots__ = ("_est_tokens", "_released", "_settled", "_source")

    def __init__(self, source: str, est_tokens: int) -> None:
        self._source = source
        self._est_tokens = est_tokens
        self._settled = False
        self._released = False

    @property
    def lease_id(self) -> str:
        raise NotImplementedError

    @property
    def source(self) -> str:
        return self._source

    @property
    def est_tokens(self) -> int:
        return self._est_tokens

    async def settle(self, actual_tokens: int) -> None:
        # The usual count passes the plain check; anything else gets the full one (and its
        # error message).
        if type(actual_tokens) is int and 0 <= actual_tokens <= MAX_TOKENS:
            actual = actual_tokens
        else:
            actual = check_token_count(actual_tokens, "actual_tokens")
        if self._settled:
            return
        self._settled = True
        delta = actual - self._est_tokens
        if delta:
            self._apply_settle(delta)

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._apply_release()

    def _apply_settle(self, delta: int) -> None:
        """Move the TPM charge by ``delta`` tokens (actual minus estimated, never 0)."""
        raise NotImplementedError

    def _apply_release(self) -> None:
        """Free the concurrency slot."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} lease_id={self.lease_id!r} source={self._source!r} "
            f"est_tokens={self._est_tokens} settled={self._settled} released={self._released}>"
        )


__all__ = ["OnceOnlyPermit"]

"""Model prices: token usage -> money (M2 §6).

A price table maps a model name to ``{"input_per_1m": x, "output_per_1m": y}`` (money per one
million tokens, one currency for the whole table), optionally with ``"cached_input_per_1m"``
(prompt tokens read from the provider's prompt cache) and ``"cache_write_per_1m"`` (prompt
tokens written to it); both default to ``input_per_1m``. An optional top-level
``"currency": "USD"`` labels the table's currency (reports print it next to costs). The library
ships no prices: they change with the gateway's billing and a stale default would hide real
cost.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polygateway.errors import ConfigError
from polygateway.frozen import value_methods

logger = logging.getLogger(__name__)

PRICE_FIELDS: tuple[str, str] = ("input_per_1m", "output_per_1m")
OPTIONAL_PRICE_FIELDS: tuple[str, str] = ("cached_input_per_1m", "cache_write_per_1m")
CURRENCY_KEY = "currency"
"""Top-level key of a price table naming its currency (not a model)."""


@value_methods
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ModelPrice:
    """Money per one million prompt / completion tokens (cache rates: ``None`` = input rate)."""

    input_per_1m: float
    output_per_1m: float
    cached_input_per_1m: float | None = None
    cache_write_per_1m: float | None = None


class PricingTable:
    """``cost = prompt/1e6*input + completion/1e6*output``; unknown model -> ``None``.

    Cached and cache-written prompt tokens (parts of ``prompt``) are priced at their own rates
    instead of the input rate, never both.

    An unknown model is logged once per model (not per call) so a missing price cannot flood
    the log. Bad entries raise ``ConfigError`` naming the model and the field.
    """

    __slots__ = ("_origin", "_prices", "_unpriced_warned", "currency")

    def __init__(self, prices: Mapping[str, Any], *, origin: str = "pricing") -> None:
        self._origin = origin
        self._prices: dict[str, ModelPrice] = _validate(prices, origin)
        label = prices.get(CURRENCY_KEY) if isinstance(prices, Mapping) else None
        self.currency: str = label if isinstance(label, str) else ""
        """The table's currency label (``""`` when the file names none)."""
        self._unpriced_warned: set[str] = set()

    @classmethod
    def from_file(cls, path: str) -> PricingTable:
        """Load a JSON price table; any problem is a ``ConfigError`` naming ``path``."""
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            raise ConfigError(f"pricing file {path}: not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"pricing file {path}: cannot be read ({exc})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"pricing file {path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                f"{exc.msg}"
            ) from None
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"pricing file {path}: expected a JSON object mapping model -> "
                f'{{"input_per_1m": ..., "output_per_1m": ...}}, got {type(data).__name__}'
            )
        return cls(data, origin=f"pricing file {path}")

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self._prices)

    def price(self, model: str) -> ModelPrice | None:
        return self._prices.get(model)

    def cost(
        self,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float | None:
        price = self._prices.get(model)
        if price is None:
            if model not in self._unpriced_warned:
                self._unpriced_warned.add(model)
                logger.warning(
                    "no price for model %r in %s: its calls are recorded with cost=None",
                    model,
                    self._origin,
                )
            return None
        cost = (
            prompt_tokens / 1e6 * price.input_per_1m + completion_tokens / 1e6 * price.output_per_1m
        )
        if cached_tokens or cache_write_tokens:
            cached_rate = price.cached_input_per_1m
            write_rate = price.cache_write_per_1m
            if cached_rate is not None:
                cost += cached_tokens / 1e6 * (cached_rate - price.input_per_1m)
            if write_rate is not None:
                cost += cache_write_tokens / 1e6 * (write_rate - price.input_per_1m)
        return cost

    def __repr__(self) -> str:
        return f"PricingTable({len(self._prices)} models from {self._origin})"


def _is_price(value: object) -> bool:
    # bool is an int subclass: reject it so `true` cannot pass as a price of 1.
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= 0
    )


def _validate(prices: object, origin: str) -> dict[str, ModelPrice]:
    # Typed loosely on purpose: the input usually comes straight from JSON.
    if not isinstance(prices, Mapping):
        raise ConfigError(
            f"{origin}: expected a mapping model -> prices, got {type(prices).__name__}"
        )
    problems: list[str] = []
    table: dict[str, ModelPrice] = {}
    for model, entry in prices.items():
        if model == CURRENCY_KEY:
            if not isinstance(entry, str) or not entry.strip():
                problems.append(f'{origin}: "{CURRENCY_KEY}" must be a label such as "USD"')
            continue
        if not isinstance(model, str) or not model:
            problems.append(f"{origin}: model names must be non-empty strings, got {model!r}")
            continue
        if not isinstance(entry, Mapping):
            problems.append(
                f'{origin}: model {model!r}: expected {{"input_per_1m": ..., "output_per_1m": '
                f"...}}, got {type(entry).__name__}"
            )
            continue
        values: list[float] = []
        for name in PRICE_FIELDS:
            value = entry.get(name)
            if value is None:
                problems.append(f"{origin}: model {model!r}: missing field {name!r}")
            elif not _is_price(value):
                problems.append(
                    f"{origin}: model {model!r}: field {name!r} must be a finite number >= 0, "
                    f"got {value!r}"
                )
            else:
                values.append(float(value))
        cache_rates: list[float | None] = []
        for name in OPTIONAL_PRICE_FIELDS:
            value = entry.get(name)
            if value is None:
                cache_rates.append(None)
            elif _is_price(value):
                cache_rates.append(float(value))
            else:
                problems.append(
                    f"{origin}: model {model!r}: field {name!r} must be a finite number >= 0, "
                    f"got {value!r}"
                )
        allowed = PRICE_FIELDS + OPTIONAL_PRICE_FIELDS
        unknown = sorted(str(k) for k in entry if k not in allowed)
        if unknown:
            problems.append(
                f"{origin}: model {model!r}: unknown field(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(allowed)}"
            )
        if len(values) == 2 and len(cache_rates) == 2 and not unknown:
            table[model] = ModelPrice(values[0], values[1], cache_rates[0], cache_rates[1])
    if problems:
        raise ConfigError(problems)
    return table


__all__ = ["CURRENCY_KEY", "OPTIONAL_PRICE_FIELDS", "PRICE_FIELDS", "ModelPrice", "PricingTable"]

"""Metrics aggregated in plain Python, exported as an OTLP ``ExportMetricsServiceRequest``.

``PlainMeter`` has the three ``create_*`` methods the recorder's instruments use (the same
names and arguments as an OpenTelemetry ``Meter``), so one definition of the instruments
(``pgw_otel.recorder._Metrics``) feeds either the SDK or these aggregates. Counters sum,
gauges keep the last value, histograms count into explicit buckets with ``bisect`` (a value
on a boundary falls in the bucket it closes, as in the SDK) and keep the sum, min and max;
every point is keyed by its attributes in the order they were given. Cumulative temporality.

Each instrument keeps at most ``point_limit`` attribute sets (``POINT_LIMIT``, the SDK's
default cardinality limit): points are kept for the process's life and some attributes come
from upstream answers (``gen_ai.response.model``), so without a limit a proxy returning a new
model id per call would grow every export. Beyond the limit a measurement with a new attribute
set goes to one overflow point, attributes ``otel.metric.overflow=true``, as in the SDK, and
counts in the instrument's ``overflowed``.

Only the recorder's batch thread touches a ``PlainMeter``: no locks. ``request`` builds the
export with the generated protobuf classes, once per export interval (never per call). A
writer that counts into cells of its own (``pgw_otel.fast``) registers their fold with
``on_settle``: ``settle`` (which ``request`` and ``overflowed`` call first) adds them into the
counters.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "OVERFLOW_KEY",
    "POINT_LIMIT",
    "HistogramPoint",
    "Key",
    "PlainCounter",
    "PlainGauge",
    "PlainHistogram",
    "PlainMeter",
]

Key = tuple[tuple[str, Any], ...]

POINT_LIMIT = 2000
"""Attribute sets kept per instrument (the SDK's default cardinality limit)."""
OVERFLOW_KEY: Key = (("otel.metric.overflow", True),)
"""The point measurements with attribute sets beyond the limit go to."""


class _NumberPoints:
    """An instrument's number points per attribute set, at most ``limit`` of them."""

    __slots__ = ("description", "limit", "name", "overflowed", "points", "unit")

    def __init__(self, name: str, unit: str, description: str, limit: int = POINT_LIMIT) -> None:
        self.name, self.unit, self.description = name, unit, description
        self.points: dict[Key, int | float] = {}
        self.limit = limit
        self.overflowed = 0


class PlainCounter(_NumberPoints):
    __slots__ = ()

    def add(self, amount: float, attributes: Mapping[str, Any]) -> None:
        self.add_key(amount, tuple(attributes.items()))

    def add_key(self, amount: float, key: Key) -> None:
        """``add`` with the attributes as their key (``tuple(attributes.items())``)."""
        points = self.points
        total = points.get(key)
        if total is not None:
            points[key] = total + amount
        elif len(points) < self.limit:
            points[key] = amount
        else:
            self.overflowed += 1
            points[OVERFLOW_KEY] = points.get(OVERFLOW_KEY, 0) + amount


class PlainGauge(_NumberPoints):
    __slots__ = ()

    def set(self, amount: float, attributes: Mapping[str, Any]) -> None:
        key = tuple(attributes.items())
        if key not in self.points and len(self.points) >= self.limit:
            self.overflowed += 1
            key = OVERFLOW_KEY
        self.points[key] = amount


class HistogramPoint:
    __slots__ = ("counts", "max", "min", "sum")

    def __init__(self, buckets: int, value: float) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0
        self.min = value
        self.max = value


class PlainHistogram:
    __slots__ = ("bounds", "description", "limit", "name", "overflowed", "points", "unit")

    def __init__(
        self,
        name: str,
        unit: str,
        description: str,
        bounds: Sequence[float],
        limit: int = POINT_LIMIT,
    ) -> None:
        self.name, self.unit, self.description = name, unit, description
        self.bounds = tuple(float(b) for b in bounds)
        self.points: dict[Key, HistogramPoint] = {}
        self.limit = limit
        self.overflowed = 0

    def record(self, amount: float, attributes: Mapping[str, Any]) -> None:
        self.record_key(amount, tuple(attributes.items()))

    def record_key(self, amount: float, key: Key) -> None:
        """``record`` with the attributes as their key (``tuple(attributes.items())``)."""
        self.record_point(amount, self.point_of(key, amount))

    def point_of(self, key: Key, amount: float) -> HistogramPoint:
        """The point of ``key``, made for a first ``amount`` when there is none yet. Points
        are never dropped (cumulative), so a caller recording under one key again and again
        may keep it and use ``record_point``, sparing the key's hash and lookup."""
        point = self.points.get(key)
        if point is None:
            if len(self.points) >= self.limit:
                self.overflowed += 1
                key = OVERFLOW_KEY
                point = self.points.get(key)
            if point is None:
                point = self.points[key] = HistogramPoint(len(self.bounds) + 1, amount)
        return point

    def record_point(self, amount: float, point: HistogramPoint) -> None:
        """``record_key`` into a point ``point_of`` gave."""
        point.counts[bisect_left(self.bounds, amount)] += 1
        point.sum += amount
        if amount < point.min:
            point.min = amount
        elif amount > point.max:
            point.max = amount


class PlainMeter:
    """Instruments aggregating in plain Python (see the module docstring)."""

    def __init__(self, started_ns: int, point_limit: int = POINT_LIMIT) -> None:
        self.started_ns = started_ns
        self.point_limit = point_limit
        """Attribute sets kept per instrument (see the module docstring)."""
        self.instruments: list[PlainCounter | PlainGauge | PlainHistogram] = []
        self._settles: list[Callable[[], None]] = []

    def on_settle(self, fold: Callable[[], None]) -> None:
        """``fold`` adds measurements held elsewhere into the instruments: ``settle`` calls it."""
        self._settles.append(fold)

    def settle(self) -> None:
        """Every measurement held elsewhere (``on_settle``) added into the instruments."""
        for fold in self._settles:
            fold()

    @property
    def overflowed(self) -> int:
        """Measurements that went to an overflow point, over every instrument."""
        self.settle()
        return sum(instrument.overflowed for instrument in self.instruments)

    def create_counter(self, name: str, unit: str = "", description: str = "") -> PlainCounter:
        counter = PlainCounter(name, unit, description, self.point_limit)
        self.instruments.append(counter)
        return counter

    def create_gauge(self, name: str, unit: str = "", description: str = "") -> PlainGauge:
        gauge = PlainGauge(name, unit, description, self.point_limit)
        self.instruments.append(gauge)
        return gauge

    def create_histogram(
        self,
        name: str,
        unit: str = "",
        description: str = "",
        *,
        explicit_bucket_boundaries_advisory: Sequence[float] = (),
    ) -> PlainHistogram:
        histogram = PlainHistogram(
            name, unit, description, explicit_bucket_boundaries_advisory, self.point_limit
        )
        self.instruments.append(histogram)
        return histogram

    def histogram(self, name: str) -> PlainHistogram:
        """The histogram created as ``name``."""
        for instrument in self.instruments:
            if isinstance(instrument, PlainHistogram) and instrument.name == name:
                return instrument
        raise KeyError(name)

    def counter(self, name: str) -> PlainCounter:
        """The counter created as ``name``."""
        for instrument in self.instruments:
            if isinstance(instrument, PlainCounter) and instrument.name == name:
                return instrument
        raise KeyError(name)

    def request(
        self, resource: Mapping[str, Any], scope_name: str, scope_version: str, now_ns: int
    ) -> Any:
        """The ``ExportMetricsServiceRequest`` of every point so far (``None``: no points)."""
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )
        from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
        from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
        from opentelemetry.proto.resource.v1.resource_pb2 import Resource

        self.settle()
        cumulative = pb.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
        started = self.started_ns
        found = []
        for instrument in self.instruments:
            if not instrument.points:
                continue
            metric = pb.Metric(
                name=instrument.name, unit=instrument.unit, description=instrument.description
            )
            if isinstance(instrument, PlainHistogram):
                bounds = list(instrument.bounds)
                metric.histogram.aggregation_temporality = cumulative
                metric.histogram.data_points.extend(
                    pb.HistogramDataPoint(
                        attributes=_key_values(key),
                        count=sum(point.counts),
                        sum=point.sum,
                        bucket_counts=point.counts,
                        explicit_bounds=bounds,
                        min=point.min,
                        max=point.max,
                        start_time_unix_nano=started,
                        time_unix_nano=now_ns,
                    )
                    for key, point in instrument.points.items()
                )
            else:
                points = [
                    _number(
                        pb.NumberDataPoint(
                            attributes=_key_values(key),
                            start_time_unix_nano=started,
                            time_unix_nano=now_ns,
                        ),
                        value,
                    )
                    for key, value in instrument.points.items()
                ]
                if isinstance(instrument, PlainCounter):
                    metric.sum.aggregation_temporality = cumulative
                    metric.sum.is_monotonic = True
                    metric.sum.data_points.extend(points)
                else:
                    metric.gauge.data_points.extend(points)
            found.append(metric)
        if not found:
            return None
        return ExportMetricsServiceRequest(
            resource_metrics=[
                pb.ResourceMetrics(
                    resource=Resource(attributes=_key_values(tuple(resource.items()))),
                    scope_metrics=[
                        pb.ScopeMetrics(
                            scope=InstrumentationScope(name=scope_name, version=scope_version),
                            metrics=found,
                        )
                    ],
                )
            ]
        )


def _number(point: Any, value: int | float) -> Any:
    if isinstance(value, float):
        point.as_double = value
    else:
        point.as_int = value
    return point


def _key_values(key: Key) -> list[Any]:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    out = []
    for name, value in key:
        if isinstance(value, bool):
            any_value = AnyValue(bool_value=value)
        elif isinstance(value, int):
            any_value = AnyValue(int_value=value)
        elif isinstance(value, float):
            any_value = AnyValue(double_value=value)
        else:
            any_value = AnyValue(string_value=str(value))
        out.append(KeyValue(key=name, value=any_value))
    return out

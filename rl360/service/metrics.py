"""Counters, gauges and histograms of one service, written in Prometheus' text exposition format (0.0.4).

    registry = MetricsRegistry()
    runs = registry.counter("rl360_sandbox_runs_total", "Code runs, by outcome.", ["status"])
    runs.inc(status="Finished")
    registry.render()  # the body of GET /metrics

Every metric is declared once with its label names; each update names every label. Values live in this
process (one event loop thread updates them; a lock keeps updates from other threads whole). Label values
are escaped as the format requires (backslash, double quote, newline).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str], lock: threading.Lock):
        self.name, self.help_text, self.label_names = name, help_text, tuple(label_names)
        self._lock = lock

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"metric {self.name} takes labels {list(self.label_names)}, got {sorted(labels)}")
        return tuple(str(labels[name]) for name in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class _Single(_Metric):
    """A metric holding one value per label set (a counter or a gauge)."""

    def __init__(self, *args):
        super().__init__(*args)
        self._values: dict[tuple[str, ...], float] = {}

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, key)} {_number(v)}" for key, v in sorted(self._values.items())]


class Counter(_Single):
    """A count that only goes up."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot go down (inc by {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Single):
    """A value that goes up and down (requests in flight, open connections)."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def add(self, amount: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Histogram(_Metric):
    """Observations counted into cumulative buckets (`le` upper bounds, then +Inf), with their sum and count."""

    kind = "histogram"

    def __init__(self, *args, buckets: Iterable[float] = LATENCY_BUCKETS_S):
        super().__init__(*args)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        if "le" in self.label_names:
            raise ValueError(f"histogram {self.name}: 'le' is reserved for bucket bounds")
        self._series: dict[tuple[str, ...], list[float]] = {}  # per bucket counts..., +Inf count, sum

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            series = self._series.setdefault(key, [0.0] * (len(self.buckets) + 2))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    series[i] += 1
            series[-2] += 1
            series[-1] += value

    def count(self, **labels: str) -> int:
        series = self._series.get(self._key(labels))
        return int(series[-2]) if series else 0

    def lines(self) -> list[str]:
        out = []
        for key, series in sorted(self._series.items()):
            for bound, count in zip(self.buckets, series):
                out.append(f"{self.name}_bucket{_labels(self.label_names, key, le=_number(bound))} {_number(count)}")
            out.append(f"{self.name}_bucket{_labels(self.label_names, key, le='+Inf')} {_number(series[-2])}")
            out.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(series[-1])}")
            out.append(f"{self.name}_count{_labels(self.label_names, key)} {_number(series[-2])}")
        return out


class MetricsRegistry:
    """The metrics of one process, in declaration order."""

    def __init__(self):
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help_text, labels, self._lock))

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help_text, labels, self._lock))

    def histogram(self, name: str, help_text: str, labels: Sequence[str] = (),
                  buckets: Iterable[float] = LATENCY_BUCKETS_S) -> Histogram:
        return self._add(Histogram(name, help_text, labels, self._lock, buckets=buckets))

    def _add(self, metric):
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is declared twice")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        """Every metric in the text exposition format, ending in a newline."""
        with self._lock:
            lines = [line for metric in self._metrics.values() for line in metric.header() + metric.lines()]
        return "\n".join(lines) + "\n"


def _labels(names: Sequence[str], values: Sequence[str], **extra: str) -> str:
    pairs = list(zip(names, values)) + list(extra.items())
    if not pairs:
        return ""
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in pairs) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))

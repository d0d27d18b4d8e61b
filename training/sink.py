"""Where the train loop reports: metrics per step and events (docs/INTERFACES.md).

The loop calls `log` (metrics of a step), `event` (e.g. "conversion_report", "run_info", "checkpoint",
"resumed", "result") and `flush`; whoever made the sink closes it. The same loop thus logs to the API
(workers' MetricStreamer), to a file, to memory in tests, or to nothing. Only rank 0's sink is called.

`log` is called on the training thread every step: implementations must return quickly (batch and send in
the background). `flush` is called before each checkpoint is written and must block until everything
logged so far is durable: a run resumed from that checkpoint continues at the step after it and never logs
the earlier steps again, so a point still in flight when the process died would be lost for good.
"""
from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path


class MetricSink:
    """Base class; every method is a no-op."""

    def log(self, step: int, metrics: dict[str, float], *, tokens: int, wall_time: float) -> None:
        pass

    def event(self, kind: str, **fields) -> None:
        pass

    def flush(self) -> None:
        """Block until everything logged so far is durable (called before each checkpoint)."""

    def close(self) -> None:
        pass


class NullSink(MetricSink):
    """Discards everything."""


class ListSink(MetricSink):
    """Keeps everything in memory (tests, benchmarks)."""

    def __init__(self):
        self.points: list[dict] = []   # {"step", "tokens", "wall_time", "metrics": {...}}
        self.events: list[dict] = []   # {"kind", **fields}
        self.closed = False

    def log(self, step, metrics, *, tokens, wall_time):
        self.points.append({"step": step, "tokens": tokens, "wall_time": wall_time, "metrics": dict(metrics)})

    def event(self, kind, **fields):
        self.events.append({"kind": kind, **fields})

    def close(self):
        self.closed = True

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one metric key, in logging order."""
        return [(p["step"], p["metrics"][key]) for p in self.points if key in p["metrics"]]

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible rather than dropping the point
    return value


class JsonlSink(MetricSink):
    """Appends one JSON object per line: {"type": "metrics", "step", "tokens", "wall_time", "metrics"}
    or {"type": "event", "kind", ...}. Thread-safe. Written to the OS on every event and on close;
    `flush` also fsyncs, so the lines survive a crash of the machine."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def log(self, step, metrics, *, tokens, wall_time):
        line = json.dumps({"type": "metrics", "step": step, "tokens": tokens, "wall_time": wall_time,
                           "metrics": {k: _jsonable(v) for k, v in metrics.items()}})
        with self._lock:
            self._f.write(line + "\n")

    def event(self, kind, **fields):
        line = json.dumps({"type": "event", "kind": kind, **fields}, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def flush(self):
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                os.fsync(self._f.fileno())

    def close(self):
        with self._lock:
            if not self._f.closed:
                self._f.close()

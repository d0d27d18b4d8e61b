"""Export of an experiment's metrics at full resolution, whatever the dashboard shows: every stored point of every
run and key (or of the keys asked for), read from the raw table in (run, key, step) order and streamed, so an
export of millions of points never sits in memory whole. Non-finite values are stored as NULL and come out empty
(CSV) or null (JSON). A CSV text cell that a spreadsheet would run as a formula (it begins with = + - @, a tab or a
carriage return: a label or a metric key anyone can write) is written with a leading single quote (OWASP's advice on
CSV injection); numbers are written as they are."""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator

from sqlalchemy import select

from backend.db import transaction
from backend.models import MetricPoint
from backend.services.runs import get_experiment

# gemm_backend (real | emulated | bf16 | fp32, empty before the run reported it) last: an emulated run's perf/* figures
# are not what the format's hardware would give, and an export read without the dashboard must still say so.
CSV_COLUMNS = ("run_id", "recipe", "label", "key", "step", "tokens", "wall_time", "value", "gemm_backend")
ROWS_PER_FETCH = 20_000
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value):
    """`value` as a CSV cell: text starting like a formula gets a leading single quote; anything else is unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def export_plan(session, experiment_id: int) -> dict:
    """What the stream needs, read before the response starts (a missing experiment is a 404, not a cut stream)."""
    exp = get_experiment(session, experiment_id)
    return {"experiment_id": exp.id, "name": exp.name,
            "runs": {r.id: {"recipe": r.recipe, "label": r.label, "status": r.status, "gemm_backend": r.gemm_backend}
                     for r in exp.runs}}


def _points(sessionmaker, run_ids: list[int], keys: list[str] | None) -> Iterator[tuple]:
    if not run_ids:
        return
    with transaction(sessionmaker) as session:
        stmt = (select(MetricPoint.run_id, MetricPoint.key, MetricPoint.step, MetricPoint.tokens,
                       MetricPoint.wall_time, MetricPoint.value)
                .where(MetricPoint.run_id.in_(run_ids))
                .order_by(MetricPoint.run_id, MetricPoint.key, MetricPoint.step))
        if keys:
            stmt = stmt.where(MetricPoint.key.in_(keys))
        # yield_per streams from a server-side cursor on PostgreSQL instead of fetching every row first.
        yield from session.execute(stmt.execution_options(yield_per=ROWS_PER_FETCH))


def csv_stream(sessionmaker, plan: dict, keys: list[str] | None) -> Iterator[str]:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    runs = plan["runs"]
    # The text of each run once (not per point); the key is checked only when it changes (rows come by run and key).
    text = {rid: (csv_cell(r["recipe"]), csv_cell(r["label"]), csv_cell(r["gemm_backend"])) for rid, r in runs.items()}
    last_key, key_cell = None, None
    for n, (run_id, key, step, tokens, wall_time, value) in enumerate(_points(sessionmaker, list(runs), keys), 1):
        recipe, label, gemm_backend = text[run_id]
        if key != last_key:
            last_key, key_cell = key, csv_cell(key)
        writer.writerow((run_id, recipe, label, key_cell, step, tokens, wall_time, value, gemm_backend))
        if n % 5000 == 0:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


def json_stream(sessionmaker, plan: dict, keys: list[str] | None) -> Iterator[str]:
    """{"experiment_id", "name", "runs": [{"run_id", "recipe", "label", "status", "gemm_backend", "series": {key: {"step": [...],
    "tokens": [...], "wall_time": [...], "value": [...]}}}]}: one series in memory at a time."""
    runs = plan["runs"]
    yield json.dumps({"experiment_id": plan["experiment_id"], "name": plan["name"]})[:-1] + ', "runs": ['
    current_run, current_key, cols = None, None, None
    first_run, emitted = True, set()

    def series_text():
        return json.dumps(current_key) + ": " + json.dumps(
            {"step": cols[0], "tokens": cols[1], "wall_time": cols[2], "value": cols[3]}, allow_nan=False)

    def run_head(run_id):
        head = json.dumps({"run_id": run_id, **runs[run_id]})[:-1]
        return ("" if first_run else ", ") + head + ', "series": {'

    for run_id, key, step, tokens, wall_time, value in _points(sessionmaker, list(runs), keys):
        if run_id != current_run or key != current_key:
            if cols is not None:
                yield series_text()
            if run_id != current_run:
                if current_run is not None:
                    yield "}}"
                    first_run = False
                yield run_head(run_id)
                emitted.add(run_id)
            else:
                yield ", "
            current_run, current_key, cols = run_id, key, ([], [], [], [])
        for col, v in zip(cols, (step, tokens, wall_time, value)):
            col.append(v)
    if cols is not None:
        yield series_text() + "}}"
        first_run = False
    # Runs without any point are listed too, with no series.
    for run_id in runs:
        if run_id not in emitted:
            yield run_head(run_id) + "}}"
            first_run = False
    yield "]}\n"

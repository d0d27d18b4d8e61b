"""stored specs keep the validation windows they ran with: data.val_windows = "first"

`data.val_windows` (training.config) says where a run's validation windows lie in the validation split. Before it
existed every run validated on the *first* val_batches x batch_size windows in a row (for a folder of books: the
first book's held-out tail, perhaps the second's); its default is now "spread" (evenly over the split). A stored spec
without the key would be read with the new default when it is dispatched again (a queued run, the reconciler's
re-send, a resume after a lost worker), and its val loss - the verdict's measure - would change meaning mid-run or
between the recipes of one experiment. This migration writes the definition those specs ran with into them: every
training run's `spec.data` that lacks the key gets "first", and so does the `data_config` of an experiment whose
runs now say "first" (what the dashboard shows; an experiment whose runs say "spread" keeps the user's words). External
runs (recorded, no spec of ours) are left as they are.

Downgrade takes the key out where it is "first" (the code before it did exactly that). A run created after the
upgrade with "spread" keeps its key: the code before this revision refuses such a spec (unknown key
data.val_windows) rather than validating it on other windows than it ran with.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30 03:30:00
"""
import json

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

KEY, LEGACY = "val_windows", "first"
BATCH = 500


def _as_dict(value):
    if isinstance(value, str):  # JSON columns come back decoded; a driver that hands back text is decoded here
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _rewrite(table: str, column: str, change, only=None) -> None:
    """Apply `change(dict) -> dict | None` (None: leave the row) to `column` of every row of `table` (of the ids in
    `only`, when given), in id order."""
    bind = op.get_bind()
    t = sa.table(table, sa.column("id", sa.Integer), sa.column(column, sa.JSON))
    last = 0
    while True:
        rows = bind.execute(sa.select(t.c.id, t.c[column]).where(t.c.id > last).order_by(t.c.id).limit(BATCH)).all()
        if not rows:
            return
        for row_id, value in rows:
            if only is not None and row_id not in only:
                continue
            new = change(_as_dict(value))
            if new is not None:
                bind.execute(t.update().where(t.c.id == row_id).values({column: new}))
        last = rows[-1][0]


def _experiments_whose_runs_say(value: str) -> set:
    runs = sa.table("runs", sa.column("experiment_id", sa.Integer), sa.column("spec", sa.JSON))
    found = set()
    for experiment_id, spec in op.get_bind().execute(sa.select(runs.c.experiment_id, runs.c.spec)):
        spec = _as_dict(spec)
        if spec is not None and isinstance(spec.get("data"), dict) and spec["data"].get(KEY) == value:
            found.add(experiment_id)
    return found


def _add_to_data(data):
    if data is None or KEY in data:
        return None
    return {**data, KEY: LEGACY}


def _spec_with(spec):
    if spec is None or spec.get("external") or not isinstance(spec.get("data"), dict):
        return None
    data = _add_to_data(spec["data"])
    return None if data is None else {**spec, "data": data}


def _drop_from_data(data):
    if data is None or data.get(KEY) != LEGACY:
        return None
    return {k: v for k, v in data.items() if k != KEY}


def _spec_without(spec):
    if spec is None or not isinstance(spec.get("data"), dict):
        return None
    data = _drop_from_data(spec["data"])
    return None if data is None else {**spec, "data": data}


def upgrade() -> None:
    _rewrite("runs", "spec", _spec_with)
    _rewrite("experiments", "data_config", _add_to_data, only=_experiments_whose_runs_say(LEGACY))


def downgrade() -> None:
    _rewrite("runs", "spec", _spec_without)
    _rewrite("experiments", "data_config", _drop_from_data)

"""Helpers of the migrations that write a data key's legacy value into stored specs (0009 data.val_windows, 0010
data.eos_at_split): a key whose default changed when it was added, so a stored spec without it must say what it ran
with before it is dispatched again (a queued run, the reconciler's re-send, a resume after a lost worker).

Upgrade: every training run's `spec.data` that lacks the key gets the legacy value, and so does the `data_config` of
an experiment whose runs now say it (what the dashboard shows; an experiment whose runs say the new value keeps the
user's words). External runs (recorded, no spec of ours) are left as they are. Downgrade: the key comes out where it
holds the legacy value (the code before did exactly that); a spec with the new value keeps it, so the code before
refuses it (unknown key) rather than running it otherwise than it was meant.

Frozen with the revisions that use them: a later change of meaning belongs in a new helper, not here.
"""
from __future__ import annotations

import json

from alembic import op
import sqlalchemy as sa

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


def _experiments_whose_runs_say(key: str, value) -> set:
    runs = sa.table("runs", sa.column("experiment_id", sa.Integer), sa.column("spec", sa.JSON))
    found = set()
    for experiment_id, spec in op.get_bind().execute(sa.select(runs.c.experiment_id, runs.c.spec)):
        spec = _as_dict(spec)
        if spec is not None and isinstance(spec.get("data"), dict) and key in spec["data"] \
                and spec["data"][key] == value and type(spec["data"][key]) is type(value):
            found.add(experiment_id)
    return found


def write_legacy_value(key: str, legacy) -> None:
    """Upgrade: the legacy value into every stored spec without `key` (and its experiments' data_config)."""
    def add_to_data(data):
        if data is None or key in data:
            return None
        return {**data, key: legacy}

    def spec_with(spec):
        if spec is None or spec.get("external") or not isinstance(spec.get("data"), dict):
            return None
        data = add_to_data(spec["data"])
        return None if data is None else {**spec, "data": data}

    _rewrite("runs", "spec", spec_with)
    _rewrite("experiments", "data_config", add_to_data, only=_experiments_whose_runs_say(key, legacy))


def drop_legacy_value(key: str, legacy) -> None:
    """Downgrade: `key` out of every spec and data_config where it holds the legacy value."""
    def drop_from_data(data):
        if data is None or key not in data or data[key] != legacy or type(data[key]) is not type(legacy):
            return None
        return {k: v for k, v in data.items() if k != key}

    def spec_without(spec):
        if spec is None or not isinstance(spec.get("data"), dict):
            return None
        data = drop_from_data(spec["data"])
        return None if data is None else {**spec, "data": data}

    _rewrite("runs", "spec", spec_without)
    _rewrite("experiments", "data_config", drop_from_data)

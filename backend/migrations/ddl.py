"""Column drops of the migrations' downgrades that keep an SQLite table's AUTOINCREMENT (migration 0008).

alembic's batch mode drops a column on SQLite by copying the table; the copy is made without AUTOINCREMENT (and, had
it kept it, its sequence would restart at the largest id still stored), so a downgrade of 0011-0015 gave deleted
evaluations' and benchmarks' ids out again. SQLite 3.35 and later drop a column in place, as PostgreSQL does; an
older SQLite gets the copy with AUTOINCREMENT kept (ids deleted above the largest one left may then come back, as
0008 says of its own copy).
"""
from __future__ import annotations

import sqlite3

from alembic import op


def drop_columns(table: str, *columns: str) -> None:
    if op.get_bind().dialect.name == "sqlite" and sqlite3.sqlite_version_info < (3, 35):
        with op.batch_alter_table(table, recreate="always", table_kwargs={"sqlite_autoincrement": True}) as batch:
            for column in columns:
                batch.drop_column(column)
        return
    for column in columns:
        op.drop_column(table, column)

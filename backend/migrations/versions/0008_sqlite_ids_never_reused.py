"""SQLite: ids of experiments, runs, artifacts, evaluations, GEMM benchmarks and API tokens are never reused

Without AUTOINCREMENT SQLite gives a new row the largest id + 1, so deleting the newest run and creating another
gave the new one the deleted one's id: a script still logging to the deleted run wrote into the new one, and a
bookmark or an artifact's download address named another object. With AUTOINCREMENT an id is never handed out
twice (SQLite keeps the largest ever used in sqlite_sequence). PostgreSQL's sequences never reuse a value: nothing
to do there.

SQLite adds AUTOINCREMENT only by copying a table (alembic's batch mode: new table, rows copied with their ids,
old dropped, new renamed; indexes and constraints recreated). Foreign keys are off on the migration's own
connection (they are switched on by backend.db's engines only), so dropping the old `runs` does not cascade
into the tables that reference it; the migration refuses to run otherwise. Ids deleted before this migration above
the largest one left cannot be known, so the largest id in use is where the sequence starts.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 00:30:00
"""
from alembic import op


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

# Parents before children (the copy of a child checks nothing, foreign keys being off; the order only keeps the
# reading simple).
TABLES = ("experiments", "runs", "artifacts", "evaluations", "gemm_benchmarks", "api_tokens")


def _rebuild(autoincrement: bool) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    if bind.exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError("foreign keys are on for the migration's connection: copying `runs` would cascade its "
                           "deletion into its metrics and files; run `plab db upgrade` (it uses a connection of "
                           "its own)")
    for table in TABLES:
        with op.batch_alter_table(table, recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}):
            pass
    if bind.exec_driver_sql("PRAGMA foreign_key_check").first() is not None:
        raise RuntimeError("a foreign key no longer holds after copying the tables: nothing was committed")


def upgrade() -> None:
    _rebuild(True)


def downgrade() -> None:
    _rebuild(False)

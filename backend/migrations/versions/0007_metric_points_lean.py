"""metric points: (run_id, key, step) is the primary key; no surrogate id, no foreign key to runs

Every ingested point paid for two things no query used: the `id` column's sequence and its primary-key index
(every read goes through (run_id, key, step)), and the foreign key's per-row check against `runs` (a fifth of a
10,000-point insert on PostgreSQL). The run's existence is kept by locking instead (backend.services.runs):
ingest holds the run row FOR KEY SHARE for its transaction (404 when the run is gone) and run deletion takes it
FOR UPDATE before deleting the run's metrics, so no point can be stored for a run being deleted or deleted
already. Points of runs deleted before this migration went with the foreign key's cascade; any orphan found
here (none can exist under the constraint) is removed.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 15:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

_COLUMNS = "run_id, key, step, tokens, wall_time, value"


def _lite_table(name: str, with_id: bool) -> None:
    """SQLite alters a table by copying it: the new table under `name`."""
    if with_id:
        op.execute(f"""CREATE TABLE {name} (
            id INTEGER NOT NULL, run_id INTEGER NOT NULL, key VARCHAR(200) NOT NULL, step BIGINT NOT NULL,
            tokens BIGINT, wall_time FLOAT, value FLOAT, PRIMARY KEY (id),
            CONSTRAINT uq_metric_run_key_step UNIQUE (run_id, key, step),
            FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE)""")
    else:
        op.execute(f"""CREATE TABLE {name} (
            run_id INTEGER NOT NULL, key VARCHAR(200) NOT NULL, step BIGINT NOT NULL, tokens BIGINT,
            wall_time FLOAT, value FLOAT, CONSTRAINT metric_points_pkey PRIMARY KEY (run_id, key, step))""")


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        for fk in sa.inspect(bind).get_foreign_keys("metric_points"):
            op.drop_constraint(fk["name"], "metric_points", type_="foreignkey")
        op.execute("DELETE FROM metric_points m WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = m.run_id)")
        op.execute("ALTER TABLE metric_points DROP CONSTRAINT metric_points_pkey")
        op.drop_column("metric_points", "id")  # drops its sequence too (it is OWNED BY the column)
        # The unique key becomes the primary key (its index is rebuilt once, in the migration's transaction).
        op.execute("ALTER TABLE metric_points DROP CONSTRAINT uq_metric_run_key_step, "
                   "ADD CONSTRAINT metric_points_pkey PRIMARY KEY (run_id, key, step)")
    else:
        _lite_table("metric_points_new", with_id=False)
        op.execute(f"INSERT INTO metric_points_new ({_COLUMNS}) SELECT {_COLUMNS} FROM metric_points m "
                   "WHERE EXISTS (SELECT 1 FROM runs r WHERE r.id = m.run_id)")
        op.execute("DROP TABLE metric_points")
        op.execute("ALTER TABLE metric_points_new RENAME TO metric_points")


def downgrade() -> None:
    bind = op.get_bind()
    # The foreign key comes back, and with it the rule that a point belongs to an existing run.
    op.execute("DELETE FROM metric_points WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = metric_points.run_id)")
    if bind.dialect.name == "postgresql":
        op.execute("ALTER TABLE metric_points DROP CONSTRAINT metric_points_pkey")
        op.execute("ALTER TABLE metric_points ADD CONSTRAINT uq_metric_run_key_step UNIQUE (run_id, key, step)")
        op.execute("ALTER TABLE metric_points ADD COLUMN id BIGSERIAL PRIMARY KEY")
        op.create_foreign_key(None, "metric_points", "runs", ["run_id"], ["id"], ondelete="CASCADE")
    else:
        _lite_table("metric_points_old", with_id=True)
        op.execute(f"INSERT INTO metric_points_old ({_COLUMNS}) SELECT {_COLUMNS} FROM metric_points "
                   "ORDER BY run_id, key, step")
        op.execute("DROP TABLE metric_points")
        op.execute("ALTER TABLE metric_points_old RENAME TO metric_points")

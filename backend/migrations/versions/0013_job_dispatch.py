"""Evaluations' and GEMM benchmarks' dispatch: the job message each was last sent as, when, and on which queue

As runs' (0003): the reconciler sends a queued evaluation or benchmark again when the broker no longer holds its
message (a Redis restart without persistence); before, such a job stayed `queued` for ever. Rows queued when this
revision is applied have no dispatch recorded: nothing is re-sent for them (as for a run from before 0003).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07 13:20:00
"""
from alembic import op
import sqlalchemy as sa

from backend.migrations.ddl import drop_columns


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ('evaluations', 'gemm_benchmarks'):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column('dispatch_id', sa.String(length=64), nullable=True))
            batch.add_column(sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('gemm_benchmarks') as batch:
        batch.add_column(sa.Column('queue', sa.String(length=64), nullable=True))


def downgrade() -> None:
    # in place: the tables keep AUTOINCREMENT (backend.migrations.ddl)
    drop_columns('gemm_benchmarks', 'queue', 'dispatched_at', 'dispatch_id')
    drop_columns('evaluations', 'dispatched_at', 'dispatch_id')

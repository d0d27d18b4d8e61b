"""Evaluations' and GEMM benchmarks' claim: the job that reported `running` (worker_host), as a run's

A job's `running` report is refused while another job holds the row (a heartbeat younger than PLAB_STALE_S), so a
message delivered twice never runs one evaluation or benchmark twice at once, and the reconciler can send a lost
one again on every broker (before, only where the broker shows delivered messages: Redis). Rows stored before this
revision have no holder: one `running` then is judged by its heartbeat alone.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-08 01:30:00
"""
from alembic import op
import sqlalchemy as sa

from backend.migrations.ddl import drop_columns


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ('evaluations', 'gemm_benchmarks'):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column('worker_host', sa.String(length=200), nullable=True))


def downgrade() -> None:
    for table in ('evaluations', 'gemm_benchmarks'):
        drop_columns(table, 'worker_host')  # in place: the table keeps AUTOINCREMENT (backend.migrations.ddl)

"""Evaluations' and GEMM benchmarks' starts (`attempts`), as a run's: one whose worker died is sent again

The reconciler used to fail an evaluation or benchmark whose heartbeats stopped (its worker was killed, its node
lost), and the user had to start it again; a run in that case is sent to a worker again, up to PLAB_MAX_ATTEMPTS
starts. Each `running` report now counts a start, and the reconciler takes such a job back the same way. Rows
stored before this revision count 0 starts.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-08 01:40:00
"""
from alembic import op
import sqlalchemy as sa

from backend.migrations.ddl import drop_columns


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ('evaluations', 'gemm_benchmarks'):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column('attempts', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    for table in ('evaluations', 'gemm_benchmarks'):
        drop_columns(table, 'attempts')  # in place: the table keeps AUTOINCREMENT (backend.migrations.ddl)

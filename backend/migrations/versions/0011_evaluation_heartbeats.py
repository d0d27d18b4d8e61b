"""evaluation leases: a running evaluation's heartbeat

An evaluation's job reports `running`, then heartbeats while lm-eval scores the tasks; the reconciler ends one whose
heartbeats stopped (its worker was killed: the evaluation stayed `running` for ever and its run could not be
deleted). Evaluations running when this revision is applied have none: the reconciler reads their creation time.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 11:30:00
"""
from alembic import op
import sqlalchemy as sa

from backend.migrations.ddl import drop_columns


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('evaluations') as batch:
        batch.add_column(sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    drop_columns('evaluations', 'heartbeat_at')  # in place: the table keeps AUTOINCREMENT (backend.migrations.ddl)

"""run leases: a running job's heartbeat and the id of the message that carries a queued run

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 22:10:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('dispatch_id', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('dispatched_at')
        batch.drop_column('dispatch_id')
        batch.drop_column('heartbeat_at')

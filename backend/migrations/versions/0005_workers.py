"""workers as they register (queues, slots, GPUs per slot, launcher, last seen)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 02:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'workers',
        sa.Column('name', sa.String(length=200), primary_key=True),
        sa.Column('queues', sa.JSON(), nullable=False),
        sa.Column('slots', sa.Integer(), nullable=False),
        sa.Column('gpus_per_slot', sa.Integer(), nullable=False),
        sa.Column('launcher', sa.String(length=16), nullable=False),
        sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('workers')

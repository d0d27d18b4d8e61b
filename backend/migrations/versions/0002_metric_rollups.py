"""metric rollups: pre-computed min/max buckets per series

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:15:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    big = sa.BigInteger()
    op.create_table(
        'metric_rollups',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('key', sa.String(length=200), nullable=False),
        sa.Column('level', sa.Integer(), nullable=False),
        sa.Column('bucket', big, nullable=False),
        sa.Column('n_points', big, nullable=False),
        sa.Column('n_value', big, nullable=False),
        sa.Column('sum_value', sa.Float(), nullable=False),
        sa.Column('sum_step', sa.Float(), nullable=False),
        sa.Column('n_tokens', big, nullable=False),
        sa.Column('sum_tokens', sa.Float(), nullable=False),
        sa.Column('first_step', big, nullable=False),
        sa.Column('last_step', big, nullable=False),
        sa.Column('min_value', sa.Float(), nullable=True),
        sa.Column('min_step', big, nullable=True),
        sa.Column('min_tokens', big, nullable=True),
        sa.Column('min_wall_time', sa.Float(), nullable=True),
        sa.Column('max_value', sa.Float(), nullable=True),
        sa.Column('max_step', big, nullable=True),
        sa.Column('max_tokens', big, nullable=True),
        sa.Column('max_wall_time', sa.Float(), nullable=True),
        sa.Column('null_step', big, nullable=True),
        sa.Column('null_tokens', big, nullable=True),
        sa.Column('null_wall_time', sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'key', 'level', 'bucket'),
    )
    # Series stored before this revision get their rollup now, in the same transaction: afterwards ingest
    # keeps it current, and a reader never has to guess whether a rollup is complete.
    from sqlalchemy.orm import Session

    from backend.services.metrics import rebuild_rollup

    session = Session(bind=op.get_bind())
    rebuild_rollup(session)
    session.flush()


def downgrade() -> None:
    op.drop_table('metric_rollups')

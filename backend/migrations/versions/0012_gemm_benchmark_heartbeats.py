"""GEMM benchmark leases: a running benchmark's heartbeat

As evaluations' (0011): a benchmark's job heartbeats while it times the GEMMs, and the reconciler fails one whose
heartbeats stopped (its worker was killed: it stayed `running` for ever). Benchmarks running when this revision is
applied have none: the reconciler reads their creation time.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 11:50:00
"""
from alembic import op
import sqlalchemy as sa

from backend.migrations.ddl import drop_columns


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('gemm_benchmarks') as batch:
        batch.add_column(sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    drop_columns('gemm_benchmarks', 'heartbeat_at')  # in place: the table keeps AUTOINCREMENT (backend.migrations.ddl)

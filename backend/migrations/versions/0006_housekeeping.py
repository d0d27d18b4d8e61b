"""housekeeping: tags, notes and archived_at on experiments and runs

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 12:45:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

TABLES = ('experiments', 'runs')


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column('tags', sa.JSON(), nullable=False, server_default='[]'))
            batch.add_column(sa.Column('notes', sa.Text(), nullable=False, server_default=''))
            batch.add_column(sa.Column('archived_at', sa.DateTime(timezone=True), nullable=True))
        op.create_index(f'ix_{table}_archived_at', table, ['archived_at'])


def downgrade() -> None:
    for table in TABLES:
        op.drop_index(f'ix_{table}_archived_at', table_name=table)
        with op.batch_alter_table(table) as batch:
            batch.drop_column('archived_at')
            batch.drop_column('notes')
            batch.drop_column('tags')

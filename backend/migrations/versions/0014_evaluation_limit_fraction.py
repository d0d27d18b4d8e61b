"""Evaluations' `limit` may be a fraction of each task's documents, as lm-eval's --limit: a float column

Before, a limit was a whole number of documents per task (an integer column); every stored limit keeps its value.
PostgreSQL changes the column's type in place. SQLite's column is left as it is: a column of INTEGER affinity stores a
value with a fractional part as a REAL, unchanged, and changing its declared type would copy the table, which loses
its AUTOINCREMENT (0008) and, were foreign keys on, would cascade into the evaluations' results.
A downgrade refuses while an evaluation with a fractional limit is stored (the integer column of 0013 cannot hold
it: delete those evaluations, or their runs, first), so nothing stored is rounded away.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 17:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.alter_column('evaluations', 'limit', existing_type=sa.Integer(), type_=sa.Float(), existing_nullable=True)


def downgrade() -> None:
    bind = op.get_bind()
    fractional = bind.execute(sa.text('SELECT id FROM evaluations WHERE "limit" IS NOT NULL AND "limit" < 1 '
                                      'ORDER BY id')).scalars().all()
    if fractional:
        raise RuntimeError(f"cannot downgrade below 0014: evaluation(s) {fractional[:20]} have a fractional limit, "
                           "which the integer column of 0013 cannot hold; delete them (or their runs) first")
    if bind.dialect.name != "sqlite":
        op.alter_column('evaluations', 'limit', existing_type=sa.Float(), type_=sa.Integer(), existing_nullable=True,
                        postgresql_using='"limit"::integer')

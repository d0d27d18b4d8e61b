"""The migrations build the schema the models describe, on SQLite and the real PostgreSQL: a column added to a model
without its migration (or a migration that adds what no model has) would pass every API test on a fresh database
created from the migrations only if both agree, and fail only on a user's upgraded database. alembic compares the
upgraded database with `Base.metadata` (tables, columns, their types and nullability, indexes, foreign keys)."""
from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from backend.migrate import upgrade
from backend.models import Base


def _documented(change, sqlite: bool) -> bool:
    """Differences the migrations make on purpose: alembic's own table; on SQLite, evaluations.limit keeps its
    INTEGER declaration (0014: its affinity stores a fraction as a REAL, and changing the type would copy the table)."""
    if isinstance(change, tuple):
        return change[0] == "remove_table" and change[1].name == "alembic_version"
    return sqlite and len(change) == 1 and change[0][0] == "modify_type" and change[0][2:4] == ("evaluations", "limit")


def test_the_upgraded_schema_is_the_models(database_url):
    upgrade(database_url)
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as c:
            context = MigrationContext.configure(c, opts={"compare_type": True})
            diff = [d for d in compare_metadata(context, Base.metadata)
                    if not _documented(d, database_url.startswith("sqlite"))]
    finally:
        engine.dispose()
    assert diff == [], diff

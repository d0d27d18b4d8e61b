"""Shared fixtures: real databases (SQLite file, the machine's PostgreSQL), data paths."""
from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()
os.environ.setdefault("PLAB_DATA_DIR", str(SHARED_DATA))
# Tests that build an API from an explicit Settings still send through the Celery app of the environment's
# settings (plab.broker.make_app): without PLAB_HOME that is ./plab-data/broker of the checkout, where their
# messages outlived the suite and a later `plab demo` in the same checkout consumed them (a demo run failed on a
# test's "needs 2 GPUs" message). A temporary home per session keeps the checkout clean.
os.environ.setdefault("PLAB_HOME", tempfile.mkdtemp(prefix="plab-test-home-"))
PG_ADMIN_URL = os.environ.get("PLAB_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("PLAB_TEST_REDIS", "redis://127.0.0.1:6379")


def _postgres_available() -> bool:
    from sqlalchemy import create_engine, text

    try:
        eng = create_engine(PG_ADMIN_URL)
        with eng.connect() as c:
            c.execute(text("SELECT 1"))
        eng.dispose()
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture
def postgres_url():
    """A fresh PostgreSQL database on the machine's real server, dropped afterwards."""
    from sqlalchemy import create_engine, text

    if not _postgres_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}; .ci/run must start it")
        pytest.skip("PostgreSQL is not running")
    name = f"plab_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    yield url
    from backend.db import _engines

    eng = _engines.pop(url, None)
    if eng is not None:
        eng.dispose()
    with admin.connect() as c:
        c.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"))
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'plab.sqlite'}"
    return request.getfixturevalue("postgres_url")

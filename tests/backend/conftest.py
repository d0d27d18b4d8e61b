"""Fixtures shared by the API tests that need the real Redis broker (the reconciler's, the retry's)."""
from __future__ import annotations

import pytest
import redis

from plab.broker import close_senders
from tests.integration.conftest import REDIS_URL, _claim_redis_db


@pytest.fixture
def broker(monkeypatch, tmp_path):
    """A Redis database of this test's own (flushed before and after) as PLAB_BROKER_URL, and PLAB_HOME in
    tmp_path; the fixture is the Redis client, to look at the queues."""
    db, lock = _claim_redis_db()
    url = f"{REDIS_URL}/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    monkeypatch.setenv("PLAB_BROKER_URL", url)
    monkeypatch.setenv("PLAB_HOME", str(tmp_path))
    yield client
    # The API's cached Celery sender stays connected to the database, which a later claim then takes for an
    # orphan's: 15 tests of a worker process held every database and the served stacks found none (a CI run).
    close_senders()
    client.flushdb()
    client.close()
    lock.close()

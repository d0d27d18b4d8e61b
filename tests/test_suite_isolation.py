"""The suite must not write into the checkout: messages that tests send through the environment's embedded broker
once outlived them in ./plab-data/broker, and a later `plab demo` in the same checkout consumed them."""
from pathlib import Path

from plab.broker import make_app
from plab.settings import get_settings

REPO = Path(__file__).resolve().parent.parent


def test_the_environments_plab_home_and_broker_lie_outside_the_checkout():
    home = get_settings().home.resolve()
    assert home != REPO and REPO not in home.parents
    make_app()  # the embedded broker's folders, created where the settings say
    assert REPO not in get_settings().broker_folder.resolve().parents


def test_a_served_stack_never_shares_its_redis_database_with_a_process_left_connected_to_it():
    """A stack claims a Redis database by a file lock, which dies with its pytest process while the stack's
    worker (its own session) may live on: the claim also skips a database some client is still connected to."""
    import pytest
    import redis

    from tests.conftest import REDIS_URL
    from tests.integration.conftest import _claim_redis_db

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.exceptions.ConnectionError:
        pytest.skip(f"Redis is not running at {REDIS_URL}")
    db, lock = _claim_redis_db()
    lock.close()  # as when the suite that held it was killed
    orphan = redis.Redis.from_url(f"{REDIS_URL}/{db}")
    orphan.ping()  # ... and its worker is still connected
    try:
        again, lock = _claim_redis_db()
        lock.close()
        assert again != db
    finally:
        orphan.close()
    again, lock = _claim_redis_db()  # once the orphan is gone, its database is free again
    lock.close()
    assert again <= db

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


def test_a_served_stacks_processes_die_with_the_test_process_even_when_it_is_killed():
    """The stacks' API and worker run in their own sessions; a suite killed mid-test once left them running. A
    process started as the stack starts them (tests.integration.conftest.spawn) and then orphaned by a SIGKILL of
    its parent gets SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    middle = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "from tests.integration.conftest import spawn\n"
         "child = spawn(['sleep', '120'])\n"
         "print(child.pid, flush=True)\n"
         "time.sleep(120)\n"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(middle.stdout.readline())
        assert _alive(pid)
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the stack's process outlived the killed test process"
    finally:
        middle.kill()
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits for a reaper this container may not have)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

"""A served deployment without Docker: the commands of docker-compose.yml run as subprocesses against this
machine's real PostgreSQL and Redis (hosts and ports rewritten to the local ones)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REDIS_URL, REPO

FINAL = {"succeeded", "failed", "cancelled", "diverged"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compose_command(service: str) -> list[str]:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    cmd = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", c) for c in compose["services"][service]["command"]]
    assert cmd[0] == "plab"
    # `plab` is this venv's console script; run it through the interpreter so the subprocess uses the same venv.
    return [sys.executable, "-m", "plab.cli", *cmd[1:]]


def _claim_redis_db():
    """A Redis database no other suite on this machine uses right now: an exclusive lock per database number
    (1-15), held for the stack's life (parallel suites once collided on `1 + pid % 14`), on a database no client
    is connected to. The lock dies with the pytest process, but a stack's API and worker run in their own
    sessions: a suite killed mid-test leaves them consuming from their database, and a later stack that flushed
    and reused it had its jobs taken by that orphaned worker (an evaluation that never finished)."""
    import fcntl

    import redis

    server = redis.Redis.from_url(REDIS_URL)
    try:
        for db in range(1, 16):
            handle = open(f"/tmp/plab-test-redis-db-{db}.lock", "w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            if any(c.get("db") == str(db) for c in server.client_list()):
                handle.close()  # an orphan of an interrupted suite still uses it
                continue
            return db, handle
    finally:
        server.close()
    raise RuntimeError("all Redis databases 1-15 are held by other test stacks, or used by processes a killed "
                       "suite left behind (`redis-cli client list` shows them; stop them)")


def die_with_parent() -> None:
    """Popen preexec_fn: the child gets SIGTERM when the process that started it dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG). A stack's API and worker run in their own sessions, so an interrupted suite's Ctrl-C or kill
    never reached them and they lived on, consuming from their Redis database."""
    import ctypes

    parent = int(os.environ.get("PLAB_TEST_PARENT_PID", "0"))
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if parent and os.getppid() != parent:  # the parent died before the prctl: nobody will signal us
        os.kill(os.getpid(), signal.SIGTERM)


def spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    """A process of the served stack: its own session (a test can signal its whole group), dying with its parent."""
    env = dict(kwargs.pop("env", None) or os.environ, PLAB_TEST_PARENT_PID=str(os.getpid()))
    return subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent, **kwargs)


class Stack:
    def __init__(self, tmp: Path, database_url: str, slots: int, redis_url: str | None = None):
        self.tmp = tmp
        self.port = free_port()
        if redis_url is None:
            self.redis_db, self._db_lock = _claim_redis_db()
            redis_url = f"{REDIS_URL}/{self.redis_db}"
        else:
            self._db_lock = open(os.devnull)
        self.queue_prefix = uuid.uuid4().hex[:8]
        self.env = dict(os.environ, PLAB_DATABASE_URL=database_url, PLAB_BROKER_URL=redis_url,
                        PLAB_API_URL=f"http://127.0.0.1:{self.port}", PLAB_HOME=str(tmp / "home"),
                        PLAB_API_TOKEN="integration-token", PYTHONUNBUFFERED="1",
                        # Fast leases so recovery tests take seconds: heartbeats every 2 s, a run without one for
                        # 15 s has lost its worker, the reconciler looks every 2 s.
                        PLAB_HEARTBEAT_S="2", PLAB_STALE_S="15", PLAB_RECONCILE_S="2", PLAB_REQUEUE_GRACE_S="5",
                        # A folder of the test's own corpora, which specs may name besides the shared data.
                        PLAB_ALLOWED_PATHS=str(tmp / "data"))
        (tmp / "data").mkdir(parents=True, exist_ok=True)
        self.env.pop("CUDA_VISIBLE_DEVICES", None)
        self.slots = slots
        self.procs: dict[str, subprocess.Popen] = {}
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.port}/api/v1",
                                headers={"Authorization": "Bearer integration-token"}, timeout=30)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        proc = spawn(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        p = self.tmp / f"{name}.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""

    def up(self) -> Stack:
        import redis

        redis.Redis.from_url(self.env["PLAB_BROKER_URL"]).flushdb()
        migrate = subprocess.run(compose_command("migrate"), env=self.env, cwd=REPO, capture_output=True, text=True,
                                 timeout=120)
        assert migrate.returncode == 0, migrate.stderr
        self.start("api", compose_command("api") + ["--host", "127.0.0.1", "--port", str(self.port)])
        self.start_worker()
        deadline = time.time() + 60
        while True:
            try:
                if self.api.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.procs["api"].poll() is None, self.log("api")
            assert time.time() < deadline, "API did not come up:\n" + self.log("api")
            time.sleep(0.3)
        return self

    def restart_api(self) -> None:
        self.start("api", compose_command("api") + ["--host", "127.0.0.1", "--port", str(self.port)])
        deadline = time.time() + 60
        while True:
            try:
                if self.api.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "API did not come back:\n" + self.log("api")
            time.sleep(0.3)

    def start_worker(self) -> subprocess.Popen:
        return self.start("worker", compose_command("worker") + ["--slots", str(self.slots)])

    def down(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=20)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self.api.close()
        self._db_lock.close()

    # helpers for tests
    def create(self, **body) -> dict:
        r = self.api.post("/experiments", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = predicate()
            if value:
                return value
            assert self.procs["worker"].poll() is None, "worker died:\n" + self.log("worker")
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}\nworker log:\n{self.log('worker')}")

    def wait_final(self, experiment_id: int, timeout: float = 300) -> dict:
        def done():
            exp = self.api.get(f"/experiments/{experiment_id}").json()
            return exp if all(r["status"] in FINAL for r in exp["runs"]) else None

        return self.wait(done, timeout, f"experiment {experiment_id} to finish")

    def run(self, run_id: int) -> dict:
        return self.api.get(f"/runs/{run_id}").json()

    def series(self, run_id: int, key: str = "train/loss") -> dict:
        return self.api.get(f"/runs/{run_id}/metrics/{key}", params={"max_points": 100_000}).json()


@pytest.fixture
def stack(postgres_url, tmp_path, request):
    slots = getattr(request, "param", 2)
    s = Stack(tmp_path, postgres_url, slots).up()
    yield s
    s.down()


TINY = {"model": "tiny", "data": {"corpus": "tinyshakespeare", "vocab_size": 512, "seq_len": 64},
        "seed": 0}


def tiny_training(steps: int, **over) -> dict:
    return {"steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "val_every": max(2, steps // 2),
            "val_batches": 2, **over}

"""Metric ingest through the real API (uvicorn subprocess) into the real database.

Measures, per database (PostgreSQL, SQLite):
  * one client: POST /runs/{id}/metrics with batches of 10,000 points (4 keys) -> points/s;
  * 20 concurrent writers to ONE run, each listing the keys in its own (shuffled) order, distinct steps per
    writer: failed requests (a deadlock shows as 503/500), lost or duplicated points (the run's stored count
    against what was sent), per-request latency p50/p99.
Goals (the hardening issue): PostgreSQL one client >= 50k points/s; 20 writers 0 deadlocks, 0 lost, p99 < 1 s;
SQLite 20 writers p99 < 1 s. Writes `bench/results/ingest_bench_<date>.json` (host, date, commit).

    python bench/ingest_bench.py [--postgres postgresql+psycopg://postgres@127.0.0.1:5432/postgres] [--skip-sqlite]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchmeta import git_commit  # noqa: E402

TOKEN = "ingest-bench"
KEYS = ["train/loss", "train/grad_norm", "perf/tokens_per_s", "train/lr"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(db_url: str, home: Path):
    from backend.migrate import upgrade

    upgrade(db_url)
    port = _free_port()
    env = dict(os.environ, PLAB_DATABASE_URL=db_url, PLAB_HOME=str(home), PLAB_API_TOKEN=TOKEN,
               PLAB_RECONCILE_S="0", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "backend.app:create_app", "--factory", "--host",
                             "127.0.0.1", "--port", str(port), "--log-level", "warning"], cwd=REPO, env=env)
    base = f"http://127.0.0.1:{port}/api/v1"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the API did not start")
        time.sleep(0.2)


def _new_run(http: httpx.Client) -> int:
    exp = http.post("/experiments", json={"name": "ingest bench", "model": "tiny", "data": {"corpus": "random",
                    "vocab_size": 256}, "training": {"steps": 100}, "recipes": ["bf16"], "enqueue": False})
    exp.raise_for_status()
    return exp.json()["runs"][0]["id"]


def _batch(keys: list[str], first_step: int, steps: int) -> list[dict]:
    return [{"key": k, "step": first_step + i, "value": 1.0 + 1e-3 * i, "tokens": (first_step + i) * 8192,
             "wall_time": 1.8e9 + i} for k in keys for i in range(steps)]


def one_client(base: str, batches: int = 10, per_key: int = 2500, form: str = "series") -> dict:
    """`form` "series": through our metric client (`PlabClient.log_metrics`, the compact form the workers send,
    its encoding timed); "points": the row form, bodies encoded before the clock starts."""
    from workers.client import PlabClient

    with PlabClient(base.removesuffix("/api/v1"), token=TOKEN, timeout=120) as client, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as http:
        run = _new_run(http)
        client.log_metrics(run, _batch(KEYS, 10**8, 10))  # warm
        payloads = [_batch(KEYS, b * per_key, per_key) for b in range(batches)]
        if form == "points":
            bodies = [json.dumps({"points": body}).encode() for body in payloads]
        start = time.perf_counter()
        for i, body in enumerate(payloads):
            if form == "series":
                client.log_metrics(run, body, retries=0)
            else:
                http.post(f"/runs/{run}/metrics", content=bodies[i],
                          headers={"Content-Type": "application/json"}).raise_for_status()
        seconds = time.perf_counter() - start
        stored = sum(k["points"] for k in http.get(f"/runs/{run}/metrics").json()["keys"])
    points = batches * per_key * len(KEYS)
    assert stored == points + 40, (stored, points)
    return {"form": form, "points": points, "seconds": seconds, "points_per_s": points / seconds,
            "batch_points": per_key * 4}


def concurrent_writers(base: str, writers: int = 20, batches: int = 10, per_key: int = 50) -> dict:
    """20 threads of our metric client, each its own key order (the compact form keeps it)."""
    from workers.client import ApiError, PlabClient

    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as http:
        run = _new_run(http)
    latencies, failures, lock = [], [], threading.Lock()

    def writer(w: int) -> None:
        keys = KEYS[:]
        random.Random(w).shuffle(keys)
        with PlabClient(base.removesuffix("/api/v1"), token=TOKEN, timeout=120) as client:
            for b in range(batches):
                body = _batch(keys, (w * batches + b) * per_key, per_key)
                t = time.perf_counter()
                try:
                    client.log_metrics(run, body, retries=0)
                    failure = None
                except (ApiError, httpx.HTTPError) as e:
                    failure = f"{getattr(e, 'status', type(e).__name__)}: {str(e)[:200]}"
                with lock:
                    latencies.append(time.perf_counter() - t)
                    if failure:
                        failures.append(failure)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    with httpx.Client(base_url=base, timeout=60) as http:
        keys = http.get(f"/runs/{run}/metrics").json()["keys"]
    stored = sum(k["points"] for k in keys)
    sent = writers * batches * per_key * len(KEYS)
    latencies.sort()
    return {"writers": writers, "requests": len(latencies), "failed_requests": len(failures),
            "failures": failures[:5], "deadlocks": sum("deadlock" in f.lower() or f.startswith("503") for f in failures),
            "points_sent": sent, "points_stored": stored, "lost_or_extra": sent - stored, "seconds": seconds,
            "p50_s": statistics.median(latencies), "p99_s": latencies[max(0, int(0.99 * len(latencies)) - 1)],
            "max_s": latencies[-1]}


def bench(db_url: str, home: Path) -> dict:
    proc, base = _server(db_url, home)
    try:
        return {"one_client": one_client(base), "one_client_row_form": one_client(base, form="points"),
                "twenty_writers": concurrent_writers(base)}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _fresh_postgres(admin_url: str) -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(sa.text("DROP DATABASE IF EXISTS plab_ingest_bench"))
        c.execute(sa.text("CREATE DATABASE plab_ingest_bench"))
    engine.dispose()
    return admin_url.rsplit("/", 1)[0] + "/plab_ingest_bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--postgres", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--skip-sqlite", action="store_true")
    a = ap.parse_args()
    out = {"bench": "ingest_bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "host": f"{platform.node()} ({os.cpu_count()} cores)", "git_commit": git_commit(), "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        out["results"]["postgresql"] = bench(_fresh_postgres(a.postgres), Path(tmp) / "pg")
        if not a.skip_sqlite:
            out["results"]["sqlite"] = bench(f"sqlite:///{Path(tmp) / 'bench.sqlite'}", Path(tmp) / "lite")
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"ingest_bench_{dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H%M}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"\n# ingest_bench on {out['host']} at {out['git_commit']} -> {path.relative_to(REPO)}")
    for db, r in out["results"].items():
        o, w = r["one_client"], r["twenty_writers"]
        print(f"{db:<11} one client {o['points_per_s']:>9,.0f} points/s (row form "
              f"{r['one_client_row_form']['points_per_s']:,.0f}) | 20 writers: {w['failed_requests']} failed, "
              f"{w['deadlocks']} deadlocks, {w['lost_or_extra']} lost/extra, p50 {w['p50_s']:.3f} s, "
              f"p99 {w['p99_s']:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Acceptance benchmark of the comparison dashboard on a long experiment, against the real PostgreSQL.

    python bench/dashboard_bench.py                   # 8 runs x 100,000 steps x 3 series (2.4 M points)
    python bench/dashboard_bench.py --steps 5000      # a quick look (smaller data, same checks)

What it does, in order:
1. creates a fresh database on the PostgreSQL server at --admin-url (default $PLAB_TEST_POSTGRES or
   postgresql+psycopg://postgres@127.0.0.1:5432/test), migrates it, and starts the real server
   (`uvicorn backend.app:create_app --factory`) on it;
2. creates one experiment with 8 runs through the REST API (`enqueue: false`) and stores `--steps` points of
   train/loss, train/lr and perf/tokens_per_s per run, by PostgreSQL COPY into the metric table (default) or
   with `--load api` through `POST /api/v1/runs/{id}/metrics` in batches of 10,000 (measures the ingest rate
   too, but takes many minutes for 2.4 M points); run 4's train/loss carries a planted one-step spike; after
   COPY the min/max rollup the endpoint reads (ingest maintains it) is rebuilt from the raw rows
   (`backend.services.metrics.rebuild_rollup`, timed apart);
3. times the comparison data endpoint
   `GET /api/v1/experiments/{id}/series?keys=train/loss,train/lr,perf/tokens_per_s&max_points=2000` (median of
   --repeats after one warm-up) and checks every series has at most 2,000 points and that the spike is in the
   answer; then times `GET /api/v1/experiments/{id}/comparison?key=train/loss&x=tokens` (the relative difference
   to BF16; no bar, reported with its median differences, which should be close to 0.4 % x run index);
4. opens the experiment page in headless Chromium (/usr/bin/chromium, a fresh persistent profile) --page-loads
   times and reads the page's own `plabExperiment.firstRenderMs` (navigation start to charts and runs table
   drawn): the first visit, the second, and returning visits (from the third, Chromium runs plotly.js from its
   code cache); the bar applies to returning visits, the first visit is reported next to it. A blank page that
   only loads plotly.js (the cartesian bundle) is timed too: the floor under any plotly.js page on the machine at that moment;
5. writes bench/results/dashboard_bench_<UTC time>.json and prints a table; drops the database
   (unless --keep-db).

Bars (the issue "Decision-grade comparison"): series endpoint median < 150 ms, <= 2,000 points a series, spike
present, the page with every chart drawn < 1.5 s on a first visit (a browser that never saw the page: plotly.js
fetched, gzipped, and compiled) and on returning visits.
The machine's load average is recorded with the result: on a shared 2-core machine it moves the timings.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import math
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import git_commit  # noqa: E402
from training.precision.catalog import recipe_names  # noqa: E402

import httpx  # noqa: E402

KEYS = ("train/loss", "train/lr", "perf/tokens_per_s")
RECIPES = [*recipe_names(), {"name": "nvfp4", "bf16_last_layers": 2}]
SPIKE_RUN_INDEX = 4
SPIKE_VALUE = 50.0
BATCH = 10_000
TOKENS_PER_STEP = 8 * 2048
BARS = {"endpoint_median_ms": 150.0, "max_points_per_series": 2000, "page_interactive_ms": 1500.0}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def log(msg: str) -> None:
    print(f"[dashboard_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--admin-url", default=os.environ.get(
        "PLAB_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
        help="SQLAlchemy URL of an existing PostgreSQL database with CREATE DATABASE rights")
    p.add_argument("--steps", type=int, default=100_000, help="points per series (default 100000)")
    p.add_argument("--repeats", type=int, default=20, help="timed endpoint calls (default 20)")
    p.add_argument("--page-loads", type=int, default=5, help="page loads in Chromium (default 5)")
    p.add_argument("--load", choices=("copy", "api"), default="copy",
                   help="how the points get into the database: PostgreSQL COPY (fast set-up, default) or the REST "
                        "API's batch ingest (also reports the API's ingest throughput; slow for 2.4 M points)")
    p.add_argument("--ingest-workers", type=int, default=2, help="concurrent metric batches with --load api")
    p.add_argument("--chromium", default=os.environ.get("PLAB_CHROMIUM", "/usr/bin/chromium"))
    p.add_argument("--keep-db", action="store_true", help="do not drop the benchmark database afterwards")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON result")
    args = p.parse_args(argv)
    if args.steps < 10:
        p.error(f"--steps must be at least 10 (got {args.steps}): the spike is planted at 54% of the run")
    if args.repeats < 1 or args.page_loads < 1 or args.ingest_workers < 1:
        p.error("--repeats, --page-loads and --ingest-workers must be at least 1")
    if not Path(args.chromium).exists():
        p.error(f"{args.chromium} not found: install Debian's Chromium (`apt-get install -y chromium`) "
                "or pass --chromium PATH")
    return args


# ---------------------------------------------------------------------------------------------- database
class BenchDatabase:
    """A throw-away database on the real PostgreSQL server, migrated to the current schema."""

    def __init__(self, admin_url: str):
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url

        self.name = f"plab_bench_{uuid.uuid4().hex[:10]}"
        self.admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        try:
            with self.admin.connect() as c:
                c.execute(text(f'CREATE DATABASE "{self.name}"'))
        except Exception as e:  # noqa: BLE001 - say which server and how to fix, then stop
            raise SystemExit(f"cannot create a database on {admin_url}: {e}\n"
                             "start PostgreSQL or pass --admin-url postgresql+psycopg://USER@HOST:PORT/DB") from e
        self.url = make_url(admin_url).set(database=self.name).render_as_string(hide_password=False)
        from backend.migrate import upgrade

        upgrade(self.url)

    def drop(self) -> None:
        from sqlalchemy import text

        from backend.db import get_engine

        get_engine(self.url).dispose()
        with self.admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self.admin.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(database_url: str, home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PLAB_DATABASE_URL": database_url, "PLAB_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("PLAB_API_TOKEN", None)
    log_file = open(home / "server.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "backend.app:create_app", "--factory",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{(home / 'server.log').read_text()}")
        try:
            if httpx.get(f"{base}/api/v1/experiments", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"server did not answer in 120 s:\n{(home / 'server.log').read_text()}")
        time.sleep(0.3)


# ---------------------------------------------------------------------------------------------- data
def synthetic_series(run_index: int, steps: int, spike_step: int | None) -> dict[str, list[float]]:
    """Loss curves that differ a little per run (as recipes do), with noise, so min/max buckets matter."""
    rng = random.Random(1234 + run_index)
    offset = 1 + 0.004 * run_index
    loss, lr, tps = [], [], []
    for s in range(steps):
        base = (2.0 + 8.0 * math.exp(-s / (steps / 8))) * offset
        loss.append(base * (1 + 0.02 * rng.gauss(0, 1)))
        warm = min(1.0, (s + 1) / 2000)
        lr.append(3e-4 * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
        tps.append(100_000 * (1 + 0.05 * run_index) * (1 + 0.01 * rng.gauss(0, 1)))
    if spike_step is not None:
        loss[spike_step] = SPIKE_VALUE
    return {"train/loss": loss, "train/lr": lr, "perf/tokens_per_s": tps}


def batches_for(run_id: int, series: dict[str, list[float]]):
    points = []
    t0 = 1_800_000_000.0
    for key, values in series.items():
        for step, value in enumerate(values):
            points.append({"key": key, "step": step, "value": value, "tokens": (step + 1) * TOKENS_PER_STEP,
                           "wall_time": t0 + 0.16 * step})
            if len(points) == BATCH:
                yield run_id, points
                points = []
    if points:
        yield run_id, points


def ingest(base: str, database_url: str, experiment: dict, steps: int, method: str, workers: int) -> dict:
    """Store the synthetic series, through the REST API (`api`) or PostgreSQL COPY (`copy`), then mark the
    runs succeeded through the API as a worker would."""
    spike_step = int(steps * 0.54321)
    runs = sorted(experiment["runs"], key=lambda r: r["id"])
    jobs, summaries = [], {}
    for i, run in enumerate(runs):
        series = synthetic_series(i, steps, spike_step if i == SPIKE_RUN_INDEX else None)
        jobs.extend(batches_for(run["id"], series))
        # What a worker sends with `succeeded` (workers/jobs/train.py): the page's bars read these.
        summaries[run["id"]] = {"tokens_per_s": statistics.median(series["perf/tokens_per_s"]),
                                "final_loss": series["train/loss"][-1], "peak_mem_gib": 20.0 - i, "mfu": 0.3 + 0.01 * i,
                                "steps": steps, "tokens": steps * TOKENS_PER_STEP}
    total = sum(len(p) for _, p in jobs)
    log(f"loading {total:,} points by {method}")
    t0 = time.perf_counter()
    stored = load_via_api(base, jobs, workers) if method == "api" else load_via_copy(database_url, jobs)
    seconds = time.perf_counter() - t0
    rollup_seconds = None
    if method == "copy":
        # COPY goes around the API's ingest, which maintains the rollup the endpoint reads: build it the way
        # the 0002 migration backfills old series (timed apart; the API path needs no such step).
        t1 = time.perf_counter()
        rebuild_rollups(database_url, [r["id"] for r in runs])
        rollup_seconds = round(time.perf_counter() - t1, 1)
        log(f"rollup rebuilt from the raw rows in {rollup_seconds} s")
    if stored != total:
        raise RuntimeError(f"{stored:,} of {total:,} points were stored")
    with httpx.Client(base_url=base, timeout=60) as client:
        for run in runs:  # final, as after training, so the page stops polling
            for status in ("running", "succeeded"):
                backend = "emulated" if run["recipe"] in ("mxfp8", "nvfp4") else "real"
                body = {"status": status, "gemm_backend": backend}
                if status == "succeeded":
                    body["summary"] = summaries[run["id"]]
                r = client.post(f"/api/v1/runs/{run['id']}/status", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"setting run {run['id']} {status} failed: {r.status_code} {r.text[:300]}")
                # The API can answer before its commit is visible; wait for it before the next transition.
                deadline = time.monotonic() + 30
                while client.get(f"/api/v1/runs/{run['id']}").json()["status"] != status:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"run {run['id']} never showed status {status!r}")
                    time.sleep(0.05)
    return {"method": method, "points": total, "seconds": round(seconds, 1), "points_per_s": round(total / seconds),
            "rollup_rebuild_seconds": rollup_seconds,
            "spike_run_id": runs[SPIKE_RUN_INDEX]["id"], "spike_step": spike_step}


def load_via_api(base: str, jobs: list, workers: int) -> int:
    client = httpx.Client(base_url=base, timeout=300)

    def send(job):
        run_id, points = job
        r = client.post(f"/api/v1/runs/{run_id}/metrics", json={"points": points})
        if r.status_code != 200:
            raise RuntimeError(f"ingest into run {run_id} failed: {r.status_code} {r.text[:300]}")
        return r.json()["inserted"]

    done = 0
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for n, inserted in enumerate(pool.map(send, jobs), 1):
            done += inserted
            if n % 40 == 0:
                log(f"  {done:,} points")
    client.close()
    return done


def load_via_copy(database_url: str, jobs: list) -> int:
    # Bulk loading is set-up, not what is measured: COPY fills 2.4 M rows in seconds where the API's
    # 10,000-point batches take many minutes on a small machine. Same table, same columns as the API writes.
    import psycopg
    from sqlalchemy.engine import make_url

    from backend.models import MetricPoint

    table = MetricPoint.__table__.name
    conninfo = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
    n = 0
    with psycopg.connect(conninfo) as conn:
        with conn.cursor() as cur:
            with cur.copy(f"COPY {table} (run_id, key, step, tokens, wall_time, value) FROM STDIN") as copy:
                for run_id, points in jobs:
                    for p in points:
                        copy.write_row((run_id, p["key"], p["step"], p["tokens"], p["wall_time"], p["value"]))
                        n += 1
            cur.execute(f"ANALYZE {table}")
    return n


def rebuild_rollups(database_url: str, run_ids: list[int]) -> None:
    from backend.db import session_scope
    from backend.services.metrics import rebuild_rollup

    for run_id in run_ids:
        with session_scope(database_url) as session:
            rebuild_rollup(session, run_id)


# ---------------------------------------------------------------------------------------------- measurements
PAGE_QUERY = {"keys": ("train/loss", "val/loss"), "max_points": 1000}  # what the experiment page asks first


def time_endpoint(base: str, experiment_id: int, repeats: int, spike: dict, *, keys=KEYS,
                  max_points: int = 2000) -> dict:
    url = (f"{base}/api/v1/experiments/{experiment_id}/series?keys={','.join(keys)}"
           f"&max_points={max_points}&x=step")
    client = httpx.Client(timeout=120)
    client.get(url).raise_for_status()  # warm-up: connection pool, plans, page cache
    times, answer = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = client.get(url)
        times.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
        answer = r.json()
    client.close()
    lengths = [len(s["value"]) for run in answer["runs"] for s in run["series"].values() if s["value"]]
    spiked = next(run for run in answer["runs"] if run["run_id"] == spike["spike_run_id"])["series"]["train/loss"]
    spike_present = any(st == spike["spike_step"] and v == SPIKE_VALUE
                        for st, v in zip(spiked["step"], spiked["value"]))
    return {"keys": list(keys), "max_points": max_points, "median_ms": round(statistics.median(times), 1),
            "p90_ms": round(sorted(times)[max(0, math.ceil(0.9 * len(times)) - 1)], 1),
            "min_ms": round(min(times), 1), "max_ms": round(max(times), 1), "series": len(lengths),
            "max_points_in_a_series": max(lengths), "min_points_in_a_series": min(lengths),
            "response_bytes": len(r.content), "spike_present": spike_present}


def time_comparison(base: str, experiment_id: int, repeats: int, runs: int) -> dict:
    """The relative-difference endpoint (no bar; reported). The synthetic run i's loss is
    (1 + 0.004 i) times run 0's (bf16) curve plus noise, so its median difference should be close to 0.4 i %
    (the median: run 4's planted spike is one large difference)."""
    url = f"{base}/api/v1/experiments/{experiment_id}/comparison?key=train/loss&x=tokens&max_points=2000"
    client = httpx.Client(timeout=120)
    client.get(url).raise_for_status()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = client.get(url)
        times.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
    client.close()
    body = r.json()
    order = sorted(body["runs"], key=lambda e: e["run_id"])
    mean_delta = {e["recipe"] + (f"#{i}" if i == runs - 1 else ""): (round(statistics.median(e["delta_pct"]), 3)
                                                                     if e["delta_pct"] else None)
                  for i, e in enumerate(order)}
    expected = {k: round(0.4 * i, 3) for i, k in enumerate(mean_delta)}
    return {"median_ms": round(statistics.median(times), 1), "max_ms": round(max(times), 1),
            "points_per_run": max(len(e["delta_pct"]) for e in order),
            "median_delta_pct": mean_delta, "expected_median_delta_pct": expected,
            "deltas_within_0_1_pct_points": all(v is None or abs(v - expected[k]) < 0.1
                                                 for k, v in mean_delta.items() if k != order[0]["recipe"])}


def time_page(base: str, experiment_id: int, loads: int, chromium: str, runs: int) -> dict:
    from playwright.sync_api import sync_playwright

    samples, errors = [], []
    # A persistent profile, as a real browser has: from the third visit Chromium runs plotly.js from its
    # V8 code cache instead of compiling 4.6 MB again (an incognito context never caches code).
    profile = tempfile.mkdtemp(prefix="plab-bench-chromium-")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=chromium, args=CHROMIUM_ARGS,
                                                       viewport={"width": 1400, "height": 1000})
        for i in range(loads):
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/experiments/{experiment_id}")
            # One series per run (the faint raw curves behind the smoothed ones carry meta.raw).
            page.wait_for_function("n => window.plabExperiment && window.plabExperiment.firstRenderMs != null"
                                   " && document.getElementById('loss-chart').data.filter(t => !t.meta.raw).length"
                                   " === n", arg=runs, timeout=60_000)
            ms = page.evaluate("() => window.plabExperiment.firstRenderMs")
            table_ms = page.evaluate("() => window.plabExperiment.tableReadyMs")
            points = page.evaluate("() => document.getElementById('loss-chart').data.filter(t => !t.meta.raw)"
                                   ".reduce((a, t) => a + t.x.length, 0)")
            # Where the time went: fetch start/end of the page's resources (ms since navigation start).
            resources = page.evaluate("""() => performance.getEntriesByType('resource')
                .filter(e => /plotly|api\\/v1/.test(e.name))
                .map(e => ({name: e.name.replace(location.origin, ''), start: Math.round(e.startTime),
                            end: Math.round(e.responseEnd)}))""")
            dom_ready = page.evaluate("() => Math.round(performance.getEntriesByType('navigation')[0]"
                                      ".domContentLoadedEventEnd)")
            marks = page.evaluate("() => Object.fromEntries(performance.getEntriesByType('mark')"
                                  ".filter(m => m.name.startsWith('plab:')).map(m => [m.name, Math.round(m.startTime)]))")
            visit = "first" if i == 0 else ("second" if i == 1 else "returning")
            samples.append({"load": i, "visit": visit, "first_render_ms": round(ms, 1),
                            "table_ready_ms": round(table_ms, 1),
                            "dom_content_loaded_ms": dom_ready, "marks_ms": marks, "loss_points_drawn": points,
                            "resources": resources})
            page.close()
        # The floor under any page built on plotly.js: a blank page that only loads and runs the bundle
        # from the same server (4.6 MB to parse and execute; seconds on a busy 2-core machine).
        floor = []
        for _ in range(3):
            page = context.new_page()
            # about:blank: no Content-Security-Policy (the server's forbids the inline timing script below).
            page.goto("about:blank")
            page.set_content(f"<script src='{base}/static/vendor/plotly-cartesian.min.js'></script>"
                             "<script>window.plotlyDoneMs = performance.now()</script>")
            floor.append(round(page.evaluate("() => window.plotlyDoneMs"), 1))
            page.close()
        context.close()
    shutil.rmtree(profile, ignore_errors=True)
    warm = [s["first_render_ms"] for s in samples if s["visit"] == "returning"] or [samples[-1]["first_render_ms"]]
    warm_table = [s["table_ready_ms"] for s in samples if s["visit"] == "returning"] or [samples[-1]["table_ready_ms"]]
    return {"loads": samples, "cold_ms": samples[0]["first_render_ms"], "warm_median_ms": statistics.median(warm),
            "table_ready_warm_median_ms": statistics.median(warm_table),
            "plotly_only_page_median_ms": statistics.median(floor), "plotly_only_page_ms": floor,
            "console_errors": errors}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc)
    db = BenchDatabase(args.admin_url)
    log(f"database {db.name} created and migrated")
    home = Path(tempfile.mkdtemp(prefix="plab-dashboard-bench-"))
    proc = None
    try:
        proc, base = start_server(db.url, home)
        log(f"server up at {base}")
        r = httpx.post(f"{base}/api/v1/experiments", timeout=300, json={
            "name": f"dashboard-bench {args.steps} steps", "description": "bench/dashboard_bench.py",
            "model": "tiny", "data": {"corpus": "tinyshakespeare", "seq_len": 2048},
            "training": {"steps": args.steps, "batch_size": 8}, "recipes": RECIPES, "enqueue": False})
        if r.status_code != 201:
            raise SystemExit(f"creating the experiment failed: {r.status_code} {r.text}")
        experiment = r.json()
        load = ingest(base, db.url, experiment, args.steps, args.load, args.ingest_workers)
        log(f"ingested {load['points']:,} points in {load['seconds']} s ({load['points_per_s']:,}/s)")
        endpoint = time_endpoint(base, experiment["id"], args.repeats, load)
        log(f"series endpoint: median {endpoint['median_ms']} ms over {args.repeats}")
        page_query = time_endpoint(base, experiment["id"], max(3, args.repeats // 4), load, **PAGE_QUERY)
        comparison = time_comparison(base, experiment["id"], max(3, args.repeats // 4), len(experiment["runs"]))
        log(f"comparison endpoint: median {comparison['median_ms']} ms")
        page = time_page(base, experiment["id"], args.page_loads, args.chromium, len(experiment["runs"]))
        log(f"page: cold {page['cold_ms']} ms, warm median {page['warm_median_ms']} ms")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if not args.keep_db:
            db.drop()

    checks = {
        "endpoint_median_under_150_ms": endpoint["median_ms"] < BARS["endpoint_median_ms"],
        "at_most_2000_points_per_series": endpoint["max_points_in_a_series"] <= BARS["max_points_per_series"],
        "spike_present": endpoint["spike_present"],
        "first_visit_under_1_5_s": page["cold_ms"] < BARS["page_interactive_ms"],
        "returning_visit_under_1_5_s": page["warm_median_ms"] < BARS["page_interactive_ms"],
        "page_without_console_errors": not page["console_errors"],
    }
    result = {
        "benchmark": "dashboard", "started_utc": started.isoformat(timespec="seconds"), "git_commit": git_commit(),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                    "python": platform.python_version()},
        "database": "postgresql", "runs": len(experiment["runs"]), "steps": args.steps, "keys": list(KEYS),
        "ingest": load, "series_endpoint": endpoint, "series_endpoint_page_query": page_query,
        "comparison_endpoint": comparison, "page": page,
        "bars": BARS, "checks": checks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"dashboard_bench_{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(path.read_text())

    print(f"\nDashboard benchmark: {len(experiment['runs'])} runs x {args.steps:,} steps x {len(KEYS)} series "
          f"on PostgreSQL (load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"  ingest                     {load['points']:,} points in {load['seconds']} s "
          f"({load['points_per_s']:,} points/s)")
    print(f"  series endpoint (2000 pts) median {endpoint['median_ms']} ms, p90 {endpoint['p90_ms']} ms "
          f"(bar < 150 ms); max {endpoint['max_points_in_a_series']} points a series; "
          f"spike {'present' if endpoint['spike_present'] else 'MISSING'}")
    print(f"  page's query               median {page_query['median_ms']} ms "
          f"(keys={','.join(PAGE_QUERY['keys'])}, max_points={PAGE_QUERY['max_points']}; val/loss is absent here)")
    print(f"  comparison endpoint        median {comparison['median_ms']} ms, {comparison['points_per_run']} points a "
          f"run; median differences {'as expected' if comparison['deltas_within_0_1_pct_points'] else 'OFF'}: "
          f"{comparison['median_delta_pct']}")
    print(f"  page: runs table shown     returning visit median {page['table_ready_warm_median_ms']} ms")
    print(f"  page: all charts drawn     first visit {page['cold_ms']} ms, returning visit median "
          f"{page['warm_median_ms']} ms (bar < 1500 ms for both)")
    print(f"  blank page with plotly.js  median {page['plotly_only_page_median_ms']} ms (the floor under any "
          "plotly.js page on this machine now)")
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"  result: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

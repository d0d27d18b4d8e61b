"""`plab demo`: the embedded one-shot comparison. It starts `plab serve` and `plab worker` as child processes on
SQLite with the embedded filesystem broker, submits a small BF16-vs-formats experiment, follows it to the end and
prints a summary table (then keeps serving the dashboard unless --no-serve)."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from plab.cli.common import UsageError, api_call, port_number, whole_number
from training.outputs import output_problem

DEMO_RECIPES = ["bf16", "fp8_tensorwise", "mxfp8", "nvfp4"]
FINAL = {"succeeded", "failed", "cancelled", "diverged"}


def demo_experiment(steps: int, recipes: list[str]) -> dict:
    return {
        "name": "demo: BF16 vs low-precision recipes (tiny Llama, tinyshakespeare)",
        "description": "Created by `plab demo`. On a CPU every low-precision recipe runs as exact emulation.",
        "model": "tiny",
        "data": {"corpus": "tinyshakespeare", "vocab_size": 1024, "seq_len": 128},
        "training": {"steps": steps, "batch_size": 8, "lr": 3e-3, "warmup_steps": max(1, steps // 10),
                     "val_every": max(10, steps // 4)},
        "seed": 0,
        # BF16 at three seeds: its seed-to-seed spread is the band the verdict judges by. One seed of a 100-step CPU
        # run against a 1% tolerance would call noise a win (three BF16 seeds of this run spread by ~3%).
        "replicates": 3,
        "recipes": recipes,
    }


def _free_port(preferred: int) -> int:
    for port in range(preferred, min(preferred + 50, 65536)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argv: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pct(value) -> str:
    return f"{value:+.2f}%" if value is not None else "-"


def _summary_table(exp: dict, verdict: dict) -> str:
    """One line per run from the experiment's verdict (GET /experiments/{id}/verdict, the dashboard's verdict):
    final validation loss, its difference to BF16, speedup (a value < 1 is a slowdown), then the verdict line."""
    facts = {r["run_id"]: r for r in verdict["runs"]}
    outcome = {rid: ("inside BF16's noise" if e["outcome"] == "matches" and e.get("resolved") is False else e["outcome"])
               for e in verdict["recipes"] for rid in e["run_ids"]}
    lines = [f"{'run':<28} {'status':<10} {'GEMMs':<9} {'val loss':>9} {'vs bf16':>8} {'tok/s':>9} {'speed':>14} "
             "verdict"]
    for r in exp["runs"]:
        f = facts.get(r["id"], {})
        loss, tps, sp = f.get("final_val_loss"), f.get("tokens_per_s"), f.get("speedup")
        # a BF16 seed's ratio is its throughput against the seeds' mean (their spread), not a slowdown
        speed = "-" if sp is None else f"{sp:.2f}x" + (" slowdown" if sp < 1 and not f.get("is_baseline") else "")
        word = "reference" if r["id"] == verdict["reference_run_id"] else (outcome.get(r["id"]) or "-")
        lines.append(f"{r['label'][:28]:<28} {r['status']:<10} {(r.get('gemm_backend') or '-'):<9} "
                     f"{(f'{loss:.4f}' if loss is not None else '-'):>9} {_pct(f.get('val_delta_pct')):>8} "
                     f"{(f'{tps:,.0f}' if tps else '-'):>9} {speed:>14} {word}")
    lines.append(f"Verdict: {verdict['summary']}")
    lines.append("val loss: mean cross-entropy over the held-out windows, nats per token. Throughput of emulated "
                 "recipes is not a speed claim: emulation runs BF16/FP32 GEMMs on dequantized values.")
    return "\n".join(lines)


def _demo_env(args, port: int) -> tuple[Path, dict]:
    """The demo's home folder and the environment of its server and worker (this process's PLAB_* follow it)."""
    from plab.settings import get_settings

    home = Path(args.home).resolve() if args.home else get_settings().home
    problem = output_problem(home, folder=True)
    if problem:
        raise UsageError(f"{'--home' if args.home else 'PLAB_HOME'} {home}: {problem}")
    env = dict(os.environ, PLAB_HOME=str(home), PLAB_API_URL=f"http://127.0.0.1:{port}")
    if not args.keep_env:
        # The demo is the embedded deployment: SQLite and the filesystem broker under its home.
        for var in ("PLAB_DATABASE_URL", "PLAB_BROKER_URL"):
            env.pop(var, None)
    os.environ.update({k: env[k] for k in ("PLAB_HOME", "PLAB_API_URL")})
    data_dir = get_settings().data_dir
    corpus = data_dir / "tinyshakespeare"
    if not corpus.is_dir():
        raise UsageError(f"the demo trains on {corpus}, which does not exist: set PLAB_DATA_DIR to the folder "
                         "that holds 'tinyshakespeare/'")
    env["PLAB_DATA_DIR"] = str(data_dir)
    (home / "logs").mkdir(exist_ok=True)
    print(f"[plab] home {home}; database SQLite; broker embedded (filesystem); data {data_dir}", flush=True)
    return home, env


def _wait_for_server(url: str, server: subprocess.Popen, log_path: Path) -> None:
    from workers.client import PlabClient

    # No retries inside the client: this loop retries, and notices a server that died meanwhile.
    with PlabClient(url, retries=0) as probe:
        deadline = time.time() + 120
        while True:
            try:
                probe.health()
                return
            except Exception:  # noqa: BLE001 - the server is still starting
                if server.poll() is not None or time.time() > deadline:
                    raise UsageError(f"the server did not start; see {log_path}")
                time.sleep(0.5)


def _follow(client, experiment_id: int, worker: subprocess.Popen, log_path: Path) -> dict:
    """Print each change of the runs' statuses until every run has ended; returns the experiment."""
    last = ""
    while True:
        exp = client.get_experiment(experiment_id)
        line = "  ".join(f"{r['label']}: {r['status']}"
                         + (f" {r['progress'].get('step', 0)}/{r['progress'].get('total')}"
                            if r["status"] == "running" and r.get("progress") else "") for r in exp["runs"])
        if line != last:
            print(f"[plab] {line}", flush=True)
            last = line
        if all(r["status"] in FINAL for r in exp["runs"]):
            return exp
        if worker.poll() is not None:
            raise UsageError(f"the worker stopped; see {log_path}")
        time.sleep(2)


def demo_recipes(text: str | None) -> list[str]:
    """--recipes as a list of catalog names, checked before anything starts."""
    from training.precision import catalog

    if text is None:
        return list(DEMO_RECIPES)
    recipes = [r.strip() for r in text.split(",") if r.strip()]
    if not recipes:
        raise UsageError(f"--recipes names no recipe; give e.g. --recipes {','.join(DEMO_RECIPES)}")
    for name in recipes:
        try:
            catalog.get(name)
        except catalog.RecipeError as e:
            raise UsageError(f"--recipes: {e}") from None
    return recipes


def cmd_demo(args) -> int:
    from workers.client import PlabClient

    recipes = demo_recipes(args.recipes)
    port = _free_port(args.port)
    home, env = _demo_env(args, port)
    py, logs = sys.executable, home / "logs"
    server = _spawn([py, "-m", "plab.cli", "serve", "--port", str(port), "--log-level", "warning"], env,
                    logs / "server.log")
    worker = _spawn([py, "-m", "plab.cli", "worker", "--slots", str(args.slots), "--log-level", "warning"], env,
                    logs / "worker.log")
    serving, ok = False, False
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_server(url, server, logs / "server.log")
        client = PlabClient.from_env(url)
        with api_call(url, "the demo's experiment"):
            exp = client.create_experiment(demo_experiment(args.steps, recipes))
        page = f"{url}/experiments/{exp['id']}"
        print(f"[plab] experiment {exp['id']} with {len(exp['runs'])} runs; dashboard: {page}", flush=True)
        exp = _follow(client, exp["id"], worker, logs / "worker.log")
        print(_summary_table(exp, client.get_verdict(exp["id"])), flush=True)
        ok = all(r["status"] == "succeeded" for r in exp["runs"])
        if args.no_serve:
            return 0 if ok else 1
        print(f"[plab] dashboard: {page}   (Ctrl-C to stop)", flush=True)
        serving = True
        while server.poll() is None:
            time.sleep(1)
        return 0 if ok else 1
    except KeyboardInterrupt:  # stopping the dashboard after the runs is how serving ends; before, an interruption
        if serving:
            return 0 if ok else 1
        print("plab: interrupted before the demo's runs finished", file=sys.stderr, flush=True)
        return 130
    finally:
        for p in (server, worker):
            _stop(p)


def add_parser(sub: argparse._SubParsersAction) -> None:
    dm = sub.add_parser("demo", help="embedded one-shot comparison on SQLite with an embedded broker")
    dm.add_argument("--no-serve", action="store_true", help="exit when the runs finish, with a summary table")
    dm.add_argument("--steps", type=whole_number(1), default=100)
    dm.add_argument("--recipes", help=f"comma-separated (default {','.join(DEMO_RECIPES)})")
    dm.add_argument("--slots", type=whole_number(1), default=2, help="runs trained at the same time")
    dm.add_argument("--port", type=port_number, default=8000,
                    help="the dashboard's port (the next free one when taken)")
    dm.add_argument("--home", help="state folder (default $PLAB_HOME or ./plab-data)")
    dm.add_argument("--keep-env", action="store_true", help="use PLAB_DATABASE_URL/PLAB_BROKER_URL if set")
    dm.set_defaults(func=cmd_demo)

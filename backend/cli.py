"""`plab`: the command line of Precision Lab.

    plab demo [--no-serve]        embedded one-shot: server + worker + a BF16-vs-formats comparison (SQLite, no services)
    plab serve                    the API and dashboard
    plab worker [--gpus 0,1]      a Celery worker (one job per GPU slot)
    plab db upgrade               apply database migrations
    plab submit FILE              create an experiment from a YAML/JSON file through the API
    plab train FILE               train one run directly, no server
    plab eval ...                 evaluate checkpoints with lm-evaluation-harness
    plab gemm-bench ...           per-layer GEMM benchmark
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

FINAL = {"succeeded", "failed", "cancelled", "diverged"}


class UsageError(Exception):
    """A problem with what the user typed or wrote in a file; printed without a traceback."""


def _load_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: no such file")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise UsageError(f"{path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _free_port(preferred: int) -> int:
    for port in [preferred] + list(range(preferred + 1, preferred + 50)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- serve / worker / db ------------------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    import uvicorn

    from backend.app import create_app

    app = create_app(migrate=False if args.no_migrate else None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def parse_gpus(spec: str | None) -> list[str]:
    if not spec:
        return []
    if spec == "all":
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    gpus = [g.strip() for g in spec.split(",") if g.strip()]
    for g in gpus:
        if not g.isdigit():
            raise UsageError(f"--gpus: {g!r} is not a GPU index; write e.g. --gpus 0,1 or --gpus all")
    if len(set(gpus)) != len(gpus):
        raise UsageError(f"--gpus: {spec!r} lists a GPU twice")
    return gpus


def worker_plan(gpus: list[str], slots: int | None, multi_gpu: bool, queues: str | None,
                device_kind: str | None) -> dict:
    """How a worker maps its devices to pool slots and which queues it reads."""
    if gpus and multi_gpu:
        slot_devices, kind = [",".join(gpus)], (device_kind or "gpu") + f"-x{len(gpus)}"
    elif gpus:
        slot_devices, kind = gpus, device_kind or "gpu"
    else:
        slot_devices, kind = ["cpu"] * (slots or 1), device_kind or "cpu"
    qs = queues.split(",") if queues else ["default", kind]
    threads = max(1, (os.cpu_count() or 1) // len(slot_devices))
    return {"slots": slot_devices, "queues": qs, "threads": threads}


def cmd_worker(args) -> int:
    plan = worker_plan(parse_gpus(args.gpus), args.slots, args.multi_gpu, args.queues, args.device_kind)
    os.environ["PLAB_WORKER_SLOTS"] = ";".join(plan["slots"])
    os.environ.setdefault("PLAB_JOB_THREADS", str(plan["threads"]))
    from workers.celery_app import app

    argv = ["worker", "--loglevel", args.log_level, "--pool", "prefork", "--concurrency", str(len(plan["slots"])),
            "--queues", ",".join(plan["queues"]), "--hostname", args.hostname or f"plab@{socket.gethostname()}",
            "--without-mingle", "--without-gossip"]
    print(f"[plab] worker: {len(plan['slots'])} slot(s) {plan['slots']}, queues {plan['queues']}", flush=True)
    app.worker_main(argv)
    return 0


def cmd_flower(args) -> int:
    """Flower, Celery's monitoring UI, on this deployment's broker."""
    from workers.celery_app import app

    app.start(["flower", f"--port={args.port}", f"--address={args.host}"])
    return 0


def cmd_db(args) -> int:
    from backend.migrate import upgrade
    from backend.settings import get_settings

    url = get_settings().database_url
    upgrade(url)
    print(f"[plab] database at {url.split('@')[-1]} is at the latest schema")
    return 0


# -- submit / train -----------------------------------------------------------------------------------------------
def _client(api_url: str | None = None):
    from backend.settings import get_settings
    from workers.client import PlabClient

    s = get_settings()
    return PlabClient(api_url or s.api_url, s.api_token)


def cmd_submit(args) -> int:
    from workers.client import ApiError

    body = _load_file(args.file)
    client = _client(args.api_url)
    try:
        exp = client.create_experiment(body)
    except ApiError as e:
        raise UsageError(f"the server refused the experiment: {e.message}") from e
    print(f"experiment {exp['id']} '{exp['name']}': {len(exp['runs'])} run(s) queued "
          f"({', '.join(r['label'] for r in exp['runs'])})")
    print(f"{client.base_url}/experiments/{exp['id']}")
    return 0


def cmd_train(args) -> int:
    from training.config import RunSpec, SpecError
    from training.sink import JsonlSink, MetricSink
    from training import launch

    data = _load_file(args.file)
    if args.recipe:
        data["recipe"] = args.recipe
    try:
        spec = RunSpec.from_dict(data)
    except SpecError as e:
        raise UsageError(f"{args.file}: {e}") from e

    class Printer(MetricSink):
        def __init__(self, inner):
            self.inner = inner

        def log(self, step, metrics, *, tokens, wall_time):
            if self.inner:
                self.inner.log(step, metrics, tokens=tokens, wall_time=wall_time)
            if "train/loss" in metrics and (step % args.print_every == 0):
                print(f"step {step:>6}  loss {metrics['train/loss']:.4f}  "
                      f"tok/s {metrics.get('perf/tokens_per_s', float('nan')):,.0f}", flush=True)

        def event(self, kind, **fields):
            if self.inner:
                self.inner.event(kind, **fields)

        def close(self):
            if self.inner:
                self.inner.close()

    sink = Printer(JsonlSink(args.metrics) if args.metrics else None)
    result = launch.run(spec, sink, output_dir=Path(args.output), resume=not args.no_resume)
    sink.close()
    print(json.dumps({"status": result.status, "steps": result.steps, "final_loss": result.final_loss,
                      "final_val_loss": result.final_val_loss, "diverged_step": result.diverged_step,
                      "gemm_backend": result.gemm_backend, "checkpoint": str(result.checkpoint_dir)}, indent=2))
    return 0 if result.status == "succeeded" else 1


# -- demo ---------------------------------------------------------------------------------------------------------
DEMO_RECIPES = ["bf16", "fp8_tensorwise", "mxfp8", "nvfp4"]


def demo_experiment(steps: int, recipes: list[str]) -> dict:
    return {
        "name": "demo: BF16 vs low-precision recipes (tiny Llama, tinyshakespeare)",
        "description": "Created by `plab demo`. On a CPU every low-precision recipe runs as exact emulation.",
        "model": "tiny",
        "data": {"corpus": "tinyshakespeare", "vocab_size": 1024, "seq_len": 128},
        "training": {"steps": steps, "batch_size": 8, "lr": 3e-3, "warmup_steps": max(1, steps // 10),
                     "val_every": max(10, steps // 4)},
        "seed": 0,
        "recipes": recipes,
    }


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


def _summary_table(exp: dict) -> str:
    runs = exp["runs"]
    base = next((r for r in runs if r["recipe"] == "bf16" and r["status"] == "succeeded"), None)
    base_loss = (base or {}).get("summary", {}).get("final_loss")
    base_tps = (base or {}).get("summary", {}).get("tokens_per_s")
    lines = [f"{'run':<28} {'status':<10} {'GEMMs':<9} {'final loss':>10} {'vs BF16':>8} {'tok/s':>9} {'speed':>6}"]
    for r in runs:
        s = r.get("summary") or {}
        loss, tps = s.get("final_loss"), s.get("tokens_per_s")
        d = f"{100 * (loss - base_loss) / base_loss:+.2f}%" if loss is not None and base_loss else "-"
        sp = f"{tps / base_tps:.2f}x" if tps and base_tps else "-"
        lines.append(f"{r['label'][:28]:<28} {r['status']:<10} {(r.get('gemm_backend') or '-'):<9} "
                     f"{(f'{loss:.4f}' if loss is not None else '-'):>10} {d:>8} "
                     f"{(f'{tps:,.0f}' if tps else '-'):>9} {sp:>6}")
    lines.append("Throughput of emulated recipes is not a speed claim: emulation runs BF16/FP32 GEMMs on "
                 "dequantized values.")
    return "\n".join(lines)


def cmd_demo(args) -> int:
    from backend.settings import get_settings

    home = Path(args.home or os.environ.get("PLAB_HOME", "plab-data")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port(args.port)
    env = dict(os.environ, PLAB_HOME=str(home), PLAB_API_URL=f"http://127.0.0.1:{port}")
    env.pop("PLAB_DATABASE_URL", None) if not args.keep_env else None
    env.pop("PLAB_BROKER_URL", None) if not args.keep_env else None
    os.environ.update({k: env[k] for k in ("PLAB_HOME", "PLAB_API_URL")})
    settings = get_settings()
    corpus = settings.data_dir / "tinyshakespeare"
    if not corpus.is_dir():
        raise UsageError(f"the demo trains on {corpus}, which does not exist: set PLAB_DATA_DIR to the folder "
                         "that holds 'tinyshakespeare/'")
    env["PLAB_DATA_DIR"] = str(settings.data_dir)
    (home / "logs").mkdir(exist_ok=True)
    py = sys.executable
    print(f"[plab] home {home}; database SQLite; broker embedded (filesystem); data {settings.data_dir}", flush=True)
    server = _spawn([py, "-m", "backend.cli", "serve", "--port", str(port), "--log-level", "warning"], env,
                    home / "logs" / "server.log")
    worker = _spawn([py, "-m", "backend.cli", "worker", "--slots", str(args.slots), "--log-level", "warning"], env,
                    home / "logs" / "worker.log")
    procs = [server, worker]
    try:
        client = _client(f"http://127.0.0.1:{port}")
        deadline = time.time() + 120
        while True:
            try:
                client._http.get("/health").raise_for_status()
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if server.poll() is not None or time.time() > deadline:
                    raise UsageError(f"the server did not start; see {home / 'logs' / 'server.log'}")
                time.sleep(0.5)
        recipes = args.recipes.split(",") if args.recipes else DEMO_RECIPES
        exp = client.create_experiment(demo_experiment(args.steps, recipes))
        url = f"http://127.0.0.1:{port}/experiments/{exp['id']}"
        print(f"[plab] experiment {exp['id']} with {len(exp['runs'])} runs; dashboard: {url}", flush=True)
        last = ""
        while True:
            exp = client.get_experiment(exp["id"])
            line = "  ".join(f"{r['label']}: {r['status']}"
                             + (f" {r['progress'].get('step', 0)}/{r['progress'].get('total')}"
                                if r["status"] == "running" and r.get("progress") else "") for r in exp["runs"])
            if line != last:
                print(f"[plab] {line}", flush=True)
                last = line
            if all(r["status"] in FINAL for r in exp["runs"]):
                break
            if worker.poll() is not None:
                raise UsageError(f"the worker stopped; see {home / 'logs' / 'worker.log'}")
            time.sleep(2)
        print(_summary_table(exp), flush=True)
        ok = all(r["status"] == "succeeded" for r in exp["runs"])
        if args.no_serve:
            return 0 if ok else 1
        print(f"[plab] dashboard: {url}   (Ctrl-C to stop)", flush=True)
        while server.poll() is None:
            time.sleep(1)
        return 0 if ok else 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in procs:
            _stop(p)


# -- delegated commands -------------------------------------------------------------------------------------------
def cmd_eval(argv: list[str]) -> int:
    """`plab eval RUN_ID --tasks a,b [--limit N] [--wait]` starts an evaluation job through the API; anything else
    (a checkpoint folder, --list-tasks, --compare) is the local lm-eval front end of training.evaluation."""
    from training.evaluation import main as eval_main

    if argv and argv[0].isdigit() and not Path(argv[0]).exists():
        return _eval_run_via_api(argv)
    return eval_main(argv) or 0


def _eval_run_via_api(argv: list[str]) -> int:
    from workers.client import ApiError

    p = argparse.ArgumentParser(prog="plab eval RUN_ID", description="evaluate a run's checkpoint on the workers")
    p.add_argument("run_id", type=int)
    p.add_argument("--tasks", required=True, help="comma-separated, e.g. plab_blimp,plab_lambada_openai")
    p.add_argument("--limit", type=int, help="documents per task")
    p.add_argument("--wait", action="store_true", help="wait for the job and print its results")
    p.add_argument("--api-url")
    a = p.parse_args(argv)
    client = _client(a.api_url)
    body = {"tasks": [t for t in a.tasks.split(",") if t]}
    if a.limit:
        body["limit"] = a.limit
    try:
        ev = client._request("POST", f"/runs/{a.run_id}/evaluations", json=body)
    except ApiError as e:
        raise UsageError(e.message) from e
    print(f"evaluation {ev['id']} of run {a.run_id} queued: {', '.join(ev['tasks'])}")
    while a.wait and ev["status"] in ("queued", "running"):
        time.sleep(2)
        ev = client._request("GET", f"/evaluations/{ev['id']}")
    if a.wait:
        for r in ev["results"]:
            shown = ", ".join(f"{m} {v.get('value'):.4f}" for m, v in (r["metrics"].get("metrics") or {}).items()
                              if isinstance(v, dict) and v.get("value") is not None)
            print(f"  {r['task']:<28} {shown}")
        print(f"status: {ev['status']}" + (f" ({ev['error_message']})" if ev.get("error_message") else ""))
        return 0 if ev["status"] == "succeeded" else 1
    return 0


def cmd_gemm(argv: list[str]) -> int:
    """`plab gemm-bench ...` runs training.gemm's benchmark on this machine; with `--post` (or `--experiment ID`)
    the result is also stored through the API, where the experiment page shows it next to the training runs."""
    import httpx

    from training.gemm import main as gemm_main
    from workers.client import ApiError, PlabClient

    # allow_abbrev=False: an abbreviation of a benchmark option (e.g. --mo for --model) must reach the benchmark's
    # parser, not be taken for one of these.
    p = argparse.ArgumentParser(prog="plab gemm-bench", add_help=False, allow_abbrev=False,
                                usage="plab gemm-bench [benchmark options] [--post] [--experiment ID] [--name NAME] "
                                      "[--api-url URL]")
    g = p.add_argument_group("storing the result through the API (token: $PLAB_API_TOKEN)")
    g.add_argument("--post", action="store_true",
                   help="after the run, store the result as a GEMM benchmark on the API server")
    g.add_argument("--experiment", type=int, metavar="ID",
                   help="attach the result to experiment ID (its page shows the GEMM panel); implies --post")
    g.add_argument("--name", default="", help="a label for the stored benchmark")
    g.add_argument("--api-url", help="the API server (default: $PLAB_API_URL or http://127.0.0.1:8000)")
    opts, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        try:
            gemm_main(["--help"])
        except SystemExit:
            pass
        print("\n" + g.title + ":")
        print("\n".join(line for line in p.format_help().splitlines()[2:] if line.strip() and not line.endswith(":")))
        return 0
    if opts.experiment is not None and opts.experiment < 1:
        raise UsageError(f"--experiment must be a positive experiment id, got {opts.experiment}")
    post_result = None
    if opts.post or opts.experiment is not None:
        from backend.settings import get_settings

        settings = get_settings()
        url = opts.api_url or settings.api_url
        client = PlabClient(url, settings.api_token, retries=1)
        # Checked before the benchmark runs: a long GPU run whose result cannot be stored is time lost.
        try:
            client.health()
            if opts.experiment is not None:
                client.get_experiment(opts.experiment)
        except ApiError as e:
            raise UsageError(f"{url}: {e.message}") from e
        except httpx.HTTPError as e:
            raise UsageError(f"cannot reach the API at {url} ({e}); start it with `plab serve` or pass --api-url")

        def post_result(result: dict) -> None:
            try:
                bench = client.post_gemm_result(result, experiment_id=opts.experiment, name=opts.name)
            except (ApiError, httpx.HTTPError) as e:
                raise UsageError(f"the benchmark ran but {url} did not store its result: {e}"
                                 + ("" if "--output" in rest else "; add --output FILE to keep the JSON")) from e
            where = (f"{url.rstrip('/')}/experiments/{opts.experiment}" if opts.experiment is not None
                     else f"{url.rstrip('/')}/api/v1/gemm-benchmarks/{bench['id']}")
            print(f"\nstored as GEMM benchmark {bench['id']}: {where}")

    return gemm_main(rest, post_result=post_result) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plab", description="Precision Lab: low-precision training against BF16.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the API and dashboard")
    s.add_argument("--host", default=os.environ.get("PLAB_HOST", "127.0.0.1"))
    s.add_argument("--port", type=int, default=int(os.environ.get("PLAB_PORT", "8000")))
    s.add_argument("--no-migrate", action="store_true", help="do not apply migrations on start")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser("worker", help="run a Celery worker")
    w.add_argument("--gpus", help="GPU indices, e.g. 0,1 (one single-GPU job per device) or 'all'")
    w.add_argument("--multi-gpu", action="store_true", help="run one multi-GPU job at a time over all --gpus")
    w.add_argument("--slots", type=int, help="concurrent CPU jobs when no GPU is given (default 1)")
    w.add_argument("--queues", help="comma-separated queues (default: 'default' and the device kind)")
    w.add_argument("--device-kind", help="queue name for this hardware, e.g. h100, b200 (default gpu/cpu)")
    w.add_argument("--hostname")
    w.add_argument("--log-level", default="info")
    w.set_defaults(func=cmd_worker)

    f = sub.add_parser("flower", help="Celery's monitoring UI for the workers")
    f.add_argument("--host", default="0.0.0.0")
    f.add_argument("--port", type=int, default=5555)
    f.set_defaults(func=cmd_flower)

    d = sub.add_parser("db", help="database maintenance")
    d.add_argument("action", choices=["upgrade"])
    d.set_defaults(func=cmd_db)

    sm = sub.add_parser("submit", help="create an experiment from a YAML/JSON file")
    sm.add_argument("file")
    sm.add_argument("--api-url", help="default: $PLAB_API_URL or http://127.0.0.1:8000")
    sm.set_defaults(func=cmd_submit)

    t = sub.add_parser("train", help="train one run from a run-spec file, no server")
    t.add_argument("file")
    t.add_argument("--recipe", help="override the file's recipe")
    t.add_argument("--output", default="plab-data/train", help="checkpoint folder")
    t.add_argument("--metrics", help="also write metrics to this JSONL file")
    t.add_argument("--no-resume", action="store_true")
    t.add_argument("--print-every", type=int, default=10)
    t.set_defaults(func=cmd_train)

    dm = sub.add_parser("demo", help="embedded one-shot comparison on SQLite with an embedded broker")
    dm.add_argument("--no-serve", action="store_true", help="exit when the runs finish, with a summary table")
    dm.add_argument("--steps", type=int, default=100)
    dm.add_argument("--recipes", help=f"comma-separated (default {','.join(DEMO_RECIPES)})")
    dm.add_argument("--slots", type=int, default=2, help="runs trained at the same time")
    dm.add_argument("--port", type=int, default=8000)
    dm.add_argument("--home", help="state folder (default $PLAB_HOME or ./plab-data)")
    dm.add_argument("--keep-env", action="store_true", help="use PLAB_DATABASE_URL/PLAB_BROKER_URL if set")
    dm.set_defaults(func=cmd_demo)

    sub.add_parser("eval", help="evaluate with lm-evaluation-harness (plab eval --help)", add_help=False)
    sub.add_parser("gemm-bench", help="per-layer GEMM benchmark (plab gemm-bench --help)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "eval":
            return cmd_eval(argv[1:])
        if argv and argv[0] == "gemm-bench":
            return cmd_gemm(argv[1:])
        args = build_parser().parse_args(argv)
        if getattr(args, "steps", 1) is not None and getattr(args, "steps", 1) < 1:
            raise UsageError("--steps must be at least 1")
        return args.func(args)
    except UsageError as e:
        print(f"plab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`plab serve`, `plab worker`, `plab flower`, `plab db`: the long-running services and database maintenance."""
from __future__ import annotations

import argparse
import os
import socket

from plab.cli.common import UsageError, port_from_env, port_number, whole_number


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def cmd_serve(args) -> int:
    import uvicorn

    from backend.app import create_app
    from plab.settings import get_settings

    if args.host not in LOOPBACK and not get_settings().api_token and not args.insecure_no_token:
        raise UsageError(f"refusing to serve on {args.host} without PLAB_API_TOKEN: anyone who reaches the port "
                         "could create and cancel runs. Set PLAB_API_TOKEN to a long random secret (e.g. `openssl "
                         "rand -hex 32`), or bind 127.0.0.1, or pass --insecure-no-token on a trusted network")
    port = args.port if args.port is not None else port_from_env("PLAB_PORT", 8000)
    check_port_free(args.host, port, "--port or PLAB_PORT")
    app = create_app(migrate=False if args.no_migrate else None)
    uvicorn.run(app, host=args.host, port=port, log_level=args.log_level)
    return 0


def check_port_free(host: str, port: int, how: str) -> None:
    """A port another process listens on is named before the server starts (uvicorn would start the app, log the
    bind error over several lines and exit with status 3). Binds as asyncio's create_server, which uvicorn serves
    with, does: every address `host` resolves to, SO_REUSEADDR, IPv6 sockets IPv6-only, families this machine
    lacks skipped."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise UsageError(f"--host {host}: {e.strerror or e}; give an address of this machine, e.g. 127.0.0.1") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        try:
            s = socket.socket(family, kind, proto)
        except OSError:
            continue  # e.g. no IPv6 here: asyncio skips it too
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                raise UsageError(f"port {port} on {host} cannot be used ({e.strerror or e}: another server - an "
                                 f"earlier `plab serve`? - may hold it); stop it or choose another port with {how}"
                                 ) from None


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


def _check_gpus_exist(gpus: list[str]) -> None:
    """Each listed index names a CUDA GPU this process sees (after CUDA_VISIBLE_DEVICES): a worker that started
    with one missing took GPU jobs and failed every one of them."""
    import torch

    count = torch.cuda.device_count()
    missing = [g for g in gpus if int(g) >= count]
    if missing:
        have = f"{count} CUDA GPU(s), indices 0 to {count - 1}" if count else "no CUDA GPU"
        raise UsageError(f"--gpus: GPU {', '.join(missing)} is not on this machine ({have} visible); list "
                         f"existing ones, or leave --gpus out for CPU slots")


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
    if args.launcher == "slurm":
        _slurm_setup(args)
        # The Slurm jobs use the cluster's nodes: this host only submits and watches them, one run per slot.
        args.gpus, args.multi_gpu = None, False
        args.device_kind = args.device_kind or "slurm"
        # Only runs sent to it (training.queue: slurm): the single-host path stays the default for the others.
        args.queues = args.queues or args.device_kind
    gpus = parse_gpus(args.gpus)
    if args.gpus == "all" and not gpus:
        # The deployment's one command (docker-compose.yml) on a host without GPUs: CPU slots.
        print("[plab] worker: --gpus all found no CUDA GPU here; running CPU slot(s)", flush=True)
    elif gpus and args.slots is not None:
        if args.gpus != "all":
            raise UsageError(f"--slots {args.slots} is for CPU jobs; with --gpus each listed GPU is one slot "
                             f"(or --multi-gpu: one job over all of them)")
        print(f"[plab] worker: --slots {args.slots} ignored: --gpus all found {len(gpus)} GPU(s), one slot each",
              flush=True)
    if gpus and args.gpus != "all":
        _check_gpus_exist(gpus)
    plan = worker_plan(gpus, args.slots, args.multi_gpu, args.queues, args.device_kind)
    # Read by each pool process as it starts (workers.tasks pins slot i to the i-th entry).
    os.environ["PLAB_WORKER_SLOTS"] = ";".join(plan["slots"])
    os.environ.setdefault("PLAB_JOB_THREADS", str(plan["threads"]))
    from workers.celery_app import app

    hostname = args.hostname or f"plab@{socket.gethostname()}"
    argv = ["worker", "--loglevel", args.log_level, "--pool", "prefork", "--concurrency", str(len(plan["slots"])),
            "--queues", ",".join(plan["queues"]), "--hostname", hostname,
            "--without-mingle", "--without-gossip"]
    _register_with_api(hostname, plan, args.launcher)
    print(f"[plab] worker: {len(plan['slots'])} slot(s) {plan['slots']}, queues {plan['queues']}", flush=True)
    app.worker_main(argv)
    return 0


def _register_with_api(name: str, plan: dict, launcher: str) -> None:
    """Tell the API what this worker offers, now and every PLAB_WORKER_BEAT_S (30) seconds, from a thread; the
    API refuses runs that no live worker of their queue can place. A worker the API cannot reach still works."""
    import threading
    import time

    from workers.client import PlabClient

    slot = plan["slots"][0]
    gpus = 0 if slot == "cpu" else len(slot.split(","))
    interval = float(os.environ.get("PLAB_WORKER_BEAT_S", "30"))

    def beat():
        warned = False
        while True:
            try:
                with PlabClient.from_env(retries=0) as client:
                    client.register_worker(name, plan["queues"], len(plan["slots"]), gpus, launcher)
                warned = False
            except Exception as e:  # noqa: BLE001 - registration is advisory
                if not warned:
                    print(f"[plab] worker: could not register with the API ({e}); retrying", flush=True)
                    warned = True
            time.sleep(interval)

    threading.Thread(target=beat, daemon=True, name="plab-worker-register").start()


def _slurm_setup(args) -> None:
    """`--launcher slurm`: the Slurm client commands must be here; the options reach the pool processes."""
    import shlex
    import shutil

    from workers.slurm import SlurmOptions

    missing = [c for c in ("sbatch", "scontrol", "scancel") if shutil.which(c) is None]
    if missing:
        raise UsageError(f"--launcher slurm needs the Slurm client commands on this host ({', '.join(missing)} not "
                         "found): install Slurm's client (Debian: slurm-client) and its configuration")
    if args.slurm_poll_s <= 0:
        raise UsageError("--slurm-poll-s must be a positive number of seconds")
    opts = SlurmOptions(partition=args.partition, account=args.account, time_limit=args.time,
                        gpus=not args.cpu_nodes, extra=shlex.split(args.sbatch_args or ""), poll_s=args.slurm_poll_s)
    os.environ.update(opts.to_env())


def cmd_flower(args) -> int:
    """Flower, Celery's monitoring UI, on this deployment's broker: loopback only, unless basic auth is set."""
    from workers.celery_app import app

    auth = args.basic_auth or os.environ.get("PLAB_FLOWER_BASIC_AUTH", "")
    if auth and (":" not in auth or auth.startswith(":") or auth.endswith(":")):
        raise UsageError("Flower's basic auth must be USER:PASSWORD (PLAB_FLOWER_BASIC_AUTH or --basic-auth)")
    if args.host not in LOOPBACK and not auth:
        raise UsageError(f"refusing to run Flower on {args.host} without basic auth: it can revoke and inspect "
                         "tasks. Set PLAB_FLOWER_BASIC_AUTH=user:password, or bind 127.0.0.1")
    argv = ["flower", f"--port={args.port}", f"--address={args.host}"]
    app.start(argv + ([f"--basic-auth={auth}"] if auth else []))
    return 0


def cmd_db(args) -> int:
    from backend.migrate import upgrade
    from plab.settings import get_settings

    url = get_settings().database_url
    upgrade(url)
    print(f"[plab] database at {url.split('@')[-1]} is at the latest schema")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="run the API and dashboard")
    s.add_argument("--host", default=os.environ.get("PLAB_HOST", "127.0.0.1"))
    s.add_argument("--port", type=port_number, default=None, help="default: $PLAB_PORT or 8000")
    s.add_argument("--no-migrate", action="store_true", help="do not apply migrations on start")
    s.add_argument("--insecure-no-token", action="store_true",
                   help="serve on a non-loopback address without PLAB_API_TOKEN (writes open to anyone)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"))
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser("worker", help="run a Celery worker")
    w.add_argument("--gpus", help="GPU indices, e.g. 0,1 (one single-GPU job per device) or 'all'")
    w.add_argument("--multi-gpu", action="store_true", help="run one multi-GPU job at a time over all --gpus")
    w.add_argument("--slots", type=whole_number(1), help="concurrent CPU jobs when no GPU is given (default 1)")
    w.add_argument("--queues", help="comma-separated queues (default: 'default' and the device kind)")
    w.add_argument("--device-kind", help="queue name for this hardware, e.g. h100, b200 (default gpu/cpu)")
    w.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="local: jobs run on this host (default); slurm: each training run is submitted as a Slurm "
                        "job (training.nodes x training.gpus) and watched from here")
    w.add_argument("--partition", help="Slurm partition (--launcher slurm)")
    w.add_argument("--account", help="Slurm account (--launcher slurm)")
    w.add_argument("--time", help="Slurm time limit, e.g. 04:00:00 (--launcher slurm; a run that reaches it is "
                                  "requeued and resumes from its checkpoint)")
    w.add_argument("--cpu-nodes", action="store_true", help="the Slurm nodes have no GPUs: no --gpus-per-node, gloo")
    w.add_argument("--sbatch-args", help="more sbatch options, e.g. '--qos=high --constraint=h100'")
    w.add_argument("--slurm-poll-s", type=float, default=5.0, help="seconds between looks at a Slurm job")
    w.add_argument("--hostname")
    w.add_argument("--log-level", default="info", type=str.lower,
                   choices=("critical", "error", "warning", "info", "debug"))
    w.set_defaults(func=cmd_worker)

    f = sub.add_parser("flower", help="Celery's monitoring UI for the workers")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--basic-auth", default=None, help="USER:PASSWORD (default: PLAB_FLOWER_BASIC_AUTH)")
    f.add_argument("--port", type=port_number, default=5555)
    f.set_defaults(func=cmd_flower)

    d = sub.add_parser("db", help="database maintenance")
    d.add_argument("action", choices=["upgrade"])
    d.set_defaults(func=cmd_db)

"""Trainer throughput on one GPU against the reference stack, in one call (issue 4, acceptance).

What it runs, each in a fresh subprocess (so compile caches, allocator state and CUDA contexts never
leak from one measurement into the next):
  1. the reference `hf_llama_anchor.py --size 1b --recipe bf16` (HF Llama, BF16 params, compile, fused AdamW);
  2. our `training.train.train` on the `1b` preset, batch 4 x 2048, random tokens, compile on, once per
     config: a recipe name, optionally with perf switches, e.g. `bf16:sdpa_backend=cudnn,fused_loss=false`.
Metrics go every step through a sink that batches points in a background thread and serialises them
like an HTTP client would (JSON batches), and the time the training thread spends in `sink.log` is
reported as a share of the step time.

Usage (on the GPU machine, repo root; the anchor is looked up at .devcarry/hf_llama_anchor.py, then
../shared/tools/hf_llama_anchor.py):

    python bench/train_bench.py                                  # anchor + every recipe, until the budget
    python bench/train_bench.py --configs bf16 bf16:sdpa_backend=cudnn bf16:fused_loss=false
    python bench/train_bench.py --configs bf16 fp8_tensorwise --budget-s 500 --no-anchor
    python bench/train_bench.py --configs bf16 --gpus 2 --batch 8 --no-anchor   # 2-GPU DDP scaling
    python bench/train_bench.py --configs bf16 --no-anchor --profile            # where the step's time goes

Perf switches (training.perf of the run spec): fused_loss, loss_chunk_tokens, fused_clip, bf16_residual,
sdpa_backend (auto|cudnn|flash|efficient|math), compile_mode, metrics_lag, prefetch, allow_tf32; plus
`compile` and `activation_checkpointing` (training keys). An A/B of the BF16 path in one call (~8 min):

    python bench/train_bench.py --configs bf16 bf16:sdpa_backend=cudnn \
        bf16:sdpa_backend=cudnn,bf16_residual=true bf16:fused_loss=false,fused_clip=false Writes `$OUT/train_bench.json` (when $OUT is set) and
`bench/results/train_bench_<date>_<gpu>.json`, and prints the ratio table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ANCHOR_PATHS = [REPO / ".devcarry" / "hf_llama_anchor.py", REPO.parent / "shared" / "tools" / "hf_llama_anchor.py"]
BOOL_KEYS = {"fused_loss", "prefetch", "allow_tf32", "fused_clip", "bf16_residual", "compile",
             "activation_checkpointing"}
INT_KEYS = {"loss_chunk_tokens", "metrics_lag"}
TRAINING_KEYS = {"compile", "activation_checkpointing"}


# ---------------------------------------------------------------------------------------------------
# configs
def parse_config(text: str) -> dict:
    """'bf16:sdpa_backend=cudnn,fused_loss=false' → {"label", "recipe", "perf": {...}, "training": {...}}."""
    recipe, _, opts = text.partition(":")
    perf, training = {}, {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"config {text!r}: expected key=value, got {item!r}")
        if key in BOOL_KEYS:
            if value.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise SystemExit(f"config {text!r}: {key} takes true/false, got {value!r}")
            value = value.lower() in ("true", "1", "on")
        elif key in INT_KEYS:
            value = int(value)
        elif value in ("none", "null"):
            value = None
        (training if key in TRAINING_KEYS else perf)[key] = value
    return {"label": text, "recipe": recipe, "perf": perf, "training": training}


def run_spec(config: dict, *, steps: int, batch: int, seq: int, model: str = "1b", device: str = "cuda",
             gpus: int = 1) -> dict:
    training = {"steps": steps, "batch_size": batch, "gpus": gpus, "lr": 1e-4, "warmup_steps": 1, "val_every": 0,
                "val_batches": 0, "checkpoint_every": 0, "compile": True, "device": device,
                "perf": dict(config["perf"])}
    training.update(config["training"])
    return {"model": model, "data": {"corpus": "random", "vocab_size": 32000, "seq_len": seq},
            "training": training, "seed": 0, "recipe": config["recipe"]}


# ---------------------------------------------------------------------------------------------------
# worker side: one config in this process
from training.sink import MetricSink  # noqa: E402 (needs the repo root on sys.path)


class BatchingSink(MetricSink):
    """Stand-in for the workers' API streamer: `log` only appends under a lock; a background thread
    drains the buffer every 0.2 s and serialises each batch to JSON (the cost of an HTTP body) and
    writes it out. Records the time the training thread spends inside `log`."""

    def __init__(self, path: Path):
        from training.sink import ListSink
        self.inner = ListSink()
        self.path = path
        self._buf: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.log_seconds: list[float] = []
        self._thread = threading.Thread(target=self._drain_loop, daemon=True)
        self._thread.start()

    on_step = None  # called once per logged training step (drives the profiler's schedule)

    def log(self, step, metrics, *, tokens, wall_time):
        if self.on_step is not None and "train/loss" in metrics:
            self.on_step()
        t0 = time.perf_counter()
        point = {"step": step, "tokens": tokens, "wall_time": wall_time, "metrics": dict(metrics)}
        with self._lock:
            self._buf.append(point)
        self.log_seconds.append(time.perf_counter() - t0)
        self.inner.log(step, metrics, tokens=tokens, wall_time=wall_time)

    def event(self, kind, **fields):
        self.inner.event(kind, **fields)

    def _drain_loop(self):
        with open(self.path, "a") as f:
            while not self._stop.wait(0.2):
                self._flush(f)
            self._flush(f)

    def _flush(self, f):
        with self._lock:
            batch, self._buf = self._buf, []
        if batch:
            points = [{"key": k, "step": p["step"], "value": v, "tokens": p["tokens"], "wall_time": p["wall_time"]}
                      for p in batch for k, v in p["metrics"].items()]
            f.write(json.dumps({"points": points}) + "\n")
            f.flush()

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)


def worker(config_json: str, steps: int, warmup: int, batch: int, seq: int, out_dir: Path, model: str,
           device: str, gpus: int, profile: bool = False) -> dict | None:
    import torch
    from training.train import train

    config = json.loads(config_json)
    spec = run_spec(config, steps=warmup + steps, batch=batch, seq=seq, model=model, device=device, gpus=gpus)
    sink = BatchingSink(out_dir / f"metrics_{os.getpid()}.jsonl")
    prof = None
    if profile:
        # Kernel-time table of 3 steps after warm-up; the profiled steps are slower, so a profiled
        # run's tokens/s is marked and must not be compared with unprofiled ones.
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(
            wait=warmup, warmup=1, active=3, repeat=1))
        prof.start()
        sink.on_step = prof.step
    t0 = time.perf_counter()
    try:
        result = train(spec, sink)
    finally:
        sink.close()
        if prof is not None:
            prof.stop()
    if prof is not None and int(os.environ.get("RANK", "0")) == 0:
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        safe = "".join(ch if ch.isalnum() else "_" for ch in config["label"])[:60]
        (out_dir / f"profile_{safe}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
        return None
    wall = time.perf_counter() - t0
    per_step = {p["step"]: p["metrics"] for p in sink.inner.points if "perf/step_time_s" in p["metrics"]}
    timed = [per_step[s] for s in sorted(per_step) if s > warmup]
    step_s = statistics.median(m["perf/step_time_s"] for m in timed)
    total_step_s = sum(m["perf/step_time_s"] for m in timed)
    tokens_per_step = batch * seq
    log_s = sink.log_seconds[warmup:] or sink.log_seconds
    return {
        "label": config["label"], "recipe": config["recipe"], "status": result.status,
        "spec": spec, "steps_timed": len(timed),
        "tokens_per_s": tokens_per_step / step_s, "step_time_s": step_s,
        "step_time_min_s": min(m["perf/step_time_s"] for m in timed),
        "step_time_max_s": max(m["perf/step_time_s"] for m in timed),
        "data_wait_share": sum(m["perf/data_wait_s"] for m in timed) / total_step_s,
        "sink_log_share": (sum(log_s) / len(log_s)) / step_s,
        "mfu": result.summary.get("mfu"), "tflops": tokens_per_step / step_s * result.summary["flops_per_token"] / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "gemm_backend": result.gemm_backend,
        "label_kind": {"real": "real", "emulated": "emulated", "bf16": "real (bf16)"}.get(result.gemm_backend,
                                                                                         result.gemm_backend),
        "params": result.summary.get("params"), "flops_per_token": result.summary.get("flops_per_token"),
        "first_steps_s": [per_step[s]["perf/step_time_s"] for s in sorted(per_step)[:warmup]],
        "wall_s": wall, "device_name": result.device_name, "profiled": profile,
    }


# ---------------------------------------------------------------------------------------------------
# driver side
def _last_json_line(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _run(cmd: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-1500:]
        return {"error": f"timed out after {timeout:.0f} s",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
                "wall_s": time.perf_counter() - t0}
    out = _last_json_line(proc.stdout)
    if proc.returncode != 0 or out is None:
        return {"error": f"exit code {proc.returncode}", "stderr_tail": proc.stderr[-3000:],
                "wall_s": time.perf_counter() - t0}
    out.setdefault("wall_s", time.perf_counter() - t0)
    return out


def _git_commit() -> str:
    if os.environ.get("PLAB_GIT_COMMIT"):  # a copy of the tree without .git (the GPU machine)
        return os.environ["PLAB_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=10).stdout.strip() or os.environ.get("PLAB_GIT_COMMIT", "unknown")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("PLAB_GIT_COMMIT", "unknown")


def _fmt(x, spec=".0f"):
    width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0)
    return f"{'-':>{width}}" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", "--recipes", nargs="*", default=None,
                    help="recipe[:key=value,...] entries (default: every recipe of training.precision.RECIPES)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=6, help="untimed first steps (compile, allocator)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=520.0, help="skip configs that cannot finish within this")
    ap.add_argument("--per-run-timeout-s", type=float, default=240.0)
    ap.add_argument("--no-anchor", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="write a kernel-time table per config to $OUT/profile_<config>.txt (slows those runs)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="GPUs per config (torchrun + DDP); --batch stays the global batch")
    ap.add_argument("--model", default="1b", help="model preset (1b is the anchor's shape)")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker is not None:
        res = worker(a.worker, a.steps, a.warmup, a.batch, a.seq, Path(a.worker_out), a.model, a.device, a.gpus,
                     a.profile)
        if res is not None:
            print(json.dumps(res), flush=True)
        return 0

    t_begin = time.perf_counter()
    out_env = os.environ.get("OUT")
    # Per-config metric streams and profiles: next to the JSON under $OUT, else in a temp dir (they are
    # scratch, not results to commit).
    scratch = Path(out_env) if out_env else Path(tempfile.mkdtemp(prefix="plab-train-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    if a.configs is None:
        from training.precision import RECIPES
        a.configs = list(RECIPES)
    configs = [parse_config(c) for c in a.configs]

    def remaining():
        return a.budget_s - (time.perf_counter() - t_begin)

    anchor = None
    if not a.no_anchor:
        path = next((p for p in ANCHOR_PATHS if p.exists()), None)
        if path is None:
            anchor = {"error": f"anchor script not found at {[str(p) for p in ANCHOR_PATHS]}"}
        else:
            anchor = _run([sys.executable, str(path), "--size", "1b", "--recipe", "bf16", "--batch", str(a.batch),
                           "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup)],
                          timeout=min(a.per_run_timeout_s, max(remaining(), 1)))
        print(f"[bench] anchor: {json.dumps(anchor)[:400]}", flush=True)

    results, durations = [], []
    for config in configs:
        # A run costs about as long as the slowest so far (compile dominates); skip what cannot finish.
        expected = max(durations) if durations else 90.0
        if remaining() < expected:
            results.append({"label": config["label"], "recipe": config["recipe"],
                            "skipped": f"budget: {remaining():.0f} s left, a run takes ~{expected:.0f} s"})
            print(f"[bench] skip {config['label']}: out of budget", flush=True)
            continue
        launcher = [sys.executable] if a.gpus == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.gpus}"]
        cmd = [*launcher, str(Path(__file__).resolve()), "--worker", json.dumps(config),
               "--worker-out", str(scratch), "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--batch", str(a.batch), "--seq", str(a.seq), "--model", a.model, "--device", a.device, "--gpus", str(a.gpus),
               *(["--profile"] if a.profile else [])]
        res = _run(cmd, timeout=min(a.per_run_timeout_s, max(remaining(), 1)))
        res.setdefault("label", config["label"])
        res.setdefault("recipe", config["recipe"])
        durations.append(res.get("wall_s", 0.0))
        results.append(res)
        print(f"[bench] {config['label']}: {json.dumps({k: v for k, v in res.items() if k != 'spec'})[:600]}",
              flush=True)

    device = next((r.get("device_name") for r in results if r.get("device_name")), None)
    if device is None:
        try:
            import torch
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        except Exception:  # noqa: BLE001 - only for the report header
            device = "unknown"
    ours_bf16 = next((r for r in results if r.get("label") == "bf16" and "tokens_per_s" in r), None)
    anchor_tps = anchor.get("tokens_per_s") if anchor else None
    for r in results:
        if "tokens_per_s" in r:
            r["vs_anchor"] = r["tokens_per_s"] / anchor_tps if anchor_tps else None
            r["vs_our_bf16"] = r["tokens_per_s"] / ours_bf16["tokens_per_s"] if ours_bf16 else None
    report = {
        "bench": "train_bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device, "git_commit": _git_commit(), "model": "1b (1.14B)",
        "batch": a.batch, "seq": a.seq, "gpus": a.gpus, "timed_steps": a.steps, "warmup_steps": a.warmup,
        "anchor": anchor, "results": results, "total_wall_s": time.perf_counter() - t_begin,
        "notes": "tokens/s from the median timed step (CUDA events); MFU against the dense BF16 peak for every "
                 "recipe; emulated recipes' throughput is not hardware throughput.",
    }
    text = json.dumps(report, indent=1, default=str)
    if out_env:
        (Path(out_env) / "train_bench.json").write_text(text)
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    gpu_tag = "".join(ch if ch.isalnum() else "_" for ch in device)[:40]
    (results_dir / f"train_bench_{dt.date.today().isoformat()}_{gpu_tag}.json").write_text(text)

    print(f"\n# train_bench on {a.gpus} x {device}, {a.model}, global batch {a.batch}x{a.seq}, "
          f"median of {a.steps} steps")
    if anchor_tps:
        print(f"anchor hf_llama_anchor bf16: {anchor_tps:,.0f} tok/s, step {anchor['step_s'] * 1e3:.1f} ms, "
              f"peak {anchor.get('peak_mem_gib', 0):.1f} GiB")
    elif anchor:
        print(f"anchor: {anchor.get('error')}")
    print(f"{'config':56s} {'tok/s':>9s} {'vs anchor':>9s} {'vs bf16':>8s} {'step ms':>8s} {'MFU':>6s} "
          f"{'GiB':>6s} {'wait%':>6s} {'sink%':>6s}  gemm")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['label'][:56]:56s} {r.get('skipped') or r.get('error')}")
            continue
        print(f"{r['label'][:56]:56s} {r['tokens_per_s']:9,.0f} {_fmt(r['vs_anchor'], '9.3f')} "
              f"{_fmt(r['vs_our_bf16'], '8.3f')} {r['step_time_s'] * 1e3:8.1f} {_fmt(r['mfu'], '6.3f')} "
              f"{_fmt(r['peak_mem_gib'], '6.1f')} {100 * r['data_wait_share']:6.2f} {100 * r['sink_log_share']:6.3f}  "
              f"{r['label_kind']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

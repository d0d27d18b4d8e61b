"""Where a training step's *host* time goes: train() on the 1b shape with Python's cProfile switched on for a few
steady-state steps, per config (same syntax as bench/train_bench.py). For steps that are host-bound (the GPU
waits for launches: bench/step_profile.py's GPU busy share well below 1), this names the Python functions and
torch ops that the host spends the step in. cProfile slows Python-heavy code, so compare shares between
configs of one call, not absolute times with train_bench. Each config runs in its own subprocess.

    python bench/host_profile.py bf16 bf16:parallel=fsdp fp8_delayed [--steps 6] [--top 30]

Prints per config the wall time per profiled step and the top functions by own time and by cumulative time
(filtered to the step's own code, torch.distributed.fsdp, torch.optim, dynamo/inductor runtime wrappers and
torch.autograd); writes `$OUT/host_profile.json`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def worker(config_text: str, steps: int, top: int, batch: int, seq: int, model: str, device: str) -> dict:
    import cProfile
    import pstats

    from bench.train_bench import parse_config, run_spec
    from training.sink import NullSink
    from training.train import train

    config = parse_config(config_text)
    warmup = 6
    spec = run_spec(config, steps=warmup + steps + 1, batch=batch, seq=seq, model=model, device=device)
    prof = cProfile.Profile()
    state = {"n": 0, "t0": None, "t1": None}

    def should_stop():  # called at the start of every step
        import torch
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        state["n"] += 1
        if state["n"] == warmup + 1:
            sync()
            state["t0"] = time.perf_counter()
            prof.enable()
        elif state["n"] == warmup + steps + 1:
            prof.disable()
            sync()
            state["t1"] = time.perf_counter()
        return False
    train(spec, NullSink(), should_stop=should_stop)
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append({"where": f"{Path(file).name}:{line}({name})" if file != "~" else name,
                     "file": file, "calls": nc / steps, "own_ms": tt * 1e3 / steps, "cum_ms": ct * 1e3 / steps})
    by_own = sorted(rows, key=lambda r: -r["own_ms"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cum_ms"])[:top * 2]
    return {"config": config_text, "ms_per_step_wall": (state["t1"] - state["t0"]) * 1e3 / steps,
            "profiled_ms_per_step": sum(r["own_ms"] for r in rows), "top_own": by_own, "top_cum": by_cum}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="*")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--model", default="1b")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (with --model tiny)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        out = worker(args.worker, args.steps, args.top, args.batch, args.seq, args.model, args.device)
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    from bench.benchmeta import git_commit
    results = {}
    for config in args.configs:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--worker", config, "--steps", str(args.steps), "--top",
                               str(args.top), "--batch", str(args.batch), "--seq", str(args.seq), "--model", args.model,
                               "--device", args.device],
                              capture_output=True, text=True, timeout=args.timeout_s)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"[{config}] failed: {proc.stderr[-2000:]}", flush=True)
            continue
        r = results[config] = json.loads(line[len("RESULT "):])
        print(f"\n## {config}: {r['ms_per_step_wall']:.1f} ms per step under cProfile "
              f"({time.perf_counter() - t0:.0f} s with compile)")
        print(f"{'own ms':>8} {'cum ms':>8} {'calls':>7}  function")
        for row in r["top_own"][:args.top]:
            print(f"{row['own_ms']:8.2f} {row['cum_ms']:8.2f} {row['calls']:7.0f}  {row['where'][:100]}")
        print("  -- by cumulative time --")
        for row in r["top_cum"][:args.top]:
            print(f"{row['own_ms']:8.2f} {row['cum_ms']:8.2f} {row['calls']:7.0f}  {row['where'][:100]}")
    payload = {"bench": "host_profile", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "git_commit": git_commit(), "results": results}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "host_profile.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

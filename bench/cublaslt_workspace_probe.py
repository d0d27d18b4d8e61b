"""Does a recipe train with and without cuBLASLt's workspace, each in a process of its own?

`perf.cublaslt_workspace: none` (CUBLASLT_WORKSPACE_SIZE=0) is what `auto` picks for fp8_tensorwise and fp8_delayed
on Hopper; a user may pick it for any recipe. In one pytest process on an H200, fp8_blockwise failed with
CUBLAS_STATUS_INVALID_VALUE at its first GEMM in a "default" run right after an fp8_rowwise "none" run
(bench/NOTES_floor.md 78), so whether it runs under "none" at all is still open. This trains a small Llama (every
dim a multiple of 128, 4 steps, random tokens) once per (recipe, workspace), each in a fresh process as the CLI, a
worker's job and train_bench run, so nothing one run leaves behind can explain the other's outcome, and records
each run's status, seconds, first error line and losses.

    python bench/cublaslt_workspace_probe.py [--recipes fp8_blockwise fp8_rowwise] [--workspaces default none]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchmeta import REPO, git_commit, write_result  # noqa: E402

_CHILD = """
import json, sys
from training.sink import ListSink
from training.train import train
spec = json.loads(sys.argv[1])
sink = ListSink()
result = train(spec, sink)
print("RESULT " + json.dumps({"status": result.status, "gemm_backend": result.gemm_backend,
      "cublaslt_workspace": result.summary.get("cublaslt_workspace"),
      "losses": [round(v, 6) for _, v in sink.series("train/loss")]}))
"""


def spec(recipe: str, workspace: str, device: str = "cuda") -> dict:
    """The run's spec. On a CPU (the probe's own check: no cuBLASLt there) a quarter of the width, half the sequence and
    a quarter of the batch, every dim still a multiple of 128: ~6 s a run instead of ~25 on 2 cores."""
    cpu = device == "cpu"
    return {"model": {"hidden_size": 128 if cpu else 512, "intermediate_size": 256 if cpu else 1536,
                      "num_hidden_layers": 2, "num_attention_heads": 2 if cpu else 8,
                      "num_key_value_heads": 1 if cpu else 4},
            "data": {"corpus": "random", "vocab_size": 4096, "seq_len": 128 if cpu else 256},
            "training": {"steps": 4, "batch_size": 2 if cpu else 8, "lr": 1e-3, "warmup_steps": 1, "val_every": 0,
                         "device": device, "compile": False, "param_dtype": "bf16",
                         "perf": {"sdpa_backend": "math", "cublaslt_workspace": workspace}},
            "seed": 0, "recipe": recipe}


def error_line(log: str) -> str | None:
    """The last line naming an error (a traceback's last line)."""
    lines = [ln.strip() for ln in log.splitlines() if "Error" in ln or "error" in ln]
    return lines[-1][:500] if lines else None


def child_env(autotune: str) -> dict:
    """This process's environment without a workspace size an earlier run in it set (the caller may be a pytest
    process whose tests trained), so each child starts as a fresh CLI process would."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUBLASLT_WORKSPACE_SIZE", "_PLAB_CUBLASLT_SET")}
    return {**env, "PLAB_BLOCKWISE_AUTOTUNE": autotune}


def probe(recipe: str, workspace: str, timeout_s: float, device: str = "cuda", autotune: str = "quick") -> dict:
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec(recipe, workspace, device))], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout_s,
                              env=child_env(autotune))
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired:
        return {"recipe": recipe, "workspace": workspace, "status": "timeout", "s": round(timeout_s, 1)}
    row = {"recipe": recipe, "workspace": workspace, "rc": rc, "s": round(time.monotonic() - start, 1)}
    marks = [ln for ln in log.splitlines() if ln.startswith("RESULT ")]
    if marks:
        row.update(json.loads(marks[-1][len("RESULT "):]))
    else:
        row.update(status="error", error=error_line(log), log_tail=log[-2000:])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["fp8_blockwise", "fp8_rowwise"])
    ap.add_argument("--workspaces", nargs="+", default=["default", "none"], choices=["default", "none"])
    ap.add_argument("--timeout-s", type=float, default=240.0,
                    help="per run (default 240: an fp8_blockwise run took over 85 s on an H200 with full autotuning)")
    ap.add_argument("--blockwise-autotune", choices=["quick", "full"], default="quick",
                    help="fp8_blockwise: torchao's quantizers autotune over 8 of their 45 configs (quick) or all")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the probe's own check")
    ap.add_argument("--results-dir", type=Path, default=None, help="write the result here instead of bench/results")
    a = ap.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name(0) if a.device == "cuda" and torch.cuda.is_available() else "cpu"
    rows = [probe(r, w, a.timeout_s, a.device, a.blockwise_autotune) for r in a.recipes for w in a.workspaces]
    summary = {"bench": "cublaslt_workspace_probe", "date": dt.datetime.now(dt.timezone.utc).isoformat(
        timespec="seconds"), "device": device, "torch": torch.__version__, "git_commit": git_commit(),
        "command": " ".join(["python bench/cublaslt_workspace_probe.py", *(argv if argv is not None else sys.argv[1:])]),
        "blockwise_autotune": a.blockwise_autotune, "runs": rows}
    write_result(summary, "cublaslt_workspace_probe", device, a.results_dir)
    print(f"\n# cuBLASLt workspace probe on {device} at {summary['git_commit']}")
    for r in rows:
        print(f"{r['recipe']:14} {r['workspace']:8} {r.get('status'):10} {r['s']:7.1f} s  "
              f"{r.get('losses') or r.get('error')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time the evaluation of a 125m checkpoint on every shipped task (the bar: under 10 minutes on one H100).

Builds a random-init `125m` Llama (hidden 768, ffn 3072, 12 layers, 12 heads / 4 KV heads,
vocab 32000; `training.model.PRESETS`) with the project's byte-level BPE tokenizer, saves it
in HF format, and runs `training.evaluation.evaluate_checkpoint` on all shipped tasks with no
limit. Random weights give chance-level accuracies; the timing is what this measures
(the work per document does not depend on the weights).

Run (GPU machine, from the repo root, data carried in .devcarry/data):

    PLAB_DATA_DIR=$PWD/.devcarry/data python bench/eval_bench.py

Options: --checkpoint DIR (bench an existing checkpoint instead), --tasks a,b, --limit N,
--batch-size N, --device, --dtype, --corpus NAME (tokenizer training text under PLAB_DATA_DIR).
Prints the time per task and the total; writes JSON (metrics, times, no per-sample scores)
to $OUT/eval_bench.json when $OUT is set and to bench/results/eval_bench_<device>_<time>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchmeta import git_commit, write_result  # noqa: E402

BUDGET_S = 600  # the bar: all shipped tasks in under 10 minutes on one H100


def build_checkpoint(dest: Path, corpus: str, vocab_size: int, seq_len: int, preset: str = "125m") -> dict:
    from training.model import build_model, llama_config
    from training.tokenizer import get_tokenizer

    data_dir = Path(os.environ["PLAB_DATA_DIR"])
    t0 = time.perf_counter()
    tokenizer = get_tokenizer(data_dir / corpus, vocab_size, cache_dir=dest.parent / "cache")
    t_tok = time.perf_counter() - t0
    config = llama_config(preset, vocab_size=vocab_size, seq_len=seq_len)
    model = build_model(config, seed=0)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    n_params = sum(p.numel() for p in model.parameters())
    return {"tokenizer_train_s": t_tok, "n_params": n_params, "tokenizer_vocab": len(tokenizer), "corpus": corpus}


def main(argv=None) -> int:
    from training.evaluation import SHIPPED_TASKS, evaluate_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=None, help="existing HF checkpoint dir (default: build a random 125m)")
    parser.add_argument("--tasks", default=",".join(SHIPPED_TASKS))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", default="64", help="int or 'auto'")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--corpus", default="tinyshakespeare", help="tokenizer training corpus under PLAB_DATA_DIR")
    parser.add_argument("--seq-len", type=int, default=2048, help="model context (max_position_embeddings)")
    args = parser.parse_args(argv)
    if not os.environ.get("PLAB_DATA_DIR"):
        parser.error("set PLAB_DATA_DIR to the data directory (e.g. $PWD/.devcarry/data)")
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)

    import torch

    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="plab-eval-bench-") as tmp:
        build_info = {}
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = Path(tmp) / "ckpt-125m"
            t0 = time.perf_counter()
            build_info = build_checkpoint(checkpoint, args.corpus, 32000, args.seq_len)
            build_info["build_s"] = time.perf_counter() - t0
            print(f"built random 125m checkpoint in {build_info['build_s']:.1f} s: {build_info}", flush=True)

        def progress(name, task):
            print(f"[done] {name:<24} {task['time_s']:8.1f} s  n={task['n_samples']}", flush=True)

        result = evaluate_checkpoint(
            checkpoint, args.tasks, limit=args.limit, device=args.device, batch_size=batch_size,
            dtype=args.dtype, on_task_done=progress,
        )

    per_task = {name: result["tasks"][name]["time_s"] for name in result["requested"]}
    print(f"\ndevice: {device_name}  dtype={result['dtype']}  batch_size={result['batch_size']}  limit={result['limit']}")
    print(f"{'task':<24} {'time_s':>8} {'n':>7}  metrics")
    for name in result["requested"]:
        task = result["tasks"][name]
        metrics = ", ".join(f"{m}={v['value']:.4g}" for m, v in task["metrics"].items() if v["value"] is not None)
        print(f"{name:<24} {task['time_s']:8.1f} {task['n_samples']:>7}  {metrics}")
    total = result["total_time_s"]
    verdict = "within" if total < BUDGET_S else "OVER"
    print(f"{'model load':<24} {result['load_time_s']:8.1f}")
    print(f"{'total':<24} {total:8.1f}  ({verdict} the {BUDGET_S} s budget)")

    summary = {
        "bench": "eval_bench",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "device": device_name,
        "git_commit": git_commit(),
        "build": build_info,
        "checkpoint": str(args.checkpoint) if args.checkpoint else "random-init 125m",
        "per_task_time_s": per_task,
        "total_time_s": total,
        "within_budget": total < BUDGET_S,
        "result": {**result, "tasks": {n: {k: v for k, v in t.items() if k != "samples"} for n, t in result["tasks"].items()}},
    }
    write_result(summary, "eval_bench", device_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

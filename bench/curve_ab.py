"""Does a configuration change a recipe's loss curve by more than two runs of the same code differ? One call
trains config A `--repeats` times and config B `--b-repeats` times (default once), from the same spec (seed, data
order, initialisation) on a real corpus, each in a fresh subprocess, and compares B's curve with A's.

Why: on a GPU two runs of the same code differ (cuDNN's attention backward is not deterministic), and FP8 training
carries a last-bit difference on (bench/NOTES_floor.md 54, 55, 60). A change that alters last bits (another GEMM
algorithm, such as `cublaslt_workspace: none`; another reduction order) cannot keep the curve bit for bit, so
"the loss curve unchanged" is a statement about that spread: window by window, B's distance from the mean of A's
repeats against the largest distance between two of A's repeats. With two A runs and one B run that check says
"outside" in nearly half the windows when nothing changed (two window means of the same distribution); with several runs
of each a permutation test is the sharper question: could B's runs be A's? (p over every labelling of the pooled
runs; 4 + 2 runs give 15 labellings, so p >= 0.067.)

    python bench/curve_ab.py --a fp8_delayed --b fp8_delayed:cublaslt_workspace=none --steps 300
        [--model 1b --batch 4 --seq 2048 --corpus tinyshakespeare --vocab 32000 --repeats 2 --b-repeats 1
         --window 25]

Configs are train_bench's (`recipe[:key=value,...]`). Prints a table last, writes `$OUT/curve_ab.json` and
bench/results/curve_ab_<device>_<time>.json (device, date, commit, spec, every run's losses). `--device cpu` runs
the same comparison on a CPU (deterministic there: A's repeats agree to the bit, so any B difference shows).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from itertools import combinations
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchmeta import git_commit, write_result  # noqa: E402
from bench.train_bench import model_value, parse_config  # noqa: E402


def curve_spec(config: dict, a) -> dict:
    """The run spec of one config: a real corpus with a validation split, validation at the last step only."""
    training = {"steps": a.steps, "batch_size": a.batch, "lr": a.lr, "warmup_steps": max(1, a.steps // 20),
                "val_every": a.steps, "val_batches": a.val_batches, "checkpoint_every": 0,
                "compile": a.device == "cuda", "device": a.device, "perf": dict(config["perf"])}
    training.update(config["training"])
    return {"model": model_value(a.model), "seed": a.seed, "recipe": config["recipe"],
            "recipe_options": dict(config.get("recipe_options", {})),
            "data": {"corpus": a.corpus, "vocab_size": a.vocab, "seq_len": a.seq, "val_fraction": 0.02},
            "training": training}


def run_one(spec_path: Path, out_path: Path, cache_dir: Path) -> None:
    """Worker: train the spec and write {"losses": [[step, loss], ...], "val_loss", "wall_s"}."""
    from training.sink import ListSink
    from training.train import train

    spec = json.loads(spec_path.read_text())
    sink = ListSink()
    t0 = time.time()
    result = train(spec, sink, cache_dir=cache_dir)
    val = sink.series("val/loss")
    out_path.write_text(json.dumps({"status": result.status, "losses": sink.series("train/loss"),
                                    "val_loss": val[-1][1] if val else None, "wall_s": time.time() - t0}))


def windows(losses: list[float], size: int) -> list[float]:
    """Mean loss of each whole window of `size` steps (a last partial window is dropped)."""
    return [sum(losses[i:i + size]) / size for i in range(0, len(losses) - size + 1, size)]


def _split_statistic(curves: list[list[float]], b_idx: tuple[int, ...]) -> float:
    """Mean over windows of |mean of the runs in b_idx - mean of the others| (curves: window means per run)."""
    b = [curves[i] for i in b_idx]
    a = [c for i, c in enumerate(curves) if i not in b_idx]
    return sum(abs(sum(col_b) / len(col_b) - sum(col_a) / len(col_a))
               for col_a, col_b in zip(zip(*a), zip(*b))) / len(curves[0])


def permutation_test(a_windows: list[list[float]], b_windows: list[list[float]]) -> dict:
    """Are B's runs exchangeable with A's? Every way of labelling len(B) of the pooled runs "B" gives the statistic
    (mean distance between the two groups' window means); p is the share of labellings at least as far apart as
    the real one (ties counted, the real one included). With 2 A runs and 1 B run there are 3 labellings (p >= 1/3:
    never conclusive); 4 and 2 give 15 (p >= 0.067)."""
    pooled = a_windows + b_windows
    real = tuple(range(len(a_windows), len(pooled)))
    observed = _split_statistic(pooled, real)
    splits = [_split_statistic(pooled, idx) for idx in combinations(range(len(pooled)), len(b_windows))]
    at_least = sum(x >= observed * (1 - 1e-12) for x in splits)
    return {"statistic": observed, "labellings": len(splits), "p_value": at_least / len(splits),
            "smallest_possible_p": 1 / len(splits)}


def compare(a_runs: list[list[float]], b_runs, window: int, floor: float = 0.0) -> dict:
    """B's curve(s) against A's repeats (each a list of per-step losses; `b_runs` one such list or several): per
    window the spread between A's repeats (largest pairwise distance of their window means) and the distance of
    B's mean from A's mean; the verdict "within" when B's largest distance is at most A's largest spread (or
    `floor`, for deterministic devices). With at least two runs in all, also a permutation test of whether B's
    runs could be A's (`permutation_test`)."""
    if b_runs and not isinstance(b_runs[0], (list, tuple)):
        b_runs = [b_runs]
    n = min(*(len(r) for r in b_runs), *(len(r) for r in a_runs))
    if n < window:
        raise ValueError(f"{n} steps: fewer than one window of {window}")
    aw = [windows(r[:n], window) for r in a_runs]
    bws = [windows(r[:n], window) for r in b_runs]
    bw = [sum(col) / len(col) for col in zip(*bws)]
    mean = [sum(col) / len(col) for col in zip(*aw)]
    spread = [max((abs(x[i] - y[i]) for x, y in combinations(aw, 2)), default=0.0) for i in range(len(mean))]
    dist = [abs(bw[i] - mean[i]) for i in range(len(mean))]

    def first_difference(x, y):
        return next((step + 1 for step, (p, q) in enumerate(zip(x[:n], y[:n])) if p != q), None)

    bound = max(max(spread), floor)
    return {"window": window, "steps_compared": n, "a_window_means": aw, "a_mean": mean, "b_window_means": bw,
            "b_runs_window_means": bws,
            "a_spread": spread, "b_distance": dist, "a_spread_max": max(spread), "b_distance_max": max(dist),
            "windows_b_outside": sum(d > bound for d in dist), "bound": bound,
            "first_step_a_repeats_differ": (min(filter(None, (first_difference(x, y)
                                                               for x, y in combinations(a_runs, 2))), default=None)),
            "first_step_b_differs_from_a1": first_difference(a_runs[0], b_runs[0]),
            "permutation": permutation_test(aw, bws) if len(aw) + len(bws) > 2 else None,
            "verdict": "within" if max(dist) <= bound else "outside"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="the baseline config, e.g. fp8_delayed")
    ap.add_argument("--b", required=True, help="the config under test, e.g. fp8_delayed:cublaslt_workspace=none")
    ap.add_argument("--repeats", type=int, default=2, help="runs of A (their spread is the yardstick; >= 2 on a GPU)")
    ap.add_argument("--b-repeats", type=int, default=1,
                    help="runs of B (with 4 of A and 2 of B the permutation test can reach p = 0.067)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=25, help="steps per compared window")
    ap.add_argument("--floor", type=float, default=0.0,
                    help="smallest distance counted as outside, for devices where A's repeats agree to the bit")
    ap.add_argument("--model", default="1b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--corpus", default="tinyshakespeare", help="a corpus name under PLAB_DATA_DIR, or a path")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--timeout-s", type=float, default=900, help="per run")
    ap.add_argument("--run-one", nargs=3, metavar=("SPEC", "OUT", "CACHE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.run_one:
        run_one(*(Path(p) for p in a.run_one))
        return 0
    for name in ("repeats", "b_repeats", "steps", "window", "batch", "seq", "vocab", "val_batches"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.window > a.steps:
        ap.error(f"--window {a.window} is longer than --steps {a.steps}")
    device = "cpu"
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            ap.error("no CUDA GPU: give --device cpu to run the comparison on this CPU")
        device = torch.cuda.get_device_name()
    from training.precision import RECIPES

    configs = {"a": parse_config(a.a), "b": parse_config(a.b)}
    for which, config in configs.items():
        if config["recipe"] not in RECIPES:
            ap.error(f"--{which} {config['label']!r}: unknown recipe {config['recipe']!r}; one of {list(RECIPES)}")
    specs = {which: curve_spec(config, a) for which, config in configs.items()}
    plan = [("a", i) for i in range(a.repeats)] + [("b", i) for i in range(a.b_repeats)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="curve_ab_") as tmp:
        tmp = Path(tmp)
        for which, i in plan:  # A's repeats first, B last: a warm cache (tokenizer, shards) helps every run alike
            spec_path, out_path = tmp / f"{which}{i}.spec.json", tmp / f"{which}{i}.out.json"
            spec_path.write_text(json.dumps(specs[which]))
            t0 = time.time()
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--a", a.a, "--b", a.b,
                                   "--run-one", str(spec_path), str(out_path), str(tmp / "cache")],
                                  capture_output=True, text=True, timeout=a.timeout_s, cwd=REPO,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if proc.returncode != 0 or not out_path.exists():
                print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
                print(f"curve_ab: run {which}{i} ({configs[which]['label']}) failed, rc {proc.returncode}",
                      file=sys.stderr)
                return 1
            res = json.loads(out_path.read_text())
            res.update(config=configs[which]["label"], run=f"{which}{i}", process_wall_s=time.time() - t0)
            runs.append(res)
            if res["status"] != "succeeded" or len(res["losses"]) < a.window:
                print(f"curve_ab: run {which}{i} ({configs[which]['label']}) ended {res['status']} after "
                      f"{len(res['losses'])} logged steps: no curve to compare", file=sys.stderr)
                return 1
            print(f"[curve_ab] {res['run']} {res['config']}: {res['status']}, final loss "
                  f"{res['losses'][-1][1]:.5f}, val {res['val_loss']}, {res['wall_s']:.0f} s", flush=True)
    a_losses = [[v for _, v in r["losses"]] for r in runs[:a.repeats]]
    b_losses = [[v for _, v in r["losses"]] for r in runs[a.repeats:]]
    result = compare(a_losses, b_losses, a.window, a.floor)
    out = {"bench": "curve_ab", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": device, "git_commit": git_commit(), "a": a.a, "b": a.b, "repeats": a.repeats,
           "b_repeats": a.b_repeats,
           "spec_a": specs["a"], "spec_b": specs["b"], "comparison": result,
           "runs": runs}
    write_result(out, "curve_ab", device)
    print(f"\n# curve_ab on {device}: {a.b_repeats} run(s) of {a.b} against {a.repeats} of {a.a}, "
          f"{result['steps_compared']} steps, windows of {a.window}")
    print(f"{'window':>7s} {'A mean':>9s} {'A spread':>9s} {'B':>9s} {'|B - A|':>9s}")
    for i, (a_mean, spread, bw, dist) in enumerate(zip(result["a_mean"], result["a_spread"],
                                                        result["b_window_means"], result["b_distance"])):
        print(f"{i + 1:7d} {a_mean:9.5f} {spread:9.2e} {bw:9.5f} {dist:9.2e}"
              f"{'  outside' if dist > result['bound'] else ''}")
    vals = ", ".join(f"{r['run']} {r['val_loss']}" for r in runs)
    print(f"final validation loss: {vals}")
    print(f"first step where A's repeats differ: {result['first_step_a_repeats_differ']}; where B differs from "
          f"A's first run: {result['first_step_b_differs_from_a1']}")
    perm = result["permutation"]
    if perm:
        print(f"permutation test (are B's runs exchangeable with A's?): p = {perm['p_value']:.3f} over "
              f"{perm['labellings']} labellings (smallest possible {perm['smallest_possible_p']:.3f})")
    print(f"verdict: B is {result['verdict']} A's run-to-run spread (largest |B - A| {result['b_distance_max']:.2e}, "
          f"largest A spread {result['a_spread_max']:.2e}, floor {a.floor:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

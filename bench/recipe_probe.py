"""Quick probe of every precision recipe's training step on a 2-layer slice of the 1b model.

For each recipe: a 2-layer Llama with the `1b` preset's dims (hidden 2048, intermediate 8192, 16 heads, 8 KV
heads, vocab 32000), converted with `training.precision.apply_recipe`, parameters cast to BF16 after the
conversion (as the trainer does: FP32 masters would live in the optimizer; no autocast), model + fused loss
compiled with torch.compile, then forward + backward (+ the recipe's post-step hooks, e.g. fp8_delayed's
amax history) timed with CUDA events: 3 warm-up steps (the first compiles), 10 timed steps, batch 4 x 2048.
Recipes run in order of importance (bf16, then those with a speed bar); one not started within `--budget-s`
(150 s on a GPU) is skipped, so the whole probe stays under about 3 minutes.
No optimizer step: it costs the same under every recipe. Dynamo's graph-break counter is read per recipe,
and for fp8_delayed that the compiled backward recorded dY's amax into every layer's history.

The table: median ms per step, tokens/s ratio against bf16 measured here, and `est@1b`, the ratio this
delta implies for the 16-layer 1.14B model: est = T / (T + 16 * (ms - ms_bf16) / 2), T = `--bf16-step-ms`
(the full 1.14B BF16 step measured by bench/train_bench.py on the same kind of GPU; 130 ms on the H100). The
embeddings, LM head and loss stay BF16 under every recipe, so the per-layer difference carries over; the
estimate ignores the optimizer, which is the same for all recipes. Every row says whether its GEMMs were
real low-precision kernels or emulated.

    python bench/recipe_probe.py                                  # GPU, all recipes (< 3 min on an H100)
    python bench/recipe_probe.py --recipes bf16 nvfp4 mxfp8       # a subset
    python bench/recipe_probe.py --param-dtype fp32               # the old path: FP32 params under BF16 autocast
    python bench/recipe_probe.py --device cpu --tiny              # CPU smoke test with tiny dims

Writes `$OUT/recipe_probe.json` when $OUT is set (and `--json PATH` if given), after every recipe, so a run
cut short still leaves what it measured. Exit status 1 if a recipe failed or broke the graph.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training.precision.catalog import recipe_names  # noqa: E402

RECIPE_ORDER = list(recipe_names())
# Run order: the recipes with a speed bar first, so a budget cut drops the ones reported without a bar.
BARRED_FIRST = ["bf16", "fp8_delayed", "mxfp8", "nvfp4"]
RUN_ORDER = BARRED_FIRST + [r for r in RECIPE_ORDER if r not in BARRED_FIRST]
DIMS_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=8,
               vocab_size=32000)
DIMS_TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=256)
LAYERS_1B = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=RECIPE_ORDER,
                   help="recipes to probe (bf16 is always run first); recipe options as `nvfp4:rht=false,weight_2d=false`")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny dims, batch 2 x 64 (CPU smoke test)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; 2 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; 64 with --tiny)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--param-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 on cuda (no autocast), fp32 on cpu; fp32 on cuda runs under BF16 autocast")
    p.add_argument("--fuse-qkv", choices=["auto", "on", "off"], default="auto",
                   help="fuse q/k/v into one linear as the trainer does on GPU (auto: on for cuda when available)")
    p.add_argument("--fuse-gate-up", action="store_true",
                   help="one linear for the MLP's gate and up projections (training.model.fuse_gate_up)")
    p.add_argument("--no-compile", action="store_true", help="eager (only for quick CPU checks)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default: inductor's default)")
    p.add_argument("--bf16-step-ms", type=float, default=130.0,
                   help="full 1.14B BF16 step time on this GPU kind, for the est@1b column")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip recipes not started within this many seconds (default 150 on cuda, none on cpu)")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile 3 steps per recipe and keep the top kernels (GPU ms per step)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = [r for r in args.recipes if r.partition(":")[0] not in RECIPE_ORDER]
    if unknown:
        p.error(f"unknown recipe(s) {', '.join(unknown)}; choose from {', '.join(RECIPE_ORDER)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU; use --device cpu --tiny for a CPU smoke test")
    for name in ("layers", "steps", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be {'>= 0' if name == 'warmup' else 'positive'}")
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (64 if args.tiny else 2048)
    if args.batch < 1 or args.seq < 2:
        p.error("--batch must be >= 1 and --seq >= 2")
    wanted = list(dict.fromkeys(["bf16", *args.recipes]))
    # Run order: by RUN_ORDER of the base recipe, variants (`nvfp4:rht=false`) right after their recipe.
    args.recipes = sorted(wanted, key=lambda r: (RUN_ORDER.index(r.partition(":")[0]), wanted.index(r)))
    if args.budget_s is None:
        args.budget_s = 150.0 if args.device == "cuda" else float("inf")
    return args


class Timer:
    """CUDA events on GPU, perf_counter on CPU; milliseconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3

    def elapsed(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return self.ms


def build_base(args):
    from training.model import build_model, llama_config

    dims = dict(DIMS_TINY if args.tiny else DIMS_1B, num_hidden_layers=args.layers)
    config = llama_config(dims, dims["vocab_size"], args.seq)
    return build_model(config, args.seed), dims


def probe_recipe(recipe: str, base, dims: dict, args, device: torch.device) -> dict:
    from torch._dynamo.utils import counters

    from training import model as model_mod
    from training.precision import apply_recipe

    on_cuda = device.type == "cuda"
    param_dtype = args.param_dtype if args.param_dtype != "auto" else ("bf16" if on_cuda else "fp32")
    bf16_params = param_dtype == "bf16"
    model = copy.deepcopy(base).to(device)
    fused = False
    fuse = getattr(model_mod, "fuse_qkv", None)
    if fuse is not None and (args.fuse_qkv == "on" or (args.fuse_qkv == "auto" and on_cuda)):
        fused = fuse(model) > 0
    elif args.fuse_qkv == "on":
        raise SystemExit("--fuse-qkv on: this checkout's training.model has no fuse_qkv")
    if args.fuse_gate_up:
        model_mod.fuse_gate_up(model)
    name, options = parse_recipe(recipe)
    report = apply_recipe(model, name, **options)
    if bf16_params:
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)  # parameters only: recipe state stays FP32 (as train.py)
    model.train()
    loss_module = model_mod.CausalLMLoss(model, fused_loss=True, chunk_tokens=2048,
                                         compute_dtype=torch.bfloat16 if on_cuda else None)
    net = loss_module if args.no_compile else torch.compile(loss_module, mode=args.compile_mode)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if on_cuda and not bf16_params
                else contextlib.nullcontext())
    hooks = [h for h in report.hooks if hasattr(h, "post_optimizer_step")]
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, dims["vocab_size"], (args.batch, args.seq + 1), generator=g).to(device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        with autocast:
            loss = net(inputs, targets)
        loss.backward()
        for hook in hooks:
            hook.post_optimizer_step(model)
        return loss

    torch._dynamo.reset()
    counters.clear()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    first_loss = float(step().detach())  # compiles
    compile_s = time.perf_counter() - t0
    for _ in range(max(args.warmup - 1, 0)):
        step()
    times = []
    for _ in range(args.steps):
        with Timer(device) as timer:
            loss = step()
        times.append(timer)
    ms = [t.elapsed() for t in times]
    last_loss = float(loss.detach())
    kernels = None
    if args.profile and on_cuda:
        from bench.step_profile import summarize
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        t_prof = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        kernels = summarize(prof, 3)
        kernels["profiled_wall_ms_per_step"] = (time.perf_counter() - t_prof) * 1e3 / 3
        # Host side: the ops whose own CPU time per step is largest (a step slower than its GPU time is
        # launch-bound; these say by what).
        cpu = sorted(((e.self_cpu_time_total / 1e3 / 3, e.count // 3, e.key[:90]) for e in prof.key_averages()
                      if e.self_cpu_time_total > 0), reverse=True)
        kernels["cpu_top"] = cpu[:15]
        kernels["cpu_ms_per_step"] = sum(c[0] for c in cpu)
    breaks = {str(k): int(v) for k, v in counters["graph_break"].items()}
    # fp8_delayed: the compiled backward must have recorded dY's amax (custom op with a declared mutation)
    # and the hook must have pushed it into every layer's history.
    from training.precision.fp8_delayed import GRAD, DelayedScalingLinear
    delayed = [m for m in model.modules() if isinstance(m, DelayedScalingLinear)]
    grad_amax_recorded = (all(bool(m.amax_history[GRAD].amax() > 0) for m in delayed) if delayed else None)
    result = {
        "recipe": recipe,
        "gemm_backend": report.gemm_backend,
        "converted_layers": sum(1 for layer in report.layers if layer["converted"]),
        "total_layers": len(report.layers),
        "notes": list(report.notes),
        "param_dtype": param_dtype,
        "autocast": bool(on_cuda and not bf16_params),
        "fused_qkv": fused,
        "fused_gate_up": bool(args.fuse_gate_up),
        "compiled": not args.no_compile,
        "compile_and_first_step_s": round(compile_s, 2),
        "ms_median": statistics.median(ms),
        "ms_mean": statistics.fmean(ms),
        "ms_min": min(ms),
        "ms_all": [round(v, 3) for v in ms],
        "graph_breaks": sum(breaks.values()),
        "delayed_grad_amax_recorded": grad_amax_recorded,
        "graph_break_reasons": breaks,
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "first_loss": first_loss,
        "last_loss": last_loss,
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30) if on_cuda else None,
        "kernels": kernels,
    }
    del net, loss_module, model
    return result


def parse_recipe(text: str) -> tuple[str, dict]:
    """'nvfp4:rht=false,rht_seed=3' -> ('nvfp4', {'rht': False, 'rht_seed': 3})."""
    name, _, opts = text.partition(":")
    options = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"recipe {text!r}: expected key=value, got {item!r}")
        low = value.lower()
        options[key] = (low == "true") if low in ("true", "false") else int(value) if value.isdigit() else value
    return name, options


def add_ratios(results: list[dict], args) -> None:
    base = next((r for r in results if r["recipe"] == "bf16" and "ms_median" in r), None)
    if base is None:
        return
    for r in results:
        if "ms_median" not in r:
            continue
        r["ratio_vs_bf16"] = base["ms_median"] / r["ms_median"]
        if args.device != "cuda":
            continue  # the estimate scales from a GPU's 1.14B BF16 step
        delta_per_layer = (r["ms_median"] - base["ms_median"]) / args.layers
        r["est_ratio_1b"] = args.bf16_step_ms / (args.bf16_step_ms + LAYERS_1B * delta_per_layer)


def table(results: list[dict], args) -> str:
    head = (f"{'recipe':<35}{'gemms':<10}{'conv':>7}{'compile s':>11}{'ms/step':>10}{'x bf16':>8}"
            f"{'est@1b':>8}{'breaks':>8}{'graphs':>7}{'peak GiB':>10}")
    lines = [head, "-" * len(head)]
    for r in sorted(results, key=lambda r: RECIPE_ORDER.index(r["recipe"].partition(":")[0])):
        if "error" in r:
            lines.append(f"{r['recipe']:<15}FAILED: {r['error'][:150]}")
            continue
        if "skipped" in r:
            lines.append(f"{r['recipe']:<15}skipped: {r['skipped']}")
            continue
        conv = f"{r['converted_layers']}/{r['total_layers']}"
        peak = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        ratio = f"{r['ratio_vs_bf16']:.3f}" if "ratio_vs_bf16" in r else "-"
        est = f"{r['est_ratio_1b']:.3f}" if "est_ratio_1b" in r else "-"
        lines.append(f"{r['recipe'][:34]:<35}{r['gemm_backend']:<10}{conv:>7}{r['compile_and_first_step_s']:>11.1f}"
                     f"{r['ms_median']:>10.2f}{ratio:>8}{est:>8}{r['graph_breaks']:>8}{r['unique_graphs']:>7}"
                     f"{peak:>10}")
    lines.append(f"est@1b: ratio implied for the 16-layer 1.14B model with a {args.bf16_step_ms:g} ms BF16 step "
                 f"(--bf16-step-ms); x bf16: measured on this {args.layers}-layer slice.")
    return "\n".join(lines)


def write_json(payload: dict, args) -> None:
    targets = []
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / "recipe_probe.json")
    if args.json is not None:
        targets.append(args.json)
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    t_start = time.perf_counter()
    base, dims = build_base(args)
    payload = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": dict(dims, num_hidden_layers=args.layers),
        "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "steps": args.steps,
        "bf16_step_ms_1b": args.bf16_step_ms, "compile_mode": args.compile_mode, "results": [],
    }
    try:
        import torchao
        payload["torchao"] = torchao.__version__
    except Exception as exc:  # the probe still runs the emulated and bf16 recipes without torchao
        payload["torchao"] = f"unavailable: {exc}"
    results = payload["results"]
    for recipe in args.recipes:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            results.append({"recipe": recipe, "skipped": f"budget of {args.budget_s:g} s spent ({elapsed:.0f} s)"})
            continue
        print(f"[probe] {recipe} ...", flush=True)
        try:
            results.append(probe_recipe(recipe, base, dims, args, device))
        except Exception as exc:  # one broken recipe must not hide the others
            import traceback
            results.append({"recipe": recipe, "error": f"{type(exc).__name__}: {exc}",
                            "trace": traceback.format_exc()[-3000:]})
        finally:
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        add_ratios(results, args)
        payload["wall_s"] = round(time.perf_counter() - t_start, 1)
        write_json(payload, args)
        last = results[-1]
        if "ms_median" in last:
            print(f"[probe] {recipe}: {last['ms_median']:.2f} ms/step ({last['gemm_backend']}), "
                  f"compile+first step {last['compile_and_first_step_s']:.1f} s, graph breaks {last['graph_breaks']}",
                  flush=True)
        else:
            print(f"[probe] {recipe}: {last.get('error') or last.get('skipped')}", flush=True)
    if args.profile:
        for r in results:
            if r.get("kernels"):
                print(f"\n## {r['recipe']}: {r['kernels']['total_ms']:.2f} GPU ms/step; by category "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["kernels"]["ms_per_step"].items())))
                for ms_, kname, cat in r["kernels"]["top"][:12]:
                    print(f"{ms_:8.3f}  {cat:18s} {kname[:100]}")
                print(f"   host: {r['kernels']['cpu_ms_per_step']:.2f} CPU ms/step (profiled wall "
                      f"{r['kernels']['profiled_wall_ms_per_step']:.2f} ms); top ops by own CPU time (ms/step, calls/step):")
                for ms_, calls, kname in r["kernels"]["cpu_top"][:10]:
                    print(f"{ms_:8.3f} {calls:6d}  {kname}")
    print(table(results, args))
    print(f"[probe] wall {payload['wall_s']} s")
    bad = [r["recipe"] for r in results
           if "error" in r or r.get("graph_breaks") or r.get("delayed_grad_amax_recorded") is False]
    for r in results:
        if r.get("delayed_grad_amax_recorded") is False:
            print(f"[probe] {r['recipe']}: the compiled backward did not record dY's amax into the history")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

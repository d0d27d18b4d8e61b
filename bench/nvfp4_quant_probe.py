"""The fused NVFP4 quantizers (training/precision/nvfp4_triton.py) on a GPU, module against module and tile against
tile, on the 1b model's operand shapes, with the host out of the measurement.

bench/nvfp4_kernel_bench.py times Python calls of `dual_quantize_launch` back to back, so at 8192 x 2048 (~0.08 ms
of GPU work for three launches and three allocations) the host's launch time is part of what it reads. Here each
variant's 20 calls are captured in one CUDA graph and the graph is replayed between CUDA events (bench.kernel_bench.
graph_timed, the median of 5 replays): GPU time only (the amax pass, its reduction and the quantize pass, as in the
training step). Every variant is first checked against the first module's default configuration on the same operand
and seed: (a, b, pts) to the bit, both roundings (a change of tile or of arithmetic that keeps the bits keeps the
stochastic rounding's draws too).

    python bench/nvfp4_quant_probe.py --modules old=/tmp/old_nvfp4_triton.py [--configs 128:1:4 128:2:4 ...]
                                      [--amax-tiles 256:4 512:8 ...]

(`this` is always the working tree's module; configs are block_n:groups:num_warps of the quantize pass;
`--amax-tiles` adds rows of `this` module at its own quantize configuration with the amax pass's tile features:token
groups changed: the amax is the same whatever the tile, so the bits are too.) Prints a table last; writes
bench/results/nvfp4_quant_probe_<device>_<time>.json (and $OUT/nvfp4_quant_probe.json).
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ((8192, 2048), (8192, 4096), (8192, 8192))  # tokens x features of X and dY in the 1b model
# per step on the 1b shape (bench/NOTES_floor.md 42-44): launches of each shape and rounding
LAUNCHES = {((8192, 2048), False): 48, ((8192, 2048), True): 32, ((8192, 4096), True): 16,
            ((8192, 8192), False): 16, ((8192, 8192), True): 32}
CONFIGS = ((128, 1, 4), (128, 2, 4), (128, 4, 4), (128, 2, 8), (64, 2, 4), (256, 2, 8))


def _powers_of_two(text: str, fields: str, example: str) -> tuple:
    """`text` as len(fields.split(":")) powers of two, the first >= 16 (a block of features), or a usage error."""
    try:
        values = tuple(int(v) for v in text.split(":"))
    except ValueError:
        values = ()
    if len(values) != len(fields.split(":")) or any(v <= 0 or v & (v - 1) for v in values) or values[0] < 16:
        raise argparse.ArgumentTypeError(f"{text!r}: want {fields}, powers of two, BLOCK_N >= 16 (e.g. {example})")
    return values


def config_arg(text: str) -> tuple:
    """BLOCK_N:GROUPS:WARPS -> (block_n, groups, num_warps) of the quantize pass."""
    return _powers_of_two(text, "BLOCK_N:GROUPS:WARPS", "128:2:4")


def amax_tile_arg(text: str) -> tuple:
    """BLOCK_N:GROUPS -> (amax_block_n, amax_groups) of the amax pass."""
    return _powers_of_two(text, "BLOCK_N:GROUPS", "256:4")


def module_arg(text: str) -> tuple:
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: want NAME=PATH to a copy of nvfp4_triton.py (e.g. "
                                         "old=/tmp/old.py from `git show REF:training/precision/nvfp4_triton.py`)")
    return name, path


def load_module(name: str, path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"nvfp4_triton_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modules", nargs="*", type=module_arg, default=[],
                    help="NAME=PATH: other versions of nvfp4_triton.py, timed beside the working tree's (`this`)")
    ap.add_argument("--configs", nargs="+", type=config_arg, default=list(CONFIGS),
                    help="launch configurations BLOCK_N:GROUPS:WARPS (default: %(default)s)")
    ap.add_argument("--amax-tiles", nargs="*", type=amax_tile_arg, default=[],
                    help="amax-pass tiles BLOCK_N:GROUPS, each timed with this module's quantize configuration")
    a = ap.parse_args(argv)

    import json

    import torch

    from bench.benchmeta import git_commit, write_result
    from bench.kernel_bench import graph_timed
    from training.precision import nvfp4_triton as this
    from training.precision.formats import random_sign_vector, rht_matrix

    dev = torch.device("cuda")
    mods = [(name, load_module(name, path)) for name, path in a.modules] + [("this", this)]
    h = this.rht_operand(rht_matrix(random_sign_vector(0)).to(dev), dev)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for shape in SHAPES:
        x = (torch.randn(shape, device=dev, generator=g)
             / torch.rand(shape, device=dev, generator=g).clamp_min(0.02).sqrt()).bfloat16()
        for sr in (False, True):
            seed = torch.randint(0, 2 ** 31 - 1, (1,), device=dev)
            base_mod = mods[0][1]
            ref = base_mod.dual_quantize_launch(x, h, seed, True, sr, **base_mod.launch_config(shape[1], sr))
            variants = [(name, mod, dict(block_n=bn, groups=groups, num_warps=warps), f"{bn}:{groups}:{warps}")
                        for name, mod in mods for bn, groups, warps in a.configs]
            variants += [("this", this, dict(this.launch_config(shape[1], sr), amax_block_n=abn, amax_groups=ag),
                          f"amax{abn}:{ag}") for abn, ag in a.amax_tiles]
            for name, mod, cfg, label in variants:
                out = mod.dual_quantize_launch(x, h, seed, True, sr, **cfg)
                same = all(torch.equal(p.view(torch.int32) if p.dtype == torch.float32 else p.view(torch.int16),
                                       q.view(torch.int32) if q.dtype == torch.float32 else q.view(torch.int16))
                           for p, q in zip(out, ref))
                ms = graph_timed(lambda: mod.dual_quantize_launch(x, h, seed, True, sr, **cfg), reps=5)
                row = {"shape": list(shape), "stochastic": sr, "module": name, "variant": label, **cfg, "ms": ms,
                       "same_bits": same, "gbps": x.numel() * 2 * 4 / ms / 1e6}  # x read twice, a and b written
                rows.append(row)
                print(json.dumps(row), flush=True)
    # per module and config: GPU ms per 1b step over the step's launches of each shape and rounding
    per_step = {}
    for row in rows:
        key = f"{row['module']} {row['variant']}"
        per_step[key] = per_step.get(key, 0.0) + row["ms"] * LAUNCHES.get((tuple(row["shape"]), row["stochastic"]), 0)
    payload = {"bench": "nvfp4_quant_probe", "device": torch.cuda.get_device_name(dev),
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
               "modules": dict(a.modules), "rows": rows, "ms_per_1b_step": per_step,
               "all_same_bits": all(r["same_bits"] for r in rows)}
    write_result(payload, "nvfp4_quant_probe", torch.cuda.get_device_name(dev))
    print(f"\nall variants bit-equal to {mods[0][0]}'s default: {payload['all_same_bits']}")
    cols = [(shape, sr) for shape in SHAPES for sr in (False, True) if (shape, sr) in LAUNCHES]
    print(f"{'module config':>22} " + " ".join(f"{f'{s[0]}x{s[1]} ' + ('sr' if sr else 'rne'):>15}" for s, sr in cols)
          + f" {'ms per 1b step':>15}")
    for key, step_ms in per_step.items():
        cells = []
        for shape, sr in cols:
            r = next(r for r in rows if f"{r['module']} {r['variant']}" == key and tuple(r["shape"]) == shape
                     and r["stochastic"] == sr)
            cells.append(f"{r['ms']:10.4f}{'' if r['same_bits'] else ' DIFF':>5}")
        print(f"{key:>22} " + " ".join(cells) + f" {step_ms:15.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

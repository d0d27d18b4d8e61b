"""NVFP4 stochastic rounding, two kernel layouts side by side on a GPU: this tree's nvfp4_triton.py against another
version of it (`--compare-module`, e.g. the eighths layout: `git show a9b7555:training/precision/nvfp4_triton.py >
/tmp/eighths.py`), SR timed at four launch configurations on the 1b operand shapes (the whole launch, amax pass
included), round-to-nearest checked bit-identical between the two, and SR's mean offset from RNE as a sanity
check. Writes `$OUT/sr_ab.json`. Produced bench/results/nvfp4_sr_layout_ab_2026-11-24T1950_H100.json (run from a
copy of this file in a git-excluded folder with the compared module path fixed, working tree of 0cab912).

    python bench/nvfp4_sr_ab.py --compare-module /tmp/eighths.py
"""
import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from bench.nvfp4_kernel_bench import timed
from training.precision import nvfp4_triton as new
from training.precision.formats import random_sign_vector, rht_matrix
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--compare-module", required=True)
args = ap.parse_args()
spec = importlib.util.spec_from_file_location("old", args.compare_module); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = torch.device("cuda")
h = new.rht_operand(rht_matrix(random_sign_vector(0)), dev)
g = torch.Generator(device=dev).manual_seed(0)
rows = []
for shape in ((8192, 2048), (8192, 4096), (8192, 8192)):
    x = (torch.randn(shape, device=dev, generator=g) / torch.rand(shape, device=dev, generator=g).clamp_min(0.02).sqrt()).bfloat16()
    seed = torch.randint(0, 2**31 - 1, (1,), device=dev)
    # RNE identical between modules; SR: both land on grid neighbours, mean close
    a0, b0, _ = old.dual_quantize_launch(x, h, seed, True, False)
    a1, b1, _ = new.dual_quantize_launch(x, h, seed, True, False)
    rne_same = bool(torch.equal(a0.view(torch.int16), a1.view(torch.int16)) and torch.equal(b0.view(torch.int16), b1.view(torch.int16)))
    s0 = old.dual_quantize_launch(x, h, seed, True, True)
    s1 = new.dual_quantize_launch(x, h, seed, True, True)
    # unbiasedness proxy: mean difference to RNE values, relative
    bias = [float((s[0].float() - a1.float()).mean()) for s in (s0, s1)]
    for cfg in (dict(block_n=256, groups=1, num_warps=4), dict(block_n=256, groups=1, num_warps=8),
                dict(block_n=128, groups=1, num_warps=4), dict(block_n=512, groups=1, num_warps=8)):
        r = {"shape": list(shape), **cfg, "rne_same": rne_same, "sr_mean_minus_rne": bias}
        for name, mod in (("eighths", old), ("full", new)):
            try:
                r[f"{name}_sr_ms"] = min(timed(lambda: mod.dual_quantize_launch(x, h, seed, True, True, **cfg)) for _ in range(2))
            except Exception as e:
                r[f"{name}_sr_ms"] = None; r[f"{name}_err"] = str(e)[:100]
        r["full_rne_ms"] = timed(lambda: new.dual_quantize_launch(x, h, seed, True, False, **cfg))
        rows.append(r); print(json.dumps(r), flush=True)
out = os.environ.get("OUT")
if out:
    json.dump({"bench": "nvfp4 SR layout A/B", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": os.environ.get("PLAB_GIT_COMMIT"), "device": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(out, "sr_ab.json"), "w"), indent=1)

"""Does inductor replay its CUDA graphs for a training config? Trains 10 steps of the 1b shape and prints inductor's
counters; run it with TORCH_LOGS=perf_hints and count the warning "Unable to hit fast path of CUDAGraphs" in its
output (what found the per-layer graphs taking the slow path, bench/NOTES_floor.md section 10).

    TORCH_LOGS=perf_hints python bench/cudagraph_check.py fp8_delayed:compile_mode=reduce-overhead 2>&1 | grep -c "Unable to hit fast path"
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.train_bench import parse_config, run_spec
from training.train import train
from training.sink import ListSink
import torch
cfg = parse_config(sys.argv[1])
spec = run_spec(cfg, steps=10, batch=4, seq=2048)
r = train(spec, ListSink())
print("status", r.status)
print("counters", dict(torch._dynamo.utils.counters.get("inductor", {})))

"""MasterAdamW's Triton update over the 1b model's parameters, alone on a GPU: the tile that moves its bytes fastest.

The update (training/optim_kernels.py) moves 28 bytes per parameter: BF16 gradient and parameter, FP32 master, m
and v. In the 1b step on an H200 its kernel took 9.7 ms for 1.14 B parameters, ~3.3 TB/s against the 4.2 TB/s the
same GPU copies at (bench/results/step_profile_2026-11-28T1957_*: the optimizer row of the floor table, 1.32x). Its
tile then, 2048 elements per program with 8 warps, one program per block, had been chosen on an H100; this probe's
runs on an H200 chose 512 x 4 (436fb00, bench/NOTES_floor.md 81). This times one whole
update of the model (its two launches: the weights with decay, the norms without) for several tiles (elements per
program, warps) and for persistent grids (a few programs per SM, each looping over blocks), each against the copy
ceiling measured in the same run. Every variant starts from the same state and must give the default tile's
parameter, master, m and v to the bit (the update is elementwise: the tile only changes which program computes an
element).

`--shard`: FSDP2's shard update (`adamw_shard_update`, its own kernel) instead, as the one-rank direct step runs it:
FP32 parameters, m and v, BF16 gradients, and the BF16 copy of each updated parameter written by the same pass (28 B
per parameter too); its tile was 2048 x 8, chosen on an H100, until this mode's first H200 run chose 512 x 4 (76775f6,
bench/NOTES_floor.md 83). Tiles BLOCK:WARPS only.

GPU time per update between CUDA events (median of 10 after 3 warm-up updates). Prints a table; writes
bench/results/adamw_tile_probe_<device>_<time>.json (and $OUT/adamw_tile_probe.json).

    python bench/adamw_tile_probe.py [--shard] [--tiles 2048:8 1024:4 2048:8:8 ...]   (block:warps[:programs per SM])
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (elements per program, warps, programs per SM or None for one program per block), after the step's own tile
# (training.optim_kernels: BLOCK x NUM_WARPS, or SHARD_BLOCK x SHARD_NUM_WARPS with --shard), the default every variant
# is checked against and timed beside: the H100's first choice 2048 x 8 (the step's until 436fb00), then the sizes the
# first H200 run tried
TILES = ((2048, 8, None), (1024, 4, None), (2048, 4, None), (4096, 8, None), (4096, 16, None), (8192, 16, None),
         (8192, 8, None), (2048, 8, 8), (4096, 8, 4), (4096, 16, 2), (8192, 16, 2))


# the shard update's tiles: the H100's first, then MasterAdamW's H200 choice (the shard update's since 76775f6) and its
# neighbours
SHARD_TILES = ((2048, 8, None), (512, 4, None), (1024, 4, None), (256, 2, None), (512, 2, None), (1024, 8, None),
               (4096, 8, None))


def default_tiles(shard: bool) -> tuple:
    """The step's own tile (training.optim_kernels) first, then the list's others."""
    from training import optim_kernels as ok
    own = (ok.SHARD_BLOCK, ok.SHARD_NUM_WARPS, None) if shard else (ok.BLOCK, ok.NUM_WARPS, None)
    return (own,) + tuple(t for t in (SHARD_TILES if shard else TILES) if t != own)


def tile_arg(text: str) -> tuple:
    """BLOCK:WARPS or BLOCK:WARPS:PER_SM -> (block, warps, programs per SM or None); powers of two (Triton's
    tl.arange and num_warps need them), PER_SM a positive integer."""
    parts = text.split(":")
    try:
        values = [int(v) for v in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or min(values) < 1 or any(v & (v - 1) for v in values[:2]):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give BLOCK:WARPS or BLOCK:WARPS:PER_SM, BLOCK and WARPS powers of two, PER_SM a positive "
            "integer, e.g. 512:4 or 2048:8:8")
    return (*values[:2], values[2] if len(values) == 3 else None)


def flat_state(params, dev):
    """The update's state as one flat buffer per kind (p, g BF16; w, m, v FP32), each parameter a view of it, so that
    a variant's start state is one copy per kind; p holds the parameters' values. Returns (flat, lists): lists is
    [(views of the 2D parameters, weight decay 0.1), (views of the 1D ones, 0.0)], the step's two launches, each
    views a dict kind -> list of tensors."""
    import torch

    kinds = {"p": torch.bfloat16, "g": torch.bfloat16, "w": torch.float32, "m": torch.float32, "v": torch.float32}
    n = sum(q.numel() for q in params)
    flat = {k: torch.empty(n, device=dev, dtype=dtype) for k, dtype in kinds.items()}
    lists, off = [], 0
    for grp, wd in (([q for q in params if q.dim() >= 2], 0.1), ([q for q in params if q.dim() < 2], 0.0)):
        views = {k: [] for k in kinds}
        for q in grp:
            for k in kinds:
                views[k].append(flat[k][off:off + q.numel()].view(q.shape))
            views["p"][-1].copy_(q.detach())
            off += q.numel()
        lists.append((views, wd))
    return flat, lists


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiles", nargs="+", type=tile_arg, default=None, metavar="BLOCK:WARPS[:PER_SM]",
                    help="tiles to time (the first is the reference for the bit comparison); default: the step's "
                         "own tile, then TILES or SHARD_TILES")
    ap.add_argument("--shard", action="store_true",
                    help="time FSDP2's shard update (FP32 parameters, BF16 gradients and copies) instead")
    a = ap.parse_args(argv)
    tiles = default_tiles(a.shard) if a.tiles is None else a.tiles
    if a.shard and any(per_sm is not None for _, _, per_sm in tiles):
        ap.error("--shard: the shard update has one program per block; give tiles as BLOCK:WARPS")

    import torch

    from bench.benchmeta import git_commit, write_result
    from bench.kernel_bench import model_buckets, timed
    from bench.step_profile import ADAMW_BYTES_PER_PARAM, device_ceilings
    from training import optim_kernels as ok

    if not torch.cuda.is_available():
        print("needs a GPU (the Triton update timed between CUDA events)")
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    params = [q for b in model_buckets(dev) for q in b]
    flat, lists = flat_state(params, dev)
    n = flat["p"].numel()
    del params
    flat["g"].copy_((torch.randn(n, device=dev) * 1e-3).bfloat16())
    flat["w"].copy_(flat["p"].float())
    flat["m"].copy_(torch.randn(n, device=dev) * 1e-4)
    flat["v"].copy_(torch.rand(n, device=dev) * 1e-7)
    start = {k: flat[k].clone() for k in ("p", "w", "m", "v")}
    lr = torch.tensor(1e-4, device=dev)
    grad_scale = torch.tensor(1.3, device=dev)
    wds = {wd: torch.tensor(wd, device=dev) for wd in (0.1, 0.0)}
    steps = [[torch.zeros((), device=dev) for _ in lst["p"]] for lst, _ in lists]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tables = ok.AdamWTables()

    def update(block, warps, per_sm):
        for (lst, wd), st in zip(lists, steps):
            if a.shard:  # w: the FP32 parameter shard; p: its BF16 copy, written by the same pass
                torch._foreach_add_(st, 1.0)  # the caller counts the step (training.parallel's LocalFusedAdamW)
                ok.adamw_shard_update(lst["w"], lst["g"], lst["m"], lst["v"], st, lr=1e-4, beta1=0.9, beta2=0.95,
                                      weight_decay=wd, eps=1e-8, grad_scale=grad_scale, tables=tables,
                                      outs=lst["p"], block=block, num_warps=warps)
                continue
            ok.adamw_master_update(lst["p"], lst["g"], lst["w"], lst["m"], lst["v"], lr, st, grad_scale, 0.9, 0.95,
                                   1e-8, wds[wd], tables=tables, programs=None if per_sm is None else per_sm * sms,
                                   block=block, num_warps=warps)

    def restart():
        for k, t in start.items():
            flat[k].copy_(t)
        for st in steps:
            for s in st:
                s.zero_()

    ceilings = device_ceilings()
    gbps = ceilings["copy_gbps"]
    floor_ms = ADAMW_BYTES_PER_PARAM * n / (gbps * 1e6)
    rows, want = [], None
    for block, warps, per_sm in tiles:
        restart()
        update(block, warps, per_sm)
        torch.cuda.synchronize()
        got = {k: flat[k].clone() for k in ("p", "w", "m", "v")}
        if want is None:
            want = got
        bits = {k: torch.int16 if k == "p" else torch.int32 for k in got}
        mism = {k: int((got[k].view(bits[k]) != want[k].view(bits[k])).sum()) for k in got}
        del got
        ms = timed(lambda: update(block, warps, per_sm), reps=10)
        rows.append({"block": block, "warps": warps, "programs_per_sm": per_sm, "ms": ms, "floor_ms": floor_ms,
                     "vs_floor": ms / floor_ms, "tb_per_s": ADAMW_BYTES_PER_PARAM * n / ms / 1e9,
                     "mismatches_vs_default": mism, "same": not any(mism.values())})
        print(f"[adamw] {rows[-1]}", flush=True)
    summary = {"bench": "adamw_tile_probe", "update": "shard" if a.shard else "master",
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "params": n, "sms": sms, "bytes_per_param": ADAMW_BYTES_PER_PARAM, "ceilings": ceilings,
               "rows": rows}
    print(f"copy ceiling {gbps:.0f} GB/s; {n / 1e9:.3f} B parameters; floor {floor_ms:.2f} ms per update")
    print(f"{'block':>6s} {'warps':>5s} {'per SM':>6s} {'ms':>7s} {'ratio':>6s} {'TB/s':>5s}  same")
    for r in rows:
        per_sm = "-" if r["programs_per_sm"] is None else str(r["programs_per_sm"])
        print(f"{r['block']:6d} {r['warps']:5d} {per_sm:>6s} {r['ms']:7.3f} {r['vs_floor']:6.2f} "
              f"{r['tb_per_s']:5.2f}  {'yes' if r['same'] else 'NO ' + str(r['mismatches_vs_default'])}")
    write_result(summary, "adamw_tile_probe", torch.cuda.get_device_name())
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

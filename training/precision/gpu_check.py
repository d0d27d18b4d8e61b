"""GPU check of every precision recipe, in one call (the CPU test suite cannot reach these code paths).

    python -m training.precision.gpu_check --out $OUT/precision_gpu_check.json

On the GPU it checks, per recipe: which backend `auto` picks and why; conversion of a small Llama;
first-step loss against BF16 (same weights, same batch); that the real kernels agree with our exact
emulation on the same layer; 30 training steps under BF16 autocast that reduce the loss; fp8_delayed under
torch.compile (inductor) with its hook, and its state round trip; and the format contract on the GPU:
`quantize_dequantize` bit-exact against torchao's MXFP8/NVFP4 reference quantizers run on the same device.
Each check records its error instead of stopping the rest. Exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
from torch import nn

from training.precision import BASELINE, RECIPES, apply_recipe, quantize_dequantize
from training.precision.registry import get_recipe

MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096)  # every linear dim a multiple of 128
BATCH, SEQ = 4, 256


def _model(seed=0):
    from training.model import build_model, llama_config

    return build_model(llama_config(MODEL, MODEL["vocab_size"], SEQ), seed).cuda()


def _loss(model, ids):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss


def _check(results, name, fn):
    t0 = time.perf_counter()
    try:
        value = fn()
        results[name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2), **(value or {})}
    except Exception as exc:  # record and go on: one broken recipe must not hide the others
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    status = "ok " if results[name]["ok"] else "FAIL"
    print(f"[{status}] {name}: {json.dumps({k: v for k, v in results[name].items() if k != 'trace'})[:400]}", flush=True)


def check_formats_on_gpu():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {"normal": torch.randn(256, 512, device="cuda", generator=g)}
    out = torch.randn(256, 512, device="cuda", generator=g)
    out[torch.rand(256, 512, device="cuda", generator=g) < 0.01] *= 1e4
    cases["outliers"] = out
    cases["tiny"] = torch.randn(256, 512, device="cuda", generator=g) * 1e-30
    mismatches = {}
    for case, x32 in cases.items():
        for dtype in (torch.float32, torch.bfloat16):
            x = x32.to(dtype)
            for rounding, mode in (("floor", ScaleCalculationMode.FLOOR), ("rceil", ScaleCalculationMode.RCEIL)):
                ref = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=mode).dequantize(dtype)
                ours = quantize_dequantize(x, "mxfp8", scale_rounding=rounding)
                mismatches[f"mxfp8/{rounding}/{case}/{dtype}"] = int((ref != ours).sum())
            ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max())).dequantize(dtype)
            mismatches[f"nvfp4/{case}/{dtype}"] = int((ref != quantize_dequantize(x, "nvfp4")).sum())
    bad = {k: v for k, v in mismatches.items() if v}
    if bad:
        raise AssertionError(f"not bit-exact on GPU: {bad}")
    return {"cases": len(mismatches)}


def check_recipe(recipe: str, ids: torch.Tensor, base_loss: float):
    model = _model()
    report = apply_recipe(model, recipe)
    d = report.to_dict()
    with torch.no_grad():
        first = _loss(model, ids).item()
    rel = abs(first - base_loss) / base_loss
    if rel > (0.03 if recipe == "nvfp4" else 0.01):
        raise AssertionError(f"first-step loss {first:.4f} vs bf16 {base_loss:.4f} ({rel:.2%})")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(30):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        for hook in report.hooks:
            hook.post_optimizer_step(model)
        losses.append(loss.item())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if not all(l == l for l in losses) or losses[-1] > losses[0] - 0.5:
        raise AssertionError(f"did not train: {losses[0]:.3f} -> {losses[-1]:.3f}")
    report.set_numerics_sampling(True)
    _loss(model, ids).backward()
    stats = report.collect_numerics()
    report.set_numerics_sampling(False)
    return {"gemm_backend": report.gemm_backend, "notes": d["notes"], "converted": d["converted_layers"],
            "layer_modules": sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("proj")}),
            "first_loss": first, "bf16_first_loss": base_loss, "loss_after_30": losses[-1],
            "eager_tokens_per_s_rough": round(30 * ids.numel() / elapsed), "numerics_keys": len(stats)}


def check_real_matches_emulation(recipe: str):
    """One real-kernel layer against our emulation of the same format on the same weights and data."""
    torch.manual_seed(0)

    def holder():
        h = nn.Module()
        h.model = nn.Module()
        h.model.layers = nn.ModuleList([nn.Module()])
        h.model.layers[0].proj = nn.Linear(1024, 2048, bias=False).cuda()
        return h

    real, emul = holder(), holder()
    emul.model.layers[0].proj.weight.data.copy_(real.model.layers[0].proj.weight.data)
    r_report = apply_recipe(real, recipe, backend="real")
    apply_recipe(emul, recipe, backend="emulated")
    x = torch.randn(4, 512, 1024, device="cuda")
    dy = torch.randn(4, 512, 2048, device="cuda", dtype=torch.bfloat16)
    outs = []
    for h in (real, emul):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = h.model.layers[0].proj(xi)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float(), h.model.layers[0].proj.weight.grad.float()))
    rel = {what: ((a - b).norm() / b.norm()).item() for what, a, b in zip(("Y", "dX", "dW"), outs[0], outs[1])}
    # Stochastic rounding (nvfp4) and kernel accumulation order differ; formats agree to a few percent.
    limit = 0.15 if recipe == "nvfp4" else 0.03
    if any(v > limit for v in rel.values()):
        raise AssertionError(f"real vs emulated relative differences {rel} exceed {limit}")
    return {"rel_diff": rel, "real_backend": r_report.gemm_backend}


def check_delayed_compile_and_state():
    torch._dynamo.reset()
    model = _model()
    report = apply_recipe(model, "fp8_delayed", amax_history_len=16)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), device="cuda")
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        report.hooks[0].post_optimizer_step(model)
        losses.append(loss.item())
    layer = model.model.layers[0].self_attn.q_proj
    if not bool(layer.history_ready) or float(layer.amax_history[2, 0]) <= 0:
        raise AssertionError("amax history not updated under torch.compile (grad amax missing?)")
    state = report.hooks[0].state_dict()
    fresh = apply_recipe(_model(), "fp8_delayed", amax_history_len=16)
    fresh.hooks[0].load_state_dict(state)
    explain = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    return {"losses": losses, "graph_breaks": explain.graph_break_count, "real": layer.real}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the GPU code paths; run the CPU tests instead", file=sys.stderr)
        return 2
    cap = torch.cuda.get_device_capability()
    results = {"device": torch.cuda.get_device_name(), "capability": f"sm_{cap[0]}{cap[1]}",
               "torch": torch.__version__}
    try:
        import torchao

        results["torchao"] = torchao.__version__
    except Exception as exc:
        results["torchao"] = f"unavailable: {exc}"
    checks: dict = {}
    _check(checks, "formats_bit_exact_on_gpu", check_formats_on_gpu)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        base = _loss(_model(), ids).item()
    for recipe in RECIPES:
        _check(checks, f"train/{recipe}", lambda r=recipe: check_recipe(r, ids, base))
    for recipe in (r for r in RECIPES if r != BASELINE):
        impl = get_recipe(recipe)
        reason = impl.real_unavailable(torch.device("cuda"), impl.resolve_options({}))
        if reason:
            checks[f"real_vs_emulated/{recipe}"] = {"ok": True, "skipped": reason}
            continue
        _check(checks, f"real_vs_emulated/{recipe}", lambda r=recipe: check_real_matches_emulation(r))
    _check(checks, "fp8_delayed_compile_and_state", check_delayed_compile_and_state)
    results["checks"] = checks
    failed = [k for k, v in checks.items() if not v.get("ok")]
    results["failed"] = failed
    text = json.dumps(results, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

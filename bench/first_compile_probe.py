"""Why a fresh model's first compiled step can give other values than the next compilation of the same graph.

Seen on an H200 (bench/NOTES_floor.md 84, gpu_tests_2026-11-29T0328_*): a 2-layer NVFP4 Llama whose very first
forward was compiled gave other logits (129,203 of 131,072, up to 14 % of the max) than the same model compiled
again after `torch._dynamo.reset()`; with an eager step first, every compilation agreed to the bit. A step that
creates state on its first call (a lazily built operand, a cache) would do this: compiled, the first call computes
that state inside its graph, with inductor's arithmetic, and a later compilation reads the stored tensor instead.

One call answers it. On one model (the seed fixed): the module state (every module's and quantizer's attributes,
tensors by shape, dtype, device and a hash of their bytes) before and after each step; the values (logits and every
gradient) of the first compilation, a second one, an eager step and a third compilation, compared to the bit; and
the generated code of the first two compilations, kernel by kernel (kernels only in one, kernels whose source
differs; with --dump the whole code of both in $OUT). Runs on a CPU too (the torch quantizers; nothing there was
seen to differ).

    python bench/first_compile_probe.py                # nvfp4, 2 layers, on the GPU
    python bench/first_compile_probe.py --recipe bf16  # a recipe without lazily built operands, for comparison
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Attributes every nn.Module has whose contents are not the module's own state (hooks, children, parameters, which
# are listed separately by name).
_MODULE_INTERNALS = {"_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "_backward_pre_hooks",
                     "_backward_hooks", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                     "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
                     "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
                     "_is_full_backward_hook", "training"}


def describe(value, depth: int = 0) -> str:
    """A value as a short string that changes when its contents do: tensors by shape, dtype, device and a hash of
    their bytes; dicts, lists and tuples element by element (two levels); other objects by type."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type == "meta":
            return f"tensor{tuple(t.shape)} {t.dtype} meta"
        data = t.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return f"tensor{tuple(t.shape)} {t.dtype} {t.device.type} stride{tuple(t.stride())} " \
               f"{hashlib.sha1(data).hexdigest()[:12]}"
    if depth < 2 and isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v, depth + 1)}" for k, v in value.items()) + "}"
    if depth < 2 and isinstance(value, (list, tuple)):
        return type(value).__name__ + "[" + ", ".join(describe(v, depth + 1) for v in value) + "]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def module_state(model) -> dict[str, str]:
    """Every module's own attributes (not its hooks or children), the attributes of the objects it holds that carry
    state of their own (a layer's quantizer), and every parameter and buffer, each described by `describe`."""
    state = {}
    for name, module in model.named_modules():
        prefix = name or "<model>"
        for attr, value in vars(module).items():
            if attr in _MODULE_INTERNALS:
                continue
            state[f"{prefix}.{attr}"] = describe(value)
            if hasattr(value, "__dict__") and not callable(value) and type(value).__module__.startswith("training"):
                for sub, v in vars(value).items():
                    state[f"{prefix}.{attr}.{sub}"] = describe(v)
        for pname, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            state[f"{prefix}.{pname}"] = describe(p)
    return state


def state_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What a step added, removed or changed in `module_state`."""
    out = [f"added {k}: {after[k]}" for k in after if k not in before]
    out += [f"removed {k}" for k in before if k not in after]
    out += [f"changed {k}: {before[k]} -> {after[k]}" for k in before if k in after and before[k] != after[k]]
    return out


def kernels(code: str) -> dict[str, str]:
    """Inductor's output code: each generated Triton kernel's source by name (C++ kernels on a CPU: each
    `cpp_fused_*` by name)."""
    found = dict(re.findall(r"^(triton_\w+) = async_compile\.triton\('\w+', '''(.*?)'''", code, flags=re.S | re.M))
    found.update(re.findall(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(.*?'''(.*?)'''", code,
                            flags=re.S | re.M))
    return found


def code_changes(first: str, second: str, context_lines: int = 40) -> dict:
    """Kernels only in the first code, only in the second, and those whose source differs (with a unified diff of
    each, cut to `context_lines` lines); and whether the rest of the code (the wrapper that calls them) differs."""
    a, b = kernels(first), kernels(second)
    differ = {}
    for name in sorted(set(a) & set(b)):
        if a[name] != b[name]:
            lines = list(difflib.unified_diff(a[name].splitlines(), b[name].splitlines(), "first", "second", lineterm=""))
            differ[name] = lines[:context_lines]
    strip = re.compile(r"'''.*?'''", flags=re.S)
    wrappers = [re.sub(r"/tmp/\S+|0x[0-9a-f]+", "", strip.sub("", c)) for c in (first, second)]
    return {"only_first": sorted(set(a) - set(b)), "only_second": sorted(set(b) - set(a)), "differ": differ,
            "kernels": [len(a), len(b)], "wrapper_differs": wrappers[0] != wrappers[1]}


def differences(want, got) -> list[str]:
    """Per tensor (logits first, then every gradient), how many elements differ in their bits and by how much."""
    import torch

    out = []
    for i, (w, g) in enumerate(zip(want, got)):
        if w is None or g is None:
            if (w is None) != (g is None):
                out.append(f"tensor {i}: None in one step only")
            continue
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
        differ = w.view(bits) != g.view(bits)
        if differ.any():
            rel = ((w.float() - g.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
            out.append(f"tensor {i} {tuple(w.shape)}: {int(differ.sum())} of {w.numel()} differ, max |diff| / max "
                       f"{rel:.2e}")
    return out


def build(recipe: str, layers: int, device: str, **options):
    """A seeded 2-layer-wide Llama (hidden 256, intermediate 512) in BF16 on `device`, QKV fused, `recipe` applied
    with `options`."""
    return build_with_report(recipe, layers, device, **options)[0]


def build_with_report(recipe: str, layers: int, device: str, **options):
    """`build`'s model and apply_recipe's report (its hooks: what the training loop runs after each optimizer
    step)."""
    import torch

    from training.model import build_model, fuse_qkv, llama_config
    from training.precision import apply_recipe

    config = llama_config({"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": layers,
                           "num_attention_heads": 4, "num_key_value_heads": 2}, 512, 128)
    model = build_model(config, 0).to(device, torch.bfloat16)
    fuse_qkv(model)
    return model, apply_recipe(model, recipe, **options)


def step(model, fn, ids):
    """One forward and backward with the SR seeds drawn from a fixed generator state and, on a GPU, SDPA's math
    backend (an attention backward without atomics): (logits, every parameter's gradient)."""
    import contextlib

    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    pinned = contextlib.nullcontext()
    if ids.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        pinned = sdpa_kernel(SDPBackend.MATH)
    with pinned:
        logits = fn(input_ids=ids).logits
        logits.float().square().mean().backward()
    return [logits.detach().clone()] + [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def graph_count(code: str) -> int:
    """Compiled graphs (forward and backward each one) in inductor's joined output code: one `call` per graph."""
    return code.count("def call(self, args)")


def compiled_step(model, ids, settings: dict | None = None):
    """A fresh compilation of the model (dynamo reset) under inductor's deterministic mode (no on-device
    benchmarking of kernel configurations, which could pick another reduction order) and `settings` (more inductor
    config): (values, output code)."""
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(model)
    with inductor_config.patch({"deterministic": True, **(settings or {})}):
        values, code = run_and_get_code(lambda: step(model, compiled, ids))
    return values, "\n".join(code)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="nvfp4", help="recipe applied to the model (default nvfp4)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--device", default=None, help="cuda (the default where there is one) or cpu")
    ap.add_argument("--dump", action="store_true", help="write both compilations' whole output code to $OUT")
    ap.add_argument("--results-dir", type=Path, default=None, help="where the JSON goes (default bench/results)")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: want 1 or more")

    import torch

    from bench.benchmeta import git_commit, write_result
    from training.precision import recipe_names

    if args.recipe not in recipe_names():
        ap.error(f"--recipe {args.recipe!r}: want one of {', '.join(recipe_names())}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        ap.error(f"--device {device!r}: want cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this machine has no CUDA GPU")

    t0 = time.time()
    model = build(args.recipe, args.layers, device)
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(0)).to(device)
    from torch._dynamo.utils import counters

    states = [module_state(model)]
    breaks = {}

    def compile_and_step(name):
        counters["graph_break"].clear()
        values, code = compiled_step(model, ids)
        breaks[name] = {"graphs": graph_count(code), "graph_breaks": dict(counters["graph_break"])}
        return values, code

    first, code_first = compile_and_step("first")
    states.append(module_state(model))
    second, code_second = compile_and_step("second")
    states.append(module_state(model))
    eager = step(model, model, ids)
    states.append(module_state(model))
    third, _ = compile_and_step("third")

    result = {
        "bench": "first_compile_probe", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": git_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "recipe": args.recipe, "layers": args.layers,
        "state_changed_by": {name: state_changes(a, b) for name, a, b in (
            ("first compiled step", states[0], states[1]), ("second compiled step", states[1], states[2]),
            ("eager step", states[2], states[3]))},
        "values": {"first vs second compilation": differences(first, second),
                   "second vs third compilation (eager step between)": differences(second, third),
                   "eager vs first compilation": differences(eager, first)[:4],
                   "eager vs second compilation": differences(eager, second)[:4]},
        "code, first vs second compilation": code_changes(code_first, code_second),
        "graphs per compilation": breaks,
        "wall_s": round(time.time() - t0, 1),
    }
    if args.dump and os.environ.get("OUT"):
        for name, code in (("first", code_first), ("second", code_second)):
            Path(os.environ["OUT"], f"first_compile_code_{name}.py").write_text(code)
    write_result(result, "first_compile_probe", result["device"], args.results_dir)

    print(f"\n{args.recipe}, {args.layers} layers on {result['device']}:")
    for name, changes in result["state_changed_by"].items():
        print(f"  state changed by the {name}: {len(changes)}" + "".join(f"\n    {c}" for c in changes[:12]))
    for name, diffs in result["values"].items():
        print(f"  {name}: {'; '.join(diffs[:3]) if diffs else 'the same bits'}")
    for name, b in breaks.items():
        print(f"  {name} compilation: {b['graphs']} compiled graphs, graph breaks: "
              f"{sum(b['graph_breaks'].values())} {list(b['graph_breaks'])[:3]}")
    code = result["code, first vs second compilation"]
    print(f"  kernels {code['kernels'][0]} / {code['kernels'][1]}; only in the first: {code['only_first'][:6]}; "
          f"only in the second: {code['only_second'][:6]}; differing: {list(code['differ'])[:6]}; "
          f"wrapper differs: {code['wrapper_differs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

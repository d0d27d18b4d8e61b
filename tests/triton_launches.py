"""The Triton kernels a file of interpreter checks launches, compiled for the GPU the benchmarks run on.

Triton's CPU interpreter runs a kernel as Python: it accepts code the GPU compiler rejects (a `@triton.jit` helper
reading a module global that is not a constexpr, found when such a kernel failed on an H100 while its interpreter
tests passed). So every launch the interpreter sees is recorded here (kernel, argument types, constexpr values,
launch options: `pytest -p tests.triton_launches` with PLAB_TRITON_LAUNCHES naming the file), and
`compile_for_sm90` compiles each distinct one for sm_90 down to a cubin, with Triton's front end, its GPU passes
and its bundled ptxas, on this CPU machine (the constexprs a launcher derives from the device at their GPU value). `tests.interpreted.run_under_triton_interpreter` does both."""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

RECORD_ENV = "PLAB_TRITON_LAUNCHES"
# Constexprs the launchers set from the tensors' device (`x.is_cuda`): under the interpreter they take their CPU
# value, which a GPU never compiles, so the launches are compiled with their GPU value.
GPU_VALUES = {"DOT_BF16": True, "CUDA_SEMANTICS": True, "CUDA_ADDCMUL": True, "NATIVE": True}
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")

_POINTER = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "float64": "*fp64", "int8": "*i8",
            "uint8": "*u8", "int16": "*i16", "int32": "*i32", "int64": "*i64", "bool": "*i1",
            "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5"}


def _arg_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
        if name not in _POINTER:
            raise TypeError(f"no Triton pointer type recorded for {value.dtype}")
        return _POINTER[name]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot record a kernel argument of type {type(value).__name__}")


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def pytest_configure(config) -> None:  # a pytest plugin: `-p tests.triton_launches`
    path = os.environ.get(RECORD_ENV)
    if not path or os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        signature, constexprs = {}, {}
        for name, param in params.items():
            value = bound.get(name, param.default)
            if _is_constexpr(param):
                constexprs[name] = value
            else:
                signature[name] = _arg_type(value)
        record = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": signature,
                  "constexprs": constexprs, "options": {k: v for k, v in kwargs.items() if k in OPTIONS}}
        line = json.dumps(record, sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as f:
                f.write(line + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def compile_for_sm90(path: Path) -> int:
    """Compiles every kernel launch recorded in `path` for sm_90; returns how many. Raises with the kernel's
    name and the compiler's message on the first that does not compile."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    records = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line) if line.strip() else None
        # the product's kernels (a checks file's own helper kernels are test code, and importing it outside the
        # interpreter skips)
        if r is None or r["module"].split(".")[0] != "training":
            continue
        r["constexprs"] = {k: GPU_VALUES.get(k, v) for k, v in r["constexprs"].items()}
        records[json.dumps(r, sort_keys=True)] = r
    records = list(records.values())
    for r in records:
        fn = getattr(importlib.import_module(r["module"]), r["name"])
        fn = getattr(fn, "fn", fn) if not isinstance(fn, triton.runtime.JITFunction) else fn
        signature = {**r["signature"], **{k: "constexpr" for k in r["constexprs"]}}
        try:
            out = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=r["constexprs"]),
                                 target=GPUTarget("cuda", 90, 32), options=r["options"])
        except Exception as e:  # noqa: BLE001 - reported with the launch that failed
            raise AssertionError(f"{r['module']}.{r['name']} {r['constexprs']} does not compile for sm_90: "
                                 f"{str(e)[-1500:]}") from e
        assert out.asm.get("cubin"), f"{r['module']}.{r['name']}: no cubin"
    return len(records)

"""One Triton kernel for MasterAdamW's update of a list of parameters (the GPU fast path of training.optim).

The update (training.optim's module docstring) moves 28 bytes per parameter: BF16 grad and parameter, FP32
master, m and v. Compiled by inductor it is one kernel per parameter; this is one launch per list (an overlap
bucket's parameters of one group): a 1D grid over the list's runs of BLOCK elements, each program finding its
tensors through a table of addresses (parameter, grad, master, m, v, numel, first block). The table is
rebuilt only when an address changes (the gradients are new tensors each step, but the caching allocator
usually hands out the same addresses), so a step usually uploads nothing.

The eager update (`training.optim._adamw_master_update`, the per-parameter torch ops), op for op:
- `m.lerp_(g, w)` is torch's `fma(coeff, g - m, base)` (coeff = w, base = m for |w| < 0.5; else w - 1 and g);
  `v.mul_(b2).addcmul_(g, g, value=c)` is `fma(c * g, g, v * b2)` on CPU (measured, torch 2.13) but
  `fma(c, g * g, v * b2)` on CUDA (torch 2.11's pointwise_op_impl; with the CPU form 25 % of v differed in the
  last bit from CUDA's eager update, bench/results/kernel_bench_*), so the kernel takes the form of the device;
- every other multiply and add is rounded on its own (fp fusion off), divisions and the square root are IEEE
  (`div_rn`, `sqrt_rn`; Triton's `/` is an approximate division);
- the per-parameter bias corrections 1 - beta1^t and sqrt(1 - beta2^t) and the step size lr / (1 - beta1^t)
  are computed by torch, as in the eager update (the kernel does no pow).
The BF16 parameter is the master rounded to nearest even. On CPU the kernel runs under Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests check it bit for bit against the eager update (with an IEEE square
root: torch's CPU sqrt is not correctly rounded, CUDA's is). On the GPU bench/kernel_bench.py counts the
elements that differ from the eager CUDA update.
"""
from __future__ import annotations

import numpy as np
import torch

from training.triton_math import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from training.triton_math import bf16_bits_rne, bf16_to_f32

# MasterAdamW's tile: elements per program and warps, 4 elements per thread (one 16-byte load of each FP32 state
# array). On an H200 (bench/adamw_tile_probe.py, 2026-11-28) one update of the 1b model took 8.29 ms with it against
# 9.19 ms with the 2048 x 8 warps chosen on an H100 in the first kernel: 1.11x against 1.23x its 28 B/param floor at
# the copy bandwidth; 8 or more elements per thread were slower on the H200 at every size tried (up to 7x at 16
# per thread, which spills).
BLOCK = 512
NUM_WARPS = 4
# The FSDP2 shard update's tile (`adamw_shard_update`): MasterAdamW's. On an H200 (bench/adamw_tile_probe.py --shard,
# 2026-11-29) one update of the 1b model's FP32 shards with BF16 gradients and copies took 8.17 ms against 8.92 ms at
# the 2048 x 8 chosen on an H100: 1.08x against 1.18x its 28 B/param floor (256 x 2: 8.08 ms, 1024 x 4: 8.25).
SHARD_BLOCK = 512
SHARD_NUM_WARPS = 4

if HAVE_TRITON:
    @triton.jit
    def _program_block(table_ptr, n_params, firsts_col, blk, P: tl.constexpr, BLOCK: tl.constexpr):
        """(tensor index, element offset) of block `blk` in a 1D grid over a list's blocks of BLOCK elements:
        column `firsts_col` of the table holds each tensor's first block (a prefix sum, n_params + 1 entries); a
        block's tensor is the last whose first block is at or below its id. A 2D grid sized by the largest
        tensor would launch programs past every shorter tensor's end that only exit. (BLOCK is an argument: a
        jit function may not read a module global that is not a constexpr, which only the GPU compiler refuses.)"""
        j = tl.arange(0, P)
        firsts = tl.load(table_ptr + firsts_col * n_params + j, mask=j <= n_params, other=2**62)
        i = tl.sum((firsts <= blk).to(tl.int32)) - 1
        return i, (blk - tl.load(table_ptr + firsts_col * n_params + i)) * BLOCK

    @triton.jit
    def _adamw_master_kernel(table_ptr, n_params, n_blocks, step_size_ptr, bias2_sqrt_ptr, decay_ptr,
                             grad_scale_ptr, lerp_coeff, beta2, one_minus_beta2, eps,
                             LERP_SMALL: tl.constexpr, HAS_SCALE: tl.constexpr, CUDA_ADDCMUL: tl.constexpr,
                             BLOCK: tl.constexpr, P: tl.constexpr):
        # one block per program, or (a grid of fewer programs, see `adamw_master_update`'s `programs`) a
        # grid-stride loop over the blocks
        for blk in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            _adamw_master_block(table_ptr, n_params, blk, step_size_ptr, bias2_sqrt_ptr, decay_ptr, grad_scale_ptr,
                                lerp_coeff, beta2, one_minus_beta2, eps, LERP_SMALL, HAS_SCALE, CUDA_ADDCMUL, BLOCK,
                                P)

    @triton.jit
    def _adamw_master_block(table_ptr, n_params, blk, step_size_ptr, bias2_sqrt_ptr, decay_ptr, grad_scale_ptr,
                            lerp_coeff, beta2, one_minus_beta2, eps,
                            LERP_SMALL: tl.constexpr, HAS_SCALE: tl.constexpr, CUDA_ADDCMUL: tl.constexpr,
                            BLOCK: tl.constexpr, P: tl.constexpr):
        i, start = _program_block(table_ptr, n_params, 6, blk, P, BLOCK)
        numel = tl.load(table_ptr + 5 * n_params + i)
        if start < numel:
            p_ptr = tl.load(table_ptr + i).to(tl.pointer_type(tl.int16))  # BF16 parameter, written as bits
            g_ptr = tl.load(table_ptr + n_params + i).to(tl.pointer_type(tl.bfloat16))
            w_ptr = tl.load(table_ptr + 2 * n_params + i).to(tl.pointer_type(tl.float32))
            m_ptr = tl.load(table_ptr + 3 * n_params + i).to(tl.pointer_type(tl.float32))
            v_ptr = tl.load(table_ptr + 4 * n_params + i).to(tl.pointer_type(tl.float32))
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            g = bf16_to_f32(tl.load(g_ptr + offs, mask=mask, other=0.0))
            w = tl.load(w_ptr + offs, mask=mask, other=0.0)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=mask, other=1.0)
            if HAS_SCALE:
                g = tl.math.div_rn(g, tl.load(grad_scale_ptr))
            # lerp(m, g, 1 - beta1) as torch computes it: fma(coeff, end - start, base), see `lerp_form`
            if LERP_SMALL:
                m = tl.fma(lerp_coeff, g - m, m)
            else:
                m = tl.fma(lerp_coeff, g - m, g)
            if CUDA_ADDCMUL:
                v = tl.fma(one_minus_beta2, g * g, v * beta2)
            else:
                v = tl.fma(one_minus_beta2 * g, g, v * beta2)
            w = w * tl.load(decay_ptr)
            denom = tl.math.div_rn(tl.math.sqrt_rn(v), tl.load(bias2_sqrt_ptr + i)) + eps
            w = w - tl.math.div_rn(tl.load(step_size_ptr + i) * m, denom)
            tl.store(w_ptr + offs, w, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
            tl.store(p_ptr + offs, bf16_bits_rne(w), mask=mask)


def supported(params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    """The kernel's layout: BF16 parameters and gradients (FP32 state) on one device."""
    return (HAVE_TRITON and bool(params) and all(p.dtype == torch.bfloat16 for p in params)
            and all(g.dtype == torch.bfloat16 for g in grads) and len({p.device for p in params}) == 1)


def bias_corrections(steps: list[torch.Tensor], beta1: float, beta2: float):
    """Per parameter 1 - beta1^t and sqrt(1 - beta2^t) (FP32 vectors), as the eager update computes them.
    On CUDA pow is one elementwise function at any size; on CPU the vectorized pow (Sleef) differs in the
    last bit from the scalar one the eager update uses (23 of 20,000 steps for beta 0.999), so there each
    parameter's is computed on its own 0-d step."""
    if steps[0].is_cuda:
        s = torch.stack(steps)
        return 1.0 - torch.pow(beta1, s), torch.sqrt(1.0 - torch.pow(beta2, s))
    return (torch.stack([1.0 - torch.pow(beta1, s) for s in steps]),
            torch.stack([torch.sqrt(1.0 - torch.pow(beta2, s)) for s in steps]))


class AdamWTables:
    """Address tables for the kernel, one per list of parameters, rebuilt when an address changes. Built
    on the current stream (the overlap's side stream), so the caching allocator keeps a replaced table
    alive until the kernels queued there have read it."""

    def __init__(self):
        self._tables: dict[tuple, tuple[tuple, torch.Tensor]] = {}

    def table(self, ps, gs, ws, ms, vs, extra: tuple = ()) -> torch.Tensor:
        """[addresses of ps, gs, ws, ms, vs; numel of each p; `extra`] as an int64 device tensor."""
        key = tuple(t.data_ptr() for t in ps)
        addresses = (*key, *(t.data_ptr() for t in (*gs, *ws, *ms, *vs)), *extra)
        cached = self._tables.get(key)
        if cached is not None and cached[0] == addresses:
            return cached[1]
        host = torch.tensor([*addresses[:len(addresses) - len(extra)], *(p.numel() for p in ps), *extra],
                            dtype=torch.int64)
        # cudaMemcpyAsync from pageable memory: staged before it returns, without a device synchronisation
        table = host.to(ps[0].device, non_blocking=True)
        self._tables[key] = (addresses, table)
        return table


def block_starts(ps, block: int | None = None) -> tuple[int, ...]:
    """Each tensor's first block of `block` (default BLOCK) elements in a 1D grid over the list, and the total
    (`_program_block`)."""
    block = block or BLOCK
    firsts = [0]
    for p in ps:
        firsts.append(firsts[-1] + -(-p.numel() // block))
    return tuple(firsts)


def f32(x: float) -> float:
    """x rounded to FP32: kernel scalars are passed exact, so no scalar arithmetic happens in the kernel
    (the interpreter would do it in FP64)."""
    return float(np.float32(x))


def lerp_form(weight: float) -> tuple[float, bool]:
    """torch's lerp(start, end, w) is fma(coeff, end - start, base) with (coeff, base) = (w, start) for
    |w| < 0.5, else (w - 1, end), all in FP32: returns (coeff, small)."""
    w = np.float32(weight)
    return (float(w), True) if abs(w) < 0.5 else (float(w - np.float32(1.0)), False)


def adamw_master_update(ps, gs, ws, ms, vs, lr, steps, grad_scale, beta1: float, beta2: float, eps: float,
                        wd, *, tables: AdamWTables, programs: int | None = None, block: int | None = None,
                        num_warps: int | None = None):
    """`training.optim._adamw_master_update_many` in one kernel launch (same arguments; `lr` and `wd` are
    0-d FP32 tensors on the parameters' device). Parameters and gradients BF16 (see `supported`). `programs`:
    at most that many programs, each looping over blocks (the update then occupies only that many SMs' worth
    of the GPU, beside kernels on another stream); None: one program per block. `block`, `num_warps`: the tile
    (elements per block, warps per program); None: the module's BLOCK and NUM_WARPS (bench/adamw_tile_probe.py
    times others)."""
    block, num_warps = block or BLOCK, num_warps or NUM_WARPS
    torch._foreach_add_(steps, 1.0)
    bias1, bias2_sqrt = bias_corrections(steps, beta1, beta2)
    step_size = lr / bias1
    decay = 1.0 - lr * wd
    firsts = block_starts(ps, block)
    table = tables.table(ps, gs, ws, ms, vs, extra=firsts)
    coeff, small = lerp_form(1.0 - beta1)
    grid = firsts[-1] if programs is None else max(1, min(programs, firsts[-1]))
    _adamw_master_kernel[(grid,)](
        table, len(ps), firsts[-1], step_size, bias2_sqrt, decay, grad_scale if grad_scale is not None else decay,
        coeff, f32(beta2), f32(1.0 - beta2), f32(eps),
        LERP_SMALL=small, HAS_SCALE=grad_scale is not None, CUDA_ADDCMUL=ps[0].is_cuda, BLOCK=block,
        P=triton.next_power_of_2(len(ps) + 1), num_warps=num_warps, enable_fp_fusion=False)


# ---------------------------------------------------------------------------------------------------
# torch's fused AdamW over FP32 shards (FSDP2's master parameters), without writing the gradients back
#
# `torch._fused_adamw_` on CUDA computes in FP32 with its hyperparameters as FP32. Its arithmetic was read off
# torch 2.11's kernel on an H100 by comparing its results with candidate expressions (bench/
# shard_adamw_bench.py checks this kernel against it, element for element):
#     g = g / grad_scale                                  (IEEE division)
#     p = fma(-(lr * wd), p, p)                           (only when wd != 0)
#     m = fma(beta1, m, (1 - beta1) * g)
#     v = fma(beta2, v, (1 - beta2) * (g * g))
#     p = p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)
# with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t) per tensor, FP32 (powf of the FP32
# step counter). With a `grad_scale` torch's kernel also stores the divided gradient back (4 B per parameter):
# nothing reads it after the update, so this kernel does not: 28 B per parameter instead of 32.
if HAVE_TRITON:
    @triton.jit
    def _adamw_shard_kernel(table_ptr, n_params, step_size_ptr, bc2s_ptr, grad_scale_ptr,
                            lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                            HAS_SCALE: tl.constexpr, HAS_DECAY: tl.constexpr, G_BF16: tl.constexpr,
                            HAS_OUT: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr):
        i, start = _program_block(table_ptr, n_params, 5, tl.program_id(0), P, BLOCK)
        numel = tl.load(table_ptr + 4 * n_params + i)
        if start < numel:
            p_ptr = tl.load(table_ptr + i).to(tl.pointer_type(tl.float32))
            if G_BF16:
                g_ptr = tl.load(table_ptr + n_params + i).to(tl.pointer_type(tl.bfloat16))
            else:
                g_ptr = tl.load(table_ptr + n_params + i).to(tl.pointer_type(tl.float32))
            m_ptr = tl.load(table_ptr + 2 * n_params + i).to(tl.pointer_type(tl.float32))
            v_ptr = tl.load(table_ptr + 3 * n_params + i).to(tl.pointer_type(tl.float32))
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
            if G_BF16:
                g = bf16_to_f32(tl.load(g_ptr + offs, mask=mask, other=0.0))
            else:
                g = tl.load(g_ptr + offs, mask=mask, other=0.0)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
            if HAS_SCALE:
                g = tl.math.div_rn(g, tl.load(grad_scale_ptr))
            if HAS_DECAY:
                p = tl.fma(-lr_wd, p, p)
            m = tl.fma(beta1, m, one_minus_beta1 * g)
            v = tl.fma(beta2, v, one_minus_beta2 * (g * g))
            denom = tl.math.div_rn(tl.math.sqrt_rn(v), tl.load(bc2s_ptr + i)) + eps
            p = p - tl.math.div_rn(tl.load(step_size_ptr + i) * m, denom)
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
            if HAS_OUT:  # the BF16 copy of the updated shard, after the block's first n + 1 table entries
                o_ptr = tl.load(table_ptr + 6 * n_params + 1 + i).to(tl.pointer_type(tl.int16))
                tl.store(o_ptr + offs, bf16_bits_rne(p), mask=mask)


_SCALARS: dict = {}


def _device_scalar(x: float, device: torch.device) -> torch.Tensor:
    """x as a 0-d FP32 tensor on `device`, uploaded once per value (the learning rate changes every step, the
    betas never; the update runs once per FSDP unit and step). The cache assumes one stream: the overlapped FSDP2
    step makes every call on its side stream, where the tensors are allocated, so clearing the cache never frees
    memory a kernel on another stream still reads."""
    key = (x, device)
    t = _SCALARS.get(key)
    if t is None:
        if len(_SCALARS) > 64:
            _SCALARS.clear()
        t = _SCALARS[key] = torch.tensor(x, dtype=torch.float32).to(device, non_blocking=True)
    return t


def shard_scalars(steps: list[torch.Tensor], lr: float, beta1: float, beta2: float):
    """Per tensor, FP32: lr / (1 - beta1^t) and sqrt(1 - beta2^t) from the FP32 step counters, as torch's kernel
    (FP32 pow, subtraction, square root and division)."""
    s = torch.stack(steps)
    b1, b2, lr_t = (_device_scalar(x, s.device) for x in (beta1, beta2, lr))
    # a tensor numerator: `float / tensor` is torch's reciprocal times the float, not a division
    return torch.div(lr_t, 1.0 - torch.pow(b1, s)), torch.sqrt(1.0 - torch.pow(b2, s))


def shard_supported(params: list[torch.Tensor], grads: list[torch.Tensor],
                    outs: list[torch.Tensor] | None = None) -> bool:
    """FP32 parameters and state on one device, their gradients all FP32 or all BF16, and `outs` (BF16 copies of
    the parameters to write, if any) of the parameters' sizes; every tensor contiguous (the kernel walks flat
    memory)."""
    if not (HAVE_TRITON and params and len(grads) == len(params)):
        return False
    outs = outs or []
    tensors = (*params, *grads, *outs)
    return (all(p.dtype == torch.float32 for p in params) and len({g.dtype for g in grads}) == 1
            and grads[0].dtype in (torch.float32, torch.bfloat16)
            and all(g.numel() == p.numel() for g, p in zip(grads, params))
            and (not outs or (len(outs) == len(params) and all(
                o.dtype == torch.bfloat16 and o.numel() == p.numel() for o, p in zip(outs, params))))
            and all(t.is_contiguous() for t in tensors) and len({t.device for t in tensors}) == 1)


def adamw_shard_update(ps, gs, ms, vs, steps, *, lr: float, beta1: float, beta2: float, weight_decay: float,
                       eps: float, grad_scale: torch.Tensor | None, tables: AdamWTables, outs=None,
                       block: int | None = None, num_warps: int | None = None):
    """`torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=..., grad_scale=...)` (AdamW, not amsgrad, not
    maximize; after the caller's `_foreach_add_(steps, 1)`) in one launch, without storing the divided
    gradients. Parameters and state FP32 on one device; the gradients FP32, or BF16 (read as their exact FP32
    values: the same update as with their FP32 copies). `outs`: BF16 tensors that receive each updated parameter
    rounded to nearest even (what `.to(torch.bfloat16)` gives), written by the same pass (see `shard_supported`).
    `block`, `num_warps`: the tile; None: SHARD_BLOCK and SHARD_NUM_WARPS (bench/adamw_tile_probe.py --shard times
    others)."""
    block, num_warps = block or SHARD_BLOCK, num_warps or SHARD_NUM_WARPS
    step_size, bc2s = shard_scalars(steps, lr, beta1, beta2)
    firsts = block_starts(ps, block)
    table = tables.table(ps, gs, ms, vs, [], extra=(*firsts, *(o.data_ptr() for o in outs or ())))
    b1, b2 = np.float32(beta1), np.float32(beta2)
    _adamw_shard_kernel[(firsts[-1],)](
        table, len(ps), step_size, bc2s, grad_scale if grad_scale is not None else step_size,
        float(np.float32(lr) * np.float32(weight_decay)), float(b1), float(np.float32(1.0) - b1), float(b2),
        float(np.float32(1.0) - b2), f32(eps),
        HAS_SCALE=grad_scale is not None, HAS_DECAY=weight_decay != 0, G_BF16=gs[0].dtype == torch.bfloat16,
        HAS_OUT=bool(outs), BLOCK=block, P=triton.next_power_of_2(len(ps) + 1), num_warps=num_warps,
        enable_fp_fusion=False)

"""`nvfp4`: NVIDIA's NVFP4 training recipe (arXiv 2509.25149).

E2M1 elements; one E4M3 scale per 16 elements plus one FP32 scale per tensor. Activations and
gradients use 1x16 blocks along the GEMM's reduction dim; weights use 16x16 tiles (`weight_2d`), so
Fprop and Dgrad see the same quantized weight (the chain rule stays consistent). Both Wgrad operands
pass through a 16-point random Hadamard transform along the token dim (`rht`: one fixed random sign
vector, seeded by `rht_seed`), which spreads outliers before FP4 quantization and cancels in the
product. Gradients are stochastically rounded (`stochastic_rounding`) so their quantization is
unbiased. Each part can be switched off for ablations. Real kernels: torchao `NVFP4Linear`, sm_100+
only and only with every part on; emulation elsewhere.

Emulation (see emulation.py): each operand is quantized and dequantized to element x E4M3 block scale,
which is exact in BF16; on GPU that BF16 tensor feeds a plain BF16 GEMM (FP32 accumulation, BF16
result) and the FP32 per-tensor scales of both operands are then multiplied onto the BF16 result and
rounded again: accumulator -> BF16 -> x global scales -> BF16. This double rounding (one extra BF16
rounding, 2^-9 relative) is the one place where the emulation is not bit-exact with a block-scaled
kernel that applies the global scale to its FP32 accumulator; it is far below FP4's own error.

On CUDA with BF16 activations (token count a multiple of 16) the layer takes the fused path
(`NVFP4FusedFn`, kernels in nvfp4_triton.py, option `fused_quantize`, on by default): X and dY are each
read twice and written once per layout, both quantizations (1x16 along features for Fprop/Dgrad; RHT
then 1x16 along tokens for Wgrad) coming out of one Triton pass; the RHT's FP32 sums are quantized
directly, as in a fused hardware kernel. Forward saves X's Wgrad operand instead of X, and with 16x16
weight tiles the quantized weight, which Dgrad reuses. Elsewhere (CPU, FP32 activations, other token
counts, `fused_quantize=false`) the torch quantizers of formats.py run through EmulatedLinearFn: there
the RHT is a GEMM in the GEMM dtype (FP32 on CPU; on GPU a BF16 GEMM whose result is rounded to BF16,
2^-9 relative, before the FP4 quantization reads it). The Wgrad operands are blocked along tokens in place
(no transposed copies). Stochastic rounding uses 8 random bits per element on both paths, as Blackwell's
`cvt.rs` instruction (up with probability floor(256 f) / 256 for a fraction f of the grid step; see
formats.round_to_e2m1): drawn with `torch.rand_like` on the torch path (in-kernel Philox under torch.compile;
eager and compiled runs draw different, equally distributed, roundings) and with Triton's Philox, seeded from
torch's CUDA generator, on the fused path (one 32-bit word per 4 roundings, as the hardware kernels); the two
paths' roundings agree in distribution, not draw for draw.

GEMM benchmark (`gemm_ops`): on sm_100+ torchao's `NVFP4Tensor.to_nvfp4` and block-scaled GEMM in both modes;
elsewhere kernel-only mode times torchao's emulated path (NVFP4Tensor dequantized to BF16, BF16 GEMM) and the
"with quantization" mode the quantizers a training step runs (`NVFP4EmulatedGemmOps`: on CUDA the fused Triton
quantizers for X and dY and one weight quantization for both passes, as NVFP4FusedFn; elsewhere the torch
quantizers of EmulatedLinearFn) with training's emulated GEMM.
"""
from __future__ import annotations

import torch

from training.precision.emulation import (EmulatedLinearFn, GemmQuantizer, QuantizedLinear, compute_dtype, emulated_mm,
                                        emulated_mm_parts, has_hooks)
from training.precision.formats import (Quantized, quantize_nvfp4, random_hadamard_transform, random_sign_vector,
                                        rht_matrix)
from training.precision.gemm_ops import EmulatedTorchaoOps, TorchaoBlockScaled, TorchaoBlockScaledOps, has_capability
from training.precision.registry import Recipe, capability_reason, register

BLOCK = 16


class NVFP4Quantizer(GemmQuantizer):
    def __init__(self, *, rht: bool, stochastic_rounding: bool, weight_2d: bool, rht_seed: int, device=None,
                 fused: bool = True):
        self.rht = rht
        self.fused = fused  # the Triton fast path on CUDA (nvfp4_triton.py); False: torch quantizers only
        self._rht_operands: dict = {}
        self.stochastic_rounding = stochastic_rounding
        self.weight_2d = weight_2d
        self.signs = random_sign_vector(rht_seed)
        # Built once on the layer's device: no per-step host work, nothing for torch.compile to trace.
        self.rht_matrix = rht_matrix(self.signs).to(device) if device is not None else rht_matrix(self.signs)
        if device is not None:
            self.rht_operand(device)  # built now, not by the first (compiled) forward: see rht_operand

    def rht_operand(self, device) -> torch.Tensor:
        """rht^T in BF16 on `device`, for the fused kernels: built once per device, on the layer's device when the
        quantizer is made. Not stored while torch.compile traces (a layer moved to another device afterwards): the
        graph then computes it (a 16 x 16 copy). Built and stored by the first compiled forward instead, it split
        that step into several graphs (12 compiled graphs for a 2-layer model on an H200 under torch 2.11, against
        2 once it existed), whose boundaries round intermediates to BF16 that one graph keeps in FP32: that step's
        values were not those of any later compilation (bench/first_compile_probe.py; bench/NOTES_floor.md 86)."""
        key = str(device)
        operand = self._rht_operands.get(key)
        if operand is None:
            from training.precision.nvfp4_triton import rht_operand
            operand = rht_operand(self.rht_matrix, device)
            if not torch.compiler.is_compiling():
                self._rht_operands[key] = operand
        return operand

    def input(self, x2d, *, dtype=torch.float32, track=False):
        return quantize_nvfp4(x2d, dtype=dtype, track=track)

    def weight_fprop(self, w, *, dtype=torch.float32, track=False):
        return quantize_nvfp4(w, block_2d=self.weight_2d, dtype=dtype, track=track)

    def weight_dgrad(self, w, *, dtype=torch.float32, track=False):
        # 16x16 tiles are transpose-invariant: Dgrad sees the very weight Fprop saw. With 1x16 blocks,
        # W is re-blocked along out_features (its columns, in place, used transposed).
        if self.weight_2d:
            return quantize_nvfp4(w, block_2d=True, dtype=dtype, track=track).t()
        return quantize_nvfp4(w, axis=0, dtype=dtype, track=track).t()

    def grad(self, dy2d, *, dtype=torch.float32, track=False):
        return quantize_nvfp4(dy2d, stochastic=self.stochastic_rounding, dtype=dtype, track=track)

    def _wgrad_rht(self, t2d, dtype):
        # Both Wgrad operands are blocked along tokens (axis 0 of [tokens, features]); the RHT mixes each run of
        # 16 tokens in place, as a GEMM in the GEMM dtype (BF16 on GPU: exact products, FP32 accumulation).
        return random_hadamard_transform(t2d, self.rht_matrix.to(t2d.device), axis=0, dtype=dtype) if self.rht else t2d

    def grad_wgrad(self, dy2d, *, dtype=torch.float32):
        return quantize_nvfp4(self._wgrad_rht(dy2d, dtype), axis=0, stochastic=self.stochastic_rounding,
                              dtype=dtype).t()

    def input_wgrad(self, x2d, *, dtype=torch.float32):
        return quantize_nvfp4(self._wgrad_rht(x2d, dtype), axis=0, dtype=dtype).t()

    def describe(self):
        parts = ["16x16 weights" if self.weight_2d else "1x16 weights"]
        parts.append("RHT on Wgrad" if self.rht else "no RHT")
        parts.append("SR on grads" if self.stochastic_rounding else "RNE grads")
        return "NVFP4 E2M1 + E4M3/16 + FP32 tensor scale, " + ", ".join(parts)


def _fused_fprop(xq: tuple, weight, bias, quantizer: "NVFP4Quantizer", out_dtype, wf, wf_outer, wd, wd_outer):
    """One linear's Fprop on the fused path from X's quantization `xq` = (xa, xb, pts): (Y as [tokens, out],
    W's Dgrad operand (values, outer) or None). `wf`.. : W's operands from the per-step weight cache, or None."""
    xa, _, pts = xq
    wq, w_dgrad = _weight_operands(quantizer, weight, (wf, wf_outer, wd, wd_outer))
    y = emulated_mm(Quantized(xa, pts[0]), wq, out_dtype, bias)
    return y, w_dgrad


def _fused_bprop(dy, xb, pts_x, weight, w_dgrad: tuple, q: "NVFP4Quantizer", needs_x: bool, needs_w: bool,
                 has_bias: bool, x_dtype, x_shape, bias_dtype):
    """One linear's Dgrad, Wgrad and bias gradient on the fused path: dY quantized into both layouts, X's Wgrad
    operand `xb` (with its scales `pts_x`) saved by the forward; `w_dgrad` the saved (values, outer) or ()."""
    from training.precision.nvfp4_triton import nvfp4_dual_quantize

    dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)
    dya, dyb, pts_dy = nvfp4_dual_quantize(dy2, q.rht_operand(dy2.device), rht=q.rht,
                                           stochastic=q.stochastic_rounding)
    grad_x = grad_w = grad_b = None
    if needs_x:
        wdq = Quantized(w_dgrad[0], w_dgrad[1]) if w_dgrad else q.weight_dgrad(weight, dtype=torch.bfloat16)
        grad_x = emulated_mm(Quantized(dya, pts_dy[0]), wdq, x_dtype).reshape(x_shape)
    if needs_w:
        grad_w = emulated_mm(Quantized(dyb, pts_dy[1]).t(), Quantized(xb, pts_x[1]).t(), weight.dtype)
    if has_bias:
        grad_b = dy2.to(torch.float32).sum(0).to(bias_dtype)
    return grad_x, grad_w, grad_b


def _quantize_input(x, quantizer: "NVFP4Quantizer"):
    """(x as [tokens, features] in the compute dtype, (xa, xb, pts)): X's Fprop and Wgrad operands, one pass."""
    from training.precision.nvfp4_triton import nvfp4_dual_quantize

    x2 = x.reshape(-1, x.shape[-1]).to(compute_dtype(x))
    return x2, nvfp4_dual_quantize(x2, quantizer.rht_operand(x2.device), rht=quantizer.rht, stochastic=False)


class NVFP4FusedFn(torch.autograd.Function):
    """The emulated NVFP4 linear on the GPU fast path (nvfp4_triton.py): X and dY are each quantized once
    into both layouts they are needed in (Fprop/Dgrad: 1x16 along features; Wgrad: RHT then 1x16 along
    tokens). Forward saves X's Wgrad operand (BF16, X's size) instead of X, and with 16x16 weight tiles
    the quantized weight for Dgrad (transpose-invariant: the very tensor Fprop used). Same GEMMs and
    numerics as EmulatedLinearFn, except that the RHT's FP32 sums are quantized directly."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, quantizer: "NVFP4Quantizer", wf=None, wf_outer=None, wd=None, wd_outer=None):
        """`wf`, `wd` (and outer scales): W's Fprop and Dgrad operands (BF16) from the per-step weight cache
        (QuantizedLinear), or None."""
        x2, xq = _quantize_input(x, quantizer)
        y, w_dgrad = _fused_fprop(xq, weight, bias, quantizer, x2.dtype, wf, wf_outer, wd, wd_outer)
        _save(ctx, xq, weight, w_dgrad, quantizer, bias, x)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        xb, pts_x, weight, *wq = ctx.saved_tensors
        grads = _fused_bprop(dy, xb, pts_x, weight, wq, ctx.quantizer, ctx.needs_input_grad[0],
                             ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2], ctx.x_dtype,
                             ctx.x_shape, ctx.bias_dtype)
        return (*grads, None, None, None, None, None)


def _save(ctx, xq, weight, w_dgrad, quantizer, bias, x) -> None:
    _, xb, pts = xq
    if w_dgrad is not None:  # W^T for Dgrad, known now (16x16 tiles, or cached): saved, not requantized
        ctx.save_for_backward(xb, pts, weight, w_dgrad.values, w_dgrad.outer)
    else:
        ctx.save_for_backward(xb, pts, weight)
    ctx.quantizer = quantizer
    ctx.has_bias = bias is not None
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None


class NVFP4SharedInputFn(torch.autograd.Function):
    """Two emulated NVFP4 linears on the fused path that read the same X (a gated MLP's gate and up
    projections): X is quantized once for both, and its Wgrad operand saved once; each linear's GEMMs, W
    operands and dY quantization are NVFP4FusedFn's. The same values as two NVFP4FusedFn calls: X's
    quantization rounds to nearest (deterministic), and dX is the sum of the two Dgrad products, as autograd
    adds them (two BF16 tensors). With stochastic rounding the two dY quantizations draw their seeds in this
    function's order (up's first, as autograd's engine runs them), not necessarily the compiled graph's."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, w1, b1, w2, b2, q1: "NVFP4Quantizer", q2: "NVFP4Quantizer", wf1=None, wfo1=None, wd1=None,
                wdo1=None, wf2=None, wfo2=None, wd2=None, wdo2=None):
        x2, xq = _quantize_input(x, q1)
        y1, wdq1 = _fused_fprop(xq, w1, b1, q1, x2.dtype, wf1, wfo1, wd1, wdo1)
        y2, wdq2 = _fused_fprop(xq, w2, b2, q2, x2.dtype, wf2, wfo2, wd2, wdo2)
        _, xb, pts = xq
        saved = [xb, pts, w1, w2]
        ctx.dgrad = []  # per linear: where its saved Dgrad operand is in saved_tensors, or None
        for wdq in (wdq1, wdq2):
            ctx.dgrad.append(len(saved) if wdq is not None else None)
            saved += [wdq.values, wdq.outer] if wdq is not None else []
        ctx.save_for_backward(*saved)
        ctx.quantizers = (q1, q2)
        ctx.has_bias = (b1 is not None, b2 is not None)
        ctx.bias_dtype = tuple(b.dtype if b is not None else None for b in (b1, b2))
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        lead = x.shape[:-1]
        return y1.reshape(*lead, w1.shape[0]), y2.reshape(*lead, w2.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy1, dy2):
        saved = ctx.saved_tensors
        xb, pts_x = saved[0], saved[1]
        needs = ctx.needs_input_grad
        out = {}
        for k in (1, 0):  # up's backward first, as autograd's engine orders the two separate layers
            dy = (dy1, dy2)[k]
            w = saved[2 + k]
            at = ctx.dgrad[k]
            wq = saved[at:at + 2] if at is not None else ()
            if dy is None:
                out[k] = (None, None, None)
                continue
            out[k] = _fused_bprop(dy, xb, pts_x, w, wq, ctx.quantizers[k], needs[0], needs[1 + 2 * k],
                                  ctx.has_bias[k] and needs[2 + 2 * k], ctx.x_dtype, ctx.x_shape, ctx.bias_dtype[k])
        gx = [g for g in (out[1][0], out[0][0]) if g is not None]
        grad_x = (gx[0] + gx[1] if len(gx) == 2 else gx[0]) if gx else None
        return (grad_x, out[0][1], out[0][2], out[1][1], out[1][2]) + (None,) * 10


class NVFP4EmulatedLinear(QuantizedLinear):
    """Emulated NVFP4 linear: the fused Triton quantizers where they apply (CUDA, BF16 activations, token
    count a multiple of 16), the torch quantizers of EmulatedLinearFn elsewhere (CPU, FP32, odd shapes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused_path(x):
            return NVFP4FusedFn.apply(x, self.weight, self.bias, self.quantizer, *self._cached("fused"))
        return EmulatedLinearFn.apply(x, self.weight, self.bias, self.quantizer, *self._cached("generic"))

    def forward_shared(self, x: torch.Tensor, other: "NVFP4EmulatedLinear") -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x), other(x)), with X quantized once for both where the fused path runs (NVFP4SharedInputFn).
        Each module's own call where either has hooks (the numerics probe samples gate and up through forward
        hooks, which a shared call would bypass): the same values."""
        if self._fused_path(x) and other._fused_path(x) and not (has_hooks(self) or has_hooks(other)):
            c1, c2 = self._cached("fused") or (None,) * 4, other._cached("fused") or (None,) * 4
            return NVFP4SharedInputFn.apply(x, self.weight, self.bias, other.weight, other.bias, self.quantizer,
                                            other.quantizer, *c1, *c2)
        return self(x), other(x)

    def _fused_path(self, x: torch.Tensor) -> bool:
        if not (x.is_cuda and compute_dtype(x) == torch.bfloat16 and (x.numel() // x.shape[-1]) % BLOCK == 0):
            return False
        from training.precision import nvfp4_triton

        return nvfp4_triton.HAVE_TRITON and self.quantizer.fused

    @torch.no_grad()
    def refresh_weight_cache(self) -> None:
        """Where the fused path may run (CUDA, Triton, fused option): its BF16 W, for a BF16 activation whose
        token count is a multiple of 16. Elsewhere the generic path's. Only for an uncompiled forward (see
        QuantizedLinear.reuses_weight_when: NVFP4's weight quantizer is torch ops on either path)."""
        from training.precision import nvfp4_triton

        if not (self.weight.is_cuda and nvfp4_triton.HAVE_TRITON and self.quantizer.fused):
            return super().refresh_weight_cache()
        f, d = fused_weight_operands(self.quantizer, self.weight)
        d = d or self.quantizer.weight_dgrad(self.weight, dtype=torch.bfloat16)
        self.cached_weight = ("fused", f.values, f.outer, d.values, d.outer)


def _shared_input_mlp_forward(self, x):
    """LlamaMLP.forward (down(act(gate(x)) * up(x))) with gate and up quantizing X once (share_mlp_input)."""
    gate, up = self.gate_proj.forward_shared(x, self.up_proj)
    return self.down_proj(self.act_fn(gate) * up)


def share_mlp_input(block) -> int:
    """In a Llama decoder block whose MLP's gate and up projections are both emulated NVFP4 linears with the same
    transform, have them quantize their common input once (NVFP4SharedInputFn, on the fused path; elsewhere each
    its own, as before): X's two layouts are then made and its Wgrad operand saved once instead of twice. Returns 1
    if the MLP was set up so, else 0 (another MLP class, gate and up fused into one linear, kept in BF16, ...)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = getattr(block, "mlp", None)
    if type(mlp) is not LlamaMLP or getattr(mlp, "_plab_shared_input", False):
        return 0
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not (isinstance(gate, NVFP4EmulatedLinear) and isinstance(up, NVFP4EmulatedLinear)):
        return 0
    qg, qu = gate.quantizer, up.quantizer
    if qg.rht != qu.rht or not torch.equal(qg.signs, qu.signs):
        return 0
    mlp.forward = _shared_input_mlp_forward.__get__(mlp)
    mlp._plab_shared_input = True
    return 1


def _weight_operands(q: "NVFP4Quantizer", w, cached) -> tuple[Quantized, Quantized | None]:
    """W's Fprop operand and its Dgrad operand (or None: quantized when Dgrad needs it), from the per-step weight cache
    `cached` = (wf, wf_outer, wd, wd_outer) where it holds them (QuantizedLinear), else quantized now."""
    wf, wf_outer, wd, wd_outer = cached
    if wf is not None:
        return Quantized(wf, wf_outer), (Quantized(wd, wd_outer) if wd is not None else None)
    return fused_weight_operands(q, w)


class NVFP4SwiGLUMLPFn(torch.autograd.Function):
    """A Llama MLP, down(silu(gate(x)) * up(x)), of emulated NVFP4 linears on the fused path (`fused_swiglu`): the
    GEMMs, quantizations and saved operands of NVFP4SharedInputFn (gate and up) and NVFP4FusedFn (down), operand for
    operand, except that SwiGLU and its backward run as one Triton pass each (nvfp4_swiglu_triton) that takes the gate
    and up GEMMs' BF16 results with their scales (and down's Dgrad result with its scale), writes h (or dL/dgate and
    dL/dup) and the per-tensor maxima their quantization needs, so the quantizer's amax pass over them is skipped.
    The math of those passes is what inductor's compiled step computes from the same GEMM results (the scale products
    not rounded to BF16), so a compiled step gives the three layers' bits (tests/precision/test_nvfp4_swiglu_gpu.py);
    an eager one differs from the three layers' eager step, which rounds each GEMM's scaled result to BF16 first. SR
    seeds are drawn in the layers' order: down's dY, then up's, then gate's."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, wg, wu, wd, qg: "NVFP4Quantizer", qu: "NVFP4Quantizer", qd: "NVFP4Quantizer", *cached):
        """`cached`: for gate, up and down, (wf, wf_outer, wd, wd_outer) from the per-step weight cache or Nones."""
        from training.precision.nvfp4_swiglu_triton import nvfp4_swiglu_fwd
        from training.precision.nvfp4_triton import nvfp4_dual_quantize_given_amax

        x2, (xa, xb, pts_x) = _quantize_input(x, qg)
        ops = [_weight_operands(q, w, cached[4 * i:4 * i + 4]) for i, (q, w) in enumerate(((qg, wg), (qu, wu),
                                                                                           (qd, wd)))]
        xq = Quantized(xa, pts_x[0])
        g, s_g = emulated_mm_parts(xq, ops[0][0])
        u, s_u = emulated_mm_parts(xq, ops[1][0])
        rht_t = qd.rht_operand(x2.device)
        h, amax_h = nvfp4_swiglu_fwd(g, u, s_g, s_u, rht_t, rht=qd.rht)
        ha, hb, pts_h = nvfp4_dual_quantize_given_amax(h, rht_t, amax_h, rht=qd.rht, stochastic=False)
        y = emulated_mm(Quantized(ha, pts_h[0]), ops[2][0], x2.dtype)
        saved = [xb, pts_x, g, u, s_g, s_u, hb, pts_h, wg, wu, wd]
        ctx.dgrad = []  # per linear: where its saved Dgrad operand is in saved_tensors, or None
        for _, wdq in ops:
            ctx.dgrad.append(len(saved) if wdq is not None else None)
            saved += [wdq.values, wdq.outer] if wdq is not None else []
        ctx.save_for_backward(*saved)
        ctx.quantizers = (qg, qu, qd)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.reshape(*x.shape[:-1], wd.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        from training.precision.nvfp4_swiglu_triton import nvfp4_swiglu_bwd
        from training.precision.nvfp4_triton import nvfp4_dual_quantize, nvfp4_dual_quantize_given_amax

        saved = ctx.saved_tensors
        xb, pts_x, g, u, s_g, s_u, hb, pts_h, wg, wu, wd = saved[:11]
        qg, qu, qd = ctx.quantizers
        needs = ctx.needs_input_grad

        def dgrad_operand(k, q, w):
            at = ctx.dgrad[k]
            return Quantized(saved[at], saved[at + 1]) if at is not None else q.weight_dgrad(w, dtype=torch.bfloat16)

        # down: dY quantized (its SR seed first), Dgrad into dh (GEMM and scale apart, for the SwiGLU pass), Wgrad
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)
        rht_t = qd.rht_operand(dy2.device)
        dya, dyb, pts_dy = nvfp4_dual_quantize(dy2, rht_t, rht=qd.rht, stochastic=qd.stochastic_rounding)
        dh, s_dh = emulated_mm_parts(Quantized(dya, pts_dy[0]), dgrad_operand(2, qd, wd))
        grad_wd = emulated_mm(Quantized(dyb, pts_dy[1]).t(), Quantized(hb, pts_h[1]).t(), wd.dtype) if needs[3] \
            else None
        dg, amax_dg, du, amax_du = nvfp4_swiglu_bwd(g, u, dh, s_g, s_u, s_dh, qg.rht_operand(dh.device), rht=qg.rht)
        grads = {}
        for k, q, w, d, amax in ((1, qu, wu, du, amax_du), (0, qg, wg, dg, amax_dg)):  # up first, as autograd's engine
            da, db, pts_d = nvfp4_dual_quantize_given_amax(d, q.rht_operand(d.device), amax, rht=q.rht,
                                                           stochastic=q.stochastic_rounding)
            gx = emulated_mm(Quantized(da, pts_d[0]), dgrad_operand(k, q, w), ctx.x_dtype) if needs[0] else None
            gw = emulated_mm(Quantized(db, pts_d[1]).t(), Quantized(xb, pts_x[1]).t(), w.dtype) if needs[1 + k] \
                else None
            grads[k] = (gx, gw)
        grad_x = (grads[1][0] + grads[0][0]).reshape(ctx.x_shape) if needs[0] else None
        return (grad_x, grads[0][1], grads[1][1], grad_wd) + (None,) * (3 + 12)


def _fused_swiglu_mlp_forward(self, x):
    """LlamaMLP.forward as NVFP4SwiGLUMLPFn where the three layers take the fused path and no hooks watch them (the
    numerics probe samples each layer through forward hooks, which the fused function would bypass); else gate and up
    sharing their input's quantization (NVFP4SharedInputFn) or each its own: the layers' values."""
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    if (gate._fused_path(x) and up._fused_path(x) and down._fused_path(x)
            and not any(has_hooks(m) for m in (gate, up, down))):
        cached = [c for m in (gate, up, down) for c in (m._cached("fused") or (None,) * 4)]
        return NVFP4SwiGLUMLPFn.apply(x, gate.weight, up.weight, down.weight, gate.quantizer, up.quantizer,
                                      down.quantizer, *cached)
    return _shared_input_mlp_forward(self, x)


def fuse_swiglu_mlp(block) -> int:
    """In a Llama decoder block whose MLP has a SiLU activation and gate, up and down projections that are emulated
    NVFP4 linears without biases, with one transform (rht and its signs) and one rounding of gradients: the MLP runs
    as NVFP4SwiGLUMLPFn where the fused path runs (CUDA, BF16, token count a multiple of 16), gate and up sharing their
    input's quantization elsewhere. Returns 1 if set up so, else 0 (another MLP class or activation, biases, a layer
    kept in BF16, gate and up fused into one linear, quantizers that differ)."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = getattr(block, "mlp", None)
    if type(mlp) is not LlamaMLP or getattr(mlp, "_plab_fused_swiglu", False) or getattr(mlp, "_plab_shared_input",
                                                                                           False):
        return 0
    layers = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, NVFP4EmulatedLinear) and m.bias is None for m in layers):
        return 0
    if not isinstance(mlp.act_fn, (torch.nn.SiLU, SiLUActivation)):
        return 0
    qs = [m.quantizer for m in layers]
    if any(q.rht != qs[0].rht or not torch.equal(q.signs, qs[0].signs)
           or q.stochastic_rounding != qs[0].stochastic_rounding for q in qs):
        return 0
    mlp.forward = _fused_swiglu_mlp_forward.__get__(mlp)
    mlp._plab_fused_swiglu = True
    return 1


# Inductor setting for a compiled step with NVFP4 layers on the fused path (inductor_settings).
FLEXIBLE_USER_KERNELS = {"triton_kernel_default_layout_constraint": "flexible_layout"}


def keeps_row_stride(width: int, itemsize: int = 2) -> bool:
    """Whether inductor leaves the row stride of a buffer `width` elements wide as it is: its comprehensive padding
    (on by default on GPUs) rounds a stride above `padding_stride_threshold` elements that is not a multiple of
    `padding_alignment_bytes` up to one (`ir.Layout._pad_strides`). A buffer of more dimensions whose outer stride is
    padded has no 2D view of uniform rows; inductor then hands a user kernel a copy, whose rows keep this width."""
    from torch._inductor import config

    return (not config.comprehensive_padding or width <= config.padding_stride_threshold
            or (width * itemsize) % config.padding_alignment_bytes == 0)


def inductor_settings(model: torch.nn.Module, on_cuda: bool) -> dict:
    """The inductor settings a compiled step with this model's NVFP4 layers runs under (NVFP4Recipe.inductor_settings;
    training.train applies them around its loop): `FLEXIBLE_USER_KERNELS` where the fused quantizers run, else {}.

    The fused quantizer (nvfp4_triton, a torch.library.triton_op) is two Triton kernels that both read the operand:
    the amax pass, then the quantize pass. Under inductor's default for user kernels ("needs_fixed_stride_order"),
    an operand that a fused pointwise kernel produces (the RMSNorm output, SwiGLU's h, its backward's dL/dgate and
    dL/dup) is not stored yet when the two kernels' inputs are lowered, so each kernel gets a copy of its own in the
    traced strides (`ExternKernel.require_exact_strides` -> `copy_input`) and the producing kernel stores the same
    values twice: five kernels of the 1b step, ~5 GB a step. With "flexible_layout" the producer's buffer is stored
    once and both kernels read it (bench/NOTES_floor.md 84: the same losses, ~1.1-1.5 ms a 1b step on an H200).

    The kernels take the row stride traced at compile time as a constant, so the buffer inductor allocates must keep
    it: every NVFP4 layer on the fused path must have in and out features that padding leaves alone
    (`keeps_row_stride`: up to 1024, or multiples of 64 BF16 elements, under inductor's defaults; Llama's widths are);
    where one does not, {} (each kernel takes its copy in the traced strides, as before). {} on CPU and without fused layers."""
    from training.precision import nvfp4_triton

    layers = [m for m in model.modules() if isinstance(m, NVFP4EmulatedLinear) and m.quantizer.fused]
    if not (on_cuda and nvfp4_triton.HAVE_TRITON and layers):
        return {}
    if all(keeps_row_stride(w) for m in layers for w in (m.in_features, m.out_features)):
        return dict(FLEXIBLE_USER_KERNELS)
    return {}


def fused_weight_operands(q: NVFP4Quantizer, w: torch.Tensor) -> tuple[Quantized, Quantized | None]:
    """W's Fprop operand on the fused path (BF16), and its Dgrad operand where that is the same quantization
    transposed (16x16 tiles); None: 1x16 blocks along the other dimension, quantized when Dgrad needs them."""
    f = q.weight_fprop(w, dtype=torch.bfloat16)
    return f, (f.t() if q.weight_2d else None)


class NVFP4EmulatedGemmOps(EmulatedTorchaoOps):
    """NVFP4 without its tensor cores. With quantization, the quantizers of NVFP4EmulatedLinear: on CUDA (fused
    option on, Triton present) X and dY through the fused kernel that writes both layouts in one pass (BF16
    tensors whose token count is a multiple of 16) and W quantized once for Fprop and Dgrad (16x16 tiles);
    elsewhere the torch quantizers of EmulatedLinearFn."""

    def _fused(self) -> bool:
        from training.precision import nvfp4_triton

        return self.device.type == "cuda" and self.training.fused and nvfp4_triton.HAVE_TRITON

    def quantizer(self, role, compiled=False):
        torch_path = super().quantizer(role, compiled)
        q: NVFP4Quantizer = self.training
        if not self._fused() or (role == "weight" and not q.weight_2d):
            return torch_path
        if role == "weight":  # the tile quantization Fprop makes is the one Dgrad reads (transposed)
            def weight_once(w, layouts):
                wq = torch_path(w, ("row",))[0]
                return tuple(wq if layout == "row" else wq.t() for layout in layouts)
            return weight_once

        def fused(x, layouts):
            if x.dtype != torch.bfloat16 or x.shape[0] % BLOCK:
                return torch_path(x, layouts)
            from training.precision.nvfp4_triton import nvfp4_dual_quantize

            a, b, pts = nvfp4_dual_quantize(x, q.rht_operand(x.device), rht=q.rht,
                                            stochastic=q.stochastic_rounding and role == "grad_output")
            both = {"row": Quantized(a, pts[0]), "t": Quantized(b, pts[1]).t()}
            return tuple(both[layout] for layout in layouts)
        return fused

    def quantizer_note(self, compiled):
        note = super().quantizer_note(compiled)
        return f"fused Triton quantizers for X and dY; {note}" if self._fused() else note


def torchao_nvfp4(real: bool) -> TorchaoBlockScaled:
    """torchao's NVFP4 operands (`NVFP4Tensor.to_nvfp4`, 16-element blocks, per-tensor scale) and GEMM."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    dispatch = None
    if real:
        from torchao.prototype.mx_formats.nvfp4_tensor import _addmm_nvfp4_dispatch as dispatch
    return TorchaoBlockScaled(
        "NVFP4Tensor.to_nvfp4", BLOCK,
        lambda x: NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max())), dispatch)


@register
class NVFP4Recipe(Recipe):
    name = "nvfp4"
    gemm_error_bound = 0.25  # E2M1 ≈ 0.13

    def real_unavailable(self, device, options):
        reason = capability_reason(device, self.min_capability, "NVFP4 tensor cores")
        if reason is None and not (options["rht"] and options["stochastic_rounding"] and options["weight_2d"]):
            return "torchao's NVFP4 kernels always apply RHT, stochastic rounding and 2D weights; ablations are emulated"
        if reason is None:
            try:
                from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear  # noqa: F401
            except Exception as exc:
                return f"torchao NVFP4Linear failed to import: {exc}"
        return reason

    def skip_reason(self, linear, real):
        for what, dim in (("in_features", linear.in_features), ("out_features", linear.out_features)):
            if dim % BLOCK:
                return f"{what} {dim} not a multiple of {BLOCK} required by nvfp4"
        return None

    @staticmethod
    def make_quantizer(options: dict, device) -> NVFP4Quantizer:
        return NVFP4Quantizer(rht=options["rht"], stochastic_rounding=options["stochastic_rounding"],
                              weight_2d=options["weight_2d"], rht_seed=options["rht_seed"], device=device,
                              fused=options["fused_quantize"])

    def convert(self, linear, name, options, real):
        quantizer = self.make_quantizer(options, linear.weight.device)
        if real:
            from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

            signs = tuple(int(s) for s in quantizer.signs.tolist())
            return (NVFP4Linear.from_linear(linear, rht_sign_vector=signs), quantizer,
                    "torchao NVFP4Linear (RHT, SR, 2D weights)")
        fused = " (fused Triton quantizers on CUDA)" if quantizer.fused else ""
        return (NVFP4EmulatedLinear(linear, quantizer, self.name), quantizer,
                f"emulated: {quantizer.describe()}{fused}")

    shared_note = ("linears reading the same input quantize it once where the fused kernels run (MLP gate and up), "
                   "and with fused_swiglu the MLP's SwiGLU and its backward each run as one Triton pass that also "
                   "takes the maxima the next quantization needs")

    def share_inputs(self, block, options: dict, real: bool) -> int:
        if real or not options["fused_quantize"]:
            return 0
        if options["fused_swiglu"] and options["share_mlp_input"] and fuse_swiglu_mlp(block):
            return 1
        return share_mlp_input(block) if options["share_mlp_input"] else 0

    def inductor_settings(self, model, on_cuda):
        return inductor_settings(model, on_cuda)

    def gemm_ops(self, device):
        real = has_capability(device, self.min_capability)
        torchao = torchao_nvfp4(real)
        if real:
            return TorchaoBlockScaledOps(self.name, device, self.gemm_error_bound, torchao)
        quantizer = self.make_quantizer(self.resolve_options({}), device)
        return NVFP4EmulatedGemmOps(self.name, device, self.gemm_error_bound, quantizer, torchao)

"""`fp8_delayed`: FP8 with delayed per-tensor scaling (Transformer Engine's DelayedScaling; torchao
removed it in 2025, so it is ours).

X and W in E4M3, dY in E5M2. Each converted layer keeps, per operand, an amax history of the last
`amax_history_len` steps (default 1024). The scale used at step t is 448 (57344 for E5M2) divided by
the max of the history up to step t-1; during step t the layer records the amaxes it sees (max over
micro-batches), and `DelayedScalingHook.post_optimizer_step` pushes them into the history and derives
the next scales (one batched update for all layers). The first step has no history and falls back to
the current amax. Values above the stale scale's range saturate (that is the recipe's known risk;
telemetry's saturation_frac shows it).

Each operand's amax is computed once per step: X's and W's in the layer's forward (recorded into the
pending amaxes and, before the history exists, turned into the just-in-time scale), dY's once in the
backward. Everything on the step path is tensor ops with no host synchronisation, so torch.compile
traces the layer into the model's graph without breaks: the forward's record is a module-level in-place
update of a buffer (functionalized by AOTAutograd); the backward hands dY's amax out as the gradient of
a per-layer scalar leaf, `grad_amax_token` (plain autograd, so the compiled backward just returns it;
an in-place record from inside the backward needed a Python custom op, ~0.17 ms of host time per layer
and step). `DelayedScalingHook.post_backward` folds those gradients into the pending amaxes (max over
micro-batches) after each backward; `post_optimizer_step` and `update_scales` fold whatever is left.
History, scales and pending amaxes are non-persistent buffers; they travel in checkpoints through the
hook's state_dict, not through the HF weights.

Real kernels: `torch._scaled_mm` on sm_89+ (row-major first operand, column-major second, as torchao's
float8 path): Fprop with fast accumulation, Dgrad and Wgrad without, each writing its output dtype
directly (activation dtype for Y and dX, the weight's dtype for dW). Backward reuses the FP8 copies of
X and W saved in forward (per-tensor scaling is transpose-invariant); the column-major operands it needs
are transposed FP8 copies (1 byte per element). Elsewhere (CPU, pre-Ada GPUs, token counts not divisible
by 16) the same casts feed the exact emulation of emulation.py.

Option `one_pass_cast` (on by default; real GEMMs with inductor's casts): each operand's amax is reduced along its
rows, then over them (the same value), which is the loop shape of its row-major cast, so inductor records the amax
in the cast's own pass (from the kernel that produces the operand: RMSNorm, SwiGLU and its backward); the
transposed layouts Wgrad and Dgrad read are copied from the 1-byte codes by a Triton kernel the compiler does not
inline (fp8_triton.fp8_transpose), and X and W are saved in that layout. Without it inductor wrote both layouts from
the BF16 operand in a 2D-tiled kernel that cannot hold a row reduction, and ran a separate amax pass over the
operand (torch 2.11; one H100, 1b step: 91.7 against 95.5 ms, bench/NOTES_floor.md 47). Same codes, amaxes and
GEMMs, so the training is the same (the tests, eager and compiled).

Option `fused_cast` (off by default): once the history exists, the real path casts each operand with one
fused Triton pass (fp8_triton.py): X, W and dY are each read once, their amax recorded and their FP8 codes
written in both layouts the GEMMs read (DelayedFP8FusedFn); codes bit-identical with the torch casts, the GEMMs
see the same operands in the same layouts, so the training is the same. Off because it measured slower in
the compiled step on an H100 (bench/results/step_profile_*: 16.5 ms per 1b step in the cast kernels, where
inductor's casts, fused into the kernels that produce X and dY, cost ~10 ms): a standalone pass must read a
materialized BF16 operand that a fused cast never writes.
"""
from __future__ import annotations

import torch
from torch import nn

from training.precision import emulation
from training.precision.emulation import GemmQuantizer, QuantizedLinear, compute_dtype, emulated_mm, has_hooks
from training.precision.formats import (FP8_AMAX_EPS, Quantized, fp8_cast, fp8_scale_from_amax,
                                        quantize_fp8_tensorwise)
from training.precision.gemm_ops import scaled_mm_shape_reason
from training.precision.registry import Recipe, capability_reason, register

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INPUT, WEIGHT, GRAD = 0, 1, 2
OPERAND_DTYPES = (E4M3, E4M3, E5M2)
OPERAND_MAX = tuple(float(torch.finfo(d).max) for d in OPERAND_DTYPES)
STATE_BUFFERS = ("amax_history", "pending_amax", "scales", "history_ready")


class DelayedQuantizer(GemmQuantizer):
    """Per-tensor FP8 with the layer's current delayed scales, for numerics telemetry: it observes
    without feeding the amax history (the training GEMMs run in DelayedFP8Fn)."""

    def __init__(self, layer: "DelayedScalingLinear"):
        self.layer = layer  # the quantizer is not a Module, so this back-reference adds no submodule

    def _q(self, t, which, dtype=torch.float32, track=False):
        scale = self.layer.effective_scale(which, t.detach().abs().amax())
        return quantize_fp8_tensorwise(t, OPERAND_DTYPES[which], scale=scale, dtype=dtype, track=track)

    def input(self, x2d, *, dtype=torch.float32, track=False):
        return self._q(x2d, INPUT, dtype, track)

    def weight_fprop(self, w, *, dtype=torch.float32, track=False):
        return self._q(w, WEIGHT, dtype, track)

    def weight_dgrad(self, w, *, dtype=torch.float32, track=False):
        return self._q(w, WEIGHT, dtype, track).t()

    def grad(self, dy2d, *, dtype=torch.float32, track=False):
        return self._q(dy2d, GRAD, dtype, track)

    def grad_wgrad(self, dy2d, *, dtype=torch.float32):
        return self._q(dy2d, GRAD, dtype).t()

    def input_wgrad(self, x2d, *, dtype=torch.float32):
        return self._q(x2d, INPUT, dtype).t()

    def describe(self):
        return f"E4M3 X/W, E5M2 dY, per-tensor delayed scaling (history {self.layer.amax_history.shape[1]})"


def _to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return fp8_cast(t, scale, dtype)[0]


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what torch._scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


def _amax(t: torch.Tensor, by_rows: bool) -> torch.Tensor:
    """max |t| in FP32 (exact either way). by_rows: as a reduction along each row, then over the rows, the shape
    of the row-major cast's loop, so the compiler can compute it in the cast's own pass (`one_pass_cast`)."""
    a = t.detach().abs()
    return (a.amax(dim=-1).amax() if by_rows and a.dim() == 2 else a.amax()).to(torch.float32)


def _fp8_mm(real: bool, a8, inv_a, b8, inv_b, out_dtype, *, fast_accum: bool, bias=None) -> torch.Tensor:
    """a8 @ b8 (+ bias) with per-tensor scales. Real: torch._scaled_mm, the bias added in the output dtype
    (as torchao's Float8Linear). Emulated: the exact emulation of emulation.py (FP8 codes are exact in
    BF16: BF16 GEMM on GPU, FP32 on CPU), the bias added to the scaled result before its rounding."""
    if real:
        out = torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
        return out if bias is None else out + bias.to(out_dtype)
    dtype = emulation.gemm_dtype(a8)
    return emulated_mm(Quantized(a8.to(dtype), inv_a), Quantized(b8.to(dtype).t(), inv_b), out_dtype, bias)


class DelayedFP8Fn(torch.autograd.Function):
    """The three FP8 GEMMs of a linear with delayed scales. Forward gets the X and W scales (from the
    history, or just in time on the first step); backward computes dY's amax once, returns it as the
    gradient of `token` (the layer's grad_amax_token; None when not recording) and takes dY's scale from
    the same `scales`/`ready` buffers. With `scales` and `ready` None it is current scaling throughout
    (fp8_tensorwise's CurrentScalingLinear): the caller's X and W scales, dY's from its own amax."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x2, weight, bias, s_x, s_w, scales, ready, token, real: bool, out_dtype,
                ready_host: bool = False, one_pass: bool = False, w8_given=None, w8t_given=None):
        x8 = _to_fp8(x2, s_x, E4M3)
        w8 = _to_fp8(weight, s_w, E4M3) if w8_given is None else w8_given
        inv_x, inv_w = s_x.reciprocal(), s_w.reciprocal()
        y = _fp8_mm(real, x8, inv_x, w8.t(), inv_w, out_dtype, fast_accum=True, bias=bias)
        # The FP8 copies are what backward needs (1 byte per element instead of the activation's 2-4). With
        # one_pass (real GEMMs) the transposed layouts Wgrad and Dgrad read are copied from the codes here, or
        # W's comes with its codes (w8t_given: both written by one pass over W).
        ctx.from_codes = one_pass and real
        if ctx.from_codes:
            from training.precision.fp8_triton import fp8_transpose

            x8, w8 = fp8_transpose(x8), fp8_transpose(w8) if w8t_given is None else w8t_given
        ctx.save_for_backward(x8, w8, inv_x, inv_w, scales, ready)
        ctx.real, ctx.ready_host, ctx.by_rows = real, ready_host, one_pass
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        x8, w8, inv_x, inv_w, scales, ready = ctx.saved_tensors  # x8, w8 transposed under from_codes
        dy2 = dy.reshape(-1, dy.shape[-1])
        amax = _amax(dy2, ctx.by_rows)
        # Once the history exists (known on the host), dY's scale does not depend on dY: the cast need not
        # wait for the amax reduction, and the compiler may fuse both into one pass over dY. No history at all
        # (`ready` None: fp8_tensorwise's CurrentScalingLinear): the current amax's scale.
        if ready is None:
            s_g = fp8_scale_from_amax(amax, E5M2)
        elif ctx.ready_host:
            s_g = scales[GRAD]
        else:
            s_g = torch.where(ready, scales[GRAD], fp8_scale_from_amax(amax, E5M2))
        g8 = _to_fp8(dy2, s_g, E5M2)
        inv_g = s_g.reciprocal()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w8_second = w8.t() if ctx.from_codes else _col_major(w8) if ctx.real else w8
            grad_x = _fp8_mm(ctx.real, g8, inv_g, w8_second, inv_w, ctx.x_dtype, fast_accum=False)
        if ctx.needs_input_grad[1]:
            if ctx.from_codes:  # real GEMMs, X saved transposed
                from training.precision.fp8_triton import fp8_transpose

                grad_w = _fp8_mm(True, fp8_transpose(g8), inv_g, x8.t(), inv_x, ctx.w_dtype, fast_accum=False)
            elif ctx.real:
                grad_w = _fp8_mm(True, g8.t().contiguous(), inv_g, _col_major(x8), inv_x, ctx.w_dtype,
                                 fast_accum=False)
            else:
                grad_w = _fp8_mm(False, g8.t(), inv_g, x8, inv_x, ctx.w_dtype, fast_accum=False)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = dy2.to(torch.float32).sum(0).to(ctx.bias_dtype)
        grad_token = amax if ctx.needs_input_grad[7] else None
        return grad_x, grad_w, grad_b, None, None, None, None, grad_token, None, None, None, None, None, None


class DelayedFP8FusedFn(torch.autograd.Function):
    """DelayedFP8Fn's real path once the scales come from the history, with the operands cast outside (X and W
    in the layer's forward, by fp8_triton.fp8_cast_transpose, each in both layouts) and dY cast the same way in
    backward. `x2` and `weight` only route the gradients (their values are not saved)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x2, weight, bias, x8, x8t, w8, w8t, scales, token, out_dtype):
        inv_x, inv_w = scales[INPUT].reciprocal(), scales[WEIGHT].reciprocal()
        y = _fp8_mm(True, x8, inv_x, w8.t(), inv_w, out_dtype, fast_accum=True, bias=bias)
        ctx.save_for_backward(x8t, w8t, inv_x, inv_w, scales)
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        from training.precision.fp8_triton import fp8_cast_transpose

        x8t, w8t, inv_x, inv_w, scales = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        g8, g8t, amax = fp8_cast_transpose(dy2, scales[GRAD], E5M2)
        inv_g = scales[GRAD].reciprocal()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _fp8_mm(True, g8, inv_g, w8t.t(), inv_w, ctx.x_dtype, fast_accum=False)
        if ctx.needs_input_grad[1]:
            grad_w = _fp8_mm(True, g8t, inv_g, x8t.t(), inv_x, ctx.w_dtype, fast_accum=False)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = dy2.to(torch.float32).sum(0).to(ctx.bias_dtype)
        grad_token = amax if ctx.needs_input_grad[8] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, grad_token, None


def _current_scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Current scaling's scale for `t`: FP8 max / max |t| (the amax reduced along rows, then over them)."""
    return fp8_scale_from_amax(_amax(t, True), dtype)


class DelayedSwiGLUMLPFn(torch.autograd.Function):
    """A Llama MLP, down(silu(gate(x)) * up(x)), with real FP8 GEMMs and the history's scales (`fused_swiglu`):
    the six GEMMs and the X, W and dY casts of DelayedFP8Fn's real one-pass path, operand for operand, except that
    - the activation and its backward each run as one Triton pass (fp8_swiglu_triton) that writes the FP8 codes in
      both layouts the next GEMMs read and the amax, where inductor wrote the row-major codes and a second kernel
      re-read them for the transposed layout;
    - each weight is cast in one pass that writes both layouts and its amax (fp8_triton.fp8_cast_transpose), where
      the amax-and-cast kernel was followed by a copy of the codes into the Dgrad layout;
    - X is cast (and copied into the Wgrad layout) once, with gate's input scale, for gate and up: the two layers
      record the same amax of the same X every step from the same empty history, so their input scales are equal.
    Forward returns (y, max |h|, the three weights' max |W|) (h: down's input); backward returns each layer's dY
    amax as the gradient of its token.

    With the scales None it is current scaling (fp8_tensorwise's CurrentScalingLinear layers, `fused_swiglu`): X's,
    each W's and dY's scale from its own amax, as the layers' path takes them; h's, dL/dgate's and dL/dup's from a
    first pass of the SwiGLU kernel that computes only their amaxes (fp8_swiglu_triton.swiglu_amax), then the codes
    pass with those scales. The tokens are None then (nothing is recorded)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x2, w_gate, w_up, w_down, sc_gate, sc_up, sc_down, tok_gate, tok_up, tok_down, out_dtype):
        from training.precision.fp8_swiglu_triton import swiglu_amax, swiglu_fp8_fwd

        weights = (w_gate, w_up, w_down)
        current = sc_gate is None
        if current:
            s_x, s_ws = _current_scale(x2, E4M3), tuple(_current_scale(w, E4M3) for w in weights)
        else:
            s_x, s_ws = sc_gate[INPUT], tuple(sc[WEIGHT] for sc in (sc_gate, sc_up, sc_down))
        x8, x8t, inv_x, ((wg8, wg8t, amax_wg, inv_wg), (wu8, wu8t, amax_wu, inv_wu), (wd8, wd8t, amax_wd, inv_wd)) = (
            _one_pass_operands(x2, s_x, tuple(zip(weights, s_ws))))
        g = _fp8_mm(True, x8, inv_x, wg8.t(), inv_wg, out_dtype, fast_accum=True)
        u = _fp8_mm(True, x8, inv_x, wu8.t(), inv_wu, out_dtype, fast_accum=True)
        s_h = fp8_scale_from_amax(swiglu_amax(g, u), E4M3) if current else sc_down[INPUT]
        h8, h8t, amax_h = swiglu_fp8_fwd(g, u, s_h)
        inv_h = s_h.reciprocal()
        y = _fp8_mm(True, h8, inv_h, wd8.t(), inv_wd, out_dtype, fast_accum=True)
        ctx.save_for_backward(x8t, wg8t, wu8t, g, u, h8t, wd8t, inv_x, inv_wg, inv_wu, inv_h, inv_wd,
                              sc_gate, sc_up, sc_down)
        ctx.current = current
        ctx.x_dtype, ctx.h_dtype = x2.dtype, g.dtype
        ctx.w_dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
        amax_w = torch.stack([amax_wg, amax_wu, amax_wd])
        ctx.mark_non_differentiable(amax_h, amax_w)
        return y, amax_h, amax_w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy, _grad_amax_h, _grad_amax_w):
        from training.precision.fp8_swiglu_triton import swiglu_amax, swiglu_fp8_bwd
        from training.precision.fp8_triton import fp8_transpose

        (x8t, wg8t, wu8t, g, u, h8t, wd8t, inv_x, inv_wg, inv_wu, inv_h, inv_wd, sc_gate, sc_up,
         sc_down) = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        amax_dy = _amax(dy2, True)
        s_dy = fp8_scale_from_amax(amax_dy, E5M2) if ctx.current else sc_down[GRAD]
        gd8, inv_gd = _to_fp8(dy2, s_dy, E5M2), s_dy.reciprocal()
        dh = _fp8_mm(True, gd8, inv_gd, wd8t.t(), inv_wd, ctx.h_dtype, fast_accum=False)
        dw_down = _fp8_mm(True, fp8_transpose(gd8), inv_gd, h8t.t(), inv_h, ctx.w_dtypes[2], fast_accum=False)
        if ctx.current:
            s_dg, s_du = (fp8_scale_from_amax(a, E5M2) for a in swiglu_amax(g, u, dh))
        else:
            s_dg, s_du = sc_gate[GRAD], sc_up[GRAD]
        dg8, dg8t, amax_dg, du8, du8t, amax_du = swiglu_fp8_bwd(g, u, dh, s_dg, s_du)
        inv_dg, inv_du = s_dg.reciprocal(), s_du.reciprocal()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (_fp8_mm(True, dg8, inv_dg, wg8t.t(), inv_wg, ctx.x_dtype, fast_accum=False)
                  + _fp8_mm(True, du8, inv_du, wu8t.t(), inv_wu, ctx.x_dtype, fast_accum=False))
        dw_gate = _fp8_mm(True, dg8t, inv_dg, x8t.t(), inv_x, ctx.w_dtypes[0], fast_accum=False)
        dw_up = _fp8_mm(True, du8t, inv_du, x8t.t(), inv_x, ctx.w_dtypes[1], fast_accum=False)
        tokens = tuple(a if ctx.needs_input_grad[7 + i] else None for i, a in enumerate((amax_dg, amax_du, amax_dy)))
        return (dx, dw_gate, dw_up, dw_down, None, None, None, *tokens, None)


def _weight_both_layouts(w: torch.Tensor, scale: torch.Tensor):
    """(w8, w8 transposed, max |W|) in one pass over W on a GPU with Triton (fp8_cast_transpose; its codes and amax
    equal the torch cast's and `_amax`'s); elsewhere by those torch ops and a copy."""
    from training.precision import fp8_triton

    if fp8_triton.HAVE_TRITON and w.is_cuda:
        return fp8_triton.fp8_cast_transpose(w.detach(), scale, E4M3)
    w8 = _to_fp8(w, scale, E4M3)
    return w8, w8.t().contiguous(), _amax(w, True)


def _one_pass_operands(x2: torch.Tensor, s_x: torch.Tensor, weights):
    """The operands of DelayedFP8Fn's real one-pass path, for the fused functions (DelayedSwiGLUMLPFn,
    DelayedQKVRoPEFn): X's E4M3 codes with scale `s_x`, their copy in the Wgrad layout and 1 / s_x; for each (W, its
    scale s_w) in `weights`: (W's codes in both layouts, max |W|, 1 / s_w)."""
    from training.precision.fp8_triton import fp8_transpose

    x8 = _to_fp8(x2, s_x, E4M3)
    per_weight = tuple((*_weight_both_layouts(w, s_w), s_w.reciprocal()) for w, s_w in weights)
    return x8, fp8_transpose(x8), s_x.reciprocal(), per_weight


def _fused_swiglu_mlp_forward(self, x):
    """LlamaMLP.forward on the fused SwiGLU path (DelayedSwiGLUMLPFn) where it applies, else the three layers' own
    forwards (hooks; odd token counts; fp8_delayed's first step, before the history exists). fp8_delayed's layers
    pass their history's scales and record their amaxes; fp8_tensorwise's CurrentScalingLinear layers run it with
    current scaling (scales None, nothing recorded)."""
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    out_dtype = compute_dtype(x)
    x2 = x.reshape(-1, x.shape[-1])
    if not (gate.fused_ready and up.fused_ready and down.fused_ready and x2.shape[0] % 16 == 0
            and not any(has_hooks(m) for m in (gate, up, down))):
        return down(self.act_fn(gate(x)) * up(x))
    if x2.dtype != out_dtype:
        x2 = x2.to(out_dtype)
    delayed = isinstance(gate, DelayedScalingLinear)
    record = delayed and self.training and torch.is_grad_enabled()
    tokens = (gate.grad_amax_token, up.grad_amax_token, down.grad_amax_token) if record else (None,) * 3
    scales = (gate.scales, up.scales, down.scales) if delayed else (None,) * 3
    y, amax_h, amax_w = DelayedSwiGLUMLPFn.apply(x2, gate.weight, up.weight, down.weight, *scales, *tokens,
                                                 out_dtype)
    if record:
        amax_x = _amax(x2, True)
        for i, (layer, amax_in) in enumerate(((gate, amax_x), (up, amax_x), (down, amax_h))):
            layer.record_amax(amax_in, amax_w[i])
    return y.reshape(*x.shape[:-1], down.out_features)


def fusable_delayed(layer) -> bool:
    """A layer the fused functions take with the history's scales: a real fp8_delayed layer with the one-pass casts
    (no fused_cast) and no bias."""
    return (isinstance(layer, DelayedScalingLinear) and layer.real and layer.one_pass_cast and not layer.fused_cast
            and layer.bias is None)


def fuse_swiglu_mlp(block, fusable=fusable_delayed) -> int:
    """In a Llama decoder block whose MLP's gate, up and down projections are all `fusable` layers (by default real
    fp8_delayed layers with the one-pass casts, no fused_cast, no biases; fp8_tensorwise passes its own test) and a
    SiLU activation: the MLP runs as DelayedSwiGLUMLPFn where the layers' `fused_ready` says so (fp8_delayed: once
    the amax history exists). Returns 1 if set up so, else 0 (gate and up fused into one linear, a layer kept in
    BF16, another MLP class or activation, emulated GEMMs)."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = getattr(block, "mlp", None)
    if type(mlp) is not LlamaMLP or getattr(mlp, "_plab_fused_swiglu", False):
        return 0
    layers = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(fusable(m) for m in layers) or len({type(m) for m in layers}) != 1:
        return 0
    if not isinstance(mlp.act_fn, (nn.SiLU, SiLUActivation)):
        return 0
    mlp.forward = _fused_swiglu_mlp_forward.__get__(mlp)
    mlp._plab_fused_swiglu = True
    return 1


class DelayedQKVRoPEFn(torch.autograd.Function):
    """A fused QKV projection (model.fuse_qkv) and RoPE, with a real FP8 GEMM and the history's scales
    (`fused_qkv_rope`): DelayedFP8Fn's real one-pass path operand for operand (X cast once and copied into the Wgrad
    layout, W in both layouts and its amax from one pass), then HF's `apply_rotary_pos_emb` on the GEMM's [batch,
    tokens, heads, head_dim] layout. Backward receives dQ, dK and dV and runs RoPE's backward, their concatenation
    and the E5M2 cast in one Triton pass that writes both layouts and the amax (fp8_rope_triton), where the layers'
    path had inductor's kernel write the row-major codes twice and a second kernel copy them into the Wgrad layout.
    Forward returns (q, k, v, max |W|), each of q, k, v [batch, tokens, heads, head_dim]; backward returns dY's amax
    as the gradient of the layer's token. With SDPA's fused attention kernels (cuDNN, the step's; flash) dQ, dK and dV
    are the attention op's BF16 outputs and the codes, GEMMs and amaxes are the layer's path's to the bit
    (tests/precision/test_fused_qkv_rope_gpu.py). Where the attention's backward ends in a pointwise op (eager
    attention's softmax scale, SDPA's math backend) inductor fuses that op into the layer path's cast without rounding
    its product to BF16, while this function receives the rounded gradient: the codes differ in the last bit there.

    With `scales` None it is current scaling (fp8_tensorwise's CurrentScalingLinear, `fused_qkv_rope`): X's and W's
    scales from their amaxes, as the layer's path takes them, and dY's from a first pass of the RoPE kernel that
    computes only the amax (fp8_rope_triton.rope_bwd_amax); `token` is None then. The codes are cast from dY rounded
    to BF16, as the layer's compiled path casts them under current scaling (`rope_bwd_fp8`'s `rounded`)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x2, weight, scales, token, cos, sin, batch: int, n_q: int, n_kv: int, out_dtype):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if scales is None:
            s_x, s_w = _current_scale(x2, E4M3), _current_scale(weight, E4M3)
        else:
            s_x, s_w = scales[INPUT], scales[WEIGHT]
        x8, x8t, inv_x, ((w8, w8t, amax_w, inv_w),) = _one_pass_operands(x2, s_x, ((weight, s_w),))
        y = _fp8_mm(True, x8, inv_x, w8.t(), inv_w, out_dtype, fast_accum=True)
        head_dim = cos.shape[-1]
        q, k, v = y.view(batch, -1, n_q + 2 * n_kv, head_dim).split([n_q, n_kv, n_kv], dim=2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        ctx.save_for_backward(x8t, w8t, inv_x, inv_w, scales, cos, sin)
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weight.dtype
        ctx.mark_non_differentiable(amax_w)
        return q, k, v, amax_w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dq, dk, dv, _grad_amax_w):
        from training.precision.fp8_rope_triton import rope_bwd_amax, rope_bwd_fp8

        x8t, w8t, inv_x, inv_w, scales, cos, sin = ctx.saved_tensors
        current = scales is None
        s_g = fp8_scale_from_amax(rope_bwd_amax(dq, dk, dv, cos, sin), E5M2) if current else scales[GRAD]
        g8, g8t, amax = rope_bwd_fp8(dq, dk, dv, cos, sin, s_g, rounded=current)
        inv_g = s_g.reciprocal()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _fp8_mm(True, g8, inv_g, w8t.t(), inv_w, ctx.x_dtype, fast_accum=False)
        if ctx.needs_input_grad[1]:
            dw = _fp8_mm(True, g8t, inv_g, x8t.t(), inv_x, ctx.w_dtype, fast_accum=False)
        return dx, dw, None, amax if ctx.needs_input_grad[3] else None, None, None, None, None, None, None


def _delayed_qkv_rope(attn, hidden_states, cos, sin):
    """The fused-QKV attention's projection and RoPE on the fused path (DelayedQKVRoPEFn): (q, k, v), each [batch,
    tokens, heads, head_dim]; None where the layer's own path applies (hooks on the layer; token counts not divisible
    by 16; RoPE tables of another shape or dtype; fp8_delayed's first step, before the history exists). An
    fp8_delayed layer passes its history's scales and records its amaxes; fp8_tensorwise's CurrentScalingLinear runs
    it with current scaling."""
    layer = attn.qkv_proj
    x2 = hidden_states.reshape(-1, hidden_states.shape[-1])
    batch, tokens = hidden_states.shape[0], hidden_states.shape[1]
    out_dtype = compute_dtype(hidden_states)
    if not (layer.fused_ready and hidden_states.dim() == 3 and x2.shape[0] % 16 == 0 and not has_hooks(layer)
            and cos.shape == sin.shape and cos.dim() == 3 and cos.shape[0] in (1, batch) and cos.shape[1] == tokens
            and cos.shape[2] == attn.head_dim and cos.dtype == sin.dtype == out_dtype):
        return None
    if x2.dtype != out_dtype:
        x2 = x2.to(out_dtype)
    delayed = isinstance(layer, DelayedScalingLinear)
    record = delayed and layer.training and torch.is_grad_enabled()
    n_q, n_kv = attn.qkv_split[0] // attn.head_dim, attn.qkv_split[1] // attn.head_dim
    q, k, v, amax_w = DelayedQKVRoPEFn.apply(x2, layer.weight, layer.scales if delayed else None,
                                             layer.grad_amax_token if record else None, cos, sin, batch, n_q, n_kv,
                                             out_dtype)
    if record:
        layer.record_amax(_amax(x2, True), amax_w)
    return q, k, v


def fuse_qkv_rope(block, fusable=fusable_delayed) -> int:
    """In a decoder block whose attention has a fused QKV projection (model.fuse_qkv) that is a `fusable` layer (by
    default a real fp8_delayed layer with the one-pass casts, no fused_cast, no bias; fp8_tensorwise passes its own
    test), with equal K and V widths and a power-of-two head_dim: the projection and RoPE run as DelayedQKVRoPEFn
    where the layer's `fused_ready` says so (fp8_delayed: once the amax history exists; the attention's forward asks
    `qkv_rope`). Returns 1 if set up so, else 0."""
    from training.model import _fused_qkv_attention_forward

    attn = getattr(block, "self_attn", None)
    layer = getattr(attn, "qkv_proj", None)
    if layer is None or getattr(attn, "qkv_rope", None) is not None:
        return 0
    if not fusable(layer):
        return 0
    forward = getattr(attn.forward, "__func__", None)
    head_dim = getattr(attn, "head_dim", 0)
    split = getattr(attn, "qkv_split", None)
    if (forward is not _fused_qkv_attention_forward or not split or len(split) != 3 or split[1] != split[2]
            or head_dim < 16 or head_dim & (head_dim - 1) or any(w % head_dim for w in split)):
        return 0
    attn.qkv_rope = _delayed_qkv_rope.__get__(attn)
    return 1


def _new_token(device) -> torch.Tensor:
    return torch.zeros((), device=device, requires_grad=True)


def _advance_history(history: torch.Tensor, pending: torch.Tensor, scales: torch.Tensor):
    """One step of delayed scaling for a batch of layers: history (L, 3, H), pending (L, 3), scales (L, 3)
    -> (new history, new scales). The scale is FP8 max / max(history) with torchao's FP64 division; an
    operand never seen (amax 0, e.g. no backward yet) keeps its previous scale."""
    history = torch.roll(history, shifts=1, dims=-1)
    history[..., 0] = pending
    amax = history.amax(dim=-1)
    # FP8 max per operand row, built on the device (torch.tensor(list) would be a synchronous host copy).
    row = torch.arange(3, device=amax.device)
    fp8_max = torch.where(row == GRAD, OPERAND_MAX[GRAD], OPERAND_MAX[INPUT]).to(torch.float64)
    fresh = (fp8_max / torch.clamp(amax.to(torch.float64), min=FP8_AMAX_EPS)).to(torch.float32)
    return history, torch.where(amax > 0, fresh, scales)


class DelayedScalingLinear(QuantizedLinear):
    def reuses_weight_when(self, compiled: bool) -> bool:
        return False  # W's scale comes from an amax history that every micro-batch updates

    def __init__(self, linear: nn.Linear, history_len: int, real: bool, fused_cast: bool = False,
                 one_pass_cast: bool = True):
        super().__init__(linear, GemmQuantizer(), "fp8_delayed")
        self.fused_cast = fused_cast  # real GEMMs with history: fp8_triton's cast-transpose (else torch casts)
        # Amaxes along rows, then over them (the same values, the row-major cast's loop shape); real GEMMs: the
        # transposed layouts copied from the FP8 codes (catalog option one_pass_cast).
        self.one_pass_cast = one_pass_cast
        device = linear.weight.device
        # Rows: input, weight, grad. Non-persistent: HF checkpoints stay plain; the hook saves them.
        self.register_buffer("amax_history", torch.zeros(3, history_len, device=device), persistent=False)
        self.register_buffer("pending_amax", torch.zeros(3, device=device), persistent=False)
        self.register_buffer("scales", torch.ones(3, device=device), persistent=False)
        self.register_buffer("history_ready", torch.zeros((), dtype=torch.bool, device=device), persistent=False)
        self.quantizer = DelayedQuantizer(self)
        self.real = real
        # dY's amax leaves the backward as this leaf's gradient (not a parameter or buffer: optimizers,
        # DDP and state dicts never see it); fold_grad_amax() moves it into pending_amax.
        self.grad_amax_token = _new_token(device)
        # Host-side copy of `history_ready` (set by the hook, by update_scales and on load): once true the
        # scales come straight from the history, with no data dependence on the current amax, so the FP8
        # cast of X, W and dY can start without waiting for (or be fused with) their amax reductions.
        # torch.compile guards on it: one recompilation after the first step.
        self.ready_host = False

    def _apply(self, fn, recurse=True):
        """Keep the scaling state in FP32 through `.to(dtype)` / `.bfloat16()` (a BF16 copy of the model
        must not round its amax history and scales); device moves apply as usual."""
        state = {key: self._buffers[key] for key in STATE_BUFFERS}
        super()._apply(fn, recurse)
        for key, old in state.items():
            new = self._buffers[key]
            if new is not old and new.dtype != old.dtype:
                self._buffers[key] = old.to(device=new.device)
        device = self.pending_amax.device
        if self.grad_amax_token.device != device:
            self.fold_grad_amax()
            self.grad_amax_token = _new_token(device)
        return self

    @torch.no_grad()
    def fold_grad_amax(self) -> None:
        """pending_amax[GRAD] = max(pending, dY amax of the backwards since the last fold)."""
        grad = self.grad_amax_token.grad
        if grad is not None:
            row = self.pending_amax[GRAD:GRAD + 1]
            row.copy_(torch.maximum(row, grad.reshape(1).to(device=row.device, dtype=row.dtype)))
            self.grad_amax_token.grad = None

    def record_amax(self, amax_x: torch.Tensor, amax_w: torch.Tensor) -> None:
        """pending_amax[INPUT, WEIGHT] = max(pending, this forward's max |X|, max |W|) (dY's comes through
        fold_grad_amax)."""
        pending = self.pending_amax
        pending.copy_(torch.maximum(pending, torch.stack([amax_x, amax_w, pending[GRAD]])))

    @property
    def fused_ready(self) -> bool:
        """Whether the fused functions (fuse_swiglu_mlp, fuse_qkv_rope) run this layer now: once the history exists."""
        return self.ready_host

    def effective_scale(self, which: int, current_amax: torch.Tensor) -> torch.Tensor:
        """The scale used now: from the history once it exists, else just in time from `current_amax`."""
        just_in_time = fp8_scale_from_amax(current_amax, OPERAND_DTYPES[which])
        return torch.where(self.history_ready, self.scales[which], just_in_time)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != out_dtype:
            x2 = x2.to(out_dtype)  # under autocast the kernels see the autocast (BF16) copy
        record = self.training and torch.is_grad_enabled()
        if self.real and self.ready_host and self.fused_cast and x2.is_cuda and x2.shape[0] % 16 == 0:
            from training.precision import fp8_triton

            if fp8_triton.HAVE_TRITON:
                return self._fused_forward(x2, record, out_dtype).reshape(*x.shape[:-1], self.out_features)
        # torch._scaled_mm needs every dim divisible by 16; other token counts take the emulated path.
        real = self.real and x2.shape[0] % 16 == 0
        amax_x = _amax(x2, self.one_pass_cast)
        w8 = w8t = None
        if real and self.one_pass_cast and self.ready_host:  # W's codes in both layouts and its amax, one pass
            w8, w8t, amax_w = _weight_both_layouts(self.weight, self.scales[WEIGHT])
        else:
            amax_w = _amax(self.weight, self.one_pass_cast)
        if record:
            self.record_amax(amax_x, amax_w)
        if self.ready_host:
            s_x, s_w = self.scales[INPUT], self.scales[WEIGHT]
        else:
            s_x = self.effective_scale(INPUT, amax_x)
            s_w = self.effective_scale(WEIGHT, amax_w)
        y = DelayedFP8Fn.apply(x2, self.weight, self.bias, s_x, s_w, self.scales, self.history_ready,
                               self.grad_amax_token if record else None, real, out_dtype, self.ready_host,
                               self.one_pass_cast, w8, w8t)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _fused_forward(self, x2: torch.Tensor, record: bool, out_dtype) -> torch.Tensor:
        from training.precision.fp8_triton import fp8_cast_transpose

        x8, x8t, amax_x = fp8_cast_transpose(x2.detach(), self.scales[INPUT], E4M3)
        w8, w8t, amax_w = fp8_cast_transpose(self.weight.detach(), self.scales[WEIGHT], E4M3)
        if record:
            self.record_amax(amax_x, amax_w)
        return DelayedFP8FusedFn.apply(x2, self.weight, self.bias, x8, x8t, w8, w8t, self.scales,
                                       self.grad_amax_token if record else None, out_dtype)

    @torch.no_grad()
    def update_scales(self) -> None:
        """Push the pending amaxes into the history and derive the next scales (this layer only; the hook
        does all layers at once)."""
        self.fold_grad_amax()
        history, scales = _advance_history(self.amax_history, self.pending_amax, self.scales)
        self.amax_history.copy_(history)
        self.scales.copy_(scales)
        self.history_ready.fill_(True)
        self.ready_host = True
        self.pending_amax.zero_()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, recipe=fp8_delayed, "
                f"history={self.amax_history.shape[1]}, real={self.real}")


class DelayedScalingHook:
    """Advances every delayed-scaling layer's amax history after each optimizer step; its state_dict is
    what a checkpoint must carry for a resumed run to use the same scales."""

    def __init__(self, layers: list[tuple[str, DelayedScalingLinear]], history_len: int):
        self.layers = layers
        self.history_len = history_len

    @torch.no_grad()
    def post_backward(self, model=None) -> None:
        """After each micro-batch's backward: fold every layer's dY amax (its token's gradient) into its
        pending amaxes, so that gradient accumulation takes the max over micro-batches, not the sum."""
        mods = [layer for _, layer in self.layers]
        grads = [m.grad_amax_token.grad for m in mods]
        if not any(g is not None for g in grads):
            return
        pending = torch.stack([m.pending_amax for m in mods])
        zero = pending.new_zeros(())
        seen = torch.stack([zero if g is None else g.to(pending.dtype) for g in grads])
        pending[:, GRAD] = torch.maximum(pending[:, GRAD], seen)
        torch._foreach_copy_([m.pending_amax for m in mods], list(pending.unbind(0)))
        for m in mods:
            m.grad_amax_token.grad = None

    @torch.no_grad()
    def post_optimizer_step(self, model=None) -> None:
        """All layers in one batch: a handful of kernels per step, not a dozen per layer."""
        if not self.layers:
            return
        self.post_backward()
        mods = [layer for _, layer in self.layers]
        pending = torch.stack([m.pending_amax for m in mods])
        self._max_across_ranks(pending)
        history, scales = _advance_history(torch.stack([m.amax_history for m in mods]), pending,
                                           torch.stack([m.scales for m in mods]))
        torch._foreach_copy_([m.amax_history for m in mods], list(history.unbind(0)))
        torch._foreach_copy_([m.scales for m in mods], list(scales.unbind(0)))
        ready = torch.ones((), dtype=torch.bool, device=pending.device)
        torch._foreach_copy_([m.history_ready for m in mods], [ready] * len(mods))
        torch._foreach_zero_([m.pending_amax for m in mods])
        for m in mods:
            m.ready_host = True

    @staticmethod
    def _max_across_ranks(pending: torch.Tensor) -> None:
        """Data-parallel ranks see different micro-batches; like Transformer Engine, take the max amax over
        ranks (one collective for all layers) so every rank uses the same scales."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)

    def state_dict(self) -> dict:
        self.post_backward()
        return {
            "recipe": "fp8_delayed",
            "amax_history_len": self.history_len,
            "layers": {name: {"amax_history": layer.amax_history.detach().cpu().clone(),
                              "pending_amax": layer.pending_amax.detach().cpu().clone(),
                              "scales": layer.scales.detach().cpu().clone(),
                              "history_ready": layer.history_ready.detach().cpu().clone()}
                       for name, layer in self.layers},
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("recipe") != "fp8_delayed":
            raise ValueError("not an fp8_delayed scaling state (expected a dict from DelayedScalingHook.state_dict())")
        if state.get("amax_history_len") != self.history_len:
            raise ValueError(f"checkpoint has amax_history_len={state.get('amax_history_len')}, this run uses "
                             f"{self.history_len}; resume with the same recipe option")
        saved = state.get("layers", {})
        mine = {name for name, _ in self.layers}
        if set(saved) != mine:
            missing, extra = sorted(mine - set(saved)), sorted(set(saved) - mine)
            raise ValueError(f"delayed-scaling layers differ from the checkpoint: missing {missing}, unexpected {extra}; "
                             "resume with the same bf16_first_layers/bf16_last_layers")
        with torch.no_grad():
            for name, layer in self.layers:
                for key in STATE_BUFFERS:
                    getattr(layer, key).copy_(saved[name][key].to(getattr(layer, key).device))
                layer.ready_host = bool(saved[name]["history_ready"])


@register
class FP8DelayedRecipe(Recipe):
    name = "fp8_delayed"

    def real_unavailable(self, device, options):
        reason = capability_reason(device, self.min_capability, "FP8 tensor cores")
        if reason is None and not hasattr(torch, "_scaled_mm"):
            return "this torch build has no torch._scaled_mm"
        return reason

    def skip_reason(self, linear, real):
        return scaled_mm_shape_reason(linear, self.name) if real else None

    def convert(self, linear, name, options, real):
        new = DelayedScalingLinear(linear, options["amax_history_len"], real, fused_cast=options["fused_cast"],
                                   one_pass_cast=options["one_pass_cast"])
        how = "torch._scaled_mm with delayed scaling" if real else f"emulated: {new.quantizer.describe()}"
        return new, new.quantizer, how

    shared_note = ("once the amax history exists, the MLP's SwiGLU and its backward run as one Triton pass each, "
                   "writing both FP8 layouts and the amax (fused_swiglu), and the QKV projection's dY comes from one "
                   "pass over dQ, dK and dV through RoPE's backward (fused_qkv_rope)")

    def share_inputs(self, block, options: dict, real: bool) -> int:
        if not (real and options["one_pass_cast"] and not options["fused_cast"]):
            return 0
        mlp = fuse_swiglu_mlp(block) if options["fused_swiglu"] else 0
        qkv = fuse_qkv_rope(block) if options["fused_qkv_rope"] else 0
        return 1 if mlp or qkv else 0

    def compile_mode(self, options, real):
        # The step is host-bound at times: ~1,200 Triton launches per 1b step, and rounds of 100-111 ms steps
        # against 94-98 ms (bench/NOTES_floor.md 6, 10, 28). Replayed as graphs its steps stay at the fast ones
        # (`..._1319_*_delayed_cudagraphs_ab_*`). Measured with inductor's casts, not with fused_cast's kernels.
        if real and options["cuda_graphs"] and not options["fused_cast"] and not options.get("fsdp"):
            return "reduce-overhead"
        return None

    def make_hooks(self, converted, options):
        layers = [(name, mod) for name, mod in converted if isinstance(mod, DelayedScalingLinear)]
        return [DelayedScalingHook(layers, options["amax_history_len"])] if layers else []

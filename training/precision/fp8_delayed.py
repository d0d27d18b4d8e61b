"""`fp8_delayed`: FP8 with delayed per-tensor scaling (Transformer Engine's DelayedScaling; torchao
removed it in 2025, so it is ours).

X and W in E4M3, dY in E5M2. Each converted layer keeps, per operand, an amax history of the last
`amax_history_len` steps (default 1024). The scale used at step t is 448 (57344 for E5M2) divided by
the max of the history up to step t-1; during step t the layer records the amaxes it sees (max over
micro-batches), and `DelayedScalingHook.post_optimizer_step` pushes them into the history and derives
the next scales. The first step has no history and falls back to the current amax. Values above the
stale scale's range saturate (that is the recipe's known risk; telemetry's saturation_frac shows it).

History, scales and pending amaxes are non-persistent buffers updated with tensor ops only (no Python
state on the step path, so torch.compile does not break the graph); they travel in checkpoints through
the hook's state_dict, not through the HF weights. Real kernels: `torch._scaled_mm` on sm_89+.
"""
from __future__ import annotations

import torch
from torch import nn

from training.precision.emulation import EmulatedLinearFn, GemmQuantizer, QuantizedLinear, compute_dtype
from training.precision.formats import fp8_cast, fp8_scale_from_amax, quantize_fp8_tensorwise
from training.precision.fp8_tensorwise import scaled_mm_shape_reason, transposed
from training.precision.registry import Recipe, capability_reason, register

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INPUT, WEIGHT, GRAD = 0, 1, 2
OPERAND_DTYPES = (E4M3, E4M3, E5M2)


class DelayedQuantizer(GemmQuantizer):
    """Per-tensor FP8 with the layer's delayed scales. Calls with track=True come from telemetry,
    which must observe without feeding the amax history."""

    def __init__(self, layer: "DelayedScalingLinear"):
        self.layer = layer  # the quantizer is not a Module, so this back-reference adds no submodule

    def _scale(self, which: int, t: torch.Tensor) -> torch.Tensor:
        return self.layer.effective_scale(which, t.detach().abs().amax())

    def input(self, x2d, *, track=False):
        return quantize_fp8_tensorwise(x2d, E4M3, scale=self._scale(INPUT, x2d), track=track)

    def weight(self, w, *, track=False):
        q = quantize_fp8_tensorwise(w, E4M3, scale=self._scale(WEIGHT, w), track=track)
        return q, transposed(q)

    def grad(self, dy2d, *, track=False):
        amax = dy2d.detach().abs().amax()
        if not track:
            self.layer.record_amax(GRAD, amax)
        return quantize_fp8_tensorwise(dy2d, E5M2, scale=self.layer.effective_scale(GRAD, amax), track=track)

    def wgrad(self, dy_t, x_t):
        # Same per-tensor scales as Fprop/Dgrad: the quantized tensors are orientation-independent.
        s_g = self.layer.effective_scale(GRAD, dy_t.detach().abs().amax())
        s_x = self.layer.effective_scale(INPUT, x_t.detach().abs().amax())
        return quantize_fp8_tensorwise(dy_t, E5M2, scale=s_g), quantize_fp8_tensorwise(x_t, E4M3, scale=s_x)

    def describe(self):
        return f"E4M3 X/W, E5M2 dY, per-tensor delayed scaling (history {self.layer.amax_history.shape[1]})"


def _to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return fp8_cast(t, scale, dtype)[0]


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class DelayedScaledMMFn(torch.autograd.Function):
    """Real FP8 GEMMs with delayed scales: torch._scaled_mm for Fprop (fast accumulation, as torchao),
    Dgrad and Wgrad (full-precision accumulation: gradients are less forgiving)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, layer):
        out_dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        s_x = layer.effective_scale(INPUT, x2.detach().abs().amax())
        s_w = layer.effective_scale(WEIGHT, weight.detach().abs().amax())
        x8 = _to_fp8(x2, s_x, E4M3)
        w8 = _to_fp8(weight, s_w, E4M3)
        y = torch._scaled_mm(x8, w8.t(), scale_a=s_x.reciprocal(), scale_b=s_w.reciprocal(),
                             out_dtype=torch.bfloat16, use_fast_accum=True)
        if bias is not None:
            y = y + bias.to(y.dtype)
        # FP8 copies are what backward needs (per-tensor scaling is transpose-invariant): a quarter of
        # the memory of saving FP32 operands.
        ctx.save_for_backward(x8, w8, s_x, s_w)
        ctx.layer = layer
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        x8, w8, s_x, s_w = ctx.saved_tensors
        layer = ctx.layer
        dy2 = dy.reshape(-1, dy.shape[-1])
        amax = dy2.detach().abs().amax()
        layer.record_amax(GRAD, amax)
        s_g = layer.effective_scale(GRAD, amax)
        g8 = _to_fp8(dy2, s_g, E5M2)
        inv_g = s_g.reciprocal()
        grad_x = torch._scaled_mm(g8, _col_major(w8), scale_a=inv_g, scale_b=s_w.reciprocal(),
                                  out_dtype=torch.bfloat16)
        grad_w = torch._scaled_mm(g8.t().contiguous(), _col_major(x8), scale_a=inv_g, scale_b=s_x.reciprocal(),
                                  out_dtype=torch.float32)
        grad_b = dy2.to(torch.float32).sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return grad_x.to(ctx.x_dtype).reshape(ctx.x_shape), grad_w, grad_b, None


class DelayedScalingLinear(QuantizedLinear):
    def __init__(self, linear: nn.Linear, history_len: int, real: bool):
        super().__init__(linear, GemmQuantizer(), "fp8_delayed")
        device = linear.weight.device
        # Rows: input, weight, grad. Non-persistent: HF checkpoints stay plain; the hook saves them.
        self.register_buffer("amax_history", torch.zeros(3, history_len, device=device), persistent=False)
        self.register_buffer("pending_amax", torch.zeros(3, device=device), persistent=False)
        self.register_buffer("scales", torch.ones(3, device=device), persistent=False)
        self.register_buffer("history_ready", torch.zeros((), dtype=torch.bool, device=device), persistent=False)
        self.quantizer = DelayedQuantizer(self)
        self.real = real

    def effective_scale(self, which: int, current_amax: torch.Tensor) -> torch.Tensor:
        just_in_time = fp8_scale_from_amax(current_amax, OPERAND_DTYPES[which])
        return torch.where(self.history_ready, self.scales[which], just_in_time)

    def record_amax(self, which: int, amax: torch.Tensor) -> None:
        """Called from backward for dY (backward only runs for training steps)."""
        cur = self.pending_amax[which]
        cur.copy_(torch.maximum(cur, amax.to(torch.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            # Recorded here rather than inside the autograd.Function so the buffer mutation is a plain
            # module-level in-place op that torch.compile functionalizes.
            self.pending_amax[INPUT].copy_(torch.maximum(self.pending_amax[INPUT], x.detach().abs().amax().float()))
            self.pending_amax[WEIGHT].copy_(torch.maximum(self.pending_amax[WEIGHT],
                                                          self.weight.detach().abs().amax().float()))
        tokens = x.numel() // x.shape[-1]
        # torch._scaled_mm needs every dim divisible by 16; other token counts take the emulated path.
        if self.real and tokens % 16 == 0:
            return DelayedScaledMMFn.apply(x, self.weight, self.bias, self)
        return EmulatedLinearFn.apply(x, self.weight, self.bias, self.quantizer)

    @torch.no_grad()
    def update_scales(self) -> None:
        history = torch.roll(self.amax_history, shifts=1, dims=1)
        history[:, 0] = self.pending_amax
        self.amax_history.copy_(history)
        amax = history.amax(dim=1)
        fresh = torch.stack([fp8_scale_from_amax(amax[i], OPERAND_DTYPES[i]) for i in range(3)])
        # An operand never seen (amax 0, e.g. no backward yet) keeps its previous scale.
        self.scales.copy_(torch.where(amax > 0, fresh, self.scales))
        self.history_ready.fill_(True)
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

    def post_optimizer_step(self, model=None) -> None:
        self._sync_pending_across_ranks()
        for _, layer in self.layers:
            layer.update_scales()

    def _sync_pending_across_ranks(self) -> None:
        """Data-parallel ranks see different micro-batches; like Transformer Engine, take the max amax over
        ranks (one collective for all layers) so every rank uses the same scales."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not self.layers:
            return
        pending = torch.stack([layer.pending_amax for _, layer in self.layers])
        dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        for (_, layer), row in zip(self.layers, pending):
            layer.pending_amax.copy_(row)

    def state_dict(self) -> dict:
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
                for key in ("amax_history", "pending_amax", "scales", "history_ready"):
                    getattr(layer, key).copy_(saved[name][key].to(getattr(layer, key).device))


@register
class FP8DelayedRecipe(Recipe):
    name = "fp8_delayed"
    summary = "E4M3 X/W, E5M2 dY; per-tensor scales from an amax history (max over the last N steps)"
    gpu_requirement = "real FP8 GEMMs on sm_89+ via torch._scaled_mm; emulated elsewhere"
    options = {"amax_history_len": 1024}

    def validate_options(self, options):
        n = options["amax_history_len"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"option amax_history_len of fp8_delayed must be a positive integer, got {n!r}")

    def real_unavailable(self, device, options):
        if capability_reason(device, (8, 9), "FP8 tensor cores") is None and not hasattr(torch, "_scaled_mm"):
            return "this torch build has no torch._scaled_mm"
        return capability_reason(device, (8, 9), "FP8 tensor cores")

    def skip_reason(self, linear, real):
        return scaled_mm_shape_reason(linear, self.name) if real else None

    def convert(self, linear, name, options, real):
        new = DelayedScalingLinear(linear, options["amax_history_len"], real)
        how = "torch._scaled_mm with delayed scaling" if real else f"emulated: {new.quantizer.describe()}"
        return new, new.quantizer, how

    def make_hooks(self, converted, options):
        layers = [(name, mod) for name, mod in converted if isinstance(mod, DelayedScalingLinear)]
        return [DelayedScalingHook(layers, options["amax_history_len"])] if layers else []

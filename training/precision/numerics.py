"""Numerics telemetry: what quantization does to each converted layer's operands, sampled.

While sampling is on, a forward hook on each converted linear quantizes its input and weight, and a
tensor hook on its output quantizes the incoming gradient, with the recipe's own quantizer (the same
code the emulated GEMMs use; for real-kernel layers, the format those kernels use). Sampling off means
no hooks at all, so the steady-state step pays nothing.

Per layer (`numerics/<layer>/<stat>`):
  amax_input, amax_weight, amax_grad  largest magnitude of X, W, dY
  underflow_frac   nonzero elements of X, W, dY that quantize to exactly zero, over all their elements
  saturation_frac  elements whose scaled magnitude exceeded the format max and were clamped
  snr_db_input/_weight/_grad  10 log10(sum x^2 / sum (x - q(x))^2) per operand, capped at 300 dB
  snr_db           the worst (smallest) of the three: the operand that limits this layer
"""
from __future__ import annotations

import math

import torch

from training.precision.emulation import GemmQuantizer

SNR_CAP_DB = 300.0


class _OperandStats:
    __slots__ = ("amax", "flushed", "saturated", "numel", "signal", "noise")

    def __init__(self):
        self.amax = None
        self.flushed = self.saturated = self.signal = self.noise = None
        self.numel = 0

    def add(self, original: torch.Tensor, quantized) -> None:
        o = original.detach().to(torch.float32)
        d = quantized.dequantize().to(torch.float32)
        parts = {
            "amax": o.abs().amax(),
            "flushed": ((o != 0) & (d == 0)).sum(),
            "saturated": quantized.saturated if quantized.saturated is not None else torch.zeros((), device=o.device),
            "signal": o.square().sum(),
            "noise": (o - d).square().sum(),
        }
        for key, value in parts.items():
            cur = getattr(self, key)
            if key == "amax":
                setattr(self, key, value if cur is None else torch.maximum(cur, value))
            else:
                setattr(self, key, value if cur is None else cur + value)
        self.numel += o.numel()


class NumericsProbe:
    """Owns the sampling hooks of a model's converted layers."""

    def __init__(self):
        self._layers: list[tuple[str, torch.nn.Module, GemmQuantizer]] = []
        self._handles: list = []
        self._stats: dict[str, dict[str, _OperandStats]] = {}
        self.sampling = False

    def add_layer(self, name: str, module: torch.nn.Module, quantizer: GemmQuantizer) -> None:
        self._layers.append((name, module, quantizer))

    def set_sampling(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"set_numerics_sampling takes True or False, got {on!r}")
        if on == self.sampling:
            return
        self.sampling = on
        if not on:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            return
        for name, module, quantizer in self._layers:
            self._handles.append(module.register_forward_hook(self._make_hook(name, quantizer)))

    def _bucket(self, name: str, operand: str) -> _OperandStats:
        return self._stats.setdefault(name, {}).setdefault(operand, _OperandStats())

    def _make_hook(self, name: str, quantizer: GemmQuantizer):
        def hook(module, args, output):
            with torch.no_grad():
                x = args[0].detach()
                if x.is_cuda and torch.is_autocast_enabled("cuda"):
                    x = x.to(torch.get_autocast_dtype("cuda"))  # what the GEMM quantizes under autocast
                x2 = x.reshape(-1, x.shape[-1])
                self._bucket(name, "input").add(x2, quantizer.input(x2, track=True))
                w = module.weight.detach()
                self._bucket(name, "weight").add(w, quantizer.weight(w, track=True)[0])
            if isinstance(output, torch.Tensor) and output.requires_grad:
                def grad_hook(grad):
                    with torch.no_grad():
                        g2 = grad.detach().reshape(-1, grad.shape[-1])
                        self._bucket(name, "grad").add(g2, quantizer.grad(g2, track=True))
                output.register_hook(grad_hook)
        return hook

    def collect(self) -> dict[str, float]:
        """Stats gathered since the last collect, as {"numerics/<layer>/<stat>": float}; then reset."""
        out: dict[str, float] = {}
        for name, operands in self._stats.items():
            flushed = saturated = 0.0
            numel = 0
            snrs = []
            for operand, st in operands.items():
                amax_key = {"input": "amax_input", "weight": "amax_weight", "grad": "amax_grad"}[operand]
                out[f"numerics/{name}/{amax_key}"] = float(st.amax)
                flushed += float(st.flushed)
                saturated += float(st.saturated)
                numel += st.numel
                snr = _snr_db(float(st.signal), float(st.noise))
                out[f"numerics/{name}/snr_db_{operand}"] = snr
                snrs.append(snr)
            out[f"numerics/{name}/underflow_frac"] = flushed / numel if numel else 0.0
            out[f"numerics/{name}/saturation_frac"] = saturated / numel if numel else 0.0
            out[f"numerics/{name}/snr_db"] = min(snrs) if snrs else SNR_CAP_DB
        self._stats.clear()
        return out


def _snr_db(signal: float, noise: float) -> float:
    if noise <= 0.0:
        return SNR_CAP_DB
    if signal <= 0.0:
        return 0.0 if noise == 0.0 else -SNR_CAP_DB
    return max(-SNR_CAP_DB, min(SNR_CAP_DB, 10.0 * math.log10(signal / noise)))

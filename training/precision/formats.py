"""Number formats: our own quantizers for every format the recipes use.

Everything here is plain torch, so it runs identically on CPU, on Hopper (where MXFP8/NVFP4 have no
tensor cores) and on Blackwell. The MXFP8 and NVFP4 quantizers reproduce torchao 0.18's reference
quantizers (`MXTensor.to_mx`, `NVFP4Tensor.to_nvfp4`) operation for operation, including their edge cases
(all-zero blocks, scales in the FP32 denormal range), because the bit-exactness contract of
ARCHITECTURE.md is checked against them (`quantize_dequantize` below).

Internally a quantized operand is a `Quantized`: `values` (element x block scale) and an optional FP32
per-tensor `outer` scale that the GEMM applies to its output, the way `torch._scaled_mm` and the Blackwell
block-scaled GEMMs apply their global scales. `values` are computed in FP32 and then stored in the dtype
the caller asks for: FP32 on CPU, BF16 for the GEMMs on GPU. The cast to BF16 is exact for MXFP8 (E4M3 x
2^k: 4 significant bits), NVFP4 (E2M1 x E4M3: at most 6 significant bits) and FP8 with power-of-two or
per-tensor scales (the FP8 codes themselves), except that magnitudes below BF16's smallest subnormal
(2^-133, i.e. blocks of amax below ~1e-37) flush to zero. Block-scaled FP8 with arbitrary FP32 scales
(`fp8_blockwise`) is not exact in BF16 and stays FP32 (`bf16_exact=False`).

Blocks run along one axis of a 2D operand: `axis=-1` (the last dim, contiguous) or `axis=0` (the rows,
e.g. tokens for the Wgrad GEMM, read in place instead of from a transposed copy). The code is
elementwise math around one block reduction (a reshape to (..., blocks, block) and an amax), with zero
padding only where a dimension is not a multiple of the block, so torch.compile (inductor) fuses each
quantizer into one or two kernels; nothing here synchronises with the host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from training.precision.catalog import SCALE_ROUNDINGS

F8E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
F8E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # 57344
F8E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)  # 2**-6, smallest normal E4M3
F4_E2M1_MAX = 6.0
F32_MIN_NORMAL = 2.0 ** -126
E8M0_BIAS = 127
E8M0_NAN = 255
# torchao's floor for amax before dividing (float8_utils.EPS); same value so scales match it.
FP8_AMAX_EPS = 1e-12
# Largest power of two of each element type, used by the OCP MX "floor" scale rule.
F8E4M3_MAX_POW2 = 8

FORMATS = ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4")
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
AXES = (-1, 0)


@dataclass
class Quantized:
    """A quantized operand: dequantized value = values * outer (outer None means 1)."""

    values: torch.Tensor  # element x block scale, in the dtype asked for (FP32 or BF16); any layout
    outer: Optional[torch.Tensor] = None  # FP32 scalar
    bf16_exact: bool = True  # values survive a cast to BF16 unchanged (so a BF16 GEMM is exact)
    saturated: Optional[torch.Tensor] = None  # count of elements clamped at the format max (tracked only)

    def dequantize(self) -> torch.Tensor:
        """The dequantized operand in FP32."""
        values = self.values.to(torch.float32)
        return values if self.outer is None else values * self.outer

    def t(self) -> "Quantized":
        """The transposed operand (a view: no copy)."""
        return Quantized(self.values.t(), self.outer, self.bf16_exact, self.saturated)


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _pad_last(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """Zero-pad the last dim to a multiple of the block size; zeros never change a block's amax."""
    k = x.shape[-1]
    pad = (-k) % multiple
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x, k


def _as_2d(x: torch.Tensor, axis: int) -> torch.Tensor:
    if axis not in AXES:
        raise ValueError(f"axis must be -1 (last dim) or 0 (rows of a 2D tensor), got {axis!r}")
    if axis == 0 and x.dim() != 2:
        raise ValueError(f"blocks along axis 0 need a 2D tensor, got shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1])


def _block_view(x2: torch.Tensor, block: int, axis: int) -> tuple[torch.Tensor, int, Callable]:
    """View a 2D tensor as blocks of `block` elements along `axis` (zero-padded only when needed).

    Returns (blocked, dim, unblock): `blocked` is (rows, cols/block, block) for axis -1 or
    (rows/block, block, cols) for axis 0, `dim` is the in-block dim to reduce over, and `unblock` turns a
    tensor of blocked's shape back into one of x2's shape (dropping the padding).
    """
    rows, cols = x2.shape
    if axis == -1:
        pad = (-cols) % block
        padded = torch.nn.functional.pad(x2, (0, pad)) if pad else x2
        blocked = padded.reshape(rows, (cols + pad) // block, block)

        def unblock(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(rows, cols + pad)
            return t[:, :cols] if pad else t
        return blocked, 2, unblock
    pad = (-rows) % block
    padded = torch.nn.functional.pad(x2, (0, 0, 0, pad)) if pad else x2
    blocked = padded.reshape((rows + pad) // block, block, cols)

    def unblock(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(rows + pad, cols)
        return t[:rows] if pad else t
    return blocked, 1, unblock


def _tile_view(x2: torch.Tensor, block: int) -> tuple[torch.Tensor, Callable]:
    """View a 2D tensor as (rows/block, block, cols/block, block) tiles (zero-padded only when needed)."""
    rows, cols = x2.shape
    pr, pc = (-rows) % block, (-cols) % block
    padded = torch.nn.functional.pad(x2, (0, pc, 0, pr)) if (pr or pc) else x2
    tiles = padded.reshape((rows + pr) // block, block, (cols + pc) // block, block)

    def unblock(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(rows + pr, cols + pc)
        return t[:rows, :cols] if (pr or pc) else t
    return tiles, unblock


def _count_saturated(scaled: torch.Tensor, max_pos: float, track: bool):
    return (scaled.abs() > max_pos).sum() if track else None


# ----------------------------------------------------------------------------------------------- FP8
def fp8_scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, *, power_of_2: bool = False) -> torch.Tensor:
    """torchao's `amax_to_scale`: FP64 division (eager and compile agree), optional round-down to 2^k."""
    scale = (_fp8_max(fp8_dtype) / torch.clamp(amax.to(torch.float64), min=FP8_AMAX_EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, track: bool = False):
    """Saturating cast of x*scale to FP8; returns the FP8 codes (in `fp8_dtype`) and the saturation count."""
    max_pos = _fp8_max(fp8_dtype)
    scaled = x.to(torch.float32) * scale
    saturated = _count_saturated(scaled, max_pos, track)
    q = torch.clamp(scaled, -max_pos, max_pos).to(fp8_dtype)
    return q, saturated


def quantize_fp8_tensorwise(x: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, *, scale=None,
                            dtype: torch.dtype = torch.float32, track: bool = False) -> Quantized:
    """Per-tensor FP8. `scale` (x -> FP8 multiplier) defaults to the current amax (torchao `tensorwise`);
    delayed scaling passes the scale derived from its amax history instead. `values` are the FP8 codes
    (exact in BF16), `outer` the reciprocal scale the GEMM multiplies its accumulator by, as _scaled_mm."""
    if scale is None:
        scale = fp8_scale_from_amax(x.detach().abs().amax(), fp8_dtype)
    q, saturated = fp8_cast(x, scale, fp8_dtype, track=track)
    return Quantized(q.to(dtype), outer=scale.reciprocal(), saturated=saturated)


def quantize_fp8_blocks(x: torch.Tensor, block: Optional[int], fp8_dtype=torch.float8_e4m3fn, *,
                        power_of_2: bool = False, block_2d: bool = False, axis: int = -1,
                        dtype: torch.dtype = torch.float32, track: bool = False) -> Quantized:
    """FP8 with one scale per run of `block` elements along `axis` (block None: the whole row for axis -1,
    the whole column for axis 0, i.e. torchao `rowwise`), or per `block` x `block` tile when block_2d
    (DeepSeek-V3 weights; transpose-invariant, so axis does not matter). `values` are FP8 code / scale:
    exact in BF16 only with power-of-two scales, so `dtype` applies only then (else FP32)."""
    shape = x.shape
    x2 = _as_2d(x, axis)
    if block_2d:
        blocked, unblock = _tile_view(x2, block)
        amax = blocked.abs().amax(dim=(1, 3), keepdim=True)
    elif block is None:
        blocked, unblock = x2, (lambda t: t)
        amax = x2.abs().amax(dim=1 if axis == -1 else 0, keepdim=True)
    else:
        blocked, dim, unblock = _block_view(x2, block, axis)
        amax = blocked.abs().amax(dim=dim, keepdim=True)
    scale = fp8_scale_from_amax(amax.detach(), fp8_dtype, power_of_2=power_of_2)
    q, saturated = fp8_cast(blocked, scale, fp8_dtype, track=track)
    values = q.to(torch.float32) / scale
    values = unblock(values.to(dtype) if power_of_2 else values).reshape(shape)
    return Quantized(values, bf16_exact=power_of_2, saturated=saturated)


# ---------------------------------------------------------------------------------------------- MXFP8
def mxfp8_block_scales(max_abs: torch.Tensor, scale_rounding: str):
    """E8M0 scale byte and the multiplier applied before the cast, exactly as torchao's `to_mx`.

    `floor`: OCP MX rule, 2^(floor(log2 amax) - 8), read off the FP32 exponent bits.
    `rceil`: cuBLAS/Blackwell rule, 2^ceil(log2(amax / 448)), so the block max never saturates.
    """
    if scale_rounding == "rceil":
        descale = max_abs / F8E4M3_MAX
        exponent = torch.where(
            torch.isnan(descale), E8M0_NAN,
            torch.where(torch.isinf(descale), 254,
                        (torch.clamp(torch.ceil(torch.log2(descale)), min=-E8M0_BIAS, max=E8M0_BIAS)
                         + E8M0_BIAS).to(torch.uint8)))
        # Same special cases as the PTX cvt.rp.satfinite path torchao mirrors (including 1.0 for a
        # zero exponent, which only arises for blocks whose elements all flush to zero anyway).
        multiplier = torch.where(
            exponent == 255, descale,
            torch.where(exponent == 254, 2.0 ** -127,
                        torch.where(exponent == 0, 1.0,
                                    torch.exp2(E8M0_BIAS - exponent.to(torch.float32)))))
        return exponent, multiplier, False
    bits = max_abs.view(torch.int32)
    unbiased = ((torch.bitwise_right_shift(bits, 23)) & 0xFF) - 127 - F8E4M3_MAX_POW2
    unbiased = torch.clamp(unbiased, min=-E8M0_BIAS, max=E8M0_BIAS + 1)
    exponent = (unbiased + E8M0_BIAS).to(torch.uint8)
    exponent = torch.where(torch.isnan(max_abs), E8M0_NAN, exponent)
    scale = torch.bitwise_left_shift(exponent.to(torch.int32), 23).view(torch.float32)
    # torchao clamps the divisor to the smallest FP32 normal (2^-127 is lost in Triton); the E8M0 byte
    # still says 2^-127, so such blocks dequantize at half scale. Reproduced for bit-exactness.
    scale = torch.clamp(scale, min=F32_MIN_NORMAL)
    return exponent, scale, True


def e8m0_to_fp32(exponent: torch.Tensor) -> torch.Tensor:
    s = torch.pow(torch.full_like(exponent, 2.0, dtype=torch.float32), exponent.to(torch.int16) - E8M0_BIAS)
    return torch.where(exponent != E8M0_NAN, s, float("nan"))


def quantize_mxfp8(x: torch.Tensor, *, block_size: int = 32, scale_rounding: str = "rceil", axis: int = -1,
                   dtype: torch.dtype = torch.float32, track: bool = False) -> Quantized:
    """MXFP8: E4M3 elements, one E8M0 (power-of-two) scale per `block_size` run along `axis`; `values`
    (E4M3 x 2^k) stored in `dtype`, of x's shape (x reshaped to 2D for axis -1)."""
    shape = x.shape
    blocks, dim, unblock = _block_view(_as_2d(x, axis), block_size, axis)
    # amax in the input dtype first, as torchao does (a BF16 amax is exact anyway).
    max_abs = blocks.abs().amax(dim=dim, keepdim=True).to(torch.float32)
    data = blocks.to(torch.float32)
    exponent, factor, divide = mxfp8_block_scales(max_abs, scale_rounding)
    scaled = data / factor if divide else data * factor
    saturated = _count_saturated(scaled, F8E4M3_MAX, track)
    codes = torch.clamp(scaled, -F8E4M3_MAX, F8E4M3_MAX).to(torch.float8_e4m3fn)
    values = (codes.to(torch.float32) * e8m0_to_fp32(exponent)).to(dtype)
    return Quantized(unblock(values).reshape(shape), saturated=saturated)


# ---------------------------------------------------------------------------------------------- NVFP4
def round_to_e2m1(v: torch.Tensor, *, stochastic: bool = False, generator=None) -> torch.Tensor:
    """Round FP32 values already clamped to [-6, 6] onto the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}.

    The grid is uniform with step 0.5 below 2, 1 below 4 and 2 above, so rounding |v|/step to an integer
    rounds onto the grid; torch.round is half-to-even, and an even integer is an even E2M1 mantissa,
    which matches the hardware (and torchao's bit-twiddling) round-to-nearest-even. Stochastic rounding
    uses 8 random bits per element, as Blackwell's `cvt.rs.satfinite.e2m1x4.f32` (random bits added below
    the kept bits, then truncated) and the fused Triton kernel (nvfp4_triton.py) do: with t = |v| / step and
    f = t - floor(t) it rounds up with probability floor(256 f) / 256 (up iff floor(256 u) < floor(256 f) for
    a uniform u), so it is unbiased up to that resolution: the expected result is at most step / 256 under
    |v| (step / 512 on average). Without a generator the draws are `torch.rand_like` (global RNG; inductor
    lowers it to in-kernel Philox); floor(256 u) is a uniform byte (exactly so for torch's CPU generator,
    whose floats are multiples of 2^-24).
    """
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    t = a / step  # exact: step is a power of two
    if stochastic:
        lo = torch.floor(t)
        if generator is None:
            u = torch.rand_like(t)
        else:
            u = torch.rand(t.shape, generator=generator, device=generator.device, dtype=t.dtype).to(t.device)
        # u * 256 and (t - lo) * 256 are exact (powers of two), so the floors are the 8-bit truncations
        t = lo + (torch.floor(u * 256.0) < torch.floor((t - lo) * 256.0)).to(t.dtype)
    else:
        t = torch.round(t)
    return torch.copysign(t * step, v)


def nvfp4_per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao `per_tensor_amax_to_scale`: the FP32 global scale that lets the largest block scale reach
    the E4M3 maximum (448) when the block max equals the tensor max."""
    return amax.to(torch.float32) / (F8E4M3_MAX * F4_E2M1_MAX)


def _nvfp4_blocked(data: torch.Tensor, max_abs: torch.Tensor, per_tensor_scale: torch.Tensor, *,
                   stochastic: bool, generator, track: bool):
    """NVFP4 of blocked FP32 `data` given each block's amax (broadcastable to data): E2M1 elements, E4M3
    block scales (as FP32) and the saturation count. torchao `nvfp4_quantize` with two-level scaling,
    op for op."""
    block_scale = max_abs / F4_E2M1_MAX
    scaled_block_scales = block_scale / per_tensor_scale
    block_scales_e4m3 = torch.clamp(scaled_block_scales, min=F8E4M3_TINY, max=F8E4M3_MAX).to(
        torch.float8_e4m3fn).to(torch.float32)
    # Multiplying by the reciprocal (not dividing) is what torchao and the MSLK kernel do.
    reciprocal = (1.0 / per_tensor_scale) / block_scales_e4m3
    # When the tensor amax is below ~8e-36 the reciprocal of the global scale overflows to inf and 0*inf
    # would be NaN (torchao then decodes that NaN's bits as +-1.5); we keep zeros zero instead.
    scaled = torch.where(data == 0, 0.0, data * reciprocal)
    saturated = _count_saturated(scaled, F4_E2M1_MAX, track)
    scaled = torch.clamp(scaled, -F4_E2M1_MAX, F4_E2M1_MAX)
    elements = round_to_e2m1(scaled, stochastic=stochastic, generator=generator)
    return elements, block_scales_e4m3, saturated


def _nvfp4_blocks(x2: torch.Tensor, *, axis: int, block_2d: bool, stochastic: bool, generator,
                  per_tensor_scale: Optional[torch.Tensor], track: bool):
    if per_tensor_scale is None:
        per_tensor_scale = nvfp4_per_tensor_scale(x2.detach().abs().amax())
    if block_2d:  # 16x16 tiles: one amax per tile, broadcast over its 256 elements
        blocked, unblock = _tile_view(x2, 16)
        data = blocked.to(torch.float32)
        max_abs = data.abs().amax(dim=(1, 3), keepdim=True)
    else:
        blocked, dim, unblock = _block_view(x2, 16, axis)
        data = blocked.to(torch.float32)
        max_abs = data.abs().amax(dim=dim, keepdim=True)
    elements, scales, saturated = _nvfp4_blocked(data, max_abs, per_tensor_scale, stochastic=stochastic,
                                                 generator=generator, track=track)
    return elements, scales, per_tensor_scale, saturated, unblock


def nvfp4_parts(x: torch.Tensor, *, block_2d: bool = False, stochastic: bool = False, generator=None,
                per_tensor_scale: Optional[torch.Tensor] = None, track: bool = False):
    """Quantize to NVFP4 (blocks along the last dim) and return the pieces: E2M1 element values (FP32,
    shape (rows, blocks, 16)), E4M3 block scales (FP32, one per 1x16 block: (rows, blocks), broadcast
    over 16x16 tiles when block_2d), the FP32 per-tensor scale, the saturation count and
    (rows, k, shape) to undo the blocking. Follows torchao `nvfp4_quantize` with two-level scaling."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, k = x2.shape
    elements, scales, pts, saturated, _ = _nvfp4_blocks(x2, axis=-1, block_2d=block_2d, stochastic=stochastic,
                                                        generator=generator, per_tensor_scale=per_tensor_scale,
                                                        track=track)
    if block_2d:  # (row tiles, 16, col tiles, 16) -> (rows, blocks, 16)
        nb = elements.shape[2]
        elements = elements.reshape(-1, nb, 16)[:rows]
        scales = scales.expand(-1, 16, -1, -1).reshape(-1, nb)[:rows]
    else:
        scales = scales.squeeze(-1)
    return elements, scales, pts, saturated, (rows, k, shape)


def quantize_nvfp4(x: torch.Tensor, *, axis: int = -1, block_2d: bool = False, stochastic: bool = False,
                   generator=None, per_tensor_scale: Optional[torch.Tensor] = None,
                   dtype: torch.dtype = torch.float32, track: bool = False) -> Quantized:
    """NVFP4 for a GEMM: values = E2M1 x E4M3 block scale (exact in BF16, stored in `dtype`), outer = the
    FP32 tensor scale. 1x16 blocks along `axis`, or 16x16 tiles (block_2d)."""
    shape = x.shape
    x2 = _as_2d(x, axis)
    elements, scales, pts, saturated, unblock = _nvfp4_blocks(
        x2, axis=axis, block_2d=block_2d, stochastic=stochastic, generator=generator,
        per_tensor_scale=per_tensor_scale, track=track)
    values = (elements * scales).to(dtype)
    return Quantized(unblock(values).reshape(shape), outer=pts, saturated=saturated)


# ----------------------------------------------------------------------------------- Hadamard (RHT)
def hadamard_16() -> torch.Tensor:
    """16x16 Sylvester Hadamard matrix scaled by 1/4, so it is orthonormal (H @ H.T = I)."""
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / 4.0


def random_sign_vector(seed: int, n: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(n, generator=g) >= 0.5, 1.0, -1.0)


def rht_matrix(signs: torch.Tensor) -> torch.Tensor:
    """diag(signs) @ H16: the random Hadamard transform as one orthonormal 16x16 matrix."""
    return torch.diag(signs.to(torch.float32)) @ hadamard_16().to(signs.device)


def random_hadamard_transform(x: torch.Tensor, rht: torch.Tensor, *, axis: int = -1,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Apply the 16x16 transform `rht` (see rht_matrix) to every run of 16 elements along `axis` (-1: the
    last dim; 0: the rows of a 2D tensor), zero-padded to a multiple of 16.

    Both Wgrad operands get the same orthogonal transform along the token (reduction) dimension, so
    their product is unchanged in exact arithmetic while outliers are spread over 16 elements before
    FP4 quantization. The result keeps the padded length; callers pad both operands alike.

    One GEMM with a 16-wide reduction: (rows, 16) @ (16, 16) for axis -1, a batched (16, 16) @ (16, cols)
    per run of 16 rows for axis 0 (read in place). It runs in `dtype`: FP32 (default) multiplies exactly
    and accumulates in FP32; BF16 inputs with dtype=bfloat16 (the GPU training path) still multiply
    exactly (the entries of `rht` are +-1/4) and accumulate in FP32, and the result is rounded once to
    BF16 (2^-9 relative) before the FP4 quantization reads it. A GEMM rather than a pointwise 16-term sum:
    inductor would materialise such a sum in several chunks, while the GEMM writes the result once.
    """
    if axis not in AXES:
        raise ValueError(f"axis must be -1 (last dim) or 0 (rows of a 2D tensor), got {axis!r}")
    m = rht.to(device=x.device, dtype=dtype)
    if axis == -1:
        padded, _ = _pad_last(x, 16)
        blocks = padded.reshape(-1, 16).to(dtype)  # one 2D GEMM, not a broadcast batched one
        return (blocks @ m).reshape(padded.shape)
    if x.dim() != 2:
        raise ValueError(f"the transform along axis 0 needs a 2D tensor, got shape {tuple(x.shape)}")
    blocks, _, _ = _block_view(x, 16, 0)  # (rows/16, 16, cols)
    # out[g, j, c] = sum_i rht[i, j] * x[g, i, c]
    return torch.matmul(m.t(), blocks.to(dtype)).reshape(-1, x.shape[1])


# ------------------------------------------------------------------------------------ public contract
def _check_block(fmt: str, block_size, default, *, allow_2d: bool):
    if block_size is None:
        return default, False
    if isinstance(block_size, (tuple, list)):
        if not allow_2d or len(block_size) != 2 or block_size[0] != block_size[1]:
            raise ValueError(f"block_size {block_size!r} is not valid for {fmt}: "
                             + ("use an int or a square (n, n) tile" if allow_2d else "use an int"))
        return int(block_size[0]), True
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int (or a square tuple), got {block_size!r}")
    return block_size, False


def quantize_dequantize(x: torch.Tensor, fmt: str, *, block_size=None, scale_rounding: Optional[str] = None,
                        stochastic: bool = False, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Quantize `x` to `fmt` and return the dequantized tensor (same shape and dtype as `x`).

    Blocks run along the last dimension. Formats:
      - fp8_tensorwise: E4M3, one scale 448/amax for the tensor (block_size must be None).
      - fp8_rowwise: E4M3, one power-of-two scale per row (torchao `rowwise`; block_size must be None).
      - fp8_blockwise: E4M3, one scale per 1x128 run (block_size=128 default; (128, 128) for 2D tiles).
      - mxfp8: E4M3 + E8M0 scale per 32 elements; scale_rounding "rceil" (default, our training default)
        or "floor". Bit-exact with torchao `MXTensor.to_mx(...).dequantize(x.dtype)`.
      - nvfp4: E2M1 + E4M3 scale per 16 elements + FP32 tensor scale; block_size 16 or (16, 16).
        Bit-exact with torchao `NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(
        x.abs().max())).dequantize(x.dtype)`; `stochastic=True` rounds elements stochastically.
    Deliberate differences from torchao, where torchao's output is not a number: an all-zero tensor gives
    zeros under nvfp4 (torchao: NaN, its global scale is 0/0), and for tensors whose amax is below ~8e-36
    zero elements stay zero (torchao turns them into +-1.5 x block scale).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}; cast it first with x.float()")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (blocks run along the last one)")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if scale_rounding is not None and fmt != "mxfp8":
        raise ValueError(f"scale_rounding only applies to mxfp8, not {fmt}; leave it None")
    if stochastic and fmt != "nvfp4":
        raise ValueError(f"stochastic rounding is implemented for nvfp4 only, not {fmt}")
    if generator is not None and not stochastic:
        raise ValueError("a generator only matters with stochastic=True")
    if x.numel() == 0:
        return x.clone()
    contiguous = x.contiguous()

    if fmt == "fp8_tensorwise" or fmt == "fp8_rowwise":
        if block_size is not None:
            raise ValueError(f"{fmt} has no block_size (its scale covers the {'tensor' if fmt == 'fp8_tensorwise' else 'row'})")
        q = (quantize_fp8_tensorwise(contiguous) if fmt == "fp8_tensorwise"
             else quantize_fp8_blocks(contiguous, None, power_of_2=True))
        return q.dequantize().to(x.dtype)
    if fmt == "fp8_blockwise":
        block, two_d = _check_block(fmt, block_size, 128, allow_2d=True)
        _require_multiple(x, block, fmt, two_d)
        return quantize_fp8_blocks(contiguous, block, block_2d=two_d).dequantize().to(x.dtype)
    if fmt == "mxfp8":
        block, _ = _check_block(fmt, block_size, 32, allow_2d=False)
        rounding = "rceil" if scale_rounding is None else scale_rounding
        if rounding not in SCALE_ROUNDINGS:
            raise ValueError(f"scale_rounding must be one of {', '.join(SCALE_ROUNDINGS)}, got {scale_rounding!r}")
        _require_multiple(x, block, fmt, False)
        return quantize_mxfp8(contiguous, block_size=block, scale_rounding=rounding).values.to(x.dtype)
    # nvfp4
    block, two_d = _check_block(fmt, block_size, 16, allow_2d=True)
    if block != 16:
        raise ValueError(f"nvfp4 blocks are 16 elements (or 16x16 tiles), got block_size={block_size!r}")
    _require_multiple(x, 16, fmt, two_d)
    if generator is not None and generator.device != x.device:
        raise ValueError(f"generator is on {generator.device} but x is on {x.device}; create it on x's device")
    amax = contiguous.abs().max()
    if amax == 0:
        return torch.zeros_like(x)
    elements, scales, pts, _, (rows, k, shape) = nvfp4_parts(
        contiguous, block_2d=two_d, stochastic=stochastic, generator=generator,
        per_tensor_scale=nvfp4_per_tensor_scale(amax))
    # torchao's dequantize order: (tensor scale * block scale) first, then times the element, in FP32.
    out = elements * (pts * scales).unsqueeze(-1)
    return out.reshape(rows, -1)[:, :k].reshape(shape).to(x.dtype)


def _require_multiple(x: torch.Tensor, block: int, fmt: str, two_d: bool) -> None:
    if x.shape[-1] % block:
        raise ValueError(f"{fmt} needs the last dimension ({x.shape[-1]}) to be a multiple of the block "
                         f"size {block}; pad the tensor or pick another format")
    if two_d and (x.dim() < 2 or math.prod(x.shape[:-1]) % block):
        raise ValueError(f"{fmt} with 2D {block}x{block} tiles needs the row count to be a multiple of {block}")

"""Number formats: our own quantizers for every format the recipes use.

Everything here is plain torch, so it runs identically on CPU, on Hopper (where MXFP8/NVFP4 have no
tensor cores) and on Blackwell. The MXFP8 and NVFP4 quantizers reproduce torchao 0.18's reference
quantizers (`MXTensor.to_mx`, `NVFP4Tensor.to_nvfp4`) operation for operation, including their edge cases
(all-zero blocks, scales in the FP32 denormal range), because the bit-exactness contract of
ARCHITECTURE.md is checked against them.

Internally a quantized operand is a `Quantized`: `values` (FP32, element x block scale, which is exactly
representable in BF16 for MXFP8, NVFP4 and power-of-two FP8 scales) and an optional per-tensor `outer`
scale that a GEMM applies to its FP32 output, the way `torch._scaled_mm` and the Blackwell block-scaled
GEMMs apply their global scales.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

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
SCALE_ROUNDINGS = ("floor", "rceil")
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class Quantized:
    """A quantized operand: dequantized value = values * outer (outer None means 1)."""

    values: torch.Tensor  # FP32, same shape as the source
    outer: Optional[torch.Tensor] = None  # FP32 scalar
    bf16_exact: bool = True  # values survive a cast to BF16 unchanged (so a BF16 GEMM is exact)
    saturated: Optional[torch.Tensor] = None  # count of elements clamped at the format max (tracked only)

    def dequantize(self) -> torch.Tensor:
        return self.values if self.outer is None else self.values * self.outer


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _pad_last(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """Zero-pad the last dim to a multiple of the block size; zeros never change a block's amax."""
    k = x.shape[-1]
    pad = (-k) % multiple
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x, k


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
    """Saturating cast of x*scale to FP8; returns the FP8 codes as FP32 and the saturation count."""
    max_pos = _fp8_max(fp8_dtype)
    scaled = x.to(torch.float32) * scale
    saturated = _count_saturated(scaled, max_pos, track)
    q = torch.clamp(scaled, -max_pos, max_pos).to(fp8_dtype)
    return q, saturated


def quantize_fp8_tensorwise(x: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, *, scale=None,
                            track: bool = False) -> Quantized:
    """Per-tensor FP8. `scale` (x -> FP8 multiplier) defaults to the current amax (torchao `tensorwise`);
    delayed scaling passes the scale derived from its amax history instead."""
    if scale is None:
        scale = fp8_scale_from_amax(x.detach().abs().amax(), fp8_dtype)
    q, saturated = fp8_cast(x, scale, fp8_dtype, track=track)
    # The reciprocal is what _scaled_mm multiplies the FP32 accumulator by; emulation does the same.
    return Quantized(q.to(torch.float32), outer=scale.reciprocal(), saturated=saturated)


def quantize_fp8_blocks(x: torch.Tensor, block: Optional[int], fp8_dtype=torch.float8_e4m3fn, *,
                        power_of_2: bool = False, block_2d: bool = False, track: bool = False) -> Quantized:
    """FP8 with one scale per 1 x `block` run along the last dim (block None: the whole row, i.e. torchao
    `rowwise`), or per `block` x `block` tile when block_2d (DeepSeek-V3 weights). Rows are zero-padded
    to a whole number of blocks and the padding cut off again."""
    x2 = x.reshape(-1, x.shape[-1])
    rows, k = x2.shape
    if block is None:
        blocked = x2.unsqueeze(1)  # (rows, 1, k)
        amax = blocked.abs().amax(dim=-1, keepdim=True)
    else:
        padded, _ = _pad_last(x2, block)
        blocked = padded.reshape(rows, -1, block)
        if block_2d:
            pr = (-rows) % block
            tiles = torch.nn.functional.pad(blocked, (0, 0, 0, 0, 0, pr)) if pr else blocked
            nb = tiles.shape[1]
            tile_amax = tiles.reshape(-1, block, nb, block).abs().amax(dim=(1, 3))  # (row_tiles, nb)
            amax = tile_amax.repeat_interleave(block, dim=0)[:rows].unsqueeze(-1)
        else:
            amax = blocked.abs().amax(dim=-1, keepdim=True)
    scale = fp8_scale_from_amax(amax.detach(), fp8_dtype, power_of_2=power_of_2)
    q, saturated = fp8_cast(blocked, scale, fp8_dtype, track=track)
    values = (q.to(torch.float32) / scale).reshape(rows, -1)[:, :k].reshape(x.shape)
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


def quantize_mxfp8(x: torch.Tensor, *, block_size: int = 32, scale_rounding: str = "rceil",
                   track: bool = False) -> Quantized:
    """MXFP8: E4M3 elements, one E8M0 (power-of-two) scale per `block_size` run of the last dim."""
    shape = x.shape
    padded, k = _pad_last(x.reshape(-1, shape[-1]), block_size)
    blocks = padded.reshape(padded.shape[0], -1, block_size)
    # amax in the input dtype first, as torchao does (a BF16 amax is exact anyway).
    max_abs = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    data = blocks.to(torch.float32)
    exponent, factor, divide = mxfp8_block_scales(max_abs, scale_rounding)
    scaled = data / factor if divide else data * factor
    saturated = _count_saturated(scaled, F8E4M3_MAX, track)
    codes = torch.clamp(scaled, -F8E4M3_MAX, F8E4M3_MAX).to(torch.float8_e4m3fn)
    values = codes.to(torch.float32) * e8m0_to_fp32(exponent)
    values = values.reshape(padded.shape)[:, :k].reshape(shape)
    return Quantized(values, saturated=saturated)


# ---------------------------------------------------------------------------------------------- NVFP4
def round_to_e2m1(v: torch.Tensor, *, stochastic: bool = False, generator=None) -> torch.Tensor:
    """Round FP32 values already clamped to [-6, 6] onto the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}.

    The grid is uniform with step 0.5 below 2, 1 below 4 and 2 above, so rounding |v|/step to an integer
    rounds onto the grid; torch.round is half-to-even, and an even integer is an even E2M1 mantissa,
    which matches the hardware (and torchao's bit-twiddling) round-to-nearest-even. Stochastic rounding
    rounds up with probability equal to the distance from the lower neighbour, hence unbiased.
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
        t = lo + (u < (t - lo)).to(t.dtype)
    else:
        t = torch.round(t)
    return torch.copysign(t * step, v)


def nvfp4_per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao `per_tensor_amax_to_scale`: the FP32 global scale that lets the largest block scale reach
    the E4M3 maximum (448) when the block max equals the tensor max."""
    return amax.to(torch.float32) / (F8E4M3_MAX * F4_E2M1_MAX)


def nvfp4_parts(x: torch.Tensor, *, block_2d: bool = False, stochastic: bool = False, generator=None,
                per_tensor_scale: Optional[torch.Tensor] = None, track: bool = False):
    """Quantize to NVFP4 and return the pieces: E2M1 element values (FP32), E4M3 block scales (FP32,
    one per 1x16 block, broadcast over 16x16 tiles when block_2d), the FP32 per-tensor scale, and the
    saturation count. Follows torchao `nvfp4_quantize` with two-level scaling op for op."""
    shape = x.shape
    if per_tensor_scale is None:
        per_tensor_scale = nvfp4_per_tensor_scale(x.detach().abs().amax())
    padded, k = _pad_last(x.reshape(-1, shape[-1]), 16)
    rows = padded.shape[0]
    data = padded.to(torch.float32).reshape(rows, -1, 16)
    if block_2d:
        pr = (-rows) % 16
        tiles = torch.nn.functional.pad(data, (0, 0, 0, 0, 0, pr)) if pr else data
        nb = tiles.shape[1]
        tile_amax = tiles.reshape(-1, 16, nb, 16).abs().amax(dim=(1, 3))
        max_abs = tile_amax.repeat_interleave(16, dim=0)[:rows]
    else:
        max_abs = data.abs().amax(dim=-1)
    block_scale = max_abs / F4_E2M1_MAX
    scaled_block_scales = block_scale / per_tensor_scale
    block_scales_e4m3 = torch.clamp(scaled_block_scales, min=F8E4M3_TINY, max=F8E4M3_MAX).to(
        torch.float8_e4m3fn).to(torch.float32)
    # Multiplying by the reciprocal (not dividing) is what torchao and the MSLK kernel do.
    reciprocal = (1.0 / per_tensor_scale) / block_scales_e4m3
    # When the tensor amax is below ~8e-36 the reciprocal of the global scale overflows to inf and 0*inf
    # would be NaN (torchao then decodes that NaN's bits as +-1.5); we keep zeros zero instead.
    scaled = torch.where(data == 0, 0.0, data * reciprocal.unsqueeze(-1))
    saturated = _count_saturated(scaled, F4_E2M1_MAX, track)
    scaled = torch.clamp(scaled, -F4_E2M1_MAX, F4_E2M1_MAX)
    elements = round_to_e2m1(scaled, stochastic=stochastic, generator=generator)
    return elements, block_scales_e4m3, per_tensor_scale, saturated, (rows, k, shape)


def quantize_nvfp4(x: torch.Tensor, *, block_2d: bool = False, stochastic: bool = False, generator=None,
                   track: bool = False) -> Quantized:
    """NVFP4 for a GEMM: values = E2M1 x E4M3 block scale (exact in BF16), outer = FP32 tensor scale."""
    elements, scales, pts, saturated, (rows, k, shape) = nvfp4_parts(
        x, block_2d=block_2d, stochastic=stochastic, generator=generator, track=track)
    values = (elements * scales.unsqueeze(-1)).reshape(rows, -1)[:, :k].reshape(shape)
    return Quantized(values, outer=pts, saturated=saturated)


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


def random_hadamard_transform(x: torch.Tensor, rht: torch.Tensor) -> torch.Tensor:
    """Apply the 16x16 transform `rht` (see rht_matrix) to every 16-run of the last dim, zero-padded to a
    multiple of 16.

    Both Wgrad operands get the same orthogonal transform along the token (reduction) dimension, so
    their product is unchanged in exact arithmetic while outliers are spread over 16 elements before
    FP4 quantization. The result keeps the padded length; callers pad both operands alike.
    """
    padded, _ = _pad_last(x, 16)
    blocks = padded.to(torch.float32).reshape(-1, 16)  # one 2D GEMM, not a broadcast batched one
    return (blocks @ rht.to(blocks.device)).reshape(padded.shape)


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

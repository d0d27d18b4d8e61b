"""Fused NVFP4 quantization of one GEMM operand into both layouts it is needed in (GPU fast path).

A linear layer's activation X and output gradient dY are each quantized twice by the NVFP4 recipe: for
Fprop/Dgrad in 1x16 blocks along the features, and for Wgrad after a 16-point random Hadamard transform
along the tokens, in 1x16 blocks along the tokens. Done with torch ops that is an RHT GEMM writing an
intermediate, two global-amax passes and two quantization passes (about 16 bytes of traffic per BF16
element). Here it is two passes over the operand in Triton (8 bytes per element):

  1. amax: each 16-token x BLOCK_N tile is read once; the max |x| and the max |RHT(x)| (the transform
     done in registers: a 16x16 @ 16xBLOCK_N dot with FP32 accumulation) go to two global maxima.
  2. quantize: each tile is read once more and written twice, as BF16 values (E2M1 element x E4M3 block
     scale, exact in BF16): output `a` with 1x16 blocks along the features, output `b` = RHT(x) with 1x16
     blocks along the tokens (each column of the tile is one block), both in x's [tokens, features]
     layout, so the Wgrad GEMM reads `b` transposed, in place. `b` is computed transposed in registers
     ((BLOCK_N, 16) = x^T @ rht: one wgmma on Hopper, each block a row of the product) and stored back in
     x's layout.

Both passes are bound by their instructions more than by their bytes (the quantize pass, sm_90 SASS per 16 x 128
tile and thread: 848 instructions rounding to nearest, 1136 stochastically, for 16 elements and two outputs;
bench/NOTES_floor.md 42, 44), so the per-element arithmetic is kept to adds, multiplies, min/max and bit operations.

The per-block arithmetic is that of formats.py `_nvfp4_blocked` (torchao `nvfp4_quantize`) operation for
operation, with IEEE divisions (`div_rn`; Triton's `/` is an approximate division) and the E4M3 rounding
of block scales done on the bits (round to nearest even, the scales being clamped to E4M3's normal
range), so output `a` is bit-identical to `quantize_nvfp4(x, dtype=torch.bfloat16)`. Output `b` differs
from the torch path only in the transform's arithmetic: its FP32 sums are quantized directly (as a fused
hardware kernel does), where the torch path on GPU rounds them to BF16 first. Stochastic rounding
(gradients) draws with Triton's Philox (4x32, 10 rounds) from a seed tensor drawn from torch's CUDA
generator, so runs are reproducible under torch.manual_seed. It uses 8 random bits per element and output,
the resolution of Blackwell's cvt.rs.satfinite.e2m1x4.f32 (one 32-bit word per 4 FP4 values): it rounds up
with probability floor(256 f) / 256 for a fraction f of the grid step, as formats.round_to_e2m1 does (on the
GPU with one FMA rounded toward zero, PTX fma.rz.f32); one Philox call serves 16 roundings.

`nvfp4_dual_quantize` is a `torch.library.triton_op`: torch.compile calls the two kernels from the
compiled graph (no graph break). It needs a CUDA tensor in BF16, 2D, with both dims multiples of 16;
nvfp4.NVFP4EmulatedLinear routes other inputs to the torch path. On CPU the kernels run under Triton's
interpreter (TRITON_INTERPRET=1), which is how the unit tests check them without a GPU.
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - any import problem means: no fast path
    HAVE_TRITON = False

E4M3_MAX = 448.0
E4M3_TINY = 2.0 ** -6
E2M1_MAX = 6.0
# dual_quantize_launch's default tile when called without one (the interpreter tests, the kernel benches); the
# training step's tile is launch_config's (2 token groups, not 4)
BLOCK_N = 128  # features per program
GROUPS = 4  # runs of 16 tokens per program
NUM_WARPS = 4
# The amax pass reads the operand once and keeps two maxima: it takes larger tiles than the quantize pass (whose
# 16 x 128 / 16 x 256 tiles left the amax pass at ~1.4x its floor with 16-32 K programs per 8192 x 8192 operand).
AMAX_BLOCK_N = 256
AMAX_GROUPS = 4


def launch_config(n: int, stochastic: bool) -> dict:
    """The quantize pass's tile: 128 features x 2 groups of 16 tokens on 4 warps, for both roundings.
    - 128 features on 4 warps, measured on an H100 over the 1b model's operand shapes. Stochastic rounding:
      bench/results/nvfp4_sr_layout_ab_2026-11-24T1950_H100.json (0.305 ms at 8192 x 8192 against 0.334 at 256
      features, whose random bytes take more registers). Round to nearest: once the amax pass had tiles of its own,
      128 features were the faster or equal at every shape (bench/results/nvfp4_kernel_bench_2026-11-24T2133_*:
      8192 x 2048 0.079 against 0.110 ms at 256, 8192 x 4096 0.135 / 0.138, 8192 x 8192 0.252 / 0.254).
    - 2 token groups per program, measured on an H200 with the host out of the timing (bench/nvfp4_quant_probe.py,
      CUDA graphs; bench/results/nvfp4_quant_probe_2026-11-29T0115_*, two runs): 16.28 against 16.73 ms per 1b
      step over the step's 144 launches, faster at every shape and rounding, the same bits (a program's tile only
      decides which program quantizes which rows; the random draws' counters are per row and column)."""
    return dict(block_n=128, groups=2, num_warps=4)


if HAVE_TRITON:
    @triton.jit
    def _rht_tile(h_ptr, x, DOT_BF16: tl.constexpr):
        """RHT(x) of a (16, BLOCK_N) tile: rht^T @ x with FP32 accumulation (h holds rht^T, BF16). On the
        GPU a BF16 dot (exact products: x is BF16, h is +-1/4); the interpreter's BF16 dot is not reliable,
        so there it is an FP32 (IEEE) dot of the same values."""
        r16 = tl.arange(0, 16)
        h = tl.load(h_ptr + r16[:, None] * 16 + r16[None, :])
        if DOT_BF16:
            return tl.dot(h, x.to(tl.bfloat16), out_dtype=tl.float32)
        return tl.dot(h.to(tl.float32), x.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)

    @triton.jit
    def _rht_tile_t(h_ptr, x, DOT_BF16: tl.constexpr):
        """RHT(x)^T of a (16, BLOCK_N) tile, (BLOCK_N, 16): x^T @ rht (h holds rht^T, loaded transposed), the
        same exact products as _rht_tile summed in FP32 (by the tensor cores in their own order on the GPU)."""
        r16 = tl.arange(0, 16)
        ht = tl.load(h_ptr + r16[None, :] * 16 + r16[:, None])
        if DOT_BF16:
            return tl.dot(tl.trans(x.to(tl.bfloat16)), ht, out_dtype=tl.float32)
        return tl.dot(tl.trans(x.to(tl.float32)), ht.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)

    @triton.jit
    def _scalar_div(x, d: tl.constexpr, CUDA_SEMANTICS: tl.constexpr):
        """x / d for a Python-float d as torch computes it: on CUDA torch multiplies by the FP32 reciprocal
        (its division kernel's CPU-scalar path); on CPU it divides (IEEE)."""
        if CUDA_SEMANTICS:
            return x * (1.0 / d)
        return tl.math.div_rn(x, d)

    @triton.jit
    def _nvfp4_dual_amax_kernel(x_ptr, h_ptr, partial_ptr, M, N, stride_m, BLOCK: tl.constexpr,
                                GROUPS: tl.constexpr, HAS_RHT: tl.constexpr, DOT_BF16: tl.constexpr):
        """Per program (GROUPS x 16 tokens, BLOCK features): max |x| and max |RHT(x)| into partial[pid]. The
        maxima are kept element by element over the groups and reduced across the threads once, at the end."""
        pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        acc_a = tl.zeros((16, BLOCK), dtype=tl.float32)
        acc_b = tl.zeros((16, BLOCK), dtype=tl.float32)
        for g in tl.static_range(GROUPS):
            rows = (tl.program_id(0) * GROUPS + g) * 16 + tl.arange(0, 16)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=mask, other=0.0)
            acc_a = tl.maximum(acc_a, tl.abs(x.to(tl.float32)))
            if HAS_RHT:
                acc_b = tl.maximum(acc_b, tl.abs(_rht_tile(h_ptr, x, DOT_BF16)))
        amax_a = tl.max(tl.max(acc_a, axis=1), axis=0)
        if HAS_RHT:
            amax_b = tl.max(tl.max(acc_b, axis=1), axis=0)
        else:
            amax_b = amax_a
        tl.store(partial_ptr + 2 * pid, amax_a)
        tl.store(partial_ptr + 2 * pid + 1, amax_b)

    @triton.jit
    def _round_e4m3(v):
        """Round positive FP32 values in E4M3's normal range to E4M3 (nearest, ties to even), on the bits."""
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits (mask 0xFFF00000)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _grid_power(a):
        """2^k for the E2M1 grid step 2^(k - 1) at a >= 0 (0.5 below 2, 1 below 4, 2 up to 6): the power of two of
        max(a, 1), on the bits (its exponent field alone). The rounding constants below are this times a constant,
        a product that is exact, so each add of a constant is one FFMA (a + 2^k C rounds once, as a + M did)."""
        return (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _fma_rz(p, c: tl.constexpr, a, PTX: tl.constexpr):
        """p * c + a rounded toward zero, for a >= 0 and an exact product p * c >= a: PTX's fma.rz.f32 on the GPU;
        elsewhere (Triton's interpreter) the nearest sum, one ulp less where it rounded up (the difference to
        b = p * c is exact there, so comparing it with a tells)."""
        if PTX:
            return tl.inline_asm_elementwise("fma.rz.f32 $0, $1, $2, $3;", "=f,f,f,f", [p, tl.full(p.shape, c,
                                             tl.float32), a], dtype=tl.float32, is_pure=True, pack=1)
        b = p * c
        s = a + b
        return (s.to(tl.int32, bitcast=True) - ((s - b) > a).to(tl.int32)).to(tl.float32, bitcast=True)

    @triton.jit
    def _nvfp4_values(data, max_abs, pts, rbits, STOCH: tl.constexpr, CUDA_SEMANTICS: tl.constexpr):
        """E2M1 element x E4M3 block scale for FP32 `data` with block maxima `max_abs` (broadcastable)
        and the FP32 per-tensor scale `pts` > 0: formats._nvfp4_blocked, op for op. `rbits`: int32 with
        8 random bits at bits 0..7 and zeros elsewhere, for stochastic rounding (ignored without STOCH)."""
        block_scale = _scalar_div(max_abs, 6.0, CUDA_SEMANTICS)
        scaled_block = tl.math.div_rn(block_scale, pts)
        e4m3 = _round_e4m3(tl.minimum(tl.maximum(scaled_block, 0.015625), 448.0))
        reciprocal = tl.math.div_rn(tl.math.div_rn(1.0, pts), e4m3)
        # torch's where(data == 0, 0.0, data * reciprocal) keeps zeros zero where the reciprocal overflows to inf
        # (tensor amax below ~8e-36) and turns -0.0 into +0.0. Without the select, one FFMA per element: the
        # reciprocal capped at FLT_MAX (0 * FLT_MAX = 0), and + 0.0, under which -0.0 becomes +0.0 and every other
        # product is unchanged (fma(x, r, 0) = RN(x r); the sign of a product that underflows to zero is kept).
        scaled = data * tl.minimum(reciprocal, 3.4028234663852886e38) + 0.0
        # torch clamps `scaled` to [-6, 6] and rounds its magnitude with its sign kept apart: the clamp on the
        # magnitude alone is the same (one min instead of a max and a min), the sign being read from `scaled`.
        a = tl.minimum(tl.abs(scaled), 6.0)
        if STOCH:
            # Stochastic rounding with 8 random bits, as Blackwell's cvt.rs.satfinite.e2m1x4.f32: the random
            # bits are added just below the bits E2M1 keeps, then everything below those is cut off. With
            # t = a / step and f = t - floor(t), that rounds up with probability floor(256 f) / 256. With the
            # FP32 adder: M = 1.5 * 2^15 * step has an ulp of step / 256, so a + M rounded toward zero is M plus
            # floor(256 a / step) ulps, i.e. 256 floor(t) + floor(256 f). Adding the random byte (0..255, at bits
            # 0..7) to those bits carries into the step's bits with probability floor(256 f) / 256, the mask
            # cuts the 8 bits below the step off, and M comes off exactly. a <= 6 stays in M's binade.
            p = _grid_power(a)  # M = 1.5 * 2^14 * p
            t = _fma_rz(p, 24576.0, a, CUDA_SEMANTICS)
            mag = ((t.to(tl.int32, bitcast=True) + rbits) & -256).to(tl.float32, bitcast=True) - p * 24576.0
        else:
            # Round half to even onto E2M1's grid with the FP32 adder: a + M lands where the spacing of FP32
            # numbers is the step (M = 1.5 * 2^23 * step), so the addition itself rounds to the grid, ties to
            # even (an even significand is an even multiple of the step), and subtracting M back is exact. Two
            # adds instead of floor, fraction and tie tests: same values as torch.round(a / step) * step.
            p = _grid_power(a)  # M = 1.5 * 2^22 * p
            mag = (a + p * 6291456.0) - p * 6291456.0
        # copysign on the bits (a negated +0.0 may compile to 0 - 0 = +0.0; torch.copysign gives -0.0). The sign
        # of the unclamped `scaled` is that of the clamped one.
        sign = scaled.to(tl.int32, bitcast=True) & -2147483648
        element = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return element * e4m3

    @triton.jit
    def _spread_bytes(w_lo, w_hi, CH: tl.constexpr):
        """The 8 bytes of two (16, CH) Philox output words as one byte per element of a (16, 8 CH) tile, each
        in bits 0..7 of an int32 (see _nvfp4_values): column 8 j + 4 i + b gets byte b of word i (w_lo, w_hi)
        at chunk column j."""
        pair = tl.join(w_lo, w_hi).to(tl.uint32, bitcast=True)  # (16, CH, 2)
        shifts = tl.arange(0, 4).to(tl.uint32) * 8
        r = (pair[:, :, :, None] >> shifts[None, None, None, :]) & 0xFF  # (16, CH, 2, 4)
        return tl.reshape(r, (16, CH * 8)).to(tl.int32, bitcast=True)

    @triton.jit
    def _quant_tile(x_ptr, h_ptr, a_ptr, b_ptr, rows, cols, M, N, stride_m, pts_a, pts_b,
                    r_a, r_b, W: tl.constexpr, HAS_RHT: tl.constexpr, STOCH: tl.constexpr,
                    DOT_BF16: tl.constexpr, CUDA_SEMANTICS: tl.constexpr):
        """Both outputs of one (16 tokens, W features) tile; W a multiple of 16."""
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x_raw = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=mask, other=0.0)
        x = x_raw.to(tl.float32)
        # a: 1x16 blocks along the features (masked columns are zeros).
        blocks = tl.reshape(x, (16, W // 16, 16))
        bmax = tl.max(tl.abs(blocks), axis=2)
        va = _nvfp4_values(blocks, bmax[:, :, None], pts_a, tl.reshape(r_a, (16, W // 16, 16)),
                           STOCH, CUDA_SEMANTICS)
        va = tl.reshape(va, (16, W))
        tl.store(a_ptr + rows[:, None] * N + cols[None, :], va.to(tl.bfloat16), mask=mask)
        # b: RHT along the tokens, then 1x16 blocks along the tokens (one block per column of the tile).
        # Computed transposed, (W, 16): each block is a row, so its maximum and its scale are worked out by the few
        # threads of a row of the product's layout (4) rather than by every thread of a column (8 in the (16, W)
        # product's), and the W x 16 product is one Hopper wgmma (M = W) instead of W / 8 mma.sync tiles.
        if HAS_RHT:
            yt = _rht_tile_t(h_ptr, x_raw, DOT_BF16)
        else:
            yt = tl.trans(x)
        cmax = tl.max(tl.abs(yt), axis=1)
        vb = _nvfp4_values(yt, cmax[:, None], pts_b, tl.trans(r_b), STOCH, CUDA_SEMANTICS)
        tl.store(b_ptr + rows[None, :] * N + cols[:, None], vb.to(tl.bfloat16), mask=tl.trans(mask))

    @triton.jit
    def _nvfp4_dual_quant_kernel(x_ptr, h_ptr, amax_ptr, seed_ptr, a_ptr, b_ptr, pts_ptr, M, N, stride_m,
                                 BLOCK: tl.constexpr, GROUPS: tl.constexpr, HAS_RHT: tl.constexpr,
                                 STOCH: tl.constexpr, DOT_BF16: tl.constexpr, CUDA_SEMANTICS: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        amax_a = tl.load(amax_ptr)
        amax_b = tl.load(amax_ptr + 1)
        pts_a = _scalar_div(amax_a, 2688.0, CUDA_SEMANTICS)  # per_tensor_amax_to_scale: amax / (448 * 6)
        pts_b = _scalar_div(amax_b, 2688.0, CUDA_SEMANTICS)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(pts_ptr, pts_a)
            tl.store(pts_ptr + 1, pts_b)
        # An all-zero operand (amax 0, scale 0) quantizes to zeros, as in torch; computed with a scale of 1 instead,
        # it does (every element is 0, and so is what it rounds to) without the NaN of 0 / 0 in the block scales,
        # so no per-element select is needed. The stored scales stay 0.
        pts_a = tl.where(amax_a > 0, pts_a, 1.0)
        pts_b = tl.where(amax_b > 0, pts_b, 1.0)
        seed = tl.load(seed_ptr)
        CH: tl.constexpr = BLOCK // 8  # chunk columns of 8 features per tile (stochastic rounding)
        for g in tl.static_range(GROUPS):
            rows = (pid_m * GROUPS + g) * 16 + tl.arange(0, 16)
            cols = pid_n * BLOCK + tl.arange(0, BLOCK)
            if STOCH:
                # One Philox call per (token, chunk column j of 8 features): its four 32-bit outputs give 16
                # bytes, one per element and output of those 8 features (words 0-1 for `a`, 2-3 for `b`): 16
                # roundings per call, as the hardware's one 32-bit word per 4 FP4 values. The bytes are spread
                # over the whole tile (_spread_bytes), which is then quantized in one piece like the
                # round-to-nearest path. Counters: row * (chunk columns in the grid) + the column's index in the
                # grid, the grid being num_programs(1) tiles of CH chunk columns, so distinct for every
                # (row, pid_n, j) of the launch, masked tail columns included.
                j = tl.arange(0, CH)
                counters = rows[:, None] * (tl.num_programs(1) * CH) + (pid_n * CH + j)[None, :]
                w0, w1, w2, w3 = tl.randint4x(seed, counters)
                r_a, r_b = _spread_bytes(w0, w1, CH), _spread_bytes(w2, w3, CH)
            else:  # not read without STOCH
                r_a = tl.zeros((16, BLOCK), dtype=tl.int32)
                r_b = r_a
            _quant_tile(x_ptr, h_ptr, a_ptr, b_ptr, rows, cols, M, N, stride_m, pts_a, pts_b,
                        r_a, r_b, BLOCK, HAS_RHT, STOCH, DOT_BF16, CUDA_SEMANTICS)


def rht_operand(rht: torch.Tensor, device) -> torch.Tensor:
    """The kernels' form of the transform: rht^T in BF16 (entries +-1/4, exact)."""
    return rht.t().contiguous().to(device=device, dtype=torch.bfloat16)


def dual_quantize_launch(x: torch.Tensor, h: torch.Tensor, seed: torch.Tensor, rht: bool, stochastic: bool,
                         wrap=lambda kernel: kernel, *, block_n: int = BLOCK_N, groups: int = GROUPS,
                         num_warps: int = NUM_WARPS, amax_block_n: int = AMAX_BLOCK_N,
                         amax_groups: int = AMAX_GROUPS):
    """Launch both kernels (under the interpreter too): returns (a, b, pts) with pts = [pts_a, pts_b].
    The global maxima are reduced from per-program partials (no atomics on one address); the amax pass has its
    own tile (`amax_block_n` features x 16 `amax_groups` tokens), the quantize pass `block_n` x 16 `groups`."""
    amax = amax_launch(x, h, rht, wrap, amax_block_n=amax_block_n, amax_groups=amax_groups)
    return quantize_launch(x, h, amax, seed, rht, stochastic, wrap, block_n=block_n, groups=groups,
                           num_warps=num_warps)


def amax_launch(x: torch.Tensor, h: torch.Tensor, rht: bool, wrap=lambda kernel: kernel, *,
                amax_block_n: int = AMAX_BLOCK_N, amax_groups: int = AMAX_GROUPS) -> torch.Tensor:
    """The amax pass alone: [max |x|, max |RHT(x)|] (FP32; without `rht` both max |x|), reduced from per-program
    partials (no atomics on one address)."""
    m, n = x.shape
    amax_grid = (triton.cdiv(m, 16 * amax_groups), triton.cdiv(n, amax_block_n))
    partial = torch.empty((amax_grid[0] * amax_grid[1], 2), device=x.device, dtype=torch.float32)
    wrap(_nvfp4_dual_amax_kernel)[amax_grid](x, h, partial, m, n, x.stride(0), BLOCK=amax_block_n,
                                             GROUPS=amax_groups, HAS_RHT=rht, DOT_BF16=x.is_cuda, num_warps=NUM_WARPS)
    return partial.amax(dim=0)


def quantize_launch(x: torch.Tensor, h: torch.Tensor, amax: torch.Tensor, seed: torch.Tensor, rht: bool,
                    stochastic: bool, wrap=lambda kernel: kernel, *, block_n: int = BLOCK_N, groups: int = GROUPS,
                    num_warps: int = NUM_WARPS):
    """The quantize pass alone, from the two maxima `amax` = [max |x|, max |RHT(x)|] (FP32, 2 elements, unit stride;
    the amax pass's, or those of the kernel that produced x: nvfp4_swiglu_triton): returns (a, b, pts)."""
    m, n = x.shape
    pts = torch.empty(2, device=x.device, dtype=torch.float32)
    a = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    b = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    on_gpu = x.is_cuda
    grid = (triton.cdiv(m, 16 * groups), triton.cdiv(n, block_n))
    wrap(_nvfp4_dual_quant_kernel)[grid](x, h, amax, seed, a, b, pts, m, n, x.stride(0), BLOCK=block_n,
                                         GROUPS=groups, HAS_RHT=rht, STOCH=stochastic, DOT_BF16=on_gpu,
                                         CUDA_SEMANTICS=on_gpu, num_warps=num_warps)
    return a, b, pts


if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton

    @triton_op("plab::nvfp4_dual_quantize", mutates_args=())
    def _dual_quantize_op(x: torch.Tensor, h: torch.Tensor, seed: torch.Tensor, rht: bool,
                          stochastic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return dual_quantize_launch(x, h, seed, rht, stochastic, wrap=wrap_triton,
                                    **launch_config(x.shape[1], stochastic))

    @triton_op("plab::nvfp4_quantize_given_amax", mutates_args=())
    def _quantize_given_amax_op(x: torch.Tensor, h: torch.Tensor, amax: torch.Tensor, seed: torch.Tensor, rht: bool,
                                stochastic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return quantize_launch(x, h, amax, seed, rht, stochastic, wrap=wrap_triton,
                               **launch_config(x.shape[1], stochastic))


def nvfp4_dual_quantize(x: torch.Tensor, h: torch.Tensor, *, rht: bool, stochastic: bool):
    """(a, b, pts): `a` NVFP4 values of x in 1x16 blocks along dim 1, `b` of RHT(x) (if `rht`) in 1x16
    blocks along dim 0, both BF16 [M, N]; pts = their FP32 per-tensor scales, shape (2,). x: a 2D BF16 CUDA
    tensor with both dims multiples of 16 (any strides); `h` is `rht_operand(...)`."""
    if x.stride(1) != 1:  # the kernels read rows with unit stride along the features
        x = x.contiguous()
    return torch.ops.plab.nvfp4_dual_quantize(x, h, _seed(x, stochastic), rht, stochastic)


def _seed(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Stochastic rounding's Philox seed, drawn from torch's generator on x's device (zeros without it)."""
    if stochastic:
        return torch.randint(0, 2 ** 31 - 1, (1,), device=x.device, dtype=torch.int64)
    return torch.zeros(1, device=x.device, dtype=torch.int64)


def nvfp4_dual_quantize_given_amax(x: torch.Tensor, h: torch.Tensor, amax: torch.Tensor, *, rht: bool,
                                   stochastic: bool):
    """nvfp4_dual_quantize's (a, b, pts) without its amax pass: `amax` = [max |x|, max |RHT(x)|] (FP32; with `rht`
    False both max |x|) computed by the kernel that produced x (nvfp4_swiglu_triton). x: unit column stride."""
    if x.stride(1) != 1:
        x = x.contiguous()
    return torch.ops.plab.nvfp4_quantize_given_amax(x, h, amax, _seed(x, stochastic), rht, stochastic)

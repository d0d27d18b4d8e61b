"""The fused NVFP4 Triton quantizers (training/precision/nvfp4_triton.py) against the torch quantizers of
formats.py (themselves bit-exact with torchao), on CPU under Triton's interpreter. The interpreter must be
on before triton is first imported, so test_nvfp4_triton_interpreted.py runs this file in a subprocess
with TRITON_INTERPRET=1; collected directly without it, it skips. The GPU run of the same comparison is
bench/nvfp4_kernel_bench.py."""
from __future__ import annotations

import pytest
import torch

from tests.interpreted import require_interpreter

pytest.importorskip("triton")

from training.precision.formats import (nvfp4_per_tensor_scale, quantize_nvfp4,  # noqa: E402
                                        random_hadamard_transform, random_sign_vector, rht_matrix)


require_interpreter("test_nvfp4_triton_interpreted.py")


@pytest.fixture(scope="module")
def nt():
    from training.precision import nvfp4_triton
    return nvfp4_triton


def _operand(rows, cols, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(rows, cols, generator=g)
    elif kind == "heavy":  # Student-t-like tails plus a few x1e4 outliers, per-row magnitudes
        x = torch.randn(rows, cols, generator=g) / torch.rand(rows, cols, generator=g).clamp_min(0.02).sqrt()
        x.view(-1)[torch.randint(0, x.numel(), (5,), generator=g)] *= 1e4
    elif kind == "tiny":
        x = torch.randn(rows, cols, generator=g) * 1e-30
    elif kind == "ties":  # every block's scale is 1 and its values sit on E2M1's rounding ties (and grid points)
        grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 3.0, 4.0, 0.0, 0.1, 2.2, 4.9, 5.5])
        x = grid[torch.randint(0, len(grid), (rows, cols), generator=g)]
        x = x * torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
        x[:, ::16] = 6.0  # each block along the features holds 6: block scale 6 / 6 = 1
        x[::16, :] = 6.0  # and each block along the tokens
        x[0, 0] = 2688.0  # the global amax: per-tensor scale 2688 / (448 * 6) = 1
        return x.bfloat16()
    x = x * torch.exp(torch.randn(rows, 1, generator=g))
    x[1, :16] = 0  # an all-zero block along the features
    x[16:32, 5] = 0  # an all-zero block along the tokens
    x[2, 7] = x[20, 40] = -0.0  # negative zeros: torch's quantizer gives +0 for them
    return x.bfloat16()


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kind", ["normal", "heavy", "tiny", "ties"])
@pytest.mark.parametrize("cols,config", [(96, {}), (160, {}),  # 160: a partial BLOCK_N tile (masked columns)
                                         (160, dict(block_n=64, groups=1, num_warps=2)),
                                         (96, dict(block_n=32, groups=2, num_warps=8)),
                                         # the amax pass on its own tiles: smaller, and larger than the operand
                                         (160, dict(block_n=64, groups=1, amax_block_n=32, amax_groups=1)),
                                         (96, dict(block_n=32, groups=2, amax_block_n=512, amax_groups=8))])
def test_both_outputs_are_bit_exact_with_the_torch_quantizers(nt, kind, cols, config):
    x = _operand(48, cols, kind)  # 48 tokens: with 4 groups of 16 per program, a partial row block
    m = rht_matrix(random_sign_vector(0))
    seed = torch.zeros(1, dtype=torch.int64)
    a, b, pts = nt.dual_quantize_launch(x, nt.rht_operand(m, "cpu"), seed, True, False, **config)
    ref_a = quantize_nvfp4(x, dtype=torch.bfloat16)
    assert _same_bits(a, ref_a.values) and torch.equal(pts[0], ref_a.outer)
    # Wgrad operand: RHT along the tokens in FP32 (the CPU path's arithmetic), 1x16 blocks along the tokens.
    ref_b = quantize_nvfp4(random_hadamard_transform(x, m, axis=0), axis=0, dtype=torch.bfloat16)
    assert _same_bits(b, ref_b.values) and torch.equal(pts[1], ref_b.outer)
    # Without the transform: the plain token-blocked quantization.
    _, b_plain, _ = nt.dual_quantize_launch(x, nt.rht_operand(m, "cpu"), seed, False, False)
    assert _same_bits(b_plain, quantize_nvfp4(x, axis=0, dtype=torch.bfloat16).values)


def test_an_all_zero_operand_gives_zeros_not_nan(nt):
    x = torch.zeros(32, 32, dtype=torch.bfloat16)
    a, b, pts = nt.dual_quantize_launch(x, nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu"),
                                        torch.zeros(1, dtype=torch.int64), True, True)
    assert not a.any() and not b.any() and not pts.any()


@pytest.mark.parametrize("tiny", [False, True])
def test_block_scales_where_a_product_with_the_reciprocal_rounds_to_another_e4m3_scale(nt, tiny):
    """The block scale divides by the per-tensor scale (an IEEE division, as torch does). At amax 896 these 29 block
    maxima (c 2^k, c in two values) are the BF16 ones whose E4M3 scale a product with the per-tensor reciprocal,
    block_scale * RN(1 / pts), would round to another value, with the interpreter's (CPU) semantics, block_scale =
    max / 6 (found over every BF16 maximum; on the GPU, max * RN(1 / 6), they are others, e.g. 0.0024566650390625
    2^k at amax 49). A kernel that trades the division for that product fails here (bench/NOTES_floor.md 82).
    `tiny`: the same operand times 2^-80 (a per-tensor scale below 2^-64)."""
    hard = [c * 2.0 ** k for c in (0.044921875, 0.060546875) for k in range(15) if c * 2.0 ** k <= 896]
    assert len(hard) == 29
    g = torch.Generator().manual_seed(3)
    x = torch.rand(32, 32, generator=g) * 0.5 + 0.25  # each block: its maximum and smaller values
    blocks = x.view(64, 16)
    for i, w in enumerate(hard):
        blocks[i] *= w
        blocks[i, i % 16] = w
    blocks[63, 5] = 896.0  # the tensor's amax
    x = (x * (2.0 ** -80 if tiny else 1.0)).bfloat16()
    a, _, pts = nt.dual_quantize_launch(x, nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu"),
                                        torch.zeros(1, dtype=torch.int64), True, False)
    ref = quantize_nvfp4(x, dtype=torch.bfloat16)
    assert _same_bits(a, ref.values) and torch.equal(pts[0], ref.outer)


def _e2m1_fraction(a):
    """(lower neighbour on E2M1's grid, grid step, f) for a >= 0: a = lower + f * step, f in [0, 1), exactly."""
    a = a.double()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    t = a / step
    return torch.floor(t) * step, step, t - torch.floor(t)


def _sr_counts(p, draws):
    """(expected count, binomial sigma) of ups over elements with up-probabilities p, rounded `draws` times each."""
    return float(p.sum()) * draws, float((p * (1 - p)).sum() * draws) ** 0.5


def test_stochastic_rounding_lands_on_the_two_neighbours_with_8_bit_probabilities(nt):
    """Stochastic rounding with 8 random bits (as Blackwell's cvt.rs): a value a = lower + f * step between two
    E2M1 grid points becomes one of the two, the upper one with probability floor(256 f) / 256, not f.

    Every block's maximum (and the tensor's) is 6, so the per-tensor and block scales give the reciprocal
    1 - 2^-24 (FP32's rounding of 2688 / 6 / 448) and each value a lands one FP32 ulp under its BF16 input:
    256 f is just under an integer, where 8 bits and full precision differ most (P = f - 1/256 + 2^-20 or
    so; a 16-bit or full-precision rounding goes up with probability f). Below 1 that ulp is lost by the
    kernel's a + 1 (it rounds up), so these values also check that it is truncated back. Values are picked per
    spacing regime of E2M1 (a in [0.25, 0.5), [0.5, 1), [1, 2), [2, 4), [4, 6)) and per class: low, the
    smallest f < 5/256 of the regime (P a quarter or more under f); high, the largest f > 251/256 (rounds
    down with probability 1 - P, several times 1 - f); mid-range. Up-counts must sit within 4.5 binomial
    sigmas of sum(P) per (class, regime) cell (a regime's rate off by 1/256 fails in its low and high cells)
    and, per byte of the Philox outputs and pooled over the low and over the high class, more than that from
    sum(f). Both outputs (b without the RHT: token blocks of the same values) and both signs."""
    peak = 6.0
    xs = torch.arange(0x3E80, 0x40C0, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # [0.25, 6)
    xs = xs[xs.view(torch.int16) & 0x7F != 0]  # not powers of two (those are exact: f = 0)
    pts = nvfp4_per_tensor_scale(torch.tensor(peak))
    e4m3 = (torch.tensor(peak) / 6.0 / pts).clamp(2.0 ** -6, 448.0).to(torch.float8_e4m3fn).float()
    reciprocal = (1.0 / pts) / e4m3  # formats._nvfp4_blocked's ops, which the kernel matches bit for bit
    assert float(reciprocal) == 1 - 2.0 ** -24
    a_all = xs.float() * reciprocal
    _, _, f_all = _e2m1_fraction(a_all)
    classes = {"low": f_all < 5 / 256, "high": f_all > 251 / 256, "mid": (f_all > 0.25) & (f_all < 0.75)}
    regimes = [(0.25, 0.5), (0.5, 1), (1, 2), (2, 4), (4, 6)]
    cells = []  # (class, regime, indices into xs)
    for name, in_class in classes.items():
        for lo_r, hi_r in regimes:
            cand = torch.nonzero(in_class & (a_all >= lo_r) & (a_all < hi_r)).flatten()
            if name == "low":  # the most telling: the smallest f (P = f - 1/256 the furthest from f)
                cand = cand[torch.argsort(f_all[cand])][:4]
            elif name == "high":
                cand = cand[torch.argsort(-f_all[cand])][:4]
            if len(cand):
                cells.append((name, lo_r, cand[torch.linspace(0, len(cand) - 1, min(4, len(cand))).long()]))
    assert {(n, r) for n, r, _ in cells} >= {(n, r) for n in classes for r, _ in regimes} - {("low", 0.25)}
    rows, cols = 64, 512
    g = torch.Generator().manual_seed(0)
    cell = torch.randint(0, len(cells), (rows, cols), generator=g)
    pick = torch.randint(0, 4, (rows, cols), generator=g)
    value = torch.stack([c[2][torch.arange(4) % len(c[2])] for c in cells])[cell, pick]  # index into xs
    x = xs[value].float() * torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    x[:, ::16] = peak  # each block along the features holds the peak
    x[::16, :] = peak  # and each block along the tokens
    x = x.bfloat16()
    keep = torch.ones(rows, cols, dtype=torch.bool)
    keep[:, ::16] = False
    keep[::16, :] = False
    lower, step, f = _e2m1_fraction(a_all[value])
    p8 = torch.floor(256 * f) / 256
    h = nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu")
    ups = torch.zeros(2, rows, cols, dtype=torch.int64)  # per output
    seeds = 20
    for s in range(seeds):
        outs = nt.dual_quantize_launch(x, h, torch.tensor([1000 + s]), False, True, block_n=256, groups=1)[:2]
        for o, out in enumerate(outs):
            element = out.double() / float(e4m3)  # outputs are E2M1 element x E4M3 block scale
            assert bool((element * x.double() >= 0).all()), "rounding flipped a sign"
            up = element.abs() == lower + step
            assert bool((up | (element.abs() == lower))[keep].all()), "an element left its two neighbours"
            ups[o] += up.long()
    for i, (name, lo_r, _) in enumerate(cells):  # each cell, both outputs: the rate is P's
        sel = keep & (cell == i)
        count = float(ups[:, sel].sum())
        want, sigma = _sr_counts(p8[sel], 2 * seeds)
        assert abs(count - want) <= 4.5 * sigma, (name, lo_r, count, want, sigma)
    # Each of the four bytes of a Philox output (chunk k of the 256-feature tile uses bytes 2 (k % 2) for `a` and
    # the next for `b`), each class pooled over the regimes: P's rate, not f's (a byte that leaks other bits in
    # rounds at f's rate).
    chunk_parity = (torch.arange(cols) % 256) // 32 % 2
    for byte in range(4):
        in_byte = keep & (chunk_parity == byte // 2)[None, :]
        for name in classes:
            sel = in_byte & torch.isin(cell, torch.tensor([i for i, c in enumerate(cells) if c[0] == name]))
            count = float(ups[byte % 2, sel].sum())
            want, sigma = _sr_counts(p8[sel], seeds)
            want_f, sigma_f = _sr_counts(f[sel], seeds)
            assert abs(count - want) <= 4.5 * sigma, (byte, name, count, want, sigma, want_f)
            if name != "mid":  # mid-range, 1/256 is ~3 sigmas of these draws: told apart only at the extremes
                assert abs(want_f - want) > 9 * max(sigma, sigma_f)  # the draws can tell the two rates apart
                assert abs(count - want_f) > 4.5 * sigma_f, (byte, name, count, want, want_f, sigma_f)


@pytest.mark.parametrize("weight_2d", [True, False])
def test_fused_autograd_function_matches_the_torch_path(nt, weight_2d):
    """NVFP4FusedFn (the CUDA fast path's autograd wiring: which operand, which layout, the saved Wgrad operand
    and tile-quantized weight) against EmulatedLinearFn with the same quantizer, RNE so both are deterministic.
    The fused path's GEMMs take BF16 values (as on the GPU), the torch path's FP32 ones: equal up to BF16
    rounding of the products' sums."""
    from training.precision.emulation import EmulatedLinearFn
    from training.precision.nvfp4 import NVFP4FusedFn, NVFP4Quantizer

    q = NVFP4Quantizer(rht=True, stochastic_rounding=False, weight_2d=weight_2d, rht_seed=0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, 64, generator=g).bfloat16()
    w = (torch.randn(48, 64, generator=g) * 0.1).bfloat16()
    dy = torch.randn(2, 32, 48, generator=g).bfloat16()
    outs = []
    for fn in (NVFP4FusedFn, EmulatedLinearFn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn.apply(xi, wi, None, q)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float(), wi.grad.float()))
    for what, a, b in zip(("Y", "dX", "dW"), *outs):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-2, (what, rel)


@pytest.mark.parametrize("stochastic,bias", [(False, False), (True, True)])
def test_gate_and_up_sharing_their_input_quantization_give_the_two_layers_bits(nt, stochastic, bias):
    """NVFP4SharedInputFn (a gated MLP's gate and up reading one X, quantized once) against gate and up as two
    NVFP4FusedFn layers, as autograd runs them: the same Y, dX, dW and bias gradients to the bit, stochastic
    rounding of dY included (its seeds drawn in the order autograd's engine runs the two layers), cached W
    operands for one of the two."""
    from training.precision.nvfp4 import NVFP4FusedFn, NVFP4Quantizer, NVFP4SharedInputFn

    qg, qu = (NVFP4Quantizer(rht=True, stochastic_rounding=stochastic, weight_2d=True, rht_seed=0) for _ in range(2))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 32, 64, generator=g).bfloat16()
    wg, wu = ((torch.randn(48, 64, generator=g) * 0.1).bfloat16() for _ in range(2))
    bg, bu = ((torch.randn(48, generator=g) * 0.1).bfloat16() if bias else None for _ in range(2))
    dgate, dup = (torch.randn(2, 32, 48, generator=g).bfloat16() for _ in range(2))
    fprop = qu.weight_fprop(wu, dtype=torch.bfloat16)
    cached_u = (fprop.values, fprop.outer, fprop.t().values, fprop.t().outer)  # as refresh_weight_cache makes them
    results = []
    for shared in (False, True):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, wg, bg, wu, bu)]
        xi, wgi, bgi, wui, bui = leaves
        torch.manual_seed(3)  # the SR seeds come from torch's generator
        if shared:
            gate, up = NVFP4SharedInputFn.apply(xi, wgi, bgi, wui, bui, qg, qu, None, None, None, None, *cached_u)
        else:
            gate = NVFP4FusedFn.apply(xi, wgi, bgi, qg)
            up = NVFP4FusedFn.apply(xi, wui, bui, qu, *cached_u)
        torch.autograd.backward([gate, up], [dgate, dup])
        results.append([gate, up] + [t.grad for t in leaves if t is not None])
    for a, b in zip(*results):
        assert _same_bits(a, b)


# The tiny preset's widths with two blocks instead of four: the interpreter's time is per quantized layer, and two
# blocks still show every block's MLP set up alike.
TWO_BLOCKS = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}


def test_a_converted_llama_mlp_quantizes_its_input_once_with_the_same_bits(nt, monkeypatch):
    """apply_recipe("nvfp4", share_mlp_input=True) on a tiny Llama (BF16) sets every block's MLP up to quantize its
    input once, and with
    the fused path taken (forced on here, the kernels interpreted on CPU) a training step's loss and every gradient
    equal, to the bit, those of the same model whose MLPs call gate and up separately; SR on, as by default."""
    from training.model import build_model, llama_config
    from training.precision import apply_recipe
    from training.precision.nvfp4 import NVFP4EmulatedLinear, NVFP4SharedInputFn

    monkeypatch.setattr(NVFP4EmulatedLinear, "_fused_path", lambda self, x: True)
    calls = []
    original = NVFP4SharedInputFn.apply
    monkeypatch.setattr(NVFP4SharedInputFn, "apply", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))  # 16 tokens: one block
    runs = []
    for share in (True, False):
        model = build_model(llama_config(TWO_BLOCKS, 256, 32), 0).bfloat16()
        report = apply_recipe(model, "nvfp4", share_mlp_input=True, fused_swiglu=False)
        layers = model.model.layers
        assert any(note.startswith(f"{len(layers)} block(s): linears reading the same input quantize it once where "
                                   "the fused kernels run (MLP gate and up)") for note in report.notes)
        if not share:
            for layer in layers:
                del layer.mlp.forward  # back to LlamaMLP.forward: gate and up each quantize X
        calls.clear()
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert len(calls) == (len(layers) if share else 0)
        runs.append([loss.detach()] + [p.grad for p in model.parameters()])
    bits = {2: torch.int16, 4: torch.int32}
    assert all(torch.equal(a.reshape(-1).view(bits[a.element_size()]), b.reshape(-1).view(bits[b.element_size()]))
               for a, b in zip(*runs))


def test_shared_mlp_input_is_the_default_and_numerics_sampling_sees_gate_and_up(nt, monkeypatch):
    """share_mlp_input is on by default (here with fused_swiglu off, which would run the whole MLP as one function).
    The numerics probe samples each converted linear through a forward hook, which the shared call would bypass: while
    it samples, gate and up run as their own modules (no shared call, a sample for each), with the values of the
    shared call; when it stops, the shared call is back."""
    from training.model import build_model, llama_config
    from training.precision import apply_recipe
    from training.precision.nvfp4 import NVFP4EmulatedLinear, NVFP4SharedInputFn

    monkeypatch.setattr(NVFP4EmulatedLinear, "_fused_path", lambda self, x: True)
    calls = []
    original = NVFP4SharedInputFn.apply
    monkeypatch.setattr(NVFP4SharedInputFn, "apply", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    model = build_model(llama_config(TWO_BLOCKS, 256, 32), 0).bfloat16()
    report = apply_recipe(model, "nvfp4", fused_swiglu=False)
    assert report.options["share_mlp_input"] and not report.options["fused_swiglu"]
    layers = len(model.model.layers)
    assert any(note.startswith(f"{layers} block(s): linears reading the same input quantize it once where the fused "
                               "kernels run (MLP gate and up)") for note in report.notes)
    losses = []
    for sampling in (False, True, False):
        report.set_numerics_sampling(sampling)
        calls.clear()
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=ids).loss)
        assert len(calls) == (0 if sampling else layers)
        if sampling:
            stats = report.collect_numerics()
            for name in ("gate_proj", "up_proj", "down_proj"):
                assert any(f"mlp.{name}/amax_input" in key for key in stats), name
    assert torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])


def test_the_gemm_benchmarks_fused_quantizers_are_the_training_steps(nt, monkeypatch):
    """The GEMM benchmark's "with quantization" mode on CUDA (forced on here, the kernels interpreted on CPU):
    X and dY through the fused kernel exactly as NVFP4FusedFn calls it (dY with stochastic rounding), both
    layouts from one pass, and one weight tile quantization serving Fprop and Dgrad."""
    from training.precision.nvfp4 import NVFP4EmulatedGemmOps
    from training.precision.registry import get_recipe

    monkeypatch.setattr(NVFP4EmulatedGemmOps, "_fused", lambda self: True)
    ops = get_recipe("nvfp4").gemm_ops(torch.device("cpu"))
    q = ops.training
    x = _operand(48, 96, "normal")
    for role, stochastic in (("input", False), ("grad_output", True)):
        torch.manual_seed(0)  # the kernel's Philox seed is drawn from torch's generator
        row, t = ops.quantizer(role)(x, ("row", "t"))
        torch.manual_seed(0)
        a, b, pts = nt.nvfp4_dual_quantize(x, q.rht_operand("cpu"), rht=q.rht, stochastic=stochastic)
        assert _same_bits(row.values, a) and torch.equal(row.outer, pts[0])
        assert _same_bits(t.values, b.t()) and torch.equal(t.outer, pts[1])
    w = _operand(64, 96, "normal")
    w_row, w_t = ops.quantizer("weight")(w, ("row", "t"))
    assert w_t.values.data_ptr() == w_row.values.data_ptr()
    assert torch.equal(w_row.dequantize(), q.weight_fprop(w, dtype=torch.bfloat16).dequantize())


@pytest.mark.parametrize("stochastic", [False, True])
def test_the_training_tile_gives_the_bits_of_one_group_per_program(nt, stochastic):
    """launch_config's tile (what the compiled step runs) only decides which program quantizes which rows: its
    outputs, both roundings, equal one 16-token group per program's to the bit, with 48 tokens (a last program
    whose second group is masked out) and a partial feature tile."""
    x = _operand(48, 160, "heavy")
    h = nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu")
    seed = torch.tensor([7])
    cfg = nt.launch_config(x.shape[1], stochastic)
    assert cfg["groups"] > 1  # else this compares a tile with itself
    mine = nt.dual_quantize_launch(x, h, seed, True, stochastic, **cfg)
    one = nt.dual_quantize_launch(x, h, seed, True, stochastic, **dict(cfg, groups=1))
    assert all(_same_bits(p, q) for p, q in zip(mine[:2], one[:2])) and torch.equal(mine[2], one[2])


@pytest.mark.parametrize("rows,cols,config", [(32, 256, dict(block_n=128, groups=1)),
                                              # a partial tile: the counters' row stride
                                              # must count the masked columns of the last tile too
                                              (32, 384, dict(block_n=256, groups=1))])
def test_stochastic_rounding_draws_independently_per_element_and_output(nt, rows, cols, config):
    """Every element of both outputs gets its own random byte: every element holds the same value (1.3 in BF16,
    which rounds up with probability 151/256; each block's maximum 6 sets all scales alike), so two
    element-outputs sharing a byte would round alike in every draw. Over 40 seeds no two of the element-outputs
    (all of `a` and `b`) round alike in every draw (by chance: ~1e-12 a pair), and the up-events of the 16
    roundings one Philox call serves (8 consecutive features of both outputs at one token) are uncorrelated
    (|r| < 0.035, ~6 sigmas: bytes that overlap or leak bits into each other fail)."""
    x = torch.full((rows, cols), 1.3, dtype=torch.bfloat16)
    x[:, ::16] = 6.0  # each block along the features holds the maximum
    x[::16, :] = 6.0  # and each block along the tokens
    h = nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu")
    keep = torch.ones(rows, cols, dtype=torch.bool)
    keep[:, ::16] = False
    keep[::16, :] = False
    ups_a, ups_b = [], []
    for s in range(40):
        a, b, _ = nt.dual_quantize_launch(x, h, torch.tensor([s]), False, True, **config)
        # the outputs are element x block scale (the per-tensor scale apart): a 6 marks the block scale
        ups_a.append(a.float() > a.float()[0, 0] * 1.25 / 6)
        ups_b.append(b.float() > b.float()[0, 0] * 1.25 / 6)
    ua, ub = torch.stack(ups_a), torch.stack(ups_b)  # (seeds, rows, cols)
    assert 0.55 < float(ua[:, keep].float().mean()) < 0.63 and 0.55 < float(ub[:, keep].float().mean()) < 0.63
    patterns = torch.cat([ua[:, keep], ub[:, keep]], dim=1).t()  # one row per element-output
    codes = (patterns.long() << torch.arange(patterns.shape[1])).sum(1)  # 40 bits each
    assert len(torch.unique(codes)) == len(codes), "two element-outputs share random bits"
    # The 16 roundings one Philox call serves: 8 consecutive features (one group, columns 8 j .. 8 j + 7) of
    # both outputs at one token. Groups whose 8 elements are all kept: (seeds, rows, groups, 8) per output.
    groups = [u.reshape(len(u), rows, cols // 8, 8) for u in (ua, ub)]
    sel = keep.reshape(rows, cols // 8, 8).all(-1)  # (rows, groups)
    events = torch.stack([g[:, :, :, k][:, sel] for g in groups for k in range(8)])  # (16, draws)
    corr = torch.corrcoef(events.reshape(16, -1).float())
    off = corr - torch.eye(16)
    assert float(off.abs().max()) < 0.035, (float(off.abs().max()), events.shape)

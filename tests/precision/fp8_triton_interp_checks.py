"""The fused FP8 cast-transpose (training/precision/fp8_triton.py) against the torch cast of formats.py, on CPU
under Triton's interpreter. The interpreter must be on before triton is first imported, so
test_fp8_triton_interpreted.py runs this file in a subprocess with TRITON_INTERPRET=1; collected directly
without it, it skips. The GPU run of the same comparison, and of the fp8_delayed layer with and without the
fused cast, is bench/kernel_bench.py."""
from __future__ import annotations

import pytest
import torch

from tests.interpreted import require_interpreter

pytest.importorskip("triton")

from training.precision.formats import fp8_cast  # noqa: E402

require_interpreter("test_fp8_triton_interpreted.py")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(scope="module")
def ft():
    from training.precision import fp8_triton
    return fp8_triton


def _operand(rows, cols, dtype, seed=0):
    """Magnitudes over 2^-24..2^14 (times the scale: FP8 subnormals, normals and saturation), zeros, -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-24, 14, (rows, cols), generator=g).float())
    x[0, :5] = 0
    x[1, 1] = -0.0
    return x.to(dtype)


def _codes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("fp8_dtype,scale", [(E4M3, 448.0 / 300.0), (E5M2, 3.7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols,tile", [(64, 128, {}), (130, 70, dict(bm=32, bn=64))])  # partial tiles
def test_both_layouts_are_the_torch_cast_and_the_amax_is_exact(ft, fp8_dtype, scale, dtype, rows, cols, tile):
    x = _operand(rows, cols, dtype)
    s = torch.tensor(scale)
    q, qt, amax = ft.cast_transpose_launch(x, s, fp8_dtype, **tile)
    ref, _ = fp8_cast(x, s, fp8_dtype)
    assert q.dtype == qt.dtype == fp8_dtype
    assert torch.equal(_codes(q), _codes(ref))
    assert torch.equal(_codes(qt), _codes(ref.t().contiguous()))
    assert amax.dtype == torch.float32 and amax == x.float().abs().max()


def test_a_strided_operand_is_cast_as_its_values(ft):
    x = _operand(64, 256, torch.bfloat16)[:, ::2]
    q, qt, _ = ft.fp8_cast_transpose(x, torch.tensor(2.0), E4M3)
    ref, _ = fp8_cast(x, torch.tensor(2.0), E4M3)
    assert torch.equal(_codes(q), _codes(ref)) and torch.equal(_codes(qt), _codes(ref.t().contiguous()))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rows,cols", [(64, 128), (130, 70), (8, 300)])  # whole, partial and thin tiles
def test_the_code_transpose_is_the_torch_transpose(ft, fp8_dtype, rows, cols):
    q, _ = fp8_cast(_operand(rows, cols, torch.float32, seed=rows), torch.tensor(2.0), fp8_dtype)
    qt = ft.byte_transpose_launch(q)
    assert qt.dtype == fp8_dtype and qt.shape == (cols, rows)
    assert torch.equal(_codes(qt), _codes(q.t().contiguous()))

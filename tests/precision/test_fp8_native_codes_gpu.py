"""GPU only (SM89+, skipped elsewhere): the fused FP8 kernels encode with the hardware conversion on a GPU
(triton_math.fp8_code_fast) where Triton's interpreter runs the bit arithmetic of fp8_code; both must give torch's
cast bit for bit. Values that find the differences: ties at every exponent, subnormals and the smallest of them,
halfway below the smallest subnormal, the saturation bound and beyond, infinities, signed zeros and NaN."""
import pytest
import torch

from training.precision.formats import fp8_cast
from training.precision.fp8_triton import cast_transpose_launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 conversions)")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _hard_values(dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    tiny_sub = 2.0 ** (-9 if dtype == E4M3 else -16)
    mant = 3 if dtype == E4M3 else 2
    vals = [0.0, -0.0, fmax, -fmax, fmax * 1.01, fmax * 4, float("inf"), float("-inf"), tiny_sub, tiny_sub / 2,
            tiny_sub * 0.49, tiny_sub * 0.51, tiny_sub * 1.5, tiny_sub * 2.5]
    for e in range(-18, 17):  # exact ties between neighbours, and just either side of them
        step = 2.0 ** (e - mant)
        for k in range(1, 2 ** (mant + 1), 2):
            tie = 2.0 ** e + k * step / 2
            vals += [tie, -tie, tie * (1 + 2 ** -20), tie * (1 - 2 ** -20)]
    v = torch.tensor(vals, dtype=torch.float32)
    rnd = torch.randn(64 * 64 - v.numel() % (64 * 64), generator=torch.Generator().manual_seed(0)) * fmax / 8
    return torch.cat([v, rnd])[: (v.numel() + rnd.numel()) // 64 * 64].reshape(-1, 64)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_transpose_codes_equal_torchs_cast_on_hard_values(dtype):
    x = _hard_values(dtype).cuda()
    x[3, 5] = float("nan")
    one = torch.ones((), device="cuda")
    q, qt, _ = cast_transpose_launch(x, one, dtype)
    want = fp8_cast(x, one, dtype)[0].view(torch.uint8)
    got = q.view(torch.uint8)
    nan = torch.isnan(x)
    assert torch.equal(got[~nan], want[~nan]), f"{(got != want).sum()} codes differ"
    assert torch.isnan(q[nan].float()).all()
    assert torch.equal(qt.view(torch.uint8), got.t())

"""The rescale of gradients computed ahead of the backward (kernels/rescale.py) on CUDA:
in place and out of place, per-row and broadcast scales, unaligned layouts, against
torch's fp32 product rounded once (run on an H200). The cross-entropy's targets:
test_cross_entropy_gpu."""

import pytest
import torch

from quack_kernels.ops.rescale import rescale_launch

pytestmark = pytest.mark.gpu
SHAPES = [(1, 7), (300, 4096), (131072, 1024), (5, 262145)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def expected(grad, dloss, held, dtype):
    factor = torch.where(held != 0, dloss / held, torch.nan)
    return (grad.float() * factor[:, None]).to(dtype)


def with_nans(m, n, dtype, seed):
    """Random rows, every 97th column NaN: a NaN survives only in rows left untouched
    (or scaled), so an untouched row is checked bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    grad = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    grad[:, ::97] = torch.nan
    return grad


@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_moves_only_rows_whose_scale_differs(m, n, dtype):
    """Per-row scales: rows of a differing scale (held 0: NaN) become grad * dloss /
    held, bitwise as torch's fp32 product rounded once; rows of equal scales keep
    their bits."""
    grad = with_nans(m, n, dtype, m + n)
    g = torch.Generator(device="cuda").manual_seed(m)
    held = torch.rand(m, device="cuda", generator=g) + 0.5
    dloss = torch.where(torch.arange(m, device="cuda") % 3 == 0, held, held * 0.37)
    held[1::7] = 0.0
    ours = grad.clone()
    rescale_launch(ours, dloss, held)
    want = torch.where((dloss != held)[:, None], expected(grad, dloss, held, dtype), grad)
    torch.testing.assert_close(ours, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_broadcast_scale(m, n, dtype):
    """One scale pair for every row (the looping grid): equal scales leave every bit,
    others scale every row (held 0: NaN)."""
    grad = with_nans(m, n, dtype, 2 * m + n)
    for upstream, computed_for in ((1.0, 1.0), (0.37, 1.0), (0.37, 0.5), (0.5, 0.5), (1.0, 0.0)):
        dloss = torch.tensor(upstream, device="cuda").expand(m)
        held = torch.tensor(computed_for, device="cuda").expand(m)
        ours = grad.clone()
        rescale_launch(ours, dloss, held)
        torch.testing.assert_close(ours, expected(grad, dloss, held, dtype), rtol=0, atol=0,
                                   equal_nan=True)


@pytest.mark.parametrize("n,offset", [(4096, 0), (4096, 1), (1001, 0), (1001, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_of_place_writes_every_row(n, offset, dtype):
    """An fp32 sum into the head's dtype (or a copy), one scale for every row: every
    row written, a scale of exactly 1 included; views at an element offset with a
    padded row stride (narrower vectors) and an odd row length."""
    m = 3001
    grad = (torch.randn(m, n + 5, device="cuda") * 3)[:, offset:offset + n]
    for scale in (1.0, 0.37):
        dloss = torch.tensor(scale, device="cuda").expand(m)
        held = torch.ones((), device="cuda").expand(m)
        out = torch.full((m, n + 5), torch.nan, device="cuda", dtype=dtype)[:, offset:offset + n]
        rescale_launch(grad, dloss, held, out=out)
        torch.testing.assert_close(out, expected(grad, dloss, held, dtype), rtol=0, atol=0)

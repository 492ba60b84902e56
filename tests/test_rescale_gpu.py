"""The rescale of gradients computed ahead of the backward (kernels/rescale.py) on CUDA:
in place and out of place, per-row and uniform scales, against torch's fp32 product
rounded once (run on an H200). The cross-entropy's targets: test_cross_entropy_gpu."""

import pytest
import torch

from quack_kernels.ops.rescale import rescale_launch

pytestmark = pytest.mark.gpu


def expected(grad, dloss, held, dtype):
    factor = torch.where(held != 0, dloss / held, torch.nan)
    return (grad.float() * factor[:, None]).to(dtype)


@pytest.mark.parametrize("m,n", [(1, 7), (300, 4096), (128256, 1024), (5, 262145)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_in_place_moves_only_rows_whose_scale_differs(m, n, dtype):
    """Rows of a differing scale (held 0: NaN) become grad * dloss / held, bitwise as
    torch's fp32 product rounded once; rows of equal scales keep their bits, NaN and
    all (the kernel does not touch them)."""
    g = torch.Generator(device="cuda").manual_seed(m + n)
    grad = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    grad[:, ::97] = torch.nan  # a NaN survives only in rows left untouched (or scaled)
    held = torch.rand(m, device="cuda", generator=g) + 0.5
    dloss = torch.where(torch.arange(m, device="cuda") % 3 == 0, held, held * 0.37)
    held[1::7] = 0.0
    ours = grad.clone()
    rescale_launch(ours, dloss, held)
    want = torch.where((dloss != held)[:, None], expected(grad, dloss, held, dtype), grad)
    torch.testing.assert_close(ours, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_of_place_writes_every_row(dtype):
    """An fp32 sum into the head's dtype, one scale for every row (an expanded 0-d
    upstream gradient): every row written, a scale of exactly 1 included."""
    m, n = 3001, 4096
    grad = torch.randn(m, n, device="cuda") * 3
    for scale in (1.0, 0.37):
        dloss = torch.tensor(scale, device="cuda")
        held = torch.ones((), device="cuda")
        out = torch.full((m, n), torch.nan, device="cuda", dtype=dtype)
        rescale_launch(grad, dloss.expand(m), held.expand(m), out=out)
        want = expected(grad, dloss.expand(m), held.expand(m), dtype)
        torch.testing.assert_close(out, want, rtol=0, atol=0)

"""rms_norm / layer_norm on the CPU path (CI): references, custom-op contracts, autograd,
input errors, and compile-for-sm_90a of every kernel variant with zero spills."""


import re

import pytest
import torch

import quack_kernels as qk
from quack_kernels.ops import norm as ops
from quack_kernels.primitives import config
from quack_kernels.report import measure, spills

from helpers import assert_close, assert_looping_launch_fits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(*shape, dtype=torch.float32, requires_grad=False):
    return torch.randn(*shape, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)


# --------------------------------------------------------------------- references
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_torch(dtype):
    x, w, b = rand(5, 3, 64, dtype=dtype), rand(64, dtype=dtype), rand(64, dtype=dtype)
    xd, wd, bd = x.double(), w.double(), b.double()
    assert_close(qk.rms_norm(x, w, eps=1e-6),
                 torch.nn.functional.rms_norm(xd, (64,), wd, eps=1e-6), dtype)
    assert_close(qk.layer_norm(x, w, b, eps=1e-5),
                 torch.nn.functional.layer_norm(xd, (64,), wd, bd, eps=1e-5), dtype)


def test_residual_prenorm_and_offset():
    x, r, w = rand(4, 33), rand(4, 33), rand(33)
    y, h = qk.rms_norm(x, w, residual=r, prenorm=True, weight_offset=1.0)
    assert_close(h, x + r)
    ref = torch.nn.functional.rms_norm((x + r).double(), (33,), (w + 1.0).double(), eps=1e-6)
    assert_close(y, ref)
    # prenorm without a residual hands x back as the stream
    y2, h2 = qk.layer_norm(x, prenorm=True)
    assert h2 is x or torch.equal(h2, x)


def test_mixed_dtypes_and_out_dtype():
    x = rand(8, 40, dtype=torch.bfloat16)
    r = rand(8, 40, dtype=torch.float16)
    w = rand(40)
    y, h = qk.layer_norm(x, w, residual=r, prenorm=True, out_dtype=torch.float32,
                         residual_dtype=torch.float32)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    assert_close(h, x.float() + r.float())
    ref = torch.nn.functional.layer_norm(h.double(), (40,), w.double(), eps=1e-5)
    assert_close(y, ref)


def test_residual_stream_is_rounded_before_normalizing():
    x, r = rand(3, 16, dtype=torch.bfloat16), rand(3, 16, dtype=torch.bfloat16)
    y, h = qk.rms_norm(x, residual=r, prenorm=True)
    assert h.dtype == torch.bfloat16
    assert_close(y, torch.nn.functional.rms_norm(h.double(), (16,), eps=1e-6), torch.bfloat16)


def test_stats_from_the_op():
    x = rand(6, 50)
    y, _, mean, rstd = torch.ops.quack_kernels.norm_forward(x, None, None, None, 1e-5, 0.0, False,
                                                            None, None, False)
    assert_close(mean, x.mean(-1))
    assert_close(rstd, torch.rsqrt(x.var(-1, unbiased=False) + 1e-5))


def test_empty_rows():
    x = torch.empty(0, 7, requires_grad=True)
    w = torch.ones(7, requires_grad=True)
    y = qk.rms_norm(x, w)
    assert y.shape == (0, 7)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(7))


# ------------------------------------------------------------------------ autograd
@pytest.mark.parametrize("rms", [True, False])
def test_gradients_match_fp64_autograd(rms):
    x, r = rand(6, 2, 37, requires_grad=True), rand(6, 2, 37, requires_grad=True)
    w, b = rand(37, requires_grad=True), rand(37, requires_grad=True)
    dy, dh = rand(6, 2, 37), rand(6, 2, 37)
    if rms:
        y, h = qk.rms_norm(x, w, residual=r, prenorm=True, weight_offset=0.5)
    else:
        y, h = qk.layer_norm(x, w, b, residual=r, prenorm=True)
    (y * dy).sum().add_((h * dh).sum()).backward()

    leaves = [t.detach().double().requires_grad_() for t in (x, r, w, b)]
    xd, rd, wd, bd = leaves
    hd = xd + rd
    if rms:
        yd = torch.nn.functional.rms_norm(hd, (37,), wd + 0.5, eps=1e-6)
    else:
        yd = torch.nn.functional.layer_norm(hd, (37,), wd, bd, eps=1e-5)
    (yd * dy.double()).sum().add_((hd * dh.double()).sum()).backward()
    for name, ours, ref in (("dx", x, xd), ("dresidual", r, rd), ("dweight", w, wd)):
        assert_close(ours.grad, ref.grad, torch.float32, scale=10.0, name=name)
    if not rms:
        assert_close(b.grad, bd.grad, torch.float32, scale=10.0, name="dbias")


def test_gradcheck_cpu_path():
    # float64 is not a supported dtype: check fp32 with tolerances for fp32 differences
    for rms in (True, False):
        x, r = rand(3, 9, requires_grad=True), rand(3, 9, requires_grad=True)
        w, b = rand(9, requires_grad=True), rand(9, requires_grad=True)

        def fn(x, r, w, b):
            if rms:
                return qk.rms_norm(x, w, residual=r, prenorm=True)
            return qk.layer_norm(x, w, b, residual=r, prenorm=True)

        assert torch.autograd.gradcheck(fn, (x, r, w, b), eps=1e-2, atol=2e-2, rtol=2e-2,
                                        fast_mode=True)


def test_frozen_weight_skips_dweight():
    x = rand(4, 16, requires_grad=True)
    w = rand(16)  # no grad
    qk.rms_norm(x, w).sum().backward()
    assert x.grad is not None and w.grad is None


def test_only_weight_requires_grad():
    x = rand(4, 16)
    w = rand(16, requires_grad=True)
    b = rand(16, requires_grad=True)
    qk.layer_norm(x, w, b).sum().backward()
    assert w.grad is not None and b.grad is not None


def test_opcheck():
    x, r, w, b = rand(4, 24), rand(4, 24), rand(24), rand(24)
    for args in (
        (x, w, b, r, 1e-5, 0.0, False, None, None, True),
        (x, w, None, None, 1e-6, 1.0, True, None, None, False),
        (x.bfloat16(), w, None, r.half(), 1e-6, 0.0, True, torch.float32, torch.float32, True),
    ):
        torch.library.opcheck(torch.ops.quack_kernels.norm_forward.default, args)
    y, h, mean, rstd = torch.ops.quack_kernels.norm_forward(x, w, b, r, 1e-5, 0.0, False, None, None,
                                                            True)
    torch.library.opcheck(torch.ops.quack_kernels.norm_backward.default,
                          (x, h, w, mean, rstd, x, 0.0, False, torch.float32, torch.float32, True,
                           torch.float32))
    torch.library.opcheck(torch.ops.quack_kernels.norm_backward.default,
                          (x, h, None, None, rstd, None, 0.0, True, torch.float32, None, False,
                           None))


def test_one_row_without_leading_dims():
    """A 1-D x (torch's norms take one): every gradient has torch's shape and value, and
    the forward op passes opcheck with x, weight and bias requiring grad (the reference
    summed dweight over no dims, i.e. over all of them, to a 0-d tensor)."""
    x, w, b = rand(24, requires_grad=True), rand(24, requires_grad=True), rand(24, requires_grad=True)
    dy = rand(24)
    for rms in (True, False):
        ours = qk.rms_norm(x, w, eps=1e-6) if rms else qk.layer_norm(x, w, b, eps=1e-5)
        inputs = (x, w) if rms else (x, w, b)
        grads = torch.autograd.grad(ours, inputs, dy)
        xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
        ref = torch.nn.functional.rms_norm(xd, (24,), wd, eps=1e-6) if rms \
            else torch.nn.functional.layer_norm(xd, (24,), wd, bd, eps=1e-5)
        ref_grads = torch.autograd.grad(ref, (xd, wd) if rms else (xd, wd, bd), dy.double())
        for got, want in zip(grads, ref_grads):
            assert got.shape == want.shape
            assert_close(got, want)
        torch.library.opcheck(torch.ops.quack_kernels.norm_forward.default,
                              (x, w, None if rms else b, None, 1e-5, 0.0, rms, None, None, False))


def test_fake_kernels():
    """Under FakeTensorMode the ops give every output's shape and dtype without running:
    y in out_dtype, the stream h only when stored, mean only for LayerNorm, fp32 stats;
    the backward's outputs empty where not asked for."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(3, 5, 24, dtype=torch.bfloat16), torch.empty(24)
        r = torch.empty(3, 5, 24, dtype=torch.float16)
        y, h, mean, rstd = torch.ops.quack_kernels.norm_forward(
            x, w, None, r, 1e-5, 0.0, False, torch.float32, torch.float32, True)
        assert (y.shape, y.dtype, h.shape, h.dtype) == (x.shape, torch.float32, x.shape,
                                                        torch.float32)
        assert mean.shape == rstd.shape == (3, 5) and rstd.dtype == torch.float32
        y, h, mean, rstd = torch.ops.quack_kernels.norm_forward(
            x, None, None, None, 1e-6, 0.0, True, None, None, False)
        assert y.dtype == torch.bfloat16 and h.numel() == mean.numel() == 0
        dx, dres, dw, db = torch.ops.quack_kernels.norm_backward(
            x, x, w, None, rstd, None, 0.0, True, torch.float32, None, True, None)
        assert (dx.shape, dx.dtype, dw.shape, dw.dtype) == (x.shape, torch.float32, (24,),
                                                            torch.float32)
        assert dres.numel() == db.numel() == 0


def test_torch_compile_fullgraph():
    """The modules under torch.compile(fullgraph=True, AOT autograd): outputs and the
    gradients of x and every parameter against torch's own norms in fp64, with the same
    (state_dict-compatible) parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), qk.nn.RMSNorm(48), qk.nn.LayerNorm(48))
    with torch.no_grad():  # (weights and bias away from their init of ones and zeros)
        for p in list(model[1].parameters()) + list(model[2].parameters()):
            p.add_(torch.randn_like(p) * 0.3)
    reference = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.RMSNorm(48, eps=1e-6),
                                    torch.nn.LayerNorm(48)).double()
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = rand(5, 32, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    y, expected = compiled(x), reference(xd)
    assert_close(y, expected)
    dy = torch.randn_like(y)
    y.backward(dy)
    expected.backward(dy.double())
    assert_close(x.grad, xd.grad, name="x grad")
    for (name, p), (_, pd) in zip(model.named_parameters(), reference.named_parameters()):
        assert_close(p.grad, pd.grad, name=f"{name} grad")


def test_modules_are_state_dict_compatible():
    ref = torch.nn.RMSNorm(24, eps=1e-6)
    ours = qk.nn.RMSNorm(24)
    ours.load_state_dict(ref.state_dict())
    ref_ln = torch.nn.LayerNorm(24)
    with torch.no_grad():
        ref_ln.weight.normal_()
        ref_ln.bias.normal_()
    ours_ln = qk.nn.LayerNorm(24)
    ours_ln.load_state_dict(ref_ln.state_dict())
    x = rand(3, 24)
    assert_close(ours_ln(x), ref_ln(x).double())
    assert set(qk.nn.LayerNorm(8, bias=False).state_dict()) == {"weight"}
    assert set(qk.nn.RMSNorm(8, elementwise_affine=False).state_dict()) == set()


@pytest.mark.parametrize("module", [qk.nn.RMSNorm, qk.nn.LayerNorm])
@pytest.mark.parametrize("affine", [True, False])
def test_modules_check_the_normalized_length_and_reset(module, affine):
    """As torch's: an input whose last dimension is not normalized_shape is refused, with
    or without a weight; reset_parameters (called by meta-device initialisation) brings
    the parameters back to ones and zeros."""
    layer = module(8, elementwise_affine=affine)
    with pytest.raises(ValueError, match=r"expects input of shape \[\*, 8\]"):
        layer(rand(4, 16))
    if affine:
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_()
        layer.reset_parameters()
        assert torch.equal(layer.weight, torch.ones(8))
        if module is qk.nn.LayerNorm:
            assert torch.equal(layer.bias, torch.zeros(8))
    x = rand(3, 8)
    meta = module(8, elementwise_affine=affine, device="meta").to_empty(device="cpu")
    meta.reset_parameters()
    assert torch.equal(meta(x), module(8, elementwise_affine=affine)(x))


# -------------------------------------------------------------------------- errors
def test_bad_inputs():
    x = rand(4, 8)
    with pytest.raises(ValueError, match="weight must have shape"):
        qk.rms_norm(x, rand(7))
    with pytest.raises(ValueError, match="bias must have shape"):
        qk.layer_norm(x, rand(8), rand(8, 1))
    with pytest.raises(TypeError, match="float64"):
        qk.rms_norm(x.double())
    with pytest.raises(TypeError, match="int"):
        qk.layer_norm(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="residual must have the shape"):
        qk.rms_norm(x, residual=rand(4, 9))
    with pytest.raises(TypeError, match="out_dtype"):
        qk.rms_norm(x, out_dtype=torch.float64)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            qk.rms_norm(x, rand(8).cuda())
    else:
        with pytest.raises(ValueError, match="one device"):
            qk.rms_norm(x, torch.empty(8, device="meta"))


def test_dtype_options_checked_before_any_dispatch(monkeypatch):
    """out_dtype and residual_dtype are checked by the public functions themselves: a
    plan of the C++ fast path for x alone is keyed without residual_dtype, so a bad one
    must be refused before any path is chosen (here no op is reached at all)."""
    def dispatched(*args):
        raise AssertionError("dispatched")

    monkeypatch.setattr(ops, "norm_forward", dispatched)
    x = rand(4, 8)
    for kw in (dict(residual_dtype=torch.float64, prenorm=True), dict(out_dtype=torch.int32)):
        with pytest.raises(TypeError, match="is not supported"):
            qk.rms_norm(x, **kw)


# ------------------------------------------------------------- sm_90a compilation
VARIANTS = [
    # (n, x dtype, residual/weight dtype, rms)
    (1, torch.bfloat16, torch.bfloat16, True),
    (7, torch.float16, torch.float32, False),
    (769, torch.float32, torch.float32, True),
    (4096, torch.bfloat16, torch.float32, False),
    (32768, torch.bfloat16, torch.bfloat16, True),
    (131073, torch.float32, torch.float32, False),
    (262144, torch.float32, torch.float32, True),
    (262144, torch.bfloat16, torch.bfloat16, False),
    # fp32 LayerNorm kept in registers with its residual: columns before the exchange
    (262144, torch.float32, torch.float32, False),
    # fp32 LayerNorm of x alone staged at 16 values over a 4-CTA cluster
    (32768, torch.float32, torch.float32, False),
    # 512-thread backward shares with their sums in registers (config.sums_in_registers)
    (131072, torch.float32, torch.float32, False),
    (200000, torch.bfloat16, torch.bfloat16, True),
    # fp32 backward over 16-CTA clusters of 128 threads (config.NORM_BACKWARD_FULL_CLUSTER_LOOP_REGISTERS)
    (12288, torch.float32, torch.float32, True),
    (16384, torch.float32, torch.float32, False),
]


def _variants():
    """(name, n, dtype, cfg, build) for the report's measure(): forward with and
    without a residual (stream in the weight's dtype, mixed when they differ), backward
    without and with dweight/dbias and a residual gradient."""
    for n, dt, wdt, rms in VARIANTS:
        bias = None if rms else wdt
        for has_residual in (False, True):
            cfg = ops.forward_config(n, rms, dt, wdt, has_residual, dt, wdt, bias,
                                     residual_in_dtype=dt)
            args = (cfg, rms, dt, wdt, has_residual, has_residual, wdt, bias, dt, dt)
            yield "fwd", n, dt, cfg, lambda args=args: ops.forward_kernel(*args)
        for accumulators, dres in ((0, False), (1 if rms else 2, True)):
            outs = (dt, wdt) if dres else (dt,)
            cfg = ops.backward_config(n, wdt, dt, outs, wdt, accumulators)
            args = (cfg, rms, wdt, dt, wdt, dres, dt if dres else None, dt,
                    wdt if dres else None, accumulators > 0, accumulators == 2)
            yield "bwd", n, dt, cfg, lambda args=args: ops.backward_kernel(*args)


def test_sm90a_variants_compile_without_spills(tmp_path, cuobjdump):
    rows = list(measure(_variants(), str(tmp_path), cuobjdump))
    assert len(rows) == len(VARIANTS) * 4
    for name, n, dtype, cfg, kernel, res in rows:
        assert spills(res) == 0, f"register spills in {name} n={n} {dtype}: {res}"
        if name == "fwd" and cfg.staging == "registers" and kernel.has_residual \
                and not kernel.holds_columns:
            # two CTAs of 256 threads per SM (the weight and bias loaded together in
            # the output pass took 185 at bf16 262144: config.late_columns_together)
            assert res["regs"] <= 128, f"{name} n={n} {dtype}: {res}"
        if name == "bwd":
            assert_looping_launch_fits(kernel, name, n, dtype, cfg, res)


@pytest.mark.parametrize("n, dtype, weight_dtype, rms, residual", [
    (1001, torch.bfloat16, torch.bfloat16, False, True),  # one chunk held in registers
    (4097, torch.bfloat16, torch.bfloat16, True, False),
    (16385, torch.float16, torch.float16, False, False),
    (50257, torch.bfloat16, torch.bfloat16, True, False),
    (50257, torch.bfloat16, torch.float32, False, False),
    (131073, torch.bfloat16, torch.bfloat16, False, True),
    (262143, torch.float16, torch.float16, True, True)])
def test_shifted_odd_rows_take_16_byte_accesses(n, dtype, weight_dtype, rms, residual, tmp_path,
                                                cuobjdump):
    """The norm forward of odd 16-bit rows read from the 16-byte boundary before each
    (forward_config's ``shifted``): every staged vector of x (and the residual) one
    16-byte cp.async, every vector of y (and the stream) but the row's two edges' one
    16-byte store, the edges' values stored one by one; 16-bit weights and biases two
    whole vectors a vector, spliced to the row's shift in registers (no 2-byte load but
    LayerNorm's first value, the reference of its moments), fp32 ones one 4-byte load a
    value a thread, staged once a row (config.splices_shifted_columns); no spill. The
    rows that may not be shifted take a load a value (the contrast the test relies
    on)."""
    from helpers import compiled_sass

    bias = None if rms else weight_dtype
    args = (n, rms, dtype, dtype, residual, dtype, weight_dtype, bias, 1, None)
    cfg = ops.forward_config(*args, True)
    assert cfg.row_shift
    usage, sass = compiled_sass(ops.forward_kernel(
        cfg, rms, dtype, dtype, residual, residual, weight_dtype, bias, dtype),
        tmp_path / "shifted", cuobjdump)
    assert usage["stack"] == 0 and usage["local"] == 0, usage
    vectors = cfg.num_chunks * cfg.vecs_per_thread
    rows = 1 + residual
    assert len(re.findall(r"\bLDGSTS\.E\.128\b", sass)) == rows * vectors
    # (ptxas drops the stores of vectors that start past every shift's row end)
    assert 0 < len(re.findall(r"\bSTG\.E\.128\b", sass)) <= rows * vectors
    assert 0 < len(re.findall(r"\bSTG\.E\.U16\b", sass)) <= rows * vectors * cfg.vec
    columns = 1 if rms else 2
    # (ptxas drops the loads of vectors past every shift's row end)
    vector_loads = len(re.findall(r"\bLDG\.E(?:\.\w+)?\.128\b", sass))
    value_loads = len(re.findall(r"\bLDG\.E\s", sass))
    if weight_dtype == torch.float32:
        assert vector_loads == 0
        assert 0 < value_loads <= columns * cfg.cols_per_cta // cfg.threads_per_row
    else:
        assert 0 < vector_loads <= 2 * columns * vectors and value_loads == 0, vector_loads
    # (LayerNorm reducing once reads the row's first value: its moments' reference)
    moments = int(ops.NormForward(cfg, rms, *[ops.cutlass_dtype(dtype)] * 3, residual,
                                  residual).moments)
    assert len(re.findall(r"\bLDG\.E\.U16\b", sass)) == moments
    unshifted = ops.forward_config(*args)
    _, sass = compiled_sass(ops.forward_kernel(
        unshifted, rms, dtype, dtype, residual, residual, weight_dtype, bias, dtype),
        tmp_path / "unshifted", cuobjdump)
    assert re.findall(r"\bLDG\.E\.U16\b", sass) and not re.findall(r"\bLDGSTS\.E\.128\b", sass)


def _visits(num_rows, grid_rows, cta):
    """((row, class) pairs in visit order, the partial-sum rows written) by CTA ``cta``,
    from rows.ShiftClassOrder computed on the host as the kernel computes it
    (NormBackward._class_row_blocks; a class's first position is the CTA's rows before
    it, asserted)."""
    from quack_kernels.primitives.rows import ShiftClassOrder

    order = ShiftClassOrder(num_rows, grid_rows, cta=cta)
    rows, partials = [], []
    for shift_class in range(*order.written_classes()):
        first, end = order.segment(shift_class)
        assert first - order.first == len(rows), (num_rows, grid_rows, cta, shift_class)
        rows += [(shift_class + 8 * (position - order.class_start(shift_class)), shift_class)
                 for position in range(first, end)]
        partials.append(cta + shift_class)
    return rows, partials


@pytest.mark.parametrize("num_rows", [*range(1, 41), 63, 64, 65, 127, 1000, 4097])
def test_shift_class_order_visits_every_row_once_a_class_at_a_time(num_rows):
    """rows.ShiftClassOrder (the shifted norm backward's looping grid): over every grid
    size up to the rows (the host's loop_grid_rows caps it there), each row is visited
    once, by one CTA, among the rows of its class (r mod 8: one shift), each CTA's
    blocks numbered on across its classes; the partial-sum rows the CTAs write are
    config.partial_sum_rows of them, each written once; a grid of a multiple of 8 row
    blocks gives each CTA rows of one class."""
    cfg = config.RowConfig(n_cols=4097, vec=8, threads_per_row=256, rows_per_block=1,
                           cluster_size=1, vecs_per_thread=2, num_chunks=1,
                           staging="registers", row_shift=True)
    grids = range(1, num_rows + 1) if num_rows <= 65 else (1, 3, 7, 8, 9, 15, 16, 61, 132)
    for grid_rows in grids:
        seen, written = [], []
        for cta in range(grid_rows):
            rows, partials = _visits(num_rows, grid_rows, cta)
            assert all(row % 8 == shift_class for row, shift_class in rows)
            if grid_rows % 8 == 0:  # (splits_classes: a class a CTA, as many rows each)
                assert len({shift_class for _, shift_class in rows}) == 1, (grid_rows, cta)
                assert len(rows) <= -(-num_rows // grid_rows) + 1, (grid_rows, cta)
            seen += [row for row, _ in rows]
            written += partials
        assert sorted(seen) == list(range(num_rows)), grid_rows
        assert sorted(written) == list(range(config.partial_sum_rows(cfg, grid_rows))), grid_rows


@pytest.mark.parametrize("n, dtype, rms, dres", [
    (2049, torch.float16, False, False), (50257, torch.bfloat16, True, True),
    (131073, torch.bfloat16, False, True)])
def test_shifted_backward_takes_16_byte_accesses(n, dtype, rms, dres, tmp_path, cuobjdump):
    """The norm backward of shifted odd 16-bit rows: h and dy staged in 16-byte cp.async
    vectors (each row block's, issued for the next one too), the residual gradient read
    and dx (and dresidual) stored in 16-byte vectors but their edges', the weight read
    one value a copy once a class of rows (rows.ShiftClassOrder), the per-column sums
    stored one fp32 value a store at the rows' own columns (the shift moves them off
    the vectors); no spill."""
    from helpers import compiled_sass

    sums = 1 if rms else 2
    outs = (dtype,) * (3 if dres else 1)
    cfg = ops.backward_config(n, dtype, dtype, outs, dtype, sums, 1, rms=rms, shifted=True)
    assert cfg.row_shift
    usage, sass = compiled_sass(ops.backward_kernel(
        cfg, rms, dtype, dtype, dtype, dres, dtype if dres else None, dtype,
        dtype if dres else None, True, not rms), tmp_path, cuobjdump)
    assert usage["stack"] == 0 and usage["local"] == 0, usage
    vectors = cfg.num_chunks * cfg.vecs_per_thread
    # (issued in and before the loop; LTC128B: the DSL's L2 sector hint)
    copies = len(re.findall(r"\bLDGSTS\.E(?:\.LTC128B)?\.128\b", sass))
    assert copies in (2 * vectors, 4 * vectors), copies
    assert 0 < len(re.findall(r"\bSTG\.E\.128\b", sass)) <= (1 + dres) * vectors
    assert len(re.findall(r"\bLDG\.E\.128\b", sass)) == (vectors if dres else 0)
    assert 0 < len(re.findall(r"\bLDG\.E\.U16\b", sass)) <= cfg.cols_per_cta // cfg.threads_per_row
    assert 0 < len(re.findall(r"\bSTG\.E\s", sass)) <= sums * vectors * cfg.vec


def test_rows_too_long_for_shared_memory_are_refused_with_a_clear_error():
    # LayerNorm backward with dweight and dbias keeps two fp32 partial rows per CTA
    n = 1 << 20
    cfg = ops.backward_config(n, torch.bfloat16, torch.bfloat16, (torch.bfloat16,), torch.bfloat16, 2)
    with pytest.raises(ValueError, match="KiB of shared memory per CTA"):
        ops.compile_backward(cfg, False, torch.bfloat16, torch.bfloat16, torch.bfloat16, False, None,
                             torch.bfloat16, None, True, True)


def test_every_staging_and_cluster_path():
    cfgs = [ops.backward_config(n, dt, dt, (dt,), dt, acc) for n in (4096, 65536, 200000, 262144)
            for dt in (torch.bfloat16, torch.float32) for acc in (0, 2)]
    cfgs += [ops.forward_config(n, rms, dt, dt, res, dt) for n in (4096, 262144)
             for dt in (torch.bfloat16, torch.float32) for res in (False, True)
             for rms in (True, False)]
    assert {c.staging for c in cfgs} == {"registers", "smem", "global"}
    assert any(c.cluster_size == 16 for c in cfgs) and any(c.cluster_size == 1 for c in cfgs)


@pytest.mark.parametrize("n", [65536, 131072, 131073, 131080, 200000, 262144])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rms", [True, False])
def test_forward_values_per_thread_of_wide_16bit_shares(n, dtype, rms):
    """RMSNorm of 16-bit x alone, all tensors 16-bit and read in whole 16-byte vectors,
    whose 16-CTA shares outgrow CTA_ROW_BYTES (rows over 256 KiB) takes
    WIDE_SHARE_VALUES per thread on a cluster of the 16-CTA class (fewer CTAs where the
    wide share leaves some past the row end); rows of exactly 256 KiB, LayerNorm and
    misaligned tensors keep the default of 16 values (odd rows take the shares of
    config.odd_row_forward_share, 8 values)."""
    from quack_kernels.primitives import config

    bias = None if rms else dtype
    cfg = ops.forward_config(n, rms, dtype, dtype, False, dtype, dtype, bias)
    wide = rms and n % 8 == 0 and n > 131072
    odd = n % 2 == 1 and config.ODD_ROW_FORWARD_MIN_COLS <= n <= 262144
    odd_values = config.ODD_ROW_FORWARD_VALUES
    assert cfg.vec * cfg.vecs_per_thread == (config.WIDE_SHARE_VALUES if wide
                                             else odd_values if odd else 16)
    assert config.cluster_class(cfg) == config.MAX_CLUSTER_SIZE or not wide
    misaligned = ops.forward_config(n, rms, dtype, dtype, False, dtype, dtype, bias, max_vec=4)
    assert misaligned.vec * misaligned.vecs_per_thread == (odd_values if odd else 16)


def test_backward_sums_in_registers_and_prefetch():
    """Two staging buffers where the dweight sums live in registers (one chunk per CTA),
    or in shared memory while two double-buffered CTAs still fit an SM; bf16 rows of
    262144 take SUM_THREADS_PER_ROW threads, which moves their sums to registers and
    makes room for the second buffer; fp32's takes them too but its 128-KiB staged share
    leaves room for one buffer only (refilled chunk by chunk)."""
    from quack_kernels.primitives import config

    bf16, fp32 = torch.bfloat16, torch.float32
    assert ops.backward_config(4096, bf16, bf16, (bf16,), bf16, 1).stages == 2
    for n, dtype in ((16384, bf16), (65536, bf16), (65536, fp32)):
        # the clustered shares these rows took before the register shares (a sweep's)
        cfg = ops.backward_config(n, dtype, dtype, (dtype,), dtype, 1, cta_row_bytes=(
            config.norm_backward_share(dtype.itemsize, 1, n)[0]))
        assert cfg.num_chunks > 1 and cfg.stages == 2
        kernel = ops._backward_kernel_object(cfg, True, dtype, dtype, True, False)
        assert not kernel.sums_in_registers and kernel.ctas_per_sm() >= 2
    for dtype, stages in ((bf16, 2), (fp32, 1)):
        cfg = ops.backward_config(262144, dtype, dtype, (dtype,), dtype, 1, rms=True)
        kernel = ops._backward_kernel_object(cfg, True, dtype, dtype, True, False)
        assert cfg.threads_per_row == config.SUM_THREADS_PER_ROW
        assert kernel.sums_in_registers and cfg.stages == stages
        assert cfg.num_chunks > 1 and kernel.ctas_per_sm() == 1


def test_backward_shares_by_dtype_and_sums():
    """16-bit rows: RMSNorm keeps the default share up to 4096 columns and takes two
    vectors in 64-KiB shares beyond; LayerNorm takes 32-KiB shares of two vectors at
    every length. fp32 rows and backwards without sums keep the defaults."""
    from quack_kernels.primitives import config

    share = config.norm_backward_share
    assert share(2, 1, 4096) == (config.CTA_ROW_BYTES, 1)
    assert share(2, 1, 4097) == share(2, 1, 262144) == (64 * 1024, 2)
    for n in (1024, 4097, 16384, 65536, 262144):
        assert share(2, 2, n) == (32 * 1024, 2)
    assert share(4, 1, 16384) == share(4, 2, 1024) == share(2, 0, 16384) \
        == (config.CTA_ROW_BYTES, None)
    bf16 = torch.bfloat16
    short = ops.backward_config(4096, bf16, bf16, (bf16,), bf16, 1)
    # (16384 columns take a register share by default: norm_backward_register_threads)
    long = ops.backward_config(16384, bf16, bf16, (bf16,), bf16, 1,
                               cta_row_bytes=share(2, 1, 16384)[0])
    assert short.vecs_per_thread == 1 and long.vecs_per_thread == 2
    # 64-KiB shares: two CTAs hold a 16384-column row (h, dy and the fp32 sum: 8 B/col)
    assert long.cluster_size == 2 and long.threads_per_row == 256
    kernel = ops._backward_kernel_object(long, True, bf16, bf16, True, False)
    assert kernel.loop_registers == config.NORM_BACKWARD_WIDE_LOOP_REGISTERS
    assert ops._backward_kernel_object(short, True, bf16, bf16, True, False).loop_registers \
        == config.LOOP_REGS_PER_THREAD
    # an fp32 weight narrows the accesses to 4 elements, not the values per thread
    for n in (4096, 16384, 262144):
        for sums in (1, 2):
            same = ops.backward_config(n, bf16, bf16, (bf16,), bf16, sums)
            mixed = ops.backward_config(n, bf16, bf16, (bf16,), torch.float32, sums)
            assert mixed.vec == 4 and same.vec == 8
            assert mixed.vec * mixed.vecs_per_thread == same.vec * same.vecs_per_thread
    # without sums the threads keep the default registers, even with 16 values
    frozen = ops.backward_config(4096, bf16, bf16, (bf16,), torch.float32, 0)
    assert frozen.vec * frozen.vecs_per_thread > 8
    assert ops._backward_kernel_object(frozen, True, bf16, bf16, False, False).loop_registers \
        == config.LOOP_REGS_PER_THREAD
    # fp32 rows with sums over a full cluster of 128-thread CTAs: eight of them per SM
    # (12288 columns; 16384 now take register shares), not rows on smaller clusters or
    # wider CTAs, mixed dtypes or frozen weights
    fp32 = torch.float32
    for rms in (True, False):
        sums = 1 if rms else 2
        full = ops.backward_config(12288, fp32, fp32, (fp32,), fp32, sums)
        assert config.cluster_class(full) == config.MAX_CLUSTER_SIZE
        assert full.threads_per_block == 128
        kernel = ops._backward_kernel_object(full, rms, fp32, fp32, True, not rms, fp32)
        assert kernel.loop_registers == config.NORM_BACKWARD_FULL_CLUSTER_LOOP_REGISTERS
        assert kernel.ctas_per_sm() == config.MAX_LOOP_CTAS_PER_SM
        for n, dtype in ((4096, fp32), (1024, fp32), (16384, bf16), (32768, fp32)):
            cfg = ops.backward_config(n, dtype, dtype, (dtype,), dtype, sums)
            other = ops._backward_kernel_object(cfg, rms, dtype, dtype, True, not rms, dtype)
            assert other.loop_registers != config.NORM_BACKWARD_FULL_CLUSTER_LOOP_REGISTERS, (n, dtype, rms)
        frozen = ops._backward_kernel_object(full, rms, fp32, fp32, False, False, fp32)
        mixed = ops._backward_kernel_object(full, rms, fp32, bf16, True, not rms, fp32)
        for other in (frozen, mixed):
            assert other.loop_registers != config.NORM_BACKWARD_FULL_CLUSTER_LOOP_REGISTERS, rms


def default_backward(n, rms, dtype, weight_dtype=None):
    """(config, kernel object) of the default norm backward with dweight (and dbias for
    LayerNorm) of rows of ``dtype``; ``weight_dtype`` None: the kernel without a weight."""
    cfg = ops.backward_config(n, dtype, dtype, (dtype,), weight_dtype or dtype, 1 if rms else 2)
    return cfg, ops._backward_kernel_object(cfg, rms, dtype, dtype, True, not rms, weight_dtype)


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.float32)])
def test_backward_stages_the_weight_where_it_costs_no_cta(dtype, weight_dtype):
    """The weight is staged once in shared memory where it fits and is not held in
    registers: for RMSNorm where one CTA per SM is resident, for LayerNorm wherever it
    costs no resident CTA; never in vectors under 4 bytes (odd rows). Its bytes are
    counted."""
    staged_rows = []
    for n in (1024, 4096, 16384, 65536, 131072, 200000, 262144, 262145):
        for rms in (True, False):
            cfg, kernel = default_backward(n, rms, dtype, weight_dtype)
            bare = ops._backward_kernel_object(cfg, rms, dtype, dtype, True, not rms)
            staged = len(kernel.column_dtypes) == 1
            weight_bytes = cfg.rows_per_block * cfg.cols_per_cta * weight_dtype.itemsize
            fits = bare.smem_bytes() + weight_bytes + 16 <= config.SMEM_BYTES_PER_CTA
            wide = weight_dtype.itemsize * cfg.vec >= 4
            alone = bare.ctas_per_sm()
            costless = config.loop_ctas_per_sm(cfg, bare.smem_bytes() + weight_bytes + 16,
                                               bare.loop_registers) == alone
            assert staged == (not kernel.holds_weight and fits and wide
                              and (alone == 1 or (not rms and costless))), (n, rms)
            assert kernel.smem_bytes() - bare.smem_bytes() == (weight_bytes + 16 if staged else 0)
            assert kernel.ctas_per_sm() == bare.ctas_per_sm()
            staged_rows += [n] * staged
    assert 262144 in staged_rows  # the long rows, one CTA per SM
    assert 4096 in staged_rows  # LayerNorm's share of 4096 columns


def test_backward_weight_staging_cases():
    """The staging rule at a few shapes, stated directly (see the test above)."""
    bf16, fp32 = torch.bfloat16, torch.float32

    def staged(n, rms, dtype, weight_dtype):
        return default_backward(n, rms, dtype, weight_dtype)[1].weight_staged

    assert staged(262144, True, bf16, bf16) and staged(262144, False, bf16, bf16)
    assert staged(4096, False, bf16, bf16) and not staged(4096, True, bf16, bf16)
    # the clustered share of fp32 65536 (a register share by default): staging it would
    # cost a resident CTA (2 -> 1)
    clustered = ops.backward_config(65536, fp32, fp32, (fp32,), fp32, 2,
                                    cta_row_bytes=config.CTA_ROW_BYTES)
    assert not ops._backward_kernel_object(clustered, False, fp32, fp32, True, True,
                                           fp32).weight_staged
    assert staged(65536, False, fp32, fp32)  # one 512-thread CTA per SM: nothing to lose
    assert not staged(262145, True, bf16, bf16)  # one-element vectors


def test_backward_holds_the_weight_of_16bit_layer_norm_register_shares():
    """16-bit LayerNorm rows held as one chunk in registers by 512-thread CTAs load
    weight + offset into registers once (NormBackward.holds_weight), neither staged nor
    re-read per block; RMSNorm, fp32 rows, smaller CTAs and shares of several chunks do
    not (measured to lose, spilled, or not measured)."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for dtype in (bf16, fp16):
        for n in (8192, 16384, 65536):
            cfg, kernel = default_backward(n, False, dtype, dtype)
            assert (cfg.staging, cfg.num_chunks) == ("registers", 1), n
            assert kernel.holds_weight and not kernel.weight_staged, (n, dtype)
            bare = ops._backward_kernel_object(cfg, False, dtype, dtype, True, True)
            assert kernel.smem_bytes() == bare.smem_bytes()  # no staged copy
        # an fp32 weight holds too: the rule follows the rows' dtypes (h and dy)
        assert default_backward(65536, False, dtype, fp32)[1].holds_weight
    for n, rms, dtype in ((4096, True, bf16), (65536, True, bf16), (65536, False, fp32),
                          (262144, False, bf16), (1024, False, bf16), (4096, False, fp16)):
        kernel = default_backward(n, rms, dtype, dtype)[1]
        assert not kernel.holds_weight, (n, rms, dtype)
        # dh in FMA form: 16-bit LayerNorm on 512-thread CTAs
        assert kernel.fma_form == (not rms and dtype.itemsize == 2 and n >= 8192), \
            (n, rms, dtype)


def test_backward_prefetches_row_stats_for_layer_norm_and_lone_rms_ctas():
    """rstd / mean are loaded a row block ahead for LayerNorm at every share, for
    RMSNorm only where one CTA per SM is resident (the rule's measured split)."""
    bf16, fp32 = torch.bfloat16, torch.float32

    def kernel(n, rms, dtype):
        return default_backward(n, rms, dtype, dtype)[1]

    for n in (1024, 16384, 262144):
        for dtype in (bf16, fp32):
            assert kernel(n, False, dtype).prefetches_stats
            rms = kernel(n, True, dtype)
            assert rms.prefetches_stats == (rms.ctas_per_sm() == 1), (n, dtype)
    assert kernel(262144, True, bf16).prefetches_stats
    assert not kernel(1024, True, bf16).prefetches_stats


def test_backward_launch_of_clusters_fences_its_residency():
    """A looping launch of clusters asks for the shared memory that holds each SM to the
    CTAs its grid is sized for; a launch of single CTAs asks for what it uses."""
    from quack_kernels.primitives.config import MAX_FENCED_CTAS_PER_SM, fenced_smem_bytes

    bf16 = torch.bfloat16
    clustered = default_backward(16384, False, bf16, bf16)[1]
    assert clustered.cfg.cluster_size > 1
    assert clustered.launch_smem_bytes() == fenced_smem_bytes(clustered.smem_bytes(),
                                                              clustered.ctas_per_sm())
    assert clustered.launch_smem_bytes() > clustered.smem_bytes()
    single = default_backward(1024, True, bf16, bf16)[1]
    assert single.cfg.cluster_size == 1
    assert single.launch_smem_bytes() == single.smem_bytes()
    many = default_backward(12288, True, torch.float32, torch.float32)[1]
    assert many.cfg.cluster_size > 1 and many.ctas_per_sm() > MAX_FENCED_CTAS_PER_SM
    assert many.launch_smem_bytes() == many.smem_bytes()


def test_looping_launch_requests_the_fenced_shared_memory():
    """RowKernel.launch hands the kernel launch launch_smem_bytes for a looping grid
    (grid_rows given), the kernel's own smem_bytes for one block per row block."""
    bf16 = torch.bfloat16
    kernel = default_backward(16384, False, bf16, bf16)[1]
    assert kernel.launch_smem_bytes() > kernel.smem_bytes()

    class Recorder:
        def launch(self, **options):
            self.options = options

    looping, one_block = Recorder(), Recorder()
    kernel.launch(looping, 4096, None, grid_rows=7)
    assert looping.options["smem"] == kernel.launch_smem_bytes()
    assert looping.options["grid"] == [7, kernel.cfg.cluster_size, 1]
    kernel.launch(one_block, 4096, None)
    assert one_block.options["smem"] == kernel.smem_bytes()


def test_row_stats_of_one_row_blocks_load_a_block_ahead():
    """config.row_stats_a_block_ahead: the prefetched statistics load as the block
    before begins for blocks of one row, after its row sums for blocks of several."""
    from quack_kernels.primitives.config import row_stats_a_block_ahead

    fp32 = torch.float32
    short = default_backward(256, False, fp32, fp32)[1]
    assert short.prefetches_stats and short.cfg.rows_per_block > 1
    assert not row_stats_a_block_ahead(short.cfg)
    long = default_backward(16384, False, fp32, fp32)[1]
    assert long.prefetches_stats and long.cfg.rows_per_block == 1
    assert row_stats_a_block_ahead(long.cfg)


def test_return_stats_gives_fp32_statistics_without_gradient():
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    y, rstd = qk.rms_norm(x, w, eps=1e-6, return_stats=True)
    assert_close(rstd, torch.rsqrt(x.detach().double().pow(2).mean(-1) + 1e-6), torch.float32)
    assert rstd.shape == (3, 5) and rstd.dtype == torch.float32 and not rstd.requires_grad
    y2, h, mean, rstd2 = qk.layer_norm(x, w, None, residual=x.detach(), prenorm=True, return_stats=True)
    hd = 2 * x.detach().double()
    assert_close(mean, hd.mean(-1), torch.float32)
    assert_close(rstd2, torch.rsqrt(hd.var(-1, unbiased=False) + 1e-5), torch.float32)
    (y.sum() + y2.sum()).backward()  # statistics do not block the gradient of y
    assert x.grad is not None and w.grad is not None

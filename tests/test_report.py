"""The sm_90a resource report compiles kernels without a GPU and finds no spills, no
warp syncs and no register read before it is written."""

import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import compiled_ptx
from quack_kernels.report import (_RES, _cubin_file, disassembly, measure,
                                   resource_usage, spills)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


KERNEL_NAMES = ("softmax", "log_softmax", "rms_norm", "layer_norm", "xent", "column_sum",
                "rescale")


def _run_report(*args, timeout):
    """``python -m quack_kernels.report *args`` run as a user runs it: nothing set, so
    without a GPU the package must make the DSL compile for sm_90a (set after the DSL's
    import, the variable came too late and the report showed sm_100a code; the report
    refuses another arch than the target). Returns (process, split variant rows)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUTE_DSL_ARCH", None)
    proc = subprocess.run([sys.executable, "-m", "quack_kernels.report", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0].startswith(KERNEL_NAMES)]
    return proc, rows


def test_report_quick_has_no_spills():
    proc, rows = _run_report("--quick", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    if not torch.cuda.is_available():
        assert "resource report for sm_90a" in proc.stdout
    families = {row[0].split("_")[0] for row in rows}
    assert families == {"softmax", "log", "rms", "layer", "xent", "column", "rescale"}
    assert len(rows) >= 150
    assert all(int(row[10]) == 0 and int(row[11]) == 0 and int(row[12]) == 0
               for row in rows)  # spill, wsync, uninit


@pytest.mark.slow
def test_report_full_grid_has_no_spills():
    proc, rows = _run_report(timeout=3600)
    assert len(rows) >= 500, proc.stdout[-4000:] + proc.stderr[-4000:]
    flagged = {(row[0], row[1], int(row[2])) for row in rows if row[-1] in ("SPILL", "WARPSYNC", "UNINIT")}
    assert not flagged
    assert proc.returncode == 0


def test_resource_line_parser():
    line = "  REG:80 STACK:0 SHARED:1024 LOCAL:16 CONSTANT[0]:600 TEXTURE:0"
    assert _RES.search(line).groups() == ("80", "0", "1024", "16")


def test_resource_parser_reads_cuobjdump(tmp_path, cuobjdump):
    """The resources of a compiled cubin as cuobjdump prints them (a kernel of 256
    threads uses registers and a cluster-free softmax no local memory); a missing cubin
    raises instead of reading as zero spills."""
    from quack_kernels.ops import softmax
    from quack_kernels.primitives.compile_cache import compile_kernel

    cfg = softmax.forward_config(4096, torch.float32)
    fn = compile_kernel(*softmax.forward_kernel(cfg, torch.float32, False),
                        keep_cubin_in=str(tmp_path))
    usage = resource_usage(_cubin_file(fn.__cubin__, str(tmp_path)), cuobjdump)
    assert usage["regs"] > 0 and usage["stack"] == usage["local"] == 0, usage
    with pytest.raises(subprocess.CalledProcessError):
        resource_usage(str(tmp_path / "missing.cubin"), cuobjdump)


def test_warp_syncs_are_counted_in_the_sass(tmp_path, cuobjdump):
    """A kernel whose lane-0 branch calls cute.arch.warp_idx() (a full-warp shuffle)
    compiles to WARPSYNC, which the report's measure() counts; the same store with the
    index read before the branch has none."""
    import cutlass
    import cutlass.cute as cute

    from quack_kernels.primitives.compile_cache import fake_rows
    from quack_kernels.report import measure

    class LaneZeroStore:
        def __init__(self, hoisted):
            self.hoisted = hoisted

        def smem_bytes(self):
            return 0

        @cute.jit
        def __call__(self, mOut: cute.Tensor, stream):
            self.kernel(mOut).launch(grid=[1, 1, 1], block=[64, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mOut: cute.Tensor):
            if cutlass.const_expr(self.hoisted):
                warp = cute.arch.warp_idx()
                if cute.arch.lane_idx() == 0:
                    mOut[0, warp] = mOut.element_type(1.0)
            else:
                if cute.arch.lane_idx() == 0:
                    mOut[0, cute.arch.warp_idx()] = mOut.element_type(1.0)
            cute.arch.barrier()

    variants = [(f"hoisted={hoisted}", 8, torch.float32, None,
                 lambda hoisted=hoisted: (LaneZeroStore(hoisted), fake_rows(cutlass.Float32, 8, 1)))
                for hoisted in (False, True)]
    counts = [res["warp_syncs"] for *_, res in measure(variants, str(tmp_path), cuobjdump)]
    assert counts[0] > 0 and counts[1] == 0


def test_report_refuses_cubins_of_another_arch(monkeypatch, tmp_path, cuobjdump):
    """The report checks the arch in the cubin's name against the target, so a DSL
    that compiled for its own default is caught instead of reported."""
    from quack_kernels import report
    from quack_kernels.ops import softmax
    from quack_kernels.primitives import compile_cache

    variant = next(softmax.report_variants([1024], [torch.float32]))
    monkeypatch.setattr(compile_cache, "target_arch", lambda: "sm_80")
    with pytest.raises(RuntimeError, match="another arch"):
        next(report.measure([variant], str(tmp_path), cuobjdump))


def test_report_workers_split_the_variants_between_them(monkeypatch, capsys):
    """--jobs N: worker k of N compiles the variants whose index is k modulo N; together
    they cover every variant once, with the lines the serial report prints."""
    import argparse
    from types import SimpleNamespace

    from quack_kernels import report

    res = dict(regs=32, stack=0, static_smem=1024, local=0, warp_syncs=0, uninitialized=0)
    kernel = SimpleNamespace(smem_bytes=lambda: 0)
    monkeypatch.setattr(report, "measure", lambda variants, dump_dir, cuobjdump: (
        (name, n, dtype, cfg, kernel, res) for name, n, dtype, cfg, _ in variants))
    args = argparse.Namespace(quick=True, family=None)
    serial = list(report._variant_lines(args, "cuobjdump", (0, 1)))
    shards = sorted(row for k in range(3) for row in report._variant_lines(args, "cuobjdump", (k, 3)))
    assert [row[0] for row in serial] == list(range(len(serial))) and len(serial) > 100
    assert shards == serial
    # a worker's printed records parse back to its rows (what the parent merges)
    monkeypatch.setattr(report, "find_cuobjdump", lambda: "cuobjdump")
    assert report.main(["--quick", "--family", "norm", "--shard", "1/2"]) == 0
    printed = [report.parse_record(line) for line in capsys.readouterr().out.splitlines()]
    norm = argparse.Namespace(quick=True, family=["norm"])
    assert printed == list(report._variant_lines(norm, "cuobjdump", (1, 2))) and printed


@pytest.mark.parametrize("argv, expected", [([], []), (["--quick"], ["--quick"])])
def test_bench_without_gpu_runs_the_report(monkeypatch, argv, expected):
    """The main job's CLI falls back to the resource report without a GPU (quick with
    --quick)."""
    from quack_kernels import bench, report

    calls = []
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(report, "main", lambda args: calls.append(args) or 0)
    assert bench.main(argv) == 0
    assert calls == [expected]


def test_bench_shape_option_replaces_the_grid():
    from quack_kernels import bench

    args = bench.parse_args(["--op", "softmax_fwd", "--shape", "128x1048576,4096x4096"])
    assert args.shape == [(128, 1048576), (4096, 4096)]
    op = bench.OPS["softmax_fwd"]
    assert list(bench._cases(op, ["bf16"], False, args.shape)) == [
        ("bf16", 128, 1048576), ("bf16", 4096, 4096)]
    assert list(bench._cases(op, ["bf16"], True, [])) == [
        ("bf16", M, N) for M, N in op.quick_shapes]
    for bad in ("4096", "0x4096"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--shape", bad])


def test_bench_csv_of_a_run_in_the_same_minute_is_a_new_file(tmp_path):
    """Two runs started in the same minute (two runner calls in one GPU script) each keep
    their CSV: the second one's name takes a suffix instead of overwriting the first."""
    from quack_kernels import bench

    paths = []
    for impl in ("first", "second"):
        sink = bench.CsvSink(tmp_path, "gpu", "20261130-1706", {})
        sink.write("softmax", bench.Result("softmax_fwd", "bf16", 8, 8, impl, 1.0, 1.0, 1.0))
        sink.close()
        paths += sink.paths
    assert [p.name for p in paths] == ["softmax_gpu_20261130-1706.csv",
                                       "softmax_gpu_20261130-1706-2.csv"]
    assert [p.read_text().splitlines()[1].split(",")[4] for p in paths] == ["first", "second"]


def test_graphed_training_step_is_the_same_step_timed_on_the_device():
    """cross_entropy_fwdbwd_graphed: the training step's cases and baselines, replayed
    from a CUDA graph (no host gaps between its kernels) and timed as isolated runs."""
    from quack_kernels import bench

    graphed, plain = bench.OPS["cross_entropy_fwdbwd_graphed"], bench.OPS["cross_entropy_fwdbwd"]
    assert not graphed.host_inclusive
    assert (graphed.shapes, graphed.dtypes) == (plain.shapes, plain.dtypes)
    assert set(graphed.baselines) == set(plain.baselines)
    assert graphed.ours is not plain.ours


def test_only_ops_that_write_nothing_time_after_a_reading_flush():
    """OpBench.reads_only: the loss alone (a few bytes per row out) is timed after a
    flush that leaves L2 clean; every op writing an output as large as its input keeps
    the writing flush (its own dirty lines balance the flush's); the CSV says which."""
    from quack_kernels import bench

    reading = {name for name, op in bench.OPS.items() if op.reads_only}
    assert reading == {"cross_entropy_fwd"}
    assert bench.OPS["cross_entropy_fwd"].timing == "after a reading L2 flush"
    assert bench.OPS["softmax_fwd"].timing == "after a writing L2 flush"
    assert bench.OPS["softmax_fwdbwd"].timing == "back-to-back"
    assert "timing" in bench.CSV_COLUMNS


def test_a_case_times_its_implementations_in_turn(monkeypatch):
    """bench.run_case: every implementation is timed once per round, in turn, and keeps
    its median round (a drifting host weighs on all alike); one failing while timed
    keeps its error and leaves the others' rounds whole; an absent one has no row."""
    from quack_kernels import bench

    calls = []
    slow = {"round": 0}

    def timed(fn, op, rep_ms):
        calls.append(fn.impl)
        if fn.impl == "torch" and len(calls) > 4:
            raise RuntimeError("broke in round 2")
        slow["round"] += fn.impl == bench.OURS
        # every implementation slower in round 3 (the host's slow stretch)
        return {bench.OURS: 1.0, "torch": 2.0, "liger": 4.0}[fn.impl] * (
            10 if slow["round"] == 3 else 1)

    def prepared(build, copies):
        return build(copies)

    def builder(impl):
        def build(copies):
            if impl == "absent":
                raise bench.Unavailable(impl)
            fn = lambda: None  # noqa: E731
            fn.impl = impl
            return fn
        return build

    op = bench.dataclasses.replace(
        bench.OPS["softmax_fwd"], ours=builder(bench.OURS),
        baselines={name: builder(name) for name in ("torch", "liger", "absent")},
        model_bytes=lambda M, N, dtype: 10**6)
    monkeypatch.setattr(bench, "_input_copies", lambda *args: [{}])
    monkeypatch.setattr(bench, "_prepared", prepared)
    monkeypatch.setattr(bench, "_timed_ms", timed)
    results = bench.run_case(op, "bf16", 8, 8, 1000.0, with_baselines=True)
    assert calls[:7] == [bench.OURS, "torch", "liger", bench.OURS, "torch", "liger", bench.OURS]
    assert len(calls) == 2 * bench.TIMING_ROUNDS + 2
    by_impl = {r.impl: r for r in results}
    assert list(by_impl) == [bench.OURS, "torch", "liger"]
    assert by_impl[bench.OURS].time_us == 1e3 and by_impl["liger"].time_us == 4e3
    assert by_impl["torch"].time_us is None and "broke in round 2" in by_impl["torch"].error
    assert by_impl[bench.OURS].speedup_vs_best_baseline == 4.0


def test_a_case_gives_input_overwriters_their_own_copies_and_may_time_one_by_one(monkeypatch):
    """OpBench.overwrites_inputs: such a baseline is built on new tensors of the same
    values (Liger's cross-entropy writes the gradient over the logits the others read);
    OpBench.interleaved False (the graphed step): each implementation's rounds all run
    before the next is built."""
    from quack_kernels import bench

    given, events = {}, []

    def builder(impl):
        def build(copies):
            given[impl] = copies[0]["x"]
            events.append(("build", impl))
            fn = lambda: None  # noqa: E731
            fn.impl = impl
            return fn
        return build

    def timed(fn, op, rep_ms):
        events.append(("time", fn.impl))
        return 1.0

    x = torch.arange(4.0).requires_grad_()
    monkeypatch.setattr(bench, "_input_copies", lambda *args: [{"x": x}])
    monkeypatch.setattr(bench, "_prepared", lambda build, copies: build(copies))
    monkeypatch.setattr(bench, "_timed_ms", timed)
    for op_name in ("cross_entropy_fwdbwd", "cross_entropy_fwdbwd_graphed"):
        op = bench.dataclasses.replace(
            bench.OPS[op_name], ours=builder(bench.OURS),
            baselines={name: builder(name) for name in ("torch", "liger")})
        given.clear()
        events.clear()
        bench.run_case(op, "bf16", 8, 8, 1000.0, with_baselines=True)
        assert given[bench.OURS] is x and given["torch"] is x
        assert given["liger"] is not x and torch.equal(given["liger"], x)
        assert given["liger"].requires_grad and given["liger"].is_leaf
        if op.interleaved:
            assert events[:4] == [("build", bench.OURS), ("build", "torch"),
                                  ("build", "liger"), ("time", bench.OURS)]
        else:
            assert events[:3] == [("build", bench.OURS), ("time", bench.OURS),
                                  ("build", "torch")]
        assert events.count(("time", "liger")) == (bench.TIMING_ROUNDS if op.interleaved else 1)


SASS_HEAD = """
        code for sm_90a
                Function : kernel_0
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R20, SR_TID.X ;
        /*0020*/                   LDC.64 R2, c[0x0][0x210] ;
"""


def _sass(*lines):
    return SASS_HEAD + "".join(f"        /*{0x30 + 16 * i:04x}*/                   {line} ;\n"
                               for i, line in enumerate(lines))


def test_uninitialized_reads_on_some_path():
    """The compiler fault of the CUDA 13 ptxas (report.uninitialized_reads): the thread
    index used from a register nothing wrote. Writes of every width count (a 64-bit
    constant load, a shuffle's value after its predicate), reads inside an address too,
    and a merging opcode's read of its own destination is not judged (any other's is).
    Over branches: a register written on one side only is unwritten after the merge;
    written on both sides, or before a loop that reads it, it is written."""
    from quack_kernels.report import uninitialized_reads

    clean = _sass("IMAD.SHL.U32 R14, R20, 0x8, RZ", "SHFL.BFLY PT, R5, R14, 0x10, 0x1f",
                  "PRMT R15, R14, 0x7632, R15",  # (a 16-bit half packed into undefined bits)
                  # a predicate written before the register, then read: R52 is written
                  "LOP3.LUT P0, R52, R20, 0xfc, RZ, 0xc0, !PT",
                  "ISETP.NE.U32.AND P1, PT, R52, RZ, PT",
                  "@!P3 LDGSTS.E.LTC128B.128 [R5], desc[UR12][R2.64]", "EXIT")
    assert uninitialized_reads(clean) == []
    faulty = _sass("IMAD.SHL.U32 R14, R8, 0x8, RZ", "LEA R12, R8, UR4, 0x4",
                   "LDGSTS.E.128 [R12], desc[UR12][R4.64]", "EXIT")
    reads = uninitialized_reads(faulty)
    assert [r.split()[0] for r in reads] == ["0030", "0040", "0050", "0050"]
    assert reads[0].endswith("(R8)") and reads[-1].endswith("(R5)")
    # an ISETP's predicates precede its sources: its registers are read
    assert uninitialized_reads(_sass("ISETP.NE.AND P0, PT, R40, RZ, PT"))[0].endswith("(R40)")
    # a read of its own destination by an opcode that does not merge
    assert uninitialized_reads(_sass("IMAD.SHL.U32 R8, R8, 0x8, RZ", "EXIT")) != []
    # 0x30: branch over the write at 0x40 to the merge at 0x50; the condition written
    # as an operand (BRA !P0, ...) falls through as much as a predicated branch
    for branch in ("@P0 BRA 0x50", "BRA !P0, 0x50", "BRA.U !UP0, 0x50"):
        one_side = _sass(branch, "MOV R9, R20", "IADD3 R10, R9, 0x1, RZ", "EXIT")
        assert [r.split()[0] for r in uninitialized_reads(one_side)] == ["0050"], branch
    both_sides = _sass("@P0 BRA 0x60", "MOV R9, R20", "BRA 0x70", "MOV R9, RZ",
                       "IADD3 R10, R9, 0x1, RZ", "EXIT")
    assert uninitialized_reads(both_sides) == []
    # a loop (0x40-0x60) reading what is written before it and again in it
    loop = ["IADD3 R10, R9, 0x1, RZ", "MOV R9, R10", "@P0 BRA 0x40", "EXIT"]
    assert uninitialized_reads(_sass("MOV R9, RZ", *loop)) == []
    assert [r.split()[0] for r in uninitialized_reads(_sass("NOP", *loop))] == ["0040"]
    # what a subroutine returns (a division's slow path) counts as written
    call = _sass("CALL.REL.NOINC 0x60", "MOV R8, R10", "EXIT", "MOV R10, RZ", "RET.REL.NODEC R6 0x0")
    assert uninitialized_reads(call) == []
    # a branch whose target is no instruction (or no address) adds no edge, no error
    assert uninitialized_reads(_sass("@P0 BRA 0x1000", "BRA `(.L_x_1)", "EXIT")) == []


def test_uninitialized_reads_find_the_miscompile():
    """The entry of the kernel CUDA 13's ptxas miscompiled, as cuobjdump printed it
    (tests/data): the thread index read twice from R8, which nothing writes."""
    from quack_kernels.report import uninitialized_reads

    with open(os.path.join(ROOT, "tests", "data", "cuda13_thread_index_miscompile.sass")) as f:
        reads = uninitialized_reads(f.read())
    assert [(r.split()[0], r.split()[-1]) for r in reads] == [("0050", "(R8)"), ("02b0", "(R8)")]


def test_l2_prefetch_compiles_to_bulk_prefetches(tmp_path, cuobjdump):
    """RowConfig.l2_prefetch puts one bulk L2 prefetch (UBLKPF) per staged tensor in the
    norm backward's sm_90a code (its default at fp32 262144, config.with_l2_prefetch);
    without it there is none."""
    import dataclasses

    from quack_kernels.ops import norm
    from quack_kernels.report import measure

    f32 = torch.float32
    cfg = norm.backward_config(262144, f32, f32, (f32,), f32, 1, rms=True)
    assert cfg.l2_prefetch
    variants = [(f"l2_prefetch={ahead}", 262144, f32, c,
                 lambda c=c: norm.backward_kernel(c, True, f32, f32, f32, False, None, f32,
                                                  None, True, False))
                for ahead, c in ((1, cfg), (0, dataclasses.replace(cfg, l2_prefetch=0)))]
    counts = [res["bulk_prefetches"] for *_, res in measure(variants, str(tmp_path),
                                                            cuobjdump)]
    assert counts == [2, 0]


def test_l2_prefetch_refuses_vectors_under_16_bytes():
    """A bulk prefetch starts and ends on 16 bytes: a share of narrower vectors (1001
    fp32 columns: one value each) is refused when it compiles, never run misaligned."""
    import dataclasses

    from quack_kernels.ops import softmax
    from quack_kernels.primitives.compile_cache import compile_kernel

    f32 = torch.float32
    cfg = dataclasses.replace(softmax.forward_config(1001, f32), l2_prefetch=1)
    with pytest.raises(ValueError, match="whole 16-byte vectors"):
        compile_kernel(*softmax.forward_kernel(cfg, f32, False))


def test_reversed_dy_reread_carries_l2_hints_in_the_ptx(tmp_path):
    """The fp32 softmax backward of 1M columns (config.rereads_in_reverse) reads each
    dy vector twice with an L2 policy, evict_last then evict_first, stores every dx
    vector with evict_first, and its output pass starts at the last chunk (its first
    store lies furthest into the row); at 800000 columns nothing carries a policy and
    the output pass starts at chunk 0."""
    from quack_kernels.ops import softmax
    from quack_kernels.primitives.tiling import L2_POLICIES

    f32 = torch.float32
    for n, hinted in ((1 << 20, True), (800000, False)):
        cfg = softmax.backward_config(n, f32, log=False)
        ptx = compiled_ptx(softmax.backward_kernel(cfg, f32, False), tmp_path / str(n))
        vectors = cfg.num_chunks * cfg.vecs_per_thread  # of dy (and dx) a thread
        loads = len(re.findall(r"ld\.global\.L2::cache_hint\.v4", ptx))
        stores = re.findall(r"st\.global[.\w:]*\.v4\.b32\s*\[%rd\d+\+?(\d*)\]", ptx)
        hinted_stores = len(re.findall(r"st\.global\.L2::cache_hint\.v4", ptx))
        policies = [len(re.findall(rf"mov\.b64\s+%rd\d+, {L2_POLICIES[p]};", ptx))
                    for p in ("evict_last", "evict_first")]
        assert len(stores) == vectors, n
        offsets = [int(o or 0) for o in stores]
        if hinted:
            assert (loads, hinted_stores) == (2 * vectors, vectors)
            assert policies == [vectors, 2 * vectors]
            assert offsets[0] == (cfg.num_chunks - 1) * cfg.cols_per_chunk * 4
        else:
            assert (loads, hinted_stores, policies) == (0, 0, [0, 0])
            assert offsets[0] == 0


def test_training_step_kernels_overlap_their_launches_in_the_ptx(tmp_path):
    """The cross-entropy training step's kernels (mean denominator, loss + gradient,
    rescale) are launched with programmatic dependent launch: each waits for the kernel
    before it (griddepcontrol.wait) before it touches global memory; the loss and the
    rescale let the next kernel in right after that wait, the denominator only after its
    last access. A kernel launched the usual way (softmax forward) carries neither."""
    from quack_kernels.ops import cross_entropy, rescale, softmax

    bf16, i64 = torch.bfloat16, torch.int64
    wait, let_in = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
    kernels = {
        "loss": (cross_entropy.forward_kernel(
            cross_entropy.forward_config(4096, bf16, False, True), bf16, i64, weighted=False,
            smoothing=False, zloss=False, softcap=False, write_grad=True, reduce="mean"),
            [wait, let_in, "global"], ["global"]),
        "rescale": (rescale.rescale_kernel(rescale.rescale_config(4096, bf16), bf16, None, i64,
                                           False), [wait, let_in, "global"], ["global"]),
        "denominator": (cross_entropy.mean_denominator_kernel(False, i64),
                        [wait, "global"], ["global", let_in]),
        "softmax": (softmax.forward_kernel(softmax.forward_config(4096, bf16), bf16, False),
                    ["global"], ["global"]),
    }
    for name, (kernel_and_fakes, first, last) in kernels.items():
        ptx = compiled_ptx(kernel_and_fakes, tmp_path / name)
        events = ["global" if m.group(1) else m.group(0) for m in re.finditer(
            r"griddepcontrol\.\w+|\b((?:ld|st|atom|red|multimem|prefetch|cp\.async)\.[\w.:]*global)",
            ptx)]
        grid_controls = [e for e in events if e != "global"]
        assert events[:len(first)] == first and events[-len(last):] == last, (name, events[:4])
        assert grid_controls == [e for e in first + last if e != "global"], name
        # the launch asks for it exactly where the kernel waits (RowKernel.launch, and
        # MeanDenominator's own)
        assert kernel_and_fakes[0].programmatic_launch == (wait in grid_controls), name


def test_cluster_barriers_in_the_sass(tmp_path, cuobjdump):
    """rows.ReductionSlot on a cluster: a looping reduction waits on one mbarrier per
    scratch buffer (two inits, SYNCS.EXCH.64), a kernel with two one-off reductions
    (LayerNorm forward with a residual) on one per reduction, and each thread arrives
    on the cluster barrier once before its wait (one UCGABAR_ARV) however many slots
    it sets up."""
    import collections
    import re

    from quack_kernels.ops import norm
    from quack_kernels.report import measure, disassembly

    f32, bf16 = torch.float32, torch.bfloat16
    looping = norm.backward_config(4096, f32, f32, (f32,), f32, 2)
    one_block = norm.forward_config(65536, False, bf16, bf16, True, bf16, bf16, bf16)
    assert looping.cluster_size > 1 and looping.stages == 2 and one_block.cluster_size > 1
    variants = [
        ("looping", 4096, f32, looping, lambda: norm.backward_kernel(
            looping, False, f32, f32, f32, False, None, f32, None, True, True)),
        ("one_block", 65536, bf16, one_block, lambda: norm.forward_kernel(
            one_block, False, bf16, bf16, True, True, bf16, bf16, bf16))]
    reductions = {name: kernel.reductions
                  for name, _, _, _, kernel, _ in measure(variants, str(tmp_path), cuobjdump)}
    assert reductions == {"looping": 1, "one_block": 2}
    cubins = {cubin.parent: cubin for cubin in tmp_path.rglob("*.cubin")}  # one a variant
    assert len(cubins) == 2
    for cubin in cubins.values():
        sass = disassembly(str(cubin), cuobjdump)
        found = collections.Counter(re.findall(r"\b(SYNCS\.EXCH\.64|UCGABAR_ARV)\b", sass))
        assert (found["SYNCS.EXCH.64"], found["UCGABAR_ARV"]) == (2, 1), cubin


def test_bf16_widened_by_integer_ops_where_the_config_says(tmp_path, cuobjdump):
    """config.widens_by_integer_ops: the RMSNorm bf16 backward of 262144 columns (shares
    in shared memory over a cluster) widens its bf16 pairs with a mask of the high half
    (LOP3 0xffff0000) and unpacks none (PRMT); on register shares (4096 columns) it keeps
    the DSL's conversion, which unpacks every pair."""
    import re

    from quack_kernels.ops import norm
    from quack_kernels.primitives.config import widens_by_integer_ops
    from quack_kernels.report import disassembly, measure

    bf16 = torch.bfloat16
    configs = {n: norm.backward_config(n, bf16, bf16, (bf16,), bf16, 1, rms=True)
               for n in (4096, 262144)}
    assert [widens_by_integer_ops(cfg) for cfg in configs.values()] == [False, True]
    for n, cfg in configs.items():
        variant = (str(n), n, bf16, cfg, lambda cfg=cfg: norm.backward_kernel(
            cfg, True, bf16, bf16, bf16, False, None, bf16, None, True, False))
        (tmp_path / str(n)).mkdir()
        list(measure([variant], str(tmp_path / str(n)), cuobjdump))
        cubin = next((tmp_path / str(n)).rglob("*.cubin"))  # (the DSL may keep two copies)
        sass = disassembly(str(cubin), cuobjdump)
        masks = len(re.findall(r"LOP3\.LUT [^;]*0xffff0000", sass))
        unpacks = sass.count("PRMT")
        values = cfg.thread_values
        if widens_by_integer_ops(cfg):
            assert masks >= values // 2 and unpacks < values // 8, (n, masks, unpacks)
        else:
            assert masks == 0 and unpacks >= values // 2, (n, masks, unpacks)


@pytest.mark.parametrize("kind, n, store", [
    ("ln_bwd", 262144, "STAS.64"),   # dot and g_sum, the CTA's warps merged first
    ("ln_bwd", 65536, "STAS.64"),    # the same from every warp
    ("ln_fwd", 65536, "STAS.128"),   # count, mean, centered squares: padded to four
])
def test_cluster_partials_are_one_vector_store(tmp_path, kind, n, store, cuobjdump):
    """Each exchange of a cluster reduction sends a slot as one vector st.async (one
    packet between SMs), however many values it carries (reduce.slot_words)."""
    from quack_kernels.ops import norm
    from quack_kernels.primitives.compile_cache import compile_kernel

    bf16 = torch.bfloat16
    if kind == "ln_bwd":
        cfg = norm.backward_config(n, bf16, bf16, (bf16,), bf16, 2, rms=False)
        kernel, *fakes = norm.backward_kernel(cfg, False, bf16, bf16, bf16, False, None, bf16,
                                              None, True, True)
    else:
        cfg = norm.forward_config(n, False, bf16, bf16, False, bf16, bf16, bf16)
        kernel, *fakes = norm.forward_kernel(cfg, False, bf16, bf16, False, False, bf16, bf16,
                                             bf16)
        assert kernel.moments
    assert cfg.cluster_size > 1
    fn = compile_kernel(kernel, *fakes, keep_cubin_in=str(tmp_path))
    sass = disassembly(_cubin_file(fn.__cubin__, str(tmp_path)), cuobjdump)
    stores = re.findall(r"\bSTAS(?:\.\w+)*", sass)
    assert stores == [store], stores


@pytest.mark.parametrize("rms", [True, False])
def test_narrow_vectors_land_in_registers_before_shared_memory(tmp_path, rms, cuobjdump):
    """Odd 16-bit rows (2-byte vectors, no cp.async) are staged by plain loads: every
    load of a chunk is issued before the first shared-memory store waits for one
    (RowTiles._issue_chunk), instead of one load in flight per thread; and nothing
    spills (the unmasked RMSNorm re-read did, NormBackward.rereads_unmasked)."""
    from quack_kernels.ops import norm
    from quack_kernels.primitives.compile_cache import compile_kernel

    bf16 = torch.bfloat16
    cfg = norm.backward_config(50257, bf16, bf16, (bf16,), bf16, 1 if rms else 2, rms=rms)
    assert cfg.vec == 1 and cfg.staging != "global"
    kernel, *fakes = norm.backward_kernel(cfg, rms, bf16, bf16, bf16, False, None, bf16,
                                          None, True, not rms)
    fn = compile_kernel(kernel, *fakes, keep_cubin_in=str(tmp_path))
    cubin = _cubin_file(fn.__cubin__, str(tmp_path))
    usage = resource_usage(cubin, cuobjdump)
    assert usage["stack"] == 0 and usage["local"] == 0, usage
    sass = disassembly(cubin, cuobjdump)
    staging = sass[:sass.index("STS.U16")]
    # h and dy: one 16-bit load per vector of the chunk each
    assert len(re.findall(r"\bLDG\.E\.U16\b", staging)) >= 2 * cfg.vecs_per_thread


@pytest.mark.parametrize("dweight", [False, True])
def test_zero_fill_past_the_row_end_takes_no_select(tmp_path, dweight, cuobjdump):
    """RowTiles.values(fill=0) of a ragged share reads the staging's own zeros past the row
    end (a predicated-off cp.async zero-fills its vector, plain-load staging fills 0
    first), and RMSNorm's xhat is 0 there too: the RMSNorm backward of odd rows, whose
    every fill is 0, selects per row at most its statistics, not per value (66 FSEL and
    more before)."""
    from quack_kernels.ops import norm
    from quack_kernels.primitives.compile_cache import compile_kernel

    bf16 = torch.bfloat16
    cfg = norm.backward_config(50257, bf16, bf16, (bf16,), bf16, int(dweight), rms=True)
    assert cfg.needs_col_predicate and cfg.vec == 1
    kernel, *fakes = norm.backward_kernel(cfg, True, bf16, bf16, bf16, False, None, bf16,
                                          None, dweight, False)
    fn = compile_kernel(kernel, *fakes, keep_cubin_in=str(tmp_path))
    sass = disassembly(_cubin_file(fn.__cubin__, str(tmp_path)), cuobjdump)
    selects = len(re.findall(r"\bFSEL\b", sass))
    assert selects <= 2, f"{selects} FSEL ({cfg})"


@pytest.mark.slow
@pytest.mark.parametrize("n, dtype, weight_dtype, rms, sums", [
    (16385, torch.bfloat16, torch.bfloat16, True, 1),
    (32001, torch.bfloat16, torch.bfloat16, True, 1),
    (131073, torch.float16, torch.float16, True, 1),
    (245759, torch.bfloat16, torch.bfloat16, True, 1),
    (50257, torch.bfloat16, torch.float32, True, 1),
    (65537, torch.bfloat16, torch.bfloat16, False, 2),
    (139263, torch.float16, torch.float16, False, 2),
    (131073, torch.bfloat16, torch.float32, False, 2),
    (100001, torch.bfloat16, torch.bfloat16, False, 1)])
def test_odd_row_register_shares_do_not_spill(tmp_path, n, dtype, weight_dtype, rms, sums, cuobjdump):
    """The register shares of odd 16-bit norm backward rows (config.odd_row_register_share:
    dx and the weight's and bias' sums; RMSNorm 1024 threads, 64 registers a thread,
    LayerNorm 512, 128) keep every value in registers, from two CTAs to a full cluster
    and with an fp32 weight (RMSNorm at 16 values a thread spilled 32 bytes at 32001 bf16
    columns, LayerNorm on 1024 threads 32-120 bytes)."""
    from quack_kernels.ops import norm
    from quack_kernels.primitives import config

    cfg = norm.backward_config(n, dtype, dtype, (dtype,), weight_dtype, sums, rms=rms)
    threads, _ = config.ODD_ROW_SHARES[rms]
    assert (cfg.threads_per_row, cfg.staging, cfg.vec) == (threads, "registers", 1), cfg
    need_dbias = not rms and sums == 2
    variant = ("norm_bwd", n, dtype, cfg, lambda: norm.backward_kernel(
        cfg, rms, dtype, dtype, weight_dtype, False, None, dtype, None, True, need_dbias))
    (*_, usage), = measure([variant], str(tmp_path), cuobjdump)
    assert spills(usage) == 0, (cfg, usage)


@pytest.mark.parametrize("n, dtype, rms, sums, residual", [
    (262143, torch.bfloat16, False, True, False), (262145, torch.float16, False, True, False),
    (290817, torch.bfloat16, False, True, False), (262143, torch.float16, False, True, True),
    (262143, torch.bfloat16, False, False, True), (262143, torch.bfloat16, True, True, True)])
def test_norm_backward_past_a_full_cluster_does_not_spill(tmp_path, cuobjdump, n, dtype, rms,
                                                           sums, residual):
    """The shifted backward of odd 16-bit rows one vector past 16 CTAs' power-of-two
    shares (the report's N grid has none of them): LayerNorm's dweight and dbias take
    config.shifted_sums_share (CTAs of 11-12 whole warps, 168 registers a thread, the
    weight read spliced; 13 warps at 128 registers spilled 8 bytes), with a residual's
    gradients too; with those gradients LayerNorm without sums (128 registers) and
    RMSNorm with dweight (255) keep their span shares, and spilled 8 bytes before the
    class sizes were kept in shared memory (rows.ShiftClassOrder.keep)."""
    from quack_kernels.ops import norm

    accumulators = (1 if rms else 2) if sums else 0
    outs = (dtype,) * (3 if residual else 1)
    cfg = norm.backward_config(n, dtype, dtype, outs, dtype, accumulators, rms=rms,
                               shifted=True)
    assert cfg.row_shift, cfg
    span_sums = sums and not rms
    assert (cfg.threads_per_row in (352, 384)) == span_sums, cfg
    variant = ("norm_bwd", n, dtype, cfg, lambda: norm.backward_kernel(
        cfg, rms, dtype, dtype, dtype, residual, dtype if residual else None, dtype,
        dtype if residual else None, sums, span_sums))
    (*_, kernel, usage), = measure([variant], str(tmp_path), cuobjdump)
    assert kernel.weight_staged != span_sums and kernel.keeps_class_sizes
    assert spills(usage) == 0, (cfg, usage)


def test_layer_norm_forward_loads_the_next_chunks_columns_before_its_stores(tmp_path,
                                                                            cuobjdump):
    """config.norm_forward_columns_ahead in the sm_90a code: where it applies (bf16 65536
    columns, four chunks; bf16 x with an fp32 weight and bias, whose output is stored
    8 bytes a vector) the weight and bias vectors of two chunks are loaded before the
    first store of the output; on a two-chunk share (fp32 32768) one chunk's."""
    from quack_kernels.ops import norm

    bf16, f32 = torch.bfloat16, torch.float32
    for n, dtype, columns, ahead in ((65536, bf16, bf16, True), (65536, bf16, f32, True),
                                     (32768, f32, f32, False)):
        cfg = norm.forward_config(n, False, dtype, dtype, False, dtype, columns, columns)
        folder = tmp_path / f"{n}_{columns.itemsize}"
        folder.mkdir()
        variant = (str(n), n, dtype, cfg, lambda: norm.forward_kernel(
            cfg, False, dtype, dtype, False, False, columns, columns, dtype))
        (*_, kernel, _), = measure([variant], str(folder), cuobjdump)
        assert kernel.columns_ahead == ahead
        cubin, = {c.parent: c for c in folder.rglob("*.cubin")}.values()  # (one a variant)
        store = f"STG.E.{8 * cfg.vec * dtype.itemsize}"  # (the columns' loads: 16 bytes)
        accesses = re.findall(r"\b(LDG\.E\.128|STG\.E\.(?:64|128))\b",
                              disassembly(str(cubin), cuobjdump))
        loads_first = accesses[:accesses.index(store)].count("LDG.E.128")
        per_chunk = 2 * cfg.vecs_per_thread  # the weight and bias vectors of one chunk
        assert loads_first == (2 if ahead else 1) * per_chunk, (n, loads_first)

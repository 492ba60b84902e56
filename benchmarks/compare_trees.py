"""Kernel timings of several source trees of quack_kernels in one GPU session, side by
side. Each tree runs in its own process with its package first on sys.path, so two
versions of a kernel are timed on the same GPU minutes apart (a sweep across sessions
compares different machines and clocks). The trees compile at once, then take turns
(with --abba a second turn each, in reverse order, in the same processes). Timing as
the runner's: an L2 flush before each call (a reading one where the case only reads,
ce_loss / ce_mean / ce_loss_opts) hides the host time, so the numbers are the kernels'.

    git archive main quack_kernels | tar -x -C /tmp/tree_main    # a tree of main
    python benchmarks/compare_trees.py --trees /tmp/tree_main,. --abba \\
        --cases ce_loss,ce_grad,sm_fwd --shapes bf16:4096x128256,bf16:8192x151936

Cases (bytes per element of the row tensor moved, each input read once and each
output written once): sm_fwd 2, sm_bwd 3 (softmax), ce_loss 1, ce_grad 2 (the
cross-entropy forward without and with the gradient), ce_loss_opts 1 and ce_grad_opts 2
(the same with label smoothing 0.1, z-loss 1e-4 and softcap 30), ce_mean 1 (the public
loss alone with its mean, every launch it makes), rms_fwd / ln_fwd 2 and
rms_fwd_res / ln_fwd_res 4 (norm forward of x, or of x + residual with the sum stored),
rms_bwd / ln_bwd 3 (norm backward: dx, dweight and for LayerNorm dbias), rms_bwd_res /
ln_bwd_res 5 (the same with a residual's gradients: the stream's incoming gradient read,
dx and the residual's gradient written).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

CASES = ("sm_fwd", "sm_bwd", "lsm_bwd", "ce_loss", "ce_grad", "ce_loss_opts", "ce_grad_opts",
         "ce_mean", "ce_step", "rms_fwd", "ln_fwd", "rms_fwd_res", "ln_fwd_res", "rms_bwd",
         "ln_bwd", "rms_bwd_res", "ln_bwd_res", "rms_fwd_w32", "ln_fwd_w32", "ln_fwd_res_w32")
DEFAULT_SHAPES = "bf16:4096x128256,bf16:8192x151936,bf16:2048x65536,bf16:512x262144"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", required=True,
                   help="comma list of directories, each holding a quack_kernels/ package")
    p.add_argument("--cases", default="sm_fwd,ce_loss,ce_grad",
                   help=f"comma list of {','.join(CASES)}")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="dtype:MxN,...")
    p.add_argument("--abba", action="store_true",
                   help="time the trees in order, then in reverse (A B B A), and report each "
                        "tree's mean; a cell whose two runs differ by more than 3%% is marked ~ "
                        "(kernels under ~50 us moved 20%% with their place in one run)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # the tree this process times
    args = p.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        p.error(f"unknown cases {','.join(sorted(unknown))}")
    return args


def case_call(case, x):
    """(the call to time, row-tensor elements moved per element of x). The CUDA
    implementations are called directly: the custom ops' dispatcher layers cost more
    host time than the L2 flush before each call hides."""
    import torch
    import quack_kernels as qk
    from quack_kernels.ops import cross_entropy as ce_ops
    from quack_kernels.ops import norm as norm_ops
    from quack_kernels.ops import softmax as sm_ops

    m, n = x.shape
    if case == "sm_fwd":
        return (lambda: qk.softmax(x)), 2
    if case in ("sm_bwd", "lsm_bwd"):
        log = case == "lsm_bwd"
        y, dy = (qk.log_softmax if log else qk.softmax)(x), torch.randn_like(x)
        return (lambda: sm_ops._softmax_backward_cuda(y, dy, log)), 3
    if case.startswith("ce_"):
        target = torch.randint(0, n, (m,), device=x.device)
        if case == "ce_mean":
            return (lambda: qk.cross_entropy(x, target)), 1
        if case == "ce_step":  # the training step: loss and gradient through autograd
            leaf = x.detach().requires_grad_()

            def step():
                leaf.grad = None
                with torch.enable_grad():
                    qk.cross_entropy(leaf, target).backward()
            return step, 2
        grad = case.startswith("ce_grad")
        options = (0.1, 1e-4, 30.0) if case.endswith("_opts") else (0.0, 0.0, 0.0)
        # an explicit per-row scale, so that no extra kernel fills one
        scale = torch.ones(m, device=x.device) if grad else None
        return (lambda: ce_ops._cross_entropy_forward_cuda(x, target, None, -100, *options,
                                                           grad, scale)), 2 if grad else 1
    # ("_w32": the norm's weight and bias in fp32, e.g. bf16 activations with fp32 params)
    column_dtype = torch.float32 if case.endswith("_w32") else x.dtype
    case = case.removesuffix("_w32")
    weight = torch.randn(n, device=x.device, dtype=column_dtype)
    bias = torch.randn(n, device=x.device, dtype=column_dtype)
    if "_bwd" in case:
        rms = case.startswith("rms")
        _, _, mean, rstd = norm_ops.norm_forward(x, weight, None if rms else bias, None, 1e-5,
                                                 0.0, rms, None, None, False)
        dy = torch.randn_like(x)
        dres_out = torch.randn_like(x) if case.endswith("_res") else None
        dres_dtype = None if dres_out is None else x.dtype
        return (lambda: norm_ops._norm_backward_cuda(dy, x, weight, mean, rstd, dres_out, 0.0,
                                                     rms, x.dtype, dres_dtype, True,
                                                     None if rms else x.dtype)), \
            3 if dres_out is None else 5
    residual = torch.randn_like(x) if case.endswith("_res") else None
    moved = 2 if residual is None else 4
    if case.startswith("rms"):
        return (lambda: qk.rms_norm(x, weight, residual=residual,
                                    prenorm=residual is not None)), moved
    return (lambda: qk.layer_norm(x, weight, bias, residual=residual,
                                  prenorm=residual is not None)), moved


def child(args):
    """Child process: this tree's package first on sys.path; compile and warm every
    (case, shape), say ready, then time them all each time the parent writes "time" on
    stdin (one JSON line each, then a "done" line) until it writes "quit"."""
    tree = os.path.abspath(args.child)
    sys.path.insert(0, tree)
    import torch
    import quack_kernels

    if not os.path.abspath(quack_kernels.__file__).startswith(tree + os.sep):
        sys.exit(f"{args.child} holds no quack_kernels package (imported "
                 f"{quack_kernels.__file__} instead)")
    if not torch.cuda.is_available():
        sys.exit("compare_trees.py times kernels: it needs a CUDA GPU")
    print(json.dumps(dict(package=os.path.dirname(quack_kernels.__file__))), flush=True)
    for _ in each_case(args, time=False):
        pass
    print(json.dumps(dict(ready=True)), flush=True)
    for command in sys.stdin:
        if command.strip() != "time":
            break
        for row in each_case(args, time=True):
            print(json.dumps(row), flush=True)
        print(json.dumps(dict(done=True)), flush=True)


def each_case(args, time: bool):
    """Run every (case, shape) once (the compile, while other trees compile too), and
    with ``time`` measure it: one row each."""
    import torch
    from quack_kernels.bench import measure_copy_ceiling_gbps, time_device_ms

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    ceiling = measure_copy_ceiling_gbps() if time else None
    for shape in args.shapes.split(","):
        name, mn = shape.split(":")
        m, n = (int(v) for v in mn.split("x"))
        x = torch.randn(m, n, device="cuda", dtype=dtypes[name])
        for case in args.cases.split(","):
            row = dict(case=case, shape=shape)
            try:
                with torch.no_grad():
                    call, moved = case_call(case, x)
                    call()
                    if time:
                        # moving one byte per element reads only: the runner's
                        # reading flush (OpBench.reads_only), no dirty L2 to write back
                        ms = time_device_ms(call, reading_flush=moved == 1)
                        row.update(us=ms * 1e3, pct=100 * moved * x.numel() * x.element_size()
                                   / ms / 1e6 / ceiling)
            except Exception as e:  # reported in the table, the other cases go on
                row.update(error=f"{type(e).__name__}: {e}"[:80])
            yield row
        del x
        torch.cuda.empty_cache()


class Tree:
    """A child process for one tree (its stderr kept in a file, so that a chatty child
    cannot block on a full pipe)."""

    def __init__(self, tree, args):
        self.tree = tree
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--trees", args.trees, "--cases",
             args.cases, "--shapes", args.shapes, "--child", tree],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def rows_until(self, key):
        """The JSON rows the child prints up to the one holding ``key`` (None if it
        exits first: its exit status and stderr are printed)."""
        rows = []
        for line in self.proc.stdout:
            if line.startswith("{"):
                row = json.loads(line)
                if key in row:
                    return rows
                rows.append(row)
        self.proc.wait()
        self.log.seek(0)
        print(f"{self.tree}: exit {self.proc.returncode}\n{self.log.read()[-2000:]}")
        return None

    def command(self, text):
        if self.proc.poll() is None:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    trees = args.trees.split(",")
    # every tree compiles at once (compiling takes most of a run); they time one by one
    children = {tree: Tree(tree, args) for tree in trees}
    ready = {}
    for tree, proc in children.items():
        rows = proc.rows_until("ready")
        ready[tree] = rows is not None
        for row in rows or []:
            if "package" in row:
                print(f"{tree}: {row['package']}")
    results = {}  # (case, shape) -> tree -> its rows, one per run
    for tree in trees + (trees[::-1] if args.abba else []):
        if not ready[tree]:
            continue
        children[tree].command("time")
        rows = children[tree].rows_until("done")
        ready[tree] = rows is not None
        for row in rows or []:
            results.setdefault((row["case"], row["shape"]), {}).setdefault(tree, []).append(row)
    for proc in children.values():
        proc.command("quit")
        proc.proc.wait()
    print(f"{'case':11s} {'shape':18s} " + " | ".join(f"{t[-24:]:>24s}" for t in trees))
    for (case, shape), by_tree in results.items():
        cells = (cell(by_tree.get(tree, [])) for tree in trees)
        print(f"{case:11s} {shape:18s} " + " | ".join(cells))


def cell(runs: list) -> str:
    """One tree's result for a case: the mean over its runs, ~ where they differ by more
    than 3%, or the first error."""
    timed = [row for row in runs if "error" not in row]
    if not timed:
        return f"{runs[0]['error'][:24] if runs else 'missing':>24s}"
    us = sum(row["us"] for row in timed) / len(timed)
    pct = sum(row["pct"] for row in timed) / len(timed)
    spread = max(row["us"] for row in timed) / min(row["us"] for row in timed) - 1
    return f"{us:10.1f}us {pct:6.1f}% {'~' if spread > 0.03 else ' '}  "


if __name__ == "__main__":
    sys.exit(main())

"""sm_90a resource report: compile every kernel variant and read its resource use.

    python -m quack_kernels.report [--quick] [--family softmax ...] [--jobs N]

Works without a GPU: ``CUTE_DSL_ARCH=sm_90a`` (set by the package on import when no GPU
is visible, see compile_cache.compile_for_hopper_without_gpu) lets
``cute.compile`` produce the cubin, and ``cuobjdump -res-usage`` (PyPI package
``nvidia-cuda-cuobjdump``) reads registers, stack and local memory from it. Our
kernels call no functions, so a stack frame (STACK > 0) holds spilled registers
(nvdisasm marks its loads and stores "SpillRefill"), as does local memory (LOCAL > 0);
``cuobjdump -sass`` (with ``nvidia-cuda-nvdisasm``) shows any WARPSYNC (see
warp_syncs) and any register read before it is written (uninitialized_reads, a
compiler fault). The report exits 1 when it sees a spill, a warp sync or such a read. Compiling is
single-threaded, so ``--jobs`` worker processes (default: the cores, at most 4) share
the variants.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

N_GRID = [256, 1000, 1024, 4096, 4097, 8192, 16384, 32000, 50257, 65536, 131073, 262144]
N_GRID_LARGE = [1048576]  # softmax only: the issue asks for 1M columns
QUICK_N_GRID = [1000, 4096, 65536, 262144]


def families() -> dict:
    """family -> (report_variants function, N grid). Every ops module of a kernel
    family exposes ``report_variants(n_grid, dtypes)``."""
    from .ops import cross_entropy, norm, rescale, softmax

    return {
        "softmax": (softmax.report_variants, N_GRID + N_GRID_LARGE),
        "norm": (norm.report_variants, N_GRID),
        "cross_entropy": (cross_entropy.report_variants, N_GRID + [524288]),
        "rescale": (rescale.report_variants, N_GRID + [524288]),
    }


def find_cuobjdump() -> str | None:
    path = shutil.which("cuobjdump")
    if path:
        return path
    import site

    roots = site.getsitepackages() + [site.getusersitepackages()]
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "*", "bin", "cuobjdump")))
        if hits:
            return hits[-1]
    return None


def _cubin_file(cubin, dump_dir: str) -> str:
    """The DSL hands back the cubin as a path or as its bytes, depending on version."""
    if isinstance(cubin, bytes):
        path = os.path.join(dump_dir, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return path
    return cubin


_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: str, cuobjdump: str) -> dict:
    out = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    match = _RES.search(out)
    if not match:
        raise RuntimeError(f"cuobjdump printed no resource line for {cubin}:\n{out}")
    reg, stack, shared, local = map(int, match.groups())
    return dict(regs=reg, stack=stack, static_smem=shared, local=local)


def cubin_arch(cubin: str, cuobjdump: str) -> str:
    """The SM architecture a cubin holds code for (``cuobjdump -lelf`` names it)."""
    out = subprocess.run([cuobjdump, "-lelf", cubin], capture_output=True, text=True, check=True).stdout
    match = re.search(r"\.(sm_\d+[a-z]?)\.cubin\s*$", out.strip())
    if not match:
        raise RuntimeError(f"cuobjdump -lelf named no architecture for {cubin}:\n{out}")
    return match.group(1)


def spills(res: dict) -> int:
    """Bytes per thread of spilled registers (stack frame and local memory)."""
    return res["stack"] + res["local"]


def disassembly(cubin: str, cuobjdump: str) -> str:
    """The cubin's SASS (``cuobjdump -sass``)."""
    # cuobjdump disassembles with nvdisasm, which pip installs next to it
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(cuobjdump),
                                                  os.environ.get("PATH", "")]))
    run = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, env=env)
    if run.returncode:
        raise RuntimeError(f"cuobjdump -sass failed (it needs nvdisasm: pip install "
                           f"'nvidia-cuda-nvdisasm>=13.4'): {run.stderr.strip()}")
    return run.stdout


def warp_syncs(sass: str) -> int:
    """WARPSYNC instructions in ``sass``. Our kernels reconverge at barriers and use
    shuffles only where the whole warp runs, so they have none; the compiler emits one
    for a full-warp ``*_sync`` (a shuffle, or ``cute.arch.warp_idx()``, which makes its
    result warp-uniform with one) reached by part of a warp, which deadlocks when the
    other lanes wait at a barrier (a reduced cross-entropy kernel hung so)."""
    return sass.count("WARPSYNC")


# (address, guard predicate or None, opcode, operands)
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]\s+)?"
                          r"([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_REGISTER = re.compile(r"(?<![A-Z0-9_])R(\d+)(\.64|\.128)?")
_JUMPS = ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BPT", "KILL")
# opcodes that may write predicates before their register destination (LOP3.LUT P0, R52,
# ...; SHFL.BFLY PT, R5, ...; ATOMG PT, R5, ...); an ISETP's predicates come before its
# sources instead
_PREDICATE_FIRST = ("SHFL", "LOP3", "ATOM", "ATOMG", "ATOMS")
_NO_REGISTER_DEST = ("ST", "STS", "STG", "STL", "LDGSTS", "RED", "BAR", "MEMBAR", "SYNCS",
                     "R2UR")
# opcodes ptxas uses to merge into bits of a register it only partly defines (a PRMT
# packing one 16-bit half, a LOP3 masking bits whose rest goes unused): their reads of
# their own destination are not judged
_MERGING = ("PRMT", "LOP3", "BFI", "F2FP", "HADD2", "HFMA2", "HMUL2")
_CONDITION = re.compile(r"!?U?P[T0-6]|~?UR\w+")


def _dest_registers(opcode: str) -> int:
    """Registers an instruction's destination operand spans (by its opcode's width)."""
    if ".128" in opcode:
        return 4
    wide = (".64", ".WIDE", ".F64")
    if any(w in opcode for w in wide) or opcode.startswith("D") or opcode == "CS2R":
        return 2
    return 1


def _operands(args: str) -> list[str]:
    return [o.strip() for o in re.split(r",(?![^\[]*\])", args)] if args else []


def _written_and_read(opcode: str, args: str) -> tuple[set, list]:
    """(registers the instruction writes, registers it reads; a merging opcode's reads of
    its own destination left out)."""
    base = opcode.split(".")[0]
    operands = _operands(args)
    first = 0
    if base in _PREDICATE_FIRST:  # (predicate destinations before the register's)
        while first < len(operands) and re.fullmatch(r"!?P[T0-6]", operands[first]):
            first += 1
    dest = None
    if base not in _NO_REGISTER_DEST and len(operands) > first \
            and re.fullmatch(r"R\d+", operands[first]):
        dest = first
    written = set()
    if dest is not None:
        start = int(operands[dest][1:])
        written = set(range(start, start + _dest_registers(opcode)))
    if base == "CALL":  # (a subroutine, e.g. a division's slow path: it may write any)
        written = set(range(256))
    merged = written if base in _MERGING else set()
    read = [r for i, operand in enumerate(operands) if i != dest
            for number, width in _REGISTER.findall(operand)
            for r in range(int(number), int(number) + {".64": 2, ".128": 4}.get(width, 1))
            if r not in merged]
    return written, read


def _targets(args: str) -> list[int]:
    """The addresses among an instruction's operands (a branch's or call's target)."""
    return [int(h, 16) for h in re.findall(r"0x([0-9a-f]+)", args)]


def _blocks(instructions: list) -> tuple[list, dict]:
    """Basic blocks (first, end) of a function's instructions and their successors."""
    index = {int(address, 16): i for i, (address, *_) in enumerate(instructions)}
    starts = {0}
    for i, (_, opcode, args, _) in enumerate(instructions):
        base = opcode.split(".")[0]
        if base in ("BRA", "CALL"):
            starts |= {index[t] for t in _targets(args) if t in index}
        if base in _JUMPS and i + 1 < len(instructions):
            starts.add(i + 1)
    starts = sorted(starts)
    blocks = list(zip(starts, starts[1:] + [len(instructions)]))
    block_at = {first: b for b, (first, _) in enumerate(blocks)}
    successors = {}
    for b, (_, end) in enumerate(blocks):
        _, opcode, args, predicated = instructions[end - 1]
        base = opcode.split(".")[0]
        successors[b] = []
        operands = _operands(args)
        targets = _targets(args)
        if base == "BRA" and targets and targets[-1] in index:  # (else no edge known)
            successors[b].append(block_at[index[targets[-1]]])
        # a branch on a condition written as an operand (BRA !P0, 0x..; BRA.U !UP0,
        # 0x..; BRA.DIV UR4, 0x..) falls through too
        conditional = predicated or any(_CONDITION.fullmatch(o) for o in operands[:-1])
        if (base not in ("BRA", "EXIT", "RET") or conditional) and end < len(instructions):
            successors[b].append(block_at[end])
    return blocks, successors


def uninitialized_reads(sass: str) -> list[str]:
    """Instructions that read a register which some path from the function's entry
    reaches without writing (a forward must-write analysis over the basic blocks): such
    a read sees garbage. The CUDA 13 ptxas of nvidia-cutlass-dsl 4.8.1 compiled the
    thread index so (read from one register, written to another) in the looping
    cross-entropy gradient with label smoothing and the loss summed in the kernel at
    16384 bf16 columns: every CTA's first cp.async wrote outside its shared memory (an
    illegal instruction on the H200). Lenient where it cannot tell: a predicated write
    counts as a write, a register pair's odd half of a 64-bit source outside an address
    is not checked, a subroutine call writes every register, and a merging opcode may
    read its own destination (_MERGING)."""
    found = []
    for body in re.split(r"\n\s*Function : ", sass)[1:] or [sass]:
        instructions = []
        for line in body.splitlines():
            match = _INSTRUCTION.match(line)
            if match:
                address, guard, opcode, args = match.groups()
                instructions.append((address, opcode, args, guard is not None))
        if not instructions:
            continue
        blocks, successors = _blocks(instructions)
        effects = [[_written_and_read(opcode, args) for _, opcode, args, _ in
                    instructions[first:end]] for first, end in blocks]
        every = set(range(256))
        written_in = [set() if b == 0 else set(every) for b in range(len(blocks))]
        changed = True
        while changed:  # (monotone: the sets only shrink)
            changed = False
            written_out = [written_in[b].union(*(w for w, _ in effects[b]))
                           for b in range(len(blocks))]
            for b, outs in successors.items():
                for s in outs:
                    if s and not written_in[s] <= written_out[b]:
                        written_in[s] &= written_out[b]
                        changed = True
        for b, (first, _) in enumerate(blocks):
            written = set(written_in[b])
            for (address, opcode, args, _), (writes, reads) in zip(instructions[first:],
                                                                    effects[b]):
                found += [f"{address} {opcode} {args} (R{r})" for r in reads if r not in written]
                written |= writes
    return found


def measure(variants, dump_dir: str, cuobjdump: str):
    """Compile each (name, n, dtype, cfg, build) variant and read its resources; yields
    (name, n, dtype, cfg, kernel object, resource dict: cuobjdump's, and from the SASS
    warp_syncs, uninitialized and bulk_prefetches, the last not printed)."""
    from .primitives.compile_cache import compile_kernel, target_arch

    for name, n, dtype, cfg, build in variants:
        kernel, *fakes = build()
        # a folder per variant: the DSL names a cubin after its kernel's signature,
        # truncated, so variants differing only in their config share a file name
        variant_dir = tempfile.mkdtemp(dir=dump_dir)
        fn = compile_kernel(kernel, *fakes, keep_cubin_in=variant_dir)
        cubin = _cubin_file(fn.__cubin__, variant_dir)
        # another arch than the target: the DSL was set up before CUTE_DSL_ARCH was (see
        # compile_cache.compile_for_hopper_without_gpu) and compiled for its default
        arch = cubin_arch(cubin, cuobjdump)
        if arch != target_arch():
            raise RuntimeError(f"{name}: compiled for another arch ({arch}) than the "
                               f"target {target_arch()}")
        res = resource_usage(cubin, cuobjdump)
        sass = disassembly(cubin, cuobjdump)
        res["warp_syncs"] = warp_syncs(sass)
        res["uninitialized"] = len(uninitialized_reads(sass))
        res["bulk_prefetches"] = sass.count("UBLKPF")  # (RowConfig.l2_prefetch)
        yield name, n, dtype, cfg, kernel, res


def _variant_lines(args, cuobjdump: str, shard: tuple[int, int]):
    """(index, spilled, faulty, printed line) of every variant of the report whose
    index (in the report's fixed order) is ``shard[0]`` modulo ``shard[1]``."""
    import torch

    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    part, parts = shard
    first = 0  # index of the family's first variant
    with tempfile.TemporaryDirectory(prefix="quack_kernels_report_") as dump_dir:
        for family, (variants, n_grid) in families().items():
            if args.family and family not in args.family:
                continue
            grid = [n for n in n_grid if n in QUICK_N_GRID] if args.quick else n_grid
            every = list(variants(grid, dtypes))  # (configs only: builds are deferred)
            mine = [(first + i, v) for i, v in enumerate(every) if (first + i) % parts == part]
            first += len(every)
            rows = measure([v for _, v in mine], dump_dir, cuobjdump)
            for (index, _), (name, n, dtype, cfg, kernel, res) in zip(mine, rows):
                flag = "  <-- SPILL" if spills(res) else ""
                flag += "  <-- WARPSYNC" if res["warp_syncs"] else ""
                flag += "  <-- UNINIT" if res["uninitialized"] else ""
                # "smem+1r": a share in shared memory holding 1 chunk in registers
                held = getattr(cfg, "register_chunks", 0)  # (RowConfig only)
                stage = cfg.staging + (f"+{held}r" if held else "")
                line = (f"{name:18s} {str(dtype).replace('torch.', ''):9s} {n:8d} "
                        f"{cfg.threads_per_block:5d} {cfg.cluster_size:4d} {stage:>9s} "
                        f"{res['regs']:5d} {res['static_smem']:8d} {kernel.smem_bytes():8d} "
                        f"{res['stack']:6d} {res['local']:6d} {res['warp_syncs']:5d} "
                        f"{res['uninitialized']:6d}{flag}")
                yield index, spills(res) > 0, res["warp_syncs"] + res["uninitialized"] > 0, line


def record(index: int, spilled: bool, faulty: bool, line: str) -> str:
    """A worker's output line for one variant (see parse_record)."""
    return f"{index}\t{int(spilled)}\t{int(faulty)}\t{line}"


def parse_record(text: str) -> tuple[int, bool, bool, str]:
    index, spilled, faulty, line = text.split("\t", 3)
    return int(index), spilled == "1", faulty == "1", line


def _worker_lines(args, jobs: int):
    """_variant_lines from ``jobs`` worker processes (``--shard k/jobs``), in index
    order once all are done: compiling is single-threaded, so this divides the wall
    time by the cores given. Workers write to files (no pipe to fill and stall them)."""
    argv = (["--quick"] if args.quick else []) + [a for f in args.family or [] for a in ("--family", f)]
    with tempfile.TemporaryDirectory(prefix="quack_kernels_report_jobs_") as folder:
        logs = [(open(os.path.join(folder, f"{k}.out"), "w+"),
                 open(os.path.join(folder, f"{k}.err"), "w+")) for k in range(jobs)]
        workers = [subprocess.Popen([sys.executable, "-m", "quack_kernels.report", *argv,
                                     "--jobs", "1", "--shard", f"{k}/{jobs}"],
                                    stdout=out, stderr=err, text=True)
                   for k, (out, err) in enumerate(logs)]
        lines = []
        try:
            for worker, (out, err) in zip(workers, logs):
                returncode = worker.wait()
                out.seek(0)
                err.seek(0)
                if returncode:
                    raise RuntimeError(f"report worker failed ({returncode}):\n"
                                       f"{err.read()[-4000:]}")
                lines += [parse_record(text) for text in out.read().splitlines()]
        finally:  # (a failed worker leaves no other running)
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
            for out, err in logs:
                out.close()
                err.close()
    return sorted(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a representative subset of N")
    parser.add_argument("--family", action="append", help="kernel families to report (default: all)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="compiling processes (default: the cores, at most 4)")
    parser.add_argument("--shard", help=argparse.SUPPRESS)  # "k/n": a worker's share
    args = parser.parse_args(argv)

    from .primitives.compile_cache import target_arch

    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("cuobjdump not found: pip install 'nvidia-cuda-cuobjdump>=13.4'", file=sys.stderr)
        return 2
    if args.shard:  # a worker: one tab-separated record per variant
        part, parts = map(int, args.shard.split("/"))
        for row in _variant_lines(args, cuobjdump, (part, parts)):
            print(record(*row), flush=True)
        return 0
    print(f"resource report for {target_arch()} (registers/thread, shared memory/block in bytes)")
    print(f"{'kernel':18s} {'dtype':9s} {'N':>8s} {'thr':>5s} {'clu':>4s} {'stage':>9s} "
          f"{'regs':>5s} {'smem_st':>8s} {'smem_dyn':>8s} {'stack':>6s} {'spill':>6s} "
          f"{'wsync':>5s} {'uninit':>6s}", flush=True)
    start = time.time()
    if args.jobs > 1:
        lines = _worker_lines(args, args.jobs)
    else:
        lines = _variant_lines(args, cuobjdump, (0, 1))
    spilled = faulty = count = 0
    for _, spill, fault, line in lines:
        count += 1
        spilled += spill
        faulty += fault
        print(line, flush=True)
    print(f"{count} variants compiled in {time.time() - start:.0f} s ({args.jobs} processes); "
          f"{spilled} with spills, {faulty} with warp syncs or uninitialized reads")
    return 1 if spilled or faulty else 0


if __name__ == "__main__":
    sys.exit(main())

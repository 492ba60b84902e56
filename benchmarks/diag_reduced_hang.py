"""Diagnosis of the hang of this branch (fourteenth session): one reduced_loss_cuda call
per process, run each under `timeout 28`: python benchmarks/diag_reduced_hang.py M N dtype
sum|mean grad(0|1) contiguous_scale(0|1). Prints OK and the loss against torch, or nothing
if the kernel never returns."""
import sys, time, torch
from quack_kernels.ops import cross_entropy as ops
m, n, dt, red, grad, contiguous = sys.argv[1:7]
m, n = int(m), int(n)
x = torch.randn(m, n, device="cuda", dtype=getattr(torch, dt))
t = torch.randint(0, n, (m,), device="cuda")
gs = None
if grad == "1":
    gs = torch.ones(m, device="cuda") if contiguous == "1" else torch.ones((), device="cuda").expand(m)
k = ops.forward_kernel_object(ops.forward_config(n, x.dtype, False, grad == "1", softcap=False), x.dtype, weighted=False, smoothing=False, zloss=False, softcap=False, write_grad=grad == "1", reduce=red)
print(sys.argv[1:], "loops", k.loops, "cfg", k.cfg, flush=True)
t0 = time.time()
out, lse, g = ops.reduced_loss_cuda(x, t, None, -100, 0.0, 0.0, 0.0, red, gs)
torch.cuda.synchronize()
ref = torch.nn.functional.cross_entropy(x.float(), t, reduction=red)
print("OK", f"{time.time()-t0:.1f}s", out.item(), ref.item(), flush=True)

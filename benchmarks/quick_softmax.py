import torch, triton, quack_kernels as qk
from quack_kernels.ops import softmax as ops
src=torch.empty(2**30, dtype=torch.uint8, device='cuda'); dst=torch.empty_like(src)
t=triton.testing.do_bench(lambda: dst.copy_(src), return_mode='median'); ceil=2*2**30/t/1e6
print(f"copy ceiling {ceil:.0f} GB/s")
for dt in (torch.bfloat16, torch.float32):
  for N in (1024, 4096, 16384, 65536, 262144, 1<<20):
    M=max(2**27//N,128); x=torch.randn(M,N,device='cuda',dtype=dt); dy=torch.randn_like(x)
    f=lambda: ops.softmax_forward(x, False); y=f()
    t=triton.testing.do_bench(f, return_mode='median'); gb=2*x.numel()*x.element_size()/t/1e6
    tb=triton.testing.do_bench(lambda: ops.softmax_backward(y,dy,False), return_mode='median'); gbb=3*x.numel()*x.element_size()/tb/1e6
    te=triton.testing.do_bench(lambda: torch.softmax(x,-1), return_mode='median')
    print(f"{str(dt):15s} N={N:8d} fwd {t*1e3:8.1f}us {gb:6.0f}GB/s {100*gb/ceil:5.1f}%  bwd {tb*1e3:8.1f}us {100*gbb/ceil:5.1f}%  torch fwd {te*1e3:8.1f}us")

"""Host time of one training step through a Python autograd node, by the node's
signature, against torch's own C++ node: what the norms' node (10 inputs, 4 outputs,
statistics marked non-differentiable) costs over a node of tensors only. Runs on any
device (default: the CPU, where the engine runs the backward on the calling thread).

    python benchmarks/autograd_node_overhead.py [--device cuda]
"""

import argparse

import torch

from profile_ops import wall_us


class NormShapedNode(torch.autograd.Function):
    """The signature of ops.norm._EagerNorm, with trivial math."""

    @staticmethod
    def forward(ctx, x, w, b, r, eps, offset, rms, out_dtype, residual_dtype, store):
        rstd = x.new_empty(x.shape[0])
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(rstd)
        ctx.save_for_backward(x, w, None, rstd, None, None)
        return x * w, None, None, rstd

    @staticmethod
    def backward(ctx, dy, _dres, _dmean, _drstd):
        x, w, _, _, _, _ = ctx.saved_tensors
        return dy * w, (dy * x).sum(0), None, None, None, None, None, None, None, None


class TensorsOnlyNode(torch.autograd.Function):
    """Tensor inputs, one output; flags travel as one object."""

    @staticmethod
    def forward(ctx, x, w, spec):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy * w, (dy * x).sum(0), None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    x = torch.randn(8, 64, device=args.device, requires_grad=True)
    w = torch.randn(64, device=args.device, requires_grad=True)
    dy = torch.randn(8, 64, device=args.device)

    def norm_shaped():
        NormShapedNode.apply(x, w, None, None, 1e-6, 0.0, True, None, None, False)[0].backward(dy)

    def tensors_only():
        TensorsOnlyNode.apply(x, w, (1e-6, 0.0, True)).backward(dy)

    def torch_node():
        (x * w).backward(dy)

    for name, forward_backward in (("norm-shaped Python node", norm_shaped),
                                   ("tensors-only Python node", tensors_only),
                                   ("torch's C++ nodes", torch_node)):
        def step():
            x.grad = w.grad = None
            forward_backward()

        print(f"{name:26s} {wall_us(step, calls=args.steps, warmup=200):7.1f} us/step")


if __name__ == "__main__":
    main()

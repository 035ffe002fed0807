"""A Llama-style RMSNorm as one Triton kernel: one program per row, the row's sum of squares, scale
and weight product in one pass.

transformers' ``LlamaRMSNorm.forward`` (and its copies in Mistral, Qwen2, Qwen3, Phi-3) launches
eight kernels eagerly: the cast to float32, the square, the mean, the epsilon add, the reciprocal
root, the scale, the cast back, the weight's product. A decode step at batch 64 normalizes a few
hundred kilobytes, so each of them is a launch and a ramp, not bandwidth: with the decode step
eager (TRL rollouts' default), two norms a layer are a sixth of a step's kernels. Under
``torch.compile`` inductor fuses the same work (with the residual add) by itself, so the loop uses
this kernel only where the step runs eagerly (:mod:`hf_zero3.decode.norm_kernel`).

The kernel is imported on first use (:func:`.triton_launch.jit_kernel`).
"""

from __future__ import annotations

import torch

from . import triton_launch


def _kernel():
    return triton_launch.jit_kernel("rms_norm_triton", "rms_norm_kernel")


def load():
    """The kernel's launch function ``rms_norm(x2d, weight, eps) -> out``, or None without Triton."""
    return rms_norm if _kernel() is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`` over the rows of ``x`` ([rows, n],
    its last dimension contiguous; ``weight`` [n], ``x``'s dtype)."""
    import triton  # optional: triton

    rows, n = x.shape
    if weight.shape != (n,) or x.stride(-1) != 1 or weight.dtype != x.dtype:
        raise ValueError(
            f"rms_norm takes rows [m, n] with a contiguous last dimension and a weight [n] of their dtype; "
            f"got {tuple(x.shape)} (strides {x.stride()}) {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block = triton.next_power_of_2(n)
    _kernel()[(rows,)](
        x, weight, out, x.stride(0), out.stride(0), float(eps), N=n, BLOCK=block, num_warps=8 if block > 2048 else 4
    )
    return out

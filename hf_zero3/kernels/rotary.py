"""The rotate-half rotary embedding (transformers' ``apply_rotary_pos_emb`` of Llama and its
copies) as one Triton kernel per tensor: one program per head and position.

Eagerly, ``q * cos + rotate_half(q) * sin`` for the query and the key is ten kernels (two slices'
negation and concatenation, four products, two sums); at decode shapes each is a launch over a few
kilobytes. The kernel reads each head once and rounds every product and the sum to the model's
dtype as those ops do (bfloat16 or float32; float16 is left to them), so its output equals theirs
to the bit. Used by an eager decode step
(:mod:`hf_zero3.decode.rotary_kernel`); a compiled step fuses the same work itself.

The kernel is imported on first use (:func:`.triton_launch.jit_kernel`).
"""

from __future__ import annotations

import torch

from . import triton_launch


def _kernel():
    return triton_launch.jit_kernel("rotary_triton", "rotate_half_kernel")


def load():
    """The launch function ``rotate(x, cos, sin) -> out``, or None without Triton."""
    return rotate if _kernel() is not None else None


def fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The kernel takes ``x`` ([batch, heads, positions, dim] on CUDA, its last dimension contiguous) with
    ``cos``/``sin`` of one shape and layout ([batch or 1, positions, dim], unit last stride), all of
    one dtype (bfloat16 or float32: the dtypes whose roundings the kernel repeats), ``dim`` even."""
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or cos.stride() != sin.stride():
        return False
    b, _, s, d = x.shape
    return (
        (x.is_cuda or triton_launch.interpreted())
        and d % 2 == 0
        and cos.shape[1:] == (s, d)
        and cos.shape[0] in (1, b)
        and x.stride(-1) == 1
        and cos.stride(-1) == 1
        and x.dtype == cos.dtype == sin.dtype
        and x.dtype in (torch.bfloat16, torch.float32)
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos[:, None] + rotate_half(x) * sin[:, None]`` (:func:`fits` must hold), in ``x``'s
    layout."""
    import triton  # optional: triton

    if not fits(x, cos, sin):
        raise ValueError(
            f"rotate takes x [batch, heads, positions, dim] and cos/sin [batch or 1, positions, dim] of one "
            f"dtype with unit last strides; got x {tuple(x.shape)} {x.stride()} {x.dtype}, cos "
            f"{tuple(cos.shape)} {cos.stride()} {cos.dtype}, sin {tuple(sin.shape)} {sin.stride()}"
        )
    b, h, s, d = x.shape
    out = torch.empty_like(x)  # x's strides: the eager ops' output keeps its input's layout
    cb = cos.stride(0) if cos.shape[0] == b and b > 1 else 0
    half = d // 2
    _kernel()[(b * h * s,)](
        x, cos, sin, out, h, s,
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2), cb, cos.stride(1),
        HALF=half, BLOCK=triton.next_power_of_2(half), BF16=x.dtype == torch.bfloat16, num_warps=1,
        enable_fp_fusion=False,  # each product rounded before the sum, as the eager ops round it
    )  # fmt: skip
    return out

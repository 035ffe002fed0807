"""The Triton kernel of :mod:`.rms_norm` (imported only when it builds it)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(X, W, O, sxm, som, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    """One row: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, the sum of squares in float32 and
    the normalized row rounded to the model's dtype before the weight's product, as transformers'
    Llama RMSNorm rounds them."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(X + row * sxm + cols, mask=inside, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * scale).to(O.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(O + row * som + cols, (w * y).to(O.dtype.element_ty), mask=inside)

"""The Triton kernel of :mod:`.rotary` (imported only when it builds it)."""

import triton
import triton.language as tl


@triton.jit
def rotate_half_kernel(
    X, COS, SIN, O, H, S,
    sxb, sxh, sxs, sob, soh, sos, scb, scs,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One head of one position: ``x * cos + rotate_half(x) * sin``, each product and the sum
    rounded to the model's dtype as transformers' eager ops round them (``rotate_half``: the second
    half negated, then the first)."""
    pid = tl.program_id(0)
    s = pid % S
    h = (pid // S) % H
    b = pid // (S * H)
    cols = tl.arange(0, BLOCK)
    inside = cols < HALF
    x = X + b * sxb + h * sxh + s * sxs
    c = COS + b * scb + s * scs
    n = SIN + b * scb + s * scs
    x1 = tl.load(x + cols, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    c1 = tl.load(c + cols, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    n1 = tl.load(n + cols, mask=inside, other=0.0).to(tl.float32)
    n2 = tl.load(n + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    dt = O.dtype.element_ty
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * n1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * n2).to(dt).to(tl.float32)
    o = O + b * sob + h * soh + s * sos
    tl.store(o + cols, o1.to(dt), mask=inside)
    tl.store(o + HALF + cols, o2.to(dt), mask=inside)

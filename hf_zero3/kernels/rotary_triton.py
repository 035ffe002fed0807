"""The Triton kernel of :mod:`.rotary` (imported only when it builds it)."""

import triton
import triton.language as tl


@triton.jit
def rotate_half_kernel(
    X, COS, SIN, O, H, S,
    sxb, sxh, sxs, sob, soh, sos, scb, scs,
    HALF: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr,
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
    o1 = _rounded(x1 * c1, BF16) + _rounded(-x2 * n1, BF16)
    o2 = _rounded(x2 * c2, BF16) + _rounded(x1 * n2, BF16)
    o = O + b * sob + h * soh + s * sos
    tl.store(o + cols, _rounded(o1, BF16).to(dt), mask=inside)  # the cast exact: rounded already
    tl.store(o + HALF + cols, _rounded(o2, BF16).to(dt), mask=inside)


@triton.jit
def _rounded(x, BF16: tl.constexpr):
    """``x`` (float32) rounded to the nearest bfloat16, ties to even, kept in float32: in integer
    operations, which the compiler neither drops (as it may a cast there and back) nor fuses with
    the sum after them. Float32 (``BF16`` false): ``x`` (the launch turns off multiply-add fusion)."""
    if BF16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x

"""The Triton kernels of :mod:`.decode_gemm` (imported only when it builds them)."""

import triton
import triton.language as tl


@triton.jit
def tile(P, rows, stride, k, rk, R, K: tl.constexpr):
    """Rows ``rows`` (of ``R``), columns ``k + rk`` (of ``K``) of a row-major matrix, zero outside."""
    return tl.load(P + rows[:, None] * stride + (k + rk)[None, :],
                   mask=(rows[:, None] < R) & ((k + rk)[None, :] < K), other=0.0)


@triton.jit
def linear_kernel(X, W, O, M, N, sxm, swn, som, K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        acc += tl.dot(tile(X, rm, sxm, k, rk, M, K), tl.trans(tile(W, rn, swn, k, rk, N, K)))
    tl.store(O + rm[:, None] * som + rn[None, :], acc.to(O.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def gate_up_kernel(X, WG, WU, O, M, N, sxm, swn, som, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tile(X, rm, sxm, k, rk, M, K)
        gate += tl.dot(x, tl.trans(tile(WG, rn, swn, k, rk, N, K)))
        up += tl.dot(x, tl.trans(tile(WU, rn, swn, k, rk, N, K)))
    # the model's dtype between the GEMMs and the activation, as eager rounds them
    g = gate.to(O.dtype.element_ty).to(tl.float32)
    u = up.to(O.dtype.element_ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(O.dtype.element_ty).to(tl.float32)
    tl.store(O + rm[:, None] * som + rn[None, :], (act * u).to(O.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def linear_split_kernel(X, W, P, M, N, sxm, swn, spk, spm, K: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Split-K ``x @ W.T``: program (n, s) reduces the s-th of ``SPLIT`` equal slices of the
    reduction and writes its float32 partial sum to ``P[s]`` (the consumer sums them)."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k0 = tl.program_id(1) * (K // SPLIT)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K // SPLIT, BLOCK_K):
        acc += tl.dot(tile(X, rm, sxm, k0 + k, rk, M, K), tl.trans(tile(W, rn, swn, k0 + k, rk, N, K)))
    tl.store(P + tl.program_id(1) * spk + rm[:, None] * spm + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))

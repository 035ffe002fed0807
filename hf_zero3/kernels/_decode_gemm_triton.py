"""The Triton kernels of :mod:`.decode_gemm` (imported only when it builds them).

``EVEN`` (a constexpr): every block the launch may take divides the weight's rows and the
reduction (:func:`.decode_gemm._even`), so the tiles load without masks but the activations' rows.
``PDL`` (a constexpr every launch passes: inductor's calls of a ``triton_op`` kernel take no
parameter defaults): the kernel is launched as a programmatic dependent launch (where
:func:`.decode_gemm.dependent_unavailable` finds none missing). It may then start while the kernel
before it still runs: it waits for that kernel's writes (``gdc_wait``) before reading the
activations or writing anything, and lets the kernel after it launch at once (all of its programs
are running by then; the next one waits in turn)."""

import triton
import triton.language as tl

from ._common_triton import dependent_start


@triton.jit
def tile(P, rows, stride, k, rk, R, K: tl.constexpr, ROWS_IN: tl.constexpr, COLS_IN: tl.constexpr):
    """Rows ``rows`` (of ``R``), columns ``k + rk`` (of ``K``) of a row-major matrix, zero outside.
    ``ROWS_IN``/``COLS_IN``: every row/column of the tile is inside (the launch knows the blocks
    divide the matrix), so the load takes no mask there. A mask on a weight tile's rows cost the
    kernels every register (255 and spills to local memory at 64 rows, compiled for sm_90)."""
    ptrs = P + rows[:, None] * stride + (k + rk)[None, :]
    if ROWS_IN and COLS_IN:
        t = tl.load(ptrs)
    elif ROWS_IN:
        t = tl.load(ptrs, mask=(k + rk)[None, :] < K, other=0.0)
    elif COLS_IN:
        t = tl.load(ptrs, mask=rows[:, None] < R, other=0.0)
    else:
        t = tl.load(ptrs, mask=(rows[:, None] < R) & ((k + rk)[None, :] < K), other=0.0)
    return t


@triton.jit
def linear_kernel(
    X,
    W,
    O,
    M,
    N,
    sxm,
    swn,
    som,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    EVEN: tl.constexpr,
):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dependent_start(PDL)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        acc += tl.dot(tile(X, rm, sxm, k, rk, M, K, False, EVEN), tl.trans(tile(W, rn, swn, k, rk, N, K, EVEN, EVEN)))
    tl.store(
        O + rm[:, None] * som + rn[None, :], acc.to(O.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N)
    )


@triton.jit
def gate_up_kernel(
    X,
    WG,
    WU,
    O,
    M,
    N,
    sxm,
    swn,
    som,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    EVEN: tl.constexpr,
):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dependent_start(PDL)
    rk = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tile(X, rm, sxm, k, rk, M, K, False, EVEN)
        gate += tl.dot(x, tl.trans(tile(WG, rn, swn, k, rk, N, K, EVEN, EVEN)))
        up += tl.dot(x, tl.trans(tile(WU, rn, swn, k, rk, N, K, EVEN, EVEN)))
    # the model's dtype between the GEMMs and the activation, as eager rounds them
    g = gate.to(O.dtype.element_ty).to(tl.float32)
    u = up.to(O.dtype.element_ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(O.dtype.element_ty).to(tl.float32)
    tl.store(
        O + rm[:, None] * som + rn[None, :],
        (act * u).to(O.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def linear_split_kernel(
    X,
    W,
    P,
    M,
    N,
    sxm,
    swn,
    spk,
    spm,
    K: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Split-K ``x @ W.T``: program (n, s) reduces the s-th of ``SPLIT`` equal slices of the
    reduction and writes its float32 partial sum to ``P[s]`` (the consumer sums them)."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k0 = tl.program_id(1) * (K // SPLIT)
    dependent_start(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K // SPLIT, BLOCK_K):
        acc += tl.dot(
            tile(X, rm, sxm, k0 + k, rk, M, K, False, EVEN), tl.trans(tile(W, rn, swn, k0 + k, rk, N, K, EVEN, EVEN))
        )
    tl.store(
        P + tl.program_id(1) * spk + rm[:, None] * spm + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N)
    )

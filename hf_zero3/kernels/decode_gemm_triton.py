"""The Triton kernels of :mod:`.decode_gemm` (imported only when it builds them).

``EVEN`` (a constexpr): every block the launch may take divides the weight's rows and the
reduction (:func:`.decode_gemm._even`), so the tiles load without masks but the activations' rows.
``PDL`` (a constexpr every launch passes: inductor's calls of a ``triton_op`` kernel take no
parameter defaults): the kernel is launched as a programmatic dependent launch (where
:func:`.decode_gemm.dependent_unavailable` finds none missing). It may then start while the kernel
before it still runs: it waits for that kernel's writes (``gdc_wait``) before reading the
activations or writing anything, and lets the kernel after it launch at once (all of its programs
are running by then; the next one waits in turn).

Parameters stand in groups, a line each (``# fmt: skip`` keeps them so): pointers and sizes,
strides, constexprs."""

import triton
import triton.language as tl

from .triton_common import dependent_start


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
def column_block(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """This program's tile of the output: every row, its ``BLOCK_N`` columns; the offsets of one
    ``BLOCK_K`` step of the reduction. Then a dependent launch's start, before any load."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    dependent_start(PDL)
    return rm, rn, rk


@triton.jit
def dot_slice(
    X, W, rm, rn, rk, sxm, swn, M, N, k0,
    LENGTH: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """``x @ W.T`` in float32 for rows ``rm`` and columns ``rn``, over ``LENGTH`` of the reduction
    from ``k0``."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, LENGTH, BLOCK_K):
        acc += tl.dot(
            tile(X, rm, sxm, k0 + k, rk, M, K, False, EVEN), tl.trans(tile(W, rn, swn, k0 + k, rk, N, K, EVEN, EVEN))
        )
    return acc


@triton.jit
def store_tile(P, rm, rn, stride, M, N, x):
    """``x``, in ``P``'s dtype, into rows ``rm`` (of ``M``), columns ``rn`` (of ``N``) of a row-major
    matrix."""
    tl.store(
        P + rm[:, None] * stride + rn[None, :], x.to(P.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N)
    )


@triton.jit
def linear_kernel(
    X, W, O, M, N,
    sxm, swn, som,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """``x @ W.T``."""
    rm, rn, rk = column_block(BLOCK_M, BLOCK_N, BLOCK_K, PDL)
    acc = dot_slice(X, W, rm, rn, rk, sxm, swn, M, N, 0, K, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN)
    store_tile(O, rm, rn, som, M, N, acc)


@triton.jit
def gate_up_kernel(
    X, WG, WU, O, M, N,
    sxm, swn, som,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """``silu(x @ WG.T) * (x @ WU.T)``: both weights' tiles in one pass over the reduction."""
    rm, rn, rk = column_block(BLOCK_M, BLOCK_N, BLOCK_K, PDL)
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
    store_tile(O, rm, rn, som, M, N, act * u)


@triton.jit
def linear_split_kernel(
    X, W, P, M, N,
    sxm, swn, spk, spm,
    K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """Split-K ``x @ W.T``: program (n, s) reduces the s-th of ``SPLIT`` equal slices of the
    reduction and writes its float32 partial sum to ``P[s]`` (the consumer sums them)."""
    rm, rn, rk = column_block(BLOCK_M, BLOCK_N, BLOCK_K, PDL)
    k0 = tl.program_id(1) * (K // SPLIT)
    acc = dot_slice(X, W, rm, rn, rk, sxm, swn, M, N, k0, K // SPLIT, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN)
    store_tile(P + tl.program_id(1) * spk, rm, rn, spm, M, N, acc)

"""Triton GEMMs for decode shapes (a few to 64 rows against a large weight): ``x @ W.T`` and the
MLP's ``silu(x @ Wg.T) * (x @ Wu.T)`` in one kernel.

At decode shapes a GEMM only streams its weight, and cuBLAS's kernels for them reach 2.4-3.9 TB/s
of an H200's ~4.3 (``benchmarks/generation/gemm_fusion_probe.py``), with a ~5 us floor per
launch. These kernels give every program a narrow slice of output columns (``BLOCK_N``) over all
rows and the whole reduction (no split-K), and the gate/up pair reads both weights' slices in one
pass and writes the product (no [rows x 2 x intermediate] intermediate, no separate SiLU kernel).
A weight with few output columns and a long reduction (down: 2048 x 8192) gets too few programs
that way, and cuBLAS's split-K is faster there. Measured against cuBLAS by
``benchmarks/generation/decode_gemm_probe.py`` (1xH200: the gate/up kernel 1.26-1.30x faster than
cuBLAS + inductor's SiLU-mul at 8 and 64 rows; the plain GEMM 0.72-0.93x, slower: not used); the
decode step's MLP uses the gate/up kernel through :mod:`hf_zero3.generation.decode_mlp`.

Loaded lazily; :func:`is_available` as in :mod:`.gqa_decode` (Triton, ``torch.library``).
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["is_available", "load", "linear", "gate_up_silu", "DEFAULT", "CONFIGS", "MAX_ROWS"]

DEFAULT = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
_state: dict = {}


def is_available() -> bool:
    return importlib.util.find_spec("triton") is not None and hasattr(torch.library, "wrap_triton")


def _build():
    import triton
    import triton.language as tl
    # (the raw kernels; _ops wraps them in autotuning and torch.library ops)

    @triton.jit
    def linear_kernel(X, W, O, M, N, sxm, swn, som, K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(X + rm[:, None] * sxm + (k + rk)[None, :], mask=(rm[:, None] < M) & ((k + rk)[None, :] < K),
                        other=0.0)
            w = tl.load(W + rn[:, None] * swn + (k + rk)[None, :], mask=(rn[:, None] < N) & ((k + rk)[None, :] < K),
                        other=0.0)
            acc += tl.dot(x, tl.trans(w))
        tl.store(O + rm[:, None] * som + rn[None, :], acc.to(O.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def gate_up_kernel(X, WG, WU, O, M, N, sxm, swn, som, K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            kmask = (k + rk)[None, :] < K
            x = tl.load(X + rm[:, None] * sxm + (k + rk)[None, :], mask=(rm[:, None] < M) & kmask, other=0.0)
            wmask = (rn[:, None] < N) & kmask
            wg = tl.load(WG + rn[:, None] * swn + (k + rk)[None, :], mask=wmask, other=0.0)
            wu = tl.load(WU + rn[:, None] * swn + (k + rk)[None, :], mask=wmask, other=0.0)
            gate += tl.dot(x, tl.trans(wg))
            up += tl.dot(x, tl.trans(wu))
        # the model's dtype between the GEMMs and the activation, as eager rounds them
        g = gate.to(O.dtype.element_ty).to(tl.float32)
        u = up.to(O.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(O.dtype.element_ty).to(tl.float32)
        tl.store(O + rm[:, None] * som + rn[None, :], (act * u).to(O.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return triton, linear_kernel, gate_up_kernel


# the launch configurations the probe and autotuning try (each fits an H100/H200 SM's shared memory)
CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=w) for bn, bk, st, w in [
    (16, 128, 4, 4), (16, 256, 3, 4), (32, 128, 4, 4), (32, 256, 3, 4), (32, 128, 5, 4), (64, 128, 4, 4),
    (64, 64, 5, 4), (32, 128, 4, 8), (16, 512, 2, 4), (64, 128, 3, 4), (64, 64, 4, 8),
    (128, 64, 4, 8)]]
MAX_ROWS = 64


def _kernels():
    if "kernels" not in _state:
        _state["kernels"] = _build()
    return _state["kernels"]


def _launch(kernel):
    return kernel if os.environ.get("TRITON_INTERPRET") == "1" else torch.library.wrap_triton(kernel)


def _block_m(m: int) -> int:
    import triton

    return max(16, triton.next_power_of_2(m))


def linear(x: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """``x @ weight.T`` for 2-D ``x`` of at most 64 rows (contiguous rows and weight), one launch
    configuration (the probe's entry; :func:`load` gives the autotuned ops)."""
    import triton

    _, kernel, _ = _kernels()
    cfg = cfg or DEFAULT
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _launch(kernel)[(triton.cdiv(n, cfg["BLOCK_N"]),)](x, weight, out, m, n, x.stride(0), weight.stride(0),
                                                        out.stride(0), K=k, BLOCK_M=_block_m(m), **cfg)
    return out


def gate_up_silu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` (rounded to the model's dtype where eager rounds), one
    launch configuration."""
    import triton

    _, _, kernel = _kernels()
    cfg = cfg or DEFAULT
    m, k = x.shape
    n = gate.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _launch(kernel)[(triton.cdiv(n, cfg["BLOCK_N"]),)](x, gate, up, out, m, n, x.stride(0), gate.stride(0),
                                                        out.stride(0), K=k, BLOCK_M=_block_m(m), **cfg)
    return out


def load():
    """The two ops, ``(linear, gate_up_silu)``, autotuned over :data:`CONFIGS` per shape on the GPU
    (one fixed configuration under Triton's interpreter), registered through
    ``torch.library.triton_op`` so that ``torch.compile`` traces them; built once, outside any
    trace. None when Triton is missing or the build fails (``_state["error"]`` says why)."""
    if "ops" in _state or "error" in _state:
        return _state.get("ops")
    if not is_available():
        _state["error"] = "Triton or torch.library.triton_op is missing"
        return None
    try:
        _state["ops"] = _ops()
    except Exception as exc:
        _state["error"] = f"building the Triton GEMMs failed: {type(exc).__name__}: {exc}"
    return _state.get("ops")


def _ops():
    import triton

    _, linear_kernel, gate_up_kernel = _kernels()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret:
        tuned_linear, tuned_gate_up, fixed = linear_kernel, gate_up_kernel, DEFAULT
    else:
        configs = [triton.Config({"BLOCK_N": c["BLOCK_N"], "BLOCK_K": c["BLOCK_K"]}, num_warps=c["num_warps"],
                                 num_stages=c["num_stages"]) for c in CONFIGS]
        tuned_linear = triton.autotune(configs=configs, key=["M", "N", "K"])(linear_kernel)
        tuned_gate_up = triton.autotune(configs=configs, key=["M", "N", "K"])(gate_up_kernel)
        fixed = {}

    def grid(n):
        if fixed:
            return (triton.cdiv(n, fixed["BLOCK_N"]),)
        return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)

    @torch.library.triton_op("hf_zero3::decode_linear", mutates_args=())
    def linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        _launch(tuned_linear)[grid(n)](x, weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0), K=k,
                                       BLOCK_M=_block_m(m), **fixed)
        return out

    @torch.library.triton_op("hf_zero3::decode_gate_up_silu", mutates_args=())
    def gate_up_op(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = gate.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        _launch(tuned_gate_up)[grid(n)](x, gate, up, out, m, n, x.stride(0), gate.stride(0), out.stride(0), K=k,
                                        BLOCK_M=_block_m(m), **fixed)
        return out

    return linear_op, gate_up_op

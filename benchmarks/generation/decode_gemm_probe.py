"""Decode-shape GEMMs: cuBLAS (through inductor, as a compiled decode step runs them) against the
Triton kernels of ``hf_zero3.kernels.decode_gemm`` over their launch configurations.

Shapes of the Llama-3.2-1B decode step (bf16): the fused q/k/v projection [3072 x 2048], o_proj
[2048 x 2048], the gate/up pair [2 x 8192 x 2048] with SiLU and the product (cuBLAS: two GEMMs
and inductor's fused SiLU-mul kernel), down [2048 x 8192]. Each measurement is a CUDA graph of 16
calls over 16 distinct weight copies (so the weights stream from HBM, not L2, as in a 16-layer
step), replayed 20 times; per call: microseconds and the weights' TB/s. Each Triton row is checked
against cuBLAS's output (bf16 tolerance) and says so in ``ok``. Split-K rows (``triton_split``,
:data:`~hf_zero3.kernels.decode_gemm.SPLIT_CONFIGS`) time the kernel writing its float32
partials; their sum (checked, not timed) is left to the consumer's kernel.
``PROBE_MASKED=1`` also times every Triton configuration with its tiles loaded under masks where
the blocks divide the weight (``triton_masked``, ``triton_split_masked``: ``EVEN=False``), same run.
``PROBE_ROWS`` (default ``8,64``): the activation rows measured. A maintainer's tool for the
kernels' configurations; the best row of each kernel goes to decode_gemm_probe.jsonl.
Run: python benchmarks/generation/decode_gemm_probe.py   (GPU only)
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import graph_us, record, table  # noqa: E402

COPIES, REPLAYS = 16, 20
MASKED = os.environ.get("PROBE_MASKED") == "1"
ROWS = [int(r) for r in os.environ.get("PROBE_ROWS", "8,64").split(",")]  # activation rows measured
SHAPES = [
    ("qkv", 3072, 2048, False),
    ("o_proj", 2048, 2048, False),
    ("gate_up_silu", 8192, 2048, True),
    ("down", 2048, 8192, False),
]


def main():
    import torch
    import torch.nn.functional as F

    from hf_zero3.kernels import decode_gemm

    configs = decode_gemm.CONFIGS

    if not torch.cuda.is_available():
        print("decode_gemm_probe needs a CUDA GPU; skipped")
        return
    dev = torch.device("cuda")
    rows = []

    def timed(fn, args_list):
        return graph_us([lambda a=a: fn(*a) for a in args_list], REPLAYS)

    for name, n, k, pair in SHAPES:
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        ups = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)] if pair else None
        nbytes = n * k * 2 * (2 if pair else 1)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            args = [(x, weights[i], ups[i]) if pair else (x, weights[i]) for i in range(COPIES)]
            if pair:
                base = torch.compile(lambda x, g, u: F.silu(F.linear(x, g)) * F.linear(x, u), fullgraph=True)
            else:
                base = torch.compile(lambda x, w: F.linear(x, w), fullgraph=True)
            us, ref = timed(base, args)
            rows.append(
                dict(shape=name, rows=m, impl="cublas+inductor", cfg="", us=us, tbps=nbytes / us / 1e6, ok=True)
            )
            print(json.dumps(rows[-1]), flush=True)
            scale = max(r.abs().max().item() for r in ref)
            for cfg, impl in [(c, "triton") for c in configs] + [
                (dict(c, EVEN=False), "triton_masked") for c in (configs if MASKED else [])
            ]:
                fn = (
                    (lambda x, g, u, c=cfg: decode_gemm.gate_up_silu(x, g, u, c))
                    if pair
                    else (lambda x, w, c=cfg: decode_gemm.linear(x, w, c))
                )
                try:
                    us, outs = timed(fn, args)
                except Exception as exc:  # a configuration that does not fit (shared memory)
                    rows.append(
                        dict(
                            shape=name,
                            rows=m,
                            impl=impl,
                            cfg=str(cfg),
                            us=None,
                            tbps=None,
                            ok=f"{type(exc).__name__}: {str(exc)[:120]}",
                        )
                    )
                    continue
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, ref))
                rows.append(
                    dict(
                        shape=name,
                        rows=m,
                        impl=impl,
                        cfg=str(cfg),
                        us=us,
                        tbps=nbytes / us / 1e6,
                        ok=err <= 0.02 * max(1.0, scale),
                        err=err,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
            # split-K: the kernel alone (its float32 partials' sum folds into the consumer's kernel
            # in a compiled step, so the sum is not timed here; it is checked)
            splits = [] if pair else [c for c in decode_gemm.SPLIT_CONFIGS if k % (c["SPLIT"] * c["BLOCK_K"]) == 0]
            for cfg, impl in [(c, "triton_split") for c in splits] + [
                (dict(c, EVEN=False), "triton_split_masked") for c in (splits if MASKED else [])
            ]:
                try:
                    us, outs = timed(lambda x, w, c=cfg: decode_gemm.linear_split(x, w, c), args)
                except Exception as exc:
                    rows.append(
                        dict(
                            shape=name,
                            rows=m,
                            impl=impl,
                            cfg=str(cfg),
                            us=None,
                            tbps=None,
                            ok=f"{type(exc).__name__}: {str(exc)[:120]}",
                        )
                    )
                    continue
                err = max((a.sum(0) - b.float()).abs().max().item() for a, b in zip(outs, ref))
                rows.append(
                    dict(
                        shape=name,
                        rows=m,
                        impl=impl,
                        cfg=str(cfg),
                        us=us,
                        tbps=nbytes / us / 1e6,
                        ok=err <= 0.02 * max(1.0, scale),
                        err=err,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
        del weights, ups
        torch.cuda.empty_cache()
    best = []
    for name, _, _, _ in SHAPES:
        for m in ROWS:
            mine = [r for r in rows if r["shape"] == name and r["rows"] == m]
            base = next(r for r in mine if r["impl"] != "triton")
            for impl in ("triton", "triton_masked", "triton_split", "triton_split_masked"):
                tried = [r for r in mine if r["impl"] == impl and r["us"] is not None and r["ok"] is True]
                top = min(tried, key=lambda r: r["us"]) if tried else None
                if top is None and impl != "triton":
                    continue
                best.append(
                    dict(
                        shape=name,
                        rows=m,
                        impl=impl,
                        cublas_us=base["us"],
                        cublas_tbps=base["tbps"],
                        triton_us=top and top["us"],
                        triton_tbps=top and top["tbps"],
                        cfg=top and top["cfg"],
                        speedup=top and base["us"] / top["us"],
                    )
                )
    print(
        table(best, ["shape", "rows", "impl", "cublas_us", "cublas_tbps", "triton_us", "triton_tbps", "speedup", "cfg"])
    )
    path = record("decode_gemm_probe", best, HERE, dict(copies=COPIES, replays=REPLAYS, rows=ROWS, masked=MASKED))
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()

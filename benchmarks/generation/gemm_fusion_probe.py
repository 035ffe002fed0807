"""Would fusing a decode step's projections pay (issue #14, batch 64 at 27 % of the floor)? Times
the GEMMs of one Llama-3.2-1B decoder layer at decode shapes (M = batch rows, bf16), each alone
and fused (q/k/v as one [3072 x 2048] weight, k/v as one [1024 x 2048], gate/up as one
[16384 x 2048]), replayed from a CUDA graph of 200 calls, under each BLAS library torch offers
(``preferred_blas_library``: cuBLAS, cuBLASLt), and prints microseconds per call, achieved TB/s
and the fused/separate ratio. A probe for a design choice, not a benchmark of hf_zero3.
Run: python benchmarks/generation/gemm_fusion_probe.py   (GPU only; PROBE_ROWS=8,64)
"""

from __future__ import annotations

import json
import os

ROWS = [int(m) for m in os.environ.get("PROBE_ROWS", "8,64").split(",")]
H, KV, I, V = 2048, 512, 8192, 128256  # hidden, k/v width (8 heads x 64), intermediate, vocab
REPS = 200


def time_us(fn) -> float:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / REPS


def main():
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("gemm_fusion_probe needs a CUDA GPU; skipped")
        return
    dev, dt = torch.device("cuda"), torch.bfloat16
    w = {name: torch.randn(n, k, device=dev, dtype=dt) for name, (n, k) in dict(
        q=(H, H), k=(KV, H), v=(KV, H), o=(H, H), gate=(I, H), up=(I, H), down=(H, I), lm_head=(V, H),
        qkv=(H + 2 * KV, H), kv=(2 * KV, H), gate_up=(2 * I, H)).items()}
    rows = []
    for lib, m in [(lib, m) for lib in ("cublas", "cublaslt") for m in ROWS]:
        torch.backends.cuda.preferred_blas_library(lib)
        x, xi = torch.randn(m, H, device=dev, dtype=dt), torch.randn(m, I, device=dev, dtype=dt)
        us = {name: time_us(lambda t=t, inp=(xi if name == "down" else x): F.linear(inp, t)) for name, t in w.items()}
        for name, t in w.items():
            rows.append(dict(blas=lib, rows=m, gemm=name, us=us[name], tb_s=t.numel() * 2 / (us[name] * 1e-6) / 1e12))
        for fused, parts in (("qkv", ("q", "k", "v")), ("kv", ("k", "v")), ("gate_up", ("gate", "up"))):
            rows.append(dict(blas=lib, rows=m, gemm=f"{fused} fused / separate", ratio=us[fused] / sum(us[p] for p in parts)))
        layer = sum(us[p] for p in ("q", "k", "v", "o", "gate", "up", "down"))
        fused_layer = us["qkv"] + us["o"] + us["gate_up"] + us["down"]
        rows.append(dict(blas=lib, rows=m, gemm="layer, 16 layers + lm_head (us)", separate=16 * layer + us["lm_head"],
                         fused=16 * fused_layer + us["lm_head"]))
    for r in rows:
        print(json.dumps(r))
    out = os.environ.get("OUT", os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(out, "gemm_fusion_probe.json"), "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

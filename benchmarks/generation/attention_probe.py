"""The decode step's attention per layer: the rotary embedding, the static cache's
k/v write and the grouped-query attention as a compiled decode step runs them without the fusion
(inductor's rotary/index_copy kernels + ``hf_zero3.kernels.gqa_decode``'s attention kernel + the
fill-count add), against ``gqa_decode.rope_decode_attention`` (all of it in one kernel) over a few
launch settings (cache positions per block, warps, stages; plain and programmatic dependent
launches).

Llama-3.2-1B shapes (32 query heads, 8 key/value heads, head dim 64, bf16), a 192-position static
cache filled up to position 128, batch 64 and 8. Each measurement is a CUDA graph of 16 calls over
16 distinct caches (as the 16 layers of a step: the caches stream from HBM, not L2), replayed 20
times; microseconds per call. Each fused row is checked against the unfused output.
Rows with left padding (row i's first ``i % 32`` positions masked, as a batch of prompts of
divergent lengths) next to rows without. Where ``flashinfer`` imports, its batch-decode attention
(``BatchDecodeWithPagedKVCacheWrapper``, the same caches as one page per row in HND layout, CUDA
graph mode, with and without tensor cores) runs beside ``gqa_decode_attention`` on the written caches
(attention alone: FlashInfer's decode takes no per-position mask, so unpadded rows only).
``ATTENTION_PROBE_BASELINE=<path to another version of
hf_zero3/kernels/gqa_decode.py>`` adds that version's fused kernel at the same settings (its ops
registered under another namespace), so a change to the kernel is measured against the old one in
the same run. A maintainer's tool for the kernel's launch settings; rows go to
attention_probe.jsonl (``us``: microseconds per layer, ``speedup``: against the unfused row).
Run: python benchmarks/generation/attention_probe.py   (GPU only)
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import graph_us, record, table  # noqa: E402

LAYERS, REPLAYS, HEADS, KV, DIM, LENGTH, POS = 16, 20, 32, 8, 64, 192, 128
SETTINGS = [
    dict(BLOCK=b, num_warps=w, num_stages=s)
    for b, w, s in [(64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 4, 2), (64, 2, 2), (32, 2, 3)]
]
# programmatic dependent launches (the decode loop's default on Hopper): each call may start while
# the one before runs, up to its wait (the kernel loads its first cache block before it)
SETTINGS += [
    dict(BLOCK=b, num_warps=w, num_stages=s, PDL=True, launch_pdl=True) for b, w, s in [(64, 4, 2), (64, 2, 2)]
]


def _baseline():
    """Another version of the kernel module (``ATTENTION_PROBE_BASELINE``), its ops renamed so
    they register beside this version's; None when not asked for."""
    import importlib.util

    path = os.environ.get("ATTENTION_PROBE_BASELINE")
    if not path:
        return None
    src = open(path).read().replace('"hf_zero3::', '"hf_zero3_probe_baseline::')
    spec = importlib.util.spec_from_loader("hf_zero3.kernels.gqa_decode_probe_baseline", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "hf_zero3.kernels"
    exec(compile(src, path, "exec"), mod.__dict__)
    mod.load()
    return mod


def _attention_only(batch, q, caches, keep, timed):
    """Attention over the written caches alone: ``gqa_decode_attention`` (the baseline of this group)
    against FlashInfer's batch decode where it imports; the outputs must agree."""
    import torch

    from hf_zero3.kernels import gqa_decode

    dev, n = q.device, POS + 1
    qs = q.view(batch, 1, HEADS, DIM).transpose(1, 2)

    def ours(i):
        kc, vc, _ = caches[i % LAYERS]
        return gqa_decode.gqa_decode_attention(qs, kc[:, :, :n], vc[:, :, :n], keep, DIM**-0.5).view(batch, HEADS, DIM)

    us, ref = timed(ours, LAYERS)
    out = [dict(batch=batch, padded=False, impl="gqa_decode_attention", cfg="", us=us, ok=True, attention_only=True)]
    print(json.dumps(out[-1]), flush=True)
    try:
        import flashinfer
    except Exception as exc:  # not installed, or its import fails on this host
        missing = f"no flashinfer: {exc!r}"[:160]
        out.append(dict(batch=batch, padded=False, impl="flashinfer", cfg="", us=None, ok=missing, attention_only=True))
        return out
    for cores in (False, True):
        name = f"flashinfer {flashinfer.__version__} BatchDecodeWithPagedKVCacheWrapper"
        cfg = f"use_tensor_cores={cores}"
        try:
            work = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
            indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            pages = torch.arange(batch, dtype=torch.int32, device=dev)
            last = torch.full((batch,), n, dtype=torch.int32, device=dev)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                work,
                "HND",
                use_cuda_graph=True,
                use_tensor_cores=cores,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=pages,
                paged_kv_last_page_len_buffer=last,
            )
            wrapper.plan(indptr, pages, last, HEADS, KV, DIM, LENGTH, q_data_type=q.dtype, kv_data_type=q.dtype)
            qf = q.view(batch, HEADS, DIM)

            def theirs(i):
                kc, vc, _ = caches[i % LAYERS]
                return wrapper.run(qf, (kc, vc))

            us, outs = timed(theirs, LAYERS)
        except Exception as exc:  # JIT build or launch failure on this host
            failed = f"{type(exc).__name__}: {str(exc)[:200]}"
            out.append(dict(batch=batch, padded=False, impl=name, cfg=cfg, us=None, ok=failed, attention_only=True))
            print(json.dumps(out[-1]), flush=True)
            continue
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, ref))
        row = dict(batch=batch, padded=False, impl=name, cfg=cfg, us=us, ok=err <= 2e-2, err=err)
        out.append(dict(row, attention_only=True))
        print(json.dumps(out[-1]), flush=True)
    return out


def main():
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_zero3.decode.gqa_attention import kernel_attention
    from hf_zero3.kernels import gqa_decode

    if not torch.cuda.is_available() or gqa_decode.load() is None:
        print("attention_probe needs a CUDA GPU with Triton; skipped")
        return
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []

    def timed(fn, n):
        return graph_us([lambda i=i: fn(i) for i in range(n)], REPLAYS)

    baseline = _baseline()
    for batch, padded in ((64, False), (64, True), (8, False)):
        g = torch.Generator(device=dev).manual_seed(batch)
        q = torch.randn(batch, 1, HEADS * DIM, generator=g, device=dev, dtype=dt)
        k = torch.randn(batch, 1, KV * DIM, generator=g, device=dev, dtype=dt)
        v = torch.randn(batch, 1, KV * DIM, generator=g, device=dev, dtype=dt)
        angles = torch.rand(batch, 1, DIM // 2, generator=g, device=dev) * 6
        cos, sin = torch.cat([angles.cos()] * 2, -1).to(dt), torch.cat([angles.sin()] * 2, -1).to(dt)
        caches = [
            (
                torch.randn(batch, KV, LENGTH, DIM, generator=g, device=dev, dtype=dt),
                torch.randn(batch, KV, LENGTH, DIM, generator=g, device=dev, dtype=dt),
                torch.tensor(POS, device=dev),
            )
            for _ in range(LAYERS)
        ]
        keep = torch.zeros(batch, 1, 1, LENGTH, dtype=torch.bool, device=dev)
        keep[..., : POS + 1] = True
        if padded:
            for i in range(batch):
                keep[i, ..., : i % 32] = False

        def unfused(kc, vc, n, q, k, v, cos, sin, keep):
            qs = q.view(batch, 1, HEADS, DIM).transpose(1, 2)
            ks = k.view(batch, 1, KV, DIM).transpose(1, 2)
            vs = v.view(batch, 1, KV, DIM).transpose(1, 2)
            qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
            at = torch.arange(1, device=q.device) + n
            n.add_(1)
            kc.index_copy_(2, at, ks)
            vc.index_copy_(2, at, vs)
            return kernel_attention(None, qs, kc, vc, keep, scaling=DIM**-0.5)[0]

        step = torch.compile(unfused, fullgraph=True)

        def base(i):
            kc, vc, n = caches[i % LAYERS]
            n.fill_(POS)
            return step(kc, vc, n, q, k, v, cos, sin, keep)

        us, ref = timed(base, LAYERS)
        rows.append(
            dict(
                batch=batch,
                padded=padded,
                impl="unfused (compiled rotary + cache writes + kernel)",
                cfg="",
                us=us,
                ok=True,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        impls = [("rope_decode_attention", gqa_decode._state["rope_run"])]
        if baseline is not None:
            impls.insert(0, ("baseline rope_decode_attention", baseline._state["rope_run"]))
        for cfg in SETTINGS:
            for impl, run in impls:

                def fused(i, cfg=cfg, run=run):
                    kc, vc, n = caches[i % LAYERS]
                    return run(
                        q.view(batch, HEADS, DIM),
                        k.view(batch, KV, DIM),
                        v.view(batch, KV, DIM),
                        cos.view(batch, DIM),
                        sin.view(batch, DIM),
                        kc,
                        vc,
                        n.view(1),
                        keep,
                        1,
                        DIM**-0.5,
                        **cfg,
                    )

                try:
                    us, outs = timed(fused, LAYERS)
                except Exception as exc:  # a setting that does not fit
                    rows.append(
                        dict(
                            batch=batch,
                            padded=padded,
                            impl=impl,
                            cfg=str(cfg),
                            us=None,
                            ok=f"{type(exc).__name__}: {str(exc)[:120]}",
                        )
                    )
                    continue
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, ref))
                rows.append(dict(batch=batch, padded=padded, impl=impl, cfg=str(cfg), us=us, ok=err <= 2e-2, err=err))
                print(json.dumps(rows[-1]), flush=True)
        if not padded:
            rows += _attention_only(batch, q, caches, keep, timed)
        caches.clear()
        torch.cuda.empty_cache()
    for r in rows:
        group = "attention only" if r.get("attention_only") else ""
        base = next(
            b
            for b in rows
            if (b["batch"], b["padded"]) == (r["batch"], r["padded"])
            and b["cfg"] == ""
            and (("attention only" if b.get("attention_only") else "") == group)
        )
        r["speedup"] = base["us"] / r["us"] if r["us"] else None
        old = next(
            (
                b
                for b in rows
                if (b["batch"], b["padded"], b["cfg"]) == (r["batch"], r["padded"], r["cfg"])
                and b["impl"].startswith("baseline")
                and b["us"]
            ),
            None,
        )
        r["vs_baseline"] = old["us"] / r["us"] if old and r["us"] and r["cfg"] else None
    print(table(rows, ["batch", "padded", "impl", "cfg", "us", "speedup", "vs_baseline", "ok"]))
    path = record(
        "attention_probe",
        rows,
        HERE,
        dict(layers=LAYERS, replays=REPLAYS, heads=HEADS, kv_heads=KV, head_dim=DIM, cache_length=LENGTH, position=POS),
    )
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()

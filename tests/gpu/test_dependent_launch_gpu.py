"""The decode kernels as programmatic dependent launches (``HF_ZERO3_PDL``; marked gpu): the GEMMs
and the rope attention launched that way compute what their plain launches compute, eagerly,
inside ``torch.compile(fullgraph=True)`` with inductor's own kernels dependent too, and replayed
from a CUDA graph, where each kernel may start before the one it reads has finished: a missing
wait would show as a wrong result. Timings are printed for the record, not asserted (the decode
benchmark measures them)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

LAYERS = 16


def _weights(layers=LAYERS, hidden=2048, inter=8192):
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * k**-0.5

    return [(w(inter, hidden), w(inter, hidden), w(hidden, inter), w(hidden, hidden)) for _ in range(layers)]


def _norm(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)


def _mlp_stack(x, weights, gate_up, split):
    """A decode step's MLP and output-projection GEMMs, layer after layer, each reading the one
    before: norm, gate/up, down (split-K), residual add, norm, o_proj (split-K), residual add (the
    norms keep the values where bf16 rounding does not compound over the layers)."""
    for wg, wu, wd, wo in weights:
        x = x + split(gate_up(_norm(x), wg, wu), wd, 4).sum(0).to(x.dtype)
        x = x + split(_norm(x), wo, 4).sum(0).to(x.dtype)
    return x


def _graph(fn, *args):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)  # warm-up (and autotuning) before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def _replay_us(graph, n=20):
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


@pytest.mark.parametrize("rows", [8, 64])
def test_dependent_gemms_compute_the_plain_launches_results(rows):
    from hf_zero3._upstream import torch as torch_up
    from hf_zero3.kernels import decode_gemm

    assert decode_gemm.dependent_unavailable("cuda") is None, decode_gemm.dependent_unavailable("cuda")
    _, gate_up, split = decode_gemm.load()
    dep_gate_up, dep_split = decode_gemm.load_dependent("cuda")
    weights = _weights()
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    expected = _mlp_stack(x, weights, gate_up, split)
    # eagerly (the autotuner picks the same launch configuration for both: one tuner per kernel)
    torch.testing.assert_close(_mlp_stack(x, weights, dep_gate_up, dep_split), expected, rtol=0, atol=0)
    timings, graphs = {}, {}
    for name, (gu, sp, options) in {
        "plain": (gate_up, split, {}),
        "dependent": (dep_gate_up, dep_split, torch_up.inductor_dependent_launch_options()),
    }.items():
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: _mlp_stack(x, weights, gu, sp), fullgraph=True, options=options or None)
        graphs[name] = _graph(compiled, x)
    for trial in range(3):
        x.normal_()
        eager = _mlp_stack(x, weights, gate_up, split)
        outs = {}
        for name, (graph, out) in graphs.items():
            graph.replay()
            outs[name] = out.clone()
        # inductor's norms round otherwise than eager's, and over 32 GEMMs the roundings add up to
        # a few bf16 steps of the largest value (a few tenths where values reach ~20); a
        # kernel reading its input before the kernel writing it finished would be off by the
        # input's size
        scale = eager.abs().max().item()
        gaps = {name: (out - eager).abs().max().item() for name, out in outs.items()}
        gaps["dependent vs plain"] = (outs["dependent"] - outs["plain"]).abs().max().item()
        print(f"rows {rows} trial {trial}: largest |value| {scale:.2f}, largest differences", gaps)
        assert all(gap <= 0.05 * max(1.0, scale) for gap in gaps.values()), (scale, gaps)
    for name, (graph, _) in graphs.items():
        timings[name] = _replay_us(graph)
    print(
        f"rows {rows}: {LAYERS} layers of norm + gate/up + down + o_proj in one CUDA graph, us per replay:",
        {k: round(v, 1) for k, v in timings.items()},
    )


def test_dependent_rope_attention_computes_the_plain_launchs_result():
    """The dependent launch (its first cache block loaded before the wait, 2 warps at this batch:
    ``gqa_decode._one_wave``) writes the cache exactly as the plain one and attends within bf16
    rounding of it (another warp count sums in another order); a read of the query before the
    kernel writing it finished would be off by the values' size."""
    from test_gqa_decode_kernel_gpu import _rope_case

    from hf_zero3.kernels import gqa_decode

    q, k, v, cos, sin, kc, vc, keep = _rope_case()
    outs = {}
    for dependent in (False, True):
        ck, cv, n = kc.clone(), vc.clone(), torch.tensor(100, device="cuda")

        def step(q, ck, cv, n):
            # the query from a kernel right before (as from the q/k/v GEMM), the fill count after
            out = (
                gqa_decode.rope_decode_attention(q * 1.0, k, v, cos, sin, ck, cv, n, keep, 0.125, dependent=dependent)
                + 0
            )
            n.add_(1)
            return out

        eager = step(q, ck.clone(), cv.clone(), n.clone())
        torch._dynamo.reset()
        graph, out = _graph(torch.compile(step, fullgraph=True), q, ck, cv, n)
        ck.copy_(kc)
        cv.copy_(vc)
        n.fill_(100)
        graph.replay()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        outs[dependent] = (out.clone(), ck.clone(), cv.clone(), int(n))
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=1.6e-2, atol=1e-2)
    assert torch.equal(outs[True][1], outs[False][1]) and torch.equal(outs[True][2], outs[False][2])
    assert outs[True][3] == outs[False][3] == 101


def test_qkv_partials_into_the_rope_kernel_match_the_projections_gemm():
    """The decode step's fused q/k/v projection through the dependent split-K GEMM, its float32
    partials summed in the dependent rope kernel (``HF_ZERO3_TRITON_QKV``), compiled and replayed
    from a CUDA graph: the attention and the cache it writes within bf16 rounding of cuBLAS's
    projection feeding the same kernel (the sums round once, in another order)."""
    from test_gqa_decode_kernel_gpu import _rope_case

    from hf_zero3.kernels import decode_gemm, gqa_decode

    _, _, _, cos, sin, kc, vc, keep = _rope_case()
    rows, heads, kv, dim = 64, 32, 8, 64
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(rows, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn((heads + 2 * kv) * dim, 2048, generator=g, device="cuda", dtype=torch.bfloat16) * 2048**-0.5
    sizes = [heads * dim, kv * dim, kv * dim]
    split_op = decode_gemm.load_dependent("cuda")[1]

    def cublas(x, ck, cv, n):
        q, k, v = torch.nn.functional.linear(x, w).split(sizes, -1)
        return gqa_decode.rope_decode_attention(
            q.view(rows, heads, dim),
            k.view(rows, kv, dim),
            v.view(rows, kv, dim),
            cos,
            sin,
            ck,
            cv,
            n,
            keep,
            0.125,
            dependent=True,
        )

    def partials(x, ck, cv, n):
        q, k, v = split_op(x, w, 4).split(sizes, -1)
        return gqa_decode.rope_decode_attention(
            q.view(4, rows, heads, dim),
            k.view(4, rows, kv, dim),
            v.view(4, rows, kv, dim),
            cos,
            sin,
            ck,
            cv,
            n,
            keep,
            0.125,
            dependent=True,
        )

    results = {}
    for name, fn in (("cublas", cublas), ("partials", partials)):
        ck, cv, n = kc.clone(), vc.clone(), torch.tensor(100, device="cuda")
        torch._dynamo.reset()
        graph, out = _graph(torch.compile(fn, fullgraph=True), x, ck, cv, n)
        ck.copy_(kc)
        cv.copy_(vc)
        graph.replay()
        results[name] = (out.float().clone(), ck[:, :, 100].float().clone(), cv[:, :, 100].float().clone())
    for got, want in zip(results["partials"], results["cublas"]):
        assert got.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
    print(
        "q/k/v partials vs cuBLAS's projection, max abs diff (attention, key, value):",
        [round((a - b).abs().max().item(), 5) for a, b in zip(results["partials"], results["cublas"])],
    )

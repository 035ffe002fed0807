"""The Triton decode attention (hf_zero3.kernels.gqa_decode) compiled on a GPU (marked gpu): bf16
at Llama-3.2-1B decode shapes within bf16 tolerance of the PyTorch form and of float32 math;
inside ``torch.compile(fullgraph=True)`` and replayed from a CUDA graph, the same output."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _case(batch=64, heads=32, kv=8, dim=64, length=192, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, 1, dim, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv, length, dim, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv, length, dim, generator=g, device="cuda", dtype=dtype)
    keep = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device="cuda")
    for i in range(batch):
        keep[i, ..., i % 7: 64 + (3 * i) % 100] = True  # left padding, the unfilled tail
    return q, k, v, keep


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_within_tolerance_of_the_pytorch_form(dtype):
    from hf_zero3.generation.decode_attention import attention
    from hf_zero3.kernels import gqa_decode

    assert gqa_decode.is_available(), gqa_decode.unavailable_reason()
    q, k, v, keep = _case(dtype=dtype)
    scale = 64 ** -0.5
    out = gqa_decode.gqa_decode_attention(q, k, v, keep, scale)
    exact, _ = attention(None, q.float(), k.float(), v.float(), keep, scaling=scale)
    torch_form, _ = attention(None, q, k, v, keep, scaling=scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.float() - exact).abs().max().item() <= tol
    # the kernel keeps scores in float32: at least as close to exact math as the PyTorch form
    assert (out.float() - exact).abs().max() <= (torch_form.float() - exact).abs().max() + 1e-3


def test_kernel_compiles_into_one_graph_and_replays_from_a_cuda_graph():
    from hf_zero3.generation.decode_attention import kernel_attention

    q, k, v, keep = _case()

    def step(q, k, v, keep):
        return kernel_attention(None, q * 1.0, k, v, keep, scaling=0.125)[0] + 0

    expected = step(q, k, v, keep)
    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, keep), expected)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compiled(q, k, v, keep)  # warm-up before capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = compiled(q, k, v, keep)
    keep[:, ..., :32] = False  # a new mask, read by the replay
    graph.replay()
    torch.testing.assert_close(out, step(q, k, v, keep))

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
        keep[i, ..., i % 7 : 64 + (3 * i) % 100] = True  # left padding, the unfilled tail
    return q, k, v, keep


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_within_tolerance_of_the_pytorch_form(dtype):
    from hf_zero3.decode.gqa_attention import attention
    from hf_zero3.kernels import gqa_decode

    assert gqa_decode.is_available(), gqa_decode.unavailable_reason()
    q, k, v, keep = _case(dtype=dtype)
    scale = 64**-0.5
    out = gqa_decode.gqa_decode_attention(q, k, v, keep, scale)
    exact, _ = attention(None, q.float(), k.float(), v.float(), keep, scaling=scale)
    torch_form, _ = attention(None, q, k, v, keep, scaling=scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.float() - exact).abs().max().item() <= tol
    # the kernel keeps scores in float32: at least as close to exact math as the PyTorch form
    assert (out.float() - exact).abs().max() <= (torch_form.float() - exact).abs().max() + 1e-3


def test_kernel_compiles_into_one_graph_and_replays_from_a_cuda_graph():
    from hf_zero3.decode.gqa_attention import kernel_attention

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


def _rope_case(batch=64, heads=32, kv=8, dim=64, length=192, pos=100, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, heads, dim, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv, dim, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv, dim, generator=g, device="cuda", dtype=dtype)
    angles = torch.rand(batch, dim // 2, generator=g, device="cuda") * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    kc = torch.randn(batch, kv, length, dim, generator=g, device="cuda", dtype=dtype)
    vc = torch.randn(batch, kv, length, dim, generator=g, device="cuda", dtype=dtype)
    keep = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device="cuda")
    for i in range(batch):
        keep[i, ..., i % 7 : pos + 1] = True
    return q, k, v, cos, sin, kc, vc, keep


def _rope_reference(q, k, v, cos, sin, kc, vc, keep, pos):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_zero3.decode.gqa_attention import attention

    qr, kr = apply_rotary_pos_emb(
        q[:, :, None].float(), k[:, :, None].float(), cos[:, None].float(), sin[:, None].float()
    )
    kc, vc = kc.float().clone(), vc.float().clone()
    at = torch.tensor([pos], device=q.device)
    kc.index_copy_(2, at, kr.to(q.dtype).float())
    vc.index_copy_(2, at, v[:, :, None].float())
    return attention(None, qr.to(q.dtype).float(), kc, vc, keep, scaling=q.shape[-1] ** -0.5)[0], kc, vc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_kernel_within_tolerance_of_float32_math(dtype):
    """Rotary embedding + cache write + attention in one kernel (Llama-3.2-1B decode shapes)."""
    from hf_zero3.kernels import gqa_decode

    q, k, v, cos, sin, kc, vc, keep = _rope_case(dtype=dtype)
    exact, ref_k, ref_v = _rope_reference(q, k, v, cos, sin, kc, vc, keep, 100)
    counter = torch.tensor(100, device="cuda")
    out = gqa_decode.rope_decode_attention(q, k, v, cos, sin, kc, vc, counter, keep, 64**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.float() - exact).abs().max().item() <= tol
    assert (kc.float() - ref_k).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(vc.float(), ref_v) and int(counter) == 100


def test_rope_kernel_compiled_and_replayed_writes_the_cache_in_place():
    """Inside ``torch.compile(fullgraph=True)`` (a graph input mutated by a user Triton kernel) and
    replayed from a CUDA graph: the caller's cache tensors hold the new key and value, the output
    is the eager kernel's, and the position comes from the counter at replay."""
    from hf_zero3.kernels import gqa_decode

    q, k, v, cos, sin, kc, vc, keep = _rope_case()
    counter = torch.tensor(100, device="cuda")

    def step(q, k, v, kc, vc, counter, keep):
        out = gqa_decode.rope_decode_attention(q * 1.0, k, v, cos, sin, kc, vc, counter, keep, 0.125) + 0
        counter.add_(1)
        return out

    eager_k, eager_v, eager_n = kc.clone(), vc.clone(), counter.clone()
    expected = step(q, k, v, eager_k, eager_v, eager_n, keep)
    compiled = torch.compile(step, fullgraph=True)
    ck, cv, cn = kc.clone(), vc.clone(), counter.clone()
    torch.testing.assert_close(compiled(q, k, v, ck, cv, cn, keep), expected)
    assert torch.equal(ck, eager_k) and torch.equal(cv, eager_v) and int(cn) == 101
    ck, cv, cn = kc.clone(), vc.clone(), counter.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compiled(q, k, v, ck, cv, cn, keep)  # warm-up before capture (writes position 100)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(q, k, v, ck, cv, cn, keep)  # captured at 101
    ck.copy_(kc)
    cv.copy_(vc)
    cn.fill_(100)
    graph.replay()  # at 100 again: the counter read at replay
    torch.testing.assert_close(out, expected)
    assert torch.equal(ck, eager_k) and torch.equal(cv, eager_v) and int(cn) == 101


def test_rope_inputs_are_built_once_a_step_not_once_a_layer():
    """Several layers' rope kernels in one compiled step, reading the loop's 2-D padding mask and
    cos/sin computed from the positions in the step (as the static loop's step does): with the
    rotary rows through ``hf_zero3::decode_rotary_rows`` the kernels inductor generates to compute
    cos/sin do not grow with the layer count, and are no more than without the op (without it a
    profiler trace shows three input-building kernels a layer). Same output as eager."""
    import re

    from torch._inductor.utils import run_and_get_code

    from hf_zero3.decode.gqa_attention import _rotary_rows
    from hf_zero3.kernels import gqa_decode

    q, k, v, _, _, kc, vc, _ = _rope_case()
    padding = torch.ones(kc.shape[0], kc.shape[2], dtype=torch.long, device="cuda")
    for i in range(kc.shape[0]):
        padding[i, : i % 7] = 0  # left padding; the kernel reads nothing after the new token
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float) / 64))
    positions = torch.arange(kc.shape[0], device="cuda") % 5 + 95

    def make(rotary_op):
        def step(q, k, v, caches, counter, padding, positions):
            freqs = positions[:, None].float() * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
            if rotary_op:
                cos, sin = _rotary_rows(cos, sin)
            outs = [
                gqa_decode.rope_decode_attention(q, k, v, cos, sin, kc_i, vc_i, counter, padding, 0.125)
                for kc_i, vc_i in caches
            ]
            return torch.stack(outs).sum(0)

        return step

    generated = {}
    for rotary_op in (True, False):
        step = make(rotary_op)
        for layers in (2, 4):
            caches = [(kc.clone(), vc.clone()) for _ in range(layers)]
            expected = step(
                q,
                k,
                v,
                [(a.clone(), b.clone()) for a, b in caches],
                torch.tensor(100, device="cuda"),
                padding,
                positions,
            )
            torch._dynamo.reset()
            out, code = run_and_get_code(
                torch.compile(step, fullgraph=True),
                q,
                k,
                v,
                caches,
                torch.tensor(100, device="cuda"),
                padding,
                positions,
            )
            torch.testing.assert_close(out, expected)
            for (ck, cv), (ek, ev) in zip(caches, [(kc, vc)] * layers):
                assert not torch.equal(ck, ek) and torch.equal(ck[:, :, :100], ek[:, :, :100])  # wrote at 100
            # inductor's own kernels computing cos or sin (the user kernel is @triton.jit'd apart)
            src = "\n".join(code)
            generated[rotary_op, layers] = len(
                {
                    m.group(1)
                    for m in re.finditer(r"def (triton_\w+)\(", src)
                    if "cos" in m.group(1) or "sin" in m.group(1)
                }
            )
    print("kernels computing cos/sin, (rotary op, layers):", generated)
    assert generated[True, 2] == generated[True, 4] <= generated[False, 4], generated

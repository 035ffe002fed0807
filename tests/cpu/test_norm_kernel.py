"""An eager decode step's RMSNorms through hf_zero3's Triton kernel (hf_zero3.decode.norm_kernel,
hf_zero3.kernels.rms_norm), run by Triton's interpreter on CPU: the kernel against transformers'
own RMSNorm in float32 (the interpreter's casts to bf16 do not round as the GPU's do: the GPU test
checks bf16 to the bit), a whole bf16 forward with its norms patched, and which norms it takes."""

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernel tests need Triton (installed with the test extra)")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a GPU host: the GPU tests run the kernel compiled (conftest sets the interpreter on CPU-only hosts)",
)


@pytest.mark.parametrize("n", [32, 96, 896, 2048])
def test_the_kernel_equals_transformers_rmsnorm(n):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hf_zero3.kernels import rms_norm

    g = torch.Generator().manual_seed(n)
    norm = LlamaRMSNorm(n, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g))
    x = 3 * torch.randn(7, n, generator=g)
    ours = rms_norm.load()(x, norm.weight.detach(), norm.variance_epsilon)
    with torch.no_grad():
        own = norm(x)
    assert ours.dtype == x.dtype and ours.shape == x.shape
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_what_it_cannot_read():
    from hf_zero3.kernels import rms_norm

    f = rms_norm.load()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        f(x, torch.ones(64), 1e-6)  # a float32 weight for bf16 rows: transformers' result is float32
    with pytest.raises(ValueError, match="contiguous"):
        f(x.t(), torch.ones(4, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
def test_which_norms_it_takes(family):
    from hf_zero3.decode import norm_kernel
    from hf_zero3.testing import models

    model = models.plain_model(getattr(models, f"tiny_{family}_config")()).to(torch.bfloat16)
    names = [n for n, m in model.named_modules() if norm_kernel.applies(m)]
    every = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert names and names == every  # each layer's two and the final norm
    assert norm_kernel.plan(model, "cpu") == ()  # CUDA only
    assert not any(norm_kernel.applies(m) for m in model.float().modules())  # float32: the model's own


def test_gemma_and_hooked_norms_keep_their_own():
    from hf_zero3.decode import norm_kernel
    from hf_zero3.testing import models

    gemma = models.plain_model(models.tiny_gemma3_config()).to(torch.bfloat16)
    assert not any(norm_kernel.applies(m) for m in gemma.modules())  # (1 + weight): another norm
    model = models.plain_model(models.tiny_llama_config()).to(torch.bfloat16)
    norm = model.model.norm
    handle = norm.register_forward_hook(lambda *a: None)
    assert not norm_kernel.applies(norm)
    handle.remove()
    assert norm_kernel.applies(norm)


def test_a_forward_with_its_norms_patched_equals_its_own_and_use_restores_them():
    from hf_zero3.decode import norm_kernel
    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config()).to(torch.bfloat16).eval()
    names = tuple(n for n, m in model.named_modules() if norm_kernel.applies(m))
    bound = norm_kernel.bind(model, names + ("model.missing",))  # a name the model lost: skipped
    assert len(bound) == len(names) == 5
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(ids).logits
        with norm_kernel.use(bound):
            first = bound[0].forward
            ours = model(ids).logits
            x = torch.randn(2, 5, model.config.hidden_size)  # float32 rows: the module's own computation
            torch.testing.assert_close(bound[0](x), type(bound[0]).forward(bound[0], x), rtol=0, atol=0)
        with norm_kernel.use(bound):
            assert bound[0].forward is first  # kept while the weight stays
    assert all("forward" not in vars(m) for m in bound)
    torch.testing.assert_close(ours.float(), own.float(), rtol=0.05, atol=0.05)
    assert bool((ours.argmax(-1) == own.argmax(-1)).float().mean() > 0.9)

"""The static loop's fused q/k/v projections (one GEMM per attention module in decode steps) on
real transformers models, fp32: equal to the model's own projections eagerly and compiled, the
same compiled graph for a later call's new buffer, modules it must leave alone, and the modules'
own forwards back after a step, also one that raised."""

import pytest
import torch
from torch import nn


def _model(kind="llama"):
    from hf_zero3.testing import models

    cfg = models.tiny_llama_config() if kind == "llama" else models.tiny_qwen2_config()  # Qwen2: q/k/v biases
    return models.plain_model(cfg).eval()


def _ids(model, seed=0):
    return torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_qkv_equals_the_models_own_eager_and_compiled(kind):
    import torch._dynamo

    from hf_zero3.decode import fused_qkv as fp

    model = _model(kind)
    names = fp.plan(model)
    assert names == tuple(f"model.layers.{i}.self_attn" for i in range(model.config.num_hidden_layers))
    fused = fp.Fused(names)
    ids = _ids(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        assert fused.bind(model) == len(names) and fused.ptr != 0
        with fused.use():
            eager = model(input_ids=ids).logits
        kept = fused.buffer.clone()
        fused.buffer.zero_()  # the fused path reads the copy, not the modules' own weights
        with fused.use():
            zeroed = model(input_ids=ids).logits
        fused.buffer.copy_(kept)
        assert not torch.allclose(zeroed, ref, atol=1e-3)
        torch._dynamo.reset()
        step = torch.compile(type(model).__call__, fullgraph=True)
        with fused.use():
            compiled = step(model, input_ids=ids).logits
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        fused.free()
        assert fused.ptr == 0
        # a later call: the weights changed (a training step) and the buffer is a new tensor
        for p in model.parameters():
            p.add_(0.01)
        ref2 = model(input_ids=ids).logits
        fused.bind(model)
        with fused.use():
            compiled2 = step(model, input_ids=ids).logits
        fused.free()
    torch.testing.assert_close(eager, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled2, ref2, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref2, ref)  # the copy is refreshed, not stale
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile for the new buffer
    attn = model.model.layers[0].self_attn
    assert all("forward" not in vars(getattr(attn, n)) for n in fp.NAMES)


def test_what_is_left_alone():
    from peft import LoraConfig, get_peft_model

    from hf_zero3.decode import fused_qkv as fp

    model = _model()
    n = model.config.num_hidden_layers
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *a: None)
    assert len(fp.plan(model)) == n - 1  # a hooked projection keeps its own call
    handle.remove()
    model.model.layers[1].self_attn.v_proj.forward = lambda x: x  # a patched forward (accelerate's hooks)
    assert fp.plan(model) == ("model.layers.0.self_attn",)
    del model.model.layers[1].self_attn.v_proj.forward
    lora = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert fp.plan(lora) == ()  # LoRA layers are not plain nn.Linear


class _Cross(nn.Module):
    """Projections named like self-attention's, the key/value ones called on another input."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, memory):
        return self.q_proj(x), self.k_proj(memory), self.v_proj(memory)


def test_a_projection_called_on_another_input_computes_its_own():
    from hf_zero3.decode import fused_qkv as fp

    torch.manual_seed(0)
    m = _Cross()
    x, mem = torch.randn(3, 4), torch.randn(3, 4)
    ref = m(x, mem)
    fused = fp.Fused(fp.plan(m))
    assert fused.names == ("",) and fused.bind(m) == 1
    with torch.no_grad(), fused.use():
        got = m(x, mem)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_forwards_are_restored_after_a_step_that_raised():
    from hf_zero3.decode import fused_qkv as fp

    model = _model()
    fused = fp.Fused(fp.plan(model))
    fused.bind(model)
    attn = model.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="boom"):
        with fused.use():
            assert "forward" in vars(attn.q_proj)
            raise RuntimeError("boom")
    assert all("forward" not in vars(getattr(attn, n)) for n in fp.NAMES)
    fused.free()


def test_layers_with_and_without_biases():
    from hf_zero3.decode import fused_qkv as fp

    model = _model()
    attn = model.model.layers[1].self_attn
    torch.manual_seed(1)
    for name in fp.NAMES:  # one layer with q/k/v biases, the other without
        old = getattr(attn, name)
        setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
    ids = _ids(model)
    fused = fp.Fused(fp.plan(model))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        assert fused.bind(model) == 2
        with fused.use():
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    fused.free()
    assert fused.ptr == 0
    off = fp.Fused(())  # the loop's plan with DecodeOptions(fuse_qkv=False): nothing to fuse
    assert off.bind(model) == 0 and off.ptr == 0


def test_the_parts_are_views_of_one_gemm_not_copies():
    """A fused layer's q, k and v are slices of one GEMM's output, read through their strides (a copy
    each was three kernels a layer in front of the fused rope kernel on a GPU), equal to the
    modules' own projections."""
    from hf_zero3.decode import fused_qkv as fp

    model = _model()
    fused = fp.Fused(fp.plan(model))
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 1, model.config.hidden_size)
    with torch.no_grad():
        own = [getattr(attn, n)(x) for n in fp.NAMES]
        assert fused.bind(model) > 0
        with fused.use():
            parts = [getattr(attn, n)(x) for n in fp.NAMES]
    fused.free()
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1
    assert not any(p.is_contiguous() for p in parts)  # rows strided by the fused width
    for got, ref in zip(parts, own):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)

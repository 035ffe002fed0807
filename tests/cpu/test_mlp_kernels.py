"""The decode step's MLP through hf_zero3's Triton GEMMs (hf_zero3.decode.mlp_kernels,
hf_zero3.kernels.decode_gemm), run by Triton's interpreter on CPU in float32 (its bf16 ``tl.dot``
is not exact; bf16 runs in the GPU benchmark): the kernels against F.linear, the patched forward
against a real Llama MLP, and which modules it takes."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="the kernel tests need Triton (installed with the test extra)")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a GPU host: the GPU benchmark runs the kernels compiled (conftest sets the interpreter on CPU-only hosts)",
)


@pytest.mark.parametrize("rows,n,k", [(3, 40, 70), (8, 64, 256), (17, 33, 130), (64, 48, 96)])
def test_kernels_equal_f_linear(rows, n, k):
    from hf_zero3.kernels import decode_gemm

    g = torch.Generator().manual_seed(rows)
    x, w, u = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, k, generator=g)
    linear, gate_up_silu, split = decode_gemm.load()
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gate_up_silu(x, w, u), F.silu(F.linear(x, w)) * F.linear(x, u), rtol=1e-4, atol=1e-3)
    parts = split(x, w, decode_gemm.split_for(k))
    assert parts.shape == (decode_gemm.split_for(k), rows, n)
    torch.testing.assert_close(parts.sum(0), F.linear(x, w), rtol=1e-4, atol=1e-4)
    for cfg in decode_gemm.CONFIGS[:3]:  # the probe's entry, one launch configuration each
        torch.testing.assert_close(decode_gemm.linear(x, w, cfg), F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "rows,n,k,cfg",
    [
        (3, 40, 256, dict(BLOCK_N=16, BLOCK_K=64, SPLIT=4)),
        (64, 48, 512, dict(BLOCK_N=32, BLOCK_K=128, SPLIT=2)),
        (17, 33, 128, dict(BLOCK_N=16, BLOCK_K=32, SPLIT=4)),
    ],
)
def test_split_k_partials_sum_to_f_linear(rows, n, k, cfg):
    from hf_zero3.kernels import decode_gemm

    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    parts = decode_gemm.linear_split(x, w, cfg)
    assert parts.shape == (cfg["SPLIT"], rows, n) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), F.linear(x, w), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of SPLIT"):
        decode_gemm.linear_split(x, w, dict(cfg, SPLIT=3))


def test_split_for_takes_four_slices_from_2048():
    from hf_zero3.kernels.decode_gemm import split_for

    assert [split_for(k) for k in (64, 1024, 1088, 2048, 8192, 14336, 3000, 1000)] == [1, 2, 1, 4, 4, 4, 1, 1]


@pytest.mark.parametrize("family", ["llama", "phi3"])
@pytest.mark.parametrize("split", [False, True])
def test_an_mlp_through_the_kernels_equals_its_own_forward(split, family):
    """Llama's gate/up/down MLP, and Phi-3's fused gate_up_proj (the kernel reads its row halves)."""
    from hf_zero3.decode import mlp_kernels
    from hf_zero3.kernels import decode_gemm
    from hf_zero3.testing import models

    # intermediate 1024: down's reduction splits in two with split-K on
    model = models.plain_model(getattr(models, f"tiny_{family}_config")(intermediate_size=1024))
    mlp = model.model.layers[0].mlp
    # the loop takes half-precision MLPs (float32 keeps its own); the forward computes any dtype
    assert mlp_kernels.applies(copy.deepcopy(mlp).to(torch.bfloat16)) and not mlp_kernels.applies(mlp)
    assert decode_gemm.split_for(mlp.down_proj.in_features) == 2
    x = torch.randn(5, 1, model.config.hidden_size)
    with torch.no_grad():
        own = mlp(x)
        ours = mlp_kernels._forward(mlp, split)(x)
        big = torch.randn(2, 40, model.config.hidden_size)  # a prompt's rows: the model's own computation
        torch.testing.assert_close(mlp_kernels._forward(mlp, split)(big), mlp(big))
        # dependent launches asked where there are none (CPU, Triton's interpreter): the plain ops
        torch.testing.assert_close(mlp_kernels._forward(mlp, split, True)(x), ours, rtol=0, atol=0)
    torch.testing.assert_close(ours, own, rtol=1e-4, atol=1e-5)


def test_an_output_projection_through_split_k_equals_its_own_forward():
    from hf_zero3.decode import mlp_kernels

    lin = torch.nn.Linear(1024, 40, bias=False)
    x = torch.randn(6, 1, 1024)
    with torch.no_grad():
        torch.testing.assert_close(mlp_kernels._split_forward(lin)(x), lin(x), rtol=1e-4, atol=1e-4)
        big = torch.randn(2, 40, 1024)  # more rows than a decode step: the layer's own GEMM
        torch.testing.assert_close(mlp_kernels._split_forward(lin)(big), lin(big))


def test_which_output_projections_split_and_use_restores_them(monkeypatch):
    from hf_zero3.decode import mlp_kernels
    from hf_zero3.testing import models

    # o_proj's reduction is heads x head_dim = hidden (1024 here): long enough to split
    model = models.plain_model(models.tiny_llama_config(hidden_size=1024, num_hidden_layers=1)).to(torch.bfloat16)
    split = tuple(n for n, m in model.named_modules() if mlp_kernels.applies_split(n, m))
    assert split == ("model.layers.0.self_attn.o_proj",)
    small = models.plain_model(models.tiny_llama_config()).to(torch.bfloat16)  # 32: too short to split
    assert not any(mlp_kernels.applies_split(n, m) for n, m in small.named_modules())
    o = model.model.layers[0].self_attn.o_proj
    handle = o.register_forward_pre_hook(lambda *a: None)
    assert not mlp_kernels.applies_split(split[0], o)  # hooked: its own forward
    handle.remove()
    names = split + ("model.layers.0.mlp",)
    bound = mlp_kernels.bind(model, names)
    assert bound == [o, model.model.layers[0].mlp]
    assert mlp_kernels.counts(bound, True) == (1, 1) and mlp_kernels.counts(bound, False) == (1, 1)
    with mlp_kernels.use(bound, True):
        first = o.forward
    with mlp_kernels.use(bound, True):
        assert o.forward is first  # kept: a compiled step's guard on it holds
    assert "forward" not in vars(o)


def test_which_mlps_it_takes_and_use_restores_them(monkeypatch):
    from hf_zero3.decode import mlp_kernels
    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config()).to(torch.bfloat16)
    names = tuple(n for n, m in model.named_modules() if mlp_kernels.applies(m))
    assert names == ("model.layers.0.mlp", "model.layers.1.mlp")
    assert mlp_kernels.plan(model, "cpu") == ()  # CUDA only
    assert not mlp_kernels.applies(model.float().model.layers[0].mlp)  # float32: the model's own
    model.to(torch.bfloat16)
    mlp = model.model.layers[0].mlp
    handle = mlp.gate_proj.register_forward_hook(lambda *a: None)
    assert not mlp_kernels.applies(mlp)  # a hooked projection (LoRA, accelerate, a user's) keeps its own
    handle.remove()
    mlp.act_fn = torch.nn.GELU()
    assert not mlp_kernels.applies(mlp)
    mlp.act_fn = torch.nn.SiLU()
    assert mlp_kernels.applies(mlp)
    keeps = type("MyMLP", (type(mlp),), {})  # a class of the user's that keeps the checked forward
    mlp.__class__ = keeps
    assert mlp_kernels.applies(mlp)
    overrides = type("MyMLP", (type(mlp),), {"forward": lambda self, x: self.down_proj(self.up_proj(x))})
    mlp.__class__ = overrides  # its own forward: its own code runs
    assert not mlp_kernels.applies(mlp)
    mlp.__class__ = keeps.__mro__[1]
    bound = mlp_kernels.bind(model, names)
    assert len(bound) == 2 and bound[0] is mlp
    with pytest.raises(RuntimeError, match="inside"):
        with mlp_kernels.use(bound, False):
            assert "forward" in vars(mlp)
            raise RuntimeError("inside")
    assert "forward" not in vars(mlp)


def test_autocast_keeps_the_models_computation():
    """Under autocast (which casts per op) the model's own MLP runs: the kernel would not cast."""
    from hf_zero3.decode import mlp_kernels
    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config())
    mlp = model.model.layers[0].mlp
    fn = mlp_kernels._forward(mlp, True)
    y = torch.randn(3, 1, model.config.hidden_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, own = fn(y), mlp(y)
    assert ours.dtype == own.dtype == torch.bfloat16  # autocast's computation, not the float32 kernel's
    torch.testing.assert_close(ours, own, rtol=0, atol=0)


def test_split_k_autotuning_keeps_only_configurations_whose_block_divides_a_slice():
    from hf_zero3.kernels import decode_gemm

    configs = [triton.Config({"BLOCK_N": 32, "BLOCK_K": bk}) for bk in (64, 128, 256)]
    # 2816 = 4 slices of 704: only BLOCK_K 64 divides them; 8192 = 4 of 2048: all three
    assert [c.kwargs["BLOCK_K"] for c in decode_gemm._split_prune(configs, {}, K=2816, SPLIT=4)] == [64]
    assert len(decode_gemm._split_prune(configs, {}, K=8192, SPLIT=4)) == 3
    assert decode_gemm._split_prune(configs, {"K": 96, "SPLIT": 2}) == []  # Triton then raises, no wrong sum


def test_autotuned_kernels_keep_their_results_for_the_next_process(tmp_path):
    """The GEMMs' autotuning results go to Triton's cache (``cache_results``), so a new process does
    not benchmark every configuration again before its first decode step. Built in a process
    without Triton's interpreter (this one runs it, and the interpreter keeps no results)."""
    import os
    import subprocess
    import sys

    code = (
        "import triton, triton.language as tl\n"
        "from hf_zero3.kernels import triton_launch\n"
        "@triton.jit\n"
        "def k(x_ptr, N: tl.constexpr):\n"
        "    pass\n"
        "print(triton_launch.autotune(k, [triton.Config({})], ['N']).cache_results)\n"
    )
    script = tmp_path / "tuned.py"  # Triton reads a kernel's source from its file
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout

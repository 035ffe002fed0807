"""The Triton decode-attention kernel (hf_zero3.kernels.gqa_decode) run by Triton's interpreter on
CPU, float32, against the PyTorch form it replaces on GPU and, through a real Llama model with a
static cache, against the model's own attention. (The interpreter's bf16 ``tl.dot`` is not
exact; bf16 runs in the GPU test.)"""

import os

import pytest
import torch

from hf_zero3._upstream import transformers as hf_up

triton = pytest.importorskip("triton", reason="the kernel tests need Triton (installed with the test extra)")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a GPU host: tests/gpu runs the kernel compiled (conftest sets the interpreter on CPU-only hosts)",
)


@pytest.fixture(autouse=True)
def switch_on(monkeypatch):
    from hf_zero3.kernels import gqa_decode

    monkeypatch.delenv("HF_ZERO3_TRITON_ATTENTION", raising=False)
    assert gqa_decode.load() is not None, gqa_decode.unavailable_reason()  # built interpreted


def _case(seed, batch, heads, kv, dim, length, dim_v=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k = torch.randn(batch, kv, length, dim, generator=g)
    v = torch.randn(batch, kv, length, dim_v or dim, generator=g)
    keep = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    for i in range(batch):
        keep[i, ..., 3 * i : max(3 * i + 1, length - 70 - i)] = True  # left padding, an unfilled tail
    return q, k, v, keep


@pytest.mark.parametrize(
    "batch,heads,kv,dim,length,dim_v",
    [
        (3, 8, 2, 16, 70, None),  # a tail block with no position to attend (skipped)
        (2, 12, 4, 64, 200, None),  # four blocks, the last partly outside the cache
        (1, 6, 3, 80, 33, None),  # a head dim that is no power of two, one block
        (2, 4, 4, 16, 20, None),  # one query head per key/value head
        (2, 8, 2, 32, 90, 16),  # a value head dim of its own
    ],
)
def test_kernel_equals_the_pytorch_form(batch, heads, kv, dim, length, dim_v):
    from hf_zero3.decode.gqa_attention import attention
    from hf_zero3.kernels import gqa_decode

    q, k, v, keep = _case(batch + length, batch, heads, kv, dim, length, dim_v)
    assert gqa_decode.supports(q, k, v, keep)
    scale = dim**-0.5
    ref, _ = attention(None, q, k, v, keep, scaling=scale) if kv < heads else (None, None)
    if ref is None:  # the PyTorch form hands one-head groups to SDPA: compare with plain math
        scores = (q @ k.transpose(2, 3)) * scale
        ref = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v
        ref = ref.transpose(1, 2)
    out = gqa_decode.gqa_decode_attention(q, k, v, keep, scale)
    assert out.shape == ref.shape == (batch, 1, heads, (dim_v or dim))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    torch.testing.assert_close(gqa_decode.gqa_decode_attention(q, k, v, additive, scale), ref, rtol=1e-5, atol=1e-5)
    # one mask row for every row; no mask: every position
    torch.testing.assert_close(
        gqa_decode.gqa_decode_attention(q, k, v, keep[:1], scale),
        gqa_decode.gqa_decode_attention(q, k, v, keep[:1].expand_as(keep), scale),
    )
    everything = torch.ones_like(keep)
    torch.testing.assert_close(
        gqa_decode.gqa_decode_attention(q, k, v, None, scale),
        gqa_decode.gqa_decode_attention(q, k, v, everything, scale),
        rtol=1e-6,
        atol=1e-6,
    )


def test_unsupported_shapes_and_the_switch(monkeypatch):
    from hf_zero3.kernels import gqa_decode

    q, k, v, keep = _case(0, 2, 8, 2, 16, 10)
    assert not gqa_decode.supports(q.expand(2, 8, 3, 16), k, v, keep)  # a prompt, not one token
    assert not gqa_decode.supports(q, k, v, keep.expand(2, 8, 1, 10))  # a mask per head
    assert not gqa_decode.supports(q[:, :7], k, v, keep)  # heads not a multiple of key/value heads
    monkeypatch.setitem(gqa_decode._state, "interpret", False)
    assert not gqa_decode.supports(q, k, v, keep)  # CPU tensors, a kernel built for the GPU


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_a_decode_step_through_the_kernel_matches_its_own_attention(family):
    """A real Llama (GQA) or Phi-3 (one query head per key/value head, as Phi-3-mini) with
    transformers' StaticCache: the decode step's logits through the kernel, registered as
    transformers attention (with the mask transformers builds for that cache: left padding,
    unfilled positions), equal the model's own."""
    from transformers import StaticCache

    from hf_zero3.decode import gqa_attention
    from hf_zero3.testing import models

    config = models.tiny_llama_config() if family == "llama" else models.tiny_phi3_config(num_key_value_heads=4)
    model = models.plain_model(config)
    assert gqa_attention.applies(model)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    logits = {}
    for name in (None, gqa_attention.KERNEL):
        cache = StaticCache(config=model.config, max_cache_len=80)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **hf_up.cache_arguments(cache), use_cache=True)
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            positions = (step_mask.cumsum(-1) - 1)[:, -1:]
            with gqa_attention.use(model, name):
                out = model(
                    input_ids=torch.tensor([[11], [12]]),
                    attention_mask=step_mask,
                    position_ids=positions,
                    **hf_up.cache_arguments(cache),
                    use_cache=True,
                )
        logits[name] = out.logits
    torch.testing.assert_close(logits[gqa_attention.KERNEL], logits[None], rtol=1e-5, atol=1e-5)


def test_the_kernel_is_chosen_where_it_has_a_program_per_sm(monkeypatch):
    """The kernel pays where it has at least one program per SM (batch 64: 512 programs on a
    132-SM H200); below that (batch 8: 64 programs) the PyTorch form is used."""
    from hf_zero3.decode import gqa_attention
    from hf_zero3.kernels import gqa_decode
    from hf_zero3.testing import models

    monkeypatch.setitem(gqa_decode._state, "min_programs", 132)
    assert not gqa_decode.pays(8, 8) and gqa_decode.pays(64, 8)
    model = models.plain_model(models.tiny_llama_config())
    for kernel in ("auto", "always", "off"):  # the kernel is for CUDA
        assert gqa_attention.choice(model, "cpu", 64, kernel) == gqa_attention.NAME
    mha = models.plain_model(models.tiny_llama_config(num_key_value_heads=4))
    assert gqa_attention.choice(mha, "cpu", 64) is None  # one head per group, no kernel: the model's own


def test_masks_and_dtypes_it_does_not_take():
    from hf_zero3.kernels import gqa_decode

    q, k, v, keep = _case(1, 2, 8, 2, 16, 10)
    assert not gqa_decode.supports(q, k, v, keep[..., :9])  # shorter than the cache
    assert not gqa_decode.supports(q, k, v, keep.expand(2, 1, 1, 10).repeat(2, 1, 1, 1))  # another batch
    assert not gqa_decode.supports(q, k.double(), v, keep)  # key/value in another dtype than the query


def _rope_case(seed, batch, heads, kv, dim, length, pos, cos_rows=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(batch, kv, dim, generator=g)
    v = torch.randn(batch, kv, dim, generator=g)
    angles = torch.rand(cos_rows or batch, dim // 2, generator=g) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # rotate-half layout
    kc = torch.randn(batch, kv, length, dim, generator=g)
    vc = torch.randn(batch, kv, length, dim, generator=g)
    keep = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    for i in range(batch):
        keep[i, ..., min(2 * i, pos) : pos + 1] = True  # left padding; causal: nothing after the new token
    return q, k, v, cos, sin, kc, vc, keep


@pytest.mark.parametrize(
    "batch,heads,kv,dim,length,pos,cos_rows",
    [
        (3, 8, 2, 16, 70, 37, None),  # the new token inside the first block, a block after it unread
        (2, 12, 4, 64, 200, 130, None),  # three blocks before it
        (2, 6, 3, 20, 40, 0, None),  # the first token: only itself (a head dim no power of two)
        (2, 8, 2, 32, 90, 64, 1),  # one cos/sin row for every row, the token at a block's start
    ],
)
def test_rope_kernel_equals_rotary_cache_write_and_attention(batch, heads, kv, dim, length, pos, cos_rows):
    """One kernel = transformers' rotate-half rotary embedding of the query and the new key, the
    static cache's index_copy at its fill count, and the grouped-heads attention over the cache."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_zero3.decode.gqa_attention import attention
    from hf_zero3.kernels import gqa_decode

    q, k, v, cos, sin, kc, vc, keep = _rope_case(batch * 7 + pos, batch, heads, kv, dim, length, pos, cos_rows)
    qr, kr = apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos[:, None], sin[:, None])
    ref_k, ref_v = kc.clone(), vc.clone()
    at = torch.tensor([pos])
    ref_k.index_copy_(2, at, kr)
    ref_v.index_copy_(2, at, v[:, :, None])
    ref, _ = attention(None, qr, ref_k, ref_v, keep, scaling=dim**-0.5)
    # the loop's 2-D padding mask (int64, over the whole cache, ones after the prompt): the kernel
    # reads no position after the new token, so it is the causal mask too
    padding = torch.ones(batch, length, dtype=torch.long)
    for i in range(batch):
        padding[i, : min(2 * i, pos)] = 0
    for mask in (keep, torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min), padding):
        got_k, got_v = kc.clone(), vc.clone()
        counter = torch.tensor(pos)  # a StaticLayer's fill count: 0-dim int64
        out = gqa_decode.rope_decode_attention(q, k, v, cos, sin, got_k, got_v, counter, mask, dim**-0.5)
        assert out.shape == (batch, 1, heads, dim) and int(counter) == pos  # the caller advances it
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, ref_k, rtol=1e-6, atol=1e-6)  # the rotated key at pos, the rest kept
        assert torch.equal(got_v, ref_v)
    # whatever a masked (padding) position of the cache holds never reaches the output
    poisoned_k, poisoned_v = kc.clone(), vc.clone()
    for i in range(batch):
        poisoned_k[i, :, : min(2 * i, pos)] = float("nan")
        poisoned_v[i, :, : min(2 * i, pos)] = float("inf")
    out = gqa_decode.rope_decode_attention(
        q, k, v, cos, sin, poisoned_k, poisoned_v, torch.tensor(pos), padding, dim**-0.5
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if pos == 0 or cos_rows:
        return
    # no mask: every position up to the new token's (the unfilled rest is never read)
    unpadded = torch.zeros_like(keep)
    unpadded[..., : pos + 1] = True
    ref_all, _ = attention(None, qr, ref_k, ref_v, unpadded, scaling=dim**-0.5)
    out = gqa_decode.rope_decode_attention(
        q, k, v, cos, sin, kc.clone(), vc.clone(), torch.tensor(pos), None, dim**-0.5
    )
    torch.testing.assert_close(out, ref_all, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "batch,heads,kv,dim,length,pos",
    [(3, 8, 2, 16, 70, 37), (2, 12, 4, 64, 200, 130), (2, 6, 3, 20, 40, 0), (2, 8, 2, 32, 90, 64)],
)
def test_rope_kernel_in_a_dependent_launchs_order_gives_the_same_results(batch, heads, kv, dim, length, pos):
    """A dependent launch's order (``EARLY``: the first cache block loaded before the wait, the new
    token's cache write last) computes what the plain order does, bit for bit, under every mask
    kind (the interpreter runs it without the wait itself)."""
    from hf_zero3.kernels import gqa_decode

    q, k, v, cos, sin, kc, vc, keep = _rope_case(batch * 11 + pos, batch, heads, kv, dim, length, pos, None)
    padding = torch.ones(batch, length, dtype=torch.long)
    for i in range(batch):
        padding[i, : min(2 * i, pos)] = 0
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    run = gqa_decode._state["rope_run"]
    for mask, kind in ((keep, 1), (additive, 2), (padding[:, None, None, :], 1), (keep, 0)):
        outs = []
        for early in (False, True):
            got_k, got_v = kc.clone(), vc.clone()
            out = run(q, k, v, cos, sin, got_k, got_v, torch.tensor([pos]), mask, kind, dim**-0.5, EARLY=early)
            outs.append((out, got_k, got_v))
        for plain, early in zip(*outs):
            assert torch.equal(plain, early)


@pytest.mark.parametrize("split", [2, 4])
def test_rope_kernel_sums_float32_partials_of_its_projections(split):
    """Query, key and value given as a split-K GEMM's float32 partial sums (split, rows, heads, dim):
    the kernel's output and cache write equal those of the summed projections."""
    from hf_zero3.kernels import gqa_decode

    batch, heads, kv, dim, length, pos = 3, 8, 2, 16, 70, 37
    q, k, v, cos, sin, kc, vc, keep = _rope_case(11, batch, heads, kv, dim, length, pos)
    g = torch.Generator().manual_seed(split)

    def partials(t):
        parts = torch.randn(split, *t.shape, generator=g)
        parts[-1] = t - parts[:-1].sum(0)
        return parts

    qp, kp, vp = partials(q), partials(k), partials(v)
    want_k, want_v = kc.clone(), vc.clone()
    want = gqa_decode.rope_decode_attention(
        qp.sum(0), kp.sum(0), vp.sum(0), cos, sin, want_k, want_v, torch.tensor(pos), keep, dim**-0.5
    )
    got_k, got_v = kc.clone(), vc.clone()
    got = gqa_decode.rope_decode_attention(qp, kp, vp, cos, sin, got_k, got_v, torch.tensor(pos), keep, dim**-0.5)
    assert got.dtype == kc.dtype and got.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-5)


def test_llama_decode_steps_with_qkv_partials_match_the_fused_projection(monkeypatch):
    """A two-layer Llama whose fused q/k/v projection runs through the split-K GEMM, its float32
    partials summed inside the rope kernel (the decode loop's ``qkv`` op): the same logits and cache
    as the fused projection's own GEMM feeding the same kernel, and the kernel really received
    partials; the same again with each decoder layer through one compiled layer
    (``compile_layers``), where every layer must read its own fused weight (a lookup of it inside
    the trace was resolved once, for the first layer). In float32 (the interpreter's bf16 dot is
    not exact; the GPU runs bf16): the test widens the dtypes the partials take, which on a GPU are
    half precision only."""
    from transformers import StaticCache

    from hf_zero3.decode import compiled, fused_qkv, gqa_attention, layer_compile
    from hf_zero3.kernels import decode_gemm, gqa_decode
    from hf_zero3.testing import models

    cfg = models.tiny_llama_config(
        attn_implementation="sdpa",
        hidden_size=1024,
        intermediate_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
    )
    model = models.plain_model(cfg)
    monkeypatch.setattr(fused_qkv, "PARTIAL_DTYPES", (torch.float32,))
    names = gqa_attention.rope_plan(model, gqa_attention.KERNEL)
    fused = fused_qkv.Fused(fused_qkv.plan(model))
    assert fused.bind(model) == 2
    split_op = decode_gemm.load()[2]  # the plain launch of the split-K kernel (dependent ones need a GPU)
    seen, real = [], gqa_decode.rope_decode_attention
    monkeypatch.setattr(gqa_decode, "rope_decode_attention", lambda *a, **k: seen.append(a[0].dim()) or real(*a, **k))
    ids, mask = torch.tensor([[0, 5, 6, 7], [3, 4, 5, 6]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    # Dynamo alone: the lookup the layers must not share is resolved while tracing
    layer_fn = torch.compile(compiled._layer_call, fullgraph=True, backend="eager")

    def traceable_split(rows, w, split):  # the split-K op's partials in torch (the interpreter's op is not traceable)
        k = rows.shape[-1] // split
        return torch.stack([rows[:, i * k : (i + 1) * k] @ w[:, i * k : (i + 1) * k].T for i in range(split)])

    runs = {}
    for run, qkv in (("own", None), ("partials", split_op), ("layers", traceable_split)):
        if run == "layers":  # the counting wrapper's list would be a guard that differs between layers
            monkeypatch.setattr(gqa_decode, "rope_decode_attention", real)
        cache = StaticCache(config=model.config, max_cache_len=16)
        layers = layer_compile.Layers(layer_compile.plan(model)[0])
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **hf_up.cache_arguments(cache), use_cache=True)
            bound = gqa_attention.rope_bind(model, names, cache)
            assert run != "layers" or layers.bind(model, cache, layer_fn) == 2
            whole = torch.ones(2, 16, dtype=mask.dtype)
            whole[:, :4] = mask
            logits = []
            for n, tok in enumerate(([[11], [12]], [[13], [14]])):
                positions = (whole[:, : 5 + n].cumsum(-1) - 1)[:, -1:]
                with (
                    gqa_attention.use(model, gqa_attention.KERNEL),
                    fused.use(),
                    gqa_attention.rope_use(bound, whole, qkv=qkv),
                    layers.use(),
                ):
                    logits.append(
                        model(
                            input_ids=torch.tensor(tok),
                            attention_mask=whole,
                            position_ids=positions,
                            **hf_up.cache_arguments(cache),
                            use_cache=True,
                        ).logits.float()
                    )
                gqa_attention.advance(bound, cache)
        assert layers.failed is None, layers.failed
        runs[run] = (logits, [t.float().clone() for layer in cache.layers for t in (layer.keys, layer.values)])
        assert gqa_attention._STEP["qkv"] is None  # reset after the step
    # per step and layer: the projections' outputs, then partials (split, rows, heads, dim)
    assert seen == [3] * 4 + [4] * 4, seen
    own_logits, own_cache = runs["own"]
    for run in ("partials", "layers"):
        logits, cache = runs[run]
        for a, b in zip(logits, own_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=run)
        for a, b in zip(cache, own_cache):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=run)
    monkeypatch.setattr(fused_qkv, "PARTIAL_DTYPES", (torch.float16, torch.bfloat16))
    # float32 weights outside the test's widening: the projections' own GEMM
    slot = fused_qkv.slot_of(model.model.layers[0].self_attn)
    assert fused_qkv.partials(slot, torch.ones(2, 1, 1024), split_op, 2) is None
    fused.free()


def test_llama_decode_steps_with_the_rope_kernel_match_its_own_attention(monkeypatch):
    """A real Llama with transformers' StaticCache: two decode steps through the modules' one-kernel
    decode forward (the fill counts advanced once per step, after the forward), reading
    transformers' mask or the loop's 2-D padding mask with the rotary rows made buffers, give the
    logits, the cache contents and the fill counts of the model's own steps."""
    from transformers import StaticCache

    from hf_zero3.decode import gqa_attention
    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config(attn_implementation="sdpa"))
    names = gqa_attention.rope_plan(model, gqa_attention.KERNEL)
    assert len(names) == model.config.num_hidden_layers
    assert gqa_attention.rope_plan(model, gqa_attention.NAME) == ()  # only with the kernel
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    rotaries = gqa_attention.rope_rotaries(model)
    assert len(rotaries) == 1  # the model's one rotary embedding
    from hf_zero3.kernels import gqa_decode

    masks, real = [], gqa_decode.rope_decode_attention  # the mask each kernel call reads
    monkeypatch.setattr(gqa_decode, "rope_decode_attention", lambda *a, **k: masks.append(a[8].dim()) or real(*a, **k))
    runs = {}
    # unfused; fused reading transformers' mask; fused reading the loop's 2-D padding mask over the
    # whole cache (as the static loop passes it) with the rotary rows made one buffer each
    for case in ("own", "fused", "padding"):
        cache = StaticCache(config=model.config, max_cache_len=80)
        logits, step_mask = [], mask
        whole = torch.ones(2, 80, dtype=mask.dtype)
        whole[:, : mask.shape[1]] = mask
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **hf_up.cache_arguments(cache), use_cache=True)
            bound = gqa_attention.rope_bind(model, names, cache) if case != "own" else []
            assert len(bound) == (len(names) if case != "own" else 0)
            extra = dict(padding_mask=whole, rotaries=rotaries) if case == "padding" else {}
            for tok in ([[11], [12]], [[13], [14]]):
                step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
                positions = (step_mask.cumsum(-1) - 1)[:, -1:]
                with gqa_attention.use(model, gqa_attention.KERNEL), gqa_attention.rope_use(bound, **extra):
                    out = model(
                        input_ids=torch.tensor(tok),
                        attention_mask=whole if extra else step_mask,
                        position_ids=positions,
                        **hf_up.cache_arguments(cache),
                        use_cache=True,
                    )
                gqa_attention.advance(bound, cache)
                logits.append(out.logits)
        assert all("forward" not in vars(m) for m in bound + rotaries)  # unpatched after the step
        assert gqa_attention._STEP["padding"] is None
        assert masks == {"own": [], "fused": [4] * 2 * len(names), "padding": [2] * 2 * len(names)}[case]
        masks.clear()
        runs[case] = (
            logits,
            [(layer.keys.clone(), layer.values.clone(), int(layer.cumulative_length)) for layer in cache.layers],
        )
    for case in ("fused", "padding"):
        for a, b in zip(runs[case][0], runs["own"][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for (k1, v1, n1), (k2, v2, n2) in zip(runs[case][1], runs["own"][1]):
            assert n1 == n2 == 8
            torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)

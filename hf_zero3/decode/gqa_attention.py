"""Attention for one decode token of a grouped-query model, reading the KV cache once.

Under ``torch.compile`` transformers' SDPA and eager attention repeat a GQA model's key/value heads
to the number of query heads (``repeat_kv``) before attending: with a static cache every decode
step writes and then reads ``num_key_value_groups`` copies of the whole cache, a large share of a
compiled decode step's time (see the ablations in benchmarks/HISTORY.md).
This function is transformers' eager attention (matmul, float32 softmax, matmul) with the query
heads grouped under their key/value head instead, so the cache is read once and nothing is
copied. Its numerics are eager's (scores in the model's dtype, softmax in float32), also for
SDPA models, whose SDPA kernels keep scores in float32: in bf16 the two differ within bf16
tolerance (the GPU test's teacher-forced logits), in float32 they agree (CPU tests).
hf_zero3's static loop uses it for its decode steps only (one query token), on models that take
their attention from transformers' attention interface; the prompt's forward and every other
shape keep the model's own attention (SDPA for any other shape). On CUDA with Triton the same
attention runs as one kernel per layer (:mod:`hf_zero3.kernels.gqa_decode`: ``KERNEL``, float32
scores as flash attention keeps them, the unfilled tail of the cache not read); elsewhere, or with
``DecodeOptions(triton_attention="off")``, or where the kernel has fewer programs than the GPU has SMs
(batch x key/value heads: it is slower there), as the PyTorch form above (``NAME``).
A model with one query head per key/value head (Phi-3) takes the kernel only, which reads the
cache's filled positions where SDPA reads the static cache's whole length (:func:`multi_head`).
:func:`choice` picks one when a decode loop is built. Where it picks the kernel, Llama attention
modules also move their rotary embedding and cache write into it (:func:`rope_plan`, below).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from transformers.cache_utils import StaticLayer
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from .._upstream import torch as torch_up
from .._upstream import transformers as hf_up
from ..kernels import decode_gemm, gqa_decode
from . import families, fused_qkv

NAME = "hf_zero3_gqa_decode"
KERNEL = gqa_decode.NAME
_REPLACES = ("sdpa", "eager")  # implementations whose decode step this computes the same way
_REGISTERED = False


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """``query`` (batch, heads, 1, dim), ``key``/``value`` (batch, kv_heads, length, dim); returns
    (batch, 1, heads, dim) as transformers' attention functions do, and no weights."""
    b, h, q, d = query.shape
    kv = key.shape[1]
    if q != 1 or kv == h or h % kv or dropout or kwargs.get("softcap") is not None:
        return hf_up.sdpa_attention()(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scores = torch.matmul(query.reshape(b, kv, h // kv, d), key.transpose(2, 3))  # (b, kv, groups, length)
    scores = scores * (scaling if scaling is not None else d**-0.5)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]  # (b, 1, 1, length): every head's the same
        if mask.shape[1] != 1:
            mask = mask.reshape(b, kv, h // kv, -1)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).reshape(b, 1, h, value.shape[-1]), None


def kernel_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """:func:`attention` as one Triton kernel where :func:`gqa_decode.supports` the shapes (the
    PyTorch form otherwise)."""
    if dropout or kwargs.get("softcap") is not None or not gqa_decode.supports(query, key, value, attention_mask):
        return attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return gqa_decode.gqa_decode_attention(query, key, value, attention_mask, scale), None


def applies(model) -> bool:
    """A model that looks its attention up by name, with SDPA or eager attention, one config,
    whole groups of query heads per key/value head (one each included: :func:`multi_head`), and
    plain softmax attention: no logit soft-capping (Gemma 2/3) and no attention sinks (gpt-oss),
    which transformers' own functions compute and this one does not."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hf_up.supports_attention_backend(model) or getattr(cfg, "sub_configs", None):
        return False
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return False
    if any(torch_up.module_has(m, "sinks") for m in model.modules()):
        return False
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    return (
        hf_up.attention_implementation(cfg) in _REPLACES
        and isinstance(heads, int)
        and isinstance(kv, int)
        and 0 < kv <= heads
        and heads % kv == 0
    )


def multi_head(model) -> bool:
    """One query head per key/value head (Phi-3, GPT-2-style MHA): nothing to repeat, so the
    PyTorch form has nothing over SDPA; the kernel still pays, reading only the cache's filled
    positions where SDPA reads the static cache's whole length."""
    cfg = model.config
    return cfg.num_key_value_heads == cfg.num_attention_heads


def choice(model, device, rows: int, kernel: str = "auto", eager: bool = False) -> str | None:
    """The decode attention a loop of ``rows`` on ``device`` uses: ``KERNEL`` (CUDA, Triton, and
    ``kernel`` is ``"always"``, or ``"auto"`` where it is the faster form: :func:`gqa_decode.pays`
    for a compiled step; for an ``eager`` step, whose PyTorch form is some twenty unfused
    kernels a layer, at any size),
    ``NAME``, or None (the model's own: :func:`applies` is False, or a :func:`multi_head` model
    where the kernel does not run). ``kernel``: :attr:`~hf_zero3.options.DecodeOptions.triton_attention`."""
    if not applies(model):
        return None
    if (
        kernel != "off"
        and torch.device(device).type == "cuda"
        and gqa_decode.is_available()
        and gqa_decode.load() is not None
        and (kernel == "always" or eager or gqa_decode.pays(rows, model.config.num_key_value_heads))
    ):
        return KERNEL  # built here, outside the compiled step's trace
    return None if multi_head(model) else NAME


@contextlib.contextmanager
def use(model, name: str | None = NAME):
    """Inside: ``model`` attends with ``name`` (:func:`attention` or :func:`kernel_attention`;
    None: its own attention)."""
    global _REGISTERED
    if name is None:
        yield
        return
    if not _REGISTERED:
        hf_up.register_attention(NAME, attention)
        hf_up.register_attention(KERNEL, kernel_attention)
        _REGISTERED = True
    with hf_up.attention_implementation_set(model.config, name):
        yield


# -- the rotary embedding and the cache write inside the kernel ------------------------------------
# Where the Triton kernel attends, a decode step of a Llama attention module is otherwise four more
# small kernels per layer under torch.compile (the query's rotary embedding with the mask, the
# key's with its cache write, the value's cache write, the cache's fill-count add), each paying its
# own launch gap for a few microseconds of work (see the ablations in benchmarks/HISTORY.md). Here the
# module's decode forward runs its q/k/v projections and then one kernel
# (:func:`gqa_decode.rope_decode_attention`) that rotates the query and the new key, writes the key
# and the value at the cache's fill count and attends; the loop advances every such layer's fill
# count in one op after the step's forward (:func:`advance`), as ``StaticLayer.update`` would have
# one by one. On by default; ``DecodeOptions(fuse_rope=False)`` turns it off (decided when a
# decode loop is built; :func:`rope_plan` says why it pays).

# What the one kernel reads besides the layer's own tensors, the same for every layer of a step.
# Under torch.compile inductor inlines a cheap pointwise producer into each consumer, and a
# Triton kernel's input is a buffer: the causal mask transformers builds from the padding mask and
# the rotary embedding's cos and sin rows were built again for every layer (three kernels a layer
# in a profiler trace). So the kernel reads the loop's own 2-D
# padding mask in place (a step's input: nothing to build; the kernel never reads past the new
# token, so the causal part needs no mask), and cos/sin leave the rotary embedding through an
# opaque op (their own buffers, once per step).
_ROPE_FORWARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # attention module -> its decode forward
_ROTARY_FORWARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # rotary embedding -> its decode forward
# inside rope_use: the loop's 2-D padding mask, its launch kind, the q/k/v split-K op (rope_qkv)
_STEP: dict = {"padding": None, "dependent": False, "qkv": None}


@torch.library.custom_op("hf_zero3::decode_rotary_rows", mutates_args=())
def _rotary_rows(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's cos and sin as buffers of their own: an op inductor cannot inline, so
    every layer's kernel reads the step's one copy instead of a copy built for it."""
    return cos.clone(), sin.clone()


@_rotary_rows.register_fake
def _(cos, sin):
    return torch.empty_like(cos), torch.empty_like(sin)


def _llama_rotary_forwards() -> tuple:
    """The rotary embeddings whose output :func:`rope_use` routes through :func:`_rotary_rows`."""
    return (LlamaRotaryEmbedding.forward,)


def _rope_module(m, forwards: tuple) -> bool:
    """``m`` runs an attention forward :func:`_rope_forward` computes (transformers' Llama
    attention: query/key/value projections, rotate-half rotary embedding, a cache update, the
    attention interface without extra arguments, ``o_proj``; a subclass that keeps it), as the
    source checked (``forwards``: :func:`.families.rope_forwards`'s, resolved once for a pass over
    the model), with the shapes the kernel takes."""
    if type(m).forward not in forwards or not torch_up.runs_class_forward(m):
        return False
    projs = [getattr(m, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if any(not isinstance(p, torch.nn.Linear) for p in projs) or not isinstance(getattr(m, "layer_idx", None), int):
        return False
    d = getattr(m, "head_dim", None)
    q, k, v = projs[:3]
    return (
        isinstance(d, int)
        and d % 2 == 0
        and q.out_features % d == 0
        and k.out_features % d == 0
        and v.out_features == k.out_features
        and (q.out_features // d) % (k.out_features // d) == 0
        and q.out_features > k.out_features
    )


def rope_qkv(device, dependent: bool):
    """The split-K op a decode step's fused q/k/v projection runs through where it feeds the rope
    kernel (which sums the float32 partials itself), or None: only with dependent launches
    (:attr:`~hf_zero3.options.DecodeOptions.triton_qkv` decides whether the loop asks). cuBLAS, which computes
    the projection otherwise, launches no kernel as a programmatic dependent launch, so the two
    boundaries norm -> q/k/v -> attention were the two per layer a kernel could not start early."""
    if not dependent:
        return None
    ops = decode_gemm.load_dependent(device)
    return ops[1] if ops is not None else None


def rope_plan(model, attention: str | None) -> tuple[str, ...]:
    """Names of ``model``'s attention modules whose decode steps rotate, write the cache and attend
    in one kernel: where the loop attends with the kernel (``attention`` is :data:`KERNEL`). A
    decode step then runs four kernels fewer per layer (the rotary embedding, the cache writes and
    the fill-count add move into the attention kernel; see the ablations in
    benchmarks/HISTORY.md). It pays only because the kernel's inputs are read in place: the loop's
    padding mask, one cos/sin buffer a step and the fused q/k/v projection's parts; had inductor
    built the mask, cos and sin and the projection's copies in front of it (six kernels a layer),
    the saving would be lost."""
    if attention != KERNEL:
        return ()
    forwards = families.rope_forwards()
    return tuple(name for name, m in model.named_modules() if _rope_module(m, forwards))


def rope_bind(model, names: tuple[str, ...], cache) -> list:
    """The named modules (:func:`rope_plan`) that still apply to this call's ``cache`` (after its
    prompt's forward: a static layer allocates its tensors at its first update), once per call."""
    bound = []
    layers = getattr(cache, "layers", ())
    forwards = families.rope_forwards()
    for _, m in torch_up.named_submodules(model, names):
        if not _rope_module(m, forwards) or m.layer_idx >= len(layers):
            continue
        layer = layers[m.layer_idx]
        if type(layer) is not StaticLayer or not getattr(layer, "is_initialized", False):
            continue
        w = m.q_proj.weight
        if layer.keys.dtype == w.dtype and layer.values.dtype == w.dtype and layer.keys.device == w.device:
            bound.append(m)
    return bound


def rope_rotaries(model) -> list:
    """``model``'s Llama rotary embeddings (their decode output made a buffer by :func:`rope_use`)."""
    forwards = _llama_rotary_forwards()
    return [m for m in model.modules() if type(m).forward in forwards and torch_up.runs_class_forward(m)]


def _plain_causal(config) -> bool:
    """A model whose decode mask is causal plus padding (no sliding window, no other layer kinds):
    the one kernel may read the loop's padding mask in its place."""
    kinds = getattr(config, "layer_types", None) or ()
    return not getattr(config, "sliding_window", None) and all(k == "full_attention" for k in kinds)


def _padding_fits(mask, b: int, length: int) -> bool:
    return (
        mask.dim() == 2
        and mask.shape[0] in (1, b)
        and mask.shape[1] >= length
        and mask.stride(-1) == 1
        and (mask.dtype == torch.bool or not mask.dtype.is_floating_point)
    )


def _rope_fits(m, hidden, cos, sin, layer, mask) -> bool:
    """The step's tensors are what :func:`gqa_decode.rope_decode_attention` computes: one token,
    the cache's dtype (no autocast), one (batch or 1, 1, head dim) cos/sin row per row, whole groups
    of query heads per cache head, head dims up to 256, :func:`gqa_decode.supports`' masks or a 2-D
    padding mask, a device Triton runs on. Shapes, dtypes and strides only: facts a trace
    specializes on."""
    b, d = hidden.shape[0], m.head_dim
    keys, values = layer.keys, layer.values
    if hidden.dim() != 3 or hidden.shape[1] != 1 or hidden.dtype != keys.dtype or values.dtype != keys.dtype:
        return False
    if keys.dtype not in (torch.float16, torch.bfloat16, torch.float32) or torch.is_autocast_enabled(
        hidden.device.type
    ):
        return False
    if not (hidden.is_cuda or gqa_decode.runs_on_cpu()):
        return False
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, b) or tuple(cos.shape[1:]) != (1, d):
        return False
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.dtype != sin.dtype:
        return False
    heads, kv = m.q_proj.out_features // d, keys.shape[1]
    if (
        keys.shape[0] != b
        or keys.shape[-1] != d
        or m.k_proj.out_features != kv * d
        or heads % kv
        or d > 256
        or values.shape[:2] != keys.shape[:2]
        or m.v_proj.out_features != kv * values.shape[-1]
        or values.shape[-1] > 256
    ):
        return False
    return (
        mask is None
        or _padding_fits(mask, b, keys.shape[-2])
        or (
            mask.dim() == 4
            and mask.shape[1] == 1
            and mask.shape[2] == 1
            and mask.shape[-1] >= keys.shape[-2]
            and mask.shape[0] in (1, b)
        )
    )


def _rope_forward(module):
    ref = weakref.ref(module)  # kept per module in a weak dictionary: must not hold its key
    own = type(module).forward
    key = hf_up.cache_keyword()  # read here, outside the compiled step's trace
    slot = fused_qkv.slot_of(module)  # likewise: a lookup inside the trace is resolved once for every layer

    def forward(hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        m = ref()
        # the cache: the 4th parameter of every checked release; the decoder layer passes it by keyword
        cache = args[0] if args else kwargs.pop(key, None)
        layers = getattr(cache, "layers", None)
        layer = layers[m.layer_idx] if layers is not None and m.layer_idx < len(layers) else None
        mask = attention_mask
        padding = _STEP["padding"]
        if (
            padding is not None
            and layer is not None
            and _plain_causal(m.config)
            and _padding_fits(padding, hidden_states.shape[0], layer.keys.shape[-2])
        ):
            mask = padding  # what transformers' mask was built from, read in place
        if (
            layer is None
            or position_embeddings is None
            or kwargs.get("output_attentions")
            or not _rope_fits(m, hidden_states, *position_embeddings, layer, mask)
        ):
            out = own(m, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
            if layer is not None and hidden_states.shape[1] == 1:
                layer.cumulative_length.sub_(1)  # the loop's advance() counts this layer's step
            return out
        b, d = hidden_states.shape[0], m.head_dim
        op = _STEP["qkv"]
        split = decode_gemm.split_for(hidden_states.shape[-1]) if op is not None else 1
        parts = fused_qkv.partials(slot, hidden_states, op, split) if split > 1 else None
        if parts is not None:  # float32 partial sums (split, rows, features), summed by the kernel
            q, k = (p.view(split, b, -1, d) for p in parts[:2])
            v = parts[2].view(split, b, k.shape[2], -1)
        else:
            q = m.q_proj(hidden_states).view(b, -1, d)
            k = m.k_proj(hidden_states).view(b, -1, d)
            v = m.v_proj(hidden_states).view(b, k.shape[1], -1)
        cos, sin = position_embeddings
        out = gqa_decode.rope_decode_attention(
            q,
            k,
            v,
            cos.view(cos.shape[0], d),
            sin.view(sin.shape[0], d),
            layer.keys,
            layer.values,
            layer.cumulative_length,
            mask,
            m.scaling,
            dependent=_STEP["dependent"],
        )
        return m.o_proj(out.reshape(b, 1, -1)), None

    return forward


def _rotary_forward(module):
    ref = weakref.ref(module)
    own = type(module).forward

    def forward(x, position_ids, *args, **kwargs):
        return _rotary_rows(*own(ref(), x, position_ids, *args, **kwargs))

    return forward


@contextlib.contextmanager
def rope_use(
    modules: list, padding_mask: torch.Tensor | None = None, rotaries: list = (), dependent: bool = False, qkv=None
):
    """Inside: ``modules`` (:func:`rope_bind`) run their decode forward through the one kernel;
    the caller calls :func:`advance` after the step's forward. ``padding_mask``: the step's 2-D
    attention mask over the whole cache (the static loop's), which the kernel then reads instead
    of transformers' causal mask; ``rotaries`` (:func:`rope_rotaries`): rotary embeddings whose
    cos/sin become one buffer each per step. Both only where ``modules`` is not empty.
    ``dependent``: the kernel is a programmatic dependent launch (the loop planned it); ``qkv``
    (:func:`rope_qkv`'s op): the fused q/k/v projection (:mod:`.fused_qkv`, bound this call)
    runs through it and the kernel sums its float32 partials."""
    made = [(m, _ROPE_FORWARDS, _rope_forward) for m in modules]
    made += [(r, _ROTARY_FORWARDS, _rotary_forward) for r in rotaries] if modules else []
    try:
        with torch_up.instance_forwards(
            (m, forwards.get(m) or forwards.setdefault(m, make(m))) for m, forwards, make in made
        ):
            if modules:
                _STEP["padding"], _STEP["dependent"], _STEP["qkv"] = padding_mask, dependent, qkv
            yield
    finally:
        _STEP["padding"], _STEP["dependent"], _STEP["qkv"] = None, False, None


def advance(modules: list, cache) -> None:
    """After a decode step's forward: the fill count of every layer ``modules`` wrote, one op."""
    if modules:
        torch_up.add_one_to_each([cache.layers[m.layer_idx].cumulative_length for m in modules])

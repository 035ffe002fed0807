"""One Triton kernel for a grouped-query model's decode-step attention over a static KV cache.

The PyTorch form in :mod:`hf_zero3.decode.gqa_attention` is three kernels per layer under
``torch.compile`` (the score GEMM, the masked softmax, the value GEMM) and reads every cache
position, also those a static cache has not filled yet. This kernel is one
launch per layer: a program per (row, key/value head) holds that head's group of query heads,
walks the cache in blocks with an online softmax (scores and softmax in float32, as flash
attention computes them), and skips the blocks its boolean mask has no position in (the unfilled
tail of a static cache, left padding). Its programs do not split the cache, so it is used only
where there are at least as many (row, key/value head) programs as the GPU has SMs: with fewer
the GPU is underused and the PyTorch form is faster (``benchmarks/generation/bench_decode.py``;
see the ablations in benchmarks/HISTORY.md): :func:`pays`.

:func:`rope_decode_attention` is the same attention with the layer's rotary embedding and its cache
write inside (the query and the new key rotated in registers, the key and value stored at the
cache's fill count, the new token's own score from registers, the positions before it from the
cache): the decode steps of Llama attention modules take it where the kernel attends
(:mod:`hf_zero3.decode.gqa_attention`), instead of four small kernels per layer beside it.

Loaded lazily (the kernels, in :mod:`.gqa_decode_triton`, import Triton): :func:`is_available` is
False without Triton or without ``torch.library.triton_op`` (torch < 2.6); the caller then keeps
the PyTorch form. Registered as the custom ops
``hf_zero3::gqa_decode_attention`` and ``hf_zero3::gqa_decode_rope_attention`` (which mutates the
two cache tensors) through ``torch.library.triton_op``, so ``torch.compile``
(``fullgraph=True``) traces it and CUDA graphs capture it. The decode loop's
``triton_attention`` option picks it: ``auto`` (default, where :func:`pays`), ``always``, ``off``.
:func:`load` builds it outside any trace (the decode loop calls it when it picks the kernel). On
CPU it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` when it is built), which the
CPU tests use.
"""

from __future__ import annotations

import torch

from . import triton_launch

NAME = "hf_zero3_gqa_decode_triton"
BLOCK_S = 64  # cache positions per block
LAUNCH = dict(BLOCK=BLOCK_S, num_warps=4, num_stages=2)  # both kernels' launch settings
_state: dict = {}


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return _state.get("error") or triton_launch.missing()


def is_available() -> bool:
    return unavailable_reason() is None


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask) -> bool:
    """The shapes the kernel computes: one query token, whole groups of query heads per key/value
    head, head dims up to 256, a mask of one head (or none), on a device Triton runs on."""
    b, h, q, d = query.shape
    kv = key.shape[1]
    if q != 1 or h % kv or d > 256 or value.shape[-1] > 256 or key.shape[0] != b:
        return False
    if attention_mask is not None and (
        attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or attention_mask.shape[2] != 1
        or attention_mask.shape[-1] < key.shape[-2]
        or attention_mask.shape[0] not in (1, b)
    ):
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return query.is_cuda or runs_on_cpu()


def runs_on_cpu() -> bool:
    """The kernels were built under Triton's interpreter (then they run on CPU tensors too)."""
    return _state.get("interpret", False)


def pays(rows: int, kv_heads: int) -> bool:
    """Whether the kernel is the faster form for ``rows`` x ``kv_heads`` programs: at least one per SM."""
    return rows * kv_heads >= _state.get("min_programs", 0)


def load():
    """Build the kernel and its op, once, outside any ``torch.compile`` trace (Dynamo does not
    trace Triton's decorators). Returns the op, or None with :func:`unavailable_reason` set."""
    if "op" not in _state:
        reason = unavailable_reason()
        if reason is None:
            try:
                _state["interpret"] = triton_launch.interpreted()
                _state["op"] = _build()
                if torch.cuda.is_available() and not _state["interpret"]:
                    _state["min_programs"] = torch.cuda.get_device_properties(
                        torch.cuda.current_device()
                    ).multi_processor_count
            except Exception as exc:  # a Triton that does not build here
                _state["error"] = f"building the Triton kernel failed: {type(exc).__name__}: {exc}"
        if "op" not in _state:
            return None
    return _state["op"]


def _build():
    """Register the ops over the kernels, imported here (they need Triton, which may be missing)."""
    from . import gqa_decode_triton as k  # optional: triton (the kernels import it)

    # the raw kernels, as the ahead-of-time compile test takes them
    _state["jit"] = {"attention": k.attention_kernel, "rope": k.rope_attention_kernel}
    _state["launch"] = {name: triton_launch.launcher(kernel) for name, kernel in _state["jit"].items()}
    rope = triton_launch.op("hf_zero3::gqa_decode_rope_attention", ("key_cache", "value_cache"), _rope_out)
    _state["rope_op"], _state["rope_run"] = rope(_rope_body(_plain)), _rope_run  # rope_run: the probe's launch settings
    if not triton_launch.interpreted():
        dependent = torch.library.custom_op(
            "hf_zero3::gqa_decode_rope_attention_dependent", mutates_args=("key_cache", "value_cache")
        )(_rope_body(_dependent))
        dependent.register_fake(_rope_out)
        _state["rope_dependent_op"] = dependent
    return triton_launch.op("hf_zero3::gqa_decode_attention", (), _out_like)(_attention)


def _meta(heads: int, dtype, key_heads: int, d: int, dv: int, launch: dict) -> dict:
    """Both kernels' constexprs and launch settings: a program holds a whole group of query heads,
    tiles of at least 16 (what ``tl.dot`` takes), ``launch`` over :data:`LAUNCH`."""
    import triton  # optional: triton

    group = heads // key_heads
    return dict(
        KV=key_heads,
        G=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        DV=dv,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        **{**LAUNCH, **launch},
    )


def _launch(name: str, args: tuple, query, key, value, mask, mask_kind: int, out, dtype, launch: dict, **constexprs):
    """Launch kernel ``name`` into ``out`` (rows, 1, heads, value dim), one program per (row,
    key/value head): ``args``, the kernel's own leading arguments, then what both kernels take last:
    the strides of the key and value caches, of the mask (0 between rows where one mask row serves
    every row) and of the output, and the constexprs (``dtype``: the one the dots compute in)."""
    b, _, h, dv = out.shape
    kv = key.shape[1]
    mb = mask.stride(0) if mask.shape[0] == b else 0
    _state["launch"][name][(b * kv,)](
        *args,
        *key.stride()[:3],
        *value.stride()[:3],
        mb,
        mask.stride(3),
        out.stride(0),
        out.stride(2),
        L=key.shape[2],
        MASK=mask_kind,
        **constexprs,
        **_meta(h, dtype, kv, query.shape[-1], dv, launch),
    )
    return out


def _parts(t) -> tuple:
    """(partial stride, row stride, head stride) of a (rows, heads, dim) or (split, ...) input."""
    return (t.stride(0) if t.dim() == 4 else 0, t.stride(-3), t.stride(-2))


def _out_like(query, key, value, mask, mask_kind, scale):
    return query.new_empty(query.shape[0], 1, query.shape[1], value.shape[-1])


def _attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, mask_kind: int, scale: float
) -> torch.Tensor:
    """The body of ``hf_zero3::gqa_decode_attention``."""
    out = torch.empty(query.shape[0], 1, query.shape[1], value.shape[-1], dtype=query.dtype, device=query.device)
    args = (query, key, value, mask, out, scale, query.stride(0), query.stride(1))
    return _launch("attention", args, query, key, value, mask, mask_kind, out, query.dtype, {})


def _rope_out(query, key, value, cos, sin, key_cache, value_cache, position, mask, mask_kind, scale):
    return value_cache.new_empty(query.shape[-3], 1, query.shape[-2], value_cache.shape[-1])


def _rope_run(query, key, value, cos, sin, key_cache, value_cache, position, mask, mask_kind, scale, **launch):
    """Launch the rope kernel; ``launch``: settings over :data:`LAUNCH` and the kernel's ``PDL`` and
    ``EARLY`` (by default a dependent launch's order where ``PDL``; see the kernel)."""
    launch = {"PDL": False, **launch}
    launch.setdefault("EARLY", launch["PDL"])
    b, h = query.shape[-3:-1]
    out = torch.empty(b, 1, h, value_cache.shape[-1], dtype=value_cache.dtype, device=query.device)
    args = (query, key, value, cos, sin, key_cache, value_cache, position, mask, out, scale)
    args += (*_parts(query), *_parts(key), *_parts(value))
    args += (cos.stride(0) if cos.shape[0] == b else 0, sin.stride(0) if sin.shape[0] == b else 0)
    split = query.shape[0] if query.dim() == 4 else 1
    return _launch(
        "rope", args, query, key_cache, value_cache, mask, mask_kind, out, key_cache.dtype, launch, SPLIT=split
    )


def _rope_body(settings):
    """The body of a rope op, launched with ``settings(query, key_cache)``: one signature for both
    ops, from which ``torch.library`` reads their schema."""

    def body(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        key_cache: torch.Tensor, value_cache: torch.Tensor, position: torch.Tensor, mask: torch.Tensor,
        mask_kind: int, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        launch = settings(query, key_cache)
        return _rope_run(
            query, key, value, cos, sin, key_cache, value_cache, position, mask, mask_kind, scale, **launch
        )

    return body


def _plain(query, key_cache) -> dict:
    """``hf_zero3::gqa_decode_rope_attention``'s launch: :data:`LAUNCH`, the plain order."""
    return {}


def _dependent(query, key_cache) -> dict:
    """``hf_zero3::gqa_decode_rope_attention_dependent``'s launch: a programmatic dependent launch,
    which the op launches itself (inductor's call of a ``triton_op`` kernel takes no launch
    attributes); a CUDA graph captures it as any kernel."""
    return dict(PDL=True, launch_pdl=True, **_one_wave(query.shape[-3] * key_cache.shape[1], query.device))


def _inputs(query, key, value, attention_mask, length: int) -> tuple:
    """What both ops take: the three tensors with unit last strides, the mask over ``length`` cache
    positions and its kind (0 none, 1 boolean, 2 additive)."""
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if attention_mask is None:
        return query, key, value, query.new_ones(1, 1, 1, 1, dtype=torch.bool).expand(1, 1, 1, length), 0
    mask = attention_mask[..., :length]
    return query, key, value, mask, 1 if mask.dtype == torch.bool else 2


def gqa_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling: float
) -> torch.Tensor:
    """``query`` (batch, heads, 1, dim), ``key``/``value`` (batch, kv_heads, length, dim), a
    (batch or 1, 1, 1, >= length) mask (boolean: True attends; else additive) or None; returns
    (batch, 1, heads, value dim) like transformers' attention functions. Check :func:`supports`
    first."""
    op = _state["op"] if "op" in _state else load()
    length = key.shape[-2]
    query, key, value, mask, kind = _inputs(query, key, value, attention_mask, length)
    return op(query, key, value, mask, kind, float(scaling))


def _one_wave(programs: int, device) -> dict:
    """A dependent launch's warps: 2 where the 4-warp programs (register-heavy: only two fit an SM)
    would take a second wave, as at batch 64 with 8 key/value heads (512 programs); otherwise 4.
    One wave keeps every program resident when the kernel before it finishes, which is what a
    dependent launch gains from (see the ablations in benchmarks/HISTORY.md)."""
    sms = _state.get(("sms", str(device)))
    if sms is None:
        sms = _state[("sms", str(device))] = torch.cuda.get_device_properties(device).multi_processor_count
    return {"num_warps": 2} if programs > 2 * sms else {}


def rope_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    position: torch.Tensor,
    attention_mask,
    scaling: float,
    dependent: bool = False,
) -> torch.Tensor:
    """One decode token's attention with its rotary embedding and its cache write in the same
    kernel: ``query`` (batch, heads, dim) and the new ``key`` (batch, kv_heads, dim) before the
    rotary embedding (``cos``/``sin``: (batch or 1, dim), transformers' rotate-half form), the new
    ``value``; writes the rotated key and the value at cache position ``position`` (a one-element
    integer tensor: a static cache's fill count before this token) into ``key_cache`` /
    ``value_cache`` (batch, kv_heads, length, dim) and attends over the positions before it and
    itself, under ``attention_mask`` as :func:`gqa_decode_attention`, or a 2-D (batch or 1,
    >= length) padding mask (integer or boolean, nonzero attends; this kernel reads no position
    after the new token, so that is the causal mask too). Returns (batch, 1, heads, value dim). The
    caller advances the fill count and checks the shapes
    (``hf_zero3.decode.gqa_attention._rope_fits``: one token, whole head groups, an even
    head dim up to 256, :func:`supports`' masks or a padding mask). ``dependent``: launched as a
    programmatic dependent launch (where
    :func:`hf_zero3.kernels.decode_gemm.dependent_unavailable` says it can be: the decode loop's
    ``dependent_launches`` option). It then reads ``position`` and the cache positions before it ahead of its
    wait for the kernel before it, so that kernel must write neither (the decode loop advances the
    fill counts between steps; the query, key and value may come from it).

    ``query``, ``key`` and ``value`` may also be float32 partial sums of their projection, one more
    leading dimension (split, batch, heads, dim), as a split-K GEMM leaves them
    (:func:`hf_zero3.kernels.decode_gemm.linear_split`): the kernel sums them and rounds the sums to
    the cache's dtype, where the projection would have rounded its output, so the decode step
    needs no kernel of its own for that sum."""
    if "rope_op" not in _state:
        load()
    length = key_cache.shape[-2]
    padding = attention_mask is not None and attention_mask.dim() == 2
    query, key, value, mask, kind = _inputs(query, key, value, None if padding else attention_mask, length)
    if padding:  # read in place as (rows, 1, 1, length), attending where nonzero
        mask, kind = attention_mask[:, None, None, :length], 1
    op = _state.get("rope_dependent_op", _state["rope_op"]) if dependent else _state["rope_op"]
    return op(query, key, value, cos, sin, key_cache, value_cache, position.view(1), mask, kind, float(scaling))

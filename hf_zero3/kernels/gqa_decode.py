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
see the ablations in benchmarks/RESULTS.md): :func:`pays`.

:func:`rope_decode_attention` is the same attention with the layer's rotary embedding and its cache
write inside (the query and the new key rotated in registers, the key and value stored at the
cache's fill count, the new token's own score from registers, the positions before it from the
cache): the decode steps of Llama attention modules take it where the kernel attends
(:mod:`hf_zero3.decode.gqa_attention`), instead of four small kernels per layer beside it.

Loaded lazily: :func:`is_available` is False without Triton or without ``torch.library.triton_op``
(torch < 2.6); the caller then keeps the PyTorch form. Registered as the custom ops
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

from . import _triton

__all__ = [
    "NAME",
    "is_available",
    "runs_on_cpu",
    "unavailable_reason",
    "load",
    "supports",
    "pays",
    "gqa_decode_attention",
    "rope_decode_attention",
]

NAME = "hf_zero3_gqa_decode_triton"
BLOCK_S = 64  # cache positions per block
LAUNCH = dict(BLOCK=BLOCK_S, num_warps=4, num_stages=2)  # both kernels' launch settings
_state: dict = {}


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return _state.get("error") or _triton.missing()


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
                _state["interpret"] = _triton.interpreted()
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
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        Q,
        K,
        V,
        M,
        O,
        scale,
        sqb,
        sqh,
        skb,
        skh,
        sks,
        svb,
        svh,
        svs,
        smb,
        sms,
        sob,
        soh,
        L: tl.constexpr,
        KV: tl.constexpr,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK: tl.constexpr,
        MASK: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // KV
        head = pid % KV
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        rows = g < G
        q = tl.load(
            Q + b * sqb + (head * G + g)[:, None] * sqh + dd[None, :], mask=rows[:, None] & (dd[None, :] < D), other=0.0
        )
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        for start in range(0, L, BLOCK):
            s = start + tl.arange(0, BLOCK)
            inside = s < L
            if MASK == 1:  # boolean: True where the query attends
                valid = inside & (tl.load(M + b * smb + s * sms, mask=inside, other=0) != 0)
                bias = tl.zeros([BLOCK], tl.float32)
            elif MASK == 2:  # additive
                valid = inside
                bias = tl.load(M + b * smb + s * sms, mask=inside, other=0.0).to(tl.float32)
            else:
                valid = inside
                bias = tl.zeros([BLOCK], tl.float32)
            if tl.max(valid.to(tl.int32), axis=0) > 0:  # a block with no position to attend is not read
                k = tl.load(
                    K + b * skb + head * skh + s[:, None] * sks + dd[None, :],
                    mask=valid[:, None] & (dd[None, :] < D),
                    other=0.0,
                )
                # float32 whatever the scale arrives as (inductor passes a Python float as fp64)
                qk = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale).to(tl.float32) + bias[None, :]
                qk = tl.where(valid[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                p = tl.exp(qk - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(
                    V + b * svb + head * svh + s[:, None] * svs + dv[None, :],
                    mask=valid[:, None] & (dv[None, :] < DV),
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            O + b * sob + (head * G + g)[:, None] * soh + dv[None, :],
            out.to(O.dtype.element_ty),
            mask=rows[:, None] & (dv[None, :] < DV),
        )

    @triton.jit
    def rope_kernel(
        Q,
        KN,
        VN,
        COS,
        SIN,
        KC,
        VC,
        P,
        M,
        O,
        scale,
        sqp,
        sqb,
        sqh,
        sknp,
        sknb,
        sknh,
        svnp,
        svnb,
        svnh,
        scb,
        ssb,
        skb,
        skh,
        sks,
        svb,
        svh,
        svs,
        smb,
        sms,
        sob,
        soh,
        L: tl.constexpr,
        KV: tl.constexpr,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK: tl.constexpr,
        MASK: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
        SPLIT: tl.constexpr,
        EARLY: tl.constexpr,
    ):
        # SPLIT > 1: the query, key and value arrive as SPLIT float32 partial sums of their projection
        # (a split-K GEMM's, strides sqp/sknp/svnp apart); summed here and rounded to the cache's
        # dtype, as the projection would have returned them. Inlined sums, no helper: inductor
        # embeds a triton_op kernel with the helpers it finds in its module, not in this closure
        pid = tl.program_id(0)
        b = pid // KV
        head = pid % KV
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        rows = g < G
        in_d = dd < D
        in_dv = dv < DV
        # EARLY (a dependent launch's order, run by the CPU tests without one): the first cache
        # block's keys and values (and the fill count) load before the wait of a dependent launch:
        # no kernel of this step writes them (the positions before the fill count were written by
        # this layer's earlier steps, the count is advanced between steps), so they load while the
        # kernel before (the q/k/v projection) still runs; the new token's cache write then comes
        # last (a store before would order every cache load after it). Otherwise the order a plain
        # launch runs faster with: write, then the loop from the first block (ablations: benchmarks/RESULTS.md)
        pos = tl.load(P)  # the cache's fill count before this step: the new token's cache position
        if EARLY:
            s0 = tl.arange(0, BLOCK)
            in0 = s0 < tl.minimum(pos, L)
            kc0 = tl.load(
                KC + b * skb + head * skh + s0[:, None] * sks + dd[None, :],
                mask=in0[:, None] & in_d[None, :],
                other=0.0,
            )
            vc0 = tl.load(
                VC + b * svb + head * svh + s0[:, None] * svs + dv[None, :],
                mask=in0[:, None] & in_dv[None, :],
                other=0.0,
            )
        if PDL:  # a programmatic dependent launch: wait for the kernel before, release the one after
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # rotate_half: the first half takes minus the second half's value, the second the first's
        partner = tl.where(dd < D // 2, dd + D // 2, dd - D // 2)
        sign = tl.where(dd < D // 2, -1.0, 1.0)
        cos = tl.load(COS + b * scb + dd, mask=in_d, other=0.0).to(tl.float32)
        sin = tl.load(SIN + b * ssb + dd, mask=in_d, other=0.0).to(tl.float32)
        k = tl.zeros([BLOCK_D], tl.float32)
        kp = tl.zeros([BLOCK_D], tl.float32)
        v_new = tl.zeros([BLOCK_DV], tl.float32)
        qmask = rows[:, None] & in_d[None, :]
        qrow = Q + b * sqb + (head * G + g)[:, None] * sqh
        q = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        qp = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for i in tl.static_range(SPLIT):
            k += tl.load(KN + i * sknp + b * sknb + head * sknh + dd, mask=in_d, other=0.0).to(tl.float32)
            kp += tl.load(KN + i * sknp + b * sknb + head * sknh + partner, mask=in_d, other=0.0).to(tl.float32)
            v_new += tl.load(VN + i * svnp + b * svnb + head * svnh + dv, mask=in_dv, other=0.0).to(tl.float32)
            q += tl.load(qrow + i * sqp + dd[None, :], mask=qmask, other=0.0).to(tl.float32)
            qp += tl.load(qrow + i * sqp + partner[None, :], mask=qmask, other=0.0).to(tl.float32)
        if MASK == 1:
            own = tl.load(M + b * smb + pos * sms) != 0
        else:
            own = pos >= 0
        k = k.to(KC.dtype.element_ty).to(tl.float32)
        kp = kp.to(KC.dtype.element_ty).to(tl.float32)
        v_new = v_new.to(VC.dtype.element_ty).to(tl.float32)
        k_new = (k * cos + sign * kp * sin).to(KC.dtype.element_ty)  # rounded as the cache stores it
        if not EARLY:
            tl.store(KC + b * skb + head * skh + pos * sks + dd, k_new, mask=in_d)
            tl.store(VC + b * svb + head * svh + pos * svs + dv, v_new.to(VC.dtype.element_ty), mask=in_dv)
        q = q.to(KC.dtype.element_ty).to(tl.float32)
        qp = qp.to(KC.dtype.element_ty).to(tl.float32)
        q = (q * cos[None, :] + sign[None, :] * qp * sin[None, :]).to(KC.dtype.element_ty)
        # the new token's own score from registers (its cache row is written at the end)
        # float32 whatever the scale arrives as (inductor's fp64 would make the loop's state fp64)
        s_new = (tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale).to(tl.float32)
        if MASK == 2:
            s_new = s_new + tl.load(M + b * smb + pos * sms).to(tl.float32)
        m_i = tl.where(own, s_new, float("-inf"))
        l_i = tl.where(own, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
        acc = tl.where(own, 1.0, 0.0) * v_new.to(tl.float32)[None, :] + tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        if EARLY:  # the first block, loaded above (nothing of it attended where the cache is empty)
            if MASK == 2:
                bias0 = tl.load(M + b * smb + s0 * sms, mask=in0, other=0.0).to(tl.float32)
            else:
                bias0 = tl.zeros([BLOCK], tl.float32)
            if MASK == 1:
                valid0 = in0 & (tl.load(M + b * smb + s0 * sms, mask=in0, other=0) != 0)
            else:
                valid0 = in0
            qk = (tl.dot(q, tl.trans(kc0), input_precision=PRECISION) * scale).to(tl.float32) + bias0[None, :]
            qk = tl.where(valid0[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to attend yet
            p = tl.exp(qk - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vc0 = tl.where(valid0[:, None], vc0, tl.zeros_like(vc0))  # a masked position's value never enters
            acc = acc * alpha[:, None] + tl.dot(p.to(vc0.dtype), vc0, input_precision=PRECISION)
            m_i = m_new
        # the (other) positions filled before this step, block by block up to the fill count (a loop
        # bound read at run time: the unfilled tail is neither read nor computed). Every load of a
        # block (mask, keys, values) waits only for the fill count, none for another, and no branch
        # stands between blocks: the loads of a block are in flight together and the next block's
        # while this one is computed (the loop is software-pipelined)
        for start in range(BLOCK if EARLY else 0, tl.minimum(pos, L), BLOCK):
            s = start + tl.arange(0, BLOCK)
            inside = s < pos
            if MASK == 1:
                valid = inside & (tl.load(M + b * smb + s * sms, mask=inside, other=0) != 0)
                bias = tl.zeros([BLOCK], tl.float32)
            elif MASK == 2:
                valid = inside
                bias = tl.load(M + b * smb + s * sms, mask=inside, other=0.0).to(tl.float32)
            else:
                valid = inside
                bias = tl.zeros([BLOCK], tl.float32)
            kc = tl.load(
                KC + b * skb + head * skh + s[:, None] * sks + dd[None, :],
                mask=inside[:, None] & in_d[None, :],
                other=0.0,
            )
            vc = tl.load(
                VC + b * svb + head * svh + s[:, None] * svs + dv[None, :],
                mask=inside[:, None] & in_dv[None, :],
                other=0.0,
            )
            qk = (tl.dot(q, tl.trans(kc), input_precision=PRECISION) * scale).to(tl.float32) + bias[None, :]
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to attend yet
            p = tl.exp(qk - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vc = tl.where(valid[:, None], vc, tl.zeros_like(vc))  # a masked position's value never enters
            acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc, input_precision=PRECISION)
            m_i = m_new
        if EARLY:
            tl.store(KC + b * skb + head * skh + pos * sks + dd, k_new, mask=in_d)
            tl.store(VC + b * svb + head * svh + pos * svs + dv, v_new.to(VC.dtype.element_ty), mask=in_dv)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            O + b * sob + (head * G + g)[:, None] * soh + dv[None, :],
            out.to(O.dtype.element_ty),
            mask=rows[:, None] & in_dv[None, :],
        )

    launch = _triton.launcher(kernel)
    launch_rope = _triton.launcher(rope_kernel)

    def meta(heads, dtype, key_heads, d, dv, launch):
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

    def rope_out(query, key, value, cos, sin, key_cache, value_cache, position, mask, mask_kind, scale):
        return value_cache.new_empty(query.shape[-3], 1, query.shape[-2], value_cache.shape[-1])

    def parts(t):  # (partial stride, row stride, head stride) of a (rows, heads, dim) or (split, ...) input
        return (t.stride(0) if t.dim() == 4 else 0, t.stride(-3), t.stride(-2))

    def rope_run(query, key, value, cos, sin, key_cache, value_cache, position, mask, mask_kind, scale, **launch):
        launch = {"PDL": False, **launch}
        launch.setdefault("EARLY", launch["PDL"])  # a dependent launch's order (see the kernel)
        b, h, d = query.shape[-3:]
        kv, length = key_cache.shape[1], key_cache.shape[2]
        dv = value_cache.shape[-1]
        out = torch.empty(b, 1, h, dv, dtype=value_cache.dtype, device=query.device)
        mb = mask.stride(0) if mask.shape[0] == b else 0
        launch_rope[(b * kv,)](
            query,
            key,
            value,
            cos,
            sin,
            key_cache,
            value_cache,
            position,
            mask,
            out,
            scale,
            *parts(query),
            *parts(key),
            *parts(value),
            cos.stride(0) if cos.shape[0] == b else 0,
            sin.stride(0) if sin.shape[0] == b else 0,
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            mb,
            mask.stride(3),
            out.stride(0),
            out.stride(2),
            L=length,
            MASK=mask_kind,
            SPLIT=query.shape[0] if query.dim() == 4 else 1,
            **meta(h, key_cache.dtype, kv, d, dv, launch),
        )
        return out

    @_triton.op("hf_zero3::gqa_decode_rope_attention", ("key_cache", "value_cache"), rope_out)
    def rope_op(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        position: torch.Tensor,
        mask: torch.Tensor,
        mask_kind: int,
        scale: float,
    ) -> torch.Tensor:
        return rope_run(query, key, value, cos, sin, key_cache, value_cache, position, mask, mask_kind, scale)

    _state["rope_op"], _state["rope_run"] = rope_op, rope_run  # rope_run: the probe's launch settings
    if not _triton.interpreted():

        @torch.library.custom_op(
            "hf_zero3::gqa_decode_rope_attention_dependent", mutates_args=("key_cache", "value_cache")
        )
        def rope_dependent(
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            cos: torch.Tensor,
            sin: torch.Tensor,
            key_cache: torch.Tensor,
            value_cache: torch.Tensor,
            position: torch.Tensor,
            mask: torch.Tensor,
            mask_kind: int,
            scale: float,
        ) -> torch.Tensor:
            # launched here, not through inductor's call of a triton_op kernel (which takes no
            # launch attributes); a CUDA graph captures it as any kernel
            return rope_run(
                query,
                key,
                value,
                cos,
                sin,
                key_cache,
                value_cache,
                position,
                mask,
                mask_kind,
                scale,
                PDL=True,
                launch_pdl=True,
                **_one_wave(query.shape[-3] * key_cache.shape[1], query.device),
            )

        rope_dependent.register_fake(rope_out)
        _state["rope_dependent_op"] = rope_dependent
    _state["jit"] = {"attention": kernel, "rope": rope_kernel}  # the raw kernels (ahead-of-time compile test)

    def out_like(query, key, value, mask, mask_kind, scale):
        return query.new_empty(query.shape[0], 1, query.shape[1], value.shape[-1])

    @_triton.op("hf_zero3::gqa_decode_attention", (), out_like)
    def op(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, mask_kind: int, scale: float
    ) -> torch.Tensor:
        b, h, _, d = query.shape
        kv, length = key.shape[1], key.shape[2]
        dv = value.shape[-1]
        out = torch.empty(b, 1, h, dv, dtype=query.dtype, device=query.device)
        mb = mask.stride(0) if mask.shape[0] == b else 0  # a mask of one row serves every row
        launch[(b * kv,)](
            query,
            key,
            value,
            mask,
            out,
            scale,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            key.stride(2),
            value.stride(0),
            value.stride(1),
            value.stride(2),
            mb,
            mask.stride(3),
            out.stride(0),
            out.stride(2),
            L=length,
            MASK=mask_kind,
            **meta(h, query.dtype, kv, d, dv, {}),
        )
        return out

    return op


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
    dependent launch gains from (see the ablations in benchmarks/RESULTS.md)."""
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

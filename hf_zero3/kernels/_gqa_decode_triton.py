"""The Triton kernels of :mod:`.gqa_decode` (imported only when it builds them).

At module level, not in a function: inside ``torch.compile`` inductor re-emits a ``triton_op``
kernel with the Triton functions it calls that it finds among the kernel's module globals."""

import triton
import triton.language as tl


@triton.jit
def attention_kernel(
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
def rope_attention_kernel(
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
    # dtype, as the projection would have returned them
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

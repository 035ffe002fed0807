"""The Triton kernels of :mod:`.gqa_decode` (imported only when it builds them), and the pieces
both share: a program per (row, key/value head) holding that head's group of query heads, a cache
block's mask, the online softmax over a block, the output's store.

At module level, not in a function: inside ``torch.compile`` inductor re-emits a ``triton_op``
kernel with the Triton functions it calls that it finds among the kernel's module globals. The
kernels' parameters stand in groups, a line each (``# fmt: skip`` keeps them so): pointers, the
inputs' strides, those of the caches, mask and output, constexprs."""

import triton
import triton.language as tl

from .triton_common import dependent_start


@triton.jit
def program_heads(KV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """This program's row and key/value head, and the offsets of its query heads within their
    group, of a key's dims and of a value's."""
    pid = tl.program_id(0)
    return pid // KV, pid % KV, tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)


@triton.jit
def block_mask(M, s, inside, sms, MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Which of cache positions ``s`` (those ``inside``) the query attends, and their additive bias,
    from this row's mask ``M`` of kind ``MASK``: 1 boolean (True where the query attends), 2
    additive, 0 none."""
    if MASK == 1:
        valid = inside & (tl.load(M + s * sms, mask=inside, other=0) != 0)
        bias = tl.zeros([BLOCK], tl.float32)
    elif MASK == 2:
        valid = inside
        bias = tl.load(M + s * sms, mask=inside, other=0.0).to(tl.float32)
    else:
        valid = inside
        bias = tl.zeros([BLOCK], tl.float32)
    return valid, bias


@triton.jit
def cache_block(C, s, stride, cols, rows_in, cols_in):
    """Positions ``s`` of one head's cache (``C``: its position 0), columns ``cols``; zero where a
    position is not in or a column (``cols_in``: a row of flags) is not."""
    return tl.load(C + s[:, None] * stride + cols[None, :], mask=rows_in[:, None] & cols_in, other=0.0)


@triton.jit
def online_softmax(q, k, bias, valid, m_i, l_i, scale, PRECISION: tl.constexpr, EMPTY: tl.constexpr):
    """One block of the online softmax: the scores of ``q`` against the block's keys ``k``, masked
    and biased, the weights ``p`` and ``alpha`` (what rescales the blocks before), the new running
    max and sum. ``EMPTY``: a row may have had nothing to attend so far and have nothing in this
    block (its max still -inf), whose weights are then zeros rather than NaN (a kernel that reads
    no block without a position to attend needs no such guard)."""
    # float32 whatever the scale arrives as (inductor passes a Python float as fp64)
    qk = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale).to(tl.float32) + bias[None, :]
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    if EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp(qk - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def store_heads(O, acc, l_i, heads, soh, dv, rows, cols_in):
    """The output of this program's query ``heads`` (``O``: its row; ``cols_in`` as
    :func:`cache_block`'s): the weighted values over the softmax's sum (a head that attended
    nothing: zeros)."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + heads[:, None] * soh + dv[None, :], out.to(O.dtype.element_ty), mask=rows[:, None] & cols_in)


@triton.jit
def attention_kernel(
    Q, K, V, M, O, scale,
    sqb, sqh,
    skb, skh, sks, svb, svh, svs, smb, sms, sob, soh,
    L: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Decode attention over the cache's ``L`` positions, block by block (the online softmax); a
    block the mask attends none of is not read."""
    b, head, g, dd, dv = program_heads(KV, BLOCK_G, BLOCK_D, BLOCK_DV)
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
        valid, bias = block_mask(M + b * smb, s, inside, sms, MASK, BLOCK)
        if tl.max(valid.to(tl.int32), axis=0) > 0:  # a block with no position to attend is not read
            k = cache_block(K + b * skb + head * skh, s, sks, dd, valid, dd[None, :] < D)
            p, alpha, m_new, l_i = online_softmax(q, k, bias, valid, m_i, l_i, scale, PRECISION, False)
            v = cache_block(V + b * svb + head * svh, s, svs, dv, valid, dv[None, :] < DV)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    store_heads(O + b * sob, acc, l_i, head * G + g, soh, dv, rows, dv[None, :] < DV)


@triton.jit
def rotate_half(x, partner, cos, sin, sign, dtype: tl.constexpr):
    """transformers' rotary embedding (rotate-half form) of ``x``, ``partner`` its rotate-half
    partner's values, both float32 sums rounded to ``dtype`` first (as the projection would have
    returned them); rounded to ``dtype``, as the cache stores it."""
    x = x.to(dtype).to(tl.float32)
    partner = partner.to(dtype).to(tl.float32)
    return (x * cos + sign * partner * sin).to(dtype)


@triton.jit
def write_token(kc, vc, pos, sks, svs, dd, dv, k_new, v_new, in_d, in_dv):
    """The new token's rotated key and its value into its head's caches (``kc``/``vc``: position 0)
    at ``pos``."""
    tl.store(kc + pos * sks + dd, k_new, mask=in_d)
    tl.store(vc + pos * svs + dv, v_new.to(vc.dtype.element_ty), mask=in_dv)


@triton.jit
def attend(q, kc, vc, bias, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One cache block into the rope kernel's online softmax. Its keys and values load under the
    fill count alone, so a masked position's value is zeroed here: whatever it holds (a NaN in
    padding) never enters."""
    p, alpha, m_new, l_i = online_softmax(q, kc, bias, valid, m_i, l_i, scale, PRECISION, True)
    vc = tl.where(valid[:, None], vc, tl.zeros_like(vc))
    acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def rope_attention_kernel(
    Q, KN, VN, COS, SIN, KC, VC, P, M, O, scale,
    sqp, sqb, sqh, sknp, sknb, sknh, svnp, svnb, svnh, scb, ssb,
    skb, skh, sks, svb, svh, svs, smb, sms, sob, soh,
    L: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr, SPLIT: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """:func:`.gqa_decode.rope_decode_attention`'s kernel: the new token's rotary embedding and cache
    write, its own score from registers, then the cache's positions before it."""
    # SPLIT > 1: the query, key and value arrive as SPLIT float32 partial sums of their projection
    # (a split-K GEMM's, strides sqp/sknp/svnp apart); summed here and rounded to the cache's
    # dtype, as the projection would have returned them
    b, head, g, dd, dv = program_heads(KV, BLOCK_G, BLOCK_D, BLOCK_DV)
    rows = g < G
    in_d = dd < D
    in_dv = dv < DV
    # EARLY (a dependent launch's order, run by the CPU tests without one): the first cache
    # block's keys and values (and the fill count) load before the wait of a dependent launch:
    # no kernel of this step writes them (the positions before the fill count were written by
    # this layer's earlier steps, the count is advanced between steps), so they load while the
    # kernel before (the q/k/v projection) still runs; the new token's cache write then comes
    # last (a store before would order every cache load after it). Otherwise the order a plain
    # launch runs faster with: write, then the loop from the first block (ablations: benchmarks/HISTORY.md)
    pos = tl.load(P)  # the cache's fill count before this step: the new token's cache position
    if EARLY:
        s0 = tl.arange(0, BLOCK)
        in0 = s0 < tl.minimum(pos, L)
        kc0 = cache_block(KC + b * skb + head * skh, s0, sks, dd, in0, in_d[None, :])
        vc0 = cache_block(VC + b * svb + head * svh, s0, svs, dv, in0, in_dv[None, :])
    dependent_start(PDL)
    # each dim's rotate-half partner and sign: the first half takes minus the second half's value,
    # the second the first's
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
    k_new = rotate_half(k, kp, cos, sin, sign, KC.dtype.element_ty)
    v_new = v_new.to(VC.dtype.element_ty).to(tl.float32)
    if not EARLY:
        write_token(
            KC + b * skb + head * skh, VC + b * svb + head * svh, pos, sks, svs, dd, dv, k_new, v_new, in_d, in_dv
        )
    q = rotate_half(q, qp, cos[None, :], sin[None, :], sign[None, :], KC.dtype.element_ty)
    # the new token's own score from registers (its cache row is written at the end)
    # float32 whatever the scale arrives as (inductor's fp64 would make the loop's state fp64)
    s_new = (tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale).to(tl.float32)
    if MASK == 2:
        s_new = s_new + tl.load(M + b * smb + pos * sms).to(tl.float32)
    m_i = tl.where(own, s_new, float("-inf"))
    l_i = tl.where(own, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
    acc = tl.where(own, 1.0, 0.0) * v_new.to(tl.float32)[None, :] + tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    if EARLY:  # the first block, loaded above (nothing of it attended where the cache is empty)
        valid0, bias0 = block_mask(M + b * smb, s0, in0, sms, MASK, BLOCK)
        m_i, l_i, acc = attend(q, kc0, vc0, bias0, valid0, m_i, l_i, acc, scale, PRECISION)
    # the (other) positions filled before this step, block by block up to the fill count (a loop
    # bound read at run time: the unfilled tail is neither read nor computed). Every load of a
    # block (mask, keys, values) waits only for the fill count, none for another, and no branch
    # stands between blocks: the loads of a block are in flight together and the next block's
    # while this one is computed (the loop is software-pipelined)
    for start in range(BLOCK if EARLY else 0, tl.minimum(pos, L), BLOCK):
        s = start + tl.arange(0, BLOCK)
        inside = s < pos
        valid, bias = block_mask(M + b * smb, s, inside, sms, MASK, BLOCK)
        kc = cache_block(KC + b * skb + head * skh, s, sks, dd, inside, in_d[None, :])
        vc = cache_block(VC + b * svb + head * svh, s, svs, dv, inside, in_dv[None, :])
        m_i, l_i, acc = attend(q, kc, vc, bias, valid, m_i, l_i, acc, scale, PRECISION)
    if EARLY:
        write_token(
            KC + b * skb + head * skh, VC + b * svb + head * svh, pos, sks, svs, dd, dv, k_new, v_new, in_d, in_dv
        )
    store_heads(O + b * sob, acc, l_i, head * G + g, soh, dv, rows, in_dv[None, :])

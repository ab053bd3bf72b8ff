# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA decode (and one-row-per-token prefill) over a paged FP8/BF16 MLA KV cache, in Triton.

Each query row ``t`` (a decode token, an MTP token or a prefill token) attends to the ``topk`` cache
slots its DSA indexer selected::

    s[t, h, j]  = softmax_scale * q[t, h, :576] . K[indices[t, j], :576]      (j with a valid index)
    out[t, h]   = sum_j softmax_j(s[t, h, :]) * K[indices[t, j], :512]       (V = first 512 of K)
    lse[t, h]   = log(sum_j exp(s[t, h, j]))                                 (natural log)

The KV cache is read in place, in its stored format, one token row per selected index; nothing is
cast or gathered into a temporary copy. The formats (vLLM's ``kv_cache_dtype``: ``fp8_ds_mla``
656 B/token, ``fp8``/``fp8_e4m3`` 576 B/token, ``auto``/``bfloat16``/``float16`` 1152 B/token)
and their aliases, row layouts and scale placement are defined once in ``mla_kv_format.py``.

Conventions (shared with ``docs/CONVENTIONS.md``):

* ``indices`` hold physical slots ``block * block_size + offset``. A negative index means "no
  token" (vLLM pads with -1). An index ``>= num_blocks * block_size`` is out of range: the kernel
  never dereferences it and treats it like -1 (it contributes nothing); ``validate=True`` (a debug
  check with a host sync, not for CUDA graphs) raises on it instead. FlashMLA only treats -1 as
  invalid and reads any other index unchecked.
* Duplicate indices count as many times as they appear (exactly like FlashMLA's sparse decode and
  the float64 reference: every index position is one softmax term).
* ``lse`` is the natural-log LSE that vLLM's ``merge_attn_states`` consumes. A row with no valid
  index gets ``out = 0`` and ``lse = -inf`` (never NaN). (FlashMLA's sparse decode writes
  ``lse = +inf`` for such rows in its non-split path.)
* Scales: for ``fp8`` the per-tensor ``k_scale`` is folded into the softmax scale (QK^T) and into
  the output (PV), so the e4m3 values enter the MMA unscaled (exactly representable in bf16/fp16).
  For ``fp8_ds_mla`` each 128-wide latent group is dequantized in registers (e4m3 -> fp32 x its fp32
  scale -> q's dtype) once per KV tile, and that one register tile feeds both QK^T and PV.

Work split: one program handles one query row, ``BLOCK_H`` heads (padded to the MMA minimum of 16)
and a contiguous range of the ``topk`` slots; when the grid ``T * ceil(H / BLOCK_H)`` would
underfill the GPU the slots are split across ``num_splits`` programs whose partial results are
merged by their LSE, either by a second small kernel ("separate") or by the last program of each
(row, head block) to finish ("fused": it counts arrivals in a persistent int32 buffer that it leaves
at zero, so no per-call memset is needed). ``num_splits``, the merge and every tile size are picked
from shapes and the device only, so the call is CUDA-graph capturable (no host sync, no
data-dependent allocation).

Host cost: the arguments are validated and the launch planned once per key (shapes, strides,
dtypes, devices, scalars, 16-byte pointer alignment); later calls with that key allocate the
outputs and launch the compiled kernels directly, pointers passed as integers. The environment
variable ``GLM5_SPARSE_MLA_DISPATCH_CC`` (a compute-capability major, e.g. ``12``) makes the
dispatch pick another architecture's tile configs (SM120 proxy runs on an H200).

This file imports only torch, triton and the standard library: it runs standalone (tests,
benchmarks) and inside the patched vLLM tree (``vllm/v1/attention/ops/triton_sparse_mla.py``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton import knobs as _knobs

__all__ = [
    "sparse_mla_decode",
    "sparse_mla_decode_reference",
    "SM120_COMPILE_SPECS",
]

from . import mla_kv_format as _kvf

LATENT_DIM = _kvf.LATENT_DIM  # kv_lora_rank: V width and the quantized part of K
ROPE_DIM = _kvf.ROPE_DIM  # qk_rope_head_dim
HEAD_DIM = _kvf.HEAD_DIM  # 576: K width (absorbed q width)
DS_GROUP = _kvf.DS_GROUP  # fp8_ds_mla: one fp32 scale per 128 latent values
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

# Kernel-side format codes (constexpr KV_FORMAT).
_FMT_DS_MLA = _kvf.FMT_DS_MLA
_FMT_FP8 = _kvf.FMT_FP8
_FMT_16BIT = _kvf.FMT_16BIT


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_rows(idx_row, stride_ik, tile, lim, num_slots, block_size, stride_kb, stride_ks,
               BLOCK_N: tl.constexpr):
    """Slots of one top-k tile -> (valid mask, int64 row offsets into the cache)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(idx_row + offs_n * stride_ik, mask=offs_n < lim, other=-1)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    row = blk.to(tl.int64) * stride_kb + (slot - blk * block_size).to(tl.int64) * stride_ks
    return valid, row


@triton.jit
def _load_tile(kv_ptr, row, valid, KV_FORMAT: tl.constexpr, DT: tl.constexpr):
    """Issue every global load of one KV tile (raw bytes / values; no conversion yet).

    Returns the four 128-wide latent groups, the rope part and (fp8_ds_mla) the four group scales."""
    cg = tl.arange(0, 128)
    cr = tl.arange(0, 64)
    vm = valid[:, None]
    if KV_FORMAT == 2:
        base = kv_ptr + row[:, None]
        r0 = tl.load(base + cg[None, :], mask=vm, other=0.0)
        r1 = tl.load(base + (128 + cg)[None, :], mask=vm, other=0.0)
        r2 = tl.load(base + (256 + cg)[None, :], mask=vm, other=0.0)
        r3 = tl.load(base + (384 + cg)[None, :], mask=vm, other=0.0)
        rr = tl.load(base + (512 + cr)[None, :], mask=vm, other=0.0)
    else:
        base = kv_ptr + row[:, None]
        r0 = tl.load(base + cg[None, :], mask=vm, other=0)
        r1 = tl.load(base + (128 + cg)[None, :], mask=vm, other=0)
        r2 = tl.load(base + (256 + cg)[None, :], mask=vm, other=0)
        r3 = tl.load(base + (384 + cg)[None, :], mask=vm, other=0)
        if KV_FORMAT == 0:
            rp = (kv_ptr + row + 528).to(tl.pointer_type(DT))
            rr = tl.load(rp[:, None] + cr[None, :], mask=vm, other=0.0)
        else:
            rr = tl.load(base + (512 + cr)[None, :], mask=vm, other=0)
    if KV_FORMAT == 0:
        sp = (kv_ptr + row + 512).to(tl.pointer_type(tl.float32))
        c0 = tl.load(sp, mask=valid, other=0.0)
        c1 = tl.load(sp + 1, mask=valid, other=0.0)
        c2 = tl.load(sp + 2, mask=valid, other=0.0)
        c3 = tl.load(sp + 3, mask=valid, other=0.0)
    else:
        c0 = tl.zeros([row.shape[0]], dtype=tl.float32)
        c1 = c0
        c2 = c0
        c3 = c0
    return r0, r1, r2, r3, rr, c0, c1, c2, c3


@triton.jit
def _dequant(r, c, KV_FORMAT: tl.constexpr, DS_FOLD: tl.constexpr, DT: tl.constexpr):
    """One latent group to the MMA dtype: fp8_ds_mla times its per-row scale (unless folded),
    fp8 unscaled (k_scale folded outside), 16-bit as is."""
    if KV_FORMAT == 2:
        k = r.to(DT)
    elif KV_FORMAT == 0:
        if DS_FOLD:
            k = r.to(tl.float8e4nv, bitcast=True).to(DT)
        else:
            k = (r.to(tl.float8e4nv, bitcast=True).to(tl.float32) * c[:, None]).to(DT)
    else:
        k = r.to(tl.float8e4nv, bitcast=True).to(DT)
    return k


@triton.jit
def _attend_tile(q0, q1, q2, q3, qr, r0, r1, r2, r3, rr, c0, c1, c2, c3, valid, qk_scale,
                 m_i, l_i, acc0, acc1, acc2, acc3, KV_FORMAT: tl.constexpr, DS_FOLD: tl.constexpr,
                 DT: tl.constexpr):
    """Online-softmax update of one KV tile: S = Q K^T (five MMAs), P = exp2(S - m), O += P V."""
    k0 = _dequant(r0, c0, KV_FORMAT, DS_FOLD, DT)
    k1 = _dequant(r1, c1, KV_FORMAT, DS_FOLD, DT)
    k2 = _dequant(r2, c2, KV_FORMAT, DS_FOLD, DT)
    k3 = _dequant(r3, c3, KV_FORMAT, DS_FOLD, DT)
    if KV_FORMAT == 1:
        kr = rr.to(tl.float8e4nv, bitcast=True).to(DT)
    else:
        kr = rr.to(DT)
    if DS_FOLD and KV_FORMAT == 0:
        # scales folded: the MMAs see exact e4m3 values; the per-token group scales multiply the
        # four partial QK^T products and the P used against each group.
        s = tl.dot(qr, tl.trans(kr))
        s += tl.dot(q0, tl.trans(k0)) * c0[None, :]
        s += tl.dot(q1, tl.trans(k1)) * c1[None, :]
        s += tl.dot(q2, tl.trans(k2)) * c2[None, :]
        s += tl.dot(q3, tl.trans(k3)) * c3[None, :]
    else:
        s = tl.dot(q0, tl.trans(k0))
        s = tl.dot(q1, tl.trans(k1), s)
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.dot(q3, tl.trans(k3), s)
        s = tl.dot(qr, tl.trans(kr), s)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DS_FOLD and KV_FORMAT == 0:
        acc0 = tl.dot((p * c0[None, :]).to(DT), k0, acc0 * alpha[:, None])
        acc1 = tl.dot((p * c1[None, :]).to(DT), k1, acc1 * alpha[:, None])
        acc2 = tl.dot((p * c2[None, :]).to(DT), k2, acc2 * alpha[:, None])
        acc3 = tl.dot((p * c3[None, :]).to(DT), k3, acc3 * alpha[:, None])
    else:
        pc = p.to(DT)
        acc0 = tl.dot(pc, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pc, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(pc, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(pc, k3, acc3 * alpha[:, None])
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["num_heads", "topk", "num_slots", "block_size", "num_splits", "tiles_per_split"])
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, kscale_ptr, cnt_ptr,
    qk_scale_log2,  # softmax_scale * log2(e) (times k_scale when it is a host float)
    v_scale,  # host float k_scale for fp8 (1.0 otherwise)
    num_heads, topk, num_slots, block_size,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks,
    stride_it, stride_ik,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    num_splits, tiles_per_split,
    KV_FORMAT: tl.constexpr,
    KSCALE_FROM_PTR: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    DS_FOLD: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    GROUP: tl.constexpr = 128
    ROPE: tl.constexpr = 64
    DV: tl.constexpr = 512

    n_hb = tl.cdiv(num_heads, BLOCK_H)
    pid = tl.program_id(0)
    hb = pid % n_hb
    rest = pid // n_hb
    sp = rest % num_splits
    t = rest // num_splits

    DT = q_ptr.dtype.element_ty
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < num_heads
    offs_g = tl.arange(0, GROUP)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q0 = tl.load(q_row + (0 * GROUP + offs_g)[None, :] * stride_qd, mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + (1 * GROUP + offs_g)[None, :] * stride_qd, mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_row + (2 * GROUP + offs_g)[None, :] * stride_qd, mask=hmask[:, None], other=0.0)
    q3 = tl.load(q_row + (3 * GROUP + offs_g)[None, :] * stride_qd, mask=hmask[:, None], other=0.0)
    qr = tl.load(q_row + (DV + tl.arange(0, ROPE))[None, :] * stride_qd, mask=hmask[:, None], other=0.0)

    qk_scale = qk_scale_log2
    vs = v_scale
    if KV_FORMAT == 1:
        if KSCALE_FROM_PTR:
            ks = tl.load(kscale_ptr)
            qk_scale = qk_scale * ks
            vs = ks

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, GROUP], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, GROUP], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, GROUP], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, GROUP], dtype=tl.float32)

    # This split covers tiles [tile_lo, tile_lo + tiles_per_split) of the row's top-k list; slots
    # past `lim` (the split's end or topk) read as -1.
    tile_lo = sp * tiles_per_split
    lim = tl.minimum((tile_lo + tiles_per_split) * BLOCK_N, topk)
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    if PREFETCH:
        # Software pipeline: while tile i is computed, the KV rows of tile i+1 and the indices of
        # tile i+2 are in flight (all of a tile's loads are issued together, before any barrier).
        valid, row = _tile_rows(idx_row, stride_ik, tile_lo, lim, num_slots, block_size, stride_kb, stride_ks, BLOCK_N)
        r0, r1, r2, r3, rr, c0, c1, c2, c3 = _load_tile(kv_ptr, row, valid, KV_FORMAT, DT)
        valid_n, row_n = _tile_rows(idx_row, stride_ik, tile_lo + 1, lim, num_slots, block_size, stride_kb,
                                    stride_ks, BLOCK_N)
        for i in range(0, tiles_per_split):
            n0, n1, n2, n3, nr, d0, d1, d2, d3 = _load_tile(kv_ptr, row_n, valid_n, KV_FORMAT, DT)
            valid_nn, row_nn = _tile_rows(idx_row, stride_ik, tile_lo + i + 2, lim, num_slots, block_size,
                                          stride_kb, stride_ks, BLOCK_N)
            m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
                q0, q1, q2, q3, qr, r0, r1, r2, r3, rr, c0, c1, c2, c3, valid, qk_scale,
                m_i, l_i, acc0, acc1, acc2, acc3, KV_FORMAT, DS_FOLD, DT)
            r0, r1, r2, r3, rr, c0, c1, c2, c3 = n0, n1, n2, n3, nr, d0, d1, d2, d3
            valid = valid_n
            valid_n, row_n = valid_nn, row_nn
    else:
        for i in range(0, tiles_per_split):
            valid, row = _tile_rows(idx_row, stride_ik, tile_lo + i, lim, num_slots, block_size, stride_kb,
                                    stride_ks, BLOCK_N)
            r0, r1, r2, r3, rr, c0, c1, c2, c3 = _load_tile(kv_ptr, row, valid, KV_FORMAT, DT)
            m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
                q0, q1, q2, q3, qr, r0, r1, r2, r3, rr, c0, c1, c2, c3, valid, qk_scale,
                m_i, l_i, acc0, acc1, acc2, acc3, KV_FORMAT, DS_FOLD, DT)

    has = l_i > 0.0
    inv = tl.where(has, vs / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    offs_d = tl.arange(0, GROUP)
    if SPLIT:
        # Partial results: o normalized by its own sum, fp32 [T, H, S, 512]; lse [T, H, S].
        prow = (t.to(tl.int64) * num_heads + offs_h) * num_splits + sp
        po = po_ptr + prow[:, None] * DV + offs_d[None, :]
        tl.store(po + 0 * GROUP, acc0 * inv[:, None], mask=hmask[:, None])
        tl.store(po + 1 * GROUP, acc1 * inv[:, None], mask=hmask[:, None])
        tl.store(po + 2 * GROUP, acc2 * inv[:, None], mask=hmask[:, None])
        tl.store(po + 3 * GROUP, acc3 * inv[:, None], mask=hmask[:, None])
        tl.store(plse_ptr + prow, lse, mask=hmask)
        if FUSED_MERGE:
            # Arrival count of (row t, head block hb): the program that brings it to num_splits
            # merges all partials and resets it to 0 (the buffer is zero again between calls).
            # Ordering: the CTA barrier puts every thread's partial stores before the one thread's
            # atomic, whose release (gpu scope) publishes them; the last arriver's acquire (same
            # atomic) comes before the barrier that Triton places after a scalar atomic (its
            # result is broadcast through shared memory) and so before every thread's reads of the
            # other programs' partials, which also bypass L1 (.cg).
            tl.debug_barrier()
            cnt = cnt_ptr + (t * n_hb + hb)
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                _merge_partials(po_ptr, plse_ptr, out_ptr, lse_ptr, t, offs_h, hmask, num_heads, num_splits,
                                stride_ot, stride_oh, stride_od, stride_lt, stride_lh)
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
    else:
        o_row = out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
        OT = out_ptr.dtype.element_ty
        tl.store(o_row + (0 * GROUP + offs_d)[None, :] * stride_od, (acc0 * inv[:, None]).to(OT), mask=hmask[:, None])
        tl.store(o_row + (1 * GROUP + offs_d)[None, :] * stride_od, (acc1 * inv[:, None]).to(OT), mask=hmask[:, None])
        tl.store(o_row + (2 * GROUP + offs_d)[None, :] * stride_od, (acc2 * inv[:, None]).to(OT), mask=hmask[:, None])
        tl.store(o_row + (3 * GROUP + offs_d)[None, :] * stride_od, (acc3 * inv[:, None]).to(OT), mask=hmask[:, None])
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + offs_h * stride_lh, lse, mask=hmask)


@triton.jit
def _merge_partials(po_ptr, plse_ptr, out_ptr, lse_ptr, t, offs_h, hmask, num_heads, num_splits,
                    stride_ot, stride_oh, stride_od, stride_lt, stride_lh):
    """Fused merge (the last-arriving split program of a (row, head block)): out[t, offs_h] and
    lse[t, offs_h] from the ``num_splits`` partial (o, lse) pairs, weights exp(lse_s - max)."""
    GROUP: tl.constexpr = 128
    DV: tl.constexpr = 512
    base = (t.to(tl.int64) * num_heads + offs_h) * num_splits
    m = tl.full(offs_h.shape, float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        ls = tl.load(plse_ptr + base + s, mask=hmask, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, ls)
    finite = m > float("-inf")
    m_safe = tl.where(finite, m, 0.0)
    offs_d = tl.arange(0, GROUP)
    wsum = tl.zeros(offs_h.shape, dtype=tl.float32)
    o0 = tl.zeros([offs_h.shape[0], GROUP], dtype=tl.float32)
    o1 = o0
    o2 = o0
    o3 = o0
    for s in range(0, num_splits):
        ls = tl.load(plse_ptr + base + s, mask=hmask, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(ls > float("-inf"), tl.exp(ls - m_safe), 0.0)
        wsum += w
        pp = po_ptr + (base + s)[:, None] * DV + offs_d[None, :]
        hm = hmask[:, None]
        o0 += w[:, None] * tl.load(pp + 0 * GROUP, mask=hm, other=0.0, cache_modifier=".cg")
        o1 += w[:, None] * tl.load(pp + 1 * GROUP, mask=hm, other=0.0, cache_modifier=".cg")
        o2 += w[:, None] * tl.load(pp + 2 * GROUP, mask=hm, other=0.0, cache_modifier=".cg")
        o3 += w[:, None] * tl.load(pp + 3 * GROUP, mask=hm, other=0.0, cache_modifier=".cg")
    inv = tl.where(finite, 1.0 / tl.where(finite, wsum, 1.0), 0.0)
    OT = out_ptr.dtype.element_ty
    o_row = out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
    hm = hmask[:, None]
    tl.store(o_row + (0 * GROUP + offs_d)[None, :] * stride_od, (o0 * inv[:, None]).to(OT), mask=hm)
    tl.store(o_row + (1 * GROUP + offs_d)[None, :] * stride_od, (o1 * inv[:, None]).to(OT), mask=hm)
    tl.store(o_row + (2 * GROUP + offs_d)[None, :] * stride_od, (o2 * inv[:, None]).to(OT), mask=hm)
    tl.store(o_row + (3 * GROUP + offs_d)[None, :] * stride_od, (o3 * inv[:, None]).to(OT), mask=hm)
    lse = tl.where(finite, m_safe + tl.log(tl.where(finite, wsum, 1.0)), float("-inf"))
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + offs_h * stride_lh, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _sparse_mla_merge_kernel(
    po_ptr, plse_ptr, out_ptr, lse_ptr,
    num_heads, num_splits,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge ``num_splits`` partial (o, lse) pairs of one (token, head) by their LSE.

    Program ``(t * H + h) * (512 // BLOCK_D) + d`` writes columns ``d*BLOCK_D ..`` of out[t, h]
    (and lse[t, h] when d == 0)."""
    DV: tl.constexpr = 512
    ND: tl.constexpr = DV // BLOCK_D
    pid = tl.program_id(0)
    dblk = pid % ND
    row = pid // ND
    h = row % num_heads
    t = row // num_heads
    base = row.to(tl.int64) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_splits
    lse_s = tl.load(plse_ptr + base + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    finite = m > float("-inf")
    m_safe = tl.where(finite, m, 0.0)
    w = tl.where(smask, tl.exp(lse_s - m_safe), 0.0)
    wsum = tl.sum(w, axis=0)
    wn = tl.where(finite, w / tl.where(finite, wsum, 1.0), 0.0)
    offs_d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    po = tl.load(po_ptr + (base + offs_s)[:, None] * DV + offs_d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(po * wn[:, None], axis=0)
    OT = out_ptr.dtype.element_ty
    o_row = out_ptr + t.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
    tl.store(o_row + offs_d * stride_od, o.to(OT))
    if dblk == 0:
        lse = tl.where(finite, m_safe + tl.log(tl.where(finite, wsum, 1.0)), float("-inf"))
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + h.to(tl.int64) * stride_lh, lse)


# --------------------------------------------------------------------------------------------
# Dispatch (shapes and device only: CUDA-graph safe)
# --------------------------------------------------------------------------------------------

MAX_SPLITS = 64  # the merge kernel handles up to 64 partial results per row

# Shared memory per block available on SM120/SM121 (RTX PRO 6000, RTX 5090, DGX Spark).
SM120_SHARED_LIMIT = 101376


def _raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as a raw handle (what Triton launches on)."""
    return torch._C._cuda_getCurrentRawStream(index)


@functools.lru_cache(maxsize=None)
def _device_props(index: int) -> tuple[int, int, int]:
    """(major, minor, multiprocessor count) of a CUDA device, cached (no sync after first call)."""
    p = torch.cuda.get_device_properties(index)
    return p.major, p.minor, p.multi_processor_count


def _pick_config(num_heads: int, cc_major: int, num_tokens: int = 1) -> dict:
    """Tile configuration for ``num_heads`` heads and ``num_tokens`` query rows on a device of
    compute capability major ``cc_major`` (shapes only: CUDA-graph safe).

    Returns BLOCK_H (heads per program, >= 16: the MMA minimum), BLOCK_N (KV rows per tile),
    num_warps, num_stages, PREFETCH (software-pipelined loop: tile i+1's KV loads in flight while
    tile i is computed), DS_FOLD (fp8_ds_mla scales folded into S and P instead of dequantizing K)
    and WAVES (split the top-k range until there are WAVES x SM-count programs).
    Hopper (cc 9) and datacenter Blackwell (cc 10) have ~227 KB of shared memory per block;
    everything else (SM120/SM121, SM89, SM80) is planned against SM120's 101,376 B and checked by
    tools/sm120_check.py. The SM90 choices were measured on an H200 (docs/notes/sparse_mla.md).
    """
    big_smem = cc_major in (9, 10)
    if num_heads <= 16:
        bh = 16
    elif num_heads <= 32 or not big_smem:
        bh = 32
    else:
        bh = 64
    if big_smem:
        if bh == 64:
            return {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "PREFETCH": False,
                    "DS_FOLD": False, "WAVES": 2}
        if bh == 16 and num_tokens >= 64:
            return {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PREFETCH": True,
                    "DS_FOLD": False, "WAVES": 1}
        return {"BLOCK_H": bh, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "PREFETCH": True,
                "DS_FOLD": False, "WAVES": 2}
    return {"BLOCK_H": bh, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "PREFETCH": True,
            "DS_FOLD": False, "WAVES": 2}


# Merge of the split path (docs/notes/sparse_mla.md, "Merge: fused vs separate"). "separate": the
# split kernel writes fp32 partials (o, lse) and a second kernel merges them, one program per
# (row, head, 128 columns). "fused": the split kernel's last-arriving program of each (row, head
# block) merges them itself (an arrival counter per (row, head block) in a persistent zeroed
# buffer): no second launch, no second pass over the partials from DRAM, but each merge is done by
# one program alone. Cost model (bytes per program over one program's read rate vs. a launch gap
# plus all partials over the device's bandwidth); estimates for the H200, to be refitted from the
# bench's us_fused / us_separate.
MERGE_MODES = ("fused", "separate")
# Fused merges win up to this many splits per row (H200, bench/results/sparse_decode_h200.json, both
# merges timed at every split point, fp8_ds_mla): at 2, 3 and 5 splits the fused merge saved
# 5-59 us (H=8/16/64, T=64/128); at 8 splits (T=32) it cost 8-34 us more, and at 32-64 splits
# (T <= 4) 41-129 us more. A byte/launch cost model fitted none of these (H=64 T=64 merges
# 657 KB per program and gains, H=8 T=32 merges 131 KB and loses): the split count decides,
# because the last arriver's merge runs after its own tiles, at the tail of the launch.
FUSED_MERGE_MAX_SPLITS = 5


def _pick_merge(num_tokens: int, num_heads: int, block_h: int, num_splits: int, num_sms: int) -> str:
    """"fused" or "separate" for a split launch (shapes only: CUDA-graph safe); the measured rule
    above. The other arguments stay for a device-specific refit."""
    return "fused" if num_splits <= FUSED_MERGE_MAX_SPLITS else "separate"


def _merge_override() -> str | None:
    """``GLM5_SPARSE_MLA_MERGE`` (``fused`` / ``separate``) forces the merge of split launches
    (profiling both in a served model); read when a plan is made."""
    env = os.environ.get("GLM5_SPARSE_MLA_MERGE", "")
    if not env:
        return None
    if env not in MERGE_MODES:
        raise ValueError(f"GLM5_SPARSE_MLA_MERGE must be one of {MERGE_MODES}, got {env!r}")
    return env


# Arrival counters of the fused merge: one int32 per (row, head block), zero between calls (the
# last arriver resets its counter). One buffer per (device, stream): calls on one stream are
# ordered, so they can share it; a CUDA graph keeps the pointer of the buffer current at capture.
# Buffers are never freed (a captured graph may still point at one that was outgrown).
_COUNTERS: dict = {}
_RETIRED_COUNTERS: list = []


def _stream_buffer(store: dict, retired: list, device, dev_index: int, stream: int, n: int, dtype,
                   minimum: int) -> torch.Tensor:
    """The (device, stream)'s buffer in ``store``, grown to >= n elements (a power of two); a
    replaced buffer goes to ``retired``, never freed (a captured graph may still point at it).
    New int32 buffers are zeroed (the counters' invariant), float ones are not."""
    key = (dev_index, stream)
    buf = store.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            retired.append(buf)
        size = max(minimum, triton.next_power_of_2(n))
        buf = (torch.zeros if dtype == torch.int32 else torch.empty)(size, dtype=dtype, device=device)
        store[key] = buf
    return buf


def _counters(device, dev_index: int, stream: int, n: int) -> torch.Tensor:
    return _stream_buffer(_COUNTERS, _RETIRED_COUNTERS, device, dev_index, stream, n, torch.int32, 1024)


# Per-(device, stream) float32 workspaces of direct launches (v2's split partials and LSE sink):
# calls on one stream are ordered, so one buffer serves them all, without an allocation per call.
# Like the counters, a buffer is never freed (a captured CUDA graph keeps the pointer it saw), and
# graphs replayed concurrently on two streams must not share a capture stream.
_WORKSPACES: dict = {}
_RETIRED_WORKSPACES: list = []


def _workspace(device, dev_index: int, stream: int, n: int) -> torch.Tensor:
    return _stream_buffer(_WORKSPACES, _RETIRED_WORKSPACES, device, dev_index, stream, n, torch.float32, 4096)


# Per-(dtype, device, stream) output buffers of calls that ask for a reused output (``reuse_out``:
# vLLM's backend, whose caller consumes the attention output before its next attention call on the
# stream). Each plan keeps its view of the buffer per stream, so such a call allocates nothing. A
# buffer is made once at REUSE_OUT_MAX_BYTES and never freed (a captured graph keeps its pointer):
# 4 MiB per stream covers decode batches (bf16: T x H <= 4096, e.g. 512 rows at 8 heads); larger
# outputs are allocated per call, where the kernel runs long enough to hide that host time and the
# caching allocator reuses what vLLM's memory profiling counted.
REUSE_OUT_MAX_BYTES = 4 << 20
_OUTS: dict = {}
_RETIRED_OUTS: list = []


def reused_output(views: dict, device, dev_index: int, stream: int, shape: tuple, dtype) -> torch.Tensor:
    """Make and keep in ``views`` (a plan's stream -> tensor) its view of the stream's output
    buffer of ``dtype``; callers look ``views`` up first (the per-call path)."""
    n = 1
    for d in shape:
        n *= d
    elems = max(n, REUSE_OUT_MAX_BYTES // dtype.itemsize)  # the buffer is made once, at full size
    buf = _stream_buffer(_OUTS.setdefault(dtype, {}), _RETIRED_OUTS, device, dev_index, stream, n, dtype, elems)
    v = views[stream] = buf[:n].view(shape)
    return v


def _pick_num_splits(num_tokens: int, n_hblocks: int, topk: int, block_n: int, num_sms: int,
                     waves: float = 1.0) -> int:
    """Split the top-k range across programs when T * head-blocks would underfill the GPU
    (fewer than ``waves * num_sms`` programs)."""
    n_tiles = max(1, triton.cdiv(topk, block_n))
    base = max(1, num_tokens * n_hblocks)
    target = max(1, int(waves * num_sms))
    if base >= target:
        return 1
    splits = triton.cdiv(target, base)
    return max(1, min(splits, n_tiles, MAX_SPLITS))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


class _Plan:
    """What a call with one key (shapes, strides, dtypes, devices, scalars; 16-byte aligned
    pointers) needs, validated and worked out once: output shapes, tile config, grid, the
    non-tensor kernel arguments, and after the first launch the compiled kernels, which later
    calls launch directly (no Triton argument binding, specialization or cache lookup)."""

    __slots__ = ("device", "dev_index", "out_dtype", "out_shape", "lse_shape", "po_shape", "plse_shape",
                 "plse_offset", "scratch_numel", "merge", "fused", "cnt_numel",
                 "kv_squeeze", "kv_u8", "kscale_from_ptr", "split", "grid", "tail", "consts", "meta",
                 "merge_grid", "merge_tail", "merge_consts", "merge_meta", "kernel", "merge_kernel",
                 "launch", "head", "merge_launch", "merge_head", "out_views", "reuse_out")


_PLANS: dict = {}
_MAX_PLANS = 4096  # distinct keys kept; past it the table is cleared (a plan is cheap to rebuild)


def _dispatch_major(major: int) -> int:
    """Compute-capability major whose tile configs the dispatch uses: the device's, unless
    ``GLM5_SPARSE_MLA_DISPATCH_CC`` (an integer major, e.g. ``12``) forces another's (the SM120
    proxy runs on an H200 under ``DISABLE_MMA_V3=1``). Read when a plan is made."""
    env = os.environ.get("GLM5_SPARSE_MLA_DISPATCH_CC", "")
    if not env:
        return major
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"GLM5_SPARSE_MLA_DISPATCH_CC must be an integer compute-capability major, got {env!r}") from None


def fp8_scales(fp8: bool, k_scale, softmax_scale: float, device) -> tuple[bool, float, float]:
    """(scale read by the kernel, v_scale, qk_scale_log2) of a call: the ``fp8`` format's
    per-tensor ``k_scale`` as a host float folds into the softmax scale (QK^T) and the output scale
    here; a one-element fp32 tensor on q's device is read by the kernel (graph-safe). Other formats
    and ``None``: 1.0."""
    kscale_from_ptr, v_scale, qk_scale = False, 1.0, float(softmax_scale) * _LOG2E
    if fp8:
        if isinstance(k_scale, torch.Tensor):
            if k_scale.numel() != 1 or k_scale.dtype != torch.float32 or k_scale.device != device:
                raise ValueError("k_scale tensor must hold one float32 on q's device")
            kscale_from_ptr = True
        elif k_scale is not None:
            v_scale = float(k_scale)
            qk_scale *= v_scale
    return kscale_from_ptr, v_scale, qk_scale


def _make_plan(q, kv_cache, indices, softmax_scale, kv_format, k_scale, out, lse, num_splits, config) -> _Plan:
    """Validate the arguments (``ValueError`` on anything unsupported) and plan the call."""
    if q.dim() != 3 or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q must be [T, H, {HEAD_DIM}], got {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bf16 or fp16, got {q.dtype}")
    fmt = _kvf.resolve_kv_format(kv_format, q.dtype)
    code = fmt.code
    kv = _kvf.check_kv_cache(kv_cache, fmt, q.dtype, kv_format)
    T, H, _ = q.shape
    if H < 1:
        raise ValueError("q needs at least one head")
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"indices must be [T={T}, topk], got {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    topk = indices.shape[1]
    for name, tns in (("kv_cache", kv), ("indices", indices)):
        if tns.device != q.device:
            raise ValueError(f"{name} is on {tns.device}, q on {q.device}")
    num_blocks, block_size = kv.shape[0], kv.shape[1]
    num_slots = num_blocks * block_size
    if num_slots >= 2**31:
        raise ValueError("KV pool of >= 2**31 slots: int32 indices cannot address it")
    if out is not None and (out.shape != (T, H, LATENT_DIM) or out.dtype not in (q.dtype, torch.float32)
                            or out.device != q.device):
        raise ValueError(f"out must be [T, H, {LATENT_DIM}] of {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}")
    if lse is not None and (lse.shape != (T, H) or lse.dtype != torch.float32 or lse.device != q.device):
        raise ValueError(f"lse must be [T, H] float32, got {tuple(lse.shape)} {lse.dtype}")

    kscale_from_ptr, v_scale, qk_scale = fp8_scales(code == _FMT_FP8, k_scale, softmax_scale, q.device)

    p = _Plan()
    p.device = q.device
    p.out_dtype = q.dtype
    p.out_shape, p.lse_shape = (T, H, LATENT_DIM), (T, H)
    p.kv_squeeze = kv_cache.dim() == 4
    p.kv_u8 = code != _FMT_16BIT
    p.kscale_from_ptr = kscale_from_ptr
    bind_kernels(p, None, None)
    p.out_views = {}  # stream -> the reused output's view (reuse_out)
    p.reuse_out = T * H * LATENT_DIM * q.element_size() <= REUSE_OUT_MAX_BYTES
    p.split, p.grid = False, None
    p.merge, p.fused, p.cnt_numel = None, False, 0
    if q.is_cuda:
        p.dev_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        major, _, num_sms = _device_props(p.dev_index)
    else:  # interpreter (TRITON_INTERPRET=1) on CPU
        p.dev_index = -1
        major, num_sms = 0, 4
    if T == 0:
        return p
    cfg = dict(_pick_config(H, _dispatch_major(major), T))
    if config:
        cfg.update(config)
    bh, bn = cfg["BLOCK_H"], cfg["BLOCK_N"]
    n_hb = triton.cdiv(H, bh)
    n_tiles = max(1, triton.cdiv(topk, bn))
    if num_splits is None:
        num_splits = _pick_num_splits(T, n_hb, topk, bn, num_sms, cfg.get("WAVES", 1))
    num_splits = max(1, min(int(num_splits), n_tiles, MAX_SPLITS))
    tiles_per_split = triton.cdiv(n_tiles, num_splits)
    num_splits = triton.cdiv(n_tiles, tiles_per_split)  # no empty split
    p.split = num_splits > 1
    if p.split:
        merge = cfg.get("MERGE") or _merge_override() or _pick_merge(T, H, bh, num_splits, num_sms)
        if merge not in MERGE_MODES:
            raise ValueError(f"config MERGE must be one of {MERGE_MODES}, got {merge!r}")
        p.merge, p.fused, p.cnt_numel = merge, merge == "fused", T * n_hb
    p.po_shape, p.plse_shape = (T, H, num_splits, LATENT_DIM), (T, H, num_splits)
    p.plse_offset = T * H * num_splits * LATENT_DIM * 4  # bytes; a multiple of 16
    p.scratch_numel = T * H * num_splits * (LATENT_DIM + 1)
    ost = out.stride() if out is not None else (H * LATENT_DIM, LATENT_DIM, 1)  # allocated: contiguous
    lst = lse.stride() if lse is not None else (H, 1)
    p.grid = T * n_hb * num_splits
    p.tail = (qk_scale, v_scale, H, topk, num_slots, block_size,
              q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
              indices.stride(0), indices.stride(1), ost[0], ost[1], ost[2], lst[0], lst[1],
              num_splits, tiles_per_split)
    consts = dict(KV_FORMAT=code, KSCALE_FROM_PTR=kscale_from_ptr, SPLIT=p.split, FUSED_MERGE=p.fused,
                  DS_FOLD=bool(cfg["DS_FOLD"]) and code == _FMT_DS_MLA, PREFETCH=bool(cfg.get("PREFETCH", True)),
                  BLOCK_H=bh, BLOCK_N=bn)
    p.consts = tuple(consts.values())  # in the kernel's parameter order
    p.meta = dict(consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    p.merge_grid = T * H * (LATENT_DIM // 128)
    p.merge_tail = (H, num_splits, ost[0], ost[1], ost[2], lst[0], lst[1])
    block_s = 16 if num_splits <= 16 else MAX_SPLITS
    p.merge_consts = (block_s, 128)
    p.merge_meta = dict(BLOCK_S=block_s, BLOCK_D=128, num_warps=4)
    return p


def _no_launch_hooks() -> bool:
    """True when no launch hook is registered (Triton >= 3.6 keeps an always-present, usually
    empty HookChain; profilers such as proton add to it: then launches take Triton's path)."""
    rt = _knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _c_launch_known() -> bool:
    """True when Triton's CUDA launcher has the layout ``launcher`` was written against (Triton
    3.6: ``CudaLauncher.__call__(gx, gy, gz, stream, function, *args)`` calls the compiled C entry
    point ``launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
    *args)``, its argument format ``_BASE_ARGS_FORMAT``). Other versions launch through ``run``."""
    try:
        from triton.backends.nvidia import driver as nv
    except Exception:  # no CUDA backend in this Triton
        return False
    return triton.__version__.startswith("3.6.") and getattr(nv, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO"


def launcher(k) -> tuple:
    """``(launch, head)`` of a compiled kernel ``k``: ``launch(gx, 1, 1, stream, *head, *args)``
    launches it with the kernel's arguments ``args`` (pointers as integers).

    On Triton 3.6's CUDA launcher, for a kernel that needs no global or profile scratch (one CTA
    per cluster), ``launch`` is the launcher's C entry point itself: ``CompiledKernel.run`` would
    only add a Python frame that allocates no scratch and passes the same values (its host time:
    ``kernel_run`` against ``kernel_launch`` in bench/host_breakdown.py). Otherwise ``launch`` is
    ``k.run``, as Triton's own path calls it."""
    run = k.run
    if _c_launch_known():
        from triton.backends.nvidia.driver import CudaLauncher

        if (isinstance(run, CudaLauncher) and getattr(run, "global_scratch_size", 1) == 0
                and getattr(run, "profile_scratch_size", 1) == 0 and getattr(run, "num_ctas", 0) == 1
                and callable(getattr(run, "launch", None))):
            return run.launch, (k.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                                k.packed_metadata, None, None, None)
    return run, (k.function, k.packed_metadata, None, None, None)


def bind_kernels(p, k, m) -> None:
    """Keep a plan's compiled kernel ``k`` and merge kernel ``m`` (or None) with their launchers."""
    p.kernel, p.merge_kernel = k, m
    p.launch, p.head = launcher(k) if k is not None else (None, None)
    p.merge_launch, p.merge_head = launcher(m) if m is not None else (None, None)


def _compiled(k):
    """The CompiledKernel a JIT launch returned, if it can be launched directly (else None)."""
    if k is not None and hasattr(k, "result") and not hasattr(k, "packed_metadata"):
        k = k.result()
    return k if hasattr(k, "packed_metadata") and hasattr(k, "function") else None


def _launch(p: _Plan, q, kv_cache, indices, k_scale, out, lse, cache_kernels: bool, reuse_out: bool = False):
    stream = None
    if out is None:
        if reuse_out and p.reuse_out:  # v2's reuse_out (sparse_mla_decode_v2's v1 calls)
            stream = _raw_stream(p.dev_index) if p.dev_index >= 0 else 0
            out = p.out_views.get(stream)
            if out is None:
                out = reused_output(p.out_views, p.device, p.dev_index, stream, p.out_shape, p.out_dtype)
        else:
            out = torch.empty(p.out_shape, dtype=p.out_dtype, device=p.device)
    if lse is None:
        lse = torch.empty(p.lse_shape, dtype=torch.float32, device=p.device)
    if p.grid is None:  # T == 0
        return out, lse
    if p.launch is not None and _no_launch_hooks():
        # Direct launch of the kernels compiled for this plan, pointers passed as integers (the
        # launcher then skips its per-pointer data_ptr() call and driver attribute query; the
        # plan's key fixed every tensor's device, dtype, shape, strides and alignment). The
        # split path's partial results live in the stream's workspace: [po | plse].
        lp = lse.data_ptr()
        op = out.data_ptr()
        if stream is None:
            stream = _raw_stream(p.dev_index)
        if p.split:
            pp = _workspace(p.device, p.dev_index, stream, p.scratch_numel).data_ptr()
            plp = pp + p.plse_offset
        else:
            pp, plp = op, lp  # unused by the kernel
        cp = _counters(p.device, p.dev_index, stream, p.cnt_numel).data_ptr() if p.fused else lp
        p.launch(p.grid, 1, 1, stream, *p.head,
                 q.data_ptr(), kv_cache.data_ptr(), indices.data_ptr(), op, lp, pp, plp,
                 k_scale.data_ptr() if p.kscale_from_ptr else lp, cp, *p.tail, *p.consts)
        if p.split and not p.fused:
            p.merge_launch(p.merge_grid, 1, 1, stream, *p.merge_head,
                           pp, plp, op, lp, *p.merge_tail, *p.merge_consts)
        return out, lse
    # First launch of a plan, interpreter, misaligned pointers or a launch hook (profilers):
    # Triton's JIT path (binds, specializes, compiles or finds the kernel, launches).
    if p.split:
        po = torch.empty(p.po_shape, dtype=torch.float32, device=p.device)
        plse = torch.empty(p.plse_shape, dtype=torch.float32, device=p.device)
    else:
        po, plse = out, lse  # unused by the kernel
    ks = k_scale if p.kscale_from_ptr else lse  # any valid pointer when unused
    kv = kv_cache.squeeze(2) if p.kv_squeeze else kv_cache
    if p.kv_u8:
        kv = kv.view(torch.uint8)
    if p.fused:
        stream = _raw_stream(p.dev_index) if q.is_cuda else 0
        cnt = _counters(p.device, p.dev_index, stream, p.cnt_numel)
    else:
        cnt = lse  # unused by the kernel
    k = _sparse_mla_fwd_kernel[(p.grid,)](q, kv, indices, out, lse, po, plse, ks, cnt, *p.tail, **p.meta)
    m = None
    if p.split and not p.fused:
        m = _sparse_mla_merge_kernel[(p.merge_grid,)](po, plse, out, lse, *p.merge_tail, **p.merge_meta)
    if cache_kernels and q.is_cuda and p.kernel is None:
        k, m = _compiled(k), _compiled(m)
        if k is not None and (m is not None or not p.split or p.fused):
            bind_kernels(p, k, m)
    return out, lse


def _plan_key(q, kv_cache, indices, softmax_scale, kv_format, k_scale, out, lse, num_splits):
    """The cache key of a call, or None when it must not use a cached plan (a pointer that is not
    16-byte aligned: Triton specializes kernels on pointer alignment and fp8_ds_mla needs it)."""
    ptrs = q.data_ptr() | kv_cache.data_ptr() | indices.data_ptr()
    if out is not None:
        ptrs |= out.data_ptr()
        ko = (out.shape, out.stride(), out.dtype, out.get_device())
    else:
        ko = None
    if lse is not None:
        ptrs |= lse.data_ptr()
        kl = (lse.shape, lse.stride(), lse.dtype, lse.get_device())
    else:
        kl = None
    if isinstance(k_scale, torch.Tensor):
        ptrs |= k_scale.data_ptr()
        ks = (k_scale.shape, k_scale.dtype, k_scale.get_device())
    else:
        ks = k_scale
    if ptrs & 15:
        return None
    return (q.shape, q.stride(), q.dtype, q.get_device(),
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.get_device(),
            indices.shape, indices.stride(), indices.dtype, indices.get_device(),
            softmax_scale, kv_format, ks, ko, kl, num_splits)


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    kv_format: str,
    k_scale: torch.Tensor | float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_splits: int | None = None,
    *,
    validate: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of each query row over its selected KV-cache slots.

    Args:
        q: ``[T, H, 576]`` bf16 or fp16 (512 absorbed latent, then 64 rope). Any strides; read in
            place (never copied).
        kv_cache: ``[num_blocks, block_size, W]`` (or ``[num_blocks, block_size, 1, W]``) in the
            layout of ``kv_format``: ``fp8_ds_mla`` uint8/float8_e4m3fn W=656; ``fp8``/``fp8_e4m3``
            uint8/float8_e4m3fn W=576; ``auto``/``bfloat16``/``float16`` same dtype as q, W=576.
            Last dimension contiguous; block and token strides are free (views of a larger
            allocation are fine).
        indices: ``[T, topk]`` int32 physical slots ``block * block_size + offset``; negative = no
            token; ``>= num_blocks * block_size`` = out of range, treated as no token (see the
            module docstring). Any strides. Duplicates count once per occurrence.
        softmax_scale: the scale applied to q.k before the softmax (GLM-5: 256 ** -0.5).
        kv_format: vLLM ``kv_cache_dtype`` name of the cache layout (see ``mla_kv_format.py``).
        k_scale: per-tensor scale of the ``fp8`` format (fp32 tensor with one element, read on the
            device, or a Python float); ignored by ``fp8_ds_mla`` (its scales are in the rows) and
            the 16-bit formats; defaults to 1.0.
        out: optional ``[T, H, 512]`` output, q's dtype (or fp32); any strides.
        lse: optional ``[T, H]`` fp32 output; any strides.
        num_splits: split each row's top-k range over this many programs (merged by LSE);
            ``None`` picks it from shapes and the SM count.
        validate: debug only: check index ranges on the host (synchronizes; not capturable) and
            raise ``ValueError`` on an index >= num_blocks * block_size.
        config: tuning only: override the dispatch's tile config (keys BLOCK_H, BLOCK_N,
            num_warps, num_stages, DS_FOLD, PREFETCH, WAVES) and the merge of a split launch
            (MERGE ``"fused"`` / ``"separate"``; ``GLM5_SPARSE_MLA_MERGE`` does the same for every
            plan made while it is set).

    Returns:
        ``(out, lse)``: ``out[t, h] = softmax(softmax_scale * q[t, h] . K[idx]) @ V[idx]`` and
        ``lse[t, h]`` its natural-log log-sum-exp; rows with no valid index: zeros and ``-inf``.

    Host cost: the arguments are validated and the launch planned once per key (shapes, strides,
    dtypes, devices, scalars, 16-byte pointer alignment; ``_plan_key``); later calls with the same
    key allocate the outputs (when not given) and launch the compiled kernels directly. A call
    with ``validate`` or ``config``, or with a pointer that is not 16-byte aligned, is planned
    and launched through Triton's JIT every time.
    """
    key = None
    if not validate and config is None:
        key = _plan_key(q, kv_cache, indices, softmax_scale, kv_format, k_scale, out, lse, num_splits)
        if key is not None:
            p = _PLANS.get(key)
            if p is not None:
                return _launch(p, q, kv_cache, indices, k_scale, out, lse, True)
    p = _make_plan(q, kv_cache, indices, softmax_scale, kv_format, k_scale, out, lse, num_splits, config)
    if validate and p.grid is not None:
        num_slots = p.tail[4]
        if bool((indices >= num_slots).any().item()):
            raise ValueError(f"indices contain slots >= num_blocks * block_size = {num_slots}")
    if key is not None:
        remember_plan(_PLANS, key, p)
    return _launch(p, q, kv_cache, indices, k_scale, out, lse, key is not None)


def remember_plan(table: dict, key, plan) -> None:
    """Keep ``plan`` under ``key``; past ``_MAX_PLANS`` keys the table starts over (a plan is cheap
    to rebuild; a long-running server sees few distinct keys)."""
    if len(table) >= _MAX_PLANS:
        table.clear()
    table[key] = plan


# --------------------------------------------------------------------------------------------
# Reference (PyTorch, float64 on dequantized values)
# --------------------------------------------------------------------------------------------


def sparse_mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    kv_format: str,
    k_scale: torch.Tensor | float | None = None,
    chunk: int = 16,
    round_kv_to: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of :func:`sparse_mla_decode` (same arguments; returns float64 out, lse).

    Gathers the selected rows, dequantizes them exactly (e4m3 x fp32 scale, 16-bit rope), and
    computes the softmax in float64. Negative and out-of-range indices contribute nothing;
    duplicates count once per occurrence; a row with no valid index gives zeros and -inf.
    ``round_kv_to`` (e.g. q's dtype) rounds the dequantized rows to that dtype first, as every
    kernel that feeds them to 16-bit tensor cores does (this one and FlashMLA alike): the rest of
    the computation stays float64, so a kernel's distance to it is its own arithmetic's.
    """
    fmt = _kvf.resolve_kv_format(kv_format, q.dtype)
    kv = _kvf.check_kv_cache(kv_cache, fmt, q.dtype, kv_format)
    nb, bs, w = kv.shape
    flat = kv.reshape(nb * bs, w)
    T, H, _ = q.shape
    out = torch.zeros((T, H, LATENT_DIM), dtype=torch.float64, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64, device=q.device)
    idx_all = indices.to(torch.int64)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        idx = idx_all[t0:t1]
        valid = (idx >= 0) & (idx < nb * bs)
        rows = flat[torch.where(valid, idx, 0)]  # [c, topk, W]
        k = _kvf.dequantize_rows(rows, fmt, k_scale)  # [c, topk, 576] float64
        if round_kv_to is not None:
            k = k.to(round_kv_to).to(torch.float64)
        qq = q[t0:t1].to(torch.float64)
        s = torch.einsum("chd,ckd->chk", qq, k) * float(softmax_scale)
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        any_valid = valid.any(dim=-1)[:, None, None]
        m = torch.where(any_valid, m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("chk,ckd->chd", p, k[..., :LATENT_DIM]) / torch.where(any_valid, denom, torch.ones_like(denom))
        out[t0:t1] = torch.where(any_valid, o, torch.zeros_like(o))
        lse[t0:t1] = torch.where(any_valid[..., 0], (m + torch.log(denom))[..., 0], torch.full_like(m[..., 0], float("-inf")))
    return out, lse


# --------------------------------------------------------------------------------------------
# SM120 compile specs (tools/sm120_check.py)
# --------------------------------------------------------------------------------------------

_PTR_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}
# Launch variants of the decode kernel: no split; split + separate merge; split + fused merge
# (every split launch can take either merge: _pick_merge by shape, or config / GLM5_SPARSE_MLA_MERGE).
_SPLIT_VARIANTS = ((False, False), (True, False), (True, True))


def SM120_COMPILE_SPECS() -> list[dict]:
    """Every kernel configuration the dispatch can choose on SM120/SM121 (see tools/sm120_check.py).

    Enumerates head counts 1..128 through ``_pick_config(H, 12)``, the three cache formats, both q
    dtypes, the launch variants of ``_SPLIT_VARIANTS`` (no split, split with the separate merge,
    split with the fused merge), plus the merge kernel. Integer arguments that the
    runtime specializes (divisible by 16: pointers, strides, sizes) are declared so, and strides
    equal to 1 as the constexpr 1 that Triton's launcher uses.
    """
    specs = []
    configs = {}
    for h in range(1, 129):
        for t in (1, 4096):
            c = _pick_config(h, 12, t)
            configs[(c["BLOCK_H"], c["BLOCK_N"], c["num_warps"], c["num_stages"], c["DS_FOLD"], c["PREFETCH"])] = c
    for (bh, bn, nw, ns, fold, pref) in sorted(configs):
        for qdt, qt in _PTR_TYPES.items():
            for code, fmt in ((_FMT_DS_MLA, "fp8_ds_mla"), (_FMT_FP8, "fp8"), (_FMT_16BIT, "auto")):
                for split, fused in _SPLIT_VARIANTS:
                    kvt = "*u8" if code != _FMT_16BIT else qt
                    sig = {
                        "q_ptr": qt, "kv_ptr": kvt, "idx_ptr": "*i32", "out_ptr": qt, "lse_ptr": "*fp32",
                        "po_ptr": "*fp32", "plse_ptr": "*fp32", "kscale_ptr": "*fp32",
                        "cnt_ptr": "*i32" if fused else "*fp32",
                        "qk_scale_log2": "fp32", "v_scale": "fp32",
                        "num_heads": "i32", "topk": "i32", "num_slots": "i32", "block_size": "i32",
                        "stride_qt": "i32", "stride_qh": "i32", "stride_qd": "constexpr",
                        "stride_kb": "i32", "stride_ks": "i32",
                        "stride_it": "i32", "stride_ik": "constexpr",
                        "stride_ot": "i32", "stride_oh": "i32", "stride_od": "constexpr",
                        "stride_lt": "i32", "stride_lh": "constexpr",
                        "num_splits": "i32", "tiles_per_split": "i32",
                        "KV_FORMAT": "constexpr", "KSCALE_FROM_PTR": "constexpr", "SPLIT": "constexpr",
                        "FUSED_MERGE": "constexpr", "DS_FOLD": "constexpr", "PREFETCH": "constexpr", "BLOCK_H": "constexpr",
                        "BLOCK_N": "constexpr",
                    }
                    specs.append({
                        "name": f"sparse_mla_fwd[{fmt},{str(qdt).split('.')[-1]},BH={bh},BN={bn},w={nw},s={ns},"
                                f"fold={int(fold and code == _FMT_DS_MLA)},prefetch={int(pref)},split={int(split)}"
                                + (f",merge={'fused' if fused else 'separate'}]" if split else "]"),
                        "fn": _sparse_mla_fwd_kernel,
                        "signature": sig,
                        "constexprs": {"stride_qd": 1, "stride_ik": 1, "stride_od": 1, "stride_lh": 1,
                                       "KV_FORMAT": code, "KSCALE_FROM_PTR": code == _FMT_FP8,
                                       "SPLIT": split, "FUSED_MERGE": fused, "DS_FOLD": fold and code == _FMT_DS_MLA, "PREFETCH": pref,
                                       "BLOCK_H": bh, "BLOCK_N": bn},
                        "divisible_by_16": ["q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "lse_ptr", "po_ptr", "plse_ptr",
                                            "kscale_ptr", "cnt_ptr", "stride_qt", "stride_qh", "stride_kb", "stride_ks",
                                            "stride_it", "stride_ot", "stride_oh"],
                        "num_warps": nw,
                        "num_stages": ns,
                    })
    for (qdt, qt), block_s in [(x, b) for x in _PTR_TYPES.items() for b in (16, MAX_SPLITS)]:
        specs.append({
            "name": f"sparse_mla_merge[{str(qdt).split('.')[-1]},BLOCK_S={block_s}]",
            "fn": _sparse_mla_merge_kernel,
            "signature": {"po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": qt, "lse_ptr": "*fp32",
                          "num_heads": "i32", "num_splits": "i32",
                          "stride_ot": "i32", "stride_oh": "i32", "stride_od": "constexpr",
                          "stride_lt": "i32", "stride_lh": "constexpr",
                          "BLOCK_S": "constexpr", "BLOCK_D": "constexpr"},
            "constexprs": {"stride_od": 1, "stride_lh": 1, "BLOCK_S": block_s, "BLOCK_D": 128},
            "divisible_by_16": ["po_ptr", "plse_ptr", "out_ptr", "lse_ptr", "stride_ot", "stride_oh"],
            "num_warps": 4,
            "num_stages": 1,
        })
    return specs

# SPDX-License-Identifier: Apache-2.0
"""Exact per-row top-k for the DSA indexer, in Triton (replaces vLLM's ``top_k_per_row_prefill``,
``top_k_per_row_decode`` and ``persistent_topk`` CUDA ops).

For every logits row ``r`` with a valid column range ``[start_r, end_r)`` the kernel writes the
``k`` columns with the largest logits, as request-local int32 positions ``col - start_r`` (what
vLLM's ops return), and ``-1`` in the slots left over when the row is shorter than ``k``.

Semantics (documented, tested against ``torch.topk``):

* **Exact.** The selected set is the true top-k of the row's fp32 logits (compared as fp32, with
  ``-0.0 < +0.0``; NaN is not supported).
* **Ties: the lower index wins.** Among equal logits at the k-th place the smallest positions are
  taken, so the result is a deterministic function of the logits (upstream's CUDA ops break ties
  by thread arrival order, which is not deterministic). ``torch.topk`` does not document its tie
  order; where logits are distinct the sets are identical, with ties the value multisets are.
* **Order inside a row is unspecified.** The current kernel writes the elements above its upper
  pivot in ascending position, then the remaining selected ones in ascending position (so a row
  shorter than ``k`` is ``0, 1, ..., L-1, -1, ...``). vLLM's consumers treat the row as a set.
* Rows with ``L <= k`` (and empty / padded rows, ``L <= 0``) are written as ``0..L-1`` then -1.

Short calls (``max_seq_len <= SHORT_MAX`` = 8192; ``_topk_short_kernel``, grid ``(rows,)``, one
launch, no scratch): the row's logits are loaded once into registers as uint32 keys, the k-th
largest key is found by a 4-way bisection on the key bits (``_bisect_store``: three threshold
counts per step in one int64 block sum, ending as soon as the keys above the prefix are exactly
k), and one packed scan writes the selection in ascending position order. ``SHORT=False`` (a
keyword of every entry) takes the radix path below instead, for any length.

Algorithm for longer calls (two launches; the row's logits are read once from L2/HBM in the common case):

1. *Pivot window* (``_topk_segment_kernel``, grid ``(rows, SPLIT)``, only launched when
   ``max_seq_len > CAP``; rows with ``L <= CAP`` skip it): ``S`` logits at evenly spaced positions
   are radix-selected in registers (a ``2**BITS``-bin ``tl.histogram`` per ``BITS``-bit digit,
   ``RADIX_BITS`` = 8 by default) at the two ranks ``S*k/L -+ (ZSIGMA * binomial sd + 2)``; they
   bound a window ``[lo, hi]`` that contains the k-th largest value with overwhelming probability
   (``hi`` rounded up, ``lo`` down, to the ``ceil(20 / BITS)`` leading digits).
   Then one streaming pass over the program's segment of the row: elements above ``hi`` are
   written out (their count must stay below ``k``), window elements are compacted in position
   order into a scratch of ``CAP`` (key, position) pairs. ``SPLIT`` programs share a row when there
   are too few rows to fill the GPU (every program computes the same window).
2. *Resolve* (``_topk_merge_kernel``, grid ``(rows,)``): rows ``<= k`` are filled, rows
   ``<= CAP`` are selected straight from the logits (with ``_bisect_store``; the radix select of
   all 32 bits when ``SHORT_SELECT`` is off, as ``SHORT=False`` sets it); longer rows concatenate their segments (in
   position order), radix-select the k-th key ``tau`` among the window (only the bits that vary
   inside the window), then take the candidates ``> tau`` plus the first ``need`` ones ``== tau``
   (lowest positions first). With ``MERGE_REGS`` (off: measured 1-12% slower) the segments' windows
   are instead loaded straight into registers (``SEGCAP`` lanes each, ``merge_segcap``) and
   selected there with the short kernel's bisection (``_merge_regs``): no concatenation through
   global memory; same output.
3. *Fallback* (not instrumented; by the margin choice a row misses the window with probability
   ~1e-5 on unstructured logits; exact also for adversarial rows, e.g. huge blocks of identical logits): if the window missed the k-th value or holds more than ``CAP`` candidates, it
   is fixed from the exact counts and narrowed by 16-way multisection passes over the row until it
   fits, or until it is a single value (then the tied elements are taken in position order).

Floats are compared through the order-preserving int32 key ``b ^ 0x7fffffff if b < 0 else b``
(``b`` = the fp32 bits). The grids and every constexpr come from shapes and the host-known
``max_seq_len`` (and the SM count): the call is CUDA-graph capturable and never syncs the host.

This file imports only torch, triton and the standard library: it runs standalone (tests,
benchmarks) and inside the patched vLLM tree (``vllm/v1/attention/ops/triton_dsa_topk.py``).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import warnings

import torch
import triton
import triton.language as tl
from triton import knobs as _knobs

__all__ = [
    "top_k_per_row_prefill",
    "top_k_per_row_decode",
    "persistent_topk",
    "topk_rows",
    "top_k_per_row_prefill_reference",
    "top_k_per_row_decode_reference",
    "persistent_topk_reference",
    "topk_rows_reference",
    "topk_config",
    "topk_workspace_bytes",
    "dispatch_launches",
    "SM120_COMPILE_SPECS",
]

_INT32_MAX = 2147483647
_INT32_MIN = -2147483648

# Row-range modes of the kernel (constexpr MODE).
_MODE_STARTS_ENDS = 0  # prefill: [starts[r], ends[r])
_MODE_SEQLEN_NEXTN = 1  # decode, 1-D seq_lens [B]: [0, seq_lens[r // n] - n + r % n + 1)
_MODE_ROW_LENGTHS = 2  # decode, per-row lengths ([B, next_n] flattened, or persistent_topk): [0, lens[r])


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _f32_key(x):
    """Order-preserving map fp32 -> int32 (signed compare of keys == float compare)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _emit_pass(src, stride_c, c_begin, c_end, lo, hi, gt_out, ck, ci, tie_out, need, tie_direct,
               K: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr):
    """One pass over columns [c_begin, c_end) of a row: positions with key > hi -> gt_out[0..K),
    window positions (lo <= key <= hi) -> scratch ck/ci[0..CAP) in position order, or, when
    ``tie_direct``, -> tie_out[rank] while rank < need. Returns (#key > hi, #window).
    One packed scan (gt in the low, window in the high 16 bits) and one sum per chunk."""
    offs = tl.arange(0, CHUNK)
    n_gt = tl.zeros([], dtype=tl.int32)
    n_w = tl.zeros([], dtype=tl.int32)
    idx0 = c_begin + offs
    nxt = tl.load(src + idx0.to(tl.int64) * stride_c, mask=idx0 < c_end, other=0.0)
    for c0 in range(c_begin, c_end, CHUNK):
        cur = nxt
        idx = c0 + offs
        m = idx < c_end
        # software prefetch of the next chunk (hides L2/HBM latency behind this chunk's work)
        nidx = idx + CHUNK
        nxt = tl.load(src + nidx.to(tl.int64) * stride_c, mask=nidx < c_end, other=0.0)
        key = _f32_key(cur)
        gt = m & (key > hi)
        wn = m & (key >= lo) & (key <= hi)
        packed = gt.to(tl.int32) | (wn.to(tl.int32) << 16)
        incl = tl.cumsum(packed, 0)
        tot = tl.sum(packed, 0)
        pg = n_gt + (incl & 0xFFFF) - 1
        pw = n_w + (incl >> 16) - 1
        tl.store(gt_out + pg, idx, mask=gt & (pg < K))
        tl.store(ck + pw, key, mask=wn & (pw < CAP) & (tie_direct == 0))
        tl.store(ci + pw, idx, mask=wn & (pw < CAP) & (tie_direct == 0))
        tl.store(tie_out + pw, idx, mask=wn & (pw < need) & (tie_direct != 0))
        n_gt += tot & 0xFFFF
        n_w += tot >> 16
    return n_gt, n_w


@triton.jit
def _multisection(src, stride_c, L, lo, hi, n_gt, K: tl.constexpr, RCHUNK: tl.constexpr):
    """Narrow [lo, hi] (count(>hi) < K <= count(>=lo)) 16-fold with one counting pass.
    Returns (lo, hi, #key > hi, #lo <= key <= hi) of the new window."""
    j = tl.arange(0, 16)
    lo64 = lo.to(tl.int64)
    step = (hi.to(tl.int64) - lo64) // 16 + 1
    thr64 = lo64 + j.to(tl.int64) * step
    thr = tl.minimum(thr64, 2147483647).to(tl.int32)
    cnt = tl.zeros([16], dtype=tl.int32)
    offs = tl.arange(0, RCHUNK)
    for c0 in range(0, L, RCHUNK):
        idx = c0 + offs
        m = idx < L
        key = _f32_key(tl.load(src + idx.to(tl.int64) * stride_c, mask=m, other=0.0))
        ge = (key[:, None] >= thr[None, :]) & m[:, None]
        cnt += tl.sum(ge.to(tl.int32), 0)
    valid = (cnt >= K) & (thr64 <= hi.to(tl.int64))
    jsel = tl.max(tl.where(valid, j, 0), 0)
    new_lo = tl.max(tl.where(j == jsel, thr, -2147483648), 0)
    # (a sum over the single matching lane: a max with a fill value would be wrong for negative keys)
    nxt_ok = (jsel < 15) & (tl.sum(tl.where(j == jsel + 1, thr64, 0), 0) <= hi.to(tl.int64))
    nxt_thr = tl.max(tl.where(j == jsel + 1, thr, -2147483648), 0)
    cnt_sel = tl.max(tl.where(j == jsel, cnt, 0), 0)
    cnt_nxt = tl.max(tl.where(j == jsel + 1, cnt, 0), 0)
    new_hi = tl.where(nxt_ok, nxt_thr - 1, hi)
    new_gt = tl.where(nxt_ok, cnt_nxt, n_gt)
    new_w = cnt_sel - new_gt
    return new_lo, new_hi, new_gt, new_w


@triton.jit
def _row_range(a_ptr, b_ptr, row, next_n, MODE: tl.constexpr):
    if MODE == 0:
        rs = tl.load(a_ptr + row)
        re = tl.load(b_ptr + row)
    elif MODE == 1:
        sl = tl.load(a_ptr + row // next_n)
        rs = sl * 0
        re = sl - next_n + (row % next_n).to(tl.int32) + 1
    else:
        re = tl.load(a_ptr + row)
        rs = re * 0
    return rs, tl.maximum(re - rs, 0)


@triton.jit
def _to_u(key):
    """signed order-preserving key -> uint32 with the same (unsigned) order"""
    return key.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _from_u(ku):
    return (ku ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def _radix_select_desc(ku, m, rank, top_shift, npass, BITS: tl.constexpr):
    """Radix select on uint32 values ``ku`` (lanes with ``m``), ``BITS`` bits per pass from bit
    ``top_shift + BITS - 1`` down, ``npass`` passes: returns (prefix, r) where ``prefix`` holds the
    examined bits of the ``rank``-th largest value (0-based; lower bits zero) and ``r`` is its rank
    among the lanes sharing that prefix. With every bit examined, ``prefix`` is the value itself and
    ``r + 1`` of its ties are needed. Each pass: a ``2**BITS``-bin histogram of the masked digits
    (ballots per digit bit inside a warp, one shared-memory merge across warps); the per-pass fixed
    cost is a merge, a barrier and a bin scan; a 256-bin histogram costs more than two 16-bin ones,
    so 4-bit digits (8 passes for 32 bits) measured faster than 8-bit ones (see RADIX_BITS)."""
    NB: tl.constexpr = 1 << BITS
    dig = tl.arange(0, NB)
    prefix = tl.zeros([], dtype=tl.uint32)
    pmask = tl.zeros([], dtype=tl.uint32)
    rr = rank
    for p in range(0, npass):
        shift = (tl.zeros([], dtype=tl.int32) + top_shift - BITS * p).to(tl.uint32)
        d = ((ku >> shift) & (NB - 1)).to(tl.int32)
        match = m & ((ku & pmask) == prefix)
        dsel, rr = _pick_digit(tl.histogram(d, NB, mask=match), dig, rr)
        prefix = prefix | (dsel.to(tl.uint32) << shift)
        pmask = pmask | (tl.full([], NB - 1, tl.uint32) << shift)
    return prefix, rr


@triton.jit
def _pick_digit(cnt, dig, rank):
    """The digit whose bin of the histogram ``cnt`` holds the ``rank``-th largest lane (0-based),
    and that lane's rank among the bin's lanes."""
    above = tl.sum(cnt, 0) - tl.cumsum(cnt, 0)  # lanes with a larger digit
    sel = (above <= rank) & (rank < above + cnt)
    return tl.sum(tl.where(sel, dig, 0), 0), rank - tl.sum(tl.where(sel, above, 0), 0)


@triton.jit
def _radix_select_desc2(ku, m, rank_a, rank_b, top_shift, npass, BITS: tl.constexpr):
    """``_radix_select_desc`` at two ranks at once (``rank_a <= rank_b``): while the two order
    statistics share the digits examined so far, one histogram per pass serves both (the pivot
    window's two sample ranks usually share the sign and exponent bits); after they part, each
    takes its own. Returns the two prefixes (same contract as ``_radix_select_desc``)."""
    NB: tl.constexpr = 1 << BITS
    dig = tl.arange(0, NB)
    pa = tl.zeros([], dtype=tl.uint32)
    pb = tl.zeros([], dtype=tl.uint32)
    pmask = tl.zeros([], dtype=tl.uint32)
    ra = rank_a
    rb = rank_b
    for p in range(0, npass):
        shift = (tl.zeros([], dtype=tl.int32) + top_shift - BITS * p).to(tl.uint32)
        d = ((ku >> shift) & (NB - 1)).to(tl.int32)
        cnt = tl.histogram(d, NB, mask=m & ((ku & pmask) == pa))
        da, ra = _pick_digit(cnt, dig, ra)
        if pa != pb:  # the ranks parted: b's own histogram
            cnt = tl.histogram(d, NB, mask=m & ((ku & pmask) == pb))
        db, rb = _pick_digit(cnt, dig, rb)
        pa = pa | (da.to(tl.uint32) << shift)
        pb = pb | (db.to(tl.uint32) << shift)
        pmask = pmask | (tl.full([], NB - 1, tl.uint32) << shift)
    return pa, pb


@triton.jit
def _resolve_store(keys, idx, m, base, need, n_passes, out, BITS: tl.constexpr):
    """Write the ``need`` largest of (keys (uint32, relative to ``base``), idx) lanes ``m`` (in
    position order: ties are taken lowest position first) to out[base + ...]. ``n_passes`` digits
    of ``BITS`` bits cover every bit that varies among the keys."""
    pref, rr = _radix_select_desc(keys, m, need - 1, BITS * n_passes - BITS, n_passes, BITS)
    above = m & (keys > pref)
    eq = m & (keys == pref)
    # the ties taken up to lane i are min(#ties so far, rr + 1) because ties are taken in order.
    if keys.shape[0] <= 16384:
        # one packed scan: #above in the low, #ties in the high bits (counts <= 16384 < 2**15,
        # so the high half stays positive in int32)
        incl = tl.cumsum(above.to(tl.int32) | (eq.to(tl.int32) << 16), 0)
        n_eq = incl >> 16
        n_above = incl & 0xFFFF
    else:  # CAP > 16384 (k > 8192): the counts do not fit 16 bits, two scans
        n_eq = tl.cumsum(eq.to(tl.int32), 0)
        n_above = tl.cumsum(above.to(tl.int32), 0)
    sel = above | (eq & (n_eq <= rr + 1))
    opos = base + n_above + tl.minimum(n_eq, rr + 1) - 1
    tl.store(out + opos, idx, mask=sel)


@triton.jit
def _topk_segment_kernel(
    logits_ptr, stride_r, stride_c,
    a_ptr, b_ptr, next_n,
    out_ptr, stride_o,
    seg_gt_ptr, seg_k_ptr, seg_i_ptr, cat_k_ptr, cat_i_ptr, cnt_ptr, win_ptr,
    K: tl.constexpr, MODE: tl.constexpr, S: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
    ZSIGMA: tl.constexpr, SPLIT: tl.constexpr, BITS: tl.constexpr, SAMPLE_BITS: tl.constexpr = 20,
    SAMPLE_JOINT: tl.constexpr = False,
):
    """Pass 1 for rows longer than CAP, grid (rows, SPLIT): a window [lo, hi] from a pivot sample of
    the whole row (every program of the row computes the same one), then one streaming pass over
    this program's segment. SPLIT == 1 writes straight into the output / row scratch."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    rs, L = _row_range(a_ptr, b_ptr, row, next_n, MODE)
    if L > CAP:
        src = logits_ptr + row * stride_r + rs.to(tl.int64) * stride_c
        js = tl.arange(0, S)
        pos = (js.to(tl.int64) * L) // S
        su = _to_u(_f32_key(tl.load(src + pos * stride_c)))
        p = K / L.to(tl.float32)
        e = S * p
        mrg = ZSIGMA * tl.sqrt(e * (1.0 - p)) + 2.0
        r_hi = tl.floor(e - mrg).to(tl.int32)
        r_lo = tl.ceil(e + mrg).to(tl.int32)
        all_s = js >= 0
        # SAMPLE_BITS (~20) leading bits of each order statistic suffice: hi rounds up, lo rounds
        # down (the window only grows)
        SPASS: tl.constexpr = (SAMPLE_BITS + BITS - 1) // BITS
        LOWMASK: tl.constexpr = (1 << (32 - BITS * SPASS)) - 1
        npass = tl.full([], SPASS, tl.int32)
        top = tl.full([], 32 - BITS, tl.int32)
        if SAMPLE_JOINT:  # one histogram per pass while the two ranks share their digits
            ph, pl = _radix_select_desc2(su, all_s, tl.maximum(r_hi, 0), tl.minimum(r_lo, S - 1), top, npass, BITS)
        else:
            ph, _rh = _radix_select_desc(su, all_s, tl.maximum(r_hi, 0), top, npass, BITS)
            pl, _rl = _radix_select_desc(su, all_s, tl.minimum(r_lo, S - 1), top, npass, BITS)
        hi = tl.where(r_hi >= 0, _from_u(ph | LOWMASK), 2147483647)
        lo = tl.where(r_lo < S, _from_u(pl), -2147483648)
        hi = tl.maximum(hi, lo)
        seg_len = tl.cdiv(L, SPLIT)
        c_begin = tl.minimum(seg * seg_len, L)
        c_end = tl.minimum(c_begin + seg_len, L)
        if SPLIT == 1:
            gt_base = out_ptr + row * stride_o
            kb = cat_k_ptr + row * CAP
            ib = cat_i_ptr + row * CAP
        else:
            gt_base = seg_gt_ptr + (row * SPLIT + seg) * K
            kb = seg_k_ptr + (row * SPLIT + seg) * CAP
            ib = seg_i_ptr + (row * SPLIT + seg) * CAP
        zero = tl.zeros([], dtype=tl.int32)
        n_gt, n_w = _emit_pass(src, stride_c, c_begin, c_end, lo, hi, gt_base, kb, ib, gt_base, zero, zero,
                               K, CAP, CHUNK)
        tl.store(cnt_ptr + (row * SPLIT + seg) * 2, n_gt)
        tl.store(cnt_ptr + (row * SPLIT + seg) * 2 + 1, n_w)
        if seg == 0:
            tl.store(win_ptr + row * 2, lo)
            tl.store(win_ptr + row * 2 + 1, hi)


@triton.jit
def _merge_regs(out, row, K: tl.constexpr, KFILL: tl.constexpr, CAP: tl.constexpr, SPLIT: tl.constexpr,
                SPLIT_P: tl.constexpr, SEGCAP: tl.constexpr, sj, sm, gts, ws, n_gt, n_w, lo,
                seg_gt_ptr, seg_k_ptr, seg_i_ptr, cat_k_ptr, cat_i_ptr, BISECT_BITS: tl.constexpr):
    """The merge of a long row (``MERGE_REGS``): the segments' lists of elements above the window go
    to out[0..n_gt) at their exclusive offsets (position order), and the ``K - n_gt`` largest of the
    segments' windows are selected in registers (all windows loaded at once as SPLIT x SEGCAP lanes,
    keys relative to the window's low end, ``_bisect_store`` from their largest one's bit length) and
    written after them in position order: the same output as the concatenation + radix resolve."""
    if SPLIT > 1:
        excl = tl.cumsum(gts, 0) - gts
        fo = tl.arange(0, KFILL)
        for sg in tl.static_range(SPLIT):
            n_s = tl.sum(tl.where(sj == sg, gts, 0), 0)
            e_s = tl.sum(tl.where(sj == sg, excl, 0), 0)
            for f0 in range(0, n_s, KFILL):
                i = f0 + fo
                v = tl.load(seg_gt_ptr + (row * SPLIT + sg) * K + i, mask=i < n_s)
                tl.store(out + e_s + i, v, mask=i < n_s)
    lane = tl.arange(0, SPLIT_P * SEGCAP)
    s_l = lane // SEGCAP
    i_l = lane % SEGCAP
    nw_l = tl.zeros([SPLIT_P * SEGCAP], dtype=tl.int32)
    for sg in tl.static_range(SPLIT):
        nw_l = tl.where(s_l == sg, tl.sum(tl.where(sj == sg, ws, 0), 0), nw_l)
    m = (s_l < SPLIT) & (i_l < nw_l)
    if SPLIT > 1:
        off = (row * SPLIT + s_l) * CAP + i_l
        kv = tl.load(seg_k_ptr + off, mask=m, other=0)
        iv = tl.load(seg_i_ptr + off, mask=m, other=0)
    else:
        kv = tl.load(cat_k_ptr + row * CAP + i_l, mask=m, other=0)
        iv = tl.load(cat_i_ptr + row * CAP + i_l, mask=m, other=0)
    need = K - n_gt
    if n_w == need:  # the whole window is taken, in position order
        tl.store(out + n_gt + tl.cumsum(m.to(tl.int32), 0) - 1, iv, mask=m)
    else:
        # keys relative to the window's low end, + 1 so that no valid lane is 0 (masked lanes are;
        # no overflow: a window holding the largest key down to the smallest is over CAP)
        rel = tl.where(m, _to_u(kv) - _to_u(lo) + 1, 0)
        # the search starts at the even bit length of the largest (shift clamped to 31: a shift
        # by 32 is undefined even where the loop stops)
        mx = tl.max(rel, 0)
        top = tl.zeros([], dtype=tl.int32) + 2
        while (top < 32) & ((mx >> tl.minimum(top, 31).to(tl.uint32)) != 0):
            top += 2
        _bisect_store(rel, iv, m, n_w, out + n_gt, need, BISECT_BITS, top)


@triton.jit
def _topk_merge_kernel(
    logits_ptr, stride_r, stride_c,
    a_ptr, b_ptr, next_n,
    out_ptr, stride_o,
    seg_gt_ptr, seg_k_ptr, seg_i_ptr, cat_k_ptr, cat_i_ptr, cnt_ptr, win_ptr,
    K: tl.constexpr, KFILL: tl.constexpr, MODE: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
    RCHUNK: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P: tl.constexpr, GCHUNK: tl.constexpr,
    BITS: tl.constexpr, SHORT_SELECT: tl.constexpr, BISECT_BITS: tl.constexpr, MERGE_REGS: tl.constexpr,
    SEGCAP: tl.constexpr, MERGE_BISECT: tl.constexpr = False,
):
    """Pass 2, grid (rows,): rows <= K are filled; rows <= CAP are selected directly from the logits;
    longer rows concatenate their segments (position order), check the window and resolve it; an
    exact fallback over the whole row runs when the window missed the k-th value."""
    row = tl.program_id(0).to(tl.int64)
    rs, L = _row_range(a_ptr, b_ptr, row, next_n, MODE)
    out = out_ptr + row * stride_o
    src = logits_ptr + row * stride_r + rs.to(tl.int64) * stride_c
    cj = tl.arange(0, CAP)
    if L <= K:
        fo = tl.arange(0, KFILL)
        for f0 in range(0, K, KFILL):
            i = f0 + fo
            tl.store(out + i, tl.where(i < L, i, -1), mask=i < K)
    elif L <= CAP:
        cm = cj < L
        ku = _to_u(_f32_key(tl.load(src + cj.to(tl.int64) * stride_c, mask=cm, other=0.0)))
        if SHORT_SELECT:  # the short-row kernel's select (same output)
            _bisect_store(tl.where(cm, ku, 0), cj, cm, L, out, K, BISECT_BITS)
        else:  # radix select, 32 // BITS passes
            _resolve_store(ku, cj, cm, 0, K, tl.full([], 32 // BITS, tl.int32), out, BITS)
    else:
        ck = cat_k_ptr + row * CAP
        ci = cat_i_ptr + row * CAP
        sj = tl.arange(0, SPLIT_P)
        sm = sj < SPLIT
        gts = tl.load(cnt_ptr + (row * SPLIT + sj) * 2, mask=sm, other=0)
        ws = tl.load(cnt_ptr + (row * SPLIT + sj) * 2 + 1, mask=sm, other=0)
        n_gt = tl.sum(gts, 0)
        n_w = tl.sum(ws, 0)
        lo = tl.load(win_ptr + row * 2)
        hi = tl.load(win_ptr + row * 2 + 1)
        ok = ((n_gt < K) & (n_gt + n_w >= K) & (n_w <= CAP)).to(tl.int32)
        regs = 0
        if MERGE_REGS:
            # every segment's window fits its SEGCAP lanes: select in registers straight from the
            # segments (no concatenation through global memory)
            w_max = tl.max(tl.where(sm, ws, 0), 0)
            regs = ((ok != 0) & (w_max <= SEGCAP)).to(tl.int32)
            if regs != 0:
                _merge_regs(out, row, K, KFILL, CAP, SPLIT, SPLIT_P, SEGCAP, sj, sm, gts, ws, n_gt, n_w, lo,
                            seg_gt_ptr, seg_k_ptr, seg_i_ptr, cat_k_ptr, cat_i_ptr, BISECT_BITS)
        if regs == 0:
            tie = tl.zeros([], dtype=tl.int32)
            if ok != 0:
                if SPLIT > 1:
                    # concatenate the segments: gt lists -> out, windows -> row scratch, position order.
                    # exclusive offsets go through the (per-row) count buffer, then each output slot
                    # finds its segment with SPLIT - 1 scalar compares.
                    tl.store(cnt_ptr + (row * SPLIT + sj) * 2, tl.cumsum(gts, 0) - gts, mask=sm)
                    tl.store(cnt_ptr + (row * SPLIT + sj) * 2 + 1, tl.cumsum(ws, 0) - ws, mask=sm)
                    tl.debug_barrier()
                    go = tl.arange(0, GCHUNK)
                    for f0 in range(0, n_gt, GCHUNK):
                        i = f0 + go
                        sidx = tl.zeros([GCHUNK], dtype=tl.int32)
                        for sg in tl.static_range(1, SPLIT):
                            sidx += (i >= tl.load(cnt_ptr + (row * SPLIT + sg) * 2)).to(tl.int32)
                        loc = i - tl.load(cnt_ptr + (row * SPLIT + sidx) * 2, mask=i < n_gt, other=0)
                        v = tl.load(seg_gt_ptr + (row * SPLIT + sidx) * K + loc, mask=i < n_gt)
                        tl.store(out + i, v, mask=i < n_gt)
                    for f0 in range(0, n_w, GCHUNK):
                        i = f0 + go
                        sidx = tl.zeros([GCHUNK], dtype=tl.int32)
                        for sg in tl.static_range(1, SPLIT):
                            sidx += (i >= tl.load(cnt_ptr + (row * SPLIT + sg) * 2 + 1)).to(tl.int32)
                        loc = i - tl.load(cnt_ptr + (row * SPLIT + sidx) * 2 + 1, mask=i < n_w, other=0)
                        kv = tl.load(seg_k_ptr + (row * SPLIT + sidx) * CAP + loc, mask=i < n_w)
                        iv = tl.load(seg_i_ptr + (row * SPLIT + sidx) * CAP + loc, mask=i < n_w)
                        tl.store(ck + i, kv, mask=i < n_w)
                        tl.store(ci + i, iv, mask=i < n_w)
            else:
                # ---- fallback: exact counts fix the window, multisection narrows it ---------------
                if n_gt >= K:  # k-th value above the window
                    lo = hi + 1
                    hi = tl.full([], 2147483647, tl.int32)
                    n_w = n_gt
                    n_gt = n_gt * 0
                elif n_gt + n_w < K:  # k-th value below the window
                    n_gt = n_gt + n_w
                    n_w = L - n_gt
                    hi = lo - 1
                    lo = tl.full([], -2147483648, tl.int32)
                while (n_w > CAP) & (lo < hi):
                    lo, hi, n_gt, n_w = _multisection(src, stride_c, L, lo, hi, n_gt, K, RCHUNK)
                tie = (n_w > CAP).to(tl.int32)  # only when lo == hi: every window element ties
                n_gt2, n_w2 = _emit_pass(src, stride_c, 0, L, lo, hi, out, ck, ci, out + n_gt, K - n_gt, tie,
                                         K, CAP, CHUNK)
            if tie == 0:
                # ---- resolve the window in registers (scratch is in position order) --------------
                tl.debug_barrier()  # scratch written by other threads of this program
                cm = cj < n_w
                lo_u = _to_u(lo)
                rel = _to_u(tl.load(ck + cj, mask=cm, other=0, cache_modifier=".cg")) - lo_u
                width = _to_u(hi) - lo_u
                npass = tl.full([], 1, tl.int32)
                # (shift clamped to 31: a shift by 32 is undefined in LLVM even where npass stops the loop)
                while (npass < 32 // BITS) & ((width >> tl.minimum(BITS * npass, 31).to(tl.uint32)) != 0):
                    npass += 1
                cidx = tl.load(ci + cj, mask=cm, other=0, cache_modifier=".cg")
                if MERGE_BISECT:
                    # the short rows' register bisection on the window's relative keys (< 2**(BITS *
                    # npass)): no shared-memory histogram per pass; the same lanes in the same order
                    need = K - n_gt
                    if n_w > need:
                        _bisect_store(tl.where(cm, rel, 0), cidx, cm, n_w, out + n_gt, need, BISECT_BITS,
                                      BITS * npass)
                    else:  # the whole window is taken
                        tl.store(out + n_gt + cj, cidx, mask=cm)
                else:
                    _resolve_store(rel, cidx, cm, n_gt, K - n_gt, npass, out, BITS)


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _bisect_store(u, j, m, L, out, K, STEP_BITS: tl.constexpr = 2, TOP_BITS=32):
    """Write the K largest of the uint32 keys ``u`` (lanes ``m``, L of them, > K; other lanes 0) as
    their positions ``j`` to out[0..K), in ascending position order, ties at the k-th value to the
    lowest positions. ``TOP_BITS`` (even, <= 32): every key is below 2**TOP_BITS (the search
    starts there; 32 for any key). ``K`` may be a run-time value. Multisection on the key bits, ``STEP_BITS`` per step: 2 (16 steps at most):
    the counts of three thresholds in 21-bit fields of one int64 block sum (lanes < 2**21); 4 (8
    steps at most): a 16-bin histogram of the next digit in 16-bit fields of four int64 sums, one
    block reduction (lanes < 2**16), the 15 threshold counts its suffix sums. Ends at the k-th key
    or as soon as the keys >= the prefix are exactly K; then one packed scan places the selection."""
    # invariant: the k-th largest key is in [p, p + 2**s - 1];
    # c_ge = #(u >= p) >= K > c_gt = #(u >= p + 2**s)
    p = tl.zeros([], dtype=tl.uint32)
    s = tl.zeros([], dtype=tl.int32) + TOP_BITS
    c_ge = L
    c_gt = tl.zeros([], dtype=tl.int32)
    while (s > 0) & (c_ge != K):
        s -= STEP_BITS
        step = tl.full([], 1, tl.uint32) << s.to(tl.uint32)
        if STEP_BITS == 2:
            t1 = p + step
            t2 = t1 + step
            t3 = t2 + step
            # the three counts (< 2**21) in 21-bit fields of one int64 sum
            v = (u >= t1).to(tl.int64) + ((u >= t2).to(tl.int64) << 21) + ((u >= t3).to(tl.int64) << 42)
            n = tl.sum(v, 0)
            c1 = (n & 0x1FFFFF).to(tl.int32)
            c2 = ((n >> 21) & 0x1FFFFF).to(tl.int32)
            c3 = (n >> 42).to(tl.int32)
            ok3 = c3 >= K
            ok2 = c2 >= K
            ok1 = c1 >= K
            c_gt = tl.where(ok3, c_gt, tl.where(ok2, c3, tl.where(ok1, c2, c1)))
            c_ge = tl.where(ok3, c3, tl.where(ok2, c2, tl.where(ok1, c1, c_ge)))
            p = tl.where(ok3, t3, tl.where(ok2, t2, tl.where(ok1, t1, p)))
        else:
            tl.static_assert(STEP_BITS == 4, "STEP_BITS must be 2 or 4")
            tl.static_assert(u.shape[0] < 65536, "16-bit histogram fields")
            # digit of the keys inside the window [p, p + 16 * step) (the keys above it are the
            # c_gt already counted, those below p count nowhere); bin v is field v % 4 of word
            # v // 4; bin 0 is not needed
            dgu = (u - p) >> s.to(tl.uint32)
            in_win = (u >= p) & (dgu < 16)
            dg = tl.where(in_win, dgu, 0).to(tl.int32)
            one = tl.where(dg > 0, tl.full([], 1, tl.int64) << ((dg % 4) * 16).to(tl.int64), 0)
            wd = dg // 4
            h0, h1, h2, h3 = tl.reduce((tl.where(wd == 0, one, 0), tl.where(wd == 1, one, 0),
                                        tl.where(wd == 2, one, 0), tl.where(wd == 3, one, 0)), 0, _add4)
            # suffix sums from bin 15 down: c_v = #(u >= p + v * step); the largest v with c_v >= K
            # moves the prefix there (c_{v+1}, counted before bin v, becomes c_gt)
            acc = c_gt
            found = tl.zeros([], dtype=tl.int1)
            n_p = p
            n_ge = c_ge
            n_gt = c_gt
            for vv in tl.static_range(15):  # bin v = 15 - vv (a compile-time constant)
                if 15 - vv >= 12:
                    hw = h3
                elif 15 - vv >= 8:
                    hw = h2
                elif 15 - vv >= 4:
                    hw = h1
                else:
                    hw = h0
                prev = acc
                acc = prev + ((hw >> (((15 - vv) % 4) * 16)) & 0xFFFF).to(tl.int32)
                hit = (acc >= K) & (found == 0)
                n_p = tl.where(hit, p + step * (15 - vv), n_p)
                n_ge = tl.where(hit, acc, n_ge)
                n_gt = tl.where(hit, prev, n_gt)
                found = found | hit
            c_gt = tl.where(found, n_gt, acc)
            c_ge = n_ge
            p = n_p
    # window [p, p + 2**s - 1]: all of it is taken when c_ge == K (early end), else s == 0 and
    # it is the k-th value, of which the lowest-position K - c_gt are taken
    width = (tl.full([], 1, tl.uint32) << s.to(tl.uint32)) - 1
    need = K - c_gt
    above = m & (u > p + width)
    win = m & (u >= p) & (u - p <= width)
    if u.shape[0] <= 16384:  # one packed scan (counts < 2**15)
        incl = tl.cumsum(above.to(tl.int32) | (win.to(tl.int32) << 16), 0)
        n_w = incl >> 16
        n_above = incl & 0xFFFF
    else:
        n_w = tl.cumsum(win.to(tl.int32), 0)
        n_above = tl.cumsum(above.to(tl.int32), 0)
    sel = above | (win & (n_w <= need))
    opos = n_above + tl.minimum(n_w, need) - 1
    tl.store(out + opos, j, mask=sel)


@triton.jit
def _topk_short_kernel(
    logits_ptr, stride_r, stride_c,
    a_ptr, b_ptr, next_n,
    out_ptr, stride_o,
    seg_gt_ptr, seg_k_ptr, seg_i_ptr, cat_k_ptr, cat_i_ptr, cnt_ptr, win_ptr,
    K: tl.constexpr, KFILL: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, BISECT_BITS: tl.constexpr,
):
    """Rows of at most BLOCK columns (the whole call when max_seq_len <= SHORT_MAX), grid (rows,):
    one program per row, one launch, no scratch (the scratch pointers are unused; same arguments as
    the other kernels). The row's logits are loaded once into registers as uint32 keys; the k-th
    largest key is found by a 4-way bisection on the key bits (2 bits per step: the counts of
    three thresholds in 21-bit fields of one int64 block sum), ending early as soon as the keys >= the current prefix are exactly K; then one packed
    scan places the selection in ascending position order (ties at the k-th value: lowest
    positions first), the same output as the radix path's rows <= CAP."""
    row = tl.program_id(0).to(tl.int64)
    rs, L = _row_range(a_ptr, b_ptr, row, next_n, MODE)
    L = tl.minimum(L, BLOCK)  # (the dispatch guarantees L <= max_seq_len <= BLOCK)
    out = out_ptr + row * stride_o
    if L <= K:
        fo = tl.arange(0, KFILL)
        for f0 in range(0, K, KFILL):
            i = f0 + fo
            tl.store(out + i, tl.where(i < L, i, -1), mask=i < K)
    else:
        j = tl.arange(0, BLOCK)
        m = j < L
        src = logits_ptr + row * stride_r + rs.to(tl.int64) * stride_c
        x = tl.load(src + j.to(tl.int64) * stride_c, mask=m, other=0.0)
        # uint32 keys in float order; lanes past the row are 0, below every threshold (>= 1)
        u = tl.where(m, _to_u(_f32_key(x)), 0)
        _bisect_store(u, j, m, L, out, K, BISECT_BITS)


# Cooperative select (COOP): several programs per row, exchanging radix histograms through global
# memory, for calls with too few rows to fill the GPU (decode: T <= 32).

_COOP_PASSES = 4  # 8-bit digits of the 32-bit key, from the top
_COOP_NB = 256
_COOP_PHASES = _COOP_PASSES + 2  # the radix passes, the count exchange, the placement
_COOP_STATE = _COOP_PASSES * _COOP_NB + 4  # int32 words per row: the pass histograms, 2 counters, pad


@triton.jit
def _coop_sync(ctr_ptr, target, SPIN: tl.constexpr):
    """Grid barrier of one row's programs (a cooperative launch makes them co-resident): arrive on
    the row's counter, wait until ``target`` arrivals. The CTA barrier before the release makes
    every thread's global writes / atomics of the phase visible with the arrival; the acquire
    orders the reads after it. Without ``SPIN`` (the interpreter: programs run one after another)
    a phase ends at its launch instead and this is a no-op."""
    if SPIN:
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
        cur = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        while cur < target:
            cur = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def _coop_digit(hist_p, k_rem):
    """From a row's complete 256-bin histogram of one digit (of the keys sharing the prefix so
    far): the digit holding the ``k_rem``-th largest key (1-based), ``k_rem`` within that digit's
    bin, and the bin's count."""
    d = tl.arange(0, 256)
    g = tl.load(hist_p + d, cache_modifier=".cg")  # L2: written by other programs' atomics
    above = tl.sum(g, 0) - tl.cumsum(g, 0)
    sel = (above < k_rem) & (k_rem <= above + g)
    return (tl.sum(tl.where(sel, d, 0), 0), k_rem - tl.sum(tl.where(sel, above, 0), 0),
            tl.sum(tl.where(sel, g, 0), 0))


@triton.jit
def _topk_coop_kernel(
    logits_ptr, stride_r, stride_c,
    a_ptr, b_ptr, next_n,
    out_ptr, stride_o,
    state_ptr, part_ptr, phase_lo, phase_hi,
    K: tl.constexpr, KFILL: tl.constexpr, MODE: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
    SPIN: tl.constexpr,
):
    """Grid (rows, C): program ``c`` of a row holds columns [c * BLOCK, (c + 1) * BLOCK) as uint32
    keys in registers. Four radix passes (8-bit digits from the top): each program adds the
    histogram of its keys that share the prefix so far to the row's global histogram of the pass,
    the row's programs meet at a barrier, and each reads the same digit from the complete
    histogram (ending early when the chosen bin holds exactly the keys still needed). Then each
    program publishes its counts above / inside the final window, meets the others once more, and
    writes its selected positions at offsets from the counts of the programs before it: the
    selection in ascending position order, ties at the k-th value to the lowest positions (the
    short kernel's output exactly). The last program of a row to finish zeroes the row's state
    (histograms, counters, counts: the whole buffer is zero between calls, CUDA-graph safe).

    ``SPIN`` (GPU, cooperative launch): one launch runs every phase with grid barriers between
    them. Without it (the interpreter, which runs programs one after another) one launch per
    phase ``[phase_lo, phase_hi)``: the launch boundary is the barrier and each launch replays the
    digits of the earlier passes from the histograms."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    rs, L = _row_range(a_ptr, b_ptr, row, next_n, MODE)
    out = out_ptr + row * stride_o
    if L <= K:
        if (c == 0) & (phase_hi == 6):  # in the last phase's launch (phases: _COOP_PHASES = 6)
            fo = tl.arange(0, KFILL)
            for f0 in range(0, K, KFILL):
                i = f0 + fo
                tl.store(out + i, tl.where(i < L, i, -1), mask=i < K)
    else:
        hist = state_ptr + row * (4 * 256 + 4)  # _COOP_STATE words per row
        ctr = hist + 4 * 256  # arrivals at the barriers; ctr + 1: programs finished
        j = c * BLOCK + tl.arange(0, BLOCK)
        m = j < L
        src = logits_ptr + row * stride_r + rs.to(tl.int64) * stride_c
        x = tl.load(src + j.to(tl.int64) * stride_c, mask=m, other=0.0)
        u = tl.where(m, _to_u(_f32_key(x)), 0)
        prefix = tl.zeros([], dtype=tl.uint32)
        pmask = tl.zeros([], dtype=tl.uint32)
        k_rem = tl.zeros([], dtype=tl.int32) + K
        done = tl.zeros([], dtype=tl.int1)
        nbar = tl.zeros([], dtype=tl.int32)
        bins = tl.arange(0, 256)
        for p in tl.static_range(4):
            if done == 0:
                if (p >= phase_lo) & (p < phase_hi):  # this launch runs pass p
                    dg = ((u >> (24 - 8 * p)) & 255).to(tl.int32)
                    h = tl.histogram(dg, 256, mask=m & ((u & pmask) == prefix))
                    tl.atomic_add(hist + p * 256 + bins, h, mask=h > 0, sem="relaxed", scope="gpu")
                    nbar += 1
                    _coop_sync(ctr, nbar * C, SPIN)
                if (p < phase_lo) | SPIN:  # pass p's histogram is complete
                    dsel, k_rem, g_sel = _coop_digit(hist + p * 256, k_rem)
                    prefix = prefix | (dsel.to(tl.uint32) << (24 - 8 * p))
                    pmask = pmask | (tl.full([], 255, tl.uint32) << (24 - 8 * p))
                    done = g_sel == k_rem
        # the window [prefix, prefix | ~pmask] holds the k-th largest key; k_rem of its keys are
        # taken (all of them after an early end, else the lowest-position ties of one value)
        hi = prefix | (pmask ^ 0xFFFFFFFF)
        above = m & (u > hi)
        win = m & (u >= prefix) & (u <= hi)
        pc = part_ptr + row * (2 * C)
        if (4 >= phase_lo) & (4 < phase_hi):  # publish this program's counts
            tl.store(pc + 2 * c, tl.sum(above.to(tl.int32), 0))
            tl.store(pc + 2 * c + 1, tl.sum(win.to(tl.int32), 0))
            nbar += 1
            _coop_sync(ctr, nbar * C, SPIN)
        if phase_hi == 6:  # (last phase) place the selection, then the last program out resets the row's state
            cs = tl.arange(0, C)
            pa = tl.load(pc + 2 * cs, cache_modifier=".cg")
            pw = tl.load(pc + 2 * cs + 1, cache_modifier=".cg")
            w_before = tl.cumsum(pw, 0) - pw  # window keys of the programs before each
            taken = tl.minimum(tl.maximum(k_rem - w_before, 0), pw)
            before = cs < c
            base_sel = tl.sum(tl.where(before, pa + taken, 0), 0)
            base_w = tl.sum(tl.where(before, pw, 0), 0)
            n_w = tl.cumsum(win.to(tl.int32), 0)
            sel = above | (win & (base_w + n_w <= k_rem))
            opos = base_sel + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(out + opos, j, mask=sel)
            old = tl.atomic_add(ctr + 1, 1, sem="acq_rel", scope="gpu")
            if old == C - 1:
                z = tl.zeros([256], dtype=tl.int32)
                for p in tl.static_range(4):
                    tl.store(hist + p * 256 + bins, z)
                tl.store(ctr, 0)
                tl.store(ctr + 1, 0)
                # the counts too: a later call with more rows has its state where they were
                tl.store(pc + tl.arange(0, 2 * C), tl.zeros([2 * C], dtype=tl.int32))


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


# Radix digit width of every select (constexpr BITS). 8-bit digits take 4 passes for a 32-bit key
# where 4-bit digits take 8, but each pass's 256-bin histogram costs more than the passes saved: on
# the H200 (bench/dsa_indexer.py --sweep) the top-k with BITS=8 took 17.9 us at 4k T=128 against
# 13.1 us with BITS=4, and 35.4 / 40.0 / 54.3 us at 32k T=1/16/64 against 27.1 / 28.9 / 39.4 us.
RADIX_BITS = 4
# Shortest row segment one program of the streaming pass takes when rows are split (SPLIT).
# 4096 against 8192 on an H100 (bench/results/topk_sweep2_h100.json): 32k T = 1 / 16 24.0 / 27.3 ->
# 21.9 / 25.5 us (8 segments instead of 4), 128k T = 1 unchanged (16 either way).
SEG_MIN = 4096
# Calls whose rows are all at most this long (max_seq_len) take the one-launch register-resident
# select (``_topk_short_kernel``) unless ``SHORT=False`` is passed: its packed 16-bit counts hold
# rows up to 32767 columns, its registers (no spills on sm_90 / sm_120) rows up to 8192.
SHORT_MAX = 8192
# Key bits the register-resident select (``_bisect_store``: the short-row kernel, and the merge
# kernel's rows <= CAP) settles per step: 2 (three threshold counts per block sum, up to 16
# steps) or 4 (a 16-bin histogram per block reduction, up to 8 steps).
BISECT_BITS = 2
# Long rows (> CAP): the merge kernel selects from the segments' windows in registers
# (``_merge_regs``) instead of concatenating them through global memory and radix-resolving the
# concatenation. Same output (tested). Off: timed on an H100 (2026-12-06,
# bench/results/indexer_h100_merge_regs.json) it was 1-12% slower than the concatenating merge at
# 32k T = 1/16/64 and 128k T = 1/16 (docs/notes/dsa_indexer.md, "Register merge").
MERGE_REGS = False
# Long rows: the merge kernel resolves the window with the short rows' register bisection
# (``_bisect_store`` on the window's keys relative to its low end) instead of the radix select's
# shared-memory histograms. Same output, order included (tested). On an H100 (2026-12-07,
# bench/results/topk_sweep3_h100.json) it took the top-k from 22.0 / 25.5 / 31.0 to 19.6 / 22.6 /
# 26.5 us at 32k T = 1 / 16 / 32 and from 31.2 to 28.1 at 128k T = 1 (the merge kernel 13.0 ->
# 10.7, 15.8 -> 11.3 us). Not on SM12x (``topk_config``): there, with Triton 3.6, the split merges
# (8-bit digits) need a 32 B stack frame with it.
MERGE_BISECT = True
# The pivot window's two sample order statistics: leading bits resolved (``SAMPLE_BITS``; hi is
# rounded up and lo down past them, so fewer bits only widen the window) and whether one
# histogram per pass serves both ranks while they share their digits (``SAMPLE_JOINT``).
# Timed on an H100 (2026-12-07, bench/results/topk_breakdown_h100.json): 16 bits with the joint
# histogram took the top-k from 29.6 / 26.9 / 37.5 to 27.1 / 24.0 / 33.4 us at 32k T = 1 / 16 / 64
# and from 54.8 to 45.7 us at 128k T = 16 (20 bits joint: 27.9 / 25.1 / 34.9 / 48.9), same output.
SAMPLE_BITS = 16
SAMPLE_JOINT = True
# Calls with too few rows to fill the GPU and rows longer than SHORT_MAX: the cooperative select
# (``_topk_coop_kernel``, one cooperative launch, C programs per row meeting at grid barriers)
# instead of the segment + merge launches. On an H100 (2026-12-07, topk_sweep3_h100.json; the
# default then without MERGE_BISECT): 32k T = 1 / 16 13.3 / 19.8 us against 22.0 / 25.5 (merge
# bisection 19.6 / 22.6), 128k T = 1 15.0 against 31.2; it lost where each program held 8192 keys
# (32k T = 32: 37.2 against 31.0 / 26.5) and against the one-launch short kernel on 4k rows (10.0 /
# 13.2 / 13.3 against 7.4 / 8.6 / 9.7 us at T = 1 / 16 / 32), so it takes at most COOP_MAX_BLOCK
# keys per program and only rows the short kernel cannot.
COOP = True
# Keys per program of the cooperative select: at most COOP_MAX_BLOCK (16 registers of keys per
# thread at 8 warps), programs added (powers of two, while the grid stays within one CTA per SM)
# down to COOP_MIN_BLOCK.
COOP_MAX_BLOCK = 4096
COOP_MIN_BLOCK = 1024
# CTAs of the cooperative select per SM the grid may take (rows x C <= this x SMs). 1 is what was
# timed; 2 would take 32k rows at T = 32 (C 8) and T = 16 with 2048 keys per program (C 16), 4 up
# to T = 64. Its programs need 48-109 registers and 1 KB of shared memory (sm_120, Triton 3.8):
# two 8-warp CTAs of 4096 keys (109 registers) fit an SM, four do not, so a 4-per-SM grid of them
# is refused by the driver and that call falls back (``_COOP_REFUSED``, warned once). An option
# until timed (``COOP_CTAS_PER_SM`` override, 1..COOP_MAX_CTAS_PER_SM).
COOP_CTAS_PER_SM = 1
COOP_MAX_CTAS_PER_SM = 4


def coop_shape(k: int, max_seq_len: int, rows: int, num_sms: int,
               ctas_per_sm: int = COOP_CTAS_PER_SM) -> tuple[int, int] | None:
    """(programs per row C, keys per program BLOCK) of the cooperative select, or None where it
    does not apply: every row fits k (filled), or fewer than 2 programs per row fit
    ``ctas_per_sm`` CTAs per SM (a cooperative launch needs the whole grid co-resident: rows x C
    <= ctas_per_sm x SMs)."""
    if max_seq_len <= k or rows < 1:
        return None
    slots = num_sms * ctas_per_sm
    c = triton.next_power_of_2(triton.cdiv(max_seq_len, COOP_MAX_BLOCK))
    while rows * c * 2 <= slots and triton.cdiv(max_seq_len, c * 2) >= COOP_MIN_BLOCK:
        c *= 2
    if c < 2 or rows * c > slots:
        return None
    return c, max(256, triton.next_power_of_2(triton.cdiv(max_seq_len, c)))


def topk_config(k: int, max_seq_len: int, rows: int = 1, num_sms: int = 132, seg_min: int = SEG_MIN,
                bits: int = RADIX_BITS, arch_major: int = 0) -> dict:
    """Constexprs and launch options for a top-``k`` over ``rows`` rows of at most ``max_seq_len``
    on a GPU of compute-capability major ``arch_major`` (0: unknown / interpreter).

    Picked from host-known sizes only (graph-safe). ``S`` (pivot sample) grows with the row so that
    the expected window, ~ 2 * ZSIGMA * sqrt(k * L / S), stays well below ``CAP``. ``SPLIT``
    programs share a row when there are too few rows to fill the GPU (segments of >= 8192).
    """
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    cap = max(4096, 2 * triton.next_power_of_2(k))
    z = 4.5
    if max_seq_len <= 65536:
        s = 2048
    elif max_seq_len <= 262144:
        s = 4096
    else:
        # > 256k (GLM-5.2's 1M): a larger sample and a narrower margin keep the window ~3.7k < CAP
        # at 1M; the window then misses ~0.3% of rows per side, which take the exact fallback.
        s = 8192
        z = 3.0
    big = cap > 4096
    # power-of-two SPLIT (fewer distinct compiles): >= ~2 programs per SM, segments >= 8192
    want = max(1, (2 * num_sms) // max(rows, 1))
    split = 1
    while split * 2 <= min(16, want, max(1, max_seq_len // seg_min)):
        split *= 2
    # register budget (checked with cuobjdump, no spills on sm_90 / sm_120): CAP 4096 -> 8 warps,
    # 2048-wide chunks; CAP 8192 (k > 2048) -> 16 warps, 1024-wide chunks. The merge kernel always
    # takes 16 warps: at 8 it spills 64 B of stack on sm_120 with Triton 3.8 (vLLM 0.33.0's pin).
    if bits not in (4, 8):
        raise ValueError(f"radix digit width must be 4 or 8 bits, got {bits}")
    # The merge of split rows (SPLIT > 1) on SM12x keeps 8-bit digits: with 4 it needs a 24-40 B
    # stack frame at 16 warps on sm_120 with Triton 3.6 (tools/sm120_check.py); with 8 it needs
    # none. Elsewhere it takes ``bits``: on the H200 8-bit digits there cost 4-9 us per call at
    # 32k/128k (top-k 31.0 / 35.6 / 47.2 us at 32k T=1/16/64 against 27.1 / 28.7 / 39.3 us with
    # 4; bench/results/indexer_h200_merge_bits.json).
    merge_bits = 8 if (split > 1 and arch_major == 12) else bits
    # rows <= SHORT_MAX: one launch of _topk_short_kernel, BLOCK = the row width rounded up to a
    # power of two (>= 1024), 4 warps up to 2048, 8 above (16 keys per thread at 4096, 32 at 8192).
    # On an H100 8 warps beat 16 at 4096: 7.5 / 8.5 / 9.1 / 10.2 against 8.0 / 9.1 / 9.8 / 10.8 us at
    # T = 1 / 16 / 64 / 128 (bench/results/topk_breakdown_h100.json), and at 8192: 13.4 / 15.3
    # against 13.7 / 15.6 at T = 1 / 64 (4 warps: 16.8 / 19.6); at 2048 4 and 8 tie (1.1 / 1.5 us,
    # 16 warps 1.3 at T = 1; topk_sweep2_h100.json).
    short_block = max(1024, triton.next_power_of_2(max(max_seq_len, 1)))
    return dict(S=s, CAP=cap, CHUNK=1024 if big else 2048, RCHUNK=256, ZSIGMA=z, SPLIT=split, GCHUNK=1024, BITS=bits,
                MERGE_BITS=merge_bits,
                KFILL=min(1024, triton.next_power_of_2(k)), num_warps=16 if big else 8, merge_warps=16,
                SHORT=max_seq_len <= SHORT_MAX, SHORT_BLOCK=short_block, SHORT_SELECT=True, BISECT_BITS=BISECT_BITS,
                MERGE_REGS=MERGE_REGS, MERGE_BISECT=MERGE_BISECT and arch_major != 12, SAMPLE_BITS=SAMPLE_BITS,
                # the joint select holds both ranks' histograms: with the 8192-key sample (rows >
                # 256k) it needs an 8 B stack frame on sm_120 (Triton 3.8, split rows); two selects
                # there (92 registers, none)
                SAMPLE_JOINT=SAMPLE_JOINT and s <= 4096,
                short_warps=min(8, max(4, short_block // 512)), COOP=COOP and max_seq_len > SHORT_MAX,
                COOP_CTAS_PER_SM=COOP_CTAS_PER_SM)


def merge_segcap(cap: int, split: int) -> int:
    """Lanes per segment of the register merge (``MERGE_REGS``): at most 8192 lanes in all (the
    short kernel's register budget); a segment whose window is larger takes the concatenating
    path. The expected window of a whole row is ~2 x ZSIGMA x sqrt(k L / S) (~1.6k at 32k), so a
    segment's share is far below its lanes."""
    return min(cap, 8192 // triton.next_power_of_2(max(split, 1)))


def _scratch_layout(rows: int, k: int, cap: int, split: int) -> dict:
    sizes = {"seg_gt": rows * split * k if split > 1 else 1, "seg_k": rows * split * cap if split > 1 else 1,
             "seg_i": rows * split * cap if split > 1 else 1, "cat_k": rows * cap, "cat_i": rows * cap,
             "cnt": rows * split * 2, "win": rows * 2}
    out, off = {}, 0
    for name, n in sizes.items():
        n = (n + 3) // 4 * 4  # 16-byte aligned sub-buffers
        out[name] = (off, n)
        off += n
    out["total"] = off
    return out


def _as_int32_scratch(t: torch.Tensor | None) -> torch.Tensor | None:
    """An int32 view of a contiguous scratch buffer of any dtype (vLLM's workspace manager hands
    out uint8 views), or None when it cannot be viewed so (16-byte aligned sub-buffers need a
    4-byte multiple)."""
    if t is None or not t.is_contiguous() or (t.numel() * t.element_size()) % 4 or t.data_ptr() % 16:
        return None
    return t.reshape(-1).view(torch.int32) if t.dtype != torch.int32 else t.reshape(-1)


def topk_workspace_bytes(k: int, max_rows: int, max_seq_len: int, num_sms: int | None = None,
                         device: torch.device | str | None = None) -> int:
    """Bytes of scratch that covers every top-k call with at most ``max_rows`` rows of at most
    ``max_seq_len`` columns (``scratch=`` of the entries; what vLLM reserves in its memory
    profiling run, from max_num_batched_tokens and max_model_len). The scratch of one call is
    ``_scratch_layout(rows, k, CAP, SPLIT)`` int32 words: 2 x rows x CAP (candidate keys and
    positions, the 8 x rows x CAP bytes that dominate at large batch) plus, when rows are split,
    rows x SPLIT x (k + 2 CAP). SPLIT grows as rows shrink, so the maximum over rows <= max_rows is
    taken at the largest row count of each SPLIT regime. ``num_sms`` defaults to the SM count the
    launch uses on ``device`` (8 off CUDA / in the interpreter, as the launch)."""
    if max_rows <= 0:
        return 0
    if num_sms is None:
        dev = torch.device(device) if device is not None else None
        if dev is None or dev.type != "cuda" or _interpret():
            num_sms = 8
        else:
            num_sms = _num_sms(dev.index if dev.index is not None else torch.cuda.current_device())
    cands = {max_rows}
    for sp in (1, 2, 4, 8, 16):  # largest rows with (2 * sms) // rows >= sp
        r = (2 * num_sms) // sp
        if 1 <= r <= max_rows:
            cands.add(r)
    words = 0
    for r in cands:
        cfg = topk_config(k, max_seq_len, r, num_sms)
        words = max(words, _scratch_layout(r, k, cfg["CAP"], cfg["SPLIT"])["total"])
    return 4 * words


def call_config(k: int, max_seq_len: int, rows: int, num_sms: int, arch_major: int,
                overrides: dict | None = None) -> tuple[dict, int, int]:
    """One call's launch configuration: the dispatch's (``topk_config``) with the caller's keyword
    overrides applied (``SEG_MIN`` and ``BITS`` go into ``topk_config``; ``SHORT=False`` also turns
    ``SHORT_SELECT`` and ``COOP`` off: the radix path throughout, for A/B runs). Returns (cfg,
    num_warps, merge_warps); ``cfg`` is what ``_launch_plan`` and ``call_coop`` take."""
    over = dict(overrides or {})
    cfg = topk_config(k, max_seq_len, rows, num_sms, seg_min=over.pop("SEG_MIN", SEG_MIN),
                      bits=over.pop("BITS", RADIX_BITS), arch_major=arch_major)
    cfg.update(over)
    if over.get("SHORT") is False:
        cfg["COOP"] = False
        if "SHORT_SELECT" not in over:
            cfg["SHORT_SELECT"] = False
    return cfg, cfg.pop("num_warps"), cfg.pop("merge_warps")


def call_coop(cfg: dict, k: int, max_seq_len: int, rows: int, num_sms: int) -> tuple[int, int] | None:
    """(C, BLOCK) of the cooperative select a call of config ``cfg`` runs, or None (the launch,
    the compile specs and the benchmark's plan all decide here)."""
    if not cfg.get("COOP"):
        return None
    ctas = cfg.get("COOP_CTAS_PER_SM", COOP_CTAS_PER_SM)
    if not isinstance(ctas, int) or not 1 <= ctas <= COOP_MAX_CTAS_PER_SM:
        raise ValueError(f"COOP_CTAS_PER_SM must be an int in 1..{COOP_MAX_CTAS_PER_SM} (the cooperative "
                         f"state is sized for that many), got {ctas!r}")
    return coop_shape(k, max_seq_len, rows, num_sms, ctas)


def _launch(logits, a, b, out, next_n, k, mode, max_seq_len, scratch=None, **overrides):
    key = p = None
    if not overrides:
        key = _plan_key(logits, a, b, out, next_n, k, mode, max_seq_len, scratch)
        p = _PLANS.get(key) if key is not None else None
        if p is not None and _hooks_off() and _launch_direct(p, logits, a, b, out, next_n, scratch):
            return out
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, cols], got shape {tuple(logits.shape)}")
    if out.dtype != torch.int32:
        raise TypeError(f"indices must be int32, got {out.dtype}")
    if out.dim() != 2 or out.stride(1) != 1 or out.shape[1] < k:
        raise ValueError(f"indices must be [rows, >= k] with contiguous rows, got {tuple(out.shape)}, "
                         f"stride {out.stride()}")
    for name, t in (("row starts/lengths", a), ("row ends", b)):
        if t is not None and t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    rows = out.shape[0]
    if rows == 0:
        return out
    on_gpu = logits.device.type == "cuda" and not _interpret()
    sms = _num_sms(logits.device.index or 0) if on_gpu else 8
    major = _arch_major(logits.device.index or 0) if on_gpu else 0
    cfg, num_warps, merge_warps = call_config(k, max_seq_len, rows, sms, major, overrides)
    split = cfg["SPLIT"]
    if cfg["SHORT"] and max_seq_len > SHORT_MAX:
        raise ValueError(f"SHORT=True takes rows of at most SHORT_MAX = {SHORT_MAX} columns, got max_seq_len "
                         f"{max_seq_len}")
    plan = p if p is not None else _TopkPlan(rows, sms, k, cfg,
                                             _launch_plan(cfg, k, mode, max_seq_len, num_warps, merge_warps))
    coop = call_coop(cfg, k, max_seq_len, rows, sms)
    if coop is not None and plan.coop is None:
        plan.coop, plan.coop_key = coop, _coop_refusal_key(logits.device, rows, coop)
        plan.coop_launch = coop_launch(k, mode, cfg, coop)
    if coop is not None and plan.coop_key not in _COOP_REFUSED:
        ok, ck = _launch_coop(logits, a, b if b is not None else a, out, next_n, k, mode, cfg, coop, on_gpu, sms)
        if ok:
            # the plan is kept with what has compiled so far; a later call of the key that must
            # take the other path (a capturing stream before the cooperative state exists, a
            # refusal) comes back here once to compile and add it
            if plan.coop_direct is None:
                plan.coop_direct = _direct_entry(plan.coop_launch[0], ck, (rows, coop[0]), plan.coop_launch[1])
            if key is not None and plan.coop_direct is not None:
                _remember(_PLANS, key, plan)
            return out
    lay = plan.lay
    if plan.short:  # no scratch (the kernel takes the same pointer arguments and ignores them)
        bufs = [out] * (len(lay) - 1)
    else:
        sc = _as_int32_scratch(scratch)
        plan.scratch_ok = sc is not None and sc.numel() >= lay["total"]
        scratch = sc if plan.scratch_ok else torch.empty(lay["total"], dtype=torch.int32, device=logits.device)
        bufs = [scratch[v[0]:v[0] + v[1]] for name, v in lay.items() if name != "total"]
    b = b if b is not None else a
    common = (logits, logits.stride(0), logits.stride(1), a, b, next_n, out, out.stride(0), *bufs)
    entries = []
    for kern, consts, nw in plan.launches:
        grid = (rows, split) if kern is _topk_segment_kernel else (rows, 1)
        ck = kern[grid](*common, **consts, num_warps=nw)
        entries.append(_direct_entry(kern, ck, grid, consts))
    if all(e is not None for e in entries):  # compiled kernels (never in the interpreter)
        plan.direct = entries
        if key is not None:
            _remember(_PLANS, key, plan)
    return out


# Host side of a call (issue 12 via issue 11's "launch cost"): vLLM's piecewise CUDA graphs run the
# indexer eagerly for prefill and mixed batches, once per layer. A call's validation, dispatch
# (topk_config), scratch layout and Triton's JIT binding / specialization are worked out once per
# key (every tensor's shape, strides, dtype, device and 16-byte alignment, and the scalars: all the
# kernels specialize on); later calls with the key launch the compiled kernels directly with
# pointers as integers. Calls with overrides (tuning), a launch hook (profilers) or a misaligned
# pointer take the path above every time. A cooperative plan also holds the segment / short
# launches that calls of its shape take when the cooperative one cannot run.
_PLANS: dict = {}
_PLANS_MAX = 512


class _TopkPlan:
    __slots__ = ("rows", "num_sms", "split", "lay", "launches", "short", "scratch_ok", "direct",
                 "coop", "coop_key", "coop_launch", "coop_direct")

    def __init__(self, rows: int, num_sms: int, k: int, cfg: dict, launches: list):
        self.rows, self.num_sms, self.split = rows, num_sms, cfg["SPLIT"]
        self.lay = _scratch_layout(rows, k, cfg["CAP"], cfg["SPLIT"])
        self.launches, self.short = launches, bool(cfg["SHORT"])
        self.scratch_ok, self.direct = False, None
        self.coop = self.coop_key = self.coop_launch = self.coop_direct = None


def _plan_key(logits, a, b, out, next_n, k, mode, max_seq_len, scratch):
    """The plan-cache key of a call, or None (a pointer that is not 16-byte aligned: Triton
    specializes the kernels on pointer alignment)."""
    ptrs = logits.data_ptr() | a.data_ptr() | out.data_ptr()
    kb = ks = None
    if b is not None:
        ptrs |= b.data_ptr()
        kb = (b.shape, b.stride(), b.dtype, b.device)
    if scratch is not None:
        ptrs |= scratch.data_ptr()
        ks = (scratch.shape, scratch.stride(), scratch.dtype, scratch.device)
    if ptrs & 15:
        return None
    return (logits.shape, logits.stride(), logits.dtype, logits.device, a.shape, a.stride(), a.dtype, a.device, kb,
            out.shape, out.stride(), out.dtype, out.device, next_n, k, mode, max_seq_len, ks)


def _remember(table: dict, key, plan) -> None:
    """Keep ``plan`` under ``key`` in a plan table (this file's and the paged logits')."""
    if key not in table and len(table) >= _PLANS_MAX:  # shapes follow the batch: bounded, oldest out
        table.pop(next(iter(table)))
    table[key] = plan


def _hooks_off() -> bool:
    """No Triton launch hook is registered (profilers add one: then launches take Triton's path)."""
    rt = _knobs.runtime
    return not any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def _direct_entry(fn, ck, grid: tuple, consts: dict):
    """``(run, head, grid, tail)`` to launch the compiled kernel ``ck`` of ``fn`` again without
    Triton's JIT path: ``run(gx, gy, 1, stream, *head, *positional_args, *tail)``, ``tail`` the
    constexpr values in the signature's order (defaults where not given), as Triton's own
    ``CompiledKernel.run`` call passes them. None where ``ck`` is no compiled kernel (interpreter)."""
    if ck is not None and hasattr(ck, "result") and not hasattr(ck, "packed_metadata"):
        ck = ck.result()
    if not (hasattr(ck, "packed_metadata") and hasattr(ck, "function")):
        return None
    params = inspect.signature(fn.fn).parameters
    names = list(params)
    first = min(i for i, n in enumerate(names) if n in consts)
    tail = tuple(consts[n] if n in consts else params[n].default for n in names[first:])
    return ck.run, (ck.function, ck.packed_metadata, None, None, None), grid, tail


def _raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as the raw handle Triton launches on."""
    return torch._C._cuda_getCurrentRawStream(index)


def _launch_direct(p: _TopkPlan, logits, a, b, out, next_n, scratch) -> bool:
    """Launch a planned call's compiled kernels; False (nothing launched) where the path this call
    must take has not been compiled yet (the caller then takes Triton's path once)."""
    stream = _raw_stream(logits.device.index or 0)
    lp, ap, op = logits.data_ptr(), a.data_ptr(), out.data_ptr()
    bp = b.data_ptr() if b is not None else ap
    head = (lp, logits.stride(0), logits.stride(1), ap, bp, next_n, op, out.stride(0))
    if p.coop is not None and p.coop_key not in _COOP_REFUSED:
        buf = _coop_buffer(logits.device, p.num_sms)
        if buf is not None:
            if p.coop_direct is None:
                return False
            run, h, grid, tail = p.coop_direct
            sp = buf.data_ptr()
            try:
                run(grid[0], grid[1], 1, stream, *h, *head, sp, sp + 4 * p.rows * _COOP_STATE, 0, _COOP_PHASES, *tail)
                return True
            except RuntimeError as e:  # refused: as in _launch_coop, then the other path
                if "cooperative" not in str(e).lower():
                    raise
                _refused(p.coop_key, p.rows, p.coop, e)
    if p.direct is None:
        return False
    if p.short:
        bufs = (op,) * (len(p.lay) - 1)
    else:  # the caller's scratch where it holds the layout, else one allocated for this call
        if not p.scratch_ok:
            scratch = torch.empty(p.lay["total"], dtype=torch.int32, device=logits.device)
        sp = scratch.data_ptr()
        bufs = tuple(sp + 4 * v[0] for name, v in p.lay.items() if name != "total")
    for run, h, grid, tail in p.direct:
        run(grid[0], grid[1], 1, stream, *h, *head, *bufs, *tail)
    return True


# Per-(device, stream) zeroed state of the cooperative select (the row histograms and counters,
# then the per-program counts; all zero between calls: the last program of a row resets its own).
# Calls on one stream are ordered. Sized once for any call coop_shape admits at up to
# COOP_MAX_CTAS_PER_SM CTAs per SM (rows x C <= 4 x SMs, C >= 2: at most 2 x SMs rows; ~1.1 MB at
# 132 SMs), so it never grows inside a graph capture.
_COOP_BUFS: dict = {}


def coop_buffer_words(num_sms: int, ctas_per_sm: int = COOP_MAX_CTAS_PER_SM) -> int:
    """int32 words of the cooperative state that covers every call on a GPU of ``num_sms`` SMs
    with up to ``ctas_per_sm`` CTAs per SM: rows x (state + 2 C) with rows x C <= slots, C >= 2."""
    slots = num_sms * ctas_per_sm
    return (slots // 2) * _COOP_STATE + 2 * slots


def _coop_buffer(device: torch.device, num_sms: int) -> torch.Tensor | None:
    """The stream's zeroed state, or None when it does not exist yet and the stream is capturing a
    CUDA graph: a zeroing captured there would only run at replay, and an eager call on that
    stream before it would find garbage in the barrier counters (the caller takes the other path;
    vLLM's warm-up runs before each capture create it)."""
    on_gpu = device.type == "cuda"
    idx = (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else -1
    key = (device.type, idx, torch.cuda.current_stream(idx).cuda_stream if on_gpu else 0)
    buf = _COOP_BUFS.get(key)
    if buf is None:
        if on_gpu and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(coop_buffer_words(num_sms), dtype=torch.int32, device=device)
        _COOP_BUFS[key] = buf
    return buf


def coop_launch(k: int, mode: int, cfg: dict, coop: tuple[int, int]) -> tuple:
    """(kernel, constexprs, num_warps) of a cooperative select (the launch and the compile specs)."""
    c, block = coop
    return (_topk_coop_kernel, dict(K=k, KFILL=cfg["KFILL"], MODE=mode, C=c, BLOCK=block, SPIN=True),
            4 if block <= 2048 else 8)


# (device index, grid size, keys per program) of cooperative launches the driver refused (e.g. fewer
# SMs usable than the device has, under MPS limits or green contexts, or more CTAs per SM than the
# program's registers allow): those calls take the other path from then on. The keys per program
# set the warps and registers, so a grid refused at 4096 keys may still fit at 1024.
_COOP_REFUSED: set = set()


def _coop_refusal_key(device: torch.device, rows: int, coop: tuple[int, int]) -> tuple[int, int, int]:
    """The ``_COOP_REFUSED`` entry of a cooperative launch of ``rows`` rows at ``coop`` = (C, BLOCK)."""
    return (device.index or 0, rows * coop[0], coop[1])


def _launch_coop(logits, a, b, out, next_n, k, mode, cfg, coop, on_gpu, num_sms) -> tuple[bool, object]:
    """Run the cooperative select: (launched, what Triton's launch returned). Not launched where
    the driver refused the cooperative launch (then the caller takes the other path; warned once
    per grid size) or the stream is capturing a graph before its state exists."""
    rows = out.shape[0]
    c, block = coop
    buf = _coop_buffer(logits.device, num_sms)
    if buf is None:  # first call on a capturing stream: the other path (see _coop_buffer)
        return False, None
    state, part = buf[:rows * _COOP_STATE], buf[rows * _COOP_STATE:rows * (_COOP_STATE + 2 * c)]
    kern, consts, nw = coop_launch(k, mode, cfg, coop)
    args = (logits, logits.stride(0), logits.stride(1), a, b, next_n, out, out.stride(0), state, part)
    if on_gpu:  # one launch, every phase; the cooperative launch guarantees co-residency (or fails)
        try:
            ck = kern[(rows, c)](*args, 0, _COOP_PHASES, **consts, num_warps=nw, launch_cooperative_grid=True)
        except RuntimeError as e:  # CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: not launched, not sticky
            if "cooperative" not in str(e).lower():
                raise
            _refused(_coop_refusal_key(logits.device, rows, coop), rows, coop, e)
            return False, None
        return True, ck
    # the interpreter runs programs one after another: one launch per phase, no spinning
    consts["SPIN"] = False
    for ph in range(_COOP_PHASES):
        kern[(rows, c)](*args, ph, ph + 1, **consts, num_warps=nw)
    return True, None


def _refused(refusal_key: tuple, rows: int, coop: tuple[int, int], err: Exception) -> None:
    """Remember a cooperative launch the driver refused (its shape takes the other path from now on)."""
    _COOP_REFUSED.add(refusal_key)
    warnings.warn(f"dsa top-k: the driver refused a cooperative launch of {rows * coop[0]} CTAs of {coop[1]} keys "
                  f"({err}); calls of this shape take the segment / short path", RuntimeWarning, stacklevel=4)


def _launch_plan(cfg: dict, k: int, mode: int, max_seq_len: int, num_warps: int, merge_warps: int):
    """The kernels one top-k call launches, in order, with their constexprs and warps (used by the
    launch and by SM120_COMPILE_SPECS, so the specs are exactly what the dispatch launches)."""
    cap, split = cfg["CAP"], cfg["SPLIT"]
    if cfg.get("SHORT"):  # every row <= SHORT_MAX: one launch, one program per row
        return [(_topk_short_kernel, dict(K=k, KFILL=cfg["KFILL"], MODE=mode, BLOCK=cfg["SHORT_BLOCK"],
                                          BISECT_BITS=cfg["BISECT_BITS"]), cfg["short_warps"])]
    plan = []
    if max_seq_len > cap:  # rows longer than CAP exist: pass 1 (rows <= CAP are skipped there)
        plan.append((_topk_segment_kernel, dict(K=k, MODE=mode, S=cfg["S"], CAP=cap, CHUNK=cfg["CHUNK"],
                                                ZSIGMA=cfg["ZSIGMA"], SPLIT=split, BITS=cfg["BITS"],
                                                SAMPLE_BITS=cfg["SAMPLE_BITS"],
                                                SAMPLE_JOINT=int(bool(cfg["SAMPLE_JOINT"]))),
                     num_warps))
    plan.append((_topk_merge_kernel, dict(K=k, KFILL=cfg["KFILL"], MODE=mode, CAP=cap, CHUNK=cfg["CHUNK"],
                                          RCHUNK=cfg["RCHUNK"], SPLIT=split, SPLIT_P=triton.next_power_of_2(split),
                                          GCHUNK=cfg["GCHUNK"], BITS=cfg.get("MERGE_BITS", cfg["BITS"]),
                                          SHORT_SELECT=int(bool(cfg.get("SHORT_SELECT", True))),
                                          BISECT_BITS=cfg["BISECT_BITS"], MERGE_REGS=int(bool(cfg.get("MERGE_REGS"))),
                                          SEGCAP=cfg.get("SEGCAP") or merge_segcap(cap, split),
                                          MERGE_BISECT=int(bool(cfg.get("MERGE_BISECT", MERGE_BISECT)))),
                 merge_warps))
    return plan


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _arch_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def topk_rows(logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None,
              **overrides) -> torch.Tensor:
    """Top-``k`` of ``logits[r, :lengths[r]]`` for every row (convenience entry)."""
    lengths = lengths.reshape(-1)
    if out is None:
        out = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    if lengths.numel() != logits.shape[0]:
        raise ValueError(f"lengths has {lengths.numel()} entries for {logits.shape[0]} rows")
    return _launch(logits, lengths, None, out, 1, k, _MODE_ROW_LENGTHS, logits.shape[1], **overrides)


def top_k_per_row_prefill(logits: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                          raw_topk_indices: torch.Tensor, num_rows: int, stride0: int, stride1: int,
                          topk_tokens: int, **overrides) -> None:
    """Drop-in for ``vllm._custom_ops.top_k_per_row_prefill``: row ``r`` ranges over columns
    ``[cu_seqlen_ks[r], cu_seqlen_ke[r])``; indices are written relative to ``cu_seqlen_ks[r]``."""
    lg = torch.as_strided(logits, (num_rows, logits.shape[1]), (stride0, stride1))
    out = raw_topk_indices[:num_rows]
    if cu_seqlen_ks.numel() < num_rows or cu_seqlen_ke.numel() < num_rows:
        raise ValueError("cu_seqlen_ks / cu_seqlen_ke need one entry per row")
    _launch(lg, cu_seqlen_ks, cu_seqlen_ke, out, 1, topk_tokens, _MODE_STARTS_ENDS, logits.shape[1],
            **overrides)


def top_k_per_row_decode(logits: torch.Tensor, next_n: int, seq_lens: torch.Tensor, raw_topk_indices: torch.Tensor,
                         num_rows: int, stride0: int, stride1: int, topk_tokens: int, **overrides) -> None:
    """Drop-in for ``vllm._custom_ops.top_k_per_row_decode``. ``seq_lens`` 1-D ``[B]``: row ``r``
    covers ``[0, seq_lens[r // next_n] - next_n + r % next_n + 1)``; 2-D ``[B, next_n]``: row ``r``
    covers ``[0, seq_lens.flatten()[r])`` (upstream's ``seqLensIs2D``)."""
    lg = torch.as_strided(logits, (num_rows, logits.shape[1]), (stride0, stride1))
    out = raw_topk_indices[:num_rows]
    if seq_lens.dim() == 2:
        lens = seq_lens.reshape(-1)
        if lens.numel() < num_rows:
            raise ValueError(f"2-D seq_lens has {lens.numel()} entries for {num_rows} rows")
        _launch(lg, lens, None, out, 1, topk_tokens, _MODE_ROW_LENGTHS, logits.shape[1], **overrides)
    elif seq_lens.dim() == 1:
        if next_n < 1:
            raise ValueError(f"next_n must be >= 1, got {next_n}")
        _launch(lg, seq_lens, None, out, next_n, topk_tokens, _MODE_SEQLEN_NEXTN, logits.shape[1], **overrides)
    else:
        raise ValueError(f"seq_lens must be 1-D or 2-D, got {seq_lens.dim()}-D")


def persistent_topk(logits: torch.Tensor, lengths: torch.Tensor, output: torch.Tensor,
                    workspace: torch.Tensor | None, k: int, max_seq_len: int, **overrides) -> None:
    """Drop-in for ``torch.ops._C.persistent_topk(logits, lengths, output, workspace, k,
    max_seq_len)``: row ``r`` covers ``[0, lengths.flatten()[r])``. Any ``k`` is accepted (upstream:
    512/1024/2048). ``workspace`` is used as the candidate scratch when it is int32-viewable and
    holds the scratch (``_scratch_layout``; vLLM's 1 MiB buffer is too small for k = 2048 at
    large batch, then a scratch is allocated, graph-safe)."""
    lens = lengths.reshape(-1)
    rows = logits.shape[0]
    if lens.numel() != rows:
        raise ValueError(f"lengths has {lens.numel()} entries for {rows} logits rows")
    _launch(logits, lens, None, output, 1, k, _MODE_ROW_LENGTHS, max(int(max_seq_len), logits.shape[1]),
            scratch=workspace, **overrides)


# ----------------------------------------------------------------------------------------------
# References (PyTorch, documented tie rule: value descending, then position ascending)
# ----------------------------------------------------------------------------------------------


def _row_topk_ref(vals: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k of one row under (value desc, position asc); result sorted by position, -1 padded."""
    L = vals.numel()
    res = torch.full((k,), -1, dtype=torch.int32)
    if L <= 0:
        return res
    if L <= k:
        res[:L] = torch.arange(L, dtype=torch.int32)
        return res
    v = vals.double().cpu()
    order = torch.argsort(-v, stable=True)  # stable: equal values keep ascending position
    sel = torch.sort(order[:k]).values
    res[:] = sel.to(torch.int32)
    return res


def topk_rows_reference(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k positions (relative to ``starts``) of ``logits[r, starts[r]:ends[r]]``, sorted ascending."""
    lg = logits.detach().float().cpu()
    st = starts.reshape(-1).cpu().long()
    en = ends.reshape(-1).cpu().long()
    out = torch.full((lg.shape[0], k), -1, dtype=torch.int32)
    for r in range(lg.shape[0]):
        s, e = int(st[r]), int(en[r])
        out[r] = _row_topk_ref(lg[r, s:max(e, s)], k)
    return out


def top_k_per_row_prefill_reference(logits, cu_seqlen_ks, cu_seqlen_ke, topk_tokens):
    return topk_rows_reference(logits, cu_seqlen_ks, cu_seqlen_ke, topk_tokens)


def top_k_per_row_decode_reference(logits, next_n, seq_lens, topk_tokens):
    rows = logits.shape[0]
    if seq_lens.dim() == 2:
        ends = seq_lens.reshape(-1)[:rows].cpu().long()
    else:
        r = torch.arange(rows)
        ends = seq_lens.cpu().long()[r // next_n] - next_n + (r % next_n) + 1
    return topk_rows_reference(logits, torch.zeros_like(ends), ends, topk_tokens)


def persistent_topk_reference(logits, lengths, k):
    ends = lengths.reshape(-1).cpu().long()
    return topk_rows_reference(logits, torch.zeros_like(ends), ends, k)


def canonical(indices: torch.Tensor) -> torch.Tensor:
    """Sort each row ascending with the -1 padding last (for comparing sets)."""
    x = indices.detach().cpu().long().clone()
    x[x < 0] = 1 << 40
    x = torch.sort(x, dim=-1).values
    x[x == (1 << 40)] = -1
    return x.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# SM120 compile specs (tools/sm120_check.py)
# ----------------------------------------------------------------------------------------------


# The inputs the dispatch is enumerated over for the compile specs: the k values upstream's ops
# take (512 / 1024 / 2048; GLM-5 and DeepSeek-V3.2 use 2048), row lengths at and around every S /
# CAP tier boundary up to 2M, 1 .. 65536 rows, and the SM counts of the GPUs the stack targets
# (48: DGX Spark, 84 / 170: RTX 5090-class, 132: H100/H200, 148: B200, 188: RTX PRO 6000) plus
# the interpreter's 8. The digit width and SEG_MIN stay at their defaults: only overrides change them.
SPEC_K = (512, 1024, 2048)
SPEC_MAX_SEQ_LEN = (1, 1025, 2049, 4096, 4097, 8192, 8193, 16384, 65536, 65537, 262144, 262145, 1 << 20, 1 << 21)
SPEC_ROWS = tuple(1 << i for i in range(17))
SPEC_SMS = (8, 48, 84, 132, 148, 170, 188)


def dispatch_launches(ks=SPEC_K, max_seq_lens=SPEC_MAX_SEQ_LEN, rows=SPEC_ROWS, sms=SPEC_SMS,
                      arch_major: int = 12) -> list[tuple]:
    """Every distinct (kernel, constexprs without MODE, num_warps) the dispatch launches over the
    given inputs on a GPU of that compute-capability major (default SM12x, the compile specs'
    target; any row mode: MODE only selects the row-range loads)."""
    seen = {}

    def launches(k, L, r, n):
        """A call's cooperative launch (or None) and its plan without it (what a refused
        cooperative launch falls back to)."""
        cfg = topk_config(k, L, r, n, arch_major=arch_major)
        nw, mw = cfg.pop("num_warps"), cfg.pop("merge_warps")
        coop = call_coop(cfg, k, L, r, n)
        return (coop_launch(k, _MODE_ROW_LENGTHS, cfg, coop) if coop is not None else None,
                _launch_plan(cfg, k, _MODE_ROW_LENGTHS, L, nw, mw))

    def add(kern, consts, w):
        consts = {a: v for a, v in consts.items() if a != "MODE"}
        seen.setdefault((kern.__name__, tuple(sorted(consts.items())), w), (kern, consts, w))

    for k in ks:
        for L in max_seq_lens:
            for r in rows:
                for n in sms:
                    coop, plan = launches(k, L, r, n)
                    for launch in ([coop] if coop is not None else []) + plan:
                        add(*launch)
        # The cooperative select's C and BLOCK follow rows x L more finely than the grid above: every
        # (C, BLOCK) it can take, from rows 1 .. slots / 2 and row lengths at each power of two (its
        # boundaries) and just past it, with the plans those calls fall back to.
        lens = sorted({L for j in range(1, 23) for L in (1 << j, (1 << j) + 1)} | set(max_seq_lens))
        for n in sms:
            for r in range(1, n * COOP_CTAS_PER_SM // 2 + 1):
                for L in lens:
                    coop, plan = launches(k, L, r, n)
                    if coop is not None:
                        for launch in [coop] + plan:
                            add(*launch)
    return sorted(seen.values(), key=lambda t: (t[0].__name__, sorted(t[1].items()), t[2]))


def SM120_COMPILE_SPECS() -> list[dict]:
    """Every configuration the dispatch launches (``dispatch_launches``: k, S/CAP tier, SPLIT,
    digit width, warps), for both kernels. The three row modes only change two scalar loads at the
    top of the kernels; they rotate over the specs so that each is compiled with every kernel."""
    common_sig = {
        "logits_ptr": "*fp32", "stride_r": "i64", "stride_c": "i64", "a_ptr": "*i32", "b_ptr": "*i32",
        "next_n": "i32", "out_ptr": "*i32", "stride_o": "i64", "seg_gt_ptr": "*i32", "seg_k_ptr": "*i32",
        "seg_i_ptr": "*i32", "cat_k_ptr": "*i32", "cat_i_ptr": "*i32", "cnt_ptr": "*i32", "win_ptr": "*i32",
    }
    div16 = ["logits_ptr", "out_ptr", "seg_gt_ptr", "seg_k_ptr", "seg_i_ptr", "cat_k_ptr", "cat_i_ptr", "cnt_ptr",
             "win_ptr"]
    coop_sig = {n: t for n, t in common_sig.items() if n in ("logits_ptr", "stride_r", "stride_c", "a_ptr", "b_ptr",
                                                               "next_n", "out_ptr", "stride_o")}
    coop_sig.update({"state_ptr": "*i32", "part_ptr": "*i32", "phase_lo": "i32", "phase_hi": "i32"})
    specs = []
    count = {}
    for kern, consts, nw in dispatch_launches():
        i = count[kern.__name__] = count.get(kern.__name__, -1) + 1
        consts = dict(consts, MODE=i % 3)
        short = {_topk_segment_kernel: "segment", _topk_merge_kernel: "merge", _topk_short_kernel: "short",
                 _topk_coop_kernel: "coop"}[kern]
        tag = ",".join(f"{a}={consts[a]}" for a in ("K", "S", "CAP", "BLOCK", "C", "SPLIT", "BITS", "MODE")
                       if a in consts)
        coop = kern is _topk_coop_kernel
        specs.append({
            "name": f"dsa_topk_{short}[{tag},w={nw}]", "fn": kern,
            "signature": dict(coop_sig if coop else common_sig, **{n: "constexpr" for n in consts}),
            "constexprs": consts, "num_warps": nw, "num_stages": 1,
            "divisible_by_16": ["logits_ptr", "out_ptr", "state_ptr", "part_ptr"] if coop else div16,
        })
        if coop:
            specs[-1]["launch_cooperative_grid"] = True
    return specs

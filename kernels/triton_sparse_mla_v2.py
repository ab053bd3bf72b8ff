# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA decode v2 for small head counts (H <= 16: GLM-5 at TP8 / TP4) over an ``fp8_ds_mla``
KV cache, written in Gluon (Triton's lower-level dialect, shipped with Triton >= 3.5).

Same interface and conventions as :func:`triton_sparse_mla.sparse_mla_decode` (read its module
docstring): ``indices`` hold physical slots, negative or ``>= num_blocks * block_size`` = no token
(never dereferenced), duplicates count once per occurrence, natural-log ``lse``, a row without a
valid index gives ``out = 0`` and ``lse = -inf``, any strides of ``q`` / ``indices`` / ``out`` /
``lse``, no host synchronization (CUDA-graph capturable).

Why Gluon and not plain Triton: v1 (plain ``tl.dot``) re-materializes each K tile once per MMA
operand layout (the tile crosses shared memory twice, as bytes, and is converted and scaled twice)
and serializes ~11 CTA barriers per tile behind 200-250 registers (docs/notes/sparse_mla.md). Plain
Triton has no way to say "this bf16 tile in shared memory is the B operand of both MMAs" or "these
raw bytes go to a shared-memory ring by cp.async while the previous tile computes" for a gathered
(index-addressed) tile. Gluon states both directly:

* a 2-stage ring of raw cache rows in shared memory (latent bytes, the 4 group scales, the bf16
  rope) filled by ``cp.async`` (16-byte copies; masked rows are zero-filled, nothing is read for
  them); tile ``i+1`` is in flight while tile ``i`` is dequantized and computed;
* each latent tile dequantized ONCE (e4m3 x its fp32 group scale -> q's dtype) into one bf16/fp16
  shared-memory tile that is the B operand of both ``S = Q K^T`` and ``O += P V`` (``mma_v2``:
  ``mma.sync``, the instruction family of SM80/SM86/SM89/SM120 and also available on SM90); the
  rope part is used straight from the ring (it is already 16-bit);
* ``q`` staged once per program in shared memory (its A operand is reloaded per 64-wide chunk, so
  no warp keeps 576 columns of q in registers);
* the softmax reads S back from a 2 KB shared tile in the PV MMA's A-operand layout (row max by
  quad shuffles, P already in place; row sums reduced once after the loop);
* three CTA barriers per tile (wait for the tile, after the dequantization, after the S exchange);
  95,232 B of shared memory with BLOCK_N = 32 and 218-248 registers (Triton 3.6/3.8, sm_90 /
  sm_120), no spills: two CTAs per SM on SM90's 228 KB, one on SM120's ~100 KB, where the ring
  still keeps a whole tile (21 KB) in flight per SM.

Gluon's ``mma_v2`` is mma.sync whatever ``DISABLE_MMA_V3`` says (that flag steers Triton's
``tl.dot`` lowering, which Gluon does not run).

Scope: ``kv_format == "fp8_ds_mla"``; the bf16 / fp16 format (rows of q's dtype, the KEYS_M
kernel with ``ROWS16``) and the fp8 format (KEYS_M with ``ROWS8``) where :func:`rows16_config` /
:func:`rows8_config` dispatch them (SM90, >= 4 query rows); 1 <= H <= 16, bf16/fp16 q, CUDA device of compute capability 8.x, 9.x or 12.x, Triton with Gluon.
Every other call goes to v1 (``sparse_mla_decode``) -- the
fallback is explicit: :func:`v2_unsupported_reason` says why for a given call, and
``sparse_mla_decode_v2(..., fallback=False)`` raises instead of falling back.

Gluon kernels do not run in Triton's CPU interpreter; on CPU they are compiled for a target
(``SM120_COMPILE_SPECS``) and their bodies run under ``tests/kernels/gluon_emulator.py``. The
reference is v1's float64 ``sparse_mla_decode_reference`` (re-exported here).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import triton_sparse_mla as _v1  # vllm/v1/attention/ops/ inside vLLM; the kernels/ package here

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    # a CTA-wide barrier (bar.sync): gl.thread_barrier in Triton 3.5-3.6, gl.barrier from 3.7
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAS_GLUON = True
except Exception:  # pragma: no cover - Triton without Gluon (< 3.5): v1 only
    HAS_GLUON = False

__all__ = [
    "sparse_mla_decode_v2",
    "sparse_mla_decode_reference",
    "v2_unsupported_reason",
    "pick_config_v2",
    "rows16_config",
    "rows8_config",
    "SM120_COMPILE_SPECS",
    "HAS_GLUON",
]

sparse_mla_decode_reference = _v1.sparse_mla_decode_reference

# The fp8_ds_mla row layout comes from the one format module (mla_kv_format.py), as the writer's,
# v1's and the backend's do: 512 e4m3 latent bytes, 4 fp32 scales, 64 16-bit rope values.
_DS_ROW = _v1._kvf.resolve_kv_format("fp8_ds_mla", torch.bfloat16)
LATENT_DIM = _v1._kvf.LATENT_DIM
ROPE_DIM = _v1._kvf.ROPE_DIM
HEAD_DIM = _v1._kvf.HEAD_DIM
DS_ROW_BYTES = _DS_ROW.row_bytes  # 656
# byte offsets inside a row, as Gluon compile-time constants of the copy helper
_DS_SCALE_OFFSET = gl.constexpr(_DS_ROW.scale_offset) if HAS_GLUON else _DS_ROW.scale_offset  # 512
_DS_ROPE_OFFSET = gl.constexpr(_DS_ROW.rope_offset) if HAS_GLUON else _DS_ROW.rope_offset  # 528
MAX_SPLITS = _v1.MAX_SPLITS  # what the shared merge kernel takes
_LOG2E = 1.4426950408889634
SM120_SHARED_LIMIT = 101376
# Register cap passed to the launch: without it ptxas for sm_90 stops at 168 registers and spills
# (its occupancy heuristic; shared memory allows only 2 CTAs per SM anyway), with it 218, no spill.
MAXNREG = 255


# --------------------------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------------------------

if HAS_GLUON:

    @gluon.jit
    def _slots(idx_row, stride_ik, tile, lim, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Raw int32 slots of one top-k tile in ``layout``; positions >= lim read as -1."""
        offs = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
        return gl.load(idx_row + offs * stride_ik, mask=offs < lim, other=-1)

    @gluon.jit
    def _rows(slot, num_slots, block_size, stride_kb, stride_ks):
        """Slots -> (valid, int64 byte offset of the row in the cache). Invalid slots -> row 0."""
        valid = (slot >= 0) & (slot < num_slots)
        s = gl.where(valid, slot, 0)
        blk = s // block_size
        row = blk.to(gl.int64) * stride_kb + (s - blk * block_size).to(gl.int64) * stride_ks
        return valid, row

    @gluon.jit
    def _issue_tile(kv_ptr, lat_buf, sc_buf, rp_buf, sl_lat, sl_sc, sl_rp,
                    num_slots, block_size, stride_kb, stride_ks,
                    DT: gl.constexpr, L_LAT: gl.constexpr, L_SC: gl.constexpr, L_RP: gl.constexpr,
                    ROWS8: gl.constexpr = False):
        """cp.async one tile of rows into one ring stage: 512 latent bytes, 4 fp32 scales, 64 rope
        words per row. Masked (invalid) rows are not read; their shared memory is zero-filled.
        ``ROWS8`` (fp8 rows): 512 latent bytes and the 64 rope bytes after them, into ``sc_buf``
        (``rp_buf`` and ``sl_rp`` unused)."""
        v, r = _rows(sl_lat, num_slots, block_size, stride_kb, stride_ks)
        cl = gl.arange(0, 512, layout=gl.SliceLayout(0, L_LAT))
        cp.async_copy_global_to_shared(lat_buf, kv_ptr + r[:, None] + cl[None, :], mask=v[:, None])
        v, r = _rows(sl_sc, num_slots, block_size, stride_kb, stride_ks)
        if ROWS8:
            c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, L_SC))
            cp.async_copy_global_to_shared(sc_buf, kv_ptr + r[:, None] + 512 + c64[None, :], mask=v[:, None])
        else:
            c4 = gl.arange(0, 4, layout=gl.SliceLayout(0, L_SC))
            sp = (kv_ptr + r + _DS_SCALE_OFFSET).to(gl.pointer_type(gl.float32))
            cp.async_copy_global_to_shared(sc_buf, sp[:, None] + c4[None, :], mask=v[:, None])
            v, r = _rows(sl_rp, num_slots, block_size, stride_kb, stride_ks)
            c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, L_RP))
            rp = (kv_ptr + r + _DS_ROPE_OFFSET).to(gl.pointer_type(DT))
            cp.async_copy_global_to_shared(rp_buf, rp[:, None] + c64[None, :], mask=v[:, None])

    @gluon.jit
    def _alloc_ring(BLOCK_N: gl.constexpr, DT: gl.constexpr, RING: gl.constexpr, ROWS8: gl.constexpr = False):
        """The raw ring's stages A and B (B is A with RING 1): per row 512 latent bytes, the second
        copy (4 fp32 scales; fp8 rows: 64 rope bytes) and the 16-bit rope (fp8 rows: one tile the
        raw rope is converted into, not ringed). Separate allocations, so the compiler's barrier
        analysis sees the stages as independent."""
        SH_PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        SH_SW: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        SC_T: gl.constexpr = gl.uint8 if ROWS8 else gl.float32
        SC_W: gl.constexpr = 64 if ROWS8 else 4
        lat_a = gl.allocate_shared_memory(gl.uint8, [BLOCK_N, 512], SH_PLAIN)
        sc_a = gl.allocate_shared_memory(SC_T, [BLOCK_N, SC_W], SH_PLAIN)
        rp_a = gl.allocate_shared_memory(DT, [BLOCK_N, 64], SH_SW)
        if RING == 2:
            lat_b = gl.allocate_shared_memory(gl.uint8, [BLOCK_N, 512], SH_PLAIN)
            sc_b = gl.allocate_shared_memory(SC_T, [BLOCK_N, SC_W], SH_PLAIN)
            if ROWS8:
                rp_b = rp_a
            else:
                rp_b = gl.allocate_shared_memory(DT, [BLOCK_N, 64], SH_SW)
        else:
            lat_b = lat_a
            sc_b = sc_a
            rp_b = rp_a
        return lat_a, sc_a, rp_a, lat_b, sc_b, rp_b

    @gluon.jit
    def _alloc_groups(BLOCK_N: gl.constexpr, DT: gl.constexpr):
        """Four [BLOCK_N, 128] 16-bit tiles, one per 128-group of the latent, swizzled for ldmatrix."""
        SH_SW: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        return (gl.allocate_shared_memory(DT, [BLOCK_N, 128], SH_SW), gl.allocate_shared_memory(DT, [BLOCK_N, 128], SH_SW),
                gl.allocate_shared_memory(DT, [BLOCK_N, 128], SH_SW), gl.allocate_shared_memory(DT, [BLOCK_N, 128], SH_SW))

    @gluon.jit
    def _tile_slots(idx_row, stride_ik, tile, lim, BLOCK_N: gl.constexpr, L_LAT: gl.constexpr,
                    L_SC: gl.constexpr, L_RP: gl.constexpr):
        """One tile's slots in the layouts of its three fp8_ds_mla copies (latent, scales, rope;
        fp8 rows use the first two)."""
        return (_slots(idx_row, stride_ik, tile, lim, BLOCK_N, gl.SliceLayout(1, L_LAT)),
                _slots(idx_row, stride_ik, tile, lim, BLOCK_N, gl.SliceLayout(1, L_SC)),
                _slots(idx_row, stride_ik, tile, lim, BLOCK_N, gl.SliceLayout(1, L_RP)))

    @gluon.jit
    def _refill(kv_ptr, lat_n, sc_n, rp_n, nl_lat, nl_sc, nl_rp, has_next, num_slots, block_size, stride_kb,
                stride_ks, DT: gl.constexpr, L_LAT: gl.constexpr, L_SC: gl.constexpr, L_RP: gl.constexpr,
                ROWS8: gl.constexpr = False):
        """The next tile's copies into a free ring stage (none past the split's last tile), then the
        copy group is closed either way (the next wait_group counts groups)."""
        if has_next:
            _issue_tile(kv_ptr, lat_n, sc_n, rp_n, nl_lat, nl_sc, nl_rp, num_slots, block_size,
                        stride_kb, stride_ks, DT, L_LAT, L_SC, L_RP, ROWS8)
        cp.commit_group()

    @gluon.jit
    def _ring_prologue(kv_ptr, lat_a, sc_a, rp_a, idx_row, stride_ik, tile_lo, lim, num_slots, block_size,
                       stride_kb, stride_ks, BLOCK_N: gl.constexpr, DT: gl.constexpr, L_LAT: gl.constexpr,
                       L_SC: gl.constexpr, L_RP: gl.constexpr, ROWS8: gl.constexpr = False):
        """A split's first tile in flight into stage A; returns the second tile's slots (its copies)."""
        f_lat, f_sc, f_rp = _tile_slots(idx_row, stride_ik, tile_lo, lim, BLOCK_N, L_LAT, L_SC, L_RP)
        _issue_tile(kv_ptr, lat_a, sc_a, rp_a, f_lat, f_sc, f_rp, num_slots, block_size, stride_kb, stride_ks,
                    DT, L_LAT, L_SC, L_RP, ROWS8)
        cp.commit_group()
        return _tile_slots(idx_row, stride_ik, tile_lo + 1, lim, BLOCK_N, L_LAT, L_SC, L_RP)

    @gluon.jit
    def _dequant_groups(lat_c, sc_c, k0, k1, k2, k3, L_DQ: gl.constexpr, DT: gl.constexpr):
        """A ring stage's latent bytes -> the four 16-bit K tiles: e4m3 x its row's group scale,
        rounded to q's dtype (one buffer per 128-group)."""
        GROUP: gl.constexpr = 128
        raw = lat_c.slice(0 * GROUP, GROUP, dim=1).load(L_DQ)
        sc = sc_c.slice(0, 1, dim=1).load(L_DQ)
        k0.store((raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc).to(DT))
        raw = lat_c.slice(1 * GROUP, GROUP, dim=1).load(L_DQ)
        sc = sc_c.slice(1, 1, dim=1).load(L_DQ)
        k1.store((raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc).to(DT))
        raw = lat_c.slice(2 * GROUP, GROUP, dim=1).load(L_DQ)
        sc = sc_c.slice(2, 1, dim=1).load(L_DQ)
        k2.store((raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc).to(DT))
        raw = lat_c.slice(3 * GROUP, GROUP, dim=1).load(L_DQ)
        sc = sc_c.slice(3, 1, dim=1).load(L_DQ)
        k3.store((raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc).to(DT))

    # fp8 rows (the ``fp8`` format, KEYS_M with ROWS8): 512 e4m3 latent bytes then 64 e4m3 rope
    # bytes, one per-tensor scale outside the row. The ring (``_issue_tile`` with ROWS8) keeps the
    # raw latent and the raw rope;
    # both are converted to q's dtype unscaled (e4m3 is exact in bf16 and fp16) and the scale is
    # folded into the softmax scale and the output, as in v1.

    @gluon.jit
    def _dequant_fp8(lat_c, r8_c, k0, k1, k2, k3, rpk, L_DQ: gl.constexpr, L_R8: gl.constexpr,
                     DT: gl.constexpr):
        """A ring stage's fp8 bytes -> the four 16-bit latent tiles and the 16-bit rope tile
        (e4m3 -> q's dtype, unscaled)."""
        GROUP: gl.constexpr = 128
        k0.store(lat_c.slice(0 * GROUP, GROUP, dim=1).load(L_DQ).to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT))
        k1.store(lat_c.slice(1 * GROUP, GROUP, dim=1).load(L_DQ).to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT))
        k2.store(lat_c.slice(2 * GROUP, GROUP, dim=1).load(L_DQ).to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT))
        k3.store(lat_c.slice(3 * GROUP, GROUP, dim=1).load(L_DQ).to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT))
        rpk.store(r8_c.load(L_R8).to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT))

    @gluon.jit
    def _merge_if_last(po_ptr, plse_ptr, out_ptr, lse_ptr, cnt_ptr, t, hb, n_hb, num_heads, num_splits,
                       stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                       BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr):
        """FUSED_MERGE: called by every split program of (row ``t``, head block ``hb``) after its
        partial (o, lse) stores. The program whose arrival brings the counter to ``num_splits``
        merges all partials into out / lse (in split order: the result does not depend on which
        program arrives last) and resets the counter to 0, so no per-call memset is needed. v1's
        fused merge (``_merge_partials``) with the same ordering argument: the CTA barrier puts
        every thread's partial stores before the one thread's gpu-scope acq_rel atomic, whose
        result reaches the other threads through shared memory and a barrier; the partials of the
        other programs are then read past L1 (``.cg``)."""
        DV: gl.constexpr = 512
        _cta_barrier()
        cnt = cnt_ptr + (t * n_hb + hb)
        arrived = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            L_O: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, NUM_WARPS], [1, 0])  # [BLOCK_H, 512]
            offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_O))
            hmask = offs_h < num_heads
            offs_d = gl.arange(0, DV, layout=gl.SliceLayout(0, L_O))
            base = (t.to(gl.int64) * num_heads + offs_h) * num_splits
            m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, L_O))
            for s in range(0, num_splits):
                ls = gl.load(plse_ptr + base + s, mask=hmask, other=float("-inf"), cache_modifier=".cg")
                m = gl.maximum(m, ls)
            finite = m > float("-inf")
            m_safe = gl.where(finite, m, 0.0)
            wsum = gl.full([BLOCK_H], 0.0, gl.float32, layout=gl.SliceLayout(1, L_O))
            o = gl.full([BLOCK_H, DV], 0.0, gl.float32, layout=L_O)
            for s in range(0, num_splits):
                ls = gl.load(plse_ptr + base + s, mask=hmask, other=float("-inf"), cache_modifier=".cg")
                w = gl.where(ls > float("-inf"), gl.exp2((ls - m_safe) * 1.4426950408889634), 0.0)
                wsum = wsum + w
                pp = po_ptr + (base + s)[:, None] * DV + offs_d[None, :]
                o = o + w[:, None] * gl.load(pp, mask=hmask[:, None], other=0.0, cache_modifier=".cg")
            inv = gl.where(finite, 1.0 / gl.where(finite, wsum, 1.0), 0.0)
            OT: gl.constexpr = out_ptr.dtype.element_ty
            o_row = out_ptr + t.to(gl.int64) * stride_ot + offs_h[:, None] * stride_oh
            gl.store(o_row + offs_d[None, :] * stride_od, (o * inv[:, None]).to(OT), mask=hmask[:, None])
            lse = gl.where(finite, m_safe + gl.log2(gl.where(finite, wsum, 1.0)) * 0.6931471805599453, float("-inf"))
            gl.store(lse_ptr + t.to(gl.int64) * stride_lt + offs_h * stride_lh, lse, mask=hmask)
            gl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _q_op(q_smem, q_ops, j: gl.constexpr, Q_REGS: gl.constexpr, OP_A: gl.constexpr):
        """q's A operand of K-chunk ``j`` (0-7: latent columns 64j.., 8: the rope): from the
        registers loaded before the loop (Q_REGS) or re-read from shared memory."""
        if j < Q_REGS:
            return q_ops[j]
        elif j == 8:
            return q_smem.load(OP_A)
        else:
            return q_smem.slice(j * 64, 64, dim=1).load(OP_A)

    @gluon.jit
    def _step(kv_ptr, idx_row, stride_ik, tile, lim, num_slots, block_size, stride_kb, stride_ks,
              qk_scale_log2, has_next,
              lat_c, sc_c, rp_c, lat_n, sc_n, rp_n, k0, k1, k2, k3, q_smem, qr_smem, q_ops, s_smem,
              nl_lat, nl_sc, nl_rp, vs, m_i, l_acc, acc0, acc1, acc2, acc3, r_i, rq,
              BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, DT: gl.constexpr,
              QK_ACCS: gl.constexpr, DQ_VEC: gl.constexpr, RING: gl.constexpr, Q_REGS: gl.constexpr,
              FOLD: gl.constexpr = False):
        """One KV tile: wait for its ring stage (``*_c``), put the next tile's copies in flight into
        the other stage (``*_n``), dequantize once into k0..k3, S = Q K^T, online softmax,
        O += P V. Returns the loop state. ``FOLD``: k0..k3 hold fp16 e4m3 (unscaled) and q_smem
        q / rq in fp16; the group scales are applied to S's columns and to P per group over the
        running scale maximum ``r_i`` (as in the KEYS_M kernel's FOLD)."""
        GROUP: gl.constexpr = 128
        QC: gl.constexpr = 64
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS],
                                                      instr_shape=[16, 8])
        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        OP_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        COL_M: gl.constexpr = gl.SliceLayout(0, MMA)
        ROW_M: gl.constexpr = gl.SliceLayout(1, MMA)
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_SC: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0])
        L_RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        # dequantization: DQ_VEC contiguous values per thread, one 128-wide group row per
        # GROUP // DQ_VEC lanes (16: 4 rows per warp; 8: 2 rows per warp, one 16-byte store each)
        L_DQ: gl.constexpr = gl.BlockedLayout([1, DQ_VEC], [32 // (GROUP // DQ_VEC), GROUP // DQ_VEC],
                                              [NUM_WARPS, 1], [1, 0])

        # index loads for later tiles: latency hidden behind this tile's work
        nn_lat, nn_sc, nn_rp = _tile_slots(idx_row, stride_ik, tile + 2, lim, BLOCK_N, L_LAT, L_SC, L_RP)
        vs_n = _slots(idx_row, stride_ik, tile + 1, lim, BLOCK_N, COL_M)

        cp.wait_group(0)  # this thread's copies of this tile landed
        _cta_barrier()  # everyone's did; everyone is done with the previous tile
        if RING == 2:  # the other stage is free: the next tile's copies go now
            _refill(kv_ptr, lat_n, sc_n, rp_n, nl_lat, nl_sc, nl_rp, has_next, num_slots, block_size,
                    stride_kb, stride_ks, DT, L_LAT, L_SC, L_RP)

        # dequantize the latent part once: e4m3 x group scale -> DT (one buffer per 128-group);
        # FOLD: e4m3 -> fp16 unscaled
        if FOLD:
            _convert_groups(lat_c, k0, k1, k2, k3, L_DQ)
        else:
            _dequant_groups(lat_c, sc_c, k0, k1, k2, k3, L_DQ, DT)
        _cta_barrier()

        # S = Q K^T over 512 latent + 64 rope columns (K-chunks of 64). QK_ACCS = 4: one
        # accumulator per 128-group (the rope into the last), summed at the end: four dependent
        # chains of 2-3 mma.sync instead of one of 9 chunks (36 instructions per warp), whose
        # latency the 2 warps per scheduler cannot hide. QK_ACCS = 1: the single chain.
        s0 = gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, layout=MMA)
        if QK_ACCS == 4:
            s1 = gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, layout=MMA)
            s2 = gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, layout=MMA)
            s3 = gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, layout=MMA)
        else:
            s1 = s0
            s2 = s0
            s3 = s0
        for c in gl.static_range(2):
            s0 = mma_v2(_q_op(q_smem, q_ops, 0 * 2 + c, Q_REGS, OP_A),
                        k0.slice(c * QC, QC, dim=1).permute((1, 0)).load(OP_B), s0)
        if QK_ACCS == 1:
            s1 = s0
        for c in gl.static_range(2):
            s1 = mma_v2(_q_op(q_smem, q_ops, 1 * 2 + c, Q_REGS, OP_A),
                        k1.slice(c * QC, QC, dim=1).permute((1, 0)).load(OP_B), s1)
        if QK_ACCS == 1:
            s2 = s1
        for c in gl.static_range(2):
            s2 = mma_v2(_q_op(q_smem, q_ops, 2 * 2 + c, Q_REGS, OP_A),
                        k2.slice(c * QC, QC, dim=1).permute((1, 0)).load(OP_B), s2)
        if QK_ACCS == 1:
            s3 = s2
        for c in gl.static_range(2):
            s3 = mma_v2(_q_op(q_smem, q_ops, 3 * 2 + c, Q_REGS, OP_A),
                        k3.slice(c * QC, QC, dim=1).permute((1, 0)).load(OP_B), s3)
        if FOLD:  # per-group accumulators times their per-key scales (S's columns), the rope apart
            sc0, sc1, sc2, sc3 = _tile_scales(kv_ptr, vs, num_slots, block_size, stride_kb, stride_ks)
            sr = mma_v2(_q_op(qr_smem, q_ops, 8, Q_REGS, OP_A), rp_c.permute((1, 0)).load(OP_B),
                        gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, layout=MMA))
            s = ((s0 * sc0[None, :] + s1 * sc1[None, :]) + (s2 * sc2[None, :] + s3 * sc3[None, :])) * rq + sr
            # the same scales along P's columns (the PV A operand's layout), loaded now: in flight
            # across the S exchange barrier
            tl_slot = _slots(idx_row, stride_ik, tile, lim, BLOCK_N, gl.SliceLayout(0, OP_A))
            pc0, pc1, pc2, pc3 = _tile_scales(kv_ptr, tl_slot, num_slots, block_size, stride_kb, stride_ks)
        else:
            s3 = mma_v2(_q_op(qr_smem, q_ops, 8, Q_REGS, OP_A), rp_c.permute((1, 0)).load(OP_B), s3)
            if QK_ACCS == 4:
                s = (s0 + s1) + (s2 + s3)
            else:
                s = s3

        # softmax: S goes through shared memory once and comes back in the A-operand layout of
        # the PV MMA (every warp holds whole rows, split over the 4 lanes of a quad), so the row
        # max is a quad shuffle and P needs no further layout change: one CTA barrier
        valid = (vs >= 0) & (vs < num_slots)
        s_smem.store(gl.where(valid[None, :], s * qk_scale_log2, float("-inf")))
        _cta_barrier()
        if RING == 1:  # one stage: free once every warp's QK (which reads its rope) is done
            _refill(kv_ptr, lat_n, sc_n, rp_n, nl_lat, nl_sc, nl_rp, has_next, num_slots, block_size,
                    stride_kb, stride_ks, DT, L_LAT, L_SC, L_RP)
        s = s_smem.load(OP_A)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_acc = l_acc * alpha[:, None] + p  # row sums reduced once, after the loop
        if FOLD:  # P x scale / R per group (every warp holds whole rows: the tile's max scale is local)
            r_i, alpha_r, inv_r = _running_scale(r_i, alpha, pc0, pc1, pc2, pc3)
            alpha_o = gl.convert_layout(alpha_r, ROW_M)[:, None]
            acc0 = mma_v2((p * (pc0 * inv_r)[None, :]).to(gl.float16), k0.load(OP_B), acc0 * alpha_o)
            acc1 = mma_v2((p * (pc1 * inv_r)[None, :]).to(gl.float16), k1.load(OP_B), acc1 * alpha_o)
            acc2 = mma_v2((p * (pc2 * inv_r)[None, :]).to(gl.float16), k2.load(OP_B), acc2 * alpha_o)
            acc3 = mma_v2((p * (pc3 * inv_r)[None, :]).to(gl.float16), k3.load(OP_B), acc3 * alpha_o)
        else:
            pa = p.to(DT)
            alpha_o = gl.convert_layout(alpha, ROW_M)[:, None]
            acc0 = mma_v2(pa, k0.load(OP_B), acc0 * alpha_o)
            acc1 = mma_v2(pa, k1.load(OP_B), acc1 * alpha_o)
            acc2 = mma_v2(pa, k2.load(OP_B), acc2 * alpha_o)
            acc3 = mma_v2(pa, k3.load(OP_B), acc3 * alpha_o)
        return nn_lat, nn_sc, nn_rp, vs_n, m_new, l_acc, acc0, acc1, acc2, acc3, r_i

    @gluon.jit(do_not_specialize=["num_heads", "topk", "num_slots", "block_size", "num_splits",
                                  "tiles_per_split"])
    def _sparse_mla_v2_kernel(
        q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, cnt_ptr,
        qk_scale_log2,
        num_heads, topk, num_slots, block_size,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks,
        stride_it, stride_ik,
        stride_ot, stride_oh, stride_od,
        stride_lt, stride_lh,
        num_splits, tiles_per_split,
        SPLIT: gl.constexpr,
        FUSED_MERGE: gl.constexpr,
        BLOCK_H: gl.constexpr,
        BLOCK_N: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        QK_ACCS: gl.constexpr = 1,
        DQ_VEC: gl.constexpr = 16,
        S_SWIZZLE: gl.constexpr = False,
        RING: gl.constexpr = 2,
        Q_REGS: gl.constexpr = 0,
        FOLD: gl.constexpr = False,
    ):
        GROUP: gl.constexpr = 128
        DV: gl.constexpr = 512
        DT: gl.constexpr = q_ptr.dtype.element_ty

        # ---- layouts -------------------------------------------------------------------------
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS],
                                                      instr_shape=[16, 8])
        ROW_M: gl.constexpr = gl.SliceLayout(1, MMA)  # [BLOCK_H] vectors (m, l, head offsets)
        COL_M: gl.constexpr = gl.SliceLayout(0, MMA)  # [BLOCK_N] / [128] vectors along N
        # cp.async sources: 16 contiguous bytes per thread (same as in _step)
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])  # [BN, 512] u8
        L_SC: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0])  # [BN, 4] fp32
        L_RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])  # [BN, 64] 16-bit
        L_Q: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])  # [BH, 128] q load
        # shared memory: plain rows for the bytes and the scales, 16-byte-vector swizzle
        # (ldmatrix-friendly) for every 16-bit tile an MMA reads. Two static ring stages (A, B)
        # and one buffer per 128-group of K: separate allocations, so the compiler's barrier
        # analysis sees them as independent.
        SH_PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        SH_SW: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        # RING 1: one raw stage (21 KB less at BLOCK_N 32, for more CTAs per SM); the next tile's
        # copies then start after the QK of this one instead of before its dequantization
        lat_a, sc_a, rp_a, lat_b, sc_b, rp_b = _alloc_ring(BLOCK_N, DT, RING)
        # FOLD: the K tiles hold fp16 e4m3 (unscaled) and q's latent is staged as fp16 q / rq
        k0, k1, k2, k3 = _alloc_groups(BLOCK_N, gl.float16 if FOLD else DT)
        q_smem = gl.allocate_shared_memory(gl.float16 if FOLD else DT, [BLOCK_H, DV], SH_SW)
        qr_smem = gl.allocate_shared_memory(DT, [BLOCK_H, 64], SH_SW)
        # S exchange tile: written from the MMA accumulator layout, whose lanes with one column
        # pair sit 8 rows apart (128 B with BLOCK_N 32: one bank, an 8-way conflict in a plain
        # layout); S_SWIZZLE XORs the 8-byte column unit with the row (Nsight Compute on the H100:
        # shared stores averaged 9 wavefronts per request, 58% of them conflicts)
        SH_S: gl.constexpr = gl.SwizzledSharedLayout(2, 1, 8, [1, 0]) if S_SWIZZLE else SH_PLAIN
        s_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, BLOCK_N], SH_S)

        # ---- program -> (token, head block, split) --------------------------------------------
        n_hb = gl.cdiv(num_heads, BLOCK_H)
        pid = gl.program_id(0)
        hb = pid % n_hb
        rest = pid // n_hb
        sp = rest % num_splits
        t = rest // num_splits

        # ---- q -> shared memory (once) --------------------------------------------------------
        offs_hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_Q))
        hq_mask = (offs_hq < num_heads)[:, None]
        q_row = q_ptr + t.to(gl.int64) * stride_qt + offs_hq[:, None] * stride_qh
        offs_c = gl.arange(0, DV, layout=gl.SliceLayout(0, L_Q))
        q_lat = gl.load(q_row + offs_c[None, :] * stride_qd, mask=hq_mask, other=0.0)
        rq = 1.0
        if FOLD:
            rq = _fp16_divisor(q_lat)
            q_smem.store((q_lat.to(gl.float32) * (1.0 / rq)).to(gl.float16))
        else:
            q_smem.store(q_lat)
        r_i = gl.zeros([], gl.float32)  # FOLD's running scale maximum (carried, unused otherwise)
        offs_r = gl.arange(0, 64, layout=gl.SliceLayout(0, L_Q))
        qr_smem.store(gl.load(q_row + (DV + offs_r)[None, :] * stride_qd, mask=hq_mask, other=0.0))

        # ---- this split's tiles ---------------------------------------------------------------
        n_tiles = gl.maximum(gl.cdiv(topk, BLOCK_N), 1)
        tile_lo = sp * tiles_per_split
        n_t = gl.minimum(tiles_per_split, n_tiles - tile_lo)
        lim = gl.minimum((tile_lo + tiles_per_split) * BLOCK_N, topk)
        idx_row = idx_ptr + t.to(gl.int64) * stride_it

        # prologue: tile 0 in flight into stage A; slots of tile 1 (its copies) and tile 0 (mask)
        nl_lat, nl_sc, nl_rp = _ring_prologue(kv_ptr, lat_a, sc_a, rp_a, idx_row, stride_ik, tile_lo, lim, num_slots,
                                              block_size, stride_kb, stride_ks, BLOCK_N, DT, L_LAT, L_SC, L_RP)
        vs = _slots(idx_row, stride_ik, tile_lo, lim, BLOCK_N, COL_M)

        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        # Q_REGS = n: q's first n of nine A operands (64-column K-chunks; 8 = the rope) loaded once
        # and held in registers across the loop instead of re-read by every warp per tile (q is 36
        # of the 54 ldmatrix per warp and tile, ~72 KB of shared traffic at BLOCK_N 32: Nsight
        # Compute, H100). Two fit beside the rest at 252 registers (sm_90); three or more spill.
        # Operands past n are never used, so their loads are dead code.
        if Q_REGS:
            _cta_barrier()  # q_smem written by every warp
            q_ops = (q_smem.slice(0, 64, dim=1).load(OP_A), q_smem.slice(64, 64, dim=1).load(OP_A),
                     q_smem.slice(128, 64, dim=1).load(OP_A), q_smem.slice(192, 64, dim=1).load(OP_A),
                     q_smem.slice(256, 64, dim=1).load(OP_A), q_smem.slice(320, 64, dim=1).load(OP_A),
                     q_smem.slice(384, 64, dim=1).load(OP_A), q_smem.slice(448, 64, dim=1).load(OP_A),
                     qr_smem.load(OP_A))
        else:
            q_ops = (0, )
        m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, OP_A))
        l_acc = gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, layout=OP_A)
        acc0 = gl.full([BLOCK_H, GROUP], 0.0, gl.float32, layout=MMA)
        acc1 = gl.full([BLOCK_H, GROUP], 0.0, gl.float32, layout=MMA)
        acc2 = gl.full([BLOCK_H, GROUP], 0.0, gl.float32, layout=MMA)
        acc3 = gl.full([BLOCK_H, GROUP], 0.0, gl.float32, layout=MMA)

        # two tiles per iteration: stage A then stage B (static buffers, no dynamic indexing)
        for i in range(0, n_t, 2):
            tile = tile_lo + i
            nl_lat, nl_sc, nl_rp, vs, m_i, l_acc, acc0, acc1, acc2, acc3, r_i = _step(
                kv_ptr, idx_row, stride_ik, tile, lim, num_slots, block_size, stride_kb, stride_ks,
                qk_scale_log2, i + 1 < n_t,
                lat_a, sc_a, rp_a, lat_b, sc_b, rp_b, k0, k1, k2, k3, q_smem, qr_smem, q_ops, s_smem,
                nl_lat, nl_sc, nl_rp, vs, m_i, l_acc, acc0, acc1, acc2, acc3, r_i, rq,
                BLOCK_H, BLOCK_N, NUM_WARPS, DT, QK_ACCS, DQ_VEC, RING, Q_REGS, FOLD)
            if i + 1 < n_t:
                nl_lat, nl_sc, nl_rp, vs, m_i, l_acc, acc0, acc1, acc2, acc3, r_i = _step(
                    kv_ptr, idx_row, stride_ik, tile + 1, lim, num_slots, block_size, stride_kb, stride_ks,
                    qk_scale_log2, i + 2 < n_t,
                    lat_b, sc_b, rp_b, lat_a, sc_a, rp_a, k0, k1, k2, k3, q_smem, qr_smem, q_ops, s_smem,
                    nl_lat, nl_sc, nl_rp, vs, m_i, l_acc, acc0, acc1, acc2, acc3, r_i, rq,
                    BLOCK_H, BLOCK_N, NUM_WARPS, DT, QK_ACCS, DQ_VEC, RING, Q_REGS, FOLD)
        cp.wait_group(0)  # nothing may stay in flight into shared memory when the CTA exits

        # ---- epilogue -------------------------------------------------------------------------
        l_i = gl.convert_layout(gl.sum(l_acc, axis=1), ROW_M)
        m_i = gl.convert_layout(m_i, ROW_M)
        has = l_i > 0.0
        if FOLD:  # the accumulators are in units of the running scale maximum R
            inv = gl.where(has, r_i / gl.where(has, l_i, 1.0), 0.0)
        else:
            inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_M)
        hmask = offs_h < num_heads
        offs_d = gl.arange(0, GROUP, layout=COL_M)
        if SPLIT:
            prow = (t.to(gl.int64) * num_heads + offs_h) * num_splits + sp
            po = po_ptr + prow[:, None] * DV + offs_d[None, :]
            gl.store(po + 0 * GROUP, acc0 * inv[:, None], mask=hmask[:, None])
            gl.store(po + 1 * GROUP, acc1 * inv[:, None], mask=hmask[:, None])
            gl.store(po + 2 * GROUP, acc2 * inv[:, None], mask=hmask[:, None])
            gl.store(po + 3 * GROUP, acc3 * inv[:, None], mask=hmask[:, None])
            gl.store(plse_ptr + prow, lse, mask=hmask)
            if FUSED_MERGE:
                _merge_if_last(po_ptr, plse_ptr, out_ptr, lse_ptr, cnt_ptr, t, hb, n_hb, num_heads, num_splits,
                               stride_ot, stride_oh, stride_od, stride_lt, stride_lh, BLOCK_H, NUM_WARPS)
        else:
            OT: gl.constexpr = out_ptr.dtype.element_ty
            o_row = out_ptr + t.to(gl.int64) * stride_ot + offs_h[:, None] * stride_oh
            gl.store(o_row + (0 * GROUP + offs_d)[None, :] * stride_od, (acc0 * inv[:, None]).to(OT), mask=hmask[:, None])
            gl.store(o_row + (1 * GROUP + offs_d)[None, :] * stride_od, (acc1 * inv[:, None]).to(OT), mask=hmask[:, None])
            gl.store(o_row + (2 * GROUP + offs_d)[None, :] * stride_od, (acc2 * inv[:, None]).to(OT), mask=hmask[:, None])
            gl.store(o_row + (3 * GROUP + offs_d)[None, :] * stride_od, (acc3 * inv[:, None]).to(OT), mask=hmask[:, None])
            gl.store(lse_ptr + t.to(gl.int64) * stride_lt + offs_h * stride_lh, lse, mask=hmask)

    # ----------------------------------------------------------------------------------------
    # Keys as the MMA's M (KEYS_M): S^T = K q^T and O^T += V^T P^T, for H <= 8 (or 16, WARPS_H 2)
    # ----------------------------------------------------------------------------------------
    # The kernel above pads 8 heads to the 16 rows of mma.sync's M and splits the keys over the
    # warps, so every warp re-reads all of q from shared memory per tile and half of every MMA is
    # padding. Here the keys (16 per warp) and the latent dims are the M side and the 8 heads the
    # N side (mma.sync's n8): q^T is the B operand of S^T, held in registers for the whole loop
    # (72 registers); each warp reads only its own keys' rows of the dequantized tile for S^T; P^T
    # goes through a 2 KB shared tile into the B-operand layout of O^T += V^T P^T, whose A operand
    # is the same dequantized tile read transposed. Half the mma.sync instructions and ~40% less
    # shared-memory traffic per key than the kernel above (docs/notes/sparse_mla_v2.md).
    # WARPS_H 2 (BLOCK_H 16) splits the warps over two 8-head columns as well as over the keys: each
    # warp keeps q^T of its 8 heads in registers (the same 72), and one staging and dequantization
    # of each tile serves 16 heads (two head blocks of BLOCK_H 8 would stage and convert it twice).

    @gluon.jit
    def _km_group_scores(a0, a1, a2, a3, qt, BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, MMA: gl.constexpr,
                         OP_A: gl.constexpr):
        """The four 128-group accumulators of S^T [BLOCK_N, BLOCK_H] = K q^T over the latent tiles
        (each warp its 16 keys' rows)."""
        s0 = gl.full([BLOCK_N, BLOCK_H], 0.0, gl.float32, layout=MMA)
        s1 = gl.full([BLOCK_N, BLOCK_H], 0.0, gl.float32, layout=MMA)
        s2 = gl.full([BLOCK_N, BLOCK_H], 0.0, gl.float32, layout=MMA)
        s3 = gl.full([BLOCK_N, BLOCK_H], 0.0, gl.float32, layout=MMA)
        s0 = mma_v2(a0.slice(0, 64, dim=1).load(OP_A), qt[0], s0)
        s0 = mma_v2(a0.slice(64, 64, dim=1).load(OP_A), qt[1], s0)
        s1 = mma_v2(a1.slice(0, 64, dim=1).load(OP_A), qt[2], s1)
        s1 = mma_v2(a1.slice(64, 64, dim=1).load(OP_A), qt[3], s1)
        s2 = mma_v2(a2.slice(0, 64, dim=1).load(OP_A), qt[4], s2)
        s2 = mma_v2(a2.slice(64, 64, dim=1).load(OP_A), qt[5], s2)
        s3 = mma_v2(a3.slice(0, 64, dim=1).load(OP_A), qt[6], s3)
        s3 = mma_v2(a3.slice(64, 64, dim=1).load(OP_A), qt[7], s3)
        return s0, s1, s2, s3

    @gluon.jit
    def _km_scores(a0, a1, a2, a3, arp, qt, BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, MMA: gl.constexpr,
                   OP_A: gl.constexpr):
        """S^T [BLOCK_N, BLOCK_H] = K q^T from the four 128-wide latent tiles and the rope tile, one
        accumulator per 128-group (the rope into the last)."""
        s0, s1, s2, s3 = _km_group_scores(a0, a1, a2, a3, qt, BLOCK_N, BLOCK_H, MMA, OP_A)
        s3 = mma_v2(arp.load(OP_A), qt[8], s3)
        return (s0 + s1) + (s2 + s3)

    @gluon.jit
    def _km_softmax_pv(s_smem, m_i, l_i, acc0, acc1, acc2, acc3, v0, v1, v2, v3, DT: gl.constexpr,
                       MMA: gl.constexpr, OP_A: gl.constexpr, OP_B: gl.constexpr):
        """After the S^T exchange barrier: P^T in the PV MMA's B-operand layout (all keys of the tile
        per head column; max and sum over keys are local plus quad shuffles), online softmax, and
        O^T += V^T P^T with V^T the latent tiles read transposed. Returns (m, l, acc0..acc3)."""
        s = s_smem.load(OP_B)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        pb = p.to(DT)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, MMA))[None, :]
        acc0 = mma_v2(v0.permute((1, 0)).load(OP_A), pb, acc0 * alpha_o)
        acc1 = mma_v2(v1.permute((1, 0)).load(OP_A), pb, acc1 * alpha_o)
        acc2 = mma_v2(v2.permute((1, 0)).load(OP_A), pb, acc2 * alpha_o)
        acc3 = mma_v2(v3.permute((1, 0)).load(OP_A), pb, acc3 * alpha_o)
        return m_new, l_i, acc0, acc1, acc2, acc3

    # FOLD (fp8_ds_mla, both kernels; written for KEYS_M's S^T, the 16-head kernel's S is its
    # transpose): the latent is consumed as e4m3 converted to fp16 unscaled (one
    # cvt per two values, exact) instead of e4m3 -> f32 x scale -> q's dtype (six instructions per
    # two values, ~45% of the loop's instructions: sm_90 SASS); the per-(key, group) scales are
    # folded into S^T (its rows are the keys: one multiply per group accumulator) and into P^T per
    # group (four fp16 B operands of O^T += V^T P^T). q's latent goes to fp16 divided by rq, a power
    # of two that is 1 unless some |q| >= 2^15 (exact, no overflow; S is multiplied back in fp32); P^T x scale is divided by a running
    # maximum R of the scales seen (<= 1 in fp16, no overflow whatever the cache holds), and the
    # accumulators are rescaled when R grows (folded into the softmax's alpha), O = acc x R / l.
    # The rope stays in q's dtype (its tile comes from the ring as stored).

    @gluon.jit
    def _fp16_divisor(q_lat):
        """FOLD's rq for a tile of q's latent: a power of two, 1 unless some |q| >= 2^15, so that
        q / rq is exact in fp16 (bf16 and fp16 values are fp16 values in that range)."""
        qmax = gl.max(gl.max(gl.abs(q_lat.to(gl.float32)), axis=1), axis=0)
        return gl.where(qmax >= 32768.0, gl.exp2(gl.ceil(gl.log2(qmax)) - 15.0), 1.0)

    @gluon.jit
    def _running_scale(r_i, alpha, c0, c1, c2, c3):
        """FOLD's running scale maximum after a tile whose per-key group scales are ``c0..c3``
        (each warp holds all keys of the tile: the maximum is warp-local): returns R (never 0),
        the accumulators' rescale factor alpha x R_old / R, and 1 / R."""
        cmax = gl.max(gl.maximum(gl.maximum(c0, c1), gl.maximum(c2, c3)), axis=0)
        r_new = gl.maximum(gl.maximum(r_i, cmax), 1.0e-30)
        return r_new, alpha * (r_i / r_new), 1.0 / r_new

    @gluon.jit
    def _convert_groups(lat_c, k0, k1, k2, k3, L_DQ: gl.constexpr):
        """A ring stage's latent bytes -> the four fp16 K tiles, unscaled (FOLD)."""
        GROUP: gl.constexpr = 128
        k0.store(lat_c.slice(0 * GROUP, GROUP, dim=1).load(L_DQ).to(gl.float8e4nv, bitcast=True).to(gl.float16))
        k1.store(lat_c.slice(1 * GROUP, GROUP, dim=1).load(L_DQ).to(gl.float8e4nv, bitcast=True).to(gl.float16))
        k2.store(lat_c.slice(2 * GROUP, GROUP, dim=1).load(L_DQ).to(gl.float8e4nv, bitcast=True).to(gl.float16))
        k3.store(lat_c.slice(3 * GROUP, GROUP, dim=1).load(L_DQ).to(gl.float8e4nv, bitcast=True).to(gl.float16))

    @gluon.jit
    def _tile_scales(kv_ptr, slot, num_slots, block_size, stride_kb, stride_ks):
        """The four fp32 group scales of a tile's rows, in the layout of ``slot`` (0 for no row).
        Read from global memory (L2: the ring's copies of these rows just passed through it) in
        the layout each use needs, so no layout conversion (and no barrier) is added."""
        valid, row = _rows(slot, num_slots, block_size, stride_kb, stride_ks)
        sp = (kv_ptr + row + _DS_SCALE_OFFSET).to(gl.pointer_type(gl.float32))
        return (gl.load(sp, mask=valid, other=0.0), gl.load(sp + 1, mask=valid, other=0.0),
                gl.load(sp + 2, mask=valid, other=0.0), gl.load(sp + 3, mask=valid, other=0.0))

    @gluon.jit
    def _km_scores_fold(a0, a1, a2, a3, arp, qt, c0, c1, c2, c3, rq, BLOCK_N: gl.constexpr,
                        BLOCK_H: gl.constexpr, MMA: gl.constexpr, OP_A: gl.constexpr):
        """S^T = K q^T with fp16 e4m3 K tiles and fp16 q / rq: each group's accumulator times its
        per-key scale (``c*``: [BLOCK_N] along the keys), times rq, plus the rope's (q's dtype)."""
        s0, s1, s2, s3 = _km_group_scores(a0, a1, a2, a3, qt, BLOCK_N, BLOCK_H, MMA, OP_A)
        sr = mma_v2(arp.load(OP_A), qt[8], gl.full([BLOCK_N, BLOCK_H], 0.0, gl.float32, layout=MMA))
        lat = (s0 * c0[:, None] + s1 * c1[:, None]) + (s2 * c2[:, None] + s3 * c3[:, None])
        return lat * rq + sr

    @gluon.jit
    def _km_softmax_pv_fold(s_smem, m_i, l_i, r_i, acc0, acc1, acc2, acc3, v0, v1, v2, v3, c0, c1, c2, c3,
                            MMA: gl.constexpr, OP_A: gl.constexpr, OP_B: gl.constexpr):
        """``_km_softmax_pv`` with the group scales folded into P^T (``c*``: [BLOCK_N] along the
        keys in the B operand's layout; every warp holds all keys of the tile, so the tile's largest
        scale is warp-local) over the fp16 e4m3 V tiles; ``r_i``: the running scale maximum R.
        Returns (m, l, R, acc0..acc3)."""
        s = s_smem.load(OP_B)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        r_new, alpha_r, inv_r = _running_scale(r_i, alpha, c0, c1, c2, c3)
        alpha_o = gl.convert_layout(alpha_r, gl.SliceLayout(0, MMA))[None, :]
        acc0 = mma_v2(v0.permute((1, 0)).load(OP_A), (p * (c0 * inv_r)[:, None]).to(gl.float16), acc0 * alpha_o)
        acc1 = mma_v2(v1.permute((1, 0)).load(OP_A), (p * (c1 * inv_r)[:, None]).to(gl.float16), acc1 * alpha_o)
        acc2 = mma_v2(v2.permute((1, 0)).load(OP_A), (p * (c2 * inv_r)[:, None]).to(gl.float16), acc2 * alpha_o)
        acc3 = mma_v2(v3.permute((1, 0)).load(OP_A), (p * (c3 * inv_r)[:, None]).to(gl.float16), acc3 * alpha_o)
        return m_new, l_i, r_new, acc0, acc1, acc2, acc3

    @gluon.jit
    def _step_km(kv_ptr, idx_row, stride_ik, tile, lim, num_slots, block_size, stride_kb, stride_ks,
                 qk_scale_log2, has_next,
                 lat_c, sc_c, rp_c, lat_n, sc_n, rp_n, k0, k1, k2, k3, s_smem, qt,
                 nl_lat, nl_sc, nl_rp, vs, m_i, l_i, acc0, acc1, acc2, acc3, r_i, rq,
                 BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, DT: gl.constexpr,
                 DQ_VEC: gl.constexpr, RING: gl.constexpr, ROWS8: gl.constexpr = False, FOLD: gl.constexpr = False,
                 WARPS_H: gl.constexpr = 1):
        """One KV tile of the KEYS_M kernel (same ring protocol as ``_step``). Returns the loop state.
        ``ROWS8`` (fp8 rows): ``sc_*`` are the ring's raw rope stages, ``rp_c`` / ``rp_n`` the one
        16-bit rope tile they are converted into (``nl_rp`` unused). ``FOLD`` (fp8_ds_mla): fp16
        e4m3 K tiles with the group scales folded into S^T and P^T (``r_i``: the running scale
        maximum, ``rq``: q's divisor; both unused otherwise)."""
        GROUP: gl.constexpr = 128
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS // WARPS_H, WARPS_H],
                                                      instr_shape=[16, 8])
        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        OP_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROW_M: gl.constexpr = gl.SliceLayout(1, MMA)  # along the keys of S^T
        COL_M: gl.constexpr = gl.SliceLayout(0, MMA)  # along the heads
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_R8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NUM_WARPS, 1], [1, 0])
        # the second copy of a row: 4 fp32 scales, or fp8 rows' 64 rope bytes
        L_SC: gl.constexpr = L_R8 if ROWS8 else gl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0])
        L_RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_DQ: gl.constexpr = gl.BlockedLayout([1, DQ_VEC], [32 // (GROUP // DQ_VEC), GROUP // DQ_VEC],
                                              [NUM_WARPS, 1], [1, 0])

        nn_lat, nn_sc, nn_rp = _tile_slots(idx_row, stride_ik, tile + 2, lim, BLOCK_N, L_LAT, L_SC, L_RP)
        vs_n = _slots(idx_row, stride_ik, tile + 1, lim, BLOCK_N, ROW_M)

        cp.wait_group(0)
        _cta_barrier()
        if RING == 2:
            _refill(kv_ptr, lat_n, sc_n, rp_n, nl_lat, nl_sc, nl_rp, has_next, num_slots, block_size,
                    stride_kb, stride_ks, DT, L_LAT, L_SC, L_RP, ROWS8)
        if ROWS8:
            _dequant_fp8(lat_c, sc_c, k0, k1, k2, k3, rp_c, L_DQ, L_R8, DT)
        elif FOLD:
            _convert_groups(lat_c, k0, k1, k2, k3, L_DQ)
        else:
            _dequant_groups(lat_c, sc_c, k0, k1, k2, k3, L_DQ, DT)
        _cta_barrier()
        if RING == 1 and ROWS8:  # the raw stage is converted: refill it now (S^T reads the 16-bit tiles)
            _refill(kv_ptr, lat_n, sc_n, rp_n, nl_lat, nl_sc, nl_rp, has_next, num_slots, block_size,
                    stride_kb, stride_ks, DT, L_LAT, L_SC, L_RP, ROWS8)

        # S^T = K q^T: each warp's 16 keys against the 8 heads, one accumulator per 128-group
        if FOLD:
            sa0, sa1, sa2, sa3 = _tile_scales(kv_ptr, vs, num_slots, block_size, stride_kb, stride_ks)
            sl_b = _slots(idx_row, stride_ik, tile, lim, BLOCK_N, gl.SliceLayout(1, OP_B))
            sb0, sb1, sb2, sb3 = _tile_scales(kv_ptr, sl_b, num_slots, block_size, stride_kb, stride_ks)
            s = _km_scores_fold(k0, k1, k2, k3, rp_c, qt, sa0, sa1, sa2, sa3, rq, BLOCK_N, BLOCK_H, MMA, OP_A)
        else:
            s = _km_scores(k0, k1, k2, k3, rp_c, qt, BLOCK_N, BLOCK_H, MMA, OP_A)

        # softmax over the keys: S^T through shared memory into the B-operand layout of the PV
        # MMA (every warp holds all keys of the tile for its heads column, split over a quad)
        valid = (vs >= 0) & (vs < num_slots)
        s_smem.store(gl.where(valid[:, None], s * qk_scale_log2, float("-inf")))
        _cta_barrier()
        if RING == 1 and not ROWS8:  # every warp's S^T (which read the rope from the stage) is done
            _refill(kv_ptr, lat_n, sc_n, rp_n, nl_lat, nl_sc, nl_rp, has_next, num_slots, block_size,
                    stride_kb, stride_ks, DT, L_LAT, L_SC, L_RP)
        if FOLD:
            m_new, l_i, r_i, acc0, acc1, acc2, acc3 = _km_softmax_pv_fold(
                s_smem, m_i, l_i, r_i, acc0, acc1, acc2, acc3, k0, k1, k2, k3, sb0, sb1, sb2, sb3, MMA, OP_A, OP_B)
        else:
            m_new, l_i, acc0, acc1, acc2, acc3 = _km_softmax_pv(s_smem, m_i, l_i, acc0, acc1, acc2, acc3,
                                                                k0, k1, k2, k3, DT, MMA, OP_A, OP_B)
        return nn_lat, nn_sc, nn_rp, vs_n, m_new, l_i, acc0, acc1, acc2, acc3, r_i

    # ----------------------------------------------------------------------------------------
    # KEYS_M over 16-bit rows (KEYS_M16): the bf16 / fp16 cache format (1152-byte rows)
    # ----------------------------------------------------------------------------------------
    # The rows are the MMAs' operands as stored: cp.async copies each tile's four 128-wide latent
    # groups and its rope straight into a two-stage ring of ldmatrix-swizzled tiles, and S^T and
    # O^T read them there (no dequantization, two CTA barriers per tile). Also the kernel a prefill
    # over a dequantized per-request workspace would run. Dispatched by rows16_config (SM90, >= 32 rows).

    @gluon.jit
    def _issue_tile16(kv_ptr, g0, g1, g2, g3, rp, sl_g, sl_r, num_slots, block_size, stride_kb, stride_ks,
                      DT: gl.constexpr, L_G: gl.constexpr, L_RP: gl.constexpr):
        """cp.async one tile of 16-bit rows into one ring stage (the 4 latent groups, the rope);
        masked rows are not read, their shared memory is zero-filled."""
        v, r = _rows(sl_g, num_slots, block_size, stride_kb, stride_ks)
        row = (kv_ptr + r).to(gl.pointer_type(DT))[:, None]
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, L_G))[None, :]
        m = v[:, None]
        cp.async_copy_global_to_shared(g0, row + (0 * 128 + c), mask=m)
        cp.async_copy_global_to_shared(g1, row + (1 * 128 + c), mask=m)
        cp.async_copy_global_to_shared(g2, row + (2 * 128 + c), mask=m)
        cp.async_copy_global_to_shared(g3, row + (3 * 128 + c), mask=m)
        v, r = _rows(sl_r, num_slots, block_size, stride_kb, stride_ks)
        c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, L_RP))
        rrow = (kv_ptr + r).to(gl.pointer_type(DT))
        cp.async_copy_global_to_shared(rp, rrow[:, None] + (512 + c64)[None, :], mask=v[:, None])

    @gluon.jit
    def _step_km16(kv_ptr, idx_row, stride_ik, tile, lim, num_slots, block_size, stride_kb, stride_ks,
                   qk_scale_log2, has_next, c0, c1, c2, c3, crp, n0, n1, n2, n3, nrp, s_smem, qt,
                   nl_g, nl_r, vs, m_i, l_i, acc0, acc1, acc2, acc3,
                   BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, DT: gl.constexpr,
                   WARPS_H: gl.constexpr = 1):
        """One tile of the KEYS_M16 kernel: wait for stage ``c*``, put the next tile in flight into
        ``n*`` (free: every warp is past the previous tile), S^T, softmax, O^T."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS // WARPS_H, WARPS_H],
                                                      instr_shape=[16, 8])
        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        OP_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROW_M: gl.constexpr = gl.SliceLayout(1, MMA)
        COL_M: gl.constexpr = gl.SliceLayout(0, MMA)
        L_G: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
        L_RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])

        nn_g = _slots(idx_row, stride_ik, tile + 2, lim, BLOCK_N, gl.SliceLayout(1, L_G))
        nn_r = _slots(idx_row, stride_ik, tile + 2, lim, BLOCK_N, gl.SliceLayout(1, L_RP))
        vs_n = _slots(idx_row, stride_ik, tile + 1, lim, BLOCK_N, ROW_M)

        cp.wait_group(0)
        _cta_barrier()
        if has_next:
            _issue_tile16(kv_ptr, n0, n1, n2, n3, nrp, nl_g, nl_r, num_slots, block_size, stride_kb, stride_ks,
                          DT, L_G, L_RP)
        cp.commit_group()

        s = _km_scores(c0, c1, c2, c3, crp, qt, BLOCK_N, BLOCK_H, MMA, OP_A)

        valid = (vs >= 0) & (vs < num_slots)
        s_smem.store(gl.where(valid[:, None], s * qk_scale_log2, float("-inf")))
        _cta_barrier()
        m_new, l_i, acc0, acc1, acc2, acc3 = _km_softmax_pv(s_smem, m_i, l_i, acc0, acc1, acc2, acc3,
                                                            c0, c1, c2, c3, DT, MMA, OP_A, OP_B)
        return nn_g, nn_r, vs_n, m_new, l_i, acc0, acc1, acc2, acc3

    @gluon.jit(do_not_specialize=["num_heads", "topk", "num_slots", "block_size", "num_splits",
                                  "tiles_per_split"])
    def _sparse_mla_v2_km_kernel(
        q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, cnt_ptr,
        qk_scale_log2,
        num_heads, topk, num_slots, block_size,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks,
        stride_it, stride_ik,
        stride_ot, stride_oh, stride_od,
        stride_lt, stride_lh,
        num_splits, tiles_per_split,
        v_scale, kscale_ptr,
        SPLIT: gl.constexpr,
        FUSED_MERGE: gl.constexpr,
        BLOCK_H: gl.constexpr,
        BLOCK_N: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        QK_ACCS: gl.constexpr = 4,
        DQ_VEC: gl.constexpr = 16,
        S_SWIZZLE: gl.constexpr = False,
        RING: gl.constexpr = 1,
        Q_REGS: gl.constexpr = 0,
        ROWS16: gl.constexpr = False,
        ROWS8: gl.constexpr = False,
        KSCALE_FROM_PTR: gl.constexpr = False,
        FOLD: gl.constexpr = False,
        WARPS_H: gl.constexpr = 1,
    ):
        """The KEYS_M kernel: the same parameters as ``_sparse_mla_v2_kernel`` (one plan and launch
        path; QK_ACCS / S_SWIZZLE / Q_REGS are not used: 4 accumulators, q^T always in registers),
        BLOCK_H 8 (mma.sync's N), BLOCK_N = 16 x NUM_WARPS. ``ROWS16``: the cache holds 16-bit rows
        (bf16 / fp16 of q's dtype, 1152 B): a two-stage ring of the rows as they are (RING unused).
        ``ROWS8``: the cache holds fp8 rows (576 B, e4m3 x one per-tensor scale: ``v_scale``, or the
        fp32 at ``kscale_ptr`` with KSCALE_FROM_PTR; ``qk_scale_log2`` then excludes it); the other
        formats pass ``v_scale`` 1.0 and any pointer. ``FOLD`` (fp8_ds_mla only): the latent is
        consumed as fp16 e4m3 with the group scales folded into S^T and P^T (see ``_convert_groups``).
        ``WARPS_H``: warps along the heads (1: BLOCK_H 8; 2: BLOCK_H 16, BLOCK_N = 16 x NUM_WARPS / 2)."""
        GROUP: gl.constexpr = 128
        DV: gl.constexpr = 512
        DT: gl.constexpr = q_ptr.dtype.element_ty
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS // WARPS_H, WARPS_H],
                                                      instr_shape=[16, 8])
        OP_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROW_M: gl.constexpr = gl.SliceLayout(1, MMA)
        COL_M: gl.constexpr = gl.SliceLayout(0, MMA)
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        # the second copy of a row: 4 fp32 scales, or fp8 rows' 64 rope bytes (as in _step_km)
        L_SC: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NUM_WARPS, 1], [1, 0]) if ROWS8 else \
            gl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0])
        L_RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        SH_PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        SH_SW: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        if ROWS16:  # two stages of the rows as stored: 4 latent groups + the rope each
            ga0, ga1, ga2, ga3 = _alloc_groups(BLOCK_N, DT)
            rpa = gl.allocate_shared_memory(DT, [BLOCK_N, 64], SH_SW)
            gb0, gb1, gb2, gb3 = _alloc_groups(BLOCK_N, DT)
            rpb = gl.allocate_shared_memory(DT, [BLOCK_N, 64], SH_SW)
        else:  # the raw ring, then the 16-bit K tiles both MMAs read (fp16 e4m3 with FOLD)
            lat_a, sc_a, rp_a, lat_b, sc_b, rp_b = _alloc_ring(BLOCK_N, DT, RING, ROWS8)
            k0, k1, k2, k3 = _alloc_groups(BLOCK_N, gl.float16 if FOLD else DT)
        s_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_H], SH_PLAIN)

        n_hb = gl.cdiv(num_heads, BLOCK_H)
        pid = gl.program_id(0)
        hb = pid % n_hb
        rest = pid // n_hb
        sp = rest % num_splits
        t = rest // num_splits

        # q^T straight from global memory into the B-operand registers: nine [64, BLOCK_H] chunks
        # (eight latent, the rope), held for the whole loop
        offs_qd = gl.arange(0, 64, layout=gl.SliceLayout(1, OP_B))
        offs_qh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, OP_B))
        qmask = (offs_qh < num_heads)[None, :]
        qb = q_ptr + t.to(gl.int64) * stride_qt + offs_qh[None, :] * stride_qh + offs_qd[:, None] * stride_qd
        qt = (gl.load(qb + 0 * stride_qd, mask=qmask, other=0.0), gl.load(qb + 64 * stride_qd, mask=qmask, other=0.0),
              gl.load(qb + 128 * stride_qd, mask=qmask, other=0.0), gl.load(qb + 192 * stride_qd, mask=qmask, other=0.0),
              gl.load(qb + 256 * stride_qd, mask=qmask, other=0.0), gl.load(qb + 320 * stride_qd, mask=qmask, other=0.0),
              gl.load(qb + 384 * stride_qd, mask=qmask, other=0.0), gl.load(qb + 448 * stride_qd, mask=qmask, other=0.0),
              gl.load(qb + 512 * stride_qd, mask=qmask, other=0.0))

        rq = 1.0
        if FOLD:  # q's latent to fp16 / rq (|q| / rq <= 2^15: no overflow); the rope stays in q's dtype
            L_QM: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, NUM_WARPS], [1, 0])  # [BLOCK_H, 512]
            offs_mh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_QM))
            offs_md = gl.arange(0, DV, layout=gl.SliceLayout(0, L_QM))
            qm = gl.load(q_ptr + t.to(gl.int64) * stride_qt + offs_mh[:, None] * stride_qh + offs_md[None, :] * stride_qd,
                         mask=(offs_mh < num_heads)[:, None], other=0.0)
            rq = _fp16_divisor(qm)
            iq = 1.0 / rq
            qt = ((qt[0].to(gl.float32) * iq).to(gl.float16), (qt[1].to(gl.float32) * iq).to(gl.float16),
                  (qt[2].to(gl.float32) * iq).to(gl.float16), (qt[3].to(gl.float32) * iq).to(gl.float16),
                  (qt[4].to(gl.float32) * iq).to(gl.float16), (qt[5].to(gl.float32) * iq).to(gl.float16),
                  (qt[6].to(gl.float32) * iq).to(gl.float16), (qt[7].to(gl.float32) * iq).to(gl.float16), qt[8])
        r_i = gl.zeros([], gl.float32)  # FOLD's running scale maximum (carried, unused otherwise)
        if ROWS8 and KSCALE_FROM_PTR:  # fp8's per-tensor scale, read on the device (graph-safe)
            ks = gl.load(kscale_ptr)
            qk_scale_log2 = qk_scale_log2 * ks
            v_scale = ks

        n_tiles = gl.maximum(gl.cdiv(topk, BLOCK_N), 1)
        tile_lo = sp * tiles_per_split
        n_t = gl.minimum(tiles_per_split, n_tiles - tile_lo)
        lim = gl.minimum((tile_lo + tiles_per_split) * BLOCK_N, topk)
        idx_row = idx_ptr + t.to(gl.int64) * stride_it
        S_RP: gl.constexpr = gl.SliceLayout(1, L_RP)
        if ROWS16:
            L_G: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
            S_G: gl.constexpr = gl.SliceLayout(1, L_G)
            _issue_tile16(kv_ptr, ga0, ga1, ga2, ga3, rpa,
                          _slots(idx_row, stride_ik, tile_lo, lim, BLOCK_N, S_G),
                          _slots(idx_row, stride_ik, tile_lo, lim, BLOCK_N, S_RP),
                          num_slots, block_size, stride_kb, stride_ks, DT, L_G, L_RP)
            cp.commit_group()
            nl_g = _slots(idx_row, stride_ik, tile_lo + 1, lim, BLOCK_N, S_G)
            nl_r = _slots(idx_row, stride_ik, tile_lo + 1, lim, BLOCK_N, S_RP)
            vs = _slots(idx_row, stride_ik, tile_lo, lim, BLOCK_N, ROW_M)
        else:
            nl_lat, nl_sc, nl_rp = _ring_prologue(kv_ptr, lat_a, sc_a, rp_a, idx_row, stride_ik, tile_lo, lim,
                                                  num_slots, block_size, stride_kb, stride_ks, BLOCK_N, DT,
                                                  L_LAT, L_SC, L_RP, ROWS8)
            vs = _slots(idx_row, stride_ik, tile_lo, lim, BLOCK_N, ROW_M)
        m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(0, OP_B))
        l_i = gl.full([BLOCK_H], 0.0, gl.float32, layout=gl.SliceLayout(0, OP_B))
        acc0 = gl.full([GROUP, BLOCK_H], 0.0, gl.float32, layout=MMA)
        acc1 = gl.full([GROUP, BLOCK_H], 0.0, gl.float32, layout=MMA)
        acc2 = gl.full([GROUP, BLOCK_H], 0.0, gl.float32, layout=MMA)
        acc3 = gl.full([GROUP, BLOCK_H], 0.0, gl.float32, layout=MMA)

        if ROWS16:
            for i in range(0, n_t, 2):
                tile = tile_lo + i
                nl_g, nl_r, vs, m_i, l_i, acc0, acc1, acc2, acc3 = _step_km16(
                    kv_ptr, idx_row, stride_ik, tile, lim, num_slots, block_size, stride_kb, stride_ks,
                    qk_scale_log2, i + 1 < n_t, ga0, ga1, ga2, ga3, rpa, gb0, gb1, gb2, gb3, rpb, s_smem, qt,
                    nl_g, nl_r, vs, m_i, l_i, acc0, acc1, acc2, acc3, BLOCK_H, BLOCK_N, NUM_WARPS, DT, WARPS_H)
                if i + 1 < n_t:
                    nl_g, nl_r, vs, m_i, l_i, acc0, acc1, acc2, acc3 = _step_km16(
                        kv_ptr, idx_row, stride_ik, tile + 1, lim, num_slots, block_size, stride_kb, stride_ks,
                        qk_scale_log2, i + 2 < n_t, gb0, gb1, gb2, gb3, rpb, ga0, ga1, ga2, ga3, rpa, s_smem, qt,
                        nl_g, nl_r, vs, m_i, l_i, acc0, acc1, acc2, acc3, BLOCK_H, BLOCK_N, NUM_WARPS, DT, WARPS_H)
        else:
            for i in range(0, n_t, 2):
                tile = tile_lo + i
                nl_lat, nl_sc, nl_rp, vs, m_i, l_i, acc0, acc1, acc2, acc3, r_i = _step_km(
                    kv_ptr, idx_row, stride_ik, tile, lim, num_slots, block_size, stride_kb, stride_ks,
                    qk_scale_log2, i + 1 < n_t,
                    lat_a, sc_a, rp_a, lat_b, sc_b, rp_b, k0, k1, k2, k3, s_smem, qt,
                    nl_lat, nl_sc, nl_rp, vs, m_i, l_i, acc0, acc1, acc2, acc3, r_i, rq,
                    BLOCK_H, BLOCK_N, NUM_WARPS, DT, DQ_VEC, RING, ROWS8, FOLD, WARPS_H)
                if i + 1 < n_t:
                    nl_lat, nl_sc, nl_rp, vs, m_i, l_i, acc0, acc1, acc2, acc3, r_i = _step_km(
                        kv_ptr, idx_row, stride_ik, tile + 1, lim, num_slots, block_size, stride_kb, stride_ks,
                        qk_scale_log2, i + 2 < n_t,
                        lat_b, sc_b, rp_b, lat_a, sc_a, rp_a, k0, k1, k2, k3, s_smem, qt,
                        nl_lat, nl_sc, nl_rp, vs, m_i, l_i, acc0, acc1, acc2, acc3, r_i, rq,
                        BLOCK_H, BLOCK_N, NUM_WARPS, DT, DQ_VEC, RING, ROWS8, FOLD, WARPS_H)
        cp.wait_group(0)

        # ---- epilogue: O^T [dims, heads] -> out[t, h, dims] ------------------------------------
        l_o = gl.convert_layout(l_i, COL_M)
        m_o = gl.convert_layout(m_i, COL_M)
        has = l_o > 0.0
        if ROWS8:  # the per-tensor scale of V
            inv = gl.where(has, v_scale / gl.where(has, l_o, 1.0), 0.0)
        elif FOLD:  # the accumulators are in units of the running scale maximum R
            inv = gl.where(has, r_i / gl.where(has, l_o, 1.0), 0.0)
        else:
            inv = gl.where(has, 1.0 / gl.where(has, l_o, 1.0), 0.0)
        lse = gl.where(has, (m_o + gl.log2(gl.where(has, l_o, 1.0))) * 0.6931471805599453, float("-inf"))
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=COL_M)
        hmask = offs_h < num_heads
        offs_d = gl.arange(0, GROUP, layout=ROW_M)
        if SPLIT:
            prow = (t.to(gl.int64) * num_heads + offs_h) * num_splits + sp
            po = po_ptr + prow[None, :] * DV + offs_d[:, None]
            gl.store(po + 0 * GROUP, acc0 * inv[None, :], mask=hmask[None, :])
            gl.store(po + 1 * GROUP, acc1 * inv[None, :], mask=hmask[None, :])
            gl.store(po + 2 * GROUP, acc2 * inv[None, :], mask=hmask[None, :])
            gl.store(po + 3 * GROUP, acc3 * inv[None, :], mask=hmask[None, :])
            gl.store(plse_ptr + prow, lse, mask=hmask)
            if FUSED_MERGE:
                _merge_if_last(po_ptr, plse_ptr, out_ptr, lse_ptr, cnt_ptr, t, hb, n_hb, num_heads, num_splits,
                               stride_ot, stride_oh, stride_od, stride_lt, stride_lh, BLOCK_H, NUM_WARPS)
        else:
            OT: gl.constexpr = out_ptr.dtype.element_ty
            o_row = out_ptr + t.to(gl.int64) * stride_ot + offs_h[None, :] * stride_oh
            gl.store(o_row + (0 * GROUP + offs_d)[:, None] * stride_od, (acc0 * inv[None, :]).to(OT), mask=hmask[None, :])
            gl.store(o_row + (1 * GROUP + offs_d)[:, None] * stride_od, (acc1 * inv[None, :]).to(OT), mask=hmask[None, :])
            gl.store(o_row + (2 * GROUP + offs_d)[:, None] * stride_od, (acc2 * inv[None, :]).to(OT), mask=hmask[None, :])
            gl.store(o_row + (3 * GROUP + offs_d)[:, None] * stride_od, (acc3 * inv[None, :]).to(OT), mask=hmask[None, :])
            gl.store(lse_ptr + t.to(gl.int64) * stride_lt + offs_h * stride_lh, lse, mask=hmask)


# --------------------------------------------------------------------------------------------
# Dispatch (shapes and device only: CUDA-graph safe)
# --------------------------------------------------------------------------------------------

_SUPPORTED_MAJORS = (8, 9, 12)  # cp.async + mma.sync; 10.x (datacenter Blackwell) stays on v1


@functools.lru_cache(maxsize=None)
def _device_props(device: torch.device) -> tuple[int, int, int]:
    """(major, minor, multiprocessor count) of a CUDA device, cached (no sync after the first call)."""
    p = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    return p.major, p.minor, p.multi_processor_count


def pick_config_v2(num_heads: int, cc_major: int, num_tokens: int = 1) -> dict:
    """Tile configuration of the v2 kernel (shapes and device only: CUDA-graph safe).

    BLOCK_H 16 (the mma.sync M), BLOCK_N KV rows per tile, NUM_WARPS, QK_ACCS (S in one mma.sync
    chain or one accumulator per 128-group), and the split policy: CTAS_PER_SM (CTA slots of one
    SM: BLOCK_N 32 with 4 warps takes 95,232 B of shared memory, so two on SM90's 228 KB, one on
    SM120's ~100 KB) and SPLIT_OVERHEAD (what one program costs beyond its tiles, in tiles: q
    staging, the first tile's exposed latency, the partial-result write). ``_pick_splits_slots``
    then minimizes waves-of-slots x (tiles per program + overhead).

    Measured with ``bench/sparse_mla_v2_gpu.py`` (32k context, H 8 / 16; H200 sweeps in
    ``bench/results/sparse_mla_v2_h200.json``, H100 sweeps of 2026-12-06 in ``..._h100.json``):
    QK_ACCS 4 took 0-14% less time than 1 at every T (T = 128: 133.5 against 144.1 us on the H100);
    the slot policy picks the best split count the sweep found at T = 1, 32 and 128 (64, 8, 2
    splits: 9.4, 40.1, 133.5 us on the H100) where the fixed WAVES x SMs targets were each wrong
    somewhere (WAVES 4: 153 us at T = 128; WAVES 1: 92 us at T = 64 against 74). A config with
    ``WAVES`` (and ``MIN_TILES``) uses the older target policy instead (sweeps).

    Second H100 sweep (2026-12-06, ``bench/results/sparse_mla_v2_h100_keys_m.json``): DQ_VEC 8 took
    2-7% less than 16 at every T for 8 and 16 heads (T = 128: 124.9 / 137.1 against 133.7 / 145.1
    us); on SM90 with <= 8 heads the KEYS_M kernel (BLOCK_N 32, two warps, one raw stage, four CTAs
    per SM) took 37.0 / 61.3 / 102.2 us at T = 32 / 64 / 128 against 41.4 / 73.7 / 133.7 (0.76-0.89x)
    and lost at T = 4 (14.0 against 12.7): it runs from KEYS_M_MIN_TOKENS query rows. At 16 heads
    (two KEYS_M head blocks) it lost everywhere (172.8 against 145.1 us at T = 128)."""
    if cc_major == 9 and num_heads <= 8 and num_tokens >= KEYS_M_MIN_TOKENS:
        return dict(KEYS_M_CONFIGS[2], QK_ACCS=4, DQ_VEC=16, SPLIT_OVERHEAD=2)
    if (cc_major == 9 and 8 < num_heads <= 16 and KEYS_M_H16_MIN_TOKENS is not None
            and num_tokens >= KEYS_M_H16_MIN_TOKENS):
        return dict(KEYS_M_H16_CONFIGS[KEYS_M_H16_DISPATCH], QK_ACCS=4, DQ_VEC=16, SPLIT_OVERHEAD=2)
    return v2_kernel_config(cc_major)


def rows16_config(num_heads: int, cc_major: int, num_tokens: int) -> dict | None:
    """The ROWS16 configuration the dispatch runs for the bf16 / fp16 cache format, or ``None``
    where that format stays on v1. Measured on the H100 (2026-12-06 session 3, 32k context, v1
    against both ROWS16 configs on the same bf16 pool, us; ``bench/results/sparse_mla_v2_h100_rows.json``):
    H 8, T 4 / 32 / 128: v1 17.8 / 61.3 / 194.6, BLOCK_N 32 (2 warps) 13.4 / 42.2 / 129.2, BLOCK_N 64
    (4 warps) 13.2 / 41.8 / 116.8; H 16 (two head blocks): v1 18.9 / 65.5 / 198.3, BLOCK_N 32 14.1 /
    47.6 / 156.0, BLOCK_N 64 13.6 / 53.0 / 155.0. SM90 only (BLOCK_N 64 does not fit SM120's shared
    memory; KEYS_M with one 2-warp CTA per SM lost to the 16-head kernel under the SM120-occupancy
    proxy), from ROWS16_MIN_TOKENS query rows (T 1-3 not measured). With 9-16 heads from
    ROWS_H16_MIN_TOKENS rows: the 16-head KEYS_M over 16-bit rows (``KEYS_M_H16_CONFIGS[3]``)."""
    if cc_major != 9 or not 1 <= num_heads <= 16 or num_tokens < ROWS16_MIN_TOKENS:
        return None
    if num_heads > 8 and num_tokens >= ROWS_H16_MIN_TOKENS:
        return dict(KEYS_M_H16_CONFIGS[3], QK_ACCS=4, DQ_VEC=16, SPLIT_OVERHEAD=2)
    return dict(ROWS16_CONFIGS[1] if num_heads <= 8 else ROWS16_CONFIGS[0], QK_ACCS=4, DQ_VEC=16, SPLIT_OVERHEAD=2)


def rows8_config(num_heads: int, cc_major: int, num_tokens: int) -> dict | None:
    """The ROWS8 configuration the dispatch runs for the fp8 cache format (576-byte rows, one
    per-tensor scale), or ``None`` where it stays on v1. Measured on the H100 (same run as
    :func:`rows16_config`, an fp8 pool with the scale as a device tensor, us): H 8, T 4 / 32 / 128:
    v1 17.0 / 64.6 / 185.2, BLOCK_N 32 (2 warps) 12.3 / 32.1 / 86.5, BLOCK_N 64 (4 warps) 12.1 / 31.2 /
    88.0; H 16: v1 18.0 / 68.7 / 189.4, BLOCK_N 32 15.8 / 44.6 / 147.3, BLOCK_N 64 15.0 / 45.8 / 129.5
    (fp8_ds_mla's v2 in the same run: 12.5 / 37.4 / 102.6 at H 8, 13.8 / 42.8 / 137.2 at H 16).
    BLOCK_N 64 everywhere (within 2% of the best at 8 heads, 12% faster at 16 heads / T 128);
    SM90 only, from ROWS8_MIN_TOKENS query rows (T 1-3 not measured). With 9-16 heads from
    ROWS_H16_MIN_TOKENS rows: the 16-head KEYS_M over fp8 rows (``KEYS_M_H16_CONFIGS[4]``)."""
    if cc_major != 9 or not 1 <= num_heads <= 16 or num_tokens < ROWS8_MIN_TOKENS:
        return None
    if num_heads > 8 and num_tokens >= ROWS_H16_MIN_TOKENS:
        return dict(KEYS_M_H16_CONFIGS[4], QK_ACCS=4, DQ_VEC=16, SPLIT_OVERHEAD=2)
    return dict(ROWS8_CONFIGS[1], QK_ACCS=4, DQ_VEC=16, SPLIT_OVERHEAD=2)


def v2_kernel_config(cc_major: int) -> dict:
    """The default configuration of the 16-head-block kernel (``_sparse_mla_v2_kernel``).

    Under the SM120-occupancy proxy (H100, mma.sync, one CTA per SM as SM120's 100 KB allow;
    ``bench/results/sparse_mla_v2_h100_sm120occupancy.json``) this kernel ranked first; KEYS_M (one
    2-warp CTA per SM there) took 1.2-2.3x. ``Q_REGS`` 2 (q's first two K-chunks in registers) took
    0.97-0.99x its time at every point there (151.2 against 154.6 us at H 8, T 128) but spills 16 B
    of stack on sm_120 / sm_121 with Triton 3.8 (the newest pin's; none with 3.6), so SM12x keeps
    ``Q_REGS`` 0."""
    return {"BLOCK_H": 16, "BLOCK_N": 32, "NUM_WARPS": 4, "QK_ACCS": 4, "DQ_VEC": 8,
            "CTAS_PER_SM": 2 if cc_major == 9 else 1, "SPLIT_OVERHEAD": 2}


# The merge of a split launch: True takes v1's rule (fused into the split kernel, ``_merge_if_last``,
# at <= FUSED_MERGE_MAX_SPLITS = 5 splits, v1's separate merge kernel above), False the separate
# kernel everywhere. On an H100 (2026-12-07, fp8_ds_mla, 32k context, dispatch configs) the fused
# merge won at 2-4 splits against the separate merge's 128-column tiles (H=8 T=128 94.3 / 100.8 us,
# H=16 T=128 120.7 / 136.9; bench/results/sparse_mla_v2_fold_h100_stdout.txt) and lost at 8+ (T=4, 64 splits: 122
# / 12.5: the last arriver's serial merge); with the separate merge's whole-row tiles (merge_tile)
# the separate merge wins or ties everywhere: H=8 T=128 (4 splits) 89.5 / 92.4, H=16 T=64 (4)
# 65.4 / 73.6, T=128 (2) 118.5 / 119.2, T=32 (8-16) 33.6-38.1 / 52.6-56.7
# (bench/results/v2_kernel_split_h100.json): the fused merge's tail costs the attention kernel
# 8-13 us there. Config MERGE / GLM5_SPARSE_MLA_MERGE still force either.
V2_FUSED_MERGE = False


def merge_tile(num_splits: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_D, num_warps) of v1's separate merge kernel for a v2 split launch. Up to 16
    splits one program merges a whole (row, head) (512 columns): with v1's 128-column programs the
    merge was bound by launching 4 x T x H tiny CTAs, 5.1-25.3 us against a 2.8-3.5 us bytes floor
    at H = 8 / 16, T = 32-128 on an H100 (bench/results/v2_kernel_split_h100_merge128.json); whole
    rows take 3.3-6.2 us (v2_kernel_split_h100.json). 17-64 splits keep 128 columns (64 x 512
    partials would not fit one program's registers; 512 columns measured slower at 64 splits)."""
    if num_splits <= 16:
        return 16, LATENT_DIM, 4
    return MAX_SPLITS, 128, 4


# config keys that do not choose a kernel's tiles (an override of only these keeps the dispatch's
# kernel): the merge of a split launch, and FOLD (both kernels take it; other row formats refuse it)
_KEEP_KERNEL_KEYS = {"MERGE", "FOLD"}


def resolve_config_v2(num_heads: int, cc_major: int, num_tokens: int, config: dict | None = None,
                      kv_format: str = "fp8_ds_mla") -> dict:
    """The dispatch's configuration with ``config``'s keys on top. An override that does not set
    ``KEYS_M`` tunes the 16-head-block kernel: where the dispatch picked KEYS_M, it applies to that
    kernel's defaults instead (a BLOCK_N / NUM_WARPS meant for it would not fit KEYS_M's tiles);
    an override of only ``MERGE`` (``"fused"`` / ``"separate"``: the merge of a split launch)
    and / or ``FOLD`` keeps the dispatch's kernel.
    16-bit rows (any ``kv_format`` but fp8_ds_mla) start from :func:`rows16_config` (or the first
    ROWS16 config where the dispatch would not run them: an override asked for v2)."""
    if kv_format != "fp8_ds_mla":
        if _v1._kvf.resolve_kv_format(kv_format, torch.bfloat16).code == _v1._kvf.FMT_FP8:
            cfg = rows8_config(num_heads, cc_major, num_tokens) or dict(ROWS8_CONFIGS[0], QK_ACCS=4, DQ_VEC=16,
                                                                        SPLIT_OVERHEAD=2)
        else:
            cfg = rows16_config(num_heads, cc_major, num_tokens) or dict(ROWS16_CONFIGS[0], QK_ACCS=4, SPLIT_OVERHEAD=2)
        if config:
            cfg.update(config)
        return cfg
    cfg = dict(pick_config_v2(num_heads, cc_major, num_tokens))
    if config:
        if cfg.get("KEYS_M") and not config.get("KEYS_M") and set(config) - _KEEP_KERNEL_KEYS:
            cfg = v2_kernel_config(cc_major)
        cfg.update(config)
    return cfg


# Tile configurations the benchmark and the GPU tests also run (config= overrides). All compile
# for sm_90 without spills; BLOCK_N 64 needs more than SM120's shared memory (SM90/SM100 only).
TUNING_CONFIGS = (
    {"BLOCK_N": 32, "NUM_WARPS": 4},
    {"BLOCK_N": 32, "NUM_WARPS": 8},
    {"BLOCK_N": 16, "NUM_WARPS": 4},
    {"BLOCK_N": 64, "NUM_WARPS": 8},
)


# The KEYS_M kernel's configurations (BLOCK_H 8 = mma.sync's N, BLOCK_N = 16 keys per warp) with
# their CTA slots per SM on SM90 (shared memory: 109,568 B at BLOCK_N 64 / RING 1, 151,552 B at
# RING 2, 54,784 B at BLOCK_N 32 / RING 1, 75,776 B at RING 2). None fits two CTAs in SM120's
# ~100 KB with four warps: SM120 keeps the kernel above.
KEYS_M_MIN_TOKENS = 32  # measured: KEYS_M won at T = 32 / 64 / 128, lost at T = 4 (T in 5..31 not measured)
KEYS_M_CONFIGS = (
    {"KEYS_M": True, "BLOCK_H": 8, "BLOCK_N": 64, "NUM_WARPS": 4, "RING": 1, "CTAS_PER_SM": 2},
    {"KEYS_M": True, "BLOCK_H": 8, "BLOCK_N": 64, "NUM_WARPS": 4, "RING": 2, "CTAS_PER_SM": 1},
    {"KEYS_M": True, "BLOCK_H": 8, "BLOCK_N": 32, "NUM_WARPS": 2, "RING": 1, "CTAS_PER_SM": 4},
    {"KEYS_M": True, "BLOCK_H": 8, "BLOCK_N": 32, "NUM_WARPS": 2, "RING": 2, "CTAS_PER_SM": 3},
)

# KEYS_M with 16 heads in one CTA (WARPS_H 2: the warps split over the keys and over two 8-head
# columns; each tile staged and dequantized once for 16 heads, where two BLOCK_H 8 head blocks
# convert it twice). On sm_90 (Triton 3.6): 250 registers at BLOCK_N 32 / 4 warps (two CTAs per
# SM), 231 at BLOCK_N 64 / 8 warps (one), no spills; shared memory 55,808 B (fp8_ds_mla, RING 1),
# 76,800 B (RING 2), 111,616 B (BLOCK_N 64), 75,776 B (ROWS16), 57,344 B (ROWS8).
# GPU-tested; timed on an H100 (2026-12-07, bench/results/v2_keys_m_h16_h100.json, whole calls at
# H = 16, QK_ACCS 1): BLOCK_N 32 / RING 1 116.5 / 65.7 / 38.9 / 15.5 us at T = 128 / 64 / 32 / 4
# against the dispatch's 116.9 / 65.2 / 37.4 / 13.4 (RING 2 and BLOCK_N 64 slower): a tie at
# best, so not dispatched; with the 8-head dispatch's QK_ACCS 4 (2026-12-08,
# bench/results/v2_keys_m_h16_acc4_h100.json) 115.7 / 65.8 against 117.0 / 65.1 at T = 128 / 64:
# a tie again. (Over bf16 / fp8 rows, where the alternative is two 8-head KEYS_M blocks, it wins:
# ROWS_H16_MIN_TOKENS.)
KEYS_M_H16_MIN_TOKENS = None  # 9..16 heads on SM90 from this many rows (None: not dispatched)
KEYS_M_H16_DISPATCH = 0  # the fp8_ds_mla entry of KEYS_M_H16_CONFIGS it dispatches
KEYS_M_H16_CONFIGS = (
    {"KEYS_M": True, "BLOCK_H": 16, "WARPS_H": 2, "BLOCK_N": 32, "NUM_WARPS": 4, "RING": 1, "CTAS_PER_SM": 2},
    {"KEYS_M": True, "BLOCK_H": 16, "WARPS_H": 2, "BLOCK_N": 32, "NUM_WARPS": 4, "RING": 2, "CTAS_PER_SM": 2},
    {"KEYS_M": True, "BLOCK_H": 16, "WARPS_H": 2, "BLOCK_N": 64, "NUM_WARPS": 8, "RING": 1, "CTAS_PER_SM": 1},
    {"KEYS_M": True, "ROWS16": True, "BLOCK_H": 16, "WARPS_H": 2, "BLOCK_N": 32, "NUM_WARPS": 4, "CTAS_PER_SM": 2},
    {"KEYS_M": True, "ROWS8": True, "BLOCK_H": 16, "WARPS_H": 2, "BLOCK_N": 32, "NUM_WARPS": 4, "RING": 1,
     "CTAS_PER_SM": 2},
)


# 9-16 heads over bf16 / fp8 rows: one 16-head KEYS_M CTA (each tile staged and converted once for
# 16 heads) instead of two 8-head blocks, from this many query rows. H100, 32k context, H 16
# (bench/results/sparse_mla_v2_rows_h16_h100.json, us, T 4 / 32 / 64 / 128): fp8 rows 15.1 / 34.8 /
# 58.8 / 106.4 against the 8-head dispatch's 15.1 / 41.3 / 73.3 / 130.9; bf16 rows 15.7 / 41.6 /
# 69.6 / 120.4 against 14.0 / 42.4 / 73.1 / 133.7 (T 5-31 not measured).
ROWS_H16_MIN_TOKENS = 32

# KEYS_M over 16-bit rows (the bf16 / fp16 cache format; config ROWS16, dispatched by
# rows16_config): 74,752 B at BLOCK_N 32 (three CTAs per SM on SM90, one on SM120), 149,504 B at
# BLOCK_N 64.
ROWS16_MIN_TOKENS = 4  # measured faster than v1 at T = 4 / 32 / 128 (T 1-3 not measured)
ROWS16_CONFIGS = (
    {"KEYS_M": True, "ROWS16": True, "BLOCK_H": 8, "BLOCK_N": 32, "NUM_WARPS": 2, "CTAS_PER_SM": 3},
    {"KEYS_M": True, "ROWS16": True, "BLOCK_H": 8, "BLOCK_N": 64, "NUM_WARPS": 4, "CTAS_PER_SM": 1},
)


# KEYS_M over fp8 rows (the ``fp8`` format, 576 B: e4m3 x one per-tensor scale; config ROWS8,
# dispatched by rows8_config): the ring holds the raw rows, the latent and the rope are converted once into
# 16-bit tiles. 56,320 B at BLOCK_N 32 / RING 1 (four CTAs per SM on SM90, one on SM120),
# 112,640 B at BLOCK_N 64 / RING 1 (two on SM90).
ROWS8_MIN_TOKENS = 4  # measured faster than v1 at T = 4 / 32 / 128 (T 1-3 not measured)
ROWS8_CONFIGS = (
    {"KEYS_M": True, "ROWS8": True, "BLOCK_H": 8, "BLOCK_N": 32, "NUM_WARPS": 2, "RING": 1, "CTAS_PER_SM": 4},
    {"KEYS_M": True, "ROWS8": True, "BLOCK_H": 8, "BLOCK_N": 64, "NUM_WARPS": 4, "RING": 1, "CTAS_PER_SM": 2},
)


def shared_bytes_v2(block_n: int, elem: int = 2, block_h: int = 16, ring: int = 2, keys_m: bool = False,
                    rows16: bool = False, rows8: bool = False, warps_h: int = 1) -> int:
    """Shared memory the kernel allocates explicitly: the ring ``ring`` x (512 + 16 + 64*elem) B per
    row, the 16-bit K tile, q and the fp32 S tile (KEYS_M: no q tile, q^T lives in registers; its S^T
    tile has 8 x ``warps_h`` head columns)."""
    s_tile = block_n * 8 * warps_h * 4
    if rows16:  # two stages of 576 16-bit values per row, the S^T tile
        return 2 * block_n * 576 * elem + s_tile
    if rows8:  # ring x 576 raw bytes per row, the 16-bit latent and rope tiles, the S^T tile
        return ring * block_n * 576 + block_n * 576 * elem + s_tile
    if keys_m:
        return ring * block_n * (512 + 16 + 64 * elem) + block_n * 512 * elem + s_tile
    return (ring * block_n * (512 + 16 + 64 * elem) + block_n * 512 * elem + block_h * 576 * elem
            + block_h * block_n * 4)


def config_shared_bytes(cfg: dict) -> int:
    """``shared_bytes_v2`` of a (resolved) config: its kernel, row format, ring and WARPS_H."""
    return shared_bytes_v2(cfg["BLOCK_N"], ring=cfg.get("RING", 2), keys_m=bool(cfg.get("KEYS_M")),
                           rows16=bool(cfg.get("ROWS16")), rows8=bool(cfg.get("ROWS8")),
                           warps_h=int(cfg.get("WARPS_H", 1)))


def v2_unsupported_reason(q: torch.Tensor, kv_format: str, num_heads: int | None = None, *,
                          kv_cache: torch.Tensor | None = None, config: dict | None = None) -> str | None:
    """``None`` when the v2 kernel handles this call, else why it goes to v1 (the fallback). With
    ``kv_cache``, a cache whose rows are not 16-byte aligned (its 16-byte copies need them) goes to
    v1 too, which reads any alignment, instead of failing in v2's validation. 16-bit rows (the
    bf16 / fp16 format, of q's dtype) run in v2 where :func:`rows16_config` dispatches them (SM90,
    <= 16 heads, >= ROWS16_MIN_TOKENS rows) or where ``config`` asks for ``ROWS16``; fp8 rows
    likewise through :func:`rows8_config` or config ``ROWS8``."""
    if not HAS_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    rows16 = kv_format != "fp8_ds_mla"
    rows8 = False
    if rows16:
        try:
            code = _v1._kvf.resolve_kv_format(kv_format, q.dtype).code
        except Exception as e:  # unknown name: v1 raises the clear error
            return f"kv_format {kv_format!r}: {e}"
        rows8 = code == _v1._kvf.FMT_FP8
        if rows8:
            if config and not config.get("ROWS8", True):
                return f"kv_format {kv_format!r} with config ROWS8=False: fp8 rows run v2 only as ROWS8"
            rows16 = False
        elif config and not config.get("ROWS16", True):
            return f"kv_format {kv_format!r} with config ROWS16=False: 16-bit rows run v2 only as ROWS16"
        elif kv_cache is not None and kv_cache.dtype != q.dtype:
            return f"16-bit rows of {kv_cache.dtype} with q of {q.dtype}: ROWS16 reads rows of q's dtype"
    if q.dim() != 3 or q.shape[-1] != HEAD_DIM:
        return "q is not [T, H, 576]"
    h = q.shape[1] if num_heads is None else num_heads
    if not 1 <= h <= 16:
        return f"H = {h}: v2 handles 1..16 heads"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {q.dtype}"
    if kv_cache is not None and kv_cache.dim() >= 2 and (
            kv_cache.stride(0) * kv_cache.element_size() % 16 or kv_cache.stride(1) * kv_cache.element_size() % 16
            or kv_cache.data_ptr() % 16):
        return "cache rows not 16-byte aligned"
    if not q.is_cuda:
        return "not a CUDA tensor (Gluon kernels do not run in the interpreter)"
    major = _device_props(q.device)[0]
    if major not in _SUPPORTED_MAJORS:
        return f"compute capability {major}.x: v2 runs on 8.x, 9.x and 12.x"
    if rows16 and not (config and config.get("ROWS16")) and rows16_config(
            h, _v1._dispatch_major(major), q.shape[0]) is None:
        return (f"16-bit rows at H = {h}, T = {q.shape[0]} on {major}.x: ROWS16 is dispatched on SM90 for <= 16 "
                f"heads from {ROWS16_MIN_TOKENS} query rows (measured there), v1 elsewhere")
    if rows8 and not (config and config.get("ROWS8")) and rows8_config(
            h, _v1._dispatch_major(major), q.shape[0]) is None:
        return (f"fp8 rows at H = {h}, T = {q.shape[0]} on {major}.x: ROWS8 is dispatched on SM90 for <= 16 "
                f"heads from {ROWS8_MIN_TOKENS} query rows (measured there), v1 elsewhere")
    return None


def _pick_splits_slots(T: int, n_hb: int, n_tiles: int, slots: int, overhead: float) -> int:
    """Split count minimizing ceil(programs / slots) x (tiles per program + overhead): whole waves of
    CTA slots, each as short as the split makes it; ties go to fewer splits (less merging)."""
    base = max(1, T * n_hb)
    best_cost, best = None, 1
    for s in range(1, min(n_tiles, MAX_SPLITS) + 1):
        tps = triton.cdiv(n_tiles, s)
        if triton.cdiv(n_tiles, tps) != s:  # the same split as a smaller s (no empty split)
            continue
        cost = triton.cdiv(base * s, slots) * (tps + overhead)
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, s
    return best


def _pick_splits(T: int, n_hb: int, n_tiles: int, num_sms: int, waves: float, min_tiles: int) -> int:
    base = max(1, T * n_hb)
    target = max(1, int(waves * num_sms))
    if base >= target:
        return 1
    splits = triton.cdiv(target, base)
    return max(1, min(splits, max(1, n_tiles // max(1, min_tiles)), MAX_SPLITS))


def v2_num_splits(T: int, H: int, topk: int, cc_major: int, num_sms: int, config: dict | None = None,
                  num_splits: int | None = None, kv_format: str = "fp8_ds_mla") -> int:
    """The split count a v2 launch uses (after clamping; no empty split)."""
    cfg = resolve_config_v2(H, cc_major, T, config, kv_format)
    return _splits_for(cfg, T, triton.cdiv(H, cfg["BLOCK_H"]), max(1, triton.cdiv(topk, cfg["BLOCK_N"])),
                       num_sms, num_splits)


def _splits_for(cfg: dict, T: int, n_hb: int, n_tiles: int, num_sms: int, num_splits: int | None) -> int:
    """The split count of a resolved config: the policy's (or the caller's), clamped, no empty split."""
    if num_splits is None:
        if "WAVES" in cfg:  # forced target policy (sweeps)
            num_splits = _pick_splits(T, n_hb, n_tiles, num_sms, cfg["WAVES"], cfg.get("MIN_TILES", 1))
        else:
            num_splits = _pick_splits_slots(T, n_hb, n_tiles, num_sms * cfg["CTAS_PER_SM"], cfg["SPLIT_OVERHEAD"])
    num_splits = max(1, min(int(num_splits), n_tiles, MAX_SPLITS))
    return triton.cdiv(n_tiles, triton.cdiv(n_tiles, num_splits))


class _PlanV2:
    """A validated, planned v2 call: what a later call with the same key launches directly."""

    __slots__ = ("T", "H", "kv_squeeze", "num_splits", "grid", "tail", "meta", "consts", "merge_grid",
                 "v_scale", "kscale_from_ptr", "fused", "cnt_numel", "ws_numel", "ws_sink",
                 "merge_meta", "merge_consts", "merge_tail", "empty", "dev_index", "kernel", "merge_kernel", "keys_m",
                 "launch", "head", "merge_launch", "merge_head", "args_tail", "ws_split_off", "out_views",
                 "reuse_out")


# plan key (v1's _plan_key) -> _PlanV2, or v1's plan for a key that goes to v1; bounded by
# v1's remember_plan
_PLANS_V2: dict = {}


def _plan_v2(q, kv_cache, indices, softmax_scale, out, lse, num_splits, config,
             kv_format: str = "fp8_ds_mla", k_scale=None) -> _PlanV2:
    """Validate a supported call (``ValueError`` on bad arguments) and plan its launch."""
    T, H, _ = q.shape
    kv = kv_cache
    if kv.dim() == 4:
        if kv.shape[2] != 1:
            raise ValueError(f"kv_cache with 4 dims must be [num_blocks, block_size, 1, W], got {tuple(kv.shape)}")
        kv = kv.squeeze(2)
    code = _v1._kvf.resolve_kv_format(kv_format, q.dtype).code
    rows16 = code == _v1._kvf.FMT_16BIT
    rows8 = code == _v1._kvf.FMT_FP8
    # fp8's per-tensor scale, taken as v1 takes it
    kscale_from_ptr, v_scale, qk_scale = _v1.fp8_scales(rows8, k_scale, softmax_scale, q.device)
    if rows16:  # 16-bit rows of q's dtype (v2_unsupported_reason let only those through)
        if kv.dim() != 3 or kv.shape[2] != HEAD_DIM or kv.dtype != q.dtype:
            raise ValueError(f"{kv_format} kv_cache must be [num_blocks, block_size, {HEAD_DIM}] of {q.dtype}, "
                             f"got {tuple(kv.shape)} {kv.dtype}")
    elif rows8:
        if kv.dim() != 3 or kv.shape[2] != HEAD_DIM or kv.element_size() != 1 or kv.dtype not in (
                torch.uint8, torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"fp8 kv_cache must be [num_blocks, block_size, {HEAD_DIM}] of a 1-byte dtype, "
                             f"got {tuple(kv.shape)} {kv.dtype}")
    else:
        if kv.dim() != 3 or kv.shape[2] != DS_ROW_BYTES:
            raise ValueError(f"fp8_ds_mla kv_cache must be [num_blocks, block_size, {DS_ROW_BYTES}], got {tuple(kv.shape)}")
        if kv.element_size() != 1 or kv.dtype not in (torch.uint8, torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"fp8_ds_mla needs a 1-byte cache (uint8 or float8_e4m3fn), got {kv.dtype}")
    if kv.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    esz = kv.element_size()  # the kernel takes byte strides
    if (kv.stride(0) * esz) % 16 or (kv.stride(1) * esz) % 16 or kv.data_ptr() % 16:
        raise ValueError("cache rows must be 16-byte aligned")
    if indices.dim() != 2 or indices.shape[0] != T or indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32 [T={T}, topk], got {tuple(indices.shape)} {indices.dtype}")
    for name, tns in (("kv_cache", kv), ("indices", indices)):
        if tns.device != q.device:
            raise ValueError(f"{name} is on {tns.device}, q on {q.device}")
    topk = indices.shape[1]
    num_blocks, block_size = kv.shape[0], kv.shape[1]
    num_slots = num_blocks * block_size
    if num_slots >= 2**31:
        raise ValueError("KV pool of >= 2**31 slots: int32 indices cannot address it")
    if out is not None and (out.shape != (T, H, LATENT_DIM) or out.dtype not in (q.dtype, torch.float32)
                            or out.device != q.device):
        raise ValueError(f"out must be [T, H, {LATENT_DIM}] of {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}")
    if lse is not None and (lse.shape != (T, H) or lse.dtype != torch.float32 or lse.device != q.device):
        raise ValueError(f"lse must be [T, H] float32, got {tuple(lse.shape)} {lse.dtype}")

    p = _PlanV2()
    p.T, p.H, p.kv_squeeze = T, H, kv_cache.dim() == 4
    p.empty = T == 0 or topk == 0
    p.grid = None
    _v1.bind_kernels(p, None, None)
    p.out_views = {}  # stream -> the reused output's view (reuse_out)
    p.reuse_out = T * H * LATENT_DIM * q.element_size() <= _v1.REUSE_OUT_MAX_BYTES
    p.dev_index = -1  # CPU: the emulated kernel in the tests
    if q.is_cuda:
        p.dev_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if p.empty:
        return p
    major, _, num_sms = _device_props(q.device)
    major = _v1._dispatch_major(major)  # GLM5_SPARSE_MLA_DISPATCH_CC: the SM120 proxy's configs
    cfg = resolve_config_v2(H, major, T, config, kv_format)
    if rows16 != bool(cfg.get("ROWS16")) or rows8 != bool(cfg.get("ROWS8")) or (
            (rows16 or rows8) and not cfg.get("KEYS_M")):
        raise ValueError(f"kv_format {kv_format!r} with config ROWS16={cfg.get('ROWS16')} ROWS8={cfg.get('ROWS8')}: "
                         "16-bit rows run the KEYS_M kernel with ROWS16, fp8 rows with ROWS8 (config), "
                         "fp8_ds_mla rows with neither")
    bh, bn, nw = cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["NUM_WARPS"]
    if cfg.get("FOLD") and (rows16 or rows8):
        raise ValueError("config FOLD (e4m3 consumed as fp16, scales folded) is an option for fp8_ds_mla rows")
    wh = int(cfg.get("WARPS_H", 1))
    if cfg.get("KEYS_M") and (wh not in (1, 2) or nw % wh or bh != 8 * wh or bn != 16 * nw // wh):
        raise ValueError(f"KEYS_M needs WARPS_H 1 or 2, BLOCK_H = 8 x WARPS_H and BLOCK_N = 16 x NUM_WARPS / WARPS_H, "
                         f"got {bh} / {bn} / {nw} / {wh}")
    n_hb = triton.cdiv(H, bh)
    n_tiles = max(1, triton.cdiv(topk, bn))
    p.num_splits = _splits_for(cfg, T, n_hb, n_tiles, num_sms, num_splits)
    tiles_per_split = triton.cdiv(n_tiles, p.num_splits)
    split = p.num_splits > 1
    # the merge of a split launch: fused into the split kernel (its last-arriving program per
    # (row, head block) merges) or v1's separate merge kernel; see V2_FUSED_MERGE
    p.fused = False
    if split:
        merge = cfg.get("MERGE") or _v1._merge_override() or (
            _v1._pick_merge(T, H, bh, p.num_splits, num_sms) if V2_FUSED_MERGE else "separate")
        if merge not in _v1.MERGE_MODES:
            raise ValueError(f"config MERGE must be one of {_v1.MERGE_MODES}, got {merge!r}")
        p.fused = merge == "fused"
    p.cnt_numel = T * n_hb if p.fused else 0
    # the direct launch's per-stream workspace (float32 words): [partial o | partial lse] of a split
    # launch, then an LSE sink for calls that do not return the LSE, at a 256-byte offset (the
    # compiled kernels assume 16-byte aligned pointers, as the allocations of the first launch were)
    p.ws_sink = triton.cdiv(T * H * p.num_splits * (LATENT_DIM + 1), 64) * 64 if split else 0
    p.ws_numel = p.ws_sink + T * H
    ost = out.stride() if out is not None else (H * LATENT_DIM, LATENT_DIM, 1)  # allocated: contiguous
    lst = lse.stride() if lse is not None else (H, 1)
    p.grid = (T * n_hb * p.num_splits,)
    p.tail = (qk_scale, H, topk, num_slots, block_size,
              q.stride(0), q.stride(1), q.stride(2), kv.stride(0) * esz, kv.stride(1) * esz,
              indices.stride(0), indices.stride(1), ost[0], ost[1], ost[2], lst[0], lst[1],
              p.num_splits, tiles_per_split)
    consts = dict(SPLIT=split, FUSED_MERGE=p.fused, BLOCK_H=bh, BLOCK_N=bn, NUM_WARPS=nw, QK_ACCS=cfg.get("QK_ACCS", 1),
                  DQ_VEC=cfg.get("DQ_VEC", 16), S_SWIZZLE=bool(cfg.get("S_SWIZZLE", False)),
                  RING=cfg.get("RING", 2), Q_REGS=int(cfg.get("Q_REGS", 0)))
    p.keys_m = bool(cfg.get("KEYS_M", False))
    p.v_scale, p.kscale_from_ptr = v_scale, kscale_from_ptr
    if p.keys_m:  # the KEYS_M kernel's last parameters
        consts["ROWS16"] = rows16
        consts["ROWS8"] = rows8
        consts["KSCALE_FROM_PTR"] = kscale_from_ptr
    consts["FOLD"] = bool(cfg.get("FOLD", False))  # both kernels take it
    if p.keys_m:
        consts["WARPS_H"] = wh  # the KEYS_M kernel's last constexpr
    p.consts = tuple(consts.values())  # in the kernel's parameter order
    p.meta = dict(consts, num_warps=nw, maxnreg=cfg.get("MAXNREG", MAXNREG))
    block_s, block_d, merge_warps = merge_tile(p.num_splits)
    p.merge_grid = (T * H * (LATENT_DIM // block_d),)
    p.merge_consts = (block_s, block_d)
    p.merge_tail = (H, p.num_splits, ost[0], ost[1], ost[2], lst[0], lst[1])
    p.merge_meta = dict(BLOCK_S=block_s, BLOCK_D=block_d, num_warps=merge_warps)
    # the kernel's arguments after the eight pointers: to the fp8 scale's pointer for KEYS_M (which
    # takes v_scale, then that pointer, then its constexprs), else to the end (kernel_args)
    p.args_tail = (*p.tail, p.v_scale) if p.keys_m else (*p.tail, *p.consts)
    p.ws_split_off = T * H * p.num_splits * LATENT_DIM * 4  # byte offset of the partial LSEs
    return p


def kernel_args(p: _PlanV2, qp: int, kvp: int, idxp: int, op: int, lp: int, pp: int, plp: int, cntp: int,
                ksp: int) -> tuple:
    """The direct launch's argument list of a plan's kernel (pointers as integers; ``cntp`` /
    ``ksp``: the counters and the fp8 scale, any valid pointer where unused), in the kernel's
    parameter order (``p.args_tail``, then for the KEYS_M kernel its fp8 scale pointer and the
    constexprs); the direct launch passes the same list without building this tuple."""
    if p.keys_m:
        return (qp, kvp, idxp, op, lp, pp, plp, cntp, *p.args_tail, ksp, *p.consts)
    return (qp, kvp, idxp, op, lp, pp, plp, cntp, *p.args_tail)


def _launch_v2(p: _PlanV2, q, kv_cache, indices, out, lse, cache_kernels: bool = False, k_scale=None,
               return_lse: bool = True, reuse_out: bool = False):
    T, H = p.T, p.H
    stream = None
    if out is None:
        if reuse_out and p.reuse_out:
            stream = _v1._raw_stream(p.dev_index) if p.dev_index >= 0 else 0
            out = p.out_views.get(stream)
            if out is None:
                out = _v1.reused_output(p.out_views, q.device, p.dev_index, stream, (T, H, LATENT_DIM), q.dtype)
        else:
            out = torch.empty((T, H, LATENT_DIM), dtype=q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if p.empty:
        if T:  # every row empty (no kernel: an empty indices tensor may have no storage)
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        return out, lse
    split = p.num_splits > 1
    t = p.tail
    if p.launch is not None and _v1._no_launch_hooks():
        # Direct launch of the kernels compiled for this plan (as v1 does: pointers as integers,
        # no argument binding or specialization; the plan's key fixed every tensor's layout). The
        # split path's partial results and the LSE sink (LSE not returned) live in the stream's
        # workspace: [po | plse | sink], no allocation per call. Arguments as kernel_args orders them.
        if stream is None:
            stream = _v1._raw_stream(p.dev_index)
        op = out.data_ptr()
        ws = _v1._workspace(q.device, p.dev_index, stream, p.ws_numel).data_ptr()
        lp = lse.data_ptr() if lse is not None else ws + p.ws_sink * 4
        if split:
            pp, plp = ws, ws + p.ws_split_off
        else:
            pp, plp = op, lp  # unused by the kernel
        cntp = _v1._counters(q.device, p.dev_index, stream, p.cnt_numel).data_ptr() if p.fused else plp
        if p.keys_m:
            p.launch(p.grid[0], 1, 1, stream, *p.head, q.data_ptr(), kv_cache.data_ptr(), indices.data_ptr(), op,
                     lp, pp, plp, cntp, *p.args_tail, k_scale.data_ptr() if p.kscale_from_ptr else lp, *p.consts)
        else:
            p.launch(p.grid[0], 1, 1, stream, *p.head, q.data_ptr(), kv_cache.data_ptr(), indices.data_ptr(), op,
                     lp, pp, plp, cntp, *p.args_tail)
        if split and not p.fused:
            p.merge_launch(p.merge_grid[0], 1, 1, stream, *p.merge_head, pp, plp, op, lp, *p.merge_tail,
                           *p.merge_consts)
        return out, lse
    # first launch of a plan (or a launch hook, e.g. a profiler): Triton's JIT path
    lse_ret = lse
    if lse is None:  # not returned: a throw-away buffer (the direct path writes a sink instead)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    kv = kv_cache.squeeze(2) if p.kv_squeeze else kv_cache
    kv = kv.view(torch.uint8)
    if split:
        po = torch.empty((T, H, p.num_splits, LATENT_DIM), dtype=torch.float32, device=q.device)
        plse = torch.empty((T, H, p.num_splits), dtype=torch.float32, device=q.device)
    else:
        po, plse = out, lse  # unused
    if p.fused:  # arrival counters: zero between calls (the merging program resets its own)
        cnt = _v1._counters(q.device, p.dev_index, _v1._raw_stream(p.dev_index) if q.is_cuda else 0, p.cnt_numel)
    else:
        cnt = plse  # unused by the kernel
    if p.keys_m:
        k = _sparse_mla_v2_km_kernel[p.grid](q, kv, indices, out, lse, po, plse, cnt, *t, p.v_scale,
                                             k_scale if p.kscale_from_ptr else lse, **p.meta)
    else:
        k = _sparse_mla_v2_kernel[p.grid](q, kv, indices, out, lse, po, plse, cnt, *t, **p.meta)
    m = None
    if split and not p.fused:
        # v1's LSE merge: v2 writes its partials in the same [T*H*splits, 512] / [T*H*splits] layout
        m = _v1._sparse_mla_merge_kernel[p.merge_grid](po, plse, out, lse, *p.merge_tail, **p.merge_meta)
    if cache_kernels and p.kernel is None:
        k, m = _v1._compiled(k), _v1._compiled(m)
        if k is not None and (m is not None or not split or p.fused):
            _v1.bind_kernels(p, k, m)
    return out, lse_ret


def sparse_mla_decode_v2(
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
    fallback: bool = True,
    return_lse: bool = True,
    reuse_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA decode, v2 kernel where it applies (see the module docstring), else v1.

    Arguments and results exactly as :func:`triton_sparse_mla.sparse_mla_decode`; ``config``
    overrides keys of :func:`pick_config_v2` on the v2 path (v1's keys on the fallback path).
    ``fallback=False`` raises ``NotImplementedError`` (with the reason) instead of calling v1.
    ``return_lse=False`` with no ``lse`` given returns ``(out, None)``: the v2 path then writes the
    LSE into a per-stream sink instead of allocating it (host time; the backend asks for the LSE
    only under decode context parallelism). ``reuse_out=True`` with no ``out`` given writes an
    output of up to ``REUSE_OUT_MAX_BYTES`` (4 MiB) into a per-(device, stream) buffer instead of
    allocating it: the result is then valid only until the next ``reuse_out`` call on the same
    stream, which is how vLLM 0.26.0's backend uses it (MLA's forward consumes the output before
    the next layer's attention).

    Host cost: the support check, validation and launch plan are worked out once per key (v1's
    ``_plan_key``: shapes, strides, dtypes, devices, scalars, 16-byte alignment); later calls with
    the same key go straight to the launch. ``validate`` / ``config`` calls are planned every time.
    """
    key = None
    if not validate and config is None:
        key = _v1._plan_key(q, kv_cache, indices, softmax_scale, kv_format, k_scale, out, lse, num_splits)
        if key is not None:
            p = _PLANS_V2.get(key)
            if type(p) is _PlanV2:
                return _launch_v2(p, q, kv_cache, indices, out, lse, k_scale=k_scale, return_lse=return_lse,
                                  reuse_out=reuse_out)
            if p is not None:  # a key v2 does not take: v1's plan, launched as v1 launches it
                o, l = _v1._launch(p, q, kv_cache, indices, k_scale, out, lse, True, reuse_out)
                return o, (l if return_lse or lse is not None else None)
    reason = v2_unsupported_reason(q, kv_format, kv_cache=kv_cache, config=config)
    if reason is not None:
        if not fallback:
            raise NotImplementedError(f"sparse_mla_decode_v2: {reason}")
        o, l = _v1.sparse_mla_decode(q, kv_cache, indices, softmax_scale, kv_format, k_scale, out, lse,
                                     num_splits, validate=validate, config=config)
        # v1 planned this key (the same _plan_key): later calls skip the support check and the
        # second key v1 would compute
        v1_plan = _v1._PLANS.get(key) if key is not None else None
        if v1_plan is not None:
            _v1.remember_plan(_PLANS_V2, key, v1_plan)
        return o, (l if return_lse or lse is not None else None)
    p = _plan_v2(q, kv_cache, indices, softmax_scale, out, lse, num_splits, config, kv_format, k_scale)
    if validate and not p.empty and bool((indices >= p.tail[3]).any().item()):
        raise ValueError(f"indices contain slots >= num_blocks * block_size = {p.tail[3]}")
    if key is not None:
        _v1.remember_plan(_PLANS_V2, key, p)
    return _launch_v2(p, q, kv_cache, indices, out, lse, cache_kernels=key is not None and q.is_cuda, k_scale=k_scale,
                      return_lse=return_lse, reuse_out=reuse_out)


# --------------------------------------------------------------------------------------------
# Compile specs (tools/sm120_check.py and tests/kernels/test_sparse_mla_v2.py)
# --------------------------------------------------------------------------------------------

_PTR_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def compile_specs(cc_major: int = 12, configs: list[dict] | None = None) -> list[dict]:
    """Every v2 kernel configuration the dispatch can choose on a device of ``cc_major`` (or the
    given ``configs``), for both q dtypes, split and not, plus the merge kernel (fp8_ds_mla's
    :func:`pick_config_v2` and the 16-bit rows' :func:`rows16_config`)."""
    if configs is None:
        seen = {}
        for h in range(1, 17):
            for t, c in [(t, pick_config_v2(h, cc_major, t)) for t in (1, 4096)] + [
                    (t, rows16_config(h, cc_major, t)) for t in (1, 4096)] + [
                    (t, rows8_config(h, cc_major, t)) for t in (1, 4096)]:
                if c is None:  # no 16-bit rows in v2 there
                    continue
                seen[(c["BLOCK_H"], c["BLOCK_N"], c["NUM_WARPS"], c.get("QK_ACCS", 1), c.get("DQ_VEC", 16),
                      bool(c.get("S_SWIZZLE", False)), c.get("RING", 2), c.get("MAXNREG", MAXNREG),
                      int(c.get("Q_REGS", 0)), bool(c.get("KEYS_M", False)), bool(c.get("ROWS16", False)),
                      bool(c.get("ROWS8", False)), bool(c.get("FOLD", False)), int(c.get("WARPS_H", 1)))] = c
        configs = list(seen.values())
    specs = []
    if HAS_GLUON:
        for c in configs:
            bh, bn, nw, qa = c["BLOCK_H"], c["BLOCK_N"], c["NUM_WARPS"], c.get("QK_ACCS", 1)
            dq, sw, ring = c.get("DQ_VEC", 16), bool(c.get("S_SWIZZLE", False)), c.get("RING", 2)
            qreg = int(c.get("Q_REGS", 0))
            km = bool(c.get("KEYS_M"))
            r16 = bool(c.get("ROWS16"))
            r8 = bool(c.get("ROWS8"))
            fold = bool(c.get("FOLD"))
            wh = int(c.get("WARPS_H", 1))
            for qdt, qt in _PTR_TYPES.items():
                for split, fused in ((False, False), (True, False), (True, True)):
                    sig = {
                        "q_ptr": qt, "kv_ptr": "*u8", "idx_ptr": "*i32", "out_ptr": qt, "lse_ptr": "*fp32",
                        "po_ptr": "*fp32", "plse_ptr": "*fp32", "cnt_ptr": "*i32" if fused else "*fp32",
                        "qk_scale_log2": "fp32",
                        "num_heads": "i32", "topk": "i32", "num_slots": "i32", "block_size": "i32",
                        "stride_qt": "i32", "stride_qh": "i32", "stride_qd": "constexpr",
                        "stride_kb": "i32", "stride_ks": "i32",
                        "stride_it": "i32", "stride_ik": "constexpr",
                        "stride_ot": "i32", "stride_oh": "i32", "stride_od": "constexpr",
                        "stride_lt": "i32", "stride_lh": "constexpr",
                        "num_splits": "i32", "tiles_per_split": "i32",
                    }
                    if km:  # the KEYS_M kernel's fp8 scale (runtime parameters, before the constexprs)
                        sig.update({"v_scale": "fp32", "kscale_ptr": "*fp32"})
                    sig.update({
                        "SPLIT": "constexpr", "FUSED_MERGE": "constexpr", "BLOCK_H": "constexpr", "BLOCK_N": "constexpr",
                        "NUM_WARPS": "constexpr", "QK_ACCS": "constexpr", "DQ_VEC": "constexpr",
                        "S_SWIZZLE": "constexpr", "RING": "constexpr", "Q_REGS": "constexpr",
                    })
                    cx = {"stride_qd": 1, "stride_ik": 1, "stride_od": 1, "stride_lh": 1,
                          "SPLIT": split, "FUSED_MERGE": fused, "BLOCK_H": bh, "BLOCK_N": bn, "NUM_WARPS": nw,
                          "QK_ACCS": qa, "DQ_VEC": dq, "S_SWIZZLE": sw, "RING": ring, "Q_REGS": qreg}
                    if km:  # the KEYS_M kernel's extra constexprs
                        sig.update({"ROWS16": "constexpr", "ROWS8": "constexpr", "KSCALE_FROM_PTR": "constexpr"})
                        cx.update({"ROWS16": r16, "ROWS8": r8, "KSCALE_FROM_PTR": r8})
                    sig["FOLD"] = "constexpr"
                    cx["FOLD"] = fold
                    if km:
                        sig["WARPS_H"] = "constexpr"
                        cx["WARPS_H"] = wh
                    specs.append({
                        "name": (f"sparse_mla_v2{'_km16' if r16 else '_km8' if r8 else '_km' if km else ''}"
                                 f"{'_fold' if fold else ''}[{str(qdt).split('.')[-1]},"
                                 f"BH={bh},BN={bn},w={nw}{f',wh={wh}' if wh > 1 else ''},qa={qa},"
                                 f"dq={dq},sw={int(sw)},ring={ring},qreg={qreg},split={int(split)}"
                                 + (f",merge={'fused' if fused else 'separate'}]" if split else "]")),
                        "fn": _sparse_mla_v2_km_kernel if c.get("KEYS_M") else _sparse_mla_v2_kernel,
                        "signature": sig,
                        "constexprs": cx,
                        "divisible_by_16": ["q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "lse_ptr", "po_ptr",
                                            "plse_ptr", "cnt_ptr", "stride_qt", "stride_qh", "stride_kb", "stride_ks",
                                            "stride_it", "stride_ot", "stride_oh"],
                        "num_warps": nw,
                        "num_stages": 1,
                        "maxnreg": c.get("MAXNREG", MAXNREG),
                    })
    for qdt, qt in _PTR_TYPES.items():
        for block_s, block_d, merge_warps in sorted({merge_tile(ns) for ns in range(2, MAX_SPLITS + 1)}):
            specs.append({
                "name": f"sparse_mla_v2_merge[{str(qdt).split('.')[-1]},BLOCK_S={block_s},BLOCK_D={block_d}]",
                "fn": _v1._sparse_mla_merge_kernel,
                "signature": {"po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": qt, "lse_ptr": "*fp32",
                              "num_heads": "i32", "num_splits": "i32",
                              "stride_ot": "i32", "stride_oh": "i32", "stride_od": "constexpr",
                              "stride_lt": "i32", "stride_lh": "constexpr",
                              "BLOCK_S": "constexpr", "BLOCK_D": "constexpr"},
                "constexprs": {"stride_od": 1, "stride_lh": 1, "BLOCK_S": block_s, "BLOCK_D": block_d},
                "divisible_by_16": ["po_ptr", "plse_ptr", "out_ptr", "lse_ptr", "stride_ot", "stride_oh"],
                "num_warps": merge_warps,
                "num_stages": 1,
            })
    return specs


def SM120_COMPILE_SPECS() -> list[dict]:
    """Every configuration the v2 dispatch can choose on SM120/SM121 (tools/sm120_check.py)."""
    return compile_specs(12)

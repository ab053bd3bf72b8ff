# SPDX-License-Identifier: Apache-2.0
"""MLA KV-cache writes (quantize + store latent and rope at a slot mapping) in Triton, with the
PyTorch references and a dequantizing read used by the tests and references.

``mla_kv_cache_write`` mirrors vLLM's ``ops.concat_and_cache_mla(kv_c, k_pe, kv_cache,
slot_mapping, kv_cache_dtype, scale)`` and writes byte for byte what vLLM's CUDA writer writes
(read from the SASS of ``_C_stable_libtorch.abi3.so`` in the 0.26.0 and 0.33.0 release wheels,
kernels ``concat_and_cache_mla_kernel`` and ``concat_and_cache_ds_mla_kernel``):

``fp8_ds_mla`` (656 B/token), per 128-value latent group ``g`` of one token:
    ``amax = max |x|`` (x = kv_c in fp32), ``s = amax / 448`` (IEEE division), then
    * ``ds_scale_format="arbitrary_fp32"`` (vLLM 0.26.0): ``s = max(s, FLT_MIN)``;
    * ``ds_scale_format="pow2_fp32"`` (vLLM 0.33.0, upstream PR #49435):
      ``s = 2 ** ceil(log2(max(s, 1e-4)))`` (computed exactly from the fp32 bits; equal to
      upstream's ``exp2f(ceilf(log2f(.)))`` for every bf16/fp16 input);
    bytes ``[128 g, 128 g + 128)`` = ``e4m3_satfinite_rn(x / s)`` (IEEE division),
    bytes ``[512 + 4 g, 516 + 4 g)`` = ``s`` as fp32;
    bytes ``[528, 656)`` = the 64 rope values, the input's 16-bit words copied verbatim (bf16 for
    GLM-5/DeepSeek; fp16 models store fp16 there, exactly like vLLM's writer).
``fp8`` / ``fp8_e4m3`` (576 B/token): every one of the 576 values ``e4m3_satfinite_rn(x / k_scale)``.
``auto`` / ``bfloat16`` / ``float16`` (576 elements/token): a plain copy (cache dtype == input dtype).

A negative slot is skipped (padding). A slot ``>= num_blocks * block_size`` is out of range: the
kernel does not write it (vLLM's writer would write out of bounds); ``validate=True`` raises.

This file imports only torch, triton and the standard library.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = [
    "mla_kv_cache_write",
    "mla_kv_cache_write_reference",
    "mla_kv_gather_dequant",
    "mla_kv_gather_dequant_reference",
    "dequantize_mla_kv_cache",
    "write_config",
    "WRITE_CONFIGS",
    "SM120_COMPILE_SPECS",
]

from . import mla_kv_format as _kvf

LATENT_DIM = _kvf.LATENT_DIM
ROPE_DIM = _kvf.ROPE_DIM
HEAD_DIM = _kvf.HEAD_DIM
DS_GROUP = _kvf.DS_GROUP
FP8_MAX = 448.0
FLT_MIN = 1.1754943508222875e-38

_FMT_DS_MLA = _kvf.FMT_DS_MLA
_FMT_FP8 = _kvf.FMT_FP8
_FMT_16BIT = _kvf.FMT_16BIT
DS_SCALE_FORMATS = ("arbitrary_fp32", "pow2_fp32")


def _format(kv_format: str, model_dtype: torch.dtype) -> "_kvf.KVRowFormat":
    return _kvf.resolve_kv_format(kv_format, model_dtype)


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _pow2_ceil(s):
    """2 ** ceil(log2(s)) for positive normal fp32 s, exactly, from the bits."""
    bits = s.to(tl.int32, bitcast=True)
    e = (bits >> 23) + tl.where((bits & 0x7FFFFF) != 0, 1, 0)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3_bytes(y):
    """fp32 -> e4m3 byte, round to nearest even, saturating to +-448 (NaN -> 0x7F), like CUDA's
    ``__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3)``. Done with integer ops rather than
    Triton's cast so that the interpreter (whose fp32->fp8 cast drops the carry of a mantissa
    round-up, e.g. 31.45 -> 16) computes the same bytes as the GPU; the cost is a few integer
    ops per element in a memory-bound kernel."""
    is_nan = y != y
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # normal range (a >= 2^-6): round the fp32 mantissa to 3 bits, ties to even; carries propagate
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal range (a < 2^-6): multiples of 2^-9, ties to even (add/sub 2^23 rounds the integer)
    k = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(a < 0.015625, k, normal)
    sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    out = tl.where(is_nan, 0x7F, mag | sign)
    return out.to(tl.uint8)


@triton.jit
def _write_latent_group(src_c, stride_cd, cache_ptr, row, ok, g, ks,
                        KV_FORMAT: tl.constexpr, POW2_SCALE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Latent columns [128 g, 128 g + 128) of BLOCK_T tokens (+ their fp8_ds_mla tile scale)."""
    GROUP: tl.constexpr = 128
    cols = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(src_c + cols[None, :] * stride_cd, mask=ok[:, None], other=0.0)
    dst = cache_ptr + row[:, None] + cols[None, :]
    if KV_FORMAT == 2:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=ok[:, None])
    else:
        xf = x.to(tl.float32)
        if KV_FORMAT == 0:
            amax = tl.max(tl.abs(xf), axis=1)
            s = tl.math.div_rn(amax, tl.full([BLOCK_T], 448.0, tl.float32))
            if POW2_SCALE:
                s = _pow2_ceil(tl.maximum(s, 1.0e-4))
            else:
                s = tl.maximum(s, 1.1754943508222875e-38)
            y = tl.math.div_rn(xf, tl.broadcast_to(s[:, None], [BLOCK_T, GROUP]))
            sp = (cache_ptr + row + (512 + 4 * g)).to(tl.pointer_type(tl.float32))
            tl.store(sp, s, mask=ok)
        else:
            y = tl.math.div_rn(xf, tl.full([BLOCK_T, GROUP], 1.0, tl.float32) * ks)
        tl.store(dst, _to_e4m3_bytes(y), mask=ok[:, None])


@triton.jit
def _write_rope(src_p, stride_pd, kpe_ptr, cache_ptr, row, ok, ks,
                KV_FORMAT: tl.constexpr, BLOCK_T: tl.constexpr):
    ROPE: tl.constexpr = 64
    offs_r = tl.arange(0, ROPE)
    pe = tl.load(src_p + offs_r[None, :] * stride_pd, mask=ok[:, None], other=0.0)
    if KV_FORMAT == 0:
        rp = (cache_ptr + row + 528).to(tl.pointer_type(kpe_ptr.dtype.element_ty))
        tl.store(rp[:, None] + offs_r[None, :], pe, mask=ok[:, None])
    elif KV_FORMAT == 1:
        y = tl.math.div_rn(pe.to(tl.float32), tl.full([BLOCK_T, ROPE], 1.0, tl.float32) * ks)
        tl.store(cache_ptr + row[:, None] + (512 + offs_r)[None, :], _to_e4m3_bytes(y), mask=ok[:, None])
    else:
        tl.store(cache_ptr + row[:, None] + (512 + offs_r)[None, :], pe.to(cache_ptr.dtype.element_ty),
                 mask=ok[:, None])


@triton.jit(do_not_specialize=["num_tokens", "num_slots", "block_size"])
def _mla_kv_cache_write_kernel(
    kvc_ptr, kpe_ptr, cache_ptr, slot_ptr, kscale_ptr,
    k_scale_f, num_tokens, num_slots, block_size,
    stride_ct, stride_cd, stride_pt, stride_pd, stride_kb, stride_ks,
    KV_FORMAT: tl.constexpr,
    KSCALE_FROM_PTR: tl.constexpr,
    POW2_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PARTS: tl.constexpr,
):
    """Program (i, p): tokens [i * BLOCK_T, (i + 1) * BLOCK_T). PARTS == 1: the program writes the
    whole row (4 latent groups, then the rope part); PARTS == 5: only part p (group p < 4, rope
    p == 4), so a decode batch of a few tokens spreads over 5x more programs: the write is a chain
    of dependent latencies (slot -> row address -> load -> amax -> store), not bandwidth."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    row = blk * stride_kb + (slot - blk * block_size) * stride_ks  # [BLOCK_T] int64
    src_c = kvc_ptr + offs_t.to(tl.int64)[:, None] * stride_ct
    src_p = kpe_ptr + offs_t.to(tl.int64)[:, None] * stride_pt

    ks = 1.0
    if KV_FORMAT == 1:
        if KSCALE_FROM_PTR:
            ks = tl.load(kscale_ptr)
        else:
            ks = k_scale_f

    if PARTS == 1:
        for g in tl.static_range(4):
            _write_latent_group(src_c, stride_cd, cache_ptr, row, ok, g, ks, KV_FORMAT, POW2_SCALE, BLOCK_T)
        _write_rope(src_p, stride_pd, kpe_ptr, cache_ptr, row, ok, ks, KV_FORMAT, BLOCK_T)
    else:
        part = tl.program_id(1)
        if part < 4:
            _write_latent_group(src_c, stride_cd, cache_ptr, row, ok, part, ks, KV_FORMAT, POW2_SCALE, BLOCK_T)
        else:
            _write_rope(src_p, stride_pd, kpe_ptr, cache_ptr, row, ok, ks, KV_FORMAT, BLOCK_T)


@triton.jit(do_not_specialize=["max_tokens", "block_size"])
def _mla_kv_gather_dequant_kernel(
    cache_ptr, table_ptr, lens_ptr, starts_ptr, ws_ptr, kscale_ptr,
    k_scale_f, max_tokens, block_size,
    stride_kb, stride_ks, stride_br, stride_bb, stride_wt,
    KV_FORMAT: tl.constexpr,
    KSCALE_FROM_PTR: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (i, r): tokens [i * BLOCK_T, (i + 1) * BLOCK_T) of request r, up to its length:
    cache row (block_table[r, t // block_size], t % block_size) -> workspace row starts[r] + t,
    dequantized to the workspace dtype (e4m3 x group scale / x k_scale, rounded once)."""
    GROUP: tl.constexpr = 128
    ROPE: tl.constexpr = 64
    pid = tl.program_id(0)
    r = tl.program_id(1)
    n = tl.load(lens_ptr + r)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = offs_t < n
    blk = tl.load(table_ptr + r.to(tl.int64) * stride_br + (offs_t // block_size).to(tl.int64) * stride_bb,
                  mask=ok, other=0).to(tl.int64)
    row = blk * stride_kb + (offs_t % block_size).to(tl.int64) * stride_ks  # [BLOCK_T] int64
    start = tl.load(starts_ptr + r).to(tl.int64)
    dst = ws_ptr + (start + offs_t.to(tl.int64))[:, None] * stride_wt
    OT = ws_ptr.dtype.element_ty
    offs_g = tl.arange(0, GROUP)
    offs_r = tl.arange(0, ROPE)
    if KV_FORMAT == 1:
        if KSCALE_FROM_PTR:
            ks = tl.load(kscale_ptr)
        else:
            ks = k_scale_f
    for g in tl.static_range(4):
        cols = g * GROUP + offs_g
        x = tl.load(cache_ptr + row[:, None] + cols[None, :], mask=ok[:, None], other=0)
        if KV_FORMAT == 2:
            y = x.to(OT)
        else:
            v = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            if KV_FORMAT == 0:
                sp = (cache_ptr + row + (512 + 4 * g)).to(tl.pointer_type(tl.float32))
                v = v * tl.load(sp, mask=ok, other=0.0)[:, None]
            else:
                v = v * ks
            y = v.to(OT)
        tl.store(dst + cols[None, :], y, mask=ok[:, None])
    if KV_FORMAT == 0:
        rp = (cache_ptr + row + 528).to(tl.pointer_type(OT))
        y = tl.load(rp[:, None] + offs_r[None, :], mask=ok[:, None], other=0.0)
    else:
        x = tl.load(cache_ptr + row[:, None] + (512 + offs_r)[None, :], mask=ok[:, None], other=0)
        if KV_FORMAT == 1:
            y = (x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * ks).to(OT)
        else:
            y = x.to(OT)
    tl.store(dst + (512 + offs_r)[None, :], y, mask=ok[:, None])


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _check_inputs(kv_c, k_pe, slot_mapping):
    if kv_c.dim() != 2 or kv_c.shape[1] != LATENT_DIM:
        raise ValueError(f"kv_c must be [N, {LATENT_DIM}], got {tuple(kv_c.shape)}")
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe.squeeze(1)
    if k_pe.dim() != 2 or k_pe.shape != (kv_c.shape[0], ROPE_DIM):
        raise ValueError(f"k_pe must be [N, {ROPE_DIM}], got {tuple(k_pe.shape)}")
    if kv_c.dtype not in (torch.bfloat16, torch.float16) or k_pe.dtype != kv_c.dtype:
        raise ValueError(f"kv_c and k_pe must both be bf16 or fp16, got {kv_c.dtype} and {k_pe.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < kv_c.shape[0]:
        raise ValueError(f"slot_mapping must be [N>={kv_c.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be contiguous")
    return k_pe


class WriteConfig(NamedTuple):
    block_t: int  # tokens per program
    parts: int  # 1: a program writes whole rows; 5: one of the 4 latent groups or the rope part
    num_warps: int


# "split": decode-sized batches, where the write is latency-bound (dependent loads and a reduction
# per group): 5 programs per token. "rows": prefill-sized batches, 4 whole rows per program.
WRITE_CONFIGS = {
    "split": WriteConfig(block_t=1, parts=5, num_warps=1),
    "rows": WriteConfig(block_t=4, parts=1, num_warps=4),
}
WRITE_SPLIT_MAX_TOKENS = 1024


def write_config(num_tokens: int) -> WriteConfig:
    """The cache-write launch configuration for ``num_tokens`` tokens."""
    return WRITE_CONFIGS["split" if num_tokens <= WRITE_SPLIT_MAX_TOKENS else "rows"]


def mla_kv_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: str,
    k_scale: torch.Tensor | float | None = None,
    *,
    ds_scale_format: str = "arbitrary_fp32",
    validate: bool = False,
    config: str | None = None,
) -> None:
    """Quantize and store one latent + rope row per token into ``kv_cache`` (in place).

    Same argument order and meaning as vLLM's ``ops.concat_and_cache_mla``.

    Args:
        kv_c: ``[N, 512]`` bf16/fp16 latent (any strides).
        k_pe: ``[N, 64]`` (or ``[N, 1, 64]``) rope part, same dtype (any strides).
        kv_cache: ``[num_blocks, block_size, W]`` cache in the layout of ``kv_format`` (see the
            module docstring); 1-byte formats may come as uint8 or float8_e4m3fn.
        slot_mapping: ``[>= N]`` int64 slots ``block * block_size + offset``; negative = skip.
        kv_format: vLLM ``kv_cache_dtype`` name (``fp8_ds_mla``, ``fp8``, ``fp8_e4m3``, ``auto``,
            ``bfloat16``, ``float16``).
        k_scale: ``fp8`` only: the per-tensor scale (fp32 tensor of one element, read on the
            device, or a float); values are stored as ``x / k_scale``. Default 1.0.
        ds_scale_format: ``fp8_ds_mla`` only: ``"arbitrary_fp32"`` (vLLM 0.26.0's writer) or
            ``"pow2_fp32"`` (vLLM 0.33.0's writer); see the module docstring.
        validate: debug only (host sync): raise on slots >= num_blocks * block_size.
        config: a key of ``WRITE_CONFIGS`` instead of ``write_config(N)``'s choice (tests, benchmarks).
    """
    if config is not None and config not in WRITE_CONFIGS:
        raise ValueError(f"config must be one of {sorted(WRITE_CONFIGS)}, got {config!r}")
    k_pe = _check_inputs(kv_c, k_pe, slot_mapping)
    fmt = _format(kv_format, kv_c.dtype)
    code = fmt.code
    cache = _kvf.check_kv_cache(kv_cache, fmt, None, kv_format)
    if ds_scale_format not in DS_SCALE_FORMATS:
        raise ValueError(f"ds_scale_format must be one of {DS_SCALE_FORMATS}, got {ds_scale_format!r}")
    n = kv_c.shape[0]
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    num_slots = num_blocks * block_size
    for name, tns in (("k_pe", k_pe), ("kv_cache", cache), ("slot_mapping", slot_mapping)):
        if tns.device != kv_c.device:
            raise ValueError(f"{name} is on {tns.device}, kv_c on {kv_c.device}")
    if validate and n > 0 and bool((slot_mapping[:n] >= num_slots).any().item()):
        raise ValueError(f"slot_mapping has slots >= num_blocks * block_size = {num_slots}")
    kscale_from_ptr = False
    k_scale_f = 1.0
    kscale_arg = slot_mapping
    if code == _FMT_FP8:
        if isinstance(k_scale, torch.Tensor):
            if k_scale.numel() != 1 or k_scale.dtype != torch.float32 or k_scale.device != kv_c.device:
                raise ValueError("k_scale tensor must hold one float32 on kv_c's device")
            kscale_from_ptr = True
            kscale_arg = k_scale
        elif k_scale is not None:
            k_scale_f = float(k_scale)
    if n == 0:
        return
    cfg = write_config(n) if config is None else WRITE_CONFIGS[config]
    _mla_kv_cache_write_kernel[(triton.cdiv(n, cfg.block_t), cfg.parts)](
        kv_c, k_pe, cache, slot_mapping, kscale_arg,
        k_scale_f, n, num_slots, block_size,
        kv_c.stride(0), kv_c.stride(1), k_pe.stride(0), k_pe.stride(1),
        cache.stride(0), cache.stride(1),
        KV_FORMAT=code,
        KSCALE_FROM_PTR=kscale_from_ptr,
        POW2_SCALE=ds_scale_format == "pow2_fp32",
        BLOCK_T=cfg.block_t,
        PARTS=cfg.parts,
        num_warps=cfg.num_warps,
    )


GATHER_BLOCK_T = 16


def mla_kv_gather_dequant(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    workspace_starts: torch.Tensor,
    workspace: torch.Tensor,
    kv_format: str,
    k_scale: torch.Tensor | float | None = None,
    max_seq_len: int | None = None,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """Dequantize whole request contexts out of the paged cache into a 16-bit workspace.

    Token ``t < seq_lens[r]`` of request ``r`` (cache block ``block_table[r, t // block_size]``,
    offset ``t % block_size``) lands in ``workspace[workspace_starts[r] + t]`` as 576 values of the
    workspace's dtype: ``fp8_ds_mla`` e4m3 x its group scale (rope copied), ``fp8`` e4m3 x
    ``k_scale``, 16-bit copied; each value rounded once from fp32, as the decode kernel
    dequantizes. The layout of the result is the ``bfloat16``/``float16`` cache format, so a
    sparse attention over it is ``sparse_mla_decode`` on ``workspace.view(N, 1, 576)`` with
    request positions offset by ``workspace_starts`` as indices (the prefill workspace design,
    docs/notes/sparse_mla.md). What vLLM's ``cp_gather_and_upconvert_fp8_kv_cache`` does for
    ``fp8_ds_mla``, for every format.

    Args:
        kv_cache: ``[num_blocks, block_size, W]`` (or ``[.., 1, W]``) in the layout of ``kv_format``.
        block_table: ``[R, max_blocks]`` int32 (any strides).
        seq_lens, workspace_starts: ``[R]`` int32, contiguous.
        workspace: ``[N, 576]`` bf16/fp16, last dimension contiguous (the model dtype: also the
            dtype of fp8_ds_mla's rope words).
        max_seq_len: a host bound on every ``seq_lens[r]`` (the grid; no host sync), default
            ``max_blocks * block_size``.
        validate: debug only (host sync): raise when a request overflows the workspace or its
            block table.
    Returns ``workspace``.
    """
    if workspace.dim() != 2 or workspace.shape[1] != HEAD_DIM or workspace.stride(1) != 1:
        raise ValueError(f"workspace must be [N, {HEAD_DIM}] with a contiguous last dimension, got {tuple(workspace.shape)}")
    if workspace.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"workspace must be bf16 or fp16, got {workspace.dtype}")
    fmt = _format(kv_format, workspace.dtype)
    cache = _kvf.check_kv_cache(kv_cache, fmt, workspace.dtype, kv_format)
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [R, max_blocks], got {tuple(block_table.shape)} {block_table.dtype}")
    R = block_table.shape[0]
    for name, t in (("seq_lens", seq_lens), ("workspace_starts", workspace_starts)):
        if t.shape != (R,) or t.dtype != torch.int32 or (R and t.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous int32 [R={R}], got {tuple(t.shape)} {t.dtype}")
    for name, t in (("kv_cache", cache), ("block_table", block_table), ("seq_lens", seq_lens),
                    ("workspace_starts", workspace_starts)):
        if t.device != workspace.device:
            raise ValueError(f"{name} is on {t.device}, workspace on {workspace.device}")
    block_size = cache.shape[1]
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * block_size
    if validate and R:
        lens = seq_lens.long()
        if bool((lens > block_table.shape[1] * block_size).any() | (lens > max_seq_len).any()):
            raise ValueError("a seq_len exceeds its block table or max_seq_len")
        if bool((workspace_starts.long() + lens > workspace.shape[0]).any() | (workspace_starts < 0).any()):
            raise ValueError(f"a request overflows the workspace of {workspace.shape[0]} rows")
    kscale_from_ptr = False
    k_scale_f = 1.0
    kscale_arg = seq_lens
    if fmt.code == _FMT_FP8:
        if isinstance(k_scale, torch.Tensor):
            if k_scale.numel() != 1 or k_scale.dtype != torch.float32 or k_scale.device != workspace.device:
                raise ValueError("k_scale tensor must hold one float32 on the workspace's device")
            kscale_from_ptr = True
            kscale_arg = k_scale
        elif k_scale is not None:
            k_scale_f = float(k_scale)
    if R == 0 or max_seq_len <= 0:
        return workspace
    _mla_kv_gather_dequant_kernel[(triton.cdiv(max_seq_len, GATHER_BLOCK_T), R)](
        cache, block_table, seq_lens, workspace_starts, workspace, kscale_arg,
        k_scale_f, max_seq_len, block_size,
        cache.stride(0), cache.stride(1), block_table.stride(0), block_table.stride(1), workspace.stride(0),
        KV_FORMAT=fmt.code,
        KSCALE_FROM_PTR=kscale_from_ptr,
        BLOCK_T=GATHER_BLOCK_T,
        num_warps=4,
    )
    return workspace


def mla_kv_gather_dequant_reference(kv_cache, block_table, seq_lens, workspace_starts, workspace, kv_format,
                                    k_scale=None) -> torch.Tensor:
    """PyTorch reference of :func:`mla_kv_gather_dequant` (same arguments, same rows written)."""
    fmt = _format(kv_format, workspace.dtype)
    cache = _kvf.check_kv_cache(kv_cache, fmt, workspace.dtype, kv_format)
    bs = cache.shape[1]
    for r in range(block_table.shape[0]):
        n = int(seq_lens[r])
        t = torch.arange(n, device=cache.device)
        rows = cache[block_table[r, t // bs].long(), t % bs]
        s0 = int(workspace_starts[r])
        workspace[s0:s0 + n] = _kvf.dequantize_rows(rows, fmt, k_scale, torch.float32).to(workspace.dtype)
    return workspace


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def _e4m3_bytes_reference(y: torch.Tensor) -> torch.Tensor:
    # torch's float8 cast rounds to nearest even but turns |y| > 448 into NaN: saturate first.
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _pow2_ceil_reference(s: torch.Tensor) -> torch.Tensor:
    bits = s.contiguous().view(torch.int32)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def mla_kv_cache_write_reference(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: str,
    k_scale: torch.Tensor | float | None = None,
    *,
    ds_scale_format: str = "arbitrary_fp32",
) -> None:
    """PyTorch reference of :func:`mla_kv_cache_write` (same arguments, same in-place bytes)."""
    k_pe = _check_inputs(kv_c, k_pe, slot_mapping)
    fmt = _format(kv_format, kv_c.dtype)
    code = fmt.code
    cache = _kvf.check_kv_cache(kv_cache, fmt, None, kv_format)
    nb, bs, w = cache.shape
    n = kv_c.shape[0]
    slots = slot_mapping[:n].to(torch.int64)
    keep = (slots >= 0) & (slots < nb * bs)
    slots = slots[keep]
    x = kv_c[keep].to(torch.float32)
    pe = k_pe[keep]
    blk, off = slots // bs, slots % bs
    if code == _FMT_16BIT:
        cache[blk, off] = torch.cat([x.to(cache.dtype), pe.to(cache.dtype)], dim=-1)
        return
    if code == _FMT_FP8:
        ks = 1.0 if k_scale is None else k_scale
        ks = ks.to(torch.float32).reshape(()) if isinstance(ks, torch.Tensor) else torch.tensor(float(ks), dtype=torch.float32)
        ks = ks.to(x.device)
        row = torch.cat([x, pe.to(torch.float32)], dim=-1) / ks
        cache[blk, off] = _e4m3_bytes_reference(row)
        return
    xg = x.reshape(-1, 4, DS_GROUP)
    amax = xg.abs().amax(dim=-1)
    # IEEE fp32 division like the CUDA writer; a tensor divisor, because torch turns division by a
    # Python scalar on the GPU into a multiplication by its reciprocal (not always the same float).
    s = amax / torch.full_like(amax, FP8_MAX)
    if ds_scale_format == "pow2_fp32":
        s = _pow2_ceil_reference(s.clamp_min(torch.tensor(1.0e-4, dtype=torch.float32).item()))
    else:
        s = s.clamp_min(FLT_MIN)
    q = _e4m3_bytes_reference(xg / s[..., None]).reshape(-1, LATENT_DIM)
    row = torch.cat([q, s.contiguous().view(torch.uint8).reshape(-1, 16),
                     pe.contiguous().view(torch.uint8).reshape(-1, 2 * ROPE_DIM)], dim=-1)
    cache[blk, off] = row


def dequantize_mla_kv_cache(
    kv_cache: torch.Tensor,
    kv_format: str,
    k_scale: torch.Tensor | float | None = None,
    rope_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize a whole MLA cache to float32 ``[num_blocks, block_size, 576]`` (exact values).

    ``rope_dtype``: the 16-bit type of the ``fp8_ds_mla`` rope words (the model dtype) and the
    dtype of an ``auto`` cache.
    """
    fmt = _format(kv_format, rope_dtype)
    cache = _kvf.check_kv_cache(kv_cache, fmt, None, kv_format)
    return _kvf.dequantize_rows(cache, fmt, k_scale, torch.float32)


# --------------------------------------------------------------------------------------------
# SM120 compile specs
# --------------------------------------------------------------------------------------------


def SM120_COMPILE_SPECS() -> list[dict]:
    """Every configuration of the cache-write kernel the dispatch can choose (tools/sm120_check.py)."""
    specs = []
    for in_t, in_name in (("*bf16", "bf16"), ("*fp16", "fp16")):
        for code, fmt in ((_FMT_DS_MLA, "fp8_ds_mla"), (_FMT_FP8, "fp8"), (_FMT_16BIT, "auto")):
            variants = [(False, False), (False, True)] if code == _FMT_DS_MLA else (
                [(True, False), (False, False)] if code == _FMT_FP8 else [(False, False)])
            for (kptr, pow2), (cname, cfg) in itertools.product(variants, WRITE_CONFIGS.items()):
                specs.append({
                    "name": f"mla_kv_cache_write[{fmt},{in_name},kscale_ptr={int(kptr)},pow2={int(pow2)},{cname}]",
                    "fn": _mla_kv_cache_write_kernel,
                    "signature": {
                        "kvc_ptr": in_t, "kpe_ptr": in_t, "cache_ptr": in_t if code == _FMT_16BIT else "*u8",
                        "slot_ptr": "*i64", "kscale_ptr": "*fp32", "k_scale_f": "fp32",
                        "num_tokens": "i32", "num_slots": "i32", "block_size": "i32",
                        "stride_ct": "i32", "stride_cd": "constexpr", "stride_pt": "i32", "stride_pd": "constexpr",
                        "stride_kb": "i32", "stride_ks": "i32",
                        "KV_FORMAT": "constexpr", "KSCALE_FROM_PTR": "constexpr", "POW2_SCALE": "constexpr",
                        "BLOCK_T": "constexpr", "PARTS": "constexpr",
                    },
                    "constexprs": {"stride_cd": 1, "stride_pd": 1, "KV_FORMAT": code, "KSCALE_FROM_PTR": kptr,
                                   "POW2_SCALE": pow2, "BLOCK_T": cfg.block_t, "PARTS": cfg.parts},
                    "divisible_by_16": ["kvc_ptr", "kpe_ptr", "cache_ptr", "slot_ptr", "kscale_ptr",
                                        "stride_ct", "stride_pt", "stride_kb", "stride_ks"],
                    "num_warps": cfg.num_warps,
                    "num_stages": 1,
                })
    for ws_t, ws_name in (("*bf16", "bf16"), ("*fp16", "fp16")):
        for code, fmt in ((_FMT_DS_MLA, "fp8_ds_mla"), (_FMT_FP8, "fp8"), (_FMT_16BIT, "auto")):
            for kptr in ((True, False) if code == _FMT_FP8 else (False,)):
                specs.append({
                    "name": f"mla_kv_gather_dequant[{fmt},{ws_name},kscale_ptr={int(kptr)}]",
                    "fn": _mla_kv_gather_dequant_kernel,
                    "signature": {
                        "cache_ptr": ws_t if code == _FMT_16BIT else "*u8", "table_ptr": "*i32", "lens_ptr": "*i32",
                        "starts_ptr": "*i32", "ws_ptr": ws_t, "kscale_ptr": "*fp32", "k_scale_f": "fp32",
                        "max_tokens": "i32", "block_size": "i32",
                        "stride_kb": "i32", "stride_ks": "i32", "stride_br": "i32", "stride_bb": "constexpr",
                        "stride_wt": "i32",
                        "KV_FORMAT": "constexpr", "KSCALE_FROM_PTR": "constexpr", "BLOCK_T": "constexpr",
                    },
                    "constexprs": {"stride_bb": 1, "KV_FORMAT": code, "KSCALE_FROM_PTR": kptr,
                                   "BLOCK_T": GATHER_BLOCK_T},
                    "divisible_by_16": ["cache_ptr", "table_ptr", "lens_ptr", "starts_ptr", "ws_ptr", "kscale_ptr",
                                        "stride_kb", "stride_ks", "stride_wt"],
                    "num_warps": 4,
                    "num_stages": 1,
                })
    return specs

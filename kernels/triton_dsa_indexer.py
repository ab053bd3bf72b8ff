# SPDX-License-Identifier: Apache-2.0
"""DSA indexer kernels in Triton: FP8 indexer-K cache write, K gather, and FP8 MQA logits over the
paged cache (decode) or a gathered ragged K (chunked prefill). No DeepGEMM, no CUDA extension.

Public functions mirror the upstream ops one-to-one (same argument order and meaning), so the
vLLM integration is a swap:

=====================================  =========================================================
this module                            replaces
=====================================  =========================================================
``indexer_k_quant_and_cache``          ``vllm._custom_ops.indexer_k_quant_and_cache``
``cp_gather_indexer_k_quant_cache``    ``vllm._custom_ops.cp_gather_indexer_k_quant_cache``
``fp8_paged_mqa_logits``               ``vllm.utils.deep_gemm.fp8_fp4_paged_mqa_logits`` (FP8 path)
``fp8_mqa_logits``                     ``vllm.utils.deep_gemm.fp8_fp4_mqa_logits`` (FP8 path)
=====================================  =========================================================

Indexer K cache layout (read from vLLM's ``indexer_k_quant_and_cache_kernel``, checked by the
tests): the cache is ``uint8 [num_blocks, block_size, D + 4 * D // quant_block]`` (vLLM passes it
as is, or with a unit dim ``[num_blocks, block_size, 1, ...]`` for DeepGEMM). Inside one block the
``block_size x D`` e4m3 values of its tokens come first (token-major, ``D`` bytes per token), then
the fp32 scales (``D // quant_block`` per token). GLM-5 / DeepSeek-V3.2: ``D = quant_block = 128``,
``block_size = 64``: 8192 value bytes then 64 x 4 scale bytes = 132 B per token.

Quantization (``indexer_k_quant_and_cache``): per token and 128-group ``s = max(amax, 1e-4) / 448``,
with ``scale_fmt == "ue8m0"`` rounded *up* to a power of two (``2^ceil(log2 s)``, computed exactly
on the fp32 bits); stored value ``e4m3(x / s)`` (round to nearest even, |x / s| <= 448), stored
scale ``s``. A negative slot skips the token (padding); a slot ``>= num_blocks * block_size`` is
out of range and skipped too (vLLM's CUDA writer would write out of bounds; ``validate=True``
raises instead, with a host sync). Non-finite input, as vLLM's CUDA writer (``fmaxf`` ignores NaN,
``__nv_cvt_float_to_fp8`` keeps it): a NaN element is stored as the e4m3 NaN byte ``0x7F`` and does
not enter its group's ``amax``; a +-inf element makes the group's scale ``+inf``, so its finite
elements store +-0 and the inf itself ``inf / inf`` = NaN (``0x7F``).

Logits (DeepGEMM's convention, which vLLM uses)::

    logits[t, s] = ( sum_h  weights[t, h] * relu( q_e4m3[t, h, :] . k_e4m3[s, :] ) ) * k_scale[s]

for every column ``s`` inside row ``t``'s context and ``-inf`` elsewhere (see ``clean_logits``).
``weights`` already holds every other factor: vLLM's ``fused_indexer_q_rope_quant`` stores
``w * q_scale * softmax_scale * n_heads^-0.5`` (``q_scale`` = the per-(token, head) ue8m0 scale of q;
softmax_scale = D^-0.5). HF transformers' ``glm_moe_dsa`` indexer computes
``sum_h (w_h * H^-0.5) * relu(q_h . k * D^-0.5)`` on unquantized bf16 q/k; since every scale is
positive it commutes with the relu, so both conventions are the same function up to the FP8
quantization of q and k. The kernels implement vLLM's (pre-folded weights, FP8 q and k).

Context of a decode row (``fp8_paged_mqa_logits``), DeepGEMM's semantics:
``context_lens`` 1-D ``[B]`` = context of the *last* of the ``next_n`` query tokens, token ``j``
sees ``context_lens[b] - next_n + j + 1`` keys; 2-D ``[B, next_n]`` = per-token context lengths.

``clean_logits``: ``True`` (default) writes ``-inf`` in every column outside the context, so the
whole ``[rows, max_model_len]`` (prefill: ``[M, N]``) tensor is defined. ``False`` (what vLLM
passes to DeepGEMM) writes only the tiles that hold context columns (the tail of the last tile is
``-inf``); columns beyond are left unwritten, which is all the top-k ops read.

All launches take their grid and constexprs from shapes (and ``max_model_len``): the decode path is
CUDA-graph capturable and never syncs the host.

This file imports only torch, triton and the standard library: it runs standalone (tests,
benchmarks) and inside the patched vLLM tree (``vllm/v1/attention/ops/triton_dsa_indexer.py``).
"""

from __future__ import annotations

import functools
import itertools
import math
import os

import torch
import triton
import triton.language as tl

try:  # the vLLM tree and the kernels/ package: the sibling module (its direct-launch helpers)
    from . import triton_dsa_topk as _topk
except ImportError:  # loaded as a top-level module (tests and benchmarks put kernels/ on sys.path)
    import triton_dsa_topk as _topk

__all__ = [
    "indexer_k_quant_and_cache",
    "cp_gather_indexer_k_quant_cache",
    "fp8_paged_mqa_logits",
    "fp8_mqa_logits",
    "indexer_k_quant_and_cache_reference",
    "cp_gather_indexer_k_quant_cache_reference",
    "fp8_paged_mqa_logits_reference",
    "fp8_mqa_logits_reference",
    "dequant_indexer_k_cache",
    "paged_logits_config",
    "grid_yz_tiles",
    "paged_dispatch_configs",
    "MAX_GRID_YZ",
    "SM120_COMPILE_SPECS",
]

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda" or _interpret():
        return 8
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


# CUDA's limit on gridDim.y / gridDim.z. Launches whose y extent (query blocks of the ragged
# prefill logits, requests of the paged decode logits) could exceed it are tiled into several
# launches of at most this many programs along y, each with its offset (``grid_yz_tiles``): at
# GLM-5's 32 heads (4 queries per block) one launch took at most 262,140 rows, at 64 heads 131,070.
MAX_GRID_YZ = 65535


def grid_yz_tiles(n: int, max_yz: int = MAX_GRID_YZ) -> list[tuple[int, int]]:
    """(offset, count) launches covering ``n`` programs along grid y, each ``<= max_yz``."""
    if max_yz < 1:
        raise ValueError(f"max grid y/z must be >= 1, got {max_yz}")
    return [(o, min(max_yz, n - o)) for o in range(0, n, max_yz)]


def _cache_geometry(kv_cache: torch.Tensor, head_dim: int, quant_block: int):
    """Validate the indexer cache and return (3-D uint8 view, block_size, entry bytes)."""
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"indexer kv_cache must be uint8, got {kv_cache.dtype}")
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise ValueError(f"4-D indexer kv_cache must be [blocks, block_size, 1, bytes], got {tuple(kv_cache.shape)}")
        kv_cache = kv_cache.squeeze(2)
    if kv_cache.dim() != 3:
        raise ValueError(f"indexer kv_cache must be [blocks, block_size, bytes], got {tuple(kv_cache.shape)}")
    if head_dim % quant_block != 0:
        raise ValueError(f"head_dim {head_dim} must be a multiple of quant_block_size {quant_block}")
    entry = head_dim + 4 * (head_dim // quant_block)
    nb, bs, eb = kv_cache.shape
    if eb != entry:
        raise ValueError(f"indexer kv_cache entry has {eb} bytes, expected {entry} (head_dim {head_dim} + "
                         f"{head_dim // quant_block} fp32 scales)")
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != entry:
        raise ValueError("indexer kv_cache blocks must be contiguous ([block_size, bytes] rows packed)")
    if kv_cache.stride(0) % 16 != 0:
        raise ValueError(f"indexer kv_cache block stride {kv_cache.stride(0)} must be a multiple of 16 bytes")
    if kv_cache.data_ptr() % 16 != 0:
        raise ValueError("indexer kv_cache must be 16-byte aligned")
    return kv_cache, bs, entry


def _views(kv3: torch.Tensor):
    """fp8 and fp32 views of the same storage (the scales live at 4-byte aligned offsets)."""
    nb, page, entry = kv3.shape
    span = kv3.stride(0) * (nb - 1) + page * entry if nb > 0 else 0
    flat = torch.as_strided(kv3, (span,), (1,))
    return flat.view(FP8_DTYPE), flat.view(torch.float32)


# ----------------------------------------------------------------------------------------------
# 1. indexer K: quantize + write into the paged cache
# ----------------------------------------------------------------------------------------------


@triton.jit
def _ue8m0_ceil(s):
    """2^ceil(log2(s)) for positive normal fp32 s, exactly (bit manipulation)."""
    b = s.to(tl.int32, bitcast=True)
    e = (b >> 23) & 0xFF
    e = tl.where((b & 0x7FFFFF) != 0, e + 1, e)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits_rne(y):
    """e4m3fn bit pattern (as int32) of fp32 ``y`` with |y| <= 448, round to nearest even. Used
    instead of ``.to(tl.float8e4nv)`` under the CPU interpreter, whose fp32->fp8 cast is wrong
    (e.g. -125.875 -> -64; ties not to even). On the GPU the hardware cvt (rn, satfinite) is used."""
    a = tl.abs(y)
    ab = a.to(tl.int32, bitcast=True)
    # (NaN -> 0x7F at the end, like the hardware cvt)
    e = tl.maximum(((ab >> 23) & 0xFF) - 127, -6)  # exponent of the quantum's binade (subnormals: -6)
    q = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): spacing of e4m3 in that binade
    r = ((a / q + 8388608.0) - 8388608.0) * q  # exact: a/q < 16, fp32 add rounds to nearest even
    r = tl.minimum(r, 448.0)
    rb = r.to(tl.int32, bitcast=True)
    re_ = ((rb >> 23) & 0xFF) - 127
    normal = r >= 0.015625
    qe = tl.where(normal, re_, -6) - 3
    qq = ((qe + 127) << 23).to(tl.float32, bitcast=True)
    m = (r / qq).to(tl.int32)  # 8..15 (normal) or 0..7 (subnormal)
    bits = tl.where(normal, ((re_ + 7) << 3) | (m - 8), m)
    bits = tl.where(y.to(tl.int32, bitcast=True) < 0, bits | 0x80, bits)  # sign bit: -0.0 -> 0x80
    return tl.where(y != y, 0x7F, bits)


@triton.jit
def _indexer_k_quant_cache_kernel(
    k_ptr, cache_u8_ptr, cache_f32_ptr, slot_ptr,
    num_tokens, num_slots, stride_kt, stride_blk,
    PAGE: tl.constexpr, D: tl.constexpr, QB: tl.constexpr, USE_UE8M0: tl.constexpr, BLOCK_T: tl.constexpr,
    SOFT_CVT: tl.constexpr,
):
    NG: tl.constexpr = D // QB
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tm, other=-1).to(tl.int64)
    valid = tm & (slot >= 0) & (slot < num_slots)
    d = tl.arange(0, D)
    x = tl.load(k_ptr + t.to(tl.int64)[:, None] * stride_kt + d[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    xg = tl.reshape(x, [BLOCK_T, NG, QB])
    # NaN elements do not enter amax (vLLM's fmaxf; explicit, since a max reduction's NaN handling
    # differs between the GPU and the interpreter); inf gives s = inf (ue8m0 keeps it)
    amax = tl.max(tl.where(xg != xg, 0.0, tl.abs(xg)), axis=2)  # [BLOCK_T, NG]
    s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    if USE_UE8M0:
        s = _ue8m0_ceil(s)
    y = tl.math.div_rn(xg, s[:, :, None])
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))  # NaN stays NaN -> 0x7F
    y = tl.reshape(y, [BLOCK_T, D])
    if SOFT_CVT:
        yb = _e4m3_bits_rne(y).to(tl.uint8)
    else:
        yb = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        yb = tl.where(y != y, 0x7F, yb)  # one NaN byte whatever the sign / the cvt's choice
    blk = slot // PAGE
    off = slot % PAGE
    vbase = blk * stride_blk + off * D
    tl.store(cache_u8_ptr + vbase[:, None] + d[None, :], yb, mask=valid[:, None])
    g = tl.arange(0, NG)
    sbase = (blk * stride_blk + PAGE * D) // 4 + off * NG
    tl.store(cache_f32_ptr + sbase[:, None] + g[None, :], s, mask=valid[:, None])


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              quant_block_size: int, scale_fmt: str | None, validate: bool = False) -> None:
    """Drop-in for ``vllm._custom_ops.indexer_k_quant_and_cache(k, kv_cache, slot_mapping,
    quant_block_size, kv_cache_dtype)`` (vLLM passes the scale format, ``"ue8m0"``, as the last
    argument). ``k``: ``[T, D]`` bf16/fp16/fp32 (rows may be strided); ``slot_mapping``: ``[T]``
    int64 (or int32), negative or ``>= num_blocks * block_size`` = skip. Only the first
    ``slot_mapping.shape[0]`` rows of ``k`` are used (vLLM's CUDA-graph padding). ``validate``
    (debug only, host sync): raise on slots ``>= num_blocks * block_size``."""
    kv3, page, entry = _cache_geometry(kv_cache, k.shape[-1], quant_block_size)
    if k.dim() != 2 or k.stride(1) != 1:
        raise ValueError(f"k must be [T, head_dim] with contiguous rows, got {tuple(k.shape)} stride {k.stride()}")
    if k.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"k must be bf16/fp16/fp32, got {k.dtype}")
    head_dim = k.shape[1]
    if head_dim & (head_dim - 1) or quant_block_size & (quant_block_size - 1):
        raise ValueError("head_dim and quant_block_size must be powers of two")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"slot_mapping must be int64/int32, got {slot_mapping.dtype}")
    n = slot_mapping.shape[0]
    if k.shape[0] < n:
        raise ValueError(f"k has {k.shape[0]} rows for {n} slots")
    num_slots = kv3.shape[0] * page
    if validate and n > 0 and bool((slot_mapping[:n] >= num_slots).any().item()):
        raise ValueError(f"slot_mapping has slots >= num_blocks * block_size = {num_slots}")
    if n == 0 or num_slots == 0:
        return
    fp8v, f32v = _views(kv3)
    block_t = 4
    _indexer_k_quant_cache_kernel[(triton.cdiv(n, block_t),)](
        k, fp8v.view(torch.uint8), f32v, slot_mapping, n, num_slots, k.stride(0), kv3.stride(0),
        PAGE=page, D=head_dim, QB=quant_block_size, USE_UE8M0=(scale_fmt == "ue8m0"), BLOCK_T=block_t,
        SOFT_CVT=_interpret(), num_warps=4,
    )


def indexer_k_quant_and_cache_reference(k, kv_cache, slot_mapping, quant_block_size, scale_fmt) -> None:
    """PyTorch reference of the cache write (float32 math, same rounding rules)."""
    kv3, page, entry = _cache_geometry(kv_cache, k.shape[-1], quant_block_size)
    D = k.shape[-1]
    ng = D // quant_block_size
    n = slot_mapping.shape[0]
    x = k[:n].float().view(n, ng, quant_block_size)
    s = torch.clamp(torch.where(x.isnan(), 0.0, x.abs()).amax(dim=-1), min=1e-4) / 448.0
    if scale_fmt == "ue8m0":
        bits = s.view(torch.int32)
        e = (bits >> 23) & 0xFF
        e = torch.where((bits & 0x7FFFFF) != 0, e + 1, e)
        s = (e << 23).view(torch.float32)
    y = torch.clamp(x / s[..., None], -448.0, 448.0).to(FP8_DTYPE).view(torch.uint8)
    y = torch.where((x / s[..., None]).isnan(), 0x7F, y).view(n, D)  # NaN: the canonical 0x7F
    flat = kv3.view(kv3.shape[0], -1)
    for t in range(n):
        slot = int(slot_mapping[t])
        if slot < 0 or slot >= kv3.shape[0] * page:
            continue
        blk, off = divmod(slot, page)
        flat[blk, off * D:(off + 1) * D] = y[t]
        flat[blk, page * D + off * 4 * ng: page * D + (off + 1) * 4 * ng] = s[t].contiguous().view(torch.uint8)


def dequant_indexer_k_cache(kv_cache: torch.Tensor, head_dim: int = 128, quant_block_size: int = 128):
    """(values e4m3 -> fp32 [blocks, block_size, D], scales fp32 [blocks, block_size, D // qb])."""
    kv3, page, entry = _cache_geometry(kv_cache, head_dim, quant_block_size)
    ng = head_dim // quant_block_size
    flat = kv3.reshape(kv3.shape[0], -1)
    vals = flat[:, : page * head_dim].contiguous().view(FP8_DTYPE).float().view(-1, page, head_dim)
    scales = flat[:, page * head_dim: page * entry].contiguous().view(torch.float32).view(-1, page, ng)
    return vals, scales


# ----------------------------------------------------------------------------------------------
# 2. gather the paged K of a prefill chunk into contiguous [N, D] fp8 + [N] fp32
# ----------------------------------------------------------------------------------------------


@triton.jit
def _cp_gather_kernel(
    cache_fp8_ptr, cache_f32_ptr, dst_k_ptr, dst_s_ptr, bt_ptr, cu_ptr, req_ptr,
    num_tokens, stride_blk, stride_btb, stride_dk, stride_ds,
    PAGE: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < num_tokens
    # request of token t, found on the device by the wrapper (torch.searchsorted): an in-kernel
    # binary search over cu_seq_lens hit a Triton 3.6 layout-pass bug (sm_90 and sm_120)
    lo = tl.load(req_ptr + t, mask=tm, other=0)
    start = tl.load(cu_ptr + lo, mask=tm, other=0)
    end = tl.load(cu_ptr + lo + 1, mask=tm, other=0)
    valid = tm & (t >= start) & (t < end)
    off = t - start
    blk = tl.load(bt_ptr + lo.to(tl.int64) * stride_btb + off // PAGE, mask=valid, other=0).to(tl.int64)
    inpage = off % PAGE
    d = tl.arange(0, D)
    v = tl.load(cache_fp8_ptr + (blk * stride_blk + inpage * D)[:, None] + d[None, :], mask=valid[:, None])
    tl.store(dst_k_ptr + t.to(tl.int64)[:, None] * stride_dk + d[None, :], v, mask=valid[:, None])
    g = tl.arange(0, NG)
    sv = tl.load(cache_f32_ptr + ((blk * stride_blk + PAGE * D) // 4 + inpage * NG)[:, None] + g[None, :],
                 mask=valid[:, None])
    tl.store(dst_s_ptr + t.to(tl.int64)[:, None] * stride_ds + g[None, :], sv, mask=valid[:, None])


def _scale_view(dst_scale: torch.Tensor, n: int, ng: int) -> torch.Tensor:
    if dst_scale.dtype == torch.float32:
        s = dst_scale.reshape(dst_scale.shape[0], -1)
    elif dst_scale.dtype in (torch.uint8, torch.int8):
        s = dst_scale.reshape(dst_scale.shape[0], -1).view(torch.float32)
    elif dst_scale.dtype == torch.int32:
        s = dst_scale.reshape(dst_scale.shape[0], -1).view(torch.float32)
    else:
        raise TypeError(f"dst_scale must be fp32 or raw bytes, got {dst_scale.dtype}")
    if s.shape[0] < n or s.shape[1] < ng:
        raise ValueError(f"dst_scale {tuple(dst_scale.shape)} too small for {n} tokens x {ng} scales")
    return s


def cp_gather_indexer_k_quant_cache(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
                                    block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    """Drop-in for ``vllm._custom_ops.cp_gather_indexer_k_quant_cache``: token ``t`` of the chunk
    (request ``r`` with ``cu_seq_lens[r] <= t < cu_seq_lens[r + 1]``, position ``t - cu_seq_lens[r]``)
    is copied to ``dst_k[t]`` (e4m3 ``[N, D]``) and its scale(s) to ``dst_scale[t]`` (``[N, 4 * D /
    qb]`` bytes as vLLM allocates it, or fp32). Rows ``t >= cu_seq_lens[-1]`` are not touched."""
    head_dim = dst_k.shape[-1]
    if dst_k.dim() != 2 or dst_k.stride(1) != 1:
        raise ValueError(f"dst_k must be [N, head_dim] with contiguous rows, got {tuple(dst_k.shape)}")
    if dst_k.dtype not in (FP8_DTYPE, torch.uint8, torch.int8):
        raise TypeError(f"dst_k must be float8_e4m3fn (or raw bytes), got {dst_k.dtype}")
    n = dst_k.shape[0]
    # one fp32 scale per quant block; vLLM's layout has quant_block == head_dim for the indexer
    ng = (dst_scale.numel() * dst_scale.element_size() // 4) // max(dst_scale.shape[0], 1) if n else 1
    ng = max(1, min(ng, head_dim))
    kv3, page, entry = _cache_geometry(kv_cache, head_dim, head_dim // ng)
    if block_table.dtype != torch.int32 or cu_seq_lens.dtype != torch.int32:
        raise TypeError("block_table and cu_seq_lens must be int32")
    if block_table.stride(-1) != 1 and block_table.shape[-1] > 1:
        raise ValueError("block_table rows must be contiguous")
    if n == 0:
        return
    num_reqs = cu_seq_lens.shape[0] - 1
    if num_reqs <= 0:
        return
    s = _scale_view(dst_scale, n, ng)
    fp8v, f32v = _views(kv3)
    dk = dst_k.view(FP8_DTYPE) if dst_k.dtype != FP8_DTYPE else dst_k
    # request of every token: the last r with cu_seq_lens[r] <= t (tokens past the chunk end get
    # num_reqs and are masked by the kernel)
    tok = torch.arange(n, device=cu_seq_lens.device, dtype=torch.int32)
    req = (torch.searchsorted(cu_seq_lens[1:], tok, right=True)).clamp_(max=num_reqs - 1).to(torch.int32)
    block_t = 16
    _cp_gather_kernel[(triton.cdiv(n, block_t),)](
        fp8v, f32v, dk, s, block_table, cu_seq_lens, req,
        n, kv3.stride(0), block_table.stride(0), dk.stride(0), s.stride(0),
        PAGE=page, D=head_dim, NG=ng, BLOCK_T=block_t,
        num_warps=4,
    )


def cp_gather_indexer_k_quant_cache_reference(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    head_dim = dst_k.shape[-1]
    n = dst_k.shape[0]
    ng = max(1, min((dst_scale.numel() * dst_scale.element_size() // 4) // max(dst_scale.shape[0], 1), head_dim))
    kv3, page, entry = _cache_geometry(kv_cache, head_dim, head_dim // ng)
    flat = kv3.reshape(kv3.shape[0], -1)
    s = _scale_view(dst_scale, n, ng)
    dk = dst_k.view(torch.uint8)
    cu = cu_seq_lens.tolist()
    for r in range(len(cu) - 1):
        for t in range(cu[r], min(cu[r + 1], n)):
            off = t - cu[r]
            blk = int(block_table[r, off // page])
            o = off % page
            dk[t] = flat[blk, o * head_dim:(o + 1) * head_dim]
            s[t, :ng] = flat[blk, page * head_dim + o * 4 * ng: page * head_dim + (o + 1) * 4 * ng].view(torch.float32)


# ----------------------------------------------------------------------------------------------
# 3. decode: paged MQA logits
# ----------------------------------------------------------------------------------------------


@triton.jit
def _paged_logits_kernel(
    q_ptr, kv_fp8_ptr, kv_f32_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
    stride_qb, stride_qn, stride_qh, stride_blk, stride_wr, stride_cb, stride_btb, stride_or,
    max_model_len, b0,
    NEXT_N: tl.constexpr, NN_P: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, CTX_2D: tl.constexpr, CLEAN: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # The programs along x share one request's tiles, interleaved (tile t goes to program t % nprog),
    # counted from the request's own context: work per program follows the context, not
    # max_model_len, and the grid (nprog x B) comes from shapes only.
    pid_s = tl.program_id(0)
    nprog = tl.num_programs(0)
    b = tl.program_id(1).to(tl.int64) + b0  # b0: first request of this launch (grid-y tiling)
    jj = tl.arange(0, NN_P)
    jm = jj < NEXT_N
    if CTX_2D:
        lens = tl.load(ctx_ptr + b * stride_cb + jj, mask=jm, other=0)
    else:
        c = tl.load(ctx_ptr + b * stride_cb + jj * 0)
        lens = tl.where(jm, c - NEXT_N + 1 + jj, 0)
    lens = tl.minimum(tl.maximum(lens, 0), max_model_len)
    ctx_max = tl.max(lens, 0)
    n_ctx_tiles = tl.cdiv(ctx_max, BLOCK_N)

    rr = tl.arange(0, NN_P * H)
    r_j = rr // H
    r_h = rr % H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + (r_j * stride_qn + r_h * stride_qh)[:, None] + d[None, :],
                mask=(r_j < NEXT_N)[:, None], other=0.0)
    qT = tl.trans(q)  # [D, NN_P * H]
    w = tl.load(w_ptr + (b * NEXT_N + r_j) * stride_wr + r_h, mask=r_j < NEXT_N, other=0.0)
    orow = out_ptr + (b * NEXT_N + jj).to(tl.int64) * stride_or  # [NN_P]
    nb = tl.arange(0, BLOCK_N)
    for t in tl.range(pid_s, n_ctx_tiles, nprog, num_stages=NUM_STAGES):
        pos = t * BLOCK_N + nb
        valid = pos < ctx_max
        if BLOCK_N <= PAGE:  # the tile lies inside one cache block: one block-table load
            tile0 = t * BLOCK_N
            blk = tl.load(bt_ptr + b * stride_btb + tile0 // PAGE).to(tl.int64)
        else:
            blk = tl.load(bt_ptr + b * stride_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        inpage = pos % PAGE
        kb = blk * stride_blk + inpage * D
        k = tl.load(kv_fp8_ptr + kb[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        sc = tl.load(kv_f32_ptr + (blk * stride_blk + PAGE * D) // 4 + inpage, mask=valid, other=0.0)
        s = tl.dot(k, qT)  # [BLOCK_N, NN_P * H], fp32
        s = tl.maximum(s, 0.0) * w[None, :]
        if NN_P == 1:
            lg = tl.sum(s, axis=1) * sc
            lg = tl.where(pos < tl.max(lens, 0), lg, float("-inf"))
            tl.store(out_ptr + (b * NEXT_N) * stride_or + pos, lg, mask=pos < max_model_len)
        else:
            lg = tl.sum(tl.reshape(s, [BLOCK_N, NN_P, H]), axis=2) * sc[:, None]
            lg = tl.where(pos[:, None] < lens[None, :], lg, float("-inf"))
            tl.store(orow[None, :] + pos[:, None], lg, mask=jm[None, :] & (pos < max_model_len)[:, None])
    if CLEAN:  # the tiles past the context: first one of this program's at or after n_ctx_tiles
        t0 = n_ctx_tiles + (pid_s - n_ctx_tiles % nprog + nprog) % nprog
        for t in range(t0, tl.cdiv(max_model_len, BLOCK_N), nprog):
            pos = t * BLOCK_N + nb
            ninf = tl.full([BLOCK_N, NN_P], float("-inf"), tl.float32)
            tl.store(orow[None, :] + pos[:, None], ninf, mask=jm[None, :] & (pos < max_model_len)[:, None])


# Programs per SM the paged-logits grid aims at (``paged_logits_config``). Swept on the H200
# (bench/dsa_indexer.py --sweep): 4 lost 12-20% against the chunked grid it replaced at 32k-128k
# with 16-128 rows (too few loads in flight), 2 lost more; 16 took 5-9% longer than 8 at 4k-128k
# with 16-128 rows; 8 matched or beat the chunked grid there.
PAGED_WAVES = 8.0


def paged_logits_config(batch: int, next_n: int, max_model_len: int, num_sms: int, waves: float = PAGED_WAVES,
                        block_n: int = 64, heads: int = 32) -> dict:
    """Launch config from shapes only: ``PROGS`` programs per request (grid x, not a compile-time
    constant) share its context tiles of ``BLOCK_N`` positions, so the grid holds ~``waves``
    programs per SM whatever the batch, and a short context in a long ``max_model_len`` costs
    only its own tiles."""
    progs = max(1, round(num_sms * waves / max(batch, 1)))
    progs = min(progs, max(1, triton.cdiv(max_model_len, block_n)))
    # >= 256 MMA columns (e.g. 64 heads x next_n 4) spill with 4 warps on sm_121: use 8
    cols = triton.next_power_of_2(next_n) * heads
    return dict(BLOCK_N=block_n, PROGS=progs, NUM_STAGES=3, num_warps=8 if cols >= 256 else 4)


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_model_len: int,
                         clean_logits: bool = True, out: torch.Tensor | None = None,
                         **overrides) -> torch.Tensor:
    """MQA logits of decode queries over the paged indexer cache (DeepGEMM ``fp8_paged_mqa_logits``
    with FP8 q). ``q``: ``[B, next_n, H, D]`` float8_e4m3fn; ``kv_cache``: uint8 ``[blocks,
    block_size, (1,) D + 4]``; ``weights``: ``[B * next_n, H]`` fp32 (all scales folded in);
    ``context_lens``: int32 ``[B]`` or ``[B, next_n]``; ``block_table``: int32 ``[B, max_blocks]``.
    Returns fp32 ``[B * next_n, max_model_len]`` (contiguous).

    Host cost: a call's validation, launch config and Triton's binding are worked out once per key
    (every tensor's shape, strides, dtype, device and 16-byte alignment, ``max_model_len``,
    ``clean_logits``); later calls launch the compiled kernel directly (as the top-k's planned
    calls). Calls with overrides or under a launch hook take Triton's path every time."""
    key = None
    if not overrides:
        key = _paged_key(q, kv_cache, weights, context_lens, block_table, max_model_len, clean_logits, out)
        p = _PAGED_PLANS.get(key) if key is not None else None
        if p is not None and _topk._hooks_off():
            if out is None:
                out = torch.empty(p.out_shape, dtype=torch.float32, device=q.device)
            kvp = kv_cache.data_ptr()
            ptrs = (q.data_ptr(), kvp, kvp, weights.data_ptr(), context_lens.data_ptr(), block_table.data_ptr(),
                    out.data_ptr())
            stream = _topk._raw_stream(q.device.index or 0)
            for (run, head, grid, tail), b0 in zip(p.direct, p.b0s):
                run(grid[0], grid[1], 1, stream, *head, *ptrs, *p.ints, b0, *tail)
            return out
    if q.dim() != 4:
        raise ValueError(f"q must be [B, next_n, H, D], got {tuple(q.shape)}")
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"q must be float8_e4m3fn, got {q.dtype}")
    B, next_n, H, D = q.shape
    if q.stride(3) != 1:
        raise ValueError("q's last dim must be contiguous")
    if H & (H - 1) or D & (D - 1) or D < 16 or H < 1:
        raise ValueError(f"H ({H}) and D ({D}) must be powers of two, D >= 16")
    kv3, page, entry = _cache_geometry(kv_cache, D, D)
    if weights.dtype != torch.float32 or weights.dim() != 2 or weights.shape[1] != H or weights.stride(1) != 1:
        raise ValueError(f"weights must be fp32 [B*next_n, {H}] with contiguous rows, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if weights.shape[0] < B * next_n:
        raise ValueError(f"weights has {weights.shape[0]} rows for {B * next_n} queries")
    if context_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise TypeError("context_lens and block_table must be int32")
    if context_lens.dim() == 2:
        if tuple(context_lens.shape) != (B, next_n) or context_lens.stride(1) != 1:
            raise ValueError(f"2-D context_lens must be [B, next_n] = {(B, next_n)}, got {tuple(context_lens.shape)}")
        ctx_2d, stride_cb = True, context_lens.stride(0)
    elif context_lens.dim() == 1:
        if context_lens.shape[0] < B:
            raise ValueError(f"context_lens has {context_lens.shape[0]} entries for batch {B}")
        ctx_2d, stride_cb = False, context_lens.stride(0)
    else:
        raise ValueError("context_lens must be 1-D [B] or 2-D [B, next_n]")
    # (a [B, 1] table may be a view with stride(1) != 1, as upstream's wrapper notes: only column 0
    # is read then, so its stride does not matter)
    if block_table.dim() != 2 or block_table.shape[0] < B or (block_table.stride(1) != 1 and block_table.shape[1] > 1):
        raise ValueError(f"block_table must be [B, max_blocks] with contiguous rows, got {tuple(block_table.shape)}")
    rows = B * next_n
    if out is None:  # contiguous: vLLM's persistent_topk takes logits.size(1) as the row stride
        out = torch.empty(rows, max_model_len, dtype=torch.float32, device=q.device)
    elif out.shape[0] < rows or out.shape[1] < max_model_len or out.stride(1) != 1 or out.dtype != torch.float32:
        raise ValueError("out must be fp32 [B*next_n, >= max_model_len] with contiguous rows")
    if rows == 0 or max_model_len == 0:
        return out
    overrides = dict(overrides)
    waves = overrides.pop("WAVES", PAGED_WAVES)
    max_grid_yz = overrides.pop("MAX_GRID_YZ", MAX_GRID_YZ)
    cfg = paged_logits_config(B, next_n, max_model_len, _device_sms(q.device), waves,
                              overrides.get("BLOCK_N", 64), H)
    cfg.update(overrides)
    num_warps = cfg.pop("num_warps")
    progs = cfg.pop("PROGS")
    fp8v, f32v = _views(kv3)
    ints = (q.stride(0), q.stride(1), q.stride(2), kv3.stride(0), weights.stride(0), stride_cb,
            block_table.stride(0), out.stride(0), max_model_len)
    consts = dict(NEXT_N=next_n, NN_P=triton.next_power_of_2(next_n), H=H, D=D, PAGE=page, CTX_2D=ctx_2d,
                  CLEAN=bool(clean_logits), **cfg)
    entries, b0s = [], []
    for b0, nb in grid_yz_tiles(B, max_grid_yz):
        ck = _paged_logits_kernel[(progs, nb)](q, fp8v, f32v, weights, context_lens, block_table, out, *ints, b0,
                                               num_warps=num_warps, **consts)
        entries.append(_topk._direct_entry(_paged_logits_kernel, ck, (progs, nb), consts))
        b0s.append(b0)
    if key is not None and all(e is not None for e in entries):  # compiled (never in the interpreter)
        plan = _PagedPlan()
        plan.direct, plan.b0s, plan.ints, plan.out_shape = entries, b0s, ints, (rows, max_model_len)
        _topk._remember(_PAGED_PLANS, key, plan)
    return out


# Planned paged-logits calls (key -> _PagedPlan): see fp8_paged_mqa_logits.
_PAGED_PLANS: dict = {}


class _PagedPlan:
    __slots__ = ("direct", "b0s", "ints", "out_shape")


def _paged_key(q, kv_cache, weights, context_lens, block_table, max_model_len, clean_logits, out):
    """The plan key of a paged-logits call, or None (a pointer not 16-byte aligned: Triton
    specializes on pointer alignment)."""
    ptrs = q.data_ptr() | kv_cache.data_ptr() | weights.data_ptr() | context_lens.data_ptr() | block_table.data_ptr()
    ko = None
    if out is not None:
        ptrs |= out.data_ptr()
        ko = (out.shape, out.stride(), out.dtype, out.device)
    if ptrs & 15:
        return None
    return (q.shape, q.stride(), q.dtype, q.device, kv_cache.shape, kv_cache.stride(), kv_cache.dtype,
            kv_cache.device, weights.shape, weights.stride(), weights.dtype, weights.device, context_lens.shape,
            context_lens.stride(), context_lens.dtype, context_lens.device, block_table.shape, block_table.stride(),
            block_table.dtype, block_table.device, int(max_model_len), bool(clean_logits), ko)


def _row_context(context_lens: torch.Tensor, B: int, next_n: int) -> torch.Tensor:
    cl = context_lens.detach().cpu().long()
    if cl.dim() == 2:
        return cl[:B].reshape(-1)
    j = torch.arange(next_n)
    return (cl[:B, None] - next_n + 1 + j[None, :]).reshape(-1)


def fp8_paged_mqa_logits_reference(q, kv_cache, weights, context_lens, block_table, max_model_len) -> torch.Tensor:
    """float64 reference on the dequantized cache; ``-inf`` outside each row's context."""
    B, next_n, H, D = q.shape
    vals, scales = dequant_indexer_k_cache(kv_cache, D, D)
    page = vals.shape[1]
    lens = _row_context(context_lens, B, next_n)
    out = torch.full((B * next_n, max_model_len), float("-inf"), dtype=torch.float64)
    qf = q.float().double().cpu()
    wf = weights.double().cpu()
    bt = block_table.cpu().long()
    vals = vals.double().cpu()
    scales = scales.double().cpu()
    for b in range(B):
        for j in range(next_n):
            r = b * next_n + j
            L = int(min(max(int(lens[r]), 0), max_model_len))
            if L == 0:
                continue
            nblk = (L + page - 1) // page
            blks = bt[b, :nblk]
            kf = vals[blks].reshape(-1, D)[:L]
            ks = scales[blks].reshape(-1)[:L]
            s = torch.relu(qf[b, j] @ kf.T)  # [H, L]
            out[r, :L] = (wf[r][:, None] * s).sum(0) * ks
    return out


# ----------------------------------------------------------------------------------------------
# 4. chunked prefill: ragged MQA logits over a gathered K
# ----------------------------------------------------------------------------------------------


@triton.jit
def _ragged_logits_kernel(
    q_ptr, k_ptr, ks_ptr, w_ptr, cks_ptr, cke_ptr, out_ptr,
    M, N, stride_qm, stride_qh, stride_kn, stride_wm, stride_om, qb0,
    H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, CLEAN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_q = tl.program_id(1) + qb0  # qb0: first query block of this launch (grid-y tiling)
    qi = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qm = qi < M
    kst = tl.load(cks_ptr + qi, mask=qm, other=2147483647)
    ken = tl.load(cke_ptr + qi, mask=qm, other=0)
    lo = tl.min(kst, 0)
    hi = tl.max(ken, 0)
    n0 = pid_n * BLOCK_N
    pos = n0 + tl.arange(0, BLOCK_N)
    pm = pos < N
    optr = out_ptr + qi.to(tl.int64)[None, :] * stride_om + pos[:, None]
    omask = qm[None, :] & pm[:, None]
    if (n0 < hi) & (n0 + BLOCK_N > lo):
        rr = tl.arange(0, BLOCK_Q * H)
        r_q = pid_q * BLOCK_Q + rr // H
        r_h = rr % H
        d = tl.arange(0, D)
        q = tl.load(q_ptr + r_q.to(tl.int64)[:, None] * stride_qm + (r_h * stride_qh)[:, None] + d[None, :],
                    mask=(r_q < M)[:, None], other=0.0)
        w = tl.load(w_ptr + r_q.to(tl.int64) * stride_wm + r_h, mask=r_q < M, other=0.0)
        k = tl.load(k_ptr + pos.to(tl.int64)[:, None] * stride_kn + d[None, :], mask=pm[:, None], other=0.0)
        sc = tl.load(ks_ptr + pos, mask=pm, other=0.0)
        s = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_Q * H]
        s = tl.maximum(s, 0.0) * w[None, :]
        lg = tl.sum(tl.reshape(s, [BLOCK_N, BLOCK_Q, H]), axis=2) * sc[:, None]
        inside = (pos[:, None] >= kst[None, :]) & (pos[:, None] < ken[None, :])
        tl.store(optr, tl.where(inside, lg, float("-inf")), mask=omask)
    elif CLEAN:
        tl.store(optr, tl.full([BLOCK_N, BLOCK_Q], float("-inf"), tl.float32), mask=omask)


def fp8_mqa_logits(q: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                   cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor, clean_logits: bool = True,
                   out: torch.Tensor | None = None, **overrides) -> torch.Tensor:
    """Ragged MQA logits (DeepGEMM ``fp8_mqa_logits`` with FP8 q): ``q`` ``[M, H, D]`` e4m3,
    ``k_fp8`` ``[N, D]`` e4m3, ``k_scale`` ``[N]`` fp32, ``weights`` ``[M, H]`` fp32; query row ``i``
    sees columns ``[cu_seqlen_ks[i], cu_seqlen_ke[i])``. Returns fp32 ``[M, N]``."""
    if q.dim() != 3 or q.dtype != FP8_DTYPE or q.stride(2) != 1:
        raise ValueError(f"q must be float8_e4m3fn [M, H, D] with contiguous last dim, got {q.dtype} {tuple(q.shape)}")
    M, H, D = q.shape
    if H & (H - 1) or D & (D - 1) or D < 16:
        raise ValueError(f"H ({H}) and D ({D}) must be powers of two, D >= 16")
    if k_fp8.dim() != 2 or k_fp8.shape[1] != D or k_fp8.stride(1) != 1:
        raise ValueError(f"k_fp8 must be [N, {D}] with contiguous rows, got {tuple(k_fp8.shape)}")
    if k_fp8.dtype != FP8_DTYPE:
        k_fp8 = k_fp8.view(FP8_DTYPE)
    N = k_fp8.shape[0]
    k_scale = k_scale.reshape(-1)
    if k_scale.dtype != torch.float32 or k_scale.numel() < N or k_scale.stride(0) != 1:
        raise ValueError("k_scale must be fp32 [N] (contiguous)")
    if weights.dtype != torch.float32 or tuple(weights.shape[-1:]) != (H,) or weights.shape[0] < M or weights.stride(1) != 1:
        raise ValueError(f"weights must be fp32 [M, {H}] with contiguous rows")
    if cu_seqlen_ks.dtype != torch.int32 or cu_seqlen_ke.dtype != torch.int32:
        raise TypeError("cu_seqlen_ks / cu_seqlen_ke must be int32")
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32, device=q.device)
    if M == 0 or N == 0:
        return out
    cfg = dict(BLOCK_Q=max(1, 128 // H), BLOCK_N=128, num_warps=8)
    cfg.update(overrides)
    num_warps = cfg.pop("num_warps")
    max_grid_yz = cfg.pop("MAX_GRID_YZ", MAX_GRID_YZ)
    for qb0, nqb in grid_yz_tiles(triton.cdiv(M, cfg["BLOCK_Q"]), max_grid_yz):
        _ragged_logits_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), nqb)](
            q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out,
            M, N, q.stride(0), q.stride(1), k_fp8.stride(0), weights.stride(0), out.stride(0), qb0,
            H=H, D=D, CLEAN=bool(clean_logits), num_warps=num_warps, **cfg,
        )
    return out


def fp8_mqa_logits_reference(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke) -> torch.Tensor:
    M, H, D = q.shape
    N = k_fp8.shape[0]
    qf = q.float().double().cpu()
    kf = k_fp8.view(FP8_DTYPE).float().double().cpu() * k_scale.reshape(-1)[:N].double().cpu()[:, None]
    s = torch.relu(torch.einsum("mhd,nd->mhn", qf, kf))
    lg = (weights.double().cpu()[:, :, None] * s).sum(1)
    cols = torch.arange(N)
    ks = cu_seqlen_ks.cpu().long()[:, None]
    ke = cu_seqlen_ke.cpu().long()[:, None]
    return torch.where((cols[None, :] >= ks) & (cols[None, :] < ke), lg, torch.tensor(float("-inf"), dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# SM120 compile specs (tools/sm120_check.py)
# ----------------------------------------------------------------------------------------------


# Inputs the paged-logits dispatch is enumerated over for the compile specs: the indexer head
# counts of GLM-5 (32) and DeepSeek-V3.2 (64) (the indexer's heads are not split by tensor
# parallelism), next_n 1..4 (MTP with up to 3 draft tokens), batches 1..4096, max_model_len from
# one page to 1M (GLM-5.2), and the SM counts of the targeted GPUs (see triton_dsa_topk.SPEC_SMS).
SPEC_HEADS = (32, 64)
SPEC_NEXT_N = (1, 2, 3, 4)
SPEC_BATCH = tuple(1 << i for i in range(13))
SPEC_MAX_MODEL_LEN = (64, 4096, 32768, 131072, 163840, 202752, 1 << 20)
SPEC_SMS = (8, 48, 84, 132, 148, 170, 188)


def paged_dispatch_configs(heads=SPEC_HEADS, next_ns=SPEC_NEXT_N, batches=SPEC_BATCH,
                           max_model_lens=SPEC_MAX_MODEL_LEN, sms=SPEC_SMS) -> list[tuple[int, int, dict]]:
    """Every distinct (H, next_n, compiled part of paged_logits_config) the paged logits dispatch
    picks (default WAVES and BLOCK_N, as vLLM calls it) over the given inputs. ``PROGS`` is a grid
    size, not compiled in, so it is left out."""
    seen = {}
    for H in heads:
        for nn_ in next_ns:
            for B in batches:
                for L in max_model_lens:
                    for n in sms:
                        cfg = paged_logits_config(B, nn_, L, n, heads=H)
                        cfg.pop("PROGS")
                        seen.setdefault((H, nn_, tuple(sorted(cfg.items()))), (H, nn_, cfg))
    return [seen[key] for key in sorted(seen)]


def SM120_COMPILE_SPECS() -> list[dict]:
    """Every configuration the dispatch above can choose, at GLM-5 / DeepSeek shapes."""
    specs = []
    for in_t in ("*bf16", "*fp16"):
        for ue8m0 in (True, False):
            specs.append({
                "name": f"dsa_indexer_k_cache[{in_t[1:]},ue8m0={int(ue8m0)}]",
                "fn": _indexer_k_quant_cache_kernel,
                "signature": {"k_ptr": in_t, "cache_u8_ptr": "*u8", "cache_f32_ptr": "*fp32",
                              "slot_ptr": "*i64", "num_tokens": "i32", "num_slots": "i32", "stride_kt": "i32",
                              "stride_blk": "i32",
                              "PAGE": "constexpr", "D": "constexpr", "QB": "constexpr", "USE_UE8M0": "constexpr",
                              "BLOCK_T": "constexpr", "SOFT_CVT": "constexpr"},
                "constexprs": {"PAGE": 64, "D": 128, "QB": 128, "USE_UE8M0": ue8m0, "BLOCK_T": 4, "SOFT_CVT": False},
                "divisible_by_16": ["k_ptr", "cache_u8_ptr", "cache_f32_ptr", "slot_ptr", "stride_kt", "stride_blk"],
                "num_warps": 4, "num_stages": 1,
            })
    # stride_ds == 1 is what vLLM passes (its [N, 4]-byte scale workspace seen as [N, 1] fp32) and
    # the launcher then specializes it as a constant; num_tokens is often a multiple of 16.
    for ds_one in (False, True):
        sig = {"cache_fp8_ptr": "*fp8e4nv", "cache_f32_ptr": "*fp32", "dst_k_ptr": "*fp8e4nv",
               "dst_s_ptr": "*fp32", "bt_ptr": "*i32", "cu_ptr": "*i32", "req_ptr": "*i32",
               "num_tokens": "i32", "stride_blk": "i32", "stride_btb": "i32", "stride_dk": "i32",
               "stride_ds": "constexpr" if ds_one else "i32", "PAGE": "constexpr", "D": "constexpr",
               "NG": "constexpr", "BLOCK_T": "constexpr"}
        consts = {"PAGE": 64, "D": 128, "NG": 1, "BLOCK_T": 16}
        if ds_one:
            consts["stride_ds"] = 1
        specs.append({
            "name": f"dsa_cp_gather_indexer_k{'_ds1' if ds_one else ''}",
            "fn": _cp_gather_kernel,
            "signature": sig,
            "constexprs": consts,
            "divisible_by_16": ["cache_fp8_ptr", "cache_f32_ptr", "dst_k_ptr", "dst_s_ptr", "bt_ptr", "cu_ptr",
                                "req_ptr", "num_tokens", "stride_blk", "stride_dk"],
            "num_warps": 4, "num_stages": 1,
        })
    # paged logits: every (H, next_n, BLOCK_N, NUM_STAGES, warps) paged_logits_config picks
    # (paged_dispatch_configs), each with the four CLEAN / CTX_2D pairs (a store loop and the
    # context-length loads, set by the caller, not the dispatch; vLLM passes clean_logits=False
    # and 2-D context lengths).
    flags = ((False, True), (True, False), (False, False), (True, True))
    for (H, next_n, cfg), (clean, ctx_2d) in itertools.product(paged_dispatch_configs(), flags):
        cfg = dict(cfg)
        nw = cfg.pop("num_warps")
        specs.append({
            "name": f"dsa_paged_logits[H={H},next_n={next_n},bn={cfg['BLOCK_N']},w={nw},clean={int(clean)},"
                    f"ctx2d={int(ctx_2d)}]",
            "fn": _paged_logits_kernel,
            "signature": {
                "q_ptr": "*fp8e4nv", "kv_fp8_ptr": "*fp8e4nv", "kv_f32_ptr": "*fp32",
                "w_ptr": "*fp32", "ctx_ptr": "*i32", "bt_ptr": "*i32", "out_ptr": "*fp32",
                "stride_qb": "i32", "stride_qn": "i32", "stride_qh": "i32", "stride_blk": "i32",
                "stride_wr": "i32", "stride_cb": "i32", "stride_btb": "i32", "stride_or": "i32",
                "max_model_len": "i32", "b0": "i32",
                "NEXT_N": "constexpr", "NN_P": "constexpr", "H": "constexpr", "D": "constexpr",
                "PAGE": "constexpr", "BLOCK_N": "constexpr",
                "CTX_2D": "constexpr", "CLEAN": "constexpr", "NUM_STAGES": "constexpr"},
            "constexprs": dict(NEXT_N=next_n, NN_P=triton.next_power_of_2(next_n), H=H, D=128, PAGE=64,
                               CTX_2D=ctx_2d, CLEAN=clean, **cfg),
            "divisible_by_16": ["q_ptr", "kv_fp8_ptr", "kv_f32_ptr", "w_ptr", "ctx_ptr", "bt_ptr",
                                "out_ptr", "stride_qb", "stride_qn", "stride_qh", "stride_blk",
                                "stride_wr", "stride_or"],
            "num_warps": nw, "num_stages": cfg["NUM_STAGES"],
        })
    for H in (32, 64):
        for clean in (False, True):
            specs.append({
                "name": f"dsa_ragged_logits[H={H},clean={int(clean)}]",
                "fn": _ragged_logits_kernel,
                "signature": {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "w_ptr": "*fp32",
                              "cks_ptr": "*i32", "cke_ptr": "*i32", "out_ptr": "*fp32", "M": "i32", "N": "i32",
                              "stride_qm": "i32", "stride_qh": "i32", "stride_kn": "i32", "stride_wm": "i32",
                              "stride_om": "i32", "qb0": "i32", "H": "constexpr", "D": "constexpr", "BLOCK_Q": "constexpr",
                              "BLOCK_N": "constexpr", "CLEAN": "constexpr"},
                "constexprs": {"H": H, "D": 128, "BLOCK_Q": max(1, 128 // H), "BLOCK_N": 128, "CLEAN": clean},
                "divisible_by_16": ["q_ptr", "k_ptr", "ks_ptr", "w_ptr", "out_ptr", "stride_qm", "stride_qh",
                                    "stride_kn", "stride_wm"],
                "num_warps": 8, "num_stages": 1,
            })
    return specs

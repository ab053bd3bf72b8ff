# SPDX-License-Identifier: Apache-2.0
"""The MLA KV-cache row formats: one table for the cache writer, the sparse decode / prefill and
the backend (``vllm/v1/attention/ops/mla_kv_format.py`` inside the patched vLLM tree).

One token of an MLA cache is 576 values: the 512-wide latent (``kv_lora_rank``, also the V of the
absorbed attention) then the 64-wide rope part of K. vLLM stores it in one of three layouts,
selected by its ``kv_cache_dtype`` string:

=====================================  =========  =============================================
``kv_cache_dtype`` (aliases)           row bytes  one token row (byte offsets)
=====================================  =========  =============================================
``fp8_ds_mla``                         656        ``[0, 512)`` 512 x e4m3 latent; ``[512, 528)``
                                                  4 x fp32 scales, one per 128 latent values
                                                  (value = e4m3 x scale); ``[528, 656)``
                                                  64 x 16-bit rope in the model dtype
``fp8``, ``fp8_e4m3``                  576        576 x e4m3; value = e4m3 x ``k_scale`` (one
                                                  fp32 scale per layer, outside the row)
``auto`` (model dtype), ``bfloat16``,  1152       576 x bf16 / fp16, stored as is
``bf16``, ``float16``, ``half``,
``fp16``
=====================================  =========  =============================================

The cache tensor is ``[num_blocks, block_size, row_elems]`` (``row_elems`` = 656, 576, 576) of
``storage_dtype`` (uint8 for the two fp8 layouts; vLLM may also hand over float8_e4m3fn/int8 views
of the same bytes). Slot = block * block_size + offset.

This file imports only torch and the standard library.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "LATENT_DIM",
    "ROPE_DIM",
    "HEAD_DIM",
    "DS_GROUP",
    "DS_NUM_GROUPS",
    "FMT_DS_MLA",
    "FMT_FP8",
    "FMT_16BIT",
    "KVRowFormat",
    "KV_FORMAT_ALIASES",
    "resolve_kv_format",
    "kv_cache_row_elems",
    "kv_cache_row_bytes",
    "check_kv_cache",
    "dequantize_rows",
]

LATENT_DIM = 512  # kv_lora_rank: V width and the quantized part of K
ROPE_DIM = 64  # qk_rope_head_dim
HEAD_DIM = LATENT_DIM + ROPE_DIM  # 576: K width (the absorbed q width)
DS_GROUP = 128  # fp8_ds_mla: latent values per fp32 scale
DS_NUM_GROUPS = LATENT_DIM // DS_GROUP  # 4

# Kernel-side format codes (the constexpr KV_FORMAT of the Triton kernels).
FMT_DS_MLA = 0
FMT_FP8 = 1
FMT_16BIT = 2

_16BIT_DTYPES = (torch.bfloat16, torch.float16)
_ONE_BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class KVRowFormat:
    """Layout of one token row of an MLA KV cache (all offsets in bytes from the row start)."""

    name: str  # canonical name: "fp8_ds_mla", "fp8", "bfloat16" or "float16"
    code: int  # FMT_DS_MLA / FMT_FP8 / FMT_16BIT (the kernels' constexpr KV_FORMAT)
    storage_dtype: torch.dtype  # element type of the cache tensor
    row_elems: int  # last dimension of the cache tensor
    row_bytes: int  # bytes per token
    latent_dtype: torch.dtype  # how the 512 latent values are stored
    rope_dtype: torch.dtype  # how the 64 rope values are stored
    latent_offset: int  # byte offset of the latent part
    rope_offset: int  # byte offset of the rope part
    scale: str  # "per_group_in_row" (fp8_ds_mla), "per_tensor" (fp8: k_scale) or "none"
    scale_offset: int | None  # byte offset of the in-row fp32 scales (fp8_ds_mla), else None
    scale_group: int | None  # latent values per in-row scale (128), else None
    row_align: int  # bytes every row start must be a multiple of (fp32 scales: 16)

    @property
    def is_fp8(self) -> bool:
        return self.code != FMT_16BIT


KV_FORMAT_ALIASES: dict[str, int] = {
    "fp8_ds_mla": FMT_DS_MLA,
    "fp8": FMT_FP8,
    "fp8_e4m3": FMT_FP8,
    "auto": FMT_16BIT,
    "bfloat16": FMT_16BIT,
    "bf16": FMT_16BIT,
    "float16": FMT_16BIT,
    "half": FMT_16BIT,
    "fp16": FMT_16BIT,
}
_16BIT_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def _make(code: int, model_dtype: torch.dtype) -> KVRowFormat:
    if code == FMT_DS_MLA:
        return KVRowFormat(
            name="fp8_ds_mla", code=FMT_DS_MLA, storage_dtype=torch.uint8,
            row_elems=LATENT_DIM + 4 * DS_NUM_GROUPS + 2 * ROPE_DIM,
            row_bytes=LATENT_DIM + 4 * DS_NUM_GROUPS + 2 * ROPE_DIM,
            latent_dtype=torch.float8_e4m3fn, rope_dtype=model_dtype,
            latent_offset=0, rope_offset=LATENT_DIM + 4 * DS_NUM_GROUPS,
            scale="per_group_in_row", scale_offset=LATENT_DIM, scale_group=DS_GROUP, row_align=16)
    if code == FMT_FP8:
        return KVRowFormat(
            name="fp8", code=FMT_FP8, storage_dtype=torch.uint8, row_elems=HEAD_DIM, row_bytes=HEAD_DIM,
            latent_dtype=torch.float8_e4m3fn, rope_dtype=torch.float8_e4m3fn,
            latent_offset=0, rope_offset=LATENT_DIM,
            scale="per_tensor", scale_offset=None, scale_group=None, row_align=1)
    size = torch.tensor([], dtype=model_dtype).element_size()
    return KVRowFormat(
        name="bfloat16" if model_dtype == torch.bfloat16 else "float16", code=FMT_16BIT,
        storage_dtype=model_dtype, row_elems=HEAD_DIM, row_bytes=HEAD_DIM * size,
        latent_dtype=model_dtype, rope_dtype=model_dtype,
        latent_offset=0, rope_offset=LATENT_DIM * size,
        scale="none", scale_offset=None, scale_group=None, row_align=size)


_CACHE: dict = {}


def resolve_kv_format(kv_format: str, model_dtype: torch.dtype | None = None) -> KVRowFormat:
    """The row layout of a vLLM ``kv_cache_dtype`` name (see the module table).

    ``model_dtype`` (bf16 or fp16: the model's / query's dtype) resolves ``auto`` and is the dtype
    of ``fp8_ds_mla``'s rope words (bf16 when not given). Raises ``ValueError`` on an unknown name,
    on ``auto`` without a model dtype and on a model dtype that is not 16-bit.
    """
    key = (kv_format, model_dtype)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    code = KV_FORMAT_ALIASES.get(kv_format) if isinstance(kv_format, str) else None
    if code is None:
        raise ValueError(f"unknown MLA kv_format {kv_format!r}; expected one of {sorted(KV_FORMAT_ALIASES)}")
    if model_dtype is not None and model_dtype not in _16BIT_DTYPES:
        raise ValueError(f"model dtype must be bfloat16 or float16, got {model_dtype}")
    if code == FMT_16BIT:
        dt = _16BIT_NAMES.get(kv_format, model_dtype)
        if dt is None:
            raise ValueError("kv_format 'auto' needs the model dtype (the query's dtype)")
    else:
        dt = model_dtype if model_dtype is not None else torch.bfloat16
    fmt = _make(code, dt)
    _CACHE[key] = fmt
    return fmt


def kv_cache_row_elems(kv_cache_dtype: str) -> int:
    """Last dimension of the cache tensor for ``kv_cache_dtype`` (656 for fp8_ds_mla, else 576);
    independent of the model dtype (what ``get_kv_cache_shape`` needs)."""
    return resolve_kv_format(kv_cache_dtype, torch.bfloat16).row_elems


def kv_cache_row_bytes(kv_cache_dtype: str, model_dtype: torch.dtype | None = None) -> int:
    """Bytes per token: 656 (fp8_ds_mla), 576 (fp8), 1152 (16-bit)."""
    return resolve_kv_format(kv_cache_dtype, model_dtype).row_bytes


def check_kv_cache(kv_cache: torch.Tensor, fmt: KVRowFormat, model_dtype: torch.dtype | None = None,
                   kv_format: str | None = None) -> torch.Tensor:
    """Validate a cache tensor against ``fmt`` and return its 3-D view in ``fmt.storage_dtype``.

    Accepts ``[num_blocks, block_size, W]`` or ``[num_blocks, block_size, 1, W]``; the last
    dimension must be contiguous (block and token strides are free). 16-bit caches must have
    ``fmt.storage_dtype`` and, when ``model_dtype`` is given (the readers: their MMAs take q's
    dtype), the model dtype too; fp8 caches may be uint8, int8 or float8_e4m3fn (viewed as uint8). fp8_ds_mla rows
    must start at 16-byte multiples (their scales are read as fp32).
    """
    name = kv_format if kv_format is not None else fmt.name
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise ValueError(f"kv_cache with 4 dims must be [num_blocks, block_size, 1, W], got {tuple(kv_cache.shape)}")
        kv_cache = kv_cache.squeeze(2)
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, W], got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    if fmt.code == FMT_16BIT:
        if kv_cache.dtype != fmt.storage_dtype:
            raise ValueError(f"kv_format {name!r} needs a {fmt.storage_dtype} cache, got {kv_cache.dtype}")
        if model_dtype is not None and kv_cache.dtype != model_dtype:
            raise ValueError(f"16-bit kv_cache dtype {kv_cache.dtype} must match q dtype {model_dtype}")
    else:
        if kv_cache.dtype not in _ONE_BYTE_DTYPES:
            raise ValueError(f"kv_format {name!r} needs a 1-byte cache (uint8 or float8_e4m3fn), got {kv_cache.dtype}")
        kv_cache = kv_cache.view(torch.uint8)
    if kv_cache.shape[2] != fmt.row_elems:
        raise ValueError(f"kv_format {name!r} needs rows of {fmt.row_elems} elements, got {kv_cache.shape[2]}")
    a = fmt.row_align
    if a > 1 and (kv_cache.stride(1) % a or kv_cache.stride(0) % a or kv_cache.data_ptr() % a):
        raise ValueError(f"{fmt.name} cache rows must be {a}-byte aligned (scales are read as fp32)")
    return kv_cache


def dequantize_rows(rows: torch.Tensor, fmt: KVRowFormat, k_scale: torch.Tensor | float | None = None,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dequantize cache rows ``[..., row_elems]`` (storage dtype, e.g. gathered from a cache) to
    ``[..., 576]`` of ``dtype`` (float32 / float64: exact values), reading the layout from ``fmt``:
    fp8_ds_mla latent e4m3 x its group's in-row fp32 scale, rope as ``fmt.rope_dtype``; fp8 every
    value e4m3 x ``k_scale`` (default 1.0); 16-bit values as they are. For references and tests."""
    if fmt.code == FMT_16BIT:
        return rows.to(dtype)
    b = rows.contiguous().view(torch.uint8)
    if fmt.code == FMT_FP8:
        ks = 1.0 if k_scale is None else (float(k_scale.item()) if isinstance(k_scale, torch.Tensor) else float(k_scale))
        return b.view(torch.float8_e4m3fn).to(dtype) * ks
    lat = b[..., fmt.latent_offset:fmt.latent_offset + LATENT_DIM].view(fmt.latent_dtype).to(dtype)
    ng = LATENT_DIM // fmt.scale_group
    sc = b[..., fmt.scale_offset:fmt.scale_offset + 4 * ng].view(torch.float32).to(dtype)
    lat = (lat.unflatten(-1, (ng, fmt.scale_group)) * sc.unsqueeze(-1)).flatten(-2)
    rope_bytes = ROPE_DIM * torch.tensor([], dtype=fmt.rope_dtype).element_size()
    rope = b[..., fmt.rope_offset:fmt.rope_offset + rope_bytes].view(fmt.rope_dtype).to(dtype)
    return torch.cat([lat, rope], dim=-1)

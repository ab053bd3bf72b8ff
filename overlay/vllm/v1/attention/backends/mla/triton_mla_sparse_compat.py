# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the vLLM releases TRITON_MLA_SPARSE serves differ, in one place.

The backend (``triton_mla_sparse.py``) is written once; what depends on the
release's shared sparse-MLA base classes is one field of ``SparseMLAApi``, and
each API generation is one entry of ``GENERATIONS``:

  ====================  =========================  =========================  =========================
  difference            0.26.0                     0.33.0                     0.34.0
                        "impl-converts-topk"       "base-converts-topk"       "base-converts-topk-shardq"
  ====================  =========================  =========================  =========================
  top-k -> cache rows   the impl's ``forward_mqa`` ``SparseMLACommonImpl.     as 0.33.0; the base reads
                        converts the indexer's     forward_mqa`` converts it  the top-k from row
                        request-local top-k        (DCP, HiSparse) into rows  ``metadata.topk_start``
                        (``ImplConvertsTopk``)     of a flat row view and     (ShardQ) before it calls
                                                   calls the impl's           our step
                                                   ``_forward_mqa_kernel``    (``BaseConvertsTopk``)
                                                   (``BaseConvertsTopk``)
  metadata class        a dataclass of our own     ``SparseMLACommonMetadata``  as 0.33.0 (+ ``shardq``,
                                                                              ``topk_start``)
  fp8_ds_mla scales     amax / 448                 powers of two              powers of two
                        (``arbitrary_fp32``)       (``pow2_fp32``)            (``pow2_fp32``)
  KV cache spec hook    none (never called)        ``customize_spec``:        as 0.33.0
                                                   blocks a whole number of
                                                   flat rows apart
  ShardQ (token-        none                       none                       opt-in per impl
  sharded TP prefill)                                                         (``supports_shardq``);
                                                                              we stay out
  fp8_ds_mla row width  656 assumed                656 assumed                asked from the impl
                                                                              (``get_fp8_ds_mla_
                                                                              row_bytes``)
  ====================  =========================  =========================  =========================

(The scale facts were read from the release wheels' cache writers: 0.34.0's
sm_90 ``concat_and_cache_ds_mla_kernel`` computes the same power-of-two scale
as 0.33.0's and only gains a flag for the rope words; the other rows from
their Python sources.) What the DSA indexer needs to know of each release (its
cache's scale format, the vendored DeepGEMM's JIT) lives with the indexer, in
``vllm/v1/attention/ops/sparse_indexer_backend.py``. 0.33.0 and later also pass
``skip_scale`` to ``do_kv_cache_update``; the backend's signature takes it with
a default, so that needs no entry. The impl answers ``get_fp8_ds_mla_row_bytes`` with its
kernels' row size on every release (only 0.34.0 asks).

Adding a pin: if its base classes match an existing entry (the entry's
``marker`` holds on it and every field still describes it), add its version to
that entry's ``pins``; otherwise add an entry, with a top-k mixin of its own if
its forward path differs. ``tests/integration/test_pin_compat.py`` checks under
each pin's installed vLLM that the pin is listed in exactly the entry whose
marker holds, and that the backend took each field from that entry.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from vllm.model_executor.layers.attention import sparse_mla_attention
from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata
from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl
from vllm.v1.attention.backend import AttentionLayer, AttentionMetadata, MLAAttentionImpl

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import AttentionSpec


# ---------------------------------------------------------------------------------------------
# top-k -> cache rows: one mixin per generation, placed before SparseMLACommonImpl in the impl's
# bases; both end in the impl's _run_kernel(q, kv_cache, indices, layer).
# ---------------------------------------------------------------------------------------------


class ImplConvertsTopk:
    """0.26.0: the impl converts the indexer's request-local positions itself."""

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from vllm.v1.attention.backends.mla.sparse_utils import (
            triton_convert_req_index_to_global_index,
            triton_filter_and_convert_dcp_index,
        )

        num_tokens = q[0].shape[0] if isinstance(q, tuple) else q.shape[0]
        assert self.topk_indices_buffer is not None
        topk_indices = self.topk_indices_buffer[:num_tokens]
        req_id = attn_metadata.req_id_per_token[:num_tokens]
        if self.dcp_world_size > 1:
            indices, _ = triton_filter_and_convert_dcp_index(
                req_id,
                attn_metadata.block_table,
                topk_indices,
                dcp_size=self.dcp_world_size,
                dcp_rank=self.dcp_rank,
                cp_kv_cache_interleave_size=attn_metadata.cp_kv_cache_interleave_size,
                BLOCK_SIZE=attn_metadata.block_size,
                NUM_TOPK_TOKENS=topk_indices.shape[1],
                return_valid_counts=True,
            )
        else:
            indices = triton_convert_req_index_to_global_index(
                req_id,
                attn_metadata.block_table,
                topk_indices,
                BLOCK_SIZE=attn_metadata.block_size,
                NUM_TOPK_TOKENS=topk_indices.shape[1],
            )
        # the layer's only attention call: MLA's forward consumes its output (DCP's LSE
        # correction, the v up-projection) before it returns, so the output can be the
        # stream's reused buffer
        return self._run_kernel(q, kv_c_and_k_pe_cache, indices, layer, reuse_out=True)


class BaseConvertsTopk:
    """0.33.0+: SparseMLACommonImpl.forward_mqa converts the top-k (incl. DCP and
    HiSparse; from row ``topk_start`` of the buffer on 0.34.0) into rows of
    flat_kv_row_view(kv_cache) and calls this."""

    def _forward_mqa_kernel(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        valid_counts: torch.Tensor,
        *,
        layer: AttentionLayer,
        block_size: int,
        is_decode: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

        rows, _ = flat_kv_row_view(kv_cache, block_size)
        # [num_rows, 1, W]: one row per "block", so slot == row index. A new output per call:
        # 0.34.0's HiSparse path calls this twice per layer (decode rows, then prefill rows)
        # and concatenates the two outputs, so a reused buffer would be overwritten.
        return self._run_kernel(q, rows.unsqueeze(1), topk_indices, layer)


# ---------------------------------------------------------------------------------------------
# metadata class: made once, for the generation in use (the base class of one does not exist
# in the other's tree)
# ---------------------------------------------------------------------------------------------


def _own_metadata() -> type:
    """0.26.0: the shared base has no sparse metadata class; this carries what the
    builder fills and forward_mqa reads."""

    @dataclass
    class TritonMLASparseMetadata(AttentionMetadata):
        num_reqs: int
        max_query_len: int
        max_seq_len: int
        num_actual_tokens: int

        query_start_loc: torch.Tensor
        slot_mapping: torch.Tensor
        block_table: torch.Tensor
        # Request index of every query token: turns the indexer's request-local
        # top-k positions into physical cache slots.
        req_id_per_token: torch.Tensor

        seq_lens: torch.Tensor
        num_decodes: int
        num_prefills: int
        num_decode_tokens: int
        prefill_max_seq_len: int = 0
        prefill: MLACommonPrefillMetadata | None = None

        block_size: int = 64
        topk_tokens: int = 2048
        cp_kv_cache_interleave_size: int = 1

    TritonMLASparseMetadata.__qualname__ = "TritonMLASparseMetadata"
    return TritonMLASparseMetadata


def _common_metadata() -> type:
    """0.33.0+: the shared sparse-MLA metadata carries everything the kernel needs
    (0.34.0 adds ``shardq`` and ``topk_start``, read by the base's forward_mqa)."""
    base = sparse_mla_attention.SparseMLACommonMetadata

    class TritonMLASparseMetadata(base):  # type: ignore[misc,valid-type]
        pass

    TritonMLASparseMetadata.__qualname__ = "TritonMLASparseMetadata"
    return TritonMLASparseMetadata


# ---------------------------------------------------------------------------------------------
# the remaining differences, one function each
# ---------------------------------------------------------------------------------------------


def _spec_unchanged(spec: "AttentionSpec") -> "AttentionSpec":
    return spec


def _spec_blocks_whole_rows_apart(spec: "AttentionSpec") -> "AttentionSpec":
    # The base class reads the cache as flat rows, so blocks must be a whole number
    # of rows apart.
    from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows

    return align_blocks_to_rows(spec)


def _base_converts_any() -> bool:
    return hasattr(SparseMLACommonImpl, "_forward_mqa_kernel") and hasattr(
        sparse_mla_attention, "SparseMLACommonMetadata"
    )


def _has_shardq_and_row_hook() -> bool:
    """0.34.0: ShardQ (``supports_shardq``, ``topk_start``) and the impl's
    fp8_ds_mla row-width hook, all three."""
    metadata = getattr(sparse_mla_attention, "SparseMLACommonMetadata", None)
    fields = getattr(metadata, "__dataclass_fields__", {})
    return (
        hasattr(SparseMLACommonImpl, "supports_shardq")
        and "topk_start" in fields
        and hasattr(MLAAttentionImpl, "get_fp8_ds_mla_row_bytes")
    )


def _base_converts_topk() -> bool:
    return _base_converts_any() and not _has_shardq_and_row_hook()


def _base_converts_topk_shardq() -> bool:
    return _base_converts_any() and _has_shardq_and_row_hook()


def _impl_converts_topk() -> bool:
    return not hasattr(SparseMLACommonImpl, "_forward_mqa_kernel") and not hasattr(
        sparse_mla_attention, "SparseMLACommonMetadata"
    )


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseMLAApi:
    name: str
    # pins.lock versions of this generation (tests/integration/test_pin_compat.py)
    pins: tuple[str, ...]
    # true exactly on trees of this generation
    marker: Callable[[], bool]
    # placed first among TritonMLASparseImpl's bases
    topk_mixin: type
    # makes TritonMLASparseMetadata
    make_metadata_cls: Callable[[], type]
    # how this release's own writers store fp8_ds_mla tile scales (our writer matches it)
    ds_scale_format: str
    # TritonMLASparseBackend.customize_spec
    customize_kv_spec: Callable[["AttentionSpec"], "AttentionSpec"]
    # TritonMLASparseImpl.supports_shardq: whether the base may shard this backend's prefill
    # by token across TP ranks (ShardQ, 0.34.0). Our kernel would take ShardQ's narrowed
    # metadata like any other (the base applies topk_start), but it has not run under TP > 1
    # ShardQ; until it has, prefill stays head-sharded (the base's default, False).
    supports_shardq: bool
    # whether the release asks the impl for the fp8_ds_mla row width
    # (MLAAttentionImpl.get_fp8_ds_mla_row_bytes, 0.34.0) instead of assuming 656 bytes
    fp8_ds_mla_row_bytes_from_impl: bool


_IMPL_CONVERTS_TOPK = SparseMLAApi(
    name="impl-converts-topk",
    pins=("0.26.0",),
    marker=_impl_converts_topk,
    topk_mixin=ImplConvertsTopk,
    make_metadata_cls=_own_metadata,
    ds_scale_format="arbitrary_fp32",
    customize_kv_spec=_spec_unchanged,
    supports_shardq=False,
    fp8_ds_mla_row_bytes_from_impl=False,
)
_BASE_CONVERTS_TOPK = SparseMLAApi(
    name="base-converts-topk",
    pins=("0.33.0",),
    marker=_base_converts_topk,
    topk_mixin=BaseConvertsTopk,
    make_metadata_cls=_common_metadata,
    ds_scale_format="pow2_fp32",
    customize_kv_spec=_spec_blocks_whole_rows_apart,
    supports_shardq=False,
    fp8_ds_mla_row_bytes_from_impl=False,
)
# 0.34.0: 0.33.0's base plus ShardQ and the row-width hook (the table above); everything else
# as 0.33.0.
_BASE_CONVERTS_TOPK_SHARDQ = replace(
    _BASE_CONVERTS_TOPK,
    name="base-converts-topk-shardq",
    pins=("0.34.0",),
    marker=_base_converts_topk_shardq,
    fp8_ds_mla_row_bytes_from_impl=True,
)

GENERATIONS: tuple[SparseMLAApi, ...] = (
    _IMPL_CONVERTS_TOPK,
    _BASE_CONVERTS_TOPK,
    _BASE_CONVERTS_TOPK_SHARDQ,
)


def vllm_release() -> str:
    """The installed vLLM's release (``0.26.0`` for ``0.26.0+glm5.<hash>``)."""
    from vllm import version

    m = re.match(r"\d+\.\d+\.\d+", version.__version__)
    return m.group(0) if m else version.__version__


def select(generations: tuple[SparseMLAApi, ...] = GENERATIONS) -> SparseMLAApi:
    """The entry whose marker holds on this tree; exactly one must, and a release
    listed in another entry's ``pins`` is an error in the table."""
    matching = [g for g in generations if g.marker()]
    release = vllm_release()
    if len(matching) != 1:
        raise RuntimeError(
            f"TRITON_MLA_SPARSE: vLLM {release}'s sparse-MLA base classes match "
            f"{len(matching)} entries of triton_mla_sparse_compat.GENERATIONS "
            f"({', '.join(g.name for g in matching) or 'none'}); add or fix the entry "
            "for this release there"
        )
    (api,) = matching
    listed = [g.name for g in generations if release in g.pins]
    if listed and listed != [api.name]:
        raise RuntimeError(
            f"TRITON_MLA_SPARSE: vLLM {release} is listed under {listed} in "
            f"triton_mla_sparse_compat.GENERATIONS but its tree matches {api.name!r}"
        )
    return api


API = select()

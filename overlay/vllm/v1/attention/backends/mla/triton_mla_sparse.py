# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TRITON_MLA_SPARSE: sparse (DSA top-k) MLA attention in pure Triton.

Serves DeepSeek-V3.2-style sparse MLA models (GLM-5 / GLM-5.1 / GLM-5.2, model
type ``glm_moe_dsa``) on every GPU Triton supports, SM120/SM121 (RTX PRO 6000,
RTX 5090, DGX Spark) first. Nothing on its path is JIT-compiled CUDA: the
attention kernel reads the paged KV cache natively in all three formats

  =============  ============  ============================================
  kv_cache_dtype  bytes/token   layout of one token
  =============  ============  ============================================
  auto/bfloat16  1152          576 x model dtype
  fp8/fp8_e4m3   576           576 x e4m3 (value / k_scale, per layer)
  fp8_ds_mla     656           512 x e4m3, 4 x fp32 scales, 64 x bf16 rope
  =============  ============  ============================================

(no cast of the pool, no gathered bf16 copy), and the cache writes are Triton
kernels too. When this backend serves a model, the DSA indexer's
``kernel_config.sparse_indexer_backend="auto"`` resolves to its Triton kernels
too (``vllm/v1/attention/ops/sparse_indexer_backend.py``).

Prefill and decode both run the sparse top-k kernel, one query row per token:
the impl has no dense-MHA prefill, so it sets ``supports_dense_mha_prefill =
False`` and the MLA layer routes every token to ``forward_mqa``.

Kernels: ``vllm/v1/attention/ops/triton_sparse_mla_v2.py`` (attention for
fp8_ds_mla with <= 16 heads per GPU, TP8 / TP4: a Gluon kernel that stages each
KV tile once), ``vllm/v1/attention/ops/triton_sparse_mla.py`` (attention in
every other case) and ``vllm/v1/attention/ops/triton_mla_kv_cache.py`` (cache
writes).
"""

from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    MultipleOf,
)
from vllm.v1.attention.backends.mla import triton_mla_sparse_compat as compat
from vllm.v1.attention.ops import mla_kv_format

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec

logger = init_logger(__name__)

BACKEND_NAME = "TRITON_MLA_SPARSE"

# What differs between the vLLM pins (top-k path, metadata class, fp8_ds_mla scale
# format, KV spec hook, indexer scale format, DeepGEMM's JIT, ShardQ) is one entry per API
# generation in triton_mla_sparse_compat.py; API is the entry for this tree.
API = compat.API
_DS_SCALE_FORMAT = API.ds_scale_format

# Latent (kv_lora_rank) and rope widths of DeepSeek-V3.2-style MLA; GLM-5 uses
# the same 512 + 64 whatever its qk_nope_head_dim (192): the absorbed decode
# only ever sees 576-wide keys and 512-wide values.
# Row layouts, aliases and sizes of the three cache formats: ops/mla_kv_format.py.
MLA_LATENT_DIM = mla_kv_format.LATENT_DIM
MLA_ROPE_DIM = mla_kv_format.ROPE_DIM
MLA_HEAD_SIZE = mla_kv_format.HEAD_DIM
FP8_DS_MLA_BYTES_PER_TOKEN = mla_kv_format.kv_cache_row_bytes("fp8_ds_mla")

_FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_ds_mla")


def kv_format_of(kv_cache_dtype: str) -> str:
    """Check vLLM's kv_cache_dtype string against the kernels' formats and return
    the name the kernels take (the string itself; they accept vLLM's names)."""
    if kv_cache_dtype not in mla_kv_format.KV_FORMAT_ALIASES:
        raise ValueError(
            f"{BACKEND_NAME} does not support kv_cache_dtype={kv_cache_dtype!r}; "
            "use auto/bfloat16, fp8/fp8_e4m3 or fp8_ds_mla."
        )
    return kv_cache_dtype


class TritonMLASparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "bfloat16",
        "float16",
        "fp8",
        "fp8_e4m3",
        "fp8_ds_mla",
    ]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # The kernels address a token through the cache's block and token strides,
        # so any page size works; 64 is what the DSA indexer cache (same scheduler
        # block) requires on CUDA.
        return [64]

    @classmethod
    def customize_spec(cls, spec):
        # (0.33.0+ call this hook; 0.26.0 has none)
        return API.customize_kv_spec(spec)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type["TritonMLASparseMetadataBuilder"]:
        return TritonMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["TritonMLASparseImpl"]:
        return TritonMLASparseImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [MLA_HEAD_SIZE]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # Ampere and newer; FP8 KV formats additionally need 8.9 (checked in
        # supports_combination, which sees the kv_cache_dtype).
        return capability >= DeviceCapability(8, 0)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        if kv_cache_dtype in _FP8_KV_CACHE_DTYPES and device_capability < (
            DeviceCapability(8, 9)
        ):
            return (
                f"{BACKEND_NAME} needs compute capability 8.9+ for FP8 KV cache "
                f"({kv_cache_dtype}); got {device_capability}"
            )
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
        if model_config is not None:
            hf_text_config = model_config.hf_text_config
            if getattr(hf_text_config, "index_topk", None) is None:
                return f"{BACKEND_NAME} requires a sparse (DSA) model with index_topk"
            kv_lora_rank = getattr(hf_text_config, "kv_lora_rank", MLA_LATENT_DIM)
            rope_dim = getattr(hf_text_config, "qk_rope_head_dim", MLA_ROPE_DIM)
            if (kv_lora_rank, rope_dim) != (MLA_LATENT_DIM, MLA_ROPE_DIM):
                return (
                    f"{BACKEND_NAME} requires kv_lora_rank 512 and qk_rope_head_dim "
                    f"64; got {kv_lora_rank} and {rope_dim}"
                )
        return None

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,  # always 1 for MLA
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if cache_dtype_str == "fp8_ds_mla":
            return (num_blocks, block_size, mla_kv_format.kv_cache_row_elems(cache_dtype_str))
        return (num_blocks, block_size, head_size)


TritonMLASparseMetadata = API.make_metadata_cls()


class TritonMLASparseMetadataBuilder(
    SparseMLACommonMetadataBuilder[TritonMLASparseMetadata]
):
    metadata_cls = TritonMLASparseMetadata
    # Uniform decode batches (plain decode and MTP verification) replay as CUDA
    # graphs: the kernels take every size from tensor shapes, never from data.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: "AttentionSpec",
        layer_names: list[str],
        vllm_config: "VllmConfig",
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Prefill and decode run the same kernel, so the decode/prefill split
        # only decides which batches are graph-captured: requests with up to
        # 1 + num_speculative_tokens new tokens count as decodes (MTP).
        self._init_reorder_batch_threshold(
            1, supports_spec_as_decode=True, supports_dcp_with_varlen=True
        )


class TritonMLASparseImpl(
    API.topk_mixin, SparseMLACommonImpl[TritonMLASparseMetadata]
):
    # The top-k -> cache rows step (forward_mqa on 0.26.0, _forward_mqa_kernel on
    # 0.33.0+) comes from API.topk_mixin; both end in _run_kernel.
    #
    # Every token, prefill included, goes through the sparse top-k kernel.
    supports_dense_mha_prefill = False
    # The kernel returns the natural-log LSE that decode context parallelism
    # merges across ranks.
    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True
    # ShardQ, token-sharded TP prefill (0.34.0): see compat.SparseMLAApi.supports_shardq.
    supports_shardq: ClassVar[bool] = API.supports_shardq

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: object | None = None,
        **mla_args,
    ) -> None:
        if any((alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError(
                f"{BACKEND_NAME} does not support alibi_slopes, sliding_window "
                "or logits_soft_cap"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"{BACKEND_NAME} supports decoder self-attention only, got {attn_type}"
            )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            indexer=indexer,
            topk_indices_buffer=topk_indices_buffer,
            **mla_args,
        )
        if self.kv_lora_rank != MLA_LATENT_DIM or self.qk_rope_head_dim != MLA_ROPE_DIM:
            raise NotImplementedError(
                f"{BACKEND_NAME} supports kv_lora_rank 512 + qk_rope_head_dim 64, got "
                f"{self.kv_lora_rank} + {self.qk_rope_head_dim}"
            )
        self.kv_format = kv_format_of(kv_cache_dtype)
        # fp8/fp8_e4m3: one per-tensor k_scale per layer, outside the rows.
        self._per_tensor_k_scale = (
            mla_kv_format.KV_FORMAT_ALIASES[self.kv_format] == mla_kv_format.FMT_FP8
        )
        # The kernel reads a bf16/fp16 query; it dequantizes the cache itself.
        self.supports_quant_query_input = False

    def get_fp8_ds_mla_row_bytes(self) -> int:
        # The width of one fp8_ds_mla token row in our kernels' layout (656 B), for
        # the KV cache spec and the index group (0.34.0 asks; earlier releases
        # assume 656).
        return FP8_DS_MLA_BYTES_PER_TOKEN

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        if kv_cache.numel() == 0:
            return
        from vllm.v1.attention.ops.triton_mla_kv_cache import mla_kv_cache_write

        mla_kv_cache_write(
            kv_c_normed,
            k_pe.reshape(k_pe.shape[0], -1),
            kv_cache,
            slot_mapping.flatten(),
            kv_format_of(kv_cache_dtype),
            # (0.33.0) skip_scale: store fp8 values unscaled (k_scale is 1.0 then)
            k_scale=None if skip_scale else k_scale,
            ds_scale_format=_DS_SCALE_FORMAT,
        )

    def _run_kernel(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        layer: AttentionLayer,
        reuse_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # v2 (Gluon: one staging of each KV tile, cp.async ring) for fp8_ds_mla with <= 16
        # heads (TP8 / TP4) on SM8x/SM9x/SM12x, and for the bf16 and fp8 caches on SM90 from 4
        # query rows (ROWS16 / ROWS8); every other call goes to v1 inside it.
        from vllm.v1.attention.ops.triton_sparse_mla_v2 import sparse_mla_decode_v2

        if isinstance(q, tuple):
            # (W_UK-absorbed latent query [T, H, 512], rope query [T, H, 64]);
            # T * H * 1152 bytes, small next to the KV the kernel streams.
            q = torch.cat(q, dim=-1)
        # the LSE only where vLLM uses it (decode context parallelism): otherwise the kernel
        # writes it to a per-stream sink and no tensor is allocated for it. reuse_out: the
        # output is a view of a per-stream buffer, valid until the next such call on the stream
        # (the caller says when its output is consumed before that: see compat).
        return sparse_mla_decode_v2(
            q,
            kv_cache,
            indices,
            self.scale,
            self.kv_format,
            k_scale=layer._k_scale if self._per_tensor_k_scale else None,
            return_lse=bool(self.need_to_return_lse_for_decode),
            reuse_out=reuse_out,
        )

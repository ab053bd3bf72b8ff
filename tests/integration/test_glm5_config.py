"""vLLM's config handling of the full GLM-5 config yields the shapes TRITON_MLA_SPARSE expects."""

from __future__ import annotations

import pytest
import torch


def test_glm5_is_a_sparse_mla_model(glm5_model_config):
    mc = glm5_model_config
    assert mc.hf_text_config.model_type == "glm_moe_dsa"
    assert mc.use_mla
    # Absorbed MLA sees 512 latent + 64 rope whatever qk_nope_head_dim is.
    assert mc.get_head_size() == 576
    hf = mc.hf_text_config
    assert (hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim) == (192, 64, 256)
    assert (hf.kv_lora_rank, hf.q_lora_rank) == (512, 2048)
    assert (hf.index_n_heads, hf.index_head_dim, hf.index_topk) == (32, 128, 2048)
    assert hf.indexer_rope_interleave is True and hf.rope_interleave is True


def test_mla_dims_match_backend(glm5_model_config):
    from vllm.model_executor.layers.attention.mla_attention import get_mla_dims
    from vllm.v1.attention.backends.mla import triton_mla_sparse as b

    dims = get_mla_dims(glm5_model_config)
    assert dims.kv_lora_rank == b.MLA_LATENT_DIM
    assert dims.qk_rope_head_dim == b.MLA_ROPE_DIM
    assert dims.qk_nope_head_dim == 192
    assert dims.v_head_dim == 256
    assert b.TritonMLASparseBackend.supports_head_size(glm5_model_config.get_head_size())


@pytest.mark.parametrize("tp,heads", [(1, 64), (2, 32), (4, 16), (8, 8)])
def test_heads_per_rank(glm5_model_config, tp, heads):
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(tensor_parallel_size=tp)
    assert glm5_model_config.get_num_attention_heads(parallel) == heads


def test_glm5_architecture_resolves(glm5_model_config):
    from vllm.model_executor.models.registry import ModelRegistry

    model_cls, arch = ModelRegistry.resolve_model_cls(
        glm5_model_config.architectures, glm5_model_config
    )
    assert arch == "GlmMoeDsaForCausalLM"


def test_glm5_router_runs_in_fp32(glm5_model_config):
    from vllm.model_executor.models import deepseek_v2

    getter = getattr(deepseek_v2, "_get_moe_router_dtype", None)
    if getter is None:
        pytest.skip("this pin has no _get_moe_router_dtype")
    assert getter(glm5_model_config.hf_text_config) == torch.float32


def test_indexer_cache_is_132_bytes_per_token(glm5_model_config):
    """128 e4m3 values + one fp32 scale per 128-value block, as the Triton indexer writes."""
    head_dim = glm5_model_config.hf_text_config.index_head_dim
    quant_block = 128
    assert head_dim + head_dim // quant_block * 4 == 132


def test_repository_copy_matches_the_shared_config():
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    GLM5_CONFIG = repo / "tests" / "data" / "glm-5-config.json"
    SHARED_GLM5_CONFIG = repo.parent / "shared" / "models" / "glm-5" / "config.json"
    if not SHARED_GLM5_CONFIG.exists():
        pytest.skip("no ../shared next to this checkout (CI's clean clone)")
    assert json.loads(GLM5_CONFIG.read_text()) == json.loads(SHARED_GLM5_CONFIG.read_text())

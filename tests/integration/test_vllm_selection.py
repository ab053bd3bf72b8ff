"""vLLM's own selector picks TRITON_MLA_SPARSE for GLM-5 where it should, and honours the flags.

Runs on a CPU-only machine against the installed patched vLLM; the CUDA platform and its
device capability are simulated (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

BACKEND = "TRITON_MLA_SPARSE"
MLA_HEAD_SIZE = 576


def _select(model_config, kv_cache_dtype, backend=None, num_heads=8):
    from vllm.config import AttentionConfig, CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(cache_dtype=kv_cache_dtype),
        attention_config=AttentionConfig(backend=backend),
    )
    with set_current_vllm_config(vllm_config):
        chosen = get_attn_backend(
            MLA_HEAD_SIZE,
            torch.bfloat16,
            kv_cache_dtype,
            use_mla=True,
            use_sparse=True,
            num_heads=num_heads,
        )
    return chosen, vllm_config


def _flashinfer_sm120(monkeypatch, available: bool):
    import vllm.utils.flashinfer as fi

    monkeypatch.setattr(fi, "has_flashinfer_sparse_mla_sm120", lambda: available)


def test_backend_is_registered(vllm_module):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend_cls = AttentionBackendEnum[BACKEND].get_class()
    assert backend_cls.get_name() == BACKEND
    assert backend_cls.is_mla() and backend_cls.is_sparse()
    assert backend_cls.__module__ == "vllm.v1.attention.backends.mla.triton_mla_sparse"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"])
def test_sm120_picks_triton_when_flashinfer_sparse_is_missing(
    simulated_cuda, monkeypatch, glm5_model_config, kv_cache_dtype
):
    _flashinfer_sm120(monkeypatch, available=False)
    for major, minor in [(12, 0), (12, 1)]:
        simulated_cuda(major, minor)
        chosen, _ = _select(glm5_model_config, kv_cache_dtype)
        assert chosen.get_name() == BACKEND, (major, minor)


def test_sm120_keeps_flashinfer_first_when_it_can_serve(
    simulated_cuda, monkeypatch, glm5_model_config
):
    _flashinfer_sm120(monkeypatch, available=True)
    simulated_cuda(12, 0)
    chosen, _ = _select(glm5_model_config, "fp8_ds_mla")
    assert chosen.get_name() == "FLASHINFER_MLA_SPARSE_SM120"


def test_sm120_picks_triton_when_flashinfer_rejects_the_model(
    simulated_cuda, monkeypatch, glm5_model_config
):
    # FlashInfer's SM120 sparse kernel only serves index_topk == 2048.
    _flashinfer_sm120(monkeypatch, available=True)
    simulated_cuda(12, 0)
    hf = glm5_model_config.hf_text_config
    monkeypatch.setattr(hf, "index_topk", 1152)
    chosen, _ = _select(glm5_model_config, "fp8")
    assert chosen.get_name() == BACKEND


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
def test_flag_selects_triton_everywhere_supported(
    simulated_cuda, monkeypatch, glm5_model_config, capability, kv_cache_dtype
):
    _flashinfer_sm120(monkeypatch, available=True)
    simulated_cuda(*capability)
    chosen, _ = _select(glm5_model_config, kv_cache_dtype, backend=BACKEND)
    assert chosen.get_name() == BACKEND


@pytest.mark.parametrize("capability", [(8, 9), (9, 0)])
def test_opt_in_only_off_sm12x(simulated_cuda, monkeypatch, glm5_model_config, capability):
    # (SM100's own priority list probes the CUDA driver, so it is not simulated here.)
    simulated_cuda(*capability)
    try:
        chosen, _ = _select(glm5_model_config, "fp8_ds_mla")
    except ValueError as exc:  # no upstream sparse backend for this device
        assert "No valid attention backend" in str(exc)
        assert BACKEND not in str(exc)
    else:
        assert chosen.get_name() != BACKEND


def test_fp8_kv_needs_sm89(simulated_cuda, glm5_model_config):
    simulated_cuda(8, 0)
    with pytest.raises(ValueError, match="8.9"):
        _select(glm5_model_config, "fp8", backend=BACKEND)
    chosen, _ = _select(glm5_model_config, "auto", backend=BACKEND)
    assert chosen.get_name() == BACKEND


def test_dense_model_rejects_sparse_backend(simulated_cuda, glm5_model_config):
    from vllm.config import AttentionConfig, CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    simulated_cuda(12, 0)
    vllm_config = VllmConfig(
        model_config=glm5_model_config,
        cache_config=CacheConfig(cache_dtype="auto"),
        attention_config=AttentionConfig(backend=BACKEND),
    )
    with set_current_vllm_config(vllm_config), pytest.raises(ValueError, match="sparse"):
        get_attn_backend(
            MLA_HEAD_SIZE, torch.bfloat16, "auto", use_mla=True, use_sparse=False
        )


@pytest.mark.parametrize(
    "kv_cache_dtype,expected",
    [("fp8", "fp8"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_ds_mla", "fp8_ds_mla"), ("auto", "auto")],
)
def test_kv_cache_dtype_is_not_rewritten_for_triton(
    simulated_cuda, glm5_model_config, kv_cache_dtype, expected
):
    """vLLM rewrites fp8 to fp8_ds_mla for some sparse backends by name; not for ours."""
    from vllm.model_executor.layers.attention import mla_attention

    simulated_cuda(12, 0)
    chosen, _ = _select(glm5_model_config, kv_cache_dtype, backend=BACKEND)
    assert mla_attention._canonicalize_sparse_mla_kv_cache_dtype(chosen, kv_cache_dtype) == (
        expected
    )


@pytest.mark.parametrize(
    "kv_cache_dtype,last_dim", [("auto", 576), ("fp8", 576), ("fp8_ds_mla", 656)]
)
def test_kv_cache_shape_per_format(vllm_module, kv_cache_dtype, last_dim):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend_cls = AttentionBackendEnum[BACKEND].get_class()
    if not hasattr(backend_cls, "get_kv_cache_shape"):
        pytest.skip("this pin derives the MLA cache shape from the layer's spec")
    assert backend_cls.get_kv_cache_shape(10, 64, 1, MLA_HEAD_SIZE, kv_cache_dtype) == (
        10,
        64,
        last_dim,
    )


def test_triton_indexer_is_used_with_triton_backend(
    simulated_cuda, monkeypatch, glm5_model_config, require_triton_indexer
):
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    simulated_cuda(12, 0)
    from vllm.config import set_current_vllm_config

    _, vllm_config = _select(glm5_model_config, "fp8", backend=BACKEND)
    with set_current_vllm_config(vllm_config):  # as during model construction
        assert sib.resolve_sparse_indexer_backend(vllm_config) == "triton"


def test_deepgemm_indexer_kept_for_other_backends_when_available(
    simulated_cuda, monkeypatch, glm5_model_config, require_triton_indexer
):
    import vllm.utils.deep_gemm as deep_gemm
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    simulated_cuda(9, 0)
    monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: True)
    # DeepGEMM's JIT finds nvcc (test_dsa_indexer_choice.py has the cases without it)
    monkeypatch.setattr(
        sib,
        "deep_gemm_jit_toolchain",
        lambda: sib.JitToolchain(True, "nvcc 12.9 at /fake/bin/nvcc"),
    )
    from vllm.config import set_current_vllm_config

    _, vllm_config = _select(glm5_model_config, "fp8_ds_mla")
    with set_current_vllm_config(vllm_config):  # as during model construction
        assert sib.choose_sparse_indexer_backend(vllm_config)[0] == "deep_gemm"
        monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: False)
        assert sib.choose_sparse_indexer_backend(vllm_config)[0] == "triton"


def test_mx_scale_indexer_cache_keeps_deepgemm(
    simulated_cuda, monkeypatch, request, glm5_model_config, require_triton_indexer
):
    """On SM100, vLLM 0.33+ stores the indexer cache with MX scales (written by the model's
    fused K-cache kernel), which the Triton kernels do not read: the indexer stays on
    DeepGEMM there even with TRITON_MLA_SPARSE. 0.26.0 stores fp32 scales on every device."""
    import vllm.utils.deep_gemm as deep_gemm
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    import vllm.platforms as platforms

    simulated_cuda(10, 0)
    monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: True)
    # deep_gemm bound the platform of its import (CPU here): give it the simulated one, and
    # forget its cached answer before and after
    monkeypatch.setattr(deep_gemm, "current_platform", platforms._current_platform)
    mx = getattr(deep_gemm, "mqa_logits_use_mx_scales", None)
    if mx is not None:
        mx.cache_clear()
        request.addfinalizer(mx.cache_clear)
    from vllm.config import set_current_vllm_config

    mx_scales = mx() if mx is not None else False
    assert mx_scales == sib.indexer_cache_uses_mx_scales()
    _, vllm_config = _select(glm5_model_config, "fp8_ds_mla", backend=BACKEND)
    with set_current_vllm_config(vllm_config):
        backend = sib.resolve_sparse_indexer_backend(vllm_config)
        assert backend == ("deep_gemm" if mx_scales else "triton")

"""GLM-5 family on both pins: the fp32 MoE router and GLM-5.2's IndexCache, through vLLM's code.

Router: vLLM's `DeepseekV2MoE` is built for GLM-5's config (its FusedMoE, which would allocate
256 experts and pick a GPU kernel, is replaced by a recorder of its arguments) and its `GateLinear`
is compared with transformers' `GlmMoeDsaTopkRouter`, which computes the logits in fp32.

IndexCache: the attention layers of the class vLLM's registry uses for `GlmMoeDsaForCausalLM` on
CUDA (0.26.0: `deepseek_v2.DeepseekV2MLAAttention`; 0.33.0: `deepseek_v32.attention.
DeepseekV32Attention`) are built one by one at GLM-5's real dimensions (weights are torch.empty)
on a simulated SM120 with TRITON_MLA_SPARSE, each given the one top-k buffer the model hands all
of its layers; the tests read which layers got an indexer and where each layer's attention impl
reads its top-k from.

Model modules are imported on this machine's own platform before the CUDA platform is simulated
(on a CUDA platform their imports need the CUDA binaries), as conftest.py's fixtures do.
"""

from __future__ import annotations

import socket

import pytest
import torch

BACKEND = "TRITON_MLA_SPARSE"
NUM_LAYERS = 78  # GLM-5 / GLM-5.2 backbone; layer 78 is the MTP (nextn) layer
MTP_LAYER = NUM_LAYERS
# GLM-5.2: index_topk_freq 4, index_skip_topk_offset 3 -> layers 0-2 and every 4th from 6 run
# the indexer (21), the other 57 reuse the previous indexer layer's top-k.
GLM52_FIELDS = {"index_topk_freq": 4, "index_skip_topk_offset": 3}
GLM52_INDEXER_LAYERS = [0, 1, 2] + list(range(6, NUM_LAYERS, 4))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def single_rank(vllm_module):
    """One-rank (gloo) tensor/pipeline/expert-parallel groups, as a one-GPU worker has."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        ps.init_distributed_environment(
            world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo",
        )
        ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


@pytest.fixture(scope="module")
def model_modules(vllm_module):
    """The GLM-5 model modules, imported before any test simulates the CUDA platform."""
    from vllm.model_executor.models import deepseek_v2
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    mods = {"deepseek_v2": deepseek_v2, "registry": _TEXT_GENERATION_MODELS}
    if _TEXT_GENERATION_MODELS["GlmMoeDsaForCausalLM"][0] == "vllm.models.deepseek_v32":
        # 0.33.0 on CUDA: vllm/models/deepseek_v32/__init__.py picks nvidia.model's
        # DeepseekV32ForCausalLM, whose layers use deepseek_v32.attention.DeepseekV32Attention.
        from vllm.models.deepseek_v32 import attention as v32_attention
        from vllm.models.deepseek_v32.nvidia import model as v32_model  # noqa: F401
        from vllm.v1.attention.backends.mla import index_group

        mods.update(v32_attention=v32_attention, index_group=index_group)
    return mods


# --------------------------------------------------------------------------- fp32 router


class _FusedMoERecorder(torch.nn.Module):
    """Stands in for FusedMoE / FusedMoEFactory: records what DeepseekV2MoE passes it."""

    calls: list[dict] = []

    def __init__(self, **kwargs):
        super().__init__()
        type(self).calls.append(kwargs)
        self.is_internal_router = False


class _SharedExpertsStub(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()


def _build_moe(modules, monkeypatch, model_config, *, stub_shared_experts=False):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    dsv2 = modules["deepseek_v2"]
    fused_moe_name = "FusedMoEFactory" if hasattr(dsv2, "FusedMoEFactory") else "FusedMoE"
    monkeypatch.setattr(dsv2, fused_moe_name, _FusedMoERecorder)
    monkeypatch.setattr(_FusedMoERecorder, "calls", [])
    if stub_shared_experts:
        monkeypatch.setattr(dsv2, "DeepseekV2MLP", _SharedExpertsStub)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype):
        moe = dsv2.DeepseekV2MoE(
            config=model_config.hf_text_config,
            parallel_config=vllm_config.parallel_config,
            quant_config=None,
            prefix="model.layers.3.mlp",
        )
    (experts_kwargs,) = _FusedMoERecorder.calls
    return moe, experts_kwargs


def test_router_dtype_follows_model_type(glm5_model_config, model_modules):
    """fp32 router logits for glm_moe_dsa whatever `moe_router_dtype` says; other DeepSeek-style
    configs only with `moe_router_dtype: "float32"`."""
    from types import SimpleNamespace

    rule = model_modules["deepseek_v2"]._get_moe_router_dtype
    assert rule(glm5_model_config.hf_text_config) == torch.float32
    assert not hasattr(glm5_model_config.hf_text_config, "moe_router_dtype")
    assert rule(SimpleNamespace(model_type="deepseek_v3")) is None
    assert rule(SimpleNamespace(model_type="deepseek_v3", moe_router_dtype="float32")) == (
        torch.float32
    )


def test_glm5_moe_block_builds_an_fp32_router(
    glm5_model_config, model_modules, single_rank, monkeypatch
):
    """DeepseekV2MoE for GLM-5: a GateLinear with fp32 output, an fp32 correction bias, and the
    routing HF's GlmMoeDsaTopkRouter does (sigmoid, noaux_tc bias, top-8, renormalised, x2.5)."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    hf = glm5_model_config.hf_text_config
    moe, experts = _build_moe(model_modules, monkeypatch, glm5_model_config)
    gate = moe.gate
    assert isinstance(gate, GateLinear)
    assert (gate.input_size, gate.output_size) == (6144, 256)
    assert gate.out_dtype == torch.float32
    # The weight stays in the model dtype (as in transformers 5.17's router, which upcasts at
    # use); fp32 is the output / accumulation dtype, so the GEMM tier decides the precision.
    assert gate.weight.dtype == torch.bfloat16
    bias = gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and tuple(bias.shape) == (256,)

    assert experts["gate"] is gate
    assert experts["router_logits_dtype"] == torch.float32
    assert experts["e_score_correction_bias"] is bias
    assert experts["scoring_func"] == hf.scoring_func == "sigmoid"
    assert experts["use_grouped_topk"] is True
    assert (experts["num_expert_group"], experts["topk_group"]) == (hf.n_group, hf.topk_group)
    assert experts["top_k"] == hf.num_experts_per_tok == 8
    assert experts["renormalize"] is hf.norm_topk_prob is True
    assert experts["routed_scaling_factor"] == hf.routed_scaling_factor == 2.5


def _cpu_mm_out_dtype(monkeypatch):
    """aten::mm.dtype (cuBLAS bf16 x bf16 with fp32 accumulation and fp32 output) has no CPU
    kernel; stand in for it with exactly that arithmetic. Returns the list of its calls."""
    real_mm = torch.mm
    calls = []

    def mm(a, b, *args, out_dtype=None, **kwargs):
        if out_dtype is None:
            return real_mm(a, b, *args, **kwargs)
        assert out_dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real_mm(a.float(), b.float())

    monkeypatch.setattr(torch, "mm", mm)
    return calls


@pytest.mark.parametrize("capability", [(12, 0), (12, 1), (8, 9)])
def test_glm5_router_logits_match_hf_fp32_router(
    glm5_model_config, model_modules, single_rank, simulated_cuda, monkeypatch,
    capability,
):
    """On devices TRITON_MLA_SPARSE serves, GLM-5's router logits are HF's fp32 logits (not
    bf16 logits cast to fp32), so the same experts are picked with the same weights."""
    import vllm.platforms as platforms
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter
    from vllm.model_executor.layers.fused_moe.router import gate_linear
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    simulated_cuda(*capability)
    # gate_linear bound `current_platform` at its import, before the simulation.
    monkeypatch.setattr(gate_linear, "current_platform", platforms.current_platform)
    monkeypatch.setenv("VLLM_USE_FUSED_MOE_GROUPED_TOPK", "0")  # the torch grouped_topk
    cublas_calls = _cpu_mm_out_dtype(monkeypatch)

    hf = glm5_model_config.hf_text_config
    moe, experts = _build_moe(
        model_modules, monkeypatch, glm5_model_config, stub_shared_experts=True
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(256, 6144, generator=gen) * hf.initializer_range)
        moe.gate.e_score_correction_bias.copy_(torch.randn(256, generator=gen) * 1e-2)
    x = torch.randn(64, 6144, generator=gen).to(torch.bfloat16)

    hf_router = GlmMoeDsaTopkRouter(hf)
    with torch.no_grad():
        hf_router.weight.copy_(moe.gate.weight.float())
        hf_router.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias)
        ref_logits, ref_weights, ref_ids = hf_router(x)
        logits, _ = moe.gate(x)

    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert cublas_calls, "expected the bf16 x bf16 -> fp32 cuBLAS tier"

    weights, ids = grouped_topk(
        x, logits, experts["top_k"], experts["renormalize"],
        num_expert_group=experts["num_expert_group"], topk_group=experts["topk_group"],
        scoring_func=experts["scoring_func"],
        routed_scaling_factor=experts["routed_scaling_factor"],
        e_score_correction_bias=experts["e_score_correction_bias"],
    )
    ids, order = ids.long().sort(-1)
    ref_ids, ref_order = ref_ids.sort(-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


# --------------------------------------------------------------------------- IndexCache


def _build_attention_layers(modules, model_config, topk_buffer, layer_ids, monkeypatch,
                            cache_dtype="auto", vllm_configs=None,
                            sparse_indexer_backend="auto", **attention_config):
    """Build each layer's attention as vLLM's CUDA GLM-5 model class does, all given the one
    top-k buffer (and, 0.33.0, the one index-group builder) the model hands its layers."""
    import vllm.utils.flashinfer as fi
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        KernelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

    monkeypatch.setattr(fi, "has_flashinfer_sparse_mla_sm120", lambda: False)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(cache_dtype=cache_dtype),
        attention_config=AttentionConfig(backend=BACKEND, **attention_config),
        kernel_config=KernelConfig(sparse_indexer_backend=sparse_indexer_backend),
    )
    if vllm_configs is not None:
        vllm_configs.append(vllm_config)
    hf = model_config.hf_config
    layers = {}
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype):
        if "v32_attention" in modules:
            ig = modules["index_group"]
            builder = ig.SparseMLAIndexGroupBuilder(
                topk_buffer, ig.get_sparse_mla_index_group_max_rows(vllm_config)
            )
            for i in layer_ids:
                layers[i] = modules["v32_attention"].DeepseekV32Attention(
                    vllm_config=vllm_config, config=hf, prefix=f"model.layers.{i}.self_attn",
                    topk_indices_buffer=topk_buffer, index_group_builder=builder,
                )
        else:
            for i in layer_ids:
                layers[i] = modules["deepseek_v2"].DeepseekV2MLAAttention(
                    vllm_config=vllm_config, config=hf, hidden_size=hf.hidden_size,
                    num_heads=hf.num_attention_heads, qk_nope_head_dim=hf.qk_nope_head_dim,
                    qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                    q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                    max_position_embeddings=hf.max_position_embeddings,
                    cache_config=vllm_config.cache_config, quant_config=None,
                    prefix=f"model.layers.{i}.self_attn", topk_indices_buffer=topk_buffer,
                )
    return layers


def _impl(layer):
    """The attention backend impl of a built layer (0.26.0: through the MLA wrapper)."""
    return layer.impl if hasattr(layer, "impl") else layer.mla_attn.mla_attn.impl


CASES = {
    # GLM-5: no IndexCache fields -> every layer runs its indexer.
    "glm-5": ({}, list(range(NUM_LAYERS))),
    "glm-5.2": (GLM52_FIELDS, GLM52_INDEXER_LAYERS),
    # An explicit per-layer pattern overrides freq/offset.
    "pattern": (
        {"index_topk_pattern": "FS" * 39, "index_topk_freq": 4},
        list(range(0, NUM_LAYERS, 2)),
    ),
    # freq 4, offset 2 would make layer 78 a skip layer: the MTP layer keeps its indexer.
    "mtp-on-a-skip-slot": (
        {"index_topk_freq": 4, "index_skip_topk_offset": 2},
        [0] + list(range(1, NUM_LAYERS, 4)),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layers_that_build_an_indexer(
    case, glm5_variant, model_modules, single_rank, simulated_cuda, monkeypatch
):
    fields, expected = CASES[case]
    simulated_cuda(12, 0)
    mc = glm5_variant(case, **fields)
    hf = mc.hf_text_config
    for key, value in fields.items():  # vLLM's config loading keeps the IndexCache fields
        assert getattr(hf, key) == value
    # transformers' own reading of the same fields (GlmMoeDsaConfig.indexer_types)
    hf_full = [i for i, t in enumerate(hf.indexer_types) if t == "full"]
    assert hf_full == expected

    buf = torch.empty(16, hf.index_topk, dtype=torch.int32)
    layers = _build_attention_layers(
        model_modules, mc, buf, range(NUM_LAYERS + 1), monkeypatch
    )
    with_indexer = [i for i, layer in layers.items() if layer.indexer is not None]
    assert with_indexer == expected + [MTP_LAYER]
    assert {type(_impl(layer)).__name__ for layer in layers.values()} == {"TritonMLASparseImpl"}


def test_skip_layers_read_the_indexer_layers_topk_buffer(
    glm5_variant, model_modules, single_rank, simulated_cuda, monkeypatch
):
    """GLM-5.2: a skip layer has no indexer and no indexer cache; its TRITON_MLA_SPARSE impl reads
    the model's one top-k buffer, which the last indexer layer before it wrote this step."""
    simulated_cuda(12, 0)
    mc = glm5_variant("glm-5.2", **GLM52_FIELDS)
    buf = torch.empty(16, mc.hf_text_config.index_topk, dtype=torch.int32)
    layers = _build_attention_layers(model_modules, mc, buf, range(NUM_LAYERS + 1), monkeypatch)

    for i, layer in layers.items():
        impl = _impl(layer)
        assert impl.topk_indices_buffer is buf, i
        if layer.indexer is not None:
            assert layer.indexer.topk_indices_buffer is buf, i

    producer = None
    for i in range(NUM_LAYERS):
        layer, impl = layers[i], _impl(layers[i])
        if i in GLM52_INDEXER_LAYERS:
            producer = i
        if "v32_attention" in model_modules:
            # 0.33.0: layers consuming one indexer result form an index group; the group
            # converts the top-k once (its leader, the indexer layer) for all of them.
            group, leader = impl.index_group, _impl(layers[producer]).index_group
            assert group is leader and group.has_indexer, i
            assert impl.index_group_index == i - producer, i
            assert group.logical_topk_indices is buf
            assert layer.skip_topk is False  # only the MTP proposer toggles it
        else:
            # 0.26.0: the MLA wrapper does not call the indexer on a skip layer.
            assert layer.mla_attn.skip_topk is (i != producer), i
    mtp = layers[MTP_LAYER]
    assert mtp.indexer is not None
    if "v32_attention" in model_modules:
        assert _impl(mtp).index_group_index == 0 and mtp.skip_topk is False
    else:
        assert mtp.mla_attn.skip_topk is False


# --------------------------------------------------------------------------- 0.34.0 knobs


@pytest.mark.parametrize("asked", ["auto", "float32", "bfloat16"])
def test_triton_indexer_ranks_fp32_logits_whatever_indexer_logits_dtype_asks(
    asked, glm5_model_config, model_modules, single_rank, simulated_cuda, monkeypatch
):
    """(0.34.0) `indexer_logits_dtype` picks the dtype of DeepGEMM's MQA logits; the Triton
    indexer's logits are fp32, so the layer hands the op logits_dtype=float32 (memory profile,
    top-k and DCP merge then describe what the kernels write) and warns when bfloat16 was asked."""
    from vllm.config import AttentionConfig
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    if "indexer_logits_dtype" not in AttentionConfig.__dataclass_fields__:
        pytest.skip("this pin has no indexer_logits_dtype")
    simulated_cuda(12, 0)
    warned = []
    monkeypatch.setattr(sai.logger, "warning_once", lambda msg, *a, **k: warned.append(msg % a))
    buf = torch.empty(16, glm5_model_config.hf_text_config.index_topk, dtype=torch.int32)
    (layer,) = _build_attention_layers(
        model_modules, glm5_model_config, buf, [0], monkeypatch, indexer_logits_dtype=asked
    ).values()
    op = layer.indexer.indexer_op
    assert op.use_triton_indexer is True
    assert op.logits_dtype == torch.float32
    assert [w for w in warned if "indexer_logits_dtype" in w] == (
        ["indexer_logits_dtype=bfloat16 applies to DeepGEMM's indexer only; the Triton DSA "
         "indexer computes and ranks FP32 logits."] if asked == "bfloat16" else []
    )


def test_fp8_ds_mla_kv_spec_has_our_row_width(
    glm5_model_config, model_modules, single_rank, simulated_cuda, monkeypatch
):
    """The KV cache spec of a TRITON_MLA_SPARSE layer on fp8_ds_mla holds 656-byte token rows,
    our kernels' layout (0.34.0 asks the impl for it; earlier releases assume it)."""
    simulated_cuda(12, 0)
    buf = torch.empty(16, glm5_model_config.hf_text_config.index_topk, dtype=torch.int32)
    configs = []
    (layer,) = _build_attention_layers(
        model_modules, glm5_model_config, buf, [0], monkeypatch, cache_dtype="fp8_ds_mla",
        vllm_configs=configs,
    ).values()
    mla = layer if hasattr(layer, "get_kv_cache_spec") else layer.mla_attn.mla_attn
    spec = mla.get_kv_cache_spec(configs[0])
    assert spec.page_size_bytes % spec.block_size == 0
    assert spec.page_size_bytes // spec.block_size == 656, spec

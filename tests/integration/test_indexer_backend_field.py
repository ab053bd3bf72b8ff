"""`kernel_config.sparse_indexer_backend` (auto / deep_gemm / triton), the DSA indexer's one
dispatch point, through vLLM's own classes of each pin: the config field and its CLI flag, the
explicit values, the indexer layer taking the resolved value (nothing hung on its cache layer),
and the indexer metadata builder carrying it in every DeepseekV32IndexerMetadata it builds.
`test_dsa_indexer_choice.py` has what "auto" resolves to per case; `test_indexer_path.py` has the
op running the kernels its metadata carries and the MTP draft path reading the same value.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.integration.test_dsa_indexer_choice import _mx_scales, choice  # noqa: F401
from tests.integration.test_glm5_family import (  # noqa: F401  (fixtures)
    _build_attention_layers,
    model_modules,
    single_rank,
)
from tests.integration.test_vllm_selection import _flashinfer_sm120


# --- the config field ---------------------------------------------------------------------------


def test_field_default_values_and_spelling(vllm_module):
    from vllm.config import DeviceConfig, KernelConfig, VllmConfig

    assert KernelConfig().sparse_indexer_backend == "auto"
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    assert vllm_config.kernel_config.sparse_indexer_backend == "auto"
    for value in ("auto", "deep_gemm", "triton"):
        assert KernelConfig(sparse_indexer_backend=value).sparse_indexer_backend == value
    # normalized as vLLM's other kernel backends are
    assert KernelConfig(sparse_indexer_backend="Deep-GEMM").sparse_indexer_backend == "deep_gemm"
    with pytest.raises(Exception, match="sparse_indexer_backend"):
        KernelConfig(sparse_indexer_backend="flashmla")
    # documented in the field's docstring (what --help shows)
    from vllm.config.utils import get_attr_docs

    doc = get_attr_docs(KernelConfig)["sparse_indexer_backend"]
    for value in ('"auto"', '"deep_gemm"', '"triton"', "TRITON_MLA_SPARSE"):
        assert value in doc


def _parse(argv):
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(argv))


@pytest.mark.parametrize("flag,want", [("triton", "triton"), ("deep-gemm", "deep_gemm"),
                                       ("auto", "auto")])
def test_cli_flag(simulated_cuda, flag, want):
    assert _parse(["--sparse-indexer-backend", flag]).sparse_indexer_backend == want
    assert _parse([]).sparse_indexer_backend == "auto"
    with pytest.raises(SystemExit):
        _parse(["--sparse-indexer-backend", "flashmla"])


def test_cli_flag_reaches_the_kernel_config(vllm_module):
    """EngineArgs hands a non-"auto" value to KernelConfig, as it does the other kernel backends
    (read from create_engine_config's source: the transfer sits beside them)."""
    import inspect

    from vllm.engine.arg_utils import EngineArgs

    src = inspect.getsource(EngineArgs.create_engine_config)
    assert (
        'if self.sparse_indexer_backend != "auto":\n'
        "            kernel_config.sparse_indexer_backend = self.sparse_indexer_backend"
    ) in src


# --- explicit values ----------------------------------------------------------------------------


def _warnings(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_triton_where_auto_keeps_deepgemm(simulated_cuda, glm5_model_config, choice):
    simulated_cuda(9, 0)
    assert choice(glm5_model_config, "fp8_ds_mla", toolchain=True)[0] is False  # auto
    use_triton, reason, records = choice(
        glm5_model_config, "fp8_ds_mla", toolchain=True, requested="triton"
    )
    assert use_triton and reason == "kernel_config.sparse_indexer_backend='triton'"
    assert [r.getMessage() for r in records if r.levelno == logging.INFO] == [
        f"DSA indexer: Triton kernels ({reason})"
    ]


def test_deep_gemm_where_auto_picks_triton(
    simulated_cuda, monkeypatch, glm5_model_config, choice
):
    """SM120 where vLLM picks TRITON_MLA_SPARSE: "auto" is Triton, "deep_gemm" is honoured."""
    _flashinfer_sm120(monkeypatch, available=False)
    simulated_cuda(12, 0)
    assert choice(glm5_model_config, "fp8_ds_mla", toolchain=True)[0] is True  # auto
    use_triton, reason, records = choice(
        glm5_model_config, "fp8_ds_mla", toolchain=True, requested="deep_gemm"
    )
    assert not use_triton and reason == "kernel_config.sparse_indexer_backend='deep_gemm'"
    assert _warnings(records) == []


def test_deep_gemm_without_its_toolchain_warns(simulated_cuda, glm5_model_config, choice):
    simulated_cuda(9, 0)
    use_triton, _, records = choice(
        glm5_model_config, "fp8_ds_mla", toolchain=False, requested="deep_gemm"
    )
    assert not use_triton
    warnings = _warnings(records)
    assert len(warnings) == 1 and "no nvcc at /fake/bin/nvcc" in warnings[0]


def test_deep_gemm_where_it_cannot_run_raises(
    simulated_cuda, monkeypatch, glm5_model_config, choice
):
    import vllm.utils.deep_gemm as deep_gemm

    simulated_cuda(8, 9)
    with pytest.raises(ValueError, match="built for SM90, SM10x and SM12x"):
        choice(glm5_model_config, "fp8", backend="TRITON_MLA_SPARSE", requested="deep_gemm")
    simulated_cuda(9, 0)
    monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: False)
    with pytest.raises(ValueError, match="DeepGEMM is not installed"):
        choice(glm5_model_config, "fp8_ds_mla", toolchain=True, requested="deep_gemm")


def test_triton_on_an_mx_scale_cache_raises(simulated_cuda, glm5_model_config, choice):
    """SM100 on 0.33+: the indexer cache holds MX scales the Triton kernels cannot read; 0.26.0
    stores fp32 scales everywhere, so "triton" runs there."""
    simulated_cuda(10, 0)
    try:
        use_triton, _, _ = choice(
            glm5_model_config, "fp8_ds_mla", backend="FLASHMLA_SPARSE", requested="triton"
        )
    except ValueError as exc:
        assert _mx_scales() and "MX scales" in str(exc)
    else:
        assert not _mx_scales() and use_triton


def test_off_cuda_the_config_is_left_alone(vllm_module, glm5_model_config):
    """Other platforms run their own indexer ops: nothing is decided or written."""
    from vllm.config import DeviceConfig, KernelConfig, VllmConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    assert not current_platform.is_cuda()
    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        kernel_config=KernelConfig(sparse_indexer_backend="triton"),
    )
    assert sib.resolve_sparse_indexer_backend(vllm_config) == "deep_gemm"
    assert vllm_config.kernel_config.sparse_indexer_backend == "triton"


# --- the layer and the metadata builder ---------------------------------------------------------


def _deep_gemm_importable(monkeypatch):
    """The wheel vendors DeepGEMM, but its extension does not load without a GPU: answer as a
    CUDA host would, wherever vLLM asks (its bound copies included)."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    import vllm.utils.deep_gemm as deep_gemm
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: True)
    monkeypatch.setattr(sai, "has_deep_gemm", lambda: True, raising=False)
    monkeypatch.setattr(sib, "deep_gemm_jit_toolchain",
                        lambda: sib.JitToolchain(True, "nvcc 12.9 at /fake/bin/nvcc", (12, 9)))


def _indexer_cache_layer(layer):
    from vllm.model_executor.layers.attention.attention import AttentionLayerBase  # noqa: F401

    for name, module in layer.named_modules():
        if name.endswith("k_cache"):
            return module
    raise AssertionError("no indexer cache layer")


@pytest.mark.parametrize("requested,want", [("auto", "triton"), ("triton", "triton"),
                                            ("deep_gemm", "deep_gemm")])
def test_layer_takes_the_resolved_backend(
    requested, want, glm5_model_config, model_modules, single_rank, simulated_cuda, monkeypatch
):
    """SM120 with TRITON_MLA_SPARSE: every indexer layer takes the engine's one resolved value
    (written back into the config by the first), and nothing is set on its cache layer."""
    simulated_cuda(12, 0)
    _deep_gemm_importable(monkeypatch)
    configs = []
    buf = torch.empty(16, glm5_model_config.hf_text_config.index_topk, dtype=torch.int32)
    layers = _build_attention_layers(
        model_modules, glm5_model_config, buf, [0, 1], monkeypatch, vllm_configs=configs,
        sparse_indexer_backend=requested,
    )
    assert configs[0].kernel_config.sparse_indexer_backend == want
    for layer in layers.values():
        op = layer.indexer.indexer_op
        assert op.indexer_backend == want
        assert op.use_triton_indexer is (want == "triton")
        assert not hasattr(_indexer_cache_layer(layer), "use_triton_indexer")


def _builder(model_modules, glm5_model_config, monkeypatch, requested):
    """vLLM's DeepseekV32IndexerMetadataBuilder for the indexer cache of a built layer, on the CPU
    (the device only places its buffers)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla import indexer as idx

    configs = []
    buf = torch.empty(16, glm5_model_config.hf_text_config.index_topk, dtype=torch.int32)
    (layer,) = _build_attention_layers(
        model_modules, glm5_model_config, buf, [0], monkeypatch, vllm_configs=configs,
        sparse_indexer_backend=requested,
    ).values()
    vllm_config = configs[0]
    cache = _indexer_cache_layer(layer)
    spec = cache.get_kv_cache_spec(vllm_config)
    monkeypatch.setattr(idx, "num_compute_units", lambda *a, **k: 4, raising=False)
    kwargs = {}
    import inspect

    if "block_table_width" in inspect.signature(idx.DeepseekV32IndexerMetadataBuilder).parameters:
        kwargs["block_table_width"] = 64
    with set_current_vllm_config(vllm_config):
        builder = idx.DeepseekV32IndexerMetadataBuilder(
            spec, [cache.prefix], vllm_config, torch.device("cpu"), **kwargs
        )
    return builder, vllm_config


def _decode_batch(block_size):
    """CommonAttentionMetadata of two one-token decode requests (contexts 70 and 9)."""
    import dataclasses

    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq_lens = torch.tensor([70, 9], dtype=torch.int32)
    fields = dict(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        _seq_lens_cpu=seq_lens.clone(),
        num_computed_tokens_cpu=seq_lens - 1,
        _num_computed_tokens_cpu=seq_lens - 1,
        num_reqs=2,
        num_actual_tokens=2,
        max_query_len=1,
        max_seq_len=70,
        block_table_tensor=torch.arange(4, dtype=torch.int32).view(2, 2),
        slot_mapping=torch.tensor([69, block_size + 8], dtype=torch.int64),
    )
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in names})


@pytest.mark.parametrize("requested,want", [("auto", "triton"), ("deep_gemm", "deep_gemm")])
def test_metadata_builder_carries_the_resolved_backend(
    requested, want, glm5_model_config, model_modules, single_rank, simulated_cuda, monkeypatch
):
    from vllm.v1.attention.backends.mla import indexer as idx

    simulated_cuda(12, 0)
    _deep_gemm_importable(monkeypatch)
    builder, vllm_config = _builder(model_modules, glm5_model_config, monkeypatch, requested)
    assert builder.indexer_backend == want == vllm_config.kernel_config.sparse_indexer_backend
    # DeepGEMM's schedule metadata is made for the DeepGEMM path only (stood in for here)
    scheduled = []

    def fake_schedule(*a, **k):
        scheduled.append(True)
        return builder.scheduler_metadata_buffer.clone()

    monkeypatch.setattr(idx, "get_paged_mqa_logits_metadata", fake_schedule)
    monkeypatch.setattr(idx, "has_deep_gemm", lambda: True)
    # the module bound the platform of its import (the CPU one here)
    import vllm.platforms as platforms

    monkeypatch.setattr(idx, "current_platform", platforms._current_platform)
    md = builder.build(0, _decode_batch(builder.kv_cache_spec.block_size))
    assert isinstance(md, idx.DeepseekV32IndexerMetadata)
    assert md.indexer_backend == want
    assert md.num_decodes == 2 and md.decode is not None
    assert scheduled == ([] if want == "triton" else [True])


def test_metadata_builder_of_an_indexer_with_ops_of_its_own_keeps_deepgemm(
    glm5_model_config, model_modules, single_rank, simulated_cuda, monkeypatch
):
    """Models whose indexer is not a SparseAttnIndexer (0.33.0's GLM-5-Next, DeepSeek-V4.1) share
    this builder but run DeepGEMM ops of their own that read its schedule metadata: where no
    SparseAttnIndexer resolved the setting, the builder keeps upstream's path even where "auto"
    would pick Triton for a SparseAttnIndexer (SM120, TRITON_MLA_SPARSE)."""
    import dataclasses

    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla import indexer as idx
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    simulated_cuda(12, 0)
    _deep_gemm_importable(monkeypatch)
    built, resolved_config = _builder(model_modules, glm5_model_config, monkeypatch, "auto")
    assert built.indexer_backend == "triton"
    fresh = dataclasses.replace(resolved_config)  # same model, nothing resolved on its kernels
    fresh.kernel_config = type(resolved_config.kernel_config)()
    assert sib.resolved_sparse_indexer_backend(fresh) == "deep_gemm"
    kwargs = {}
    import inspect

    if "block_table_width" in inspect.signature(idx.DeepseekV32IndexerMetadataBuilder).parameters:
        kwargs["block_table_width"] = 64
    with set_current_vllm_config(fresh):
        builder = idx.DeepseekV32IndexerMetadataBuilder(
            built.kv_cache_spec, built.layer_names, fresh, torch.device("cpu"), **kwargs
        )
    assert builder.indexer_backend == "deep_gemm"
    assert fresh.kernel_config.sparse_indexer_backend == "auto"  # nothing decided here

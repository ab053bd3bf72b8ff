"""triton_mla_sparse_compat: every pin is one entry of GENERATIONS, and under the installed pin's
vLLM the backend takes each pin-dependent piece from exactly that entry.

Runs once per pin (tools/run_tests.py step 4 installs each pin's patched build and runs
tests/integration there), so together the runs check every pin's entry against its own tree."""
from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compat(vllm_module):
    from vllm.v1.attention.backends.mla import triton_mla_sparse_compat

    return triton_mla_sparse_compat


@pytest.fixture(scope="module")
def backend(vllm_module):
    from vllm.v1.attention.backends.mla import triton_mla_sparse

    return triton_mla_sparse


def test_every_pin_is_listed_in_exactly_one_entry(compat):
    pins = tomllib.loads((REPO / "pins.lock").read_text())["pins"]
    listed = [v for g in compat.GENERATIONS for v in g.pins]
    assert sorted(listed) == sorted(pins), (
        f"pins.lock has {sorted(pins)}, triton_mla_sparse_compat.GENERATIONS lists {sorted(listed)}"
    )


def test_installed_pin_is_the_only_matching_entry(compat):
    release = compat.vllm_release()
    matching = [g.name for g in compat.GENERATIONS if g.marker()]
    listed = [g.name for g in compat.GENERATIONS if release in g.pins]
    assert listed, f"vLLM {release} is not in any entry of GENERATIONS"
    assert matching == listed, f"vLLM {release}: markers hold for {matching}, listed under {listed}"
    assert compat.API.name == listed[0]


def test_select_names_the_release_when_no_entry_or_the_wrong_entry_matches(compat):
    release = compat.vllm_release()
    other = [g for g in compat.GENERATIONS if g is not compat.API]
    with pytest.raises(RuntimeError, match=rf"vLLM {release}'s .* match 0 entries"):
        compat.select(tuple(other))
    # the tree's own entry, but the release listed under another one
    from dataclasses import replace

    wrong = tuple(replace(g, pins=()) if g is compat.API else replace(g, pins=(release,)) for g in
                  compat.GENERATIONS)
    with pytest.raises(RuntimeError, match=rf"vLLM {release} is listed under"):
        compat.select(wrong)


def test_topk_path_comes_from_the_entry(compat, backend):
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl

    impl = backend.TritonMLASparseImpl
    mixin = compat.API.topk_mixin
    assert impl.__mro__[1] is mixin
    if mixin is compat.ImplConvertsTopk:
        # 0.26.0: our forward_mqa, and the base has no _forward_mqa_kernel to fill
        assert impl.forward_mqa is compat.ImplConvertsTopk.forward_mqa
        assert not hasattr(SparseMLACommonImpl, "_forward_mqa_kernel")
    else:
        assert mixin is compat.BaseConvertsTopk
        # 0.33.0: the base's forward_mqa (it converts the top-k), our kernel step, and the base's
        # kernel step is abstract (raises)
        assert impl.forward_mqa is SparseMLACommonImpl.forward_mqa
        assert impl._forward_mqa_kernel is compat.BaseConvertsTopk._forward_mqa_kernel
        base_src = inspect.getsource(SparseMLACommonImpl._forward_mqa_kernel)
        assert "NotImplementedError" in base_src
        # same keyword-only interface as the hook it fills
        assert (inspect.signature(impl._forward_mqa_kernel).parameters.keys()
                == inspect.signature(SparseMLACommonImpl._forward_mqa_kernel).parameters.keys())


def test_metadata_class_comes_from_the_entry(compat, backend):
    from vllm.model_executor.layers.attention import sparse_mla_attention

    md = backend.TritonMLASparseMetadata
    assert backend.TritonMLASparseMetadataBuilder.metadata_cls is md
    assert md.__qualname__ == "TritonMLASparseMetadata"
    common = getattr(sparse_mla_attention, "SparseMLACommonMetadata", None)
    if compat.API.make_metadata_cls is compat._common_metadata:
        assert common is not None and issubclass(md, common)
    else:
        assert common is None
        # what the builder of 0.26.0's base fills and ImplConvertsTopk reads
        fields = set(md.__dataclass_fields__)
        assert {"req_id_per_token", "block_table", "block_size", "topk_tokens",
                "cp_kv_cache_interleave_size", "num_decode_tokens"} <= fields
        builder_src = inspect.getsource(sparse_mla_attention.SparseMLACommonMetadataBuilder)
        for name in ("req_id_per_token", "block_table", "topk_tokens"):
            assert name in builder_src


def test_kv_spec_hook_and_scale_format_come_from_the_entry(compat, backend):
    from vllm.v1.attention.backend import AttentionBackend

    assert backend._DS_SCALE_FORMAT == compat.API.ds_scale_format
    assert compat.API.ds_scale_format in ("arbitrary_fp32", "pow2_fp32")
    hook = getattr(AttentionBackend, "customize_spec", None)
    if compat.API.customize_kv_spec is compat._spec_unchanged:
        assert hook is None, "this vLLM has customize_spec: the entry must say what ours does"
    else:
        assert hook is not None
        from vllm.v1.attention.backends.mla import sparse_utils

        assert hasattr(sparse_utils, "align_blocks_to_rows")


def test_indexer_scale_probe_matches_the_tree(vllm_module):
    """The indexer's MX-scale question is vLLM's own where the release has one (0.33+)."""
    from vllm.utils import deep_gemm
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    if not hasattr(deep_gemm, "mqa_logits_use_mx_scales"):
        assert sib.indexer_cache_uses_mx_scales() is False
    else:
        assert sib.indexer_cache_uses_mx_scales() == bool(deep_gemm.mqa_logits_use_mx_scales())


def test_deep_gemm_jit_entry_matches_the_vendored_deepgemm(vllm_module):
    """The indexer's DeepGEMM facts (sparse_indexer_backend.KNOWN_DEEP_GEMM_JITS) for the
    installed tree's vllm/third_party/deep_gemm, checked against its files (its extension cannot
    be loaded without a GPU; its text can): the version, the oldest nvcc its compiler accepts,
    and whether DG_JIT_USE_NVRTC exists in it."""
    import importlib.util
    import re

    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    spec = importlib.util.find_spec("vllm.third_party.deep_gemm")
    assert spec is not None and spec.submodule_search_locations, "this vLLM vendors no DeepGEMM"
    root = Path(list(spec.submodule_search_locations)[0])
    version = re.search(r"__version__ = '([^']+)'", (root / "__init__.py").read_text())
    jit = sib.vendored_deep_gemm_jit()
    assert version and version.group(1) == jit.version == sib.vendored_deep_gemm_version()
    assert jit.version in sib.KNOWN_DEEP_GEMM_JITS
    extensions = sorted(root.glob("_C*.so"))
    assert extensions, f"no compiled extension in {root}"
    binary = extensions[0].read_bytes()
    # 2.5.0: "NVCC version should be >= 12.3"; 2.8.1: "NVCC version must be at least 12.9"
    floors = {tuple(int(x) for x in m.groups())
              for m in re.finditer(rb"NVCC version (?:should be >= |must be at least )(\d+)\.(\d+)",
                                   binary)}
    assert floors == {jit.min_nvcc}
    assert (b"DG_JIT_USE_NVRTC" in binary) == jit.nvrtc_switch
    assert (b"nvrtcCompileProgram" in binary) == jit.nvrtc_switch


def test_shardq_opt_in_comes_from_the_entry(compat, backend):
    """(0.34.0) ShardQ is opt-in per impl (`supports_shardq`, the base's default False); ours
    takes its answer from the entry. The metadata then carries `topk_start`, which the base's
    forward_mqa applies before our kernel step (test_backend_forward covers that path)."""
    from vllm.model_executor.layers.attention import sparse_mla_attention
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl

    impl = backend.TritonMLASparseImpl
    assert impl.supports_shardq is compat.API.supports_shardq
    has_shardq = hasattr(SparseMLACommonImpl, "supports_shardq")
    assert has_shardq == (compat.API.marker is compat._base_converts_topk_shardq), (
        "this vLLM's ShardQ support and the entry disagree"
    )
    if has_shardq:
        assert SparseMLACommonImpl.supports_shardq is False  # opt-in: the base never assumes it
        assert "topk_start" in backend.TritonMLASparseMetadata.__dataclass_fields__
        assert "topk_start" in inspect.getsource(SparseMLACommonImpl.forward_mqa)
        # the base decides use_shardq from the class flag; ours says False, so it stays off
        assert "self.supports_shardq" in inspect.getsource(SparseMLACommonImpl.__init__)
    else:
        common = getattr(sparse_mla_attention, "SparseMLACommonMetadata", None)
        assert "topk_start" not in getattr(common, "__dataclass_fields__", {})


def test_fp8_ds_mla_row_width_comes_from_the_entry(compat, backend):
    """The fp8_ds_mla row width: 0.34.0 asks the impl (`get_fp8_ds_mla_row_bytes`, for the KV
    cache spec and the index group); earlier releases assume 656 B. Either way it must be our
    kernels' row: what the impl answers, what get_kv_cache_shape allocates."""
    from vllm.v1.attention import backend as vllm_backend
    from vllm.v1.attention.ops import mla_kv_format

    ours = mla_kv_format.kv_cache_row_bytes("fp8_ds_mla")
    assert ours == 656
    impl = backend.TritonMLASparseImpl
    assert impl.get_fp8_ds_mla_row_bytes(object()) == ours
    assert backend.TritonMLASparseBackend.get_kv_cache_shape(3, 64, 1, 576, "fp8_ds_mla") == (3, 64, ours)
    hook = getattr(vllm_backend.MLAAttentionImpl, "get_fp8_ds_mla_row_bytes", None)
    if compat.API.fp8_ds_mla_row_bytes_from_impl:
        assert hook is not None, "the entry says the release asks the impl, but it has no hook"
        from vllm.model_executor.layers.attention import mla_attention

        spec_src = inspect.getsource(mla_attention.MLAAttention.get_kv_cache_spec)
        assert "get_fp8_ds_mla_row_bytes" in spec_src
    else:
        assert hook is None, "this vLLM asks the impl for the fp8_ds_mla row width: the entry must say so"

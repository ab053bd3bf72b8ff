"""vLLM's sparse_attn_indexer op, patched to run on the Triton DSA kernels, against a reference.

Drives the patched `vllm.model_executor.layers.sparse_attn_indexer.sparse_attn_indexer` the way
the model does (indexer K written into the paged 132-B/token cache, a prefill chunk gathered and
scored, decode rows scored over the paged cache with MTP-style per-token context lengths, top-k
into the shared buffer), with the metadata carrying `indexer_backend="triton"`: no DeepGEMM, no
compiled vLLM op.

The forward context and the workspace manager (both set up by vLLM's GPU worker) are stood in
for; everything else is vLLM's code and ours, in the Triton interpreter on the CPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import types

import pytest
import torch

HEADS, HEAD_DIM, BLOCK = 32, 128, 64
PREFIX = "model.layers.0.self_attn.indexer.k_cache"


class _Workspace:
    def get_simultaneous(self, *specs):
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]


def _reference_logits(q_fp8, w, k_deq, ctx_start, ctx_end):
    """logits[c] = sum_h w[h] * relu(q[h] . k[c]) for c in [ctx_start, ctx_end)."""
    s = torch.relu(q_fp8.double() @ k_deq[ctx_start:ctx_end].double().T)  # [H, C]
    return (w.double()[:, None] * s).sum(0)


def _make(cls, **fields):
    """A vLLM dataclass from the fields this pin has (0.33.0 added `max_seqlen_k` to the
    prefill chunk; every field a pin lacks is dropped, every one it requires must be given)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in fields.items() if k in names})


def _forward_context(md):
    try:  # 0.33.0 reads the CUDA-graph mode of the step
        from vllm.config import CUDAGraphMode

        mode = CUDAGraphMode.NONE
    except ImportError:
        mode = None
    return types.SimpleNamespace(attn_metadata={PREFIX: md}, cudagraph_runtime_mode=mode)


def _check_topk(selected, ref_logits, k):
    """`selected` (request-local, -1 padded) is a valid top-k of `ref_logits` up to rounding."""
    n = ref_logits.numel()
    valid = selected[selected >= 0].long()
    assert valid.numel() == min(k, n)
    assert valid.unique().numel() == valid.numel(), "duplicate index in top-k"
    assert (valid < n).all()
    assert (selected[valid.numel():] == -1).all(), "valid indices must come first"
    if valid.numel() < n:
        kth = ref_logits.topk(valid.numel()).values[-1]
        tol = 1e-4 * ref_logits.abs().max() + 1e-6
        assert ref_logits[valid].min() >= kth - tol


def _keywords_of_this_pin(fn):
    """0.33.0 added required arguments after `use_pcp` (no PCP decode sharding, no dense-MHA
    metadata layer: the step's top-k is always consumed)."""
    params = inspect.signature(fn).parameters
    extra = {"pcp_shard_decode_requests": False, "dense_mha_metadata_layer_name": ""}
    return {k: v for k, v in extra.items() if k in params}


@pytest.mark.parametrize("topk,sub_rows", [(64, None), (64, 16)])
def test_prefill_and_decode_through_triton_indexer(require_triton_indexer, monkeypatch, topk, sub_rows):
    """sub_rows: (0.34.0) the op splits a prefill chunk's rows into dense_logits_rows-sized
    sub-chunks under the logits budget; the Triton branch scores each on its own row slice,
    sized by the full gathered K width (its logits are uncompressed).

    The step's kernels are those its metadata carries (`indexer_backend`): the layer's own
    argument is set to the other value here and must not matter outside the profiling run."""
    step_backend = "triton"
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    widths = []
    if sub_rows is not None:
        if not hasattr(sai, "dense_logits_rows"):
            pytest.skip("this pin's op scores a prefill chunk in one call (no row sub-chunks)")

        def dense_logits_rows(width, *a, **kw):
            widths.append(width)
            return sub_rows

        monkeypatch.setattr(sai, "dense_logits_rows", dense_logits_rows)
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadata,
        DeepseekV32IndexerPrefillChunkMetadata,
        DeepseekV32IndexerPrefillMetadata,
        DeepSeekV32IndexerDecodeMetadata,
    )
    from vllm.v1.attention.ops.triton_dsa_indexer import dequant_indexer_k_cache

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    # Request 0 decodes 2 tokens (MTP) at context 130; request 1 prefills 40 new tokens on top
    # of 50 cached ones (chunked prefill); rows with fewer than topk context tokens pad with -1.
    # (Small: the interpreter runs every kernel on the CPU.)
    dec_ctx, pre_ctx, pre_new = 130, 90, 40
    num_blocks = 10
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_table = torch.full((2, 4), 0, dtype=torch.int32)
    block_table[0, :4] = perm[:4]
    block_table[1, :3] = perm[4:7]
    kv_cache = torch.zeros(num_blocks, BLOCK, HEAD_DIM + 4, dtype=torch.uint8)

    def slot(r, p):
        return int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK

    # Tokens of this step: 2 decode tokens of request 0, then the prefill of request 1.
    # Earlier tokens are written first (as earlier steps did), with the Triton writer.
    from vllm.v1.attention.ops import triton_dsa_indexer

    k_all = {r: torch.randn(n, HEAD_DIM, generator=g).bfloat16() for r, n in ((0, dec_ctx), (1, pre_ctx))}
    hist = [(0, p) for p in range(dec_ctx - 2)] + [(1, p) for p in range(pre_ctx - pre_new)]
    triton_dsa_indexer.indexer_k_quant_and_cache(
        torch.stack([k_all[r][p] for r, p in hist]),
        kv_cache,
        torch.tensor([slot(r, p) for r, p in hist], dtype=torch.int64),
        128,
        "ue8m0",
    )
    step = [(0, dec_ctx - 2), (0, dec_ctx - 1)] + [(1, p) for p in range(pre_ctx - pre_new, pre_ctx)]
    T = len(step)
    k_step = torch.stack([k_all[r][p] for r, p in step])
    slot_mapping = torch.tensor([slot(r, p) for r, p in step], dtype=torch.int64)
    q = (torch.randn(T, HEADS, HEAD_DIM, generator=g) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.randn(T, HEADS, generator=g) * 0.1

    # Prefill chunk: rows of request 1 see [ks, ke) of the gathered K of that request.
    cu_seq_lens = torch.tensor([0, pre_ctx], dtype=torch.int32)
    first = pre_ctx - pre_new
    ks = torch.zeros(pre_new, dtype=torch.int32)
    ke = torch.arange(first + 1, pre_ctx + 1, dtype=torch.int32)
    chunk = _make(
        DeepseekV32IndexerPrefillChunkMetadata,
        block_table=block_table[1:2],
        cu_seqlen_ks=ks,
        cu_seqlen_ke=ke,
        cu_seq_lens=cu_seq_lens,
        token_to_seq=torch.zeros(pre_new, dtype=torch.int32),
        total_seq_lens=pre_ctx,
        max_seqlen_k=pre_ctx,
        token_start=2,
        token_end=T,
        num_reqs=1,
        local_cu_seq_lens=cu_seq_lens,
        local_total_seq_lens=pre_ctx,
        max_local_total_seq_lens=pre_ctx,
    )
    decode = _make(
        DeepSeekV32IndexerDecodeMetadata,
        block_table=block_table[0:1],
        seq_lens=torch.tensor([[dec_ctx - 1, dec_ctx]], dtype=torch.int32),
        decode_lens=torch.tensor([2], dtype=torch.int32),
        requires_padding=False,
        schedule_metadata=torch.empty(0),
    )
    md = _make(
        DeepseekV32IndexerMetadata,
        seq_lens=torch.tensor([dec_ctx, pre_ctx], dtype=torch.int32),
        max_seq_len=dec_ctx,
        slot_mapping=slot_mapping,
        num_decodes=1,
        num_decode_tokens=2,
        num_prefills=1,
        num_prefill_tokens=pre_new,
        decode=decode,
        prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk]),
        indexer_backend=step_backend,
    )
    monkeypatch.setattr(sai, "get_forward_context", lambda: _forward_context(md))
    monkeypatch.setattr(sai, "current_workspace_manager", lambda: _Workspace())
    buffer = torch.full((T + 4, topk), -7, dtype=torch.int32)
    # upstream's call semantics: DeepGEMM's logits are called with clean_logits=False (0.26.0) or
    # leave the tail uncleaned (0.33.0): the Triton logits must be called the same way
    calls = []
    for name in ("fp8_mqa_logits", "fp8_paged_mqa_logits"):
        orig = getattr(triton_dsa_indexer, name)

        def spy(*a, _orig=orig, _name=name, **kw):
            rows = a[0].shape[0] if _name == "fp8_mqa_logits" else None  # prefill rows scored
            calls.append((_name, kw.get("clean_logits", True), rows))
            return _orig(*a, **kw)

        monkeypatch.setattr(sai.triton_dsa_indexer, name, spy)
    # the top-k runs on a scratch from the workspace manager (reserved in the profiling run)
    from vllm.v1.attention.ops import triton_dsa_topk

    scratches = []
    for name in ("top_k_per_row_prefill", "top_k_per_row_decode"):
        orig = getattr(triton_dsa_topk, name)

        def spy_topk(*a, _orig=orig, _name=name, **kw):
            scratches.append((_name, kw.get("scratch")))
            return _orig(*a, **kw)

        monkeypatch.setattr(sai.triton_dsa_topk, name, spy_topk)

    sai.sparse_attn_indexer(
        torch.empty(T, 16),  # hidden_states: only its length is read
        PREFIX,
        kv_cache,
        q,
        None,
        k_step,
        weights,
        128,
        "ue8m0",
        topk,
        HEAD_DIM,
        4096,  # max_model_len
        4096,  # total_seq_lens (prefill workspace rows)
        buffer,
        False,  # skip_k_cache_insert
        False,  # use_pcp
        indexer_backend="deep_gemm",  # only the profiling run reads it
        **_keywords_of_this_pin(sai.sparse_attn_indexer),
    )

    vals, scales = dequant_indexer_k_cache(kv_cache)
    deq = vals * scales.repeat_interleave(HEAD_DIM // scales.shape[-1], dim=-1)
    k_deq = {r: deq[block_table[r].long()].reshape(-1, HEAD_DIM) for r in (0, 1)}
    for t, (r, p) in enumerate(step):
        ref = _reference_logits(q[t].float(), weights[t], k_deq[r], 0, p + 1)
        _check_topk(buffer[t], ref, topk)
    assert (buffer[T:] == -7).all(), "rows past the step's tokens must be left alone"
    prefill_rows = [pre_new] if sub_rows is None else [16, 16, 8]
    assert sorted(calls) == sorted(
        [("fp8_mqa_logits", False, n) for n in prefill_rows] + [("fp8_paged_mqa_logits", False, None)]
    ), calls
    if sub_rows is not None:
        assert widths == [pre_ctx], widths  # the gathered K width of the chunk
    want = triton_dsa_topk.topk_workspace_bytes(topk, T, 4096)
    assert sorted(n for n, _ in scratches) == sorted(
        ["top_k_per_row_decode"] + ["top_k_per_row_prefill"] * len(prefill_rows)
    )
    for name, scr in scratches:
        assert scr is not None and scr.dtype == torch.uint8 and scr.numel() == want, (name, scr)


@pytest.mark.parametrize("use_triton_indexer", [True, False])
def test_mtp_draft_decode_metadata_skips_deepgemm_with_triton_indexer(
    require_triton_indexer, monkeypatch, use_triton_indexer
):
    """The MTP draft path (`update_draft_decode_metadata`, 0.33.0+) re-derives the decode metadata;
    with the Triton indexer it must not call DeepGEMM's schedule metadata (DeepGEMM may not run
    there), without it it still does (upstream's behaviour, so this test can tell them apart).
    The choice is the one the metadata it updates carries (`indexer_backend`); the builder holds
    the opposite value here, so reading the builder's instead would fail."""
    import vllm.v1.attention.backends.mla.indexer as idx

    method = getattr(idx.DeepseekV32IndexerMetadataBuilder, "update_draft_decode_metadata", None)
    if method is None:
        pytest.skip("this pin has no MTP draft decode metadata update")
    called = []

    def fake_metadata(*a, **kw):
        called.append(True)
        return torch.zeros(3, 2, dtype=torch.int32)

    monkeypatch.setattr(idx, "get_paged_mqa_logits_metadata", fake_metadata)
    monkeypatch.setattr(idx, "has_deep_gemm", lambda: True)
    monkeypatch.setattr(idx.current_platform, "is_cuda", lambda: True)
    n = 2
    decode = types.SimpleNamespace(
        block_table=torch.zeros(n, 4, dtype=torch.int32),
        indices=None,
        per_req_decode_lens=None,
        seq_lens=torch.zeros(n, 1, dtype=torch.int32),
        decode_lens=torch.zeros(n, dtype=torch.int32),
        schedule_metadata=torch.zeros(3, 2, dtype=torch.int32),
    )
    md = types.SimpleNamespace(
        decode=decode,
        num_decode_tokens=n,
        num_prefills=0,
        num_decodes=n,
        block_table=torch.arange(n * 4, dtype=torch.int32).view(n, 4),
        seq_lens=torch.tensor([70, 9], dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        indexer_backend="triton" if use_triton_indexer else "deep_gemm",
    )
    builder = types.SimpleNamespace(
        dcp_world_size=1,
        compress_ratio=1,
        arange_buffer=torch.arange(16, dtype=torch.int32),
        indexer_backend="deep_gemm" if use_triton_indexer else "triton",
        num_sms=2,
        kv_cache_spec=types.SimpleNamespace(num_states=64, block_size=64),
    )
    method(builder, md)
    assert torch.equal(decode.seq_lens.view(-1), md.seq_lens)  # the rest of the update still ran
    assert torch.equal(decode.block_table, md.block_table)
    assert called == ([] if use_triton_indexer else [True])


@pytest.mark.parametrize("num_tokens", [8, 4096])
def test_profiling_run_reserves_the_triton_topk_scratch(require_triton_indexer, monkeypatch, num_tokens):
    """In vLLM's memory-profiling run (no attention metadata) the op reserves, in one workspace
    request, the K-gather buffers and the Triton top-k's scratch for the run's token count
    (max_num_batched_tokens there) and max(max_model_len, total_seq_lens) columns, so the profiled
    peak counts it (and the 1 MiB radix workspace of the compiled top-k is not asked for)."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    from vllm.v1.attention.ops import triton_dsa_topk

    requests = []

    class _Recording(_Workspace):
        def get_simultaneous(self, *specs):
            requests.append(specs)
            return super().get_simultaneous(*specs)

    ctx = _forward_context(None)
    ctx.attn_metadata = None  # what the profiling (dummy) run has
    monkeypatch.setattr(sai, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(sai, "current_workspace_manager", lambda: _Recording())
    if hasattr(sai, "_reserve_row_shard_exchange_transient"):  # 0.33.0: a DP/PCP exchange buffer
        monkeypatch.setattr(sai, "_reserve_row_shard_exchange_transient", lambda *a, **k: None)
    monkeypatch.setattr(sai.envs, "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", 1, raising=False)
    topk, max_model_len, total_seq_lens = 2048, 8192, 40960
    buffer = torch.full((num_tokens, topk), -7, dtype=torch.int32)
    sai.sparse_attn_indexer(
        torch.empty(num_tokens, 16),
        PREFIX,
        torch.zeros(4, BLOCK, HEAD_DIM + 4, dtype=torch.uint8),
        torch.zeros(num_tokens, HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn),
        None,
        torch.zeros(num_tokens, HEAD_DIM, dtype=torch.bfloat16),
        torch.zeros(num_tokens, HEADS),
        128,
        "ue8m0",
        topk,
        HEAD_DIM,
        max_model_len,
        total_seq_lens,
        buffer,
        False,
        False,
        indexer_backend="triton",  # the layer's resolved backend: no metadata in this run
        **_keywords_of_this_pin(sai.sparse_attn_indexer),
    )
    want = triton_dsa_topk.topk_workspace_bytes(topk, num_tokens, max(max_model_len, total_seq_lens), device="cpu")
    assert want >= 8 * num_tokens * triton_dsa_topk.topk_config(topk, max_model_len)["CAP"]
    assert len(requests) == 1, requests
    sizes = [(tuple(shape), dtype) for shape, dtype in requests[0]]
    assert ((want,), torch.uint8) in sizes, sizes
    assert ((sai.RADIX_TOPK_WORKSPACE_SIZE,), torch.uint8) not in sizes
    assert any(shape[0] == total_seq_lens for shape, _ in sizes), sizes  # the K-gather buffers next to it

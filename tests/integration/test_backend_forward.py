"""TRITON_MLA_SPARSE's impl, driven the way vLLM's MLA layer drives it, against a float64 reference.

CPU: the Triton kernels (ours and vLLM's index conversion) run in the interpreter, so the query
dtype is fp16 (the interpreter's bf16 tl.dot is broken; bf16 is covered by the GPU tests).
What this checks is the glue: the cache write through `do_kv_cache_update`, request-local top-k
positions turned into physical slots through the block table, the (W_UK-absorbed, rope) query
tuple, -1 padding, duplicates, several requests and MTP-style multi-token decodes, the k_scale of
the per-tensor fp8 format, and the LSE returned for decode context parallelism.
"""

from __future__ import annotations

import types

import pytest
import torch

LATENT, ROPE = 512, 64
BLOCK_SIZE = 64
TOPK = 128  # vLLM's index conversion tiles top-k by 128


@pytest.fixture(autouse=True)
def _single_rank(monkeypatch, vllm_module):
    """(0.33.0) The sparse MLA base asks the tensor-parallel group for its size; one rank here."""
    from vllm.model_executor.layers.attention import sparse_mla_attention

    if hasattr(sparse_mla_attention, "get_tensor_model_parallel_world_size"):
        monkeypatch.setattr(
            sparse_mla_attention, "get_tensor_model_parallel_world_size", lambda: 1
        )


def _make_impl(kv_cache_dtype: str, num_heads: int, topk_buffer: torch.Tensor):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.mla.triton_mla_sparse import TritonMLASparseImpl

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        impl = TritonMLASparseImpl(
            num_heads=num_heads,
            head_size=LATENT + ROPE,
            scale=256**-0.5,
            num_kv_heads=1,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=None,
            attn_type="decoder",
            kv_sharing_target_layer_name=None,
            topk_indices_buffer=topk_buffer,
            q_lora_rank=2048,
            kv_lora_rank=LATENT,
            qk_nope_head_dim=192,
            qk_rope_head_dim=ROPE,
            qk_head_dim=256,
            v_head_dim=256,
            kv_b_proj=None,
        )
    return impl


def _forward(impl, q, kv_cache, topk_local, block_table, req_id, layer):
    """Run the impl's decode path as this pin's MLA layer would.

    0.26.0: the impl's forward_mqa converts the indexer's request-local top-k itself.
    0.33.0: the shared base class converts it into rows of flat_kv_row_view(kv_cache) (on CUDA,
    through the index group's streams) and calls the impl's _forward_mqa_kernel; here the same
    conversion is done with vLLM's Triton kernel and the impl's part is called directly.
    """
    from vllm.v1.attention.backends.mla import sparse_utils
    from vllm.v1.attention.backends.mla.triton_mla_sparse import TritonMLASparseMetadata

    T = topk_local.shape[0]
    if hasattr(impl, "_forward_mqa_kernel"):
        _, stride_rows = sparse_utils.flat_kv_row_view(kv_cache, BLOCK_SIZE)
        physical, counts = sparse_utils.triton_convert_req_index_to_global_index(
            req_id, block_table, topk_local, BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_STRIDE_ROWS=stride_rows, NUM_TOPK_TOKENS=TOPK, return_valid_counts=True,
        )
        return impl._forward_mqa_kernel(
            q, kv_cache, physical, counts, layer=layer, block_size=BLOCK_SIZE, is_decode=True
        )
    md = TritonMLASparseMetadata(
        num_reqs=block_table.shape[0], max_query_len=T, max_seq_len=0, num_actual_tokens=T,
        query_start_loc=torch.zeros(block_table.shape[0] + 1, dtype=torch.int32),
        slot_mapping=torch.zeros(T, dtype=torch.int64), block_table=block_table,
        req_id_per_token=req_id, seq_lens=torch.zeros(block_table.shape[0], dtype=torch.int32),
        num_decodes=block_table.shape[0], num_prefills=0, num_decode_tokens=T,
        block_size=BLOCK_SIZE, topk_tokens=TOPK,
    )
    return impl.forward_mqa(q, kv_cache, md, layer)


def _cache(kv_cache_dtype: str, num_blocks: int) -> torch.Tensor:
    """A [num_blocks, BLOCK_SIZE, W] cache whose blocks are two pages apart (a view of a larger
    allocation, as when another layer's pages sit in between)."""
    if kv_cache_dtype == "fp8_ds_mla":
        full = torch.zeros(num_blocks, 2 * BLOCK_SIZE, 656, dtype=torch.uint8)
    elif kv_cache_dtype in ("fp8", "fp8_e4m3"):
        # vLLM hands the layer an fp8 view of its byte allocation for this format.
        full = torch.zeros(num_blocks, 2 * BLOCK_SIZE, LATENT + ROPE, dtype=torch.float8_e4m3fn)
    else:
        full = torch.zeros(num_blocks, 2 * BLOCK_SIZE, LATENT + ROPE, dtype=torch.float16)
    return full[:, :BLOCK_SIZE]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("num_heads", [8, 3])
def test_forward_mqa_matches_reference(vllm_module, kv_cache_dtype, num_heads):
    from vllm.v1.attention.ops.triton_mla_kv_cache import dequantize_mla_kv_cache

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    seq_lens = [150, 90, 40]  # request 1 decodes 2 tokens (MTP), the others one each
    query_lens = [1, 2, 1]
    num_blocks = 12
    block_table = torch.full((3, 4), -1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    used = 0
    for r, n in enumerate(seq_lens):
        nb = -(-n // BLOCK_SIZE)
        block_table[r, :nb] = perm[used : used + nb]
        used += nb

    # Write every context token through the impl, as the MLA layer does each step.
    positions = [(r, p) for r, n in enumerate(seq_lens) for p in range(n)]
    slots = torch.tensor(
        [int(block_table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for r, p in positions]
        + [-1],  # a padded token: must be skipped
        dtype=torch.int64,
    )
    kv_c = torch.randn(len(slots), LATENT, generator=g).half()
    k_pe = torch.randn(len(slots), 1, ROPE, generator=g).half()
    kv_cache = _cache(kv_cache_dtype, num_blocks)
    k_scale = torch.tensor([0.37], dtype=torch.float32)
    T = sum(query_lens)
    topk_buffer = torch.full((T + 5, TOPK), -7, dtype=torch.int32)  # poisoned beyond T rows
    impl = _make_impl(kv_cache_dtype, num_heads, topk_buffer)
    impl.do_kv_cache_update(kv_c, k_pe, kv_cache, slots, kv_cache_dtype, k_scale)

    # Request-local top-k positions (what the indexer writes): a random causal subset,
    # -1 padding, one duplicate.
    req_of_token = [r for r, n in enumerate(query_lens) for _ in range(n)]
    ctx_of_token = []
    for r, n in enumerate(query_lens):
        for j in range(n):
            ctx_of_token.append(seq_lens[r] - n + j + 1)
    for t, (r, ctx) in enumerate(zip(req_of_token, ctx_of_token)):
        k = min(TOPK - 8, ctx)
        pos = torch.randperm(ctx, generator=g)[:k].to(torch.int32)
        row = torch.full((TOPK,), -1, dtype=torch.int32)
        row[: pos.numel()] = pos
        row[TOPK - 1] = pos[0]  # duplicate: counts twice
        topk_buffer[t] = row

    # The MLA layer passes (W_UK-absorbed latent query as a transposed bmm output, rope query).
    ql_nope = torch.randn(num_heads, T, LATENT, generator=g).half().transpose(0, 1)
    q_pe = torch.randn(T, num_heads, ROPE, generator=g).half()
    layer = types.SimpleNamespace(_k_scale=k_scale, _k_scale_float=float(k_scale))
    impl.need_to_return_lse_for_decode = True  # as under decode context parallelism
    req_id = torch.tensor(req_of_token, dtype=torch.int32)
    out, lse = _forward(impl, (ql_nope, q_pe), kv_cache, topk_buffer[:T], block_table, req_id, layer)

    # float64 reference over the dequantized cache
    deq = dequantize_mla_kv_cache(
        kv_cache, "fp8" if kv_cache_dtype == "fp8" else kv_cache_dtype, k_scale,
        rope_dtype=torch.float16,
    ).double().reshape(-1, LATENT + ROPE)
    q = torch.cat([ql_nope, q_pe], dim=-1).double()
    ref_out = torch.empty(T, num_heads, LATENT, dtype=torch.float64)
    ref_lse = torch.empty(T, num_heads, dtype=torch.float64)
    for t, r in enumerate(req_of_token):
        local = topk_buffer[t][topk_buffer[t] >= 0].long()
        phys = block_table[r, local // BLOCK_SIZE].long() * BLOCK_SIZE + local % BLOCK_SIZE
        kv = deq[phys]
        s = (q[t] @ kv.T) * impl.scale
        ref_lse[t] = torch.logsumexp(s, dim=-1)
        ref_out[t] = torch.softmax(s, dim=-1) @ kv[:, :LATENT]

    assert out.shape == (T, num_heads, LATENT) and out.dtype == torch.float16
    assert torch.isfinite(out).all()
    err = (out.double() - ref_out).norm() / ref_out.norm()
    assert err < 5e-3, f"relative error {err:.2e}"
    assert lse is not None and lse.shape == (T, num_heads)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=2e-3)


def test_rows_with_no_selected_token_give_zeros_and_minus_inf(vllm_module):
    T, H = 2, 4
    topk_buffer = torch.full((T, TOPK), -1, dtype=torch.int32)
    topk_buffer[1, :3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    impl = _make_impl("fp8_ds_mla", H, topk_buffer)
    kv_cache = _cache("fp8_ds_mla", 2)
    impl.do_kv_cache_update(
        torch.randn(3, LATENT).half(),
        torch.randn(3, 1, ROPE).half(),
        kv_cache,
        torch.arange(3, dtype=torch.int64),
        "fp8_ds_mla",
        torch.ones(1),
    )
    impl.need_to_return_lse_for_decode = True
    q = torch.randn(T, H, LATENT + ROPE).half()
    layer = types.SimpleNamespace(_k_scale=torch.ones(1), _k_scale_float=1.0)
    out, lse = _forward(
        impl, q, kv_cache, topk_buffer, torch.tensor([[0], [0]], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), layer,
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


def test_impl_rejects_unsupported_cache_dtype(vllm_module):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _make_impl("fp8_e5m2", 4, torch.zeros(1, TOPK, dtype=torch.int32))


def test_base_forward_reads_the_topk_from_topk_start(vllm_module):
    """(0.34.0) ShardQ's narrowed metadata points the shared base's forward_mqa at row
    `topk_start` of the top-k buffer (the indexer wrote those tokens' top-k after the decodes);
    the base converts from there and calls our kernel step. Rows before it must not be read."""
    from vllm.v1.attention.backends.mla.triton_mla_sparse import TritonMLASparseMetadata

    if "topk_start" not in getattr(TritonMLASparseMetadata, "__dataclass_fields__", {}):
        pytest.skip("this pin's sparse MLA metadata has no topk_start (no ShardQ)")
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, H, OFF, ctx = 3, 4, 5, 100
    topk_buffer = torch.full((OFF + T + 2, TOPK), 10**6, dtype=torch.int32)  # poison: out of range
    block_table = torch.tensor([[1, 0]], dtype=torch.int32)
    for t in range(T):
        row = torch.full((TOPK,), -1, dtype=torch.int32)
        pos = torch.randperm(ctx, generator=g)[:40].to(torch.int32)
        row[:40] = pos
        topk_buffer[OFF + t] = row
    impl = _make_impl("fp8_ds_mla", H, topk_buffer)
    kv_cache = _cache("fp8_ds_mla", 2)
    slots = torch.tensor(
        [int(block_table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx)],
        dtype=torch.int64,
    )
    impl.do_kv_cache_update(
        torch.randn(ctx, LATENT, generator=g).half(), torch.randn(ctx, 1, ROPE, generator=g).half(),
        kv_cache, slots, "fp8_ds_mla", torch.ones(1),
    )
    impl.need_to_return_lse_for_decode = True
    q = torch.randn(T, H, LATENT + ROPE, generator=g).half()
    layer = types.SimpleNamespace(_k_scale=torch.ones(1), _k_scale_float=1.0)
    req_id = torch.zeros(T, dtype=torch.int32)
    md = TritonMLASparseMetadata(
        num_reqs=1, max_query_len=T, max_seq_len=ctx, num_actual_tokens=T,
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        slot_mapping=torch.zeros(T, dtype=torch.int64), num_decodes=0, num_decode_tokens=0,
        num_prefills=1, block_table=block_table, req_id_per_token=req_id,
        block_size=BLOCK_SIZE, topk_tokens=TOPK, topk_start=OFF,
    )
    out, lse = impl.forward_mqa(q, kv_cache, md, layer)
    want_out, want_lse = _forward(impl, q, kv_cache, topk_buffer[OFF:OFF + T], block_table, req_id, layer)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_output_buffer_reuse_only_where_the_caller_consumes_it(vllm_module):
    """0.26.0: the impl's forward_mqa is the layer's only attention call and MLA's forward consumes
    its output before returning, so from a key's second call on the output is the stream's reused
    buffer (same storage, new values). 0.33.0+: the base may call the kernel step twice per layer
    (0.34.0's HiSparse: decode rows, then prefill rows, outputs concatenated), so every call gets
    its own output."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, H, ctx = 2, 4, 60
    topk_buffer = torch.full((T, TOPK), -1, dtype=torch.int32)
    for t in range(T):
        topk_buffer[t, :30] = torch.randperm(ctx, generator=g)[:30].to(torch.int32)
    impl = _make_impl("fp8_ds_mla", H, topk_buffer)
    kv_cache = _cache("fp8_ds_mla", 1)
    impl.do_kv_cache_update(
        torch.randn(ctx, LATENT, generator=g).half(), torch.randn(ctx, 1, ROPE, generator=g).half(),
        kv_cache, torch.arange(ctx, dtype=torch.int64), "fp8_ds_mla", torch.ones(1),
    )
    layer = types.SimpleNamespace(_k_scale=torch.ones(1), _k_scale_float=1.0)
    block_table, req_id = torch.tensor([[0], [0]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    q1, q2 = (torch.randn(T, H, LATENT + ROPE, generator=g).half() for _ in range(2))
    run = lambda q: _forward(impl, q, kv_cache, topk_buffer, block_table, req_id, layer)[0]  # noqa: E731
    first = run(q1).clone()
    b = run(q2)
    b_values = b.clone()
    c = run(q1)
    torch.testing.assert_close(c, first, rtol=0, atol=0)  # right values on every call
    if hasattr(impl, "_forward_mqa_kernel"):  # 0.33.0+
        assert b.data_ptr() != c.data_ptr()
        torch.testing.assert_close(b, b_values, rtol=0, atol=0)  # not overwritten by the next call
    else:  # 0.26.0
        assert b.data_ptr() == c.data_ptr()

"""Our cache writers and the indexer K gather against vLLM 0.26.0's own compiled ops, byte for byte
(GPU). The ops come from the release wheel's `_C_stable_libtorch` (tests/kernels/vllm_peers.py:
staged by `python3 e2e/gpu_tests.py --prepare`, required there by GLM5_REQUIRE_PEERS=1).

* `concat_and_cache_mla` (MLA KV cache: fp8_ds_mla, per-tensor fp8, bf16) vs
  `mla_kv_cache_write` with the scale format the 0.26.0 pin's entry of
  overlay/.../triton_mla_sparse_compat.py names (amax / 448: "arbitrary_fp32");
* `indexer_k_quant_and_cache` (DSA indexer K cache, ue8m0 scales as GLM-5 uses) vs ours;
* `cp_gather_indexer_k_quant_cache` (chunked-prefill K gather) vs ours, on vLLM's cache bytes.
"""
from __future__ import annotations

import pytest
import torch

from kernels import triton_dsa_indexer as I
from kernels.triton_mla_kv_cache import mla_kv_cache_write
from tests.kernels import vllm_peers

PIN = "0.26.0"
# the fp8_ds_mla tile scales 0.26.0's writer stores (compat entry "impl-converts-topk")
DS_SCALE_FORMAT = "arbitrary_fp32"
WIDTH = {"fp8_ds_mla": 656, "fp8": 576}


def _mla_inputs(n: int, g: torch.Generator):
    # slices of one wider projection output (row strides != widths), magnitudes over 4 decades,
    # plus an all-zero latent row and one that saturates e4m3 (448) after scaling
    big = torch.randn((n, 512 + 64 + 40), device="cuda", generator=g)
    big[:, :512] *= torch.empty((n, 1), device="cuda").uniform_(0.01, 100.0, generator=g)
    big = big.to(torch.bfloat16)
    kv_c, k_pe = big[:, :512], big[:, 512 + 40:]
    kv_c[0].zero_()
    kv_c[1, :128] = 336.0
    return kv_c, k_pe


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "fp8", "auto"])
@pytest.mark.parametrize("n,num_blocks,block_size", [(4096, 96, 64), (37, 3, 16)])
def test_concat_and_cache_mla_bytes_equal_vllm(kv_cache_dtype, n, num_blocks, block_size, seed):
    ops = vllm_peers.cache_ops(PIN)
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv_c, k_pe = _mla_inputs(n, g)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=g)[:n].to(torch.int64)
    slots[::7] = -1  # padding tokens: nothing written
    k_scale = torch.tensor([0.037], device="cuda")
    if kv_cache_dtype in WIDTH:
        ours = torch.randint(0, 256, (num_blocks, block_size, WIDTH[kv_cache_dtype]), dtype=torch.uint8,
                             device="cuda", generator=g)
    else:
        ours = torch.randn((num_blocks, block_size, 576), device="cuda", generator=g).to(torch.bfloat16)
    theirs = ours.clone()
    mla_kv_cache_write(kv_c, k_pe, ours, slots, kv_cache_dtype, k_scale, ds_scale_format=DS_SCALE_FORMAT)
    ops.concat_and_cache_mla(kv_c, k_pe, theirs, slots, kv_cache_dtype, k_scale)
    torch.cuda.synchronize()
    a, b = ours.view(torch.uint8), theirs.view(torch.uint8)
    diff = (a != b).nonzero()
    assert diff.numel() == 0, (
        f"{kv_cache_dtype}: {diff.shape[0]} bytes differ from vLLM {PIN}'s concat_and_cache_mla, "
        f"first at [block, token, byte] {diff[0].tolist()}")


def _indexer_cache(num_blocks: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (num_blocks, 64, 132), dtype=torch.uint8, device="cuda", generator=g)


@pytest.mark.gpu
@pytest.mark.parametrize("n,num_blocks", [(5000, 200), (3, 2)])
def test_indexer_k_quant_and_cache_bytes_equal_vllm(n, num_blocks, seed):
    ops = vllm_peers.cache_ops(PIN)
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(n, 128, device="cuda", generator=g)
    k *= torch.empty(n, 1, device="cuda").uniform_(0.01, 30.0, generator=g)
    k = k.to(torch.bfloat16)
    k[0].zero_()
    slots = torch.randperm(num_blocks * 64, device="cuda", generator=g)[:n]
    slots[::13] = -1
    ours = _indexer_cache(num_blocks, g)
    theirs = ours.clone()
    I.indexer_k_quant_and_cache(k, ours, slots, 128, "ue8m0")
    ops.indexer_k_quant_and_cache(k, theirs, slots, 128, "ue8m0")
    torch.cuda.synchronize()
    differ = int((ours != theirs).sum())
    assert differ == 0, f"{differ} bytes differ from vLLM {PIN}'s indexer_k_quant_and_cache"


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[3000, 1, 0, 1999], [64], [1, 63, 65, 128]])
def test_cp_gather_indexer_k_quant_cache_equals_vllm(lens, seed):
    ops = vllm_peers.cache_ops(PIN)
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = 200
    # a cache written by vLLM's own writer, then gathered by both
    cache = _indexer_cache(num_blocks, g)
    n_written = num_blocks * 64
    k = (torch.randn(n_written, 128, device="cuda", generator=g) * 3).to(torch.bfloat16)
    ops.indexer_k_quant_and_cache(k, cache, torch.arange(n_written, device="cuda"), 128, "ue8m0")
    blocks_per_req = max(-(-max(lens) // 64), 1)
    block_table = torch.stack([torch.randperm(num_blocks, device="cuda", generator=g)[:blocks_per_req]
                               for _ in lens]).to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    ours_k = torch.empty(total, 128, dtype=torch.float8_e4m3fn, device="cuda")
    ours_s = torch.empty(total, 4, dtype=torch.uint8, device="cuda")
    theirs_k, theirs_s = torch.empty_like(ours_k), torch.empty_like(ours_s)
    I.cp_gather_indexer_k_quant_cache(cache, ours_k, ours_s, block_table, cu)
    ops.cp_gather_indexer_k_quant_cache(cache, theirs_k, theirs_s, block_table, cu)
    torch.cuda.synchronize()
    assert torch.equal(ours_k.view(torch.uint8), theirs_k.view(torch.uint8)), "gathered K bytes differ"
    assert torch.equal(ours_s, theirs_s), "gathered scale bytes differ"


def test_missing_peers_skip_here_and_fail_where_required(monkeypatch, tmp_path):
    """Without the staged library a comparison is skipped, but under GLM5_REQUIRE_PEERS=1 (the GPU
    run) it fails: the comparisons cannot silently drop out of the evidence."""
    monkeypatch.setattr(vllm_peers, "MANIFEST", tmp_path / "manifest.json")
    vllm_peers._load.cache_clear()
    monkeypatch.delenv(vllm_peers.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="not staged"):
        vllm_peers.cache_ops(PIN)
    monkeypatch.setenv(vllm_peers.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="not staged"):
        vllm_peers.cache_ops(PIN)
    vllm_peers._load.cache_clear()

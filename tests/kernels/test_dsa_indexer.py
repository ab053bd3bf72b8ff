# SPDX-License-Identifier: Apache-2.0
"""DSA indexer kernels (K-cache write, K gather, paged and ragged FP8 MQA logits) against their
PyTorch references. CPU: Triton interpreter at small shapes. GPU (``-m gpu``): GLM-5 shapes."""

from __future__ import annotations

import pytest
import torch

# --- interpreter setup: the shared module (also what tests/kernels/conftest.py imports) ----------
import os  # noqa: E402
import sys  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "kernels"))
from tests.triton_interpreter import _HAS_CUDA as HAS_CUDA, INTERPRET  # noqa: E402
DEVICE = "cuda" if (HAS_CUDA and not INTERPRET) else "cpu"
# ------------------------------------------------------------------------------------------------
# CPU interpreter: tl.dot on bf16 is wrong in triton 3.6's interpreter, so the K-cache write takes
# fp16 input on CPU and bf16 on the GPU (the logits run on fp8 operands in both modes).
KDTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton_dsa_indexer as I  # noqa: E402

FP8 = torch.float8_e4m3fn
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU (not the interpreter)")


def _poison_u8(shape, device=DEVICE):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)


def _make_cache(num_blocks, page, head_dim=128, device=DEVICE, scale_range=(0.1, 10.0), gen=None):
    """A fully written cache of random tokens (through the reference writer)."""
    n = num_blocks * page
    x = torch.randn(n, head_dim, generator=gen) * torch.empty(n, 1).uniform_(*scale_range, generator=gen)
    cache = torch.zeros(num_blocks, page, head_dim + 4, dtype=torch.uint8)
    I.indexer_k_quant_and_cache_reference(x.to(torch.float16), cache, torch.arange(n), head_dim, "ue8m0")
    return cache.to(device)


# ------------------------------------------------------------------------------------------------
# K-cache write
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("page", [16, 64])
def test_k_write_matches_reference(scale_fmt, page):
    g = torch.Generator().manual_seed(1)
    nb, D, T = 6, 128, 23
    k = (torch.randn(T + 3, D, generator=g) * torch.empty(T + 3, 1).uniform_(1e-3, 50, generator=g)).to(KDTYPE)
    k[4] = 0  # amax floor 1e-4
    k[5, :] = 1e-6
    k_strided = torch.empty(T + 3, 2 * D, dtype=KDTYPE)[:, :D]
    k_strided.copy_(k)
    slots = torch.randperm(nb * page, generator=g)[:T].long()
    slots[[2, 7]] = -1
    cache = _poison_u8((nb, page, D + 4))
    ref = cache.clone().cpu()
    I.indexer_k_quant_and_cache(k_strided.to(DEVICE), cache, slots.to(DEVICE), 128, scale_fmt)
    I.indexer_k_quant_and_cache_reference(k_strided, ref, slots, 128, scale_fmt)
    assert torch.equal(cache.cpu(), ref), f"{(cache.cpu() != ref).sum().item()} bytes differ"
    # skipped slots' bytes are untouched: the poison stays where no token was written
    if scale_fmt == "ue8m0":
        _, scales = I.dequant_indexer_k_cache(ref)
        written = scales.reshape(-1)[slots[slots >= 0]]
        assert torch.all(torch.log2(written) == torch.round(torch.log2(written)))


def test_k_write_layout_is_vllms():
    """Byte layout of one block: 64 x 128 e4m3 token-major, then 64 fp32 scales (vLLM's
    indexer_k_quant_and_cache_kernel: dst = blk*bs*stride + off*D; scale at bs*D + off*4)."""
    page, D = 64, 128
    k = torch.zeros(2, D, dtype=KDTYPE)
    k[0, 0] = 448.0  # scale 1 (ue8m0), value byte 0x7e
    k[1, 5] = -2.0  # scale 2^-7 (ue8m0 of 2/448), value -256 -> 0xf8
    cache = torch.zeros(3, page, D + 4, dtype=torch.uint8, device=DEVICE)
    I.indexer_k_quant_and_cache(k.to(DEVICE), cache, torch.tensor([64 + 3, 2 * 64 + 63], device=DEVICE), 128, "ue8m0")
    flat = cache.cpu().view(3, -1)
    assert flat[1, 3 * D + 0] == 0x7E
    assert torch.equal(flat[1, page * D + 3 * 4: page * D + 4 * 4].view(torch.float32), torch.tensor([1.0]))
    assert flat[2, 63 * D + 5] == 0xF8
    assert torch.equal(flat[2, page * D + 63 * 4:].view(torch.float32), torch.tensor([2.0 ** -7]))
    assert flat[0].sum() == 0 and flat[1, : 3 * D].sum() == 0


@triton.jit
def _soft_cvt_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(o_ptr + i, I._e4m3_bits_rne(x).to(tl.uint8), mask=i < n)


def test_soft_e4m3_conversion_is_rne():
    """The bit-exact fp32 -> e4m3 rounding used under the interpreter: every e4m3 value, every
    midpoint (ties to even), points next to them, subnormals and random values."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = vals[torch.isfinite(vals)]
    vals = torch.sort(torch.unique(vals)).values
    mids = (vals[1:] + vals[:-1]) / 2
    eps = torch.cat([mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)])
    rnd = torch.randn(4096) * torch.exp2(torch.randint(-12, 9, (4096,)).float())
    x = torch.cat([vals, mids, eps, rnd]).clamp(-448, 448)
    out = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    _soft_cvt_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), out, x.numel(), BLOCK=1024)
    ref = x.to(FP8).view(torch.uint8)
    ref_is_zero = (ref & 0x7F) == 0
    got = out.cpu()
    # -0.0 vs +0.0 aside (both decode to 0), the bits must agree
    same = (got == ref) | (ref_is_zero & ((got & 0x7F) == 0))
    assert same.all(), x[~same][:8]


def test_k_write_rejects_bad_input():
    cache = torch.zeros(2, 64, 132, dtype=torch.uint8, device=DEVICE)
    k = torch.zeros(4, 128, dtype=KDTYPE, device=DEVICE)
    with pytest.raises(ValueError):
        I.indexer_k_quant_and_cache(k, torch.zeros(2, 64, 130, dtype=torch.uint8, device=DEVICE),
                                    torch.zeros(4, dtype=torch.long, device=DEVICE), 128, "ue8m0")
    with pytest.raises(TypeError):
        I.indexer_k_quant_and_cache(k, cache.float(), torch.zeros(4, dtype=torch.long, device=DEVICE), 128, "ue8m0")
    with pytest.raises(ValueError):
        I.indexer_k_quant_and_cache(k[:2], cache, torch.zeros(4, dtype=torch.long, device=DEVICE), 128, "ue8m0")


# ------------------------------------------------------------------------------------------------
# K gather
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", [[20, 0, 37], [1], [64, 65, 3, 128]])
def test_cp_gather_matches_reference(lens):
    g = torch.Generator().manual_seed(2)
    page, nb = 16, 40
    cache = _make_cache(nb, page, gen=g)
    B = len(lens)
    maxb = max(1, max((l + page - 1) // page for l in lens))
    bt = torch.stack([torch.randperm(nb, generator=g)[:maxb + 2] for _ in range(B)]).int()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N = int(cu[-1]) + 7  # rows past the last request must stay untouched
    dk = _poison_u8((N, 128)).view(FP8)
    ds = _poison_u8((N, 4))
    dk_ref, ds_ref = dk.clone().cpu(), ds.clone().cpu()
    I.cp_gather_indexer_k_quant_cache(cache, dk, ds, bt.to(DEVICE), cu.to(DEVICE))
    I.cp_gather_indexer_k_quant_cache_reference(cache.cpu(), dk_ref, ds_ref, bt, cu)
    assert torch.equal(dk.cpu().view(torch.uint8), dk_ref.view(torch.uint8))
    assert torch.equal(ds.cpu(), ds_ref)


# ------------------------------------------------------------------------------------------------
# paged (decode) logits
# ------------------------------------------------------------------------------------------------


def _check_logits(out, ref, clean, rtol=2e-5):
    out = out.double().cpu()
    fin = torch.isfinite(ref)
    if clean:
        assert torch.equal(torch.isneginf(out), ~fin), "-inf mask differs from the context mask"
    else:
        assert torch.isfinite(out[fin]).all()
    if fin.any():
        err = ((out[fin] - ref[fin]).norm() / ref[fin].norm().clamp_min(1e-30)).item()
        assert err < rtol, err


@pytest.mark.parametrize("next_n,ctx_2d,clean,block_n", [
    (1, False, True, 16), (1, False, False, 32), (2, False, True, 16), (2, True, False, 16), (3, True, True, 32),
])
def test_paged_logits_matches_reference(next_n, ctx_2d, clean, block_n):
    g = torch.Generator().manual_seed(3)
    page, nb, H, D, B = 16, 24, 16, 128, 3
    cache = _make_cache(nb, page, gen=g)
    mml = 6 * page + 5  # not a multiple of the page: exercises the tail
    q = torch.randn(B, next_n, H, D, generator=g).to(FP8)
    w = torch.randn(B * next_n, H, generator=g)
    bt = torch.stack([torch.randperm(nb, generator=g)[:7] for _ in range(B)]).int()
    if ctx_2d:
        cl = torch.randint(1, mml + 1, (B, next_n), generator=g, dtype=torch.int32)
        cl[1, 0] = 0
    else:
        cl = torch.tensor([next_n, 40, mml], dtype=torch.int32)
    out = torch.full((B * next_n, mml), 12345.0, device=DEVICE)  # poison
    res = I.fp8_paged_mqa_logits(q.to(DEVICE), cache, w.to(DEVICE), cl.to(DEVICE), bt.to(DEVICE), mml,
                                 clean_logits=clean, out=out, BLOCK_N=block_n, TILES=2)
    assert res.data_ptr() == out.data_ptr()
    ref = I.fp8_paged_mqa_logits_reference(q, cache.cpu(), w, cl, bt, mml)
    _check_logits(res, ref, clean)


def test_paged_logits_accepts_4d_cache_view_and_weights_rows():
    g = torch.Generator().manual_seed(4)
    page, nb, H, D, B = 16, 8, 16, 128, 2
    cache = _make_cache(nb, page, gen=g)
    q = torch.randn(B, 1, H, D, generator=g).to(FP8)
    w = torch.randn(B + 3, H, generator=g)  # vLLM passes weights[:num_padded_tokens] of a larger buffer
    bt = torch.stack([torch.randperm(nb, generator=g)[:4] for _ in range(B)]).int()
    cl = torch.tensor([[33], [64]], dtype=torch.int32)
    res = I.fp8_paged_mqa_logits(q.to(DEVICE), cache.unsqueeze(-2), w[:B].to(DEVICE), cl.to(DEVICE), bt.to(DEVICE), 64)
    ref = I.fp8_paged_mqa_logits_reference(q, cache.cpu(), w[:B], cl, bt, 64)
    _check_logits(res, ref, True)


def test_paged_logits_rejects_bad_input():
    cache = torch.zeros(2, 64, 132, dtype=torch.uint8, device=DEVICE)
    q = torch.zeros(1, 1, 32, 128, dtype=FP8, device=DEVICE)
    w = torch.zeros(1, 32, device=DEVICE)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    cl = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError):
        I.fp8_paged_mqa_logits(q.float(), cache, w, cl, bt, 128)
    with pytest.raises(TypeError):
        I.fp8_paged_mqa_logits(q, cache, w, cl.long(), bt, 128)
    with pytest.raises(ValueError):
        I.fp8_paged_mqa_logits(q, cache, w[:, :16], cl, bt, 128)
    with pytest.raises(ValueError):
        I.fp8_paged_mqa_logits(q, cache, w, torch.ones(1, 3, dtype=torch.int32, device=DEVICE), bt, 128)


# ------------------------------------------------------------------------------------------------
# ragged (prefill) logits
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("H", [16, 32])
def test_ragged_logits_matches_reference(clean, H):
    g = torch.Generator().manual_seed(5)
    M, N, D = 11, 70, 128
    q = torch.randn(M, H, D, generator=g).to(FP8)
    kf = torch.randn(N, D, generator=g).to(FP8)
    ks = torch.rand(N, generator=g) + 0.05
    w = torch.randn(M, H, generator=g)
    # two requests in the chunk: causal rows like vLLM's cu_seqlen_ks / ke
    kst = torch.tensor([0] * 5 + [30] * 6, dtype=torch.int32)
    ke = torch.tensor([26, 27, 28, 29, 30] + [65, 66, 67, 68, 69, 70], dtype=torch.int32)
    ke[2] = 0  # an empty row
    kst[2] = 0
    out = torch.full((M, N), 777.0, device=DEVICE)
    res = I.fp8_mqa_logits(q.to(DEVICE), kf.to(DEVICE), ks.to(DEVICE), w.to(DEVICE), kst.to(DEVICE), ke.to(DEVICE),
                           clean_logits=clean, out=out, BLOCK_N=16)
    ref = I.fp8_mqa_logits_reference(q, kf, ks, w, kst, ke)
    if clean:
        _check_logits(res, ref, True)
    else:  # only the [ks, ke) region is defined
        fin = torch.isfinite(ref)
        got = res.double().cpu()
        err = ((got[fin] - ref[fin]).norm() / ref[fin].norm()).item()
        assert err < 2e-5


# ------------------------------------------------------------------------------------------------
# GPU: GLM-5 shapes (32 heads x 128, 64-token blocks, contexts 1 .. 128k)
# ------------------------------------------------------------------------------------------------


def _gpu_cache(num_tokens_total, page=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = (num_tokens_total + page - 1) // page + 1
    x = (torch.randn(nb * page, 128, device="cuda", generator=g)
         * torch.empty(nb * page, 1, device="cuda").uniform_(0.2, 5.0, generator=g)).to(torch.bfloat16)
    cache = torch.empty(nb, page, 132, dtype=torch.uint8, device="cuda")
    I.indexer_k_quant_and_cache(x, cache, torch.arange(nb * page, device="cuda"), 128, "ue8m0")
    return cache, nb


def _gpu_logits_ref_rows(q, cache, w, lens_rows, bt, rows, page=64):
    """float64 reference of selected rows, on the GPU."""
    vals, scales = I.dequant_indexer_k_cache(cache)
    B, nn_, H, D = q.shape
    outs = []
    for r in rows:
        b, j = divmod(r, nn_)
        L = int(lens_rows[r])
        nblk = (L + page - 1) // page
        kf = vals[bt[b, :nblk].long()].reshape(-1, D)[:L].double()
        ks = scales[bt[b, :nblk].long()].reshape(-1)[:L].double()
        s = torch.relu(q[b, j].double() @ kf.T)
        outs.append((w[r].double()[:, None] * s).sum(0) * ks)
    return outs


@gpu
@needs_gpu
@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("ctx", [1, 63, 64, 65, 2047, 4096, 32768, 131072])
def test_gpu_paged_logits_glm5_shapes(ctx, next_n):
    B, H, D, page = 3, 32, 128, 64
    max_model_len = max(ctx, 1) + 128
    cache, nb = _gpu_cache(B * (max_model_len + page), seed=ctx)
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(B, next_n, H, D, device="cuda", generator=g).to(FP8)
    w = torch.randn(B * next_n, H, device="cuda", generator=g) * 0.05
    nblk = (max_model_len + page - 1) // page
    bt = torch.stack([torch.randperm(nb, device="cuda", generator=g)[:nblk] for _ in range(B)]).int()
    cl = torch.tensor([ctx, max(ctx // 2, next_n), max(ctx - 1, next_n)], dtype=torch.int32, device="cuda")
    out = torch.full((B * next_n, max_model_len), 3.0e38, device="cuda")
    I.fp8_paged_mqa_logits(q, cache, w, cl, bt, max_model_len, clean_logits=True, out=out)
    lens_rows = I._row_context(cl, B, next_n)
    rows = list(range(B * next_n))
    refs = _gpu_logits_ref_rows(q, cache, w, lens_rows, bt, rows)
    for r, ref in zip(rows, refs):
        L = int(lens_rows[r])
        got = out[r, :L].double()
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, (r, L, err)
        assert torch.isneginf(out[r, L:]).all()


@gpu
@needs_gpu
def test_gpu_k_write_bf16_and_gather():
    g = torch.Generator(device="cuda").manual_seed(11)
    T, page, nb = 1000, 64, 40
    k = (torch.randn(T, 128, device="cuda", generator=g) * 3).to(torch.bfloat16)
    slots = torch.randperm(nb * page, device="cuda", generator=g)[:T]
    slots[::17] = -1
    cache = torch.randint(0, 256, (nb, page, 132), dtype=torch.uint8, device="cuda")
    ref = cache.clone().cpu()
    I.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0")
    I.indexer_k_quant_and_cache_reference(k.cpu(), ref, slots.cpu(), 128, "ue8m0")
    assert torch.equal(cache.cpu(), ref)
    lens = [700, 0, 1301, 64]
    bt = torch.stack([torch.randperm(nb, device="cuda", generator=g)[:25] for _ in lens]).int()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    N = int(cu[-1])
    dk = torch.empty(N, 128, dtype=FP8, device="cuda")
    ds = torch.empty(N, 4, dtype=torch.uint8, device="cuda")
    I.cp_gather_indexer_k_quant_cache(cache, dk, ds, bt, cu)
    dk2 = torch.empty(N, 128, dtype=FP8)
    ds2 = torch.empty(N, 4, dtype=torch.uint8)
    I.cp_gather_indexer_k_quant_cache_reference(cache.cpu(), dk2, ds2, bt.cpu(), cu.cpu())
    assert torch.equal(dk.cpu().view(torch.uint8), dk2.view(torch.uint8))
    assert torch.equal(ds.cpu(), ds2)


@gpu
@needs_gpu
def test_gpu_ragged_logits_glm5_shapes():
    g = torch.Generator(device="cuda").manual_seed(12)
    H, D = 32, 128
    # one chunk: request A (context 3000, 300 new tokens), request B (context 1000, all new)
    M, N = 300 + 1000, 3000 + 1000
    q = torch.randn(M, H, D, device="cuda", generator=g).to(FP8)
    kf = torch.randn(N, D, device="cuda", generator=g).to(FP8)
    ks = torch.rand(N, device="cuda", generator=g) + 0.05
    w = torch.randn(M, H, device="cuda", generator=g) * 0.05
    kst = torch.cat([torch.zeros(300), torch.full((1000,), 3000)]).int().cuda()
    ke = torch.cat([torch.arange(2701, 3001), 3001 + torch.arange(1000)]).int().cuda()
    out = I.fp8_mqa_logits(q, kf, ks, w, kst, ke, clean_logits=True)
    qd = q.double()
    kd = kf.double() * ks.double()[:, None]
    for rows in (slice(0, 40), slice(280, 330), slice(1250, 1300)):
        s = torch.relu(torch.einsum("mhd,nd->mhn", qd[rows], kd))
        ref = (w[rows].double()[:, :, None] * s).sum(1)
        cols = torch.arange(N, device="cuda")
        mask = (cols[None, :] >= kst[rows, None]) & (cols[None, :] < ke[rows, None])
        got = out[rows].double()
        assert torch.equal(torch.isneginf(got), ~mask)
        err = ((got[mask] - ref[mask]).norm() / ref[mask].norm()).item()
        assert err < 1e-5, err

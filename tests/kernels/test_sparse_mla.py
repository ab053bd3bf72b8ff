# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA decode vs its float64 reference: CPU interpreter on small shapes (fp16 queries: the
interpreter's bf16 tl.dot is wrong under Triton 3.6 + CPU torch), GPU at GLM-5 shapes (bf16)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import mla_kv_format
from kernels.triton_mla_kv_cache import mla_kv_cache_write, mla_kv_cache_write_reference
from kernels.triton_sparse_mla import sparse_mla_decode, sparse_mla_decode_reference
from tests.triton_interpreter import DEVICE

SCALE = 256 ** -0.5


def make_cache(fmt, nb, bs, dtype, device, k_scale=None, scale_format="arbitrary_fp32", writer=mla_kv_cache_write):
    n = nb * bs
    amp = torch.rand((n, 1), device=device) * 4 + 0.1
    kv_c = (torch.randn((n, 512), device=device) * amp).to(dtype)
    k_pe = torch.randn((n, 64), device=device).to(dtype)
    f = mla_kv_format.resolve_kv_format(fmt, dtype)
    cache = torch.empty((nb, bs, f.row_elems), dtype=f.storage_dtype, device=device)
    writer(kv_c, k_pe, cache, torch.arange(n, device=device), fmt, k_scale, ds_scale_format=scale_format)
    return cache


def head_error_scale(q, cache, idx, fmt, k_scale, ref_out, chunk=8):
    """Per (query row, head) scale E[t, h] of the kernel's error, float64 ``[T, H]``; the tests
    require ``||out[t, h] - ref[t, h]|| <= tol * E[t, h]`` with the tolerance ``tol`` that also
    bounds the whole output's relative error.

    Model (first order, independent roundings): the kernel computes with inputs perturbed by a
    relative error of size ``tol`` per element (K dequantized and rounded to the MMA dtype, P
    rounded before PV, out rounded at the store). A relative error ``tol`` of V moves out[t, h] by
    about ``tol * ||ref[t, h]||``; a relative error of K moves each score ``s_j`` by about
    ``tol * rho_j`` with ``rho_j = softmax_scale * sqrt(sum_d q_d^2 k_jd^2)`` (the RMS of
    independent per-element errors), which moves p_j by ``p_j * tol * rho_j`` (minus the
    renormalization) and out[t, h] by ``tol * sqrt(sum_j p_j^2 rho_j^2 ||v_j - ref[t, h]||^2)``.
    So ``E = ||ref[t, h]|| + sqrt(sum_j p_j^2 rho_j^2 ||v_j - ref[t, h]||^2)``: a peaked softmax
    over large scores is allowed proportionally more error than a flat one, while one head that is
    wrong (a swapped, zeroed or mis-scaled head) is not hidden by the others. Rows without a valid
    index have E = 0: their output must be exactly 0.
    test_head_error_model_holds_for_bf16_rounding checks the model against a PyTorch emulation of
    the kernel's bf16 rounding at GLM-5 sizes."""
    f = mla_kv_format.resolve_kv_format(fmt, q.dtype)
    kv = mla_kv_format.check_kv_cache(cache, f, q.dtype, fmt)
    nb, bs, w = kv.shape
    flat = kv.reshape(nb * bs, w)
    T, H, _ = q.shape
    out = torch.zeros((T, H), dtype=torch.float64, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        ix = idx[t0:t1].long()
        valid = (ix >= 0) & (ix < nb * bs)
        k = mla_kv_format.dequantize_rows(flat[torch.where(valid, ix, 0)], f, k_scale)  # [c, K, 576]
        qq = q[t0:t1].double()
        s = torch.einsum("chd,ckd->chk", qq, k) * SCALE
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all -inf rows: p = 0
        rho2 = torch.einsum("chd,ckd->chk", qq * qq, k * k) * SCALE ** 2
        r = ref_out[t0:t1]
        v = k[..., :512]
        dv2 = ((v * v).sum(-1)[:, None, :] - 2 * torch.einsum("ckd,chd->chk", v, r) + (r * r).sum(-1)[..., None])
        cond = torch.sqrt((p * p * rho2 * dv2.clamp_min(0)).sum(-1))
        out[t0:t1] = r.norm(dim=-1) + cond
    return out


def check_heads(out, ro, scale, tol):
    """Every (row, head): ||out - ref|| <= tol * scale (see head_error_scale)."""
    herr = (out.double() - ro).norm(dim=-1)
    bad = herr > tol * scale
    if bad.any():
        t, h = [int(x) for x in bad.nonzero()[0]]
        raise AssertionError(f"{int(bad.sum())} (row, head) pairs over the per-head bound; first ({t}, {h}): "
                             f"error {herr[t, h]:.3e} > {tol} * {scale[t, h]:.3e} (|ref| {ro[t, h].norm():.3e})")
    return float((herr / (tol * scale).clamp_min(1e-300)).max())


def check(q, cache, idx, fmt, k_scale=None, num_splits=None, tol=None, out=None, lse=None, config=None):
    T, H, _ = q.shape
    if out is None:
        out = torch.empty((T, H, 512), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    out.fill_(float("nan"))  # poison
    lse.fill_(float("nan"))
    o, l = sparse_mla_decode(q, cache, idx, SCALE, fmt, k_scale, out=out, lse=lse, num_splits=num_splits, config=config)
    assert o.data_ptr() == out.data_ptr() and l.data_ptr() == lse.data_ptr()
    ro, rl = sparse_mla_decode_reference(q, cache, idx, SCALE, fmt, k_scale)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten or NaN output"
    empty = ~((idx >= 0) & (idx < cache.shape[0] * cache.shape[1])).any(dim=1)
    assert torch.all(lse[empty] == float("-inf")) and torch.all(out[empty] == 0)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    if tol is None:
        tol = 1e-2 if q.dtype == torch.bfloat16 else 3e-3
    err = ((out.double() - ro).norm() / ro.norm().clamp_min(1e-30)).item()
    fin = torch.isfinite(rl)
    lerr = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    assert err < tol, f"relative error {err:.2e} >= {tol}"
    assert lerr < 10 * tol, f"lse error {lerr:.2e}"
    check_heads(out, ro, head_error_scale(q, cache, idx, fmt, k_scale, ro), tol)
    return err


# --------------------------------------------------------------------------------------------
# CPU (interpreter) or GPU: small shapes and edge cases
# --------------------------------------------------------------------------------------------

DT = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "auto"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_small_formats_and_splits(fmt, num_splits, seed):
    nb, bs, T, H, topk = 5, 16, 3, 5, 40
    ks = torch.tensor([0.05], device=DEVICE) if fmt == "fp8" else None
    cache = make_cache(fmt, nb, bs, DT, DEVICE, ks)
    q = torch.randn((T, H, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, nb * bs, (T, topk), device=DEVICE, dtype=torch.int32)
    idx[0, :11] = -1  # padding
    idx[2, 7] = idx[2, 8]  # duplicate
    check(q, cache, idx, fmt, ks, num_splits)


def test_edge_rows_duplicates_out_of_range(seed):
    nb, bs, T, H, topk = 4, 16, 4, 3, 33
    cache = make_cache("fp8_ds_mla", nb, bs, DT, DEVICE)
    q = torch.randn((T, H, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, nb * bs, (T, topk), device=DEVICE, dtype=torch.int32)
    idx[1] = -1  # no valid index: zeros and -inf
    idx[2, :] = 17  # one slot, 33 times: weight of each copy counts
    idx[3, :5] = nb * bs + 3  # out of range: contributes nothing (like -1)
    idx[3, 5:7] = -7  # any negative value = no token
    for ns in (1, 2):
        check(q, cache, idx, "fp8_ds_mla", num_splits=ns)
    # duplicates really count: lse([5, 5, 9]) = logaddexp(lse([5, 9]), lse([5]))
    def one(ix):
        return sparse_mla_decode(q[:1], cache, torch.tensor([ix], device=DEVICE, dtype=torch.int32), SCALE, "fp8_ds_mla")[1]
    assert torch.allclose(one([5, 5, 9]), torch.logaddexp(one([5, 9, -1]), one([5, -1, -1])), atol=1e-3)
    with pytest.raises(ValueError, match="slots"):
        sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", validate=True)


def test_strided_views_and_float_kscale(seed):
    """q, indices, out and lse as non-contiguous views (as vLLM hands them over); k_scale a float."""
    nb, bs, T, H, topk = 4, 16, 3, 6, 24
    cache = make_cache("fp8", nb, bs, DT, DEVICE, 0.04)
    qbig = torch.randn((T, H + 2, 600), device=DEVICE).to(DT)
    q = qbig[:, 1:H + 1, 10:586]
    ibig = torch.randint(0, nb * bs, (T, 2 * topk), device=DEVICE, dtype=torch.int32)
    idx = ibig[:, ::2]
    out = torch.empty((T, 512, H), device=DEVICE, dtype=DT).transpose(1, 2)
    lse = torch.empty((H, T), device=DEVICE, dtype=torch.float32).t()  # vLLM's merge_attn_states layout
    check(q, cache, idx, "fp8", 0.04, out=out, lse=lse)


def test_kv_cache_views_and_block_size(seed):
    """A cache that is a view into a bigger allocation (block stride != block_size * W), 4-D form."""
    nb, bs, T, H, topk = 3, 64, 2, 4, 50
    big = torch.zeros((nb, bs + 16, 656), dtype=torch.uint8, device=DEVICE)
    cache = big[:, :bs]
    cache.copy_(make_cache("fp8_ds_mla", nb, bs, DT, DEVICE))
    q = torch.randn((T, H, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, nb * bs, (T, topk), device=DEVICE, dtype=torch.int32)
    check(q, cache.unsqueeze(2), idx, "fp8_ds_mla")


def test_errors():
    cache = torch.zeros((2, 16, 656), dtype=torch.uint8, device=DEVICE)
    q = torch.zeros((1, 2, 576), dtype=DT, device=DEVICE)
    idx = torch.zeros((1, 4), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="kv_format"):
        sparse_mla_decode(q, cache, idx, SCALE, "int4")
    with pytest.raises(ValueError, match="rows of 576"):
        sparse_mla_decode(q, cache, idx, SCALE, "fp8")
    with pytest.raises(ValueError, match="int32"):
        sparse_mla_decode(q, cache, idx.long(), SCALE, "fp8_ds_mla")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        sparse_mla_decode(q.float(), cache, idx, SCALE, "fp8_ds_mla")
    with pytest.raises(ValueError, match="cache, got|must match q dtype"):
        other = torch.float16 if DT == torch.bfloat16 else torch.bfloat16
        sparse_mla_decode(q, torch.zeros((2, 16, 576), dtype=other, device=DEVICE), idx, SCALE, "auto")
    out, lse = sparse_mla_decode(q[:0], cache, idx[:0], SCALE, "fp8_ds_mla")
    assert out.shape == (0, 2, 512) and lse.shape == (0, 2)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(T=st.integers(1, 3), H=st.integers(1, 20), topk=st.integers(1, 70), fmt=st.sampled_from(["fp8_ds_mla", "fp8", "auto"]),
       splits=st.sampled_from([None, 1, 2, 5]), pad=st.floats(0.0, 0.6))
def test_property_shapes(T, H, topk, fmt, splits, pad):
    nb, bs = 3, 16
    cache = make_cache(fmt, nb, bs, DT, DEVICE, 0.06 if fmt == "fp8" else None)
    q = torch.randn((T, H, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, nb * bs, (T, topk), device=DEVICE, dtype=torch.int32)
    idx[torch.rand((T, topk), device=DEVICE) < pad] = -1
    check(q, cache, idx, fmt, 0.06 if fmt == "fp8" else None, splits)


def _emulate_kernel_rounding(q, cache, idx, fmt, k_scale, dt):
    """PyTorch emulation of the kernel's roundings (not of its order of summation): K
    dequantized to ``dt`` (fp8_ds_mla: e4m3 x scale rounded; fp8: e4m3 exact, k_scale folded into
    the fp32 score scale and the output; 16-bit: as stored), S in fp32, P rounded to ``dt``
    before PV with the fp32 sum as normalizer, out rounded to ``dt``."""
    f = mla_kv_format.resolve_kv_format(fmt, q.dtype)
    kv = mla_kv_format.check_kv_cache(cache, f, q.dtype, fmt)
    nb, bs, w = kv.shape
    valid = (idx >= 0) & (idx < nb * bs)
    rows = kv.reshape(nb * bs, w)[torch.where(valid, idx, 0).long()]
    ks = 1.0 if (fmt != "fp8" or k_scale is None) else float(k_scale)
    k = mla_kv_format.dequantize_rows(rows, f, None, torch.float32).to(dt).float()
    s = torch.einsum("thd,tkd->thk", q.float(), k) * (SCALE * ks)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    o = torch.einsum("thk,tkd->thd", p.to(dt).float(), k[..., :512]) * ks / p.sum(-1, keepdim=True)
    return o.to(dt)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "bfloat16"])
@pytest.mark.parametrize("dt, tol", [(torch.bfloat16, 1e-2), (torch.float16, 3e-3)])
def test_head_error_model_holds_for_bf16_rounding(fmt, dt, tol, seed):
    """The per-(row, head) bound is honest: an emulation of the kernel's roundings at GLM-5 sizes
    (topk 2048, 64 heads, peaked softmax from unit-variance q) stays within 70% of it at the
    tolerance the tests use for that dtype (bf16 on the GPU, fp16 in the interpreter); and it can
    fail: one head off by 10% (about 1% of the whole tensor's norm here), or two heads swapped, is
    caught."""
    nb, bs, T, H, topk = 64, 64, 3, 64, 2048
    fmt16 = fmt if fmt != "bfloat16" else ("bfloat16" if dt == torch.bfloat16 else "float16")
    ks = 0.02 if fmt == "fp8" else None
    cache = make_cache(fmt16, nb, bs, dt, "cpu", ks, writer=mla_kv_cache_write_reference)  # no interpreter
    q = torch.randn((T, H, 576)).to(dt)
    idx = torch.stack([torch.randperm(nb * bs)[:topk] for _ in range(T)]).to(torch.int32)
    idx[0, -300:] = -1
    ro, _ = sparse_mla_decode_reference(q, cache, idx, SCALE, fmt16, ks)
    scale = head_error_scale(q, cache, idx, fmt16, ks, ro)
    emu = _emulate_kernel_rounding(q, cache, idx, fmt16, ks, dt)
    assert ((emu.double() - ro).norm() / ro.norm()).item() < tol
    assert check_heads(emu, ro, scale, tol) < 0.7
    off = emu.clone()
    off[1, 5] *= 1.1
    with pytest.raises(AssertionError, match=r"first \(1, 5\)"):
        check_heads(off, ro, scale, tol)
    swap = emu.clone()
    swap[2, [7, 8]] = emu[2, [8, 7]]
    with pytest.raises(AssertionError, match="per-head bound"):
        check_heads(swap, ro, scale, tol)


# --------------------------------------------------------------------------------------------
# GPU at GLM-5 shapes (bf16)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "bfloat16"])
@pytest.mark.parametrize("H", [8, 16, 64, 128])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_gpu_glm5_shapes(fmt, H, T, seed):
    nb, bs, topk = 512, 64, 2048
    ks = torch.tensor([0.02], device="cuda") if fmt == "fp8" else None
    cache = make_cache(fmt, nb, bs, torch.bfloat16, "cuda", ks)
    q = torch.randn((T, H, 576), device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(nb * bs, device="cuda")[:topk] for _ in range(T)]).to(torch.int32)
    idx[0, -300:] = -1
    check(q, cache, idx, fmt, ks)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1152, 4096, 100])
@pytest.mark.parametrize("scale_format", ["arbitrary_fp32", "pow2_fp32"])
def test_gpu_topk_variants(topk, scale_format, seed):
    nb, bs, T, H = 256, 64, 7, 8
    cache = make_cache("fp8_ds_mla", nb, bs, torch.bfloat16, "cuda", scale_format=scale_format)
    q = torch.randn((T, H, 576), device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, nb * bs, (T, topk), device="cuda", dtype=torch.int32)
    idx[3] = -1
    check(q, cache, idx, "fp8_ds_mla")


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [False, True])
def test_gpu_configs(fold, seed):
    """Every tile configuration the dispatch can pick (and the folded-scale variant)."""
    nb, bs = 256, 64
    cache = make_cache("fp8_ds_mla", nb, bs, torch.bfloat16, "cuda")
    for H in (1, 8, 24, 64, 100, 128):
        q = torch.randn((3, H, 576), device="cuda").to(torch.bfloat16)
        idx = torch.randint(-50, nb * bs, (3, 2048), device="cuda", dtype=torch.int32)
        for prefetch in (True, False):
            check(q, cache, idx, "fp8_ds_mla", config={"DS_FOLD": fold, "PREFETCH": prefetch})


@pytest.mark.gpu
def test_gpu_prefill_many_rows(seed):
    nb, bs, T, H = 512, 64, 2500, 8
    cache = make_cache("fp8_ds_mla", nb, bs, torch.bfloat16, "cuda")
    q = torch.randn((T, H, 576), device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, nb * bs, (T, 2048), device="cuda", dtype=torch.int32)
    idx[:, :T % 2048] = -1
    check(q, cache, idx, "fp8_ds_mla")


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["fused", "separate"])
@pytest.mark.parametrize("H", [8, 64, 128])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_gpu_merge_variants(merge, H, T, seed):
    """Both merges of the split path at GLM-5 shapes: the dispatch's split count and 32 splits."""
    nb, bs, topk = 512, 64, 2048
    cache = make_cache("fp8_ds_mla", nb, bs, torch.bfloat16, "cuda")
    q = torch.randn((T, H, 576), device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(nb * bs, device="cuda")[:topk] for _ in range(T)]).to(torch.int32)
    idx[0, -300:] = -1
    if T > 1:
        idx[1] = -1  # empty row
    if T > 2:
        idx[2, :] = -1
        idx[2, 1000:1010] = 77  # one split with rows, the others empty
    for ns in (None, 32):
        check(q, cache, idx, "fp8_ds_mla", num_splits=ns, config={"MERGE": merge})


@pytest.mark.gpu
def test_gpu_fused_merge_deterministic_and_counters_zero(seed):
    """Many rows x 32 splits racing on their arrival counters: 30 calls give bit-identical results
    (the merge order does not depend on which program arrives last) and the counters are zero
    after every call."""
    import kernels.triton_sparse_mla as S

    nb, bs, T, H = 256, 64, 96, 8
    cache = make_cache("fp8_ds_mla", nb, bs, torch.bfloat16, "cuda")
    q = torch.randn((T, H, 576), device="cuda").to(torch.bfloat16)
    idx = torch.randint(-100, nb * bs, (T, 2048), device="cuda", dtype=torch.int32)
    o0, l0 = sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", num_splits=32, config={"MERGE": "fused"})
    for _ in range(30):
        o, l = sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", num_splits=32, config={"MERGE": "fused"})
        assert torch.equal(o, o0) and torch.equal(l, l0)
    torch.cuda.synchronize()
    assert not any(b.any() for b in S._COUNTERS.values())
    check(q, cache, idx, "fp8_ds_mla", num_splits=32, config={"MERGE": "fused"})


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["fused", "separate"])
def test_gpu_cuda_graph_capture(merge, seed, monkeypatch):
    import kernels.triton_sparse_mla as S

    monkeypatch.setenv("GLM5_SPARSE_MLA_MERGE", merge)
    S._PLANS.clear()
    nb, bs, T, H = 256, 64, 2, 8
    cache = make_cache("fp8_ds_mla", nb, bs, torch.bfloat16, "cuda")
    q = torch.randn((T, H, 576), device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, nb * bs, (T, 2048), device="cuda", dtype=torch.int32)
    out = torch.empty((T, H, 512), device="cuda", dtype=torch.bfloat16)
    lse = torch.empty((T, H), device="cuda", dtype=torch.float32)
    sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", out=out, lse=lse)  # warm up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", out=out, lse=lse)
    for _ in range(2):  # new data in the same buffers
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
        idx.copy_(torch.randint(-10, nb * bs, idx.shape, device="cuda", dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ro, rl = sparse_mla_decode_reference(q, cache, idx, SCALE, "fp8_ds_mla")
        assert ((out.double() - ro).norm() / ro.norm()).item() < 1e-2
        check_heads(out, ro, head_error_scale(q, cache, idx, "fp8_ds_mla", None, ro), 1e-2)
        assert not any(b.any() for b in S._COUNTERS.values())  # the fused merge reset its counters
    S._PLANS.clear()


@pytest.mark.gpu
def test_gpu_memcheck_subset(seed):
    """Small set run once under compute-sanitizer memcheck (see docs/notes/sparse_mla.md)."""
    nb, bs = 8, 64
    for fmt in ("fp8_ds_mla", "fp8", "bfloat16"):
        ks = torch.tensor([0.03], device="cuda") if fmt == "fp8" else None
        cache = make_cache(fmt, nb, bs, torch.bfloat16, "cuda", ks)
        for H, T, ns in ((8, 3, None), (64, 2, 1), (128, 1, 4), (5, 2, 3)):
            q = torch.randn((T, H, 576), device="cuda").to(torch.bfloat16)
            idx = torch.randint(-20, nb * bs + 20, (T, 300), device="cuda", dtype=torch.int32)
            for prefetch in (True, False):  # both loop structures, whatever the dispatch picks
                for merge in ("fused", "separate"):  # both merges (when the launch splits)
                    check(q, cache, idx, fmt, ks, ns, config={"PREFETCH": prefetch, "MERGE": merge})

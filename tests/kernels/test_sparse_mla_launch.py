# SPDX-License-Identifier: Apache-2.0
"""Host side of sparse_mla_decode: the per-key plan cache (validate once, launch directly) and the
dispatch override. On CPU the kernels run in the interpreter; on a GPU (compiled Triton) the same
tests run on CUDA tensors (a CPU tensor cannot reach a compiled kernel)."""

from __future__ import annotations

import pytest
import torch

import kernels.triton_sparse_mla as S
from kernels.triton_mla_kv_cache import mla_kv_cache_write
from tests.triton_interpreter import _HAS_CUDA, INTERPRET

SCALE = 256 ** -0.5
DT = torch.float16  # the interpreter's tl.dot needs fp16 (see test_sparse_mla.py)
DEV = "cuda" if _HAS_CUDA and not INTERPRET else "cpu"


def _cache(nb=3, bs=16):
    n = nb * bs
    cache = torch.empty((nb, bs, 656), dtype=torch.uint8, device=DEV)
    mla_kv_cache_write(torch.randn((n, 512), device=DEV).to(DT), torch.randn((n, 64), device=DEV).to(DT), cache,
                       torch.arange(n, device=DEV), "fp8_ds_mla")
    return cache


@pytest.fixture
def count_plans(monkeypatch):
    S._PLANS.clear()
    calls = []
    real = S._make_plan

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(S, "_make_plan", counting)
    yield calls
    S._PLANS.clear()


def test_same_key_reuses_the_plan_and_new_strides_revalidate(count_plans, seed):
    cache = _cache()
    T, H, topk = 2, 3, 20
    q = torch.randn((T, H, 576), device=DEV).to(DT)
    idx = torch.randint(0, 48, (T, topk), dtype=torch.int32, device=DEV)
    o1, l1 = S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla")
    assert len(count_plans) == 1 and len(S._PLANS) == 1
    plan = next(iter(S._PLANS.values()))
    q2 = torch.randn((T, H, 576), device=DEV).to(DT)  # new tensors, same key
    idx2 = torch.randint(-5, 48, (T, topk), dtype=torch.int32, device=DEV)
    o2, l2 = S.sparse_mla_decode(q2, cache, idx2, SCALE, "fp8_ds_mla")
    assert len(count_plans) == 1 and next(iter(S._PLANS.values())) is plan
    # the cached launch computes the new inputs (not a replay of the first call's result)
    ro, rl = S.sparse_mla_decode_reference(q2, cache, idx2, SCALE, "fp8_ds_mla")
    assert ((o2.double() - ro).norm() / ro.norm()).item() < 3e-3
    # a q view with other strides: a new key, validated and planned again
    qbig = torch.randn((T, H + 1, 600), device=DEV).to(DT)
    qv = qbig[:, :H, 16:592]
    qv.copy_(q2)
    o3, _ = S.sparse_mla_decode(qv, cache, idx2, SCALE, "fp8_ds_mla")
    assert len(count_plans) == 2 and len(S._PLANS) == 2
    assert torch.equal(o3, o2)
    # a changed shape that is invalid is caught: its key is new, so it is validated
    with pytest.raises(ValueError, match="indices must be"):
        S.sparse_mla_decode(q2, cache, idx2[:1], SCALE, "fp8_ds_mla")
    with pytest.raises(ValueError, match="int32"):
        S.sparse_mla_decode(q2, cache, idx2.long(), SCALE, "fp8_ds_mla")
    with pytest.raises(ValueError, match="rows of 656"):
        S.sparse_mla_decode(q2, cache[..., :576], idx2, SCALE, "fp8_ds_mla")
    # another scale or format is another key
    S.sparse_mla_decode(q2, cache, idx2, SCALE * 2, "fp8_ds_mla")
    assert len(count_plans) == 6 and len(S._PLANS) == 3


def test_uncached_calls_validate_every_time(count_plans, seed):
    cache = _cache()
    q = torch.randn((1, 2, 576), device=DEV).to(DT)
    idx = torch.randint(0, 48, (1, 8), dtype=torch.int32, device=DEV)
    for _ in range(2):
        S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", validate=True)
        S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", config={"PREFETCH": False})
    assert len(count_plans) == 4 and not S._PLANS
    # a pointer that is not 16-byte aligned: never cached (Triton specializes on alignment)
    qb = torch.randn((2 * 576 + 4,), device=DEV).to(DT)
    qm = qb[4:].view(1, 2, 576)
    assert qm.data_ptr() % 16
    S.sparse_mla_decode(qm, cache, idx, SCALE, "fp8_ds_mla")
    S.sparse_mla_decode(qm, cache, idx, SCALE, "fp8_ds_mla")
    assert len(count_plans) == 6 and not S._PLANS
    # fp8_ds_mla rows must be 16-byte aligned: a misaligned cache is still rejected after warm-up
    S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla")
    big = torch.zeros(cache.numel() + 8, dtype=torch.uint8, device=DEV)
    mis = big[8:].view(cache.shape)
    with pytest.raises(ValueError, match="16-byte aligned"):
        S.sparse_mla_decode(q, mis, idx, SCALE, "fp8_ds_mla")


class _FakeCompiled:
    """Stands in for a CompiledKernel: records what a direct launch passes."""

    def __init__(self):
        self.calls = []
        self.function = object()
        self.packed_metadata = object()

    def run(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("splits", [1, 3])
def test_direct_launch_passes_the_kernel_signature(monkeypatch, splits):
    """The direct launch hands the launcher every kernel parameter in the JIT signature's order:
    grid, stream, function, metadata, hooks, then one value per parameter of the kernel."""
    S._PLANS.clear()
    cache = _cache()
    T, H, topk = 2, 5, 96  # 3 tiles of BLOCK_N 32
    q = torch.randn((T, H, 576), device=DEV).to(DT)
    idx = torch.randint(0, 48, (T, 2 * topk), dtype=torch.int32, device=DEV)[:, ::2]
    ks = torch.tensor([0.5], device=DEV)
    cache8 = torch.zeros((3, 16, 576), dtype=torch.uint8, device=DEV)
    lse = torch.empty((H, T), device=DEV).t()
    S.sparse_mla_decode(q, cache8, idx, SCALE, "fp8", ks, lse=lse, num_splits=splits)  # plans + JIT launch
    (plan,) = S._PLANS.values()
    fk, fm = _FakeCompiled(), _FakeCompiled()
    plan.kernel, plan.merge_kernel = fk, fm
    monkeypatch.setattr(S, "_raw_stream", lambda index: 1234)
    out, lse2 = S.sparse_mla_decode(q, cache8, idx, SCALE, "fp8", ks, lse=lse, num_splits=splits)
    assert lse2 is lse and out.shape == (T, H, 512)
    (args,) = fk.calls
    assert args[:9] == (plan.grid, 1, 1, 1234, fk.function, fk.packed_metadata, None, None, None)
    names = S._sparse_mla_fwd_kernel.arg_names
    got = dict(zip(names, args[9:]))
    assert len(args) - 9 == len(names)
    # pointers as integers (the launcher then skips its per-pointer driver query)
    assert (got["q_ptr"], got["kv_ptr"], got["idx_ptr"]) == (q.data_ptr(), cache8.data_ptr(), idx.data_ptr())
    assert (got["out_ptr"], got["lse_ptr"], got["kscale_ptr"]) == (out.data_ptr(), lse.data_ptr(), ks.data_ptr())
    assert (got["num_heads"], got["topk"], got["num_slots"], got["block_size"]) == (H, topk, 48, 16)
    assert (got["stride_qt"], got["stride_qh"], got["stride_qd"]) == q.stride()
    assert (got["stride_kb"], got["stride_ks"]) == (16 * 576, 576)
    assert (got["stride_it"], got["stride_ik"]) == idx.stride()
    assert (got["stride_ot"], got["stride_oh"], got["stride_od"]) == out.stride()
    assert (got["stride_lt"], got["stride_lh"]) == lse.stride()
    assert got["KV_FORMAT"] == S._FMT_FP8 and got["KSCALE_FROM_PTR"] is True
    assert got["SPLIT"] == (splits > 1) and got["num_splits"] == splits
    assert abs(got["qk_scale_log2"] - SCALE * S._LOG2E) < 1e-12 and got["v_scale"] == 1.0
    for name in ("DS_FOLD", "PREFETCH", "BLOCK_H", "BLOCK_N"):
        assert got[name] == plan.meta[name]
    if splits > 1:
        (margs,) = fm.calls
        mgot = dict(zip(S._sparse_mla_merge_kernel.arg_names, margs[9:]))
        assert len(margs) - 9 == len(S._sparse_mla_merge_kernel.arg_names)
        assert (mgot["out_ptr"], mgot["lse_ptr"], mgot["num_splits"]) == (out.data_ptr(), lse.data_ptr(), splits)
        assert (mgot["stride_lt"], mgot["stride_lh"]) == lse.stride()
        # one scratch block [po | plse]: po of T*H*splits*512 fp32, then plse
        assert (mgot["po_ptr"], mgot["plse_ptr"]) == (got["po_ptr"], got["plse_ptr"])
        assert got["plse_ptr"] - got["po_ptr"] == T * H * splits * 512 * 4 and got["po_ptr"] % 16 == 0
    else:
        assert not fm.calls
    S._PLANS.clear()


def test_dispatch_cc_override(monkeypatch):
    monkeypatch.delenv("GLM5_SPARSE_MLA_DISPATCH_CC", raising=False)
    assert S._dispatch_major(9) == 9
    q = torch.zeros((4, 64, 576), dtype=DT)
    cache = torch.zeros((2, 16, 656), dtype=torch.uint8)
    idx = torch.zeros((4, 64), dtype=torch.int32)
    base = S._make_plan(q, cache, idx, SCALE, "fp8_ds_mla", None, None, None, None, None)
    assert base.meta["BLOCK_H"] == S._pick_config(64, 0, 4)["BLOCK_H"] == 32  # CPU plans as "other"
    monkeypatch.setenv("GLM5_SPARSE_MLA_DISPATCH_CC", "9")
    assert S._dispatch_major(12) == 9
    forced = S._make_plan(q, cache, idx, SCALE, "fp8_ds_mla", None, None, None, None, None)
    assert forced.meta["BLOCK_H"] == 64 and forced.meta["num_stages"] == S._pick_config(64, 9, 4)["num_stages"]
    monkeypatch.setenv("GLM5_SPARSE_MLA_DISPATCH_CC", "12")
    assert S._make_plan(q, cache, idx, SCALE, "fp8_ds_mla", None, None, None, None, None).meta == dict(
        base.meta)  # SM120 configs = the non-Hopper table
    monkeypatch.setenv("GLM5_SPARSE_MLA_DISPATCH_CC", "sm120")
    with pytest.raises(ValueError, match="GLM5_SPARSE_MLA_DISPATCH_CC"):
        S._dispatch_major(9)


def test_zero_rows_and_given_outputs_are_returned(count_plans):
    cache = _cache()
    q = torch.zeros((0, 2, 576), dtype=DT, device=DEV)
    idx = torch.zeros((0, 8), dtype=torch.int32, device=DEV)
    for _ in range(2):
        o, l = S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla")
        assert o.shape == (0, 2, 512) and l.shape == (0, 2)
    assert len(count_plans) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8"])
@pytest.mark.parametrize("T", [1, 3, 200])  # split and non-split plans
def test_gpu_direct_launch_matches_jit(fmt, T, seed):
    """The first call of a key goes through Triton's JIT and caches the compiled kernels; the
    second launches them directly. Same inputs -> bit-identical outputs; the direct path is
    really taken (the plan holds a compiled kernel)."""
    S._PLANS.clear()
    nb, bs, H, topk = 64, 64, 8, 2048
    ks = torch.tensor([0.02], device="cuda") if fmt == "fp8" else None
    # a cache as vLLM writes it (random bytes make |q.k| ~ 1e3: the softmax is then a near one-hot
    # whose pick depends on the bf16 rounding of dequantized K, which the reference does not share)
    cache = torch.empty((nb, bs, 656 if fmt == "fp8_ds_mla" else 576), dtype=torch.uint8, device="cuda")
    n = nb * bs
    mla_kv_cache_write(torch.randn((n, 512), device="cuda").to(torch.bfloat16),
                       torch.randn((n, 64), device="cuda").to(torch.bfloat16), cache,
                       torch.arange(n, device="cuda"), fmt, ks)
    q = torch.randn((T, H, 576), device="cuda").to(torch.bfloat16)
    idx = torch.randint(-10, nb * bs, (T, topk), device="cuda", dtype=torch.int32)
    o1, l1 = S.sparse_mla_decode(q, cache, idx, SCALE, fmt, ks)
    (plan,) = S._PLANS.values()
    assert plan.kernel is not None and (plan.merge_kernel is not None) == plan.split
    o2, l2 = S.sparse_mla_decode(q, cache, idx, SCALE, fmt, ks)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    ro, rl = S.sparse_mla_decode_reference(q, cache, idx, SCALE, fmt, ks)
    err = ((o2.double() - ro).norm() / ro.norm()).item()
    assert err < 1e-2, err
    S._PLANS.clear()

# SPDX-License-Identifier: Apache-2.0
"""Host side of sparse_mla_decode: the per-key plan cache (validate once, launch directly) and the
dispatch override. On CPU the kernels run in the interpreter; on a GPU (compiled Triton) the same
tests run on CUDA tensors (a CPU tensor cannot reach a compiled kernel)."""

from __future__ import annotations

import functools

import pytest
import torch
import triton

import kernels.triton_sparse_mla as S
from kernels.triton_mla_kv_cache import mla_kv_cache_write
from tests.kernels.fake_compiled import FakeCompiled
from tests.triton_interpreter import DEVICE

SCALE = 256 ** -0.5
DT = torch.float16  # the interpreter's tl.dot needs fp16 (see test_sparse_mla.py)


def _cache(nb=3, bs=16):
    n = nb * bs
    cache = torch.empty((nb, bs, 656), dtype=torch.uint8, device=DEVICE)
    mla_kv_cache_write(torch.randn((n, 512), device=DEVICE).to(DT), torch.randn((n, 64), device=DEVICE).to(DT), cache,
                       torch.arange(n, device=DEVICE), "fp8_ds_mla")
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
    q = torch.randn((T, H, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, 48, (T, topk), dtype=torch.int32, device=DEVICE)
    o1, l1 = S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla")
    assert len(count_plans) == 1 and len(S._PLANS) == 1
    plan = next(iter(S._PLANS.values()))
    q2 = torch.randn((T, H, 576), device=DEVICE).to(DT)  # new tensors, same key
    idx2 = torch.randint(-5, 48, (T, topk), dtype=torch.int32, device=DEVICE)
    o2, l2 = S.sparse_mla_decode(q2, cache, idx2, SCALE, "fp8_ds_mla")
    assert len(count_plans) == 1 and next(iter(S._PLANS.values())) is plan
    # the cached launch computes the new inputs (not a replay of the first call's result)
    ro, rl = S.sparse_mla_decode_reference(q2, cache, idx2, SCALE, "fp8_ds_mla")
    assert ((o2.double() - ro).norm() / ro.norm()).item() < 3e-3
    # a q view with other strides: a new key, validated and planned again
    qbig = torch.randn((T, H + 1, 600), device=DEVICE).to(DT)
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
    q = torch.randn((1, 2, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, 48, (1, 8), dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", validate=True)
        S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", config={"PREFETCH": False})
    assert len(count_plans) == 4 and not S._PLANS
    # a pointer that is not 16-byte aligned: never cached (Triton specializes on alignment)
    qb = torch.randn((2 * 576 + 4,), device=DEVICE).to(DT)
    qm = qb[4:].view(1, 2, 576)
    assert qm.data_ptr() % 16
    S.sparse_mla_decode(qm, cache, idx, SCALE, "fp8_ds_mla")
    S.sparse_mla_decode(qm, cache, idx, SCALE, "fp8_ds_mla")
    assert len(count_plans) == 6 and not S._PLANS
    # fp8_ds_mla rows must be 16-byte aligned: a misaligned cache is still rejected after warm-up
    S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla")
    big = torch.zeros(cache.numel() + 8, dtype=torch.uint8, device=DEVICE)
    mis = big[8:].view(cache.shape)
    with pytest.raises(ValueError, match="16-byte aligned"):
        S.sparse_mla_decode(q, mis, idx, SCALE, "fp8_ds_mla")




@pytest.mark.parametrize("splits, merge", [(1, None), (3, "separate"), (3, "fused")])
def test_direct_launch_passes_the_kernel_signature(monkeypatch, splits, merge):
    """The direct launch hands the launcher every kernel parameter in the JIT signature's order:
    grid, stream, function, metadata, hooks, then one value per parameter of the kernel."""
    S._PLANS.clear()
    cache = _cache()
    T, H, topk = 2, 5, 96  # 3 tiles of BLOCK_N 32
    q = torch.randn((T, H, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, 48, (T, 2 * topk), dtype=torch.int32, device=DEVICE)[:, ::2]
    ks = torch.tensor([0.5], device=DEVICE)
    cache8 = torch.zeros((3, 16, 576), dtype=torch.uint8, device=DEVICE)
    lse = torch.empty((H, T), device=DEVICE).t()
    if merge:
        monkeypatch.setenv("GLM5_SPARSE_MLA_MERGE", merge)
    S.sparse_mla_decode(q, cache8, idx, SCALE, "fp8", ks, lse=lse, num_splits=splits)  # plans + JIT launch
    (plan,) = S._PLANS.values()
    assert plan.merge == merge
    fk, fm = FakeCompiled(), FakeCompiled()
    S.bind_kernels(plan, fk, fm)  # no CudaLauncher: launched through run(), as Triton's path
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
    assert got["FUSED_MERGE"] == (merge == "fused")
    if merge == "fused":
        # no merge launch; the arrival counters: the (device, stream) buffer, zero, one per (row, head block)
        assert not fm.calls
        cnt = S._COUNTERS[(plan.dev_index, 1234)]
        assert got["cnt_ptr"] == cnt.data_ptr() and cnt.numel() >= T and not cnt.any()
        S._COUNTERS.pop((plan.dev_index, 1234))
        assert got["plse_ptr"] - got["po_ptr"] == T * H * splits * 512 * 4 and got["po_ptr"] % 16 == 0
    elif splits > 1:
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



def _cuda_launcher(recorder, scratch: int = 0):
    """A Triton CudaLauncher whose compiled C entry point is ``recorder`` (no CUDA needed)."""
    from triton.backends.nvidia.driver import CudaLauncher

    run = object.__new__(CudaLauncher)
    run.launch = recorder
    run.num_ctas = 1
    run.global_scratch_size, run.global_scratch_align = scratch, 16
    run.profile_scratch_size, run.profile_scratch_align = 0, 1
    run.launch_cooperative_grid, run.launch_pdl = False, False
    return run


def test_launcher_calls_the_c_entry_point_as_triton_run_does():
    """On Triton 3.6 the direct launch calls the launcher's C entry point with exactly the values
    CompiledKernel.run (CudaLauncher.__call__) would pass it; a kernel that needs global scratch
    (or another Triton) keeps run()."""
    calls = []
    rec = lambda *a: calls.append(a)  # noqa: E731
    k = FakeCompiled()
    k.run = _cuda_launcher(rec)
    args = (111, 222, 3, 4.5, True, 16)
    k.run(7, 1, 1, 99, k.function, k.packed_metadata, None, None, None, *args)  # Triton's own path
    launch, head = S.launcher(k)
    if not S._c_launch_known():
        assert launch is k.run
        pytest.skip(f"Triton {triton.__version__}: direct launches go through run()")
    assert launch is rec
    launch(7, 1, 1, 99, *head, *args)
    assert len(calls) == 2 and calls[0] == calls[1]
    k2 = FakeCompiled()
    k2.run = _cuda_launcher(rec, scratch=64)
    assert S.launcher(k2)[0] is k2.run


def test_direct_launch_uses_the_stream_workspace_for_partials(monkeypatch):
    """v1's split path takes its [po | plse] block from the stream's workspace (no allocation per
    call): two calls on one stream pass the same partial pointers."""
    S._PLANS.clear()
    cache = _cache()
    T, H, topk = 2, 5, 96
    q = torch.randn((T, H, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, 48, (T, topk), dtype=torch.int32, device=DEVICE)
    monkeypatch.setenv("GLM5_SPARSE_MLA_MERGE", "separate")
    S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", num_splits=3)
    (plan,) = S._PLANS.values()
    fk, fm = FakeCompiled(), FakeCompiled()
    S.bind_kernels(plan, fk, fm)
    monkeypatch.setattr(S, "_raw_stream", lambda index: 4321)
    for _ in range(2):
        S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", num_splits=3)
    names = S._sparse_mla_fwd_kernel.arg_names
    a, b = (dict(zip(names, c[9:])) for c in fk.calls)
    ws = S._WORKSPACES.pop((plan.dev_index, 4321))
    assert a["po_ptr"] == b["po_ptr"] == ws.data_ptr() and ws.numel() >= plan.scratch_numel
    assert a["plse_ptr"] == b["plse_ptr"] == ws.data_ptr() + plan.plse_offset
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
    q = torch.zeros((0, 2, 576), dtype=DT, device=DEVICE)
    idx = torch.zeros((0, 8), dtype=torch.int32, device=DEVICE)
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


# --------------------------------------------------------------------------------------------
# Merge of the split path: fused (last arriver merges) vs separate (second kernel)
# --------------------------------------------------------------------------------------------


def test_pick_merge_cost_model():
    """The dispatch's merge choice at the H200's 132 SMs (docs/notes/sparse_mla.md, "Merge"): fused
    up to FUSED_MERGE_MAX_SPLITS splits, where the H200 measured it faster, separate above."""
    def pick(H, T, sms=132):
        c = S._pick_config(H, 9, T)
        n_hb = -(-H // c["BLOCK_H"])
        ns = S._pick_num_splits(T, n_hb, 2048, c["BLOCK_N"], sms, c["WAVES"])
        ns = -(-(-(-2048 // c["BLOCK_N"])) // -(-(-(-2048 // c["BLOCK_N"])) // ns))  # as _make_plan: no empty split
        return ns, S._pick_merge(T, H, c["BLOCK_H"], ns, sms)

    assert [pick(8, t) for t in (1, 4, 32, 64, 128)] == [
        (64, "separate"), (64, "separate"), (8, "separate"), (3, "fused"), (2, "fused")]
    assert pick(64, 16) == (16, "separate")  # the end-to-end profile's shape (32k context, batch 16)
    assert [pick(64, t) for t in (1, 4, 32, 64, 128)] == [
        (32, "separate"), (32, "separate"), (8, "separate"), (5, "fused"), (3, "fused")]


def test_merge_override_and_config(monkeypatch):
    q = torch.zeros((2, 8, 576), dtype=DT)
    cache = torch.zeros((2, 16, 656), dtype=torch.uint8)
    idx = torch.zeros((2, 256), dtype=torch.int32)
    plan = functools.partial(S._make_plan, q, cache, idx, SCALE, "fp8_ds_mla", None, None, None)
    monkeypatch.delenv("GLM5_SPARSE_MLA_MERGE", raising=False)
    assert plan(1, None).merge is None and not plan(1, None).fused  # no split, no merge
    for m in S.MERGE_MODES:
        p = plan(4, {"MERGE": m})
        assert p.merge == m and p.fused == (m == "fused") and p.meta["FUSED_MERGE"] == p.fused
        assert p.cnt_numel == 2  # one counter per (row, head block)
        monkeypatch.setenv("GLM5_SPARSE_MLA_MERGE", m)
        assert plan(4, None).merge == m
    with pytest.raises(ValueError, match="MERGE"):
        plan(4, {"MERGE": "both"})
    monkeypatch.setenv("GLM5_SPARSE_MLA_MERGE", "yes")
    with pytest.raises(ValueError, match="GLM5_SPARSE_MLA_MERGE"):
        plan(4, None)


def _counter_key():
    """The (device, stream) key of the counter buffer a call made now uses."""
    if DEVICE == "cpu":
        return (-1, 0)
    d = torch.cuda.current_device()
    return (d, S._raw_stream(d))


@pytest.fixture
def poisoned_scratch(monkeypatch):
    """torch.empty of float tensors returns NaN-filled memory (the split path's partials): a merge
    that reads a partial before it is written sees NaN instead of a stale copy of an earlier call."""
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _merge_inputs(T=5, H=5, topk=224):
    cache = _cache(nb=4)  # 64 slots
    q = torch.randn((T, H, 576), device=DEVICE).to(DT)
    idx = torch.randint(0, 64, (T, topk), dtype=torch.int32, device=DEVICE)
    idx[0, ::3] = -1  # padding
    idx[1] = -1  # empty row: zeros and -inf
    idx[2] = -1
    idx[2, 100:130] = torch.arange(30, dtype=torch.int32) + 3  # only one split of 7 (32 slots each) has rows
    idx[3, :50] = 9  # duplicates
    idx[3, 50:60] = 64 + 7  # out of range
    idx[4, -1] = 11  # only the last slot of the last split
    idx[4, :-1] = -1
    return cache, q, idx


@pytest.mark.parametrize("merge", S.MERGE_MODES)
def test_merge_many_splits_edge_rows(merge, seed, poisoned_scratch):
    """7 splits of 32 slots: empty rows, a row whose splits are all empty but one, duplicates and
    out-of-range slots; both merges against the float64 reference and against each other."""
    cache, q, idx = _merge_inputs()
    ro, rl = S.sparse_mla_decode_reference(q, cache, idx, SCALE, "fp8_ds_mla")
    res = {}
    for m in S.MERGE_MODES:
        out = torch.full((5, 5, 512), float("nan"), dtype=DT, device=DEVICE)
        lse = torch.full((5, 5), float("nan"), device=DEVICE)
        S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", out=out, lse=lse, num_splits=7, config={"MERGE": m})
        res[m] = (out, lse)
    out, lse = res[merge]
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    for t in (0, 2, 3, 4):
        assert ((out[t].double() - ro[t]).norm() / ro[t].norm()).item() < 3e-3, t
    fin = torch.isfinite(rl)
    assert (lse.double()[fin] - rl[fin]).abs().max().item() < 3e-2
    # the two merges sum the same partials in another order: equal to rounding
    assert ((res["fused"][0].double() - res["separate"][0].double()).norm() / ro.norm()).item() < 2e-3
    assert torch.allclose(res["fused"][1], res["separate"][1], atol=1e-5, equal_nan=False) or \
        torch.equal(torch.isinf(res["fused"][1]), torch.isinf(res["separate"][1]))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert not S._COUNTERS[_counter_key()].any()  # the fused merge left its counters at zero


def test_fused_merge_repeated_calls_reuse_the_counters(monkeypatch, count_plans, seed, poisoned_scratch):
    """The cached plan with the fused merge: repeated calls (new inputs in between) reuse one
    zeroed counter buffer, give identical results for identical inputs, and leave it zero; two
    head blocks per row (H = 40 > BLOCK_H = 32 on this dispatch) have their own counters."""
    monkeypatch.setenv("GLM5_SPARSE_MLA_MERGE", "fused")
    cache, q, idx = _merge_inputs(H=40 if DEVICE == "cpu" else 72, topk=160)
    first = S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", num_splits=5)
    (plan,) = S._PLANS.values()
    assert plan.fused and plan.cnt_numel == 5 * 2
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    buf = S._COUNTERS[_counter_key()]
    assert not buf.any()
    other = S.sparse_mla_decode(q.flip(0), cache, idx.flip(0), SCALE, "fp8_ds_mla", num_splits=5)
    for _ in range(2):
        again = S.sparse_mla_decode(q, cache, idx, SCALE, "fp8_ds_mla", num_splits=5)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    assert torch.equal(other[0], first[0].flip(0))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert len(count_plans) == 1 and S._COUNTERS[_counter_key()] is buf and not buf.any()  # same plan, same buffer
    ro, _ = S.sparse_mla_decode_reference(q, cache, idx, SCALE, "fp8_ds_mla")
    assert ((first[0].double() - ro).norm() / ro.norm()).item() < 3e-3


def test_counter_buffer_grows_and_keeps_the_old_one():
    S._COUNTERS.pop((-7, 0), None)
    a = S._counters("cpu", -7, 0, 10)
    assert a.numel() == 1024 and not a.any() and S._counters("cpu", -7, 0, 1024) is a
    b = S._counters("cpu", -7, 0, 1025)
    assert b.numel() == 2048 and any(x is a for x in S._RETIRED_COUNTERS)  # a graph may still point at a
    assert S._counters("cpu", -7, 1, 5) is not b  # another stream: its own buffer
    S._COUNTERS.pop((-7, 0)), S._COUNTERS.pop((-7, 1))


def test_sm120_specs_cover_every_dispatch_choice():
    """SM120_COMPILE_SPECS is generated from the dispatch: every (tile config, split, merge) that
    _pick_config / _pick_num_splits / _pick_merge choose on SM120 for any head count, row count
    and SM count (RTX PRO 6000 188, RTX 5090 170, DGX Spark 48) is one of the compiled specs, and
    with a split both merges are (the override can force either)."""
    import random

    have = set()
    for s in S.SM120_COMPILE_SPECS():
        if s["fn"] is S._sparse_mla_fwd_kernel:
            c = s["constexprs"]
            have.add((c["BLOCK_H"], c["BLOCK_N"], s["num_warps"], s["num_stages"], c["PREFETCH"], c["SPLIT"],
                      c["FUSED_MERGE"], c["KV_FORMAT"], s["signature"]["q_ptr"]))
            assert s["signature"]["cnt_ptr"] == ("*i32" if c["FUSED_MERGE"] else "*fp32")
    rng = random.Random(0)
    for _ in range(2000):
        H, T, sms = rng.randint(1, 128), rng.choice([rng.randint(1, 300), rng.randint(1, 20000)]), rng.choice([48, 170, 188])
        topk = rng.choice([2048, 1024, 512, 4096])
        c = S._pick_config(H, 12, T)
        n_hb = -(-H // c["BLOCK_H"])
        ns = S._pick_num_splits(T, n_hb, topk, c["BLOCK_N"], sms, c["WAVES"])
        merges = S.MERGE_MODES if ns > 1 else (None,)
        assert ns == 1 or S._pick_merge(T, H, c["BLOCK_H"], ns, sms) in merges
        for m in merges:
            for code in (S._FMT_DS_MLA, S._FMT_FP8, S._FMT_16BIT):
                for qt in ("*bf16", "*fp16"):
                    key = (c["BLOCK_H"], c["BLOCK_N"], c["num_warps"], c["num_stages"], c["PREFETCH"], ns > 1,
                           m == "fused", code, qt)
                    assert key in have, f"H={H} T={T} sms={sms}: {key} not among the SM120 specs"

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Benchmark: Triton sparse MLA decode (and prefill) over an FP8 KV cache vs FlashMLA, a pure gather
of the same rows, a naive path and the floor.

Run on one GPU (H200 for the published numbers)::

    python bench/sparse_mla_decode.py --prepare-peers      # CPU: stage FlashMLA + writer cubins in .peers/
    python bench/sparse_mla_decode.py --time-budget 540    # decode benchmark -> sparse_decode_h200.json
    python bench/sparse_mla_decode.py --prefill            # prefill case -> sparse_prefill_h200.json
    DISABLE_MMA_V3=1 python bench/sparse_mla_decode.py --sm120-proxy   # SM120 proxy records (merged)
    python bench/sparse_mla_decode.py --sweep              # tile-config sweep (tuning)

Decode, per shape (heads H, query rows T, topk 2048, KV formats ``fp8_ds_mla`` 656 B, ``fp8``
576 B, ``bfloat16`` 1152 B), side by side in one process over a paged KV pool of 256k tokens
(several times the L2), indices random within each query row's own context:

1. this kernel (``kernels/triton_sparse_mla.sparse_mla_decode``), CUDA-graph replay (``us``) and
   ``host_us``: the median wall time of one eager call over 1,000 calls as the 0.26.0 backend
   calls it (LSE not returned, the output the stream's reused buffer); ``host_us_alloc`` with the
   output allocated by the call (0.33.0+'s backend);
2. ``gather_us``: a Triton kernel that only reads the same KV rows (same indices, same pool) and
   folds them into a checksum -- the memory-side limit of this access pattern, best of a few tile
   shapes; ``kernel_over_gather = us / gather_us``;
3. FlashMLA's sparse FP8 decode from the pinned vLLM wheel (staged in ``.peers/<pin>/``), fp8_ds_mla
   only, twice: as vLLM's ``FlashMLASparseImpl`` calls it (q zero-padded to 64/128 heads by a slice
   copy, output sliced back: ``flashmla_us``, ``ratio_vs_flashmla``) and the kernel alone at
   the padded head count (``flashmla_kernel_us``, ``ratio_vs_flashmla_kernel``);
4. the naive path (gather, dequantize to bf16, attention in PyTorch), unless ``--no-naive``;
5. the floor: bytes that must move over the copy bandwidth measured in the same run.

Prefill (``--prefill``): one request, contexts 8k and 32k, a chunk of 8,192 query rows (the last
8,192 positions), each row's top-k causal within the request, H = 8 and 64, against what vLLM's
FLASHMLA_SPARSE does for that prefill at that head count: below 32 heads its FP8 decode kernel over
all rows (heads padded to 64); from 32 heads the request's context upconverted into a bf16
workspace (vLLM's ``cp_gather_and_upconvert_fp8_kv_cache`` when its ``_C`` came along in
``.peers-carry/`` -- ``python3 e2e/gpu_tests.py --prepare`` -- else a PyTorch equivalent,
recorded) and
``flash_mla_sparse_fwd`` over it, heads padded to the prefill kernel's multiple (64 on SM90, 128 on
SM100, read from the 0.26.0 source). Eager calls timed with CUDA events.

Also timed: ``workspace_us``, the prefill workspace design's first measurable form (the request's
context dequantized once by ``mla_kv_gather_dequant`` into a bf16 workspace, then this kernel over
it in the ``bfloat16`` format with request positions as indices).

Every record is checked against the float64 reference (``rel_err``; prefill on a sample of rows)
and carries the command that produced it; ``--time-budget S`` stops starting shapes so results are
written within S seconds (``incomplete`` lists what was skipped). ``--sm120-proxy`` needs
``DISABLE_MMA_V3=1`` (SM90 compiles tl.dot to mma.sync like SM120), forces the SM120 dispatch
(``GLM5_SPARSE_MLA_DISPATCH_CC=12``), marks its records ``"sm120_proxy": true`` and merges them
into the results file, keeping the other records.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MERGE_MODES = ("fused", "separate")  # kernels/triton_sparse_mla.py MERGE_MODES (pure Python here)

from bench import common  # noqa: E402

PEERS = common.PEERS
TOPK = 2048
BLOCK_SIZE = 64
POOL_TOKENS = 262144  # 256k tokens: 172 MB at 656 B/token, 151 MB at 576, 302 MB at 1152
SOFTMAX_SCALE = 256 ** -0.5  # GLM-5: qk_head_dim 256
ROW_BYTES = {"fp8_ds_mla": 656, "fp8": 576, "bfloat16": 1152}
DECODE_STEM = "sparse_decode_h200"
PREFILL_STEM = "sparse_prefill_h200"
PREFILL_CHUNK = 8192
MIN_HEADS_FOR_BF16_PREFILL = 32  # vLLM 0.26.0 flashmla_sparse.py


# ------------------------------------------------------------------------------------------
# Peers (CPU side): FlashMLA (+ optionally vLLM's _C) and the writer cubins from the cached wheels
# ------------------------------------------------------------------------------------------

def prepare_peers() -> int:
    """Stage FlashMLA of the default pin into .peers/<pin>/ and the sm_90 cubins holding vLLM's MLA cache writers of every pin into .peers/vllm_cubins/
    (for tests/kernels/test_mla_kv_cache.py). Returns the bytes under .peers/."""
    import tomllib

    common.stage_members(common.FLASHMLA_MEMBERS)
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = PEERS / "vllm_cubins"
    out.mkdir(parents=True, exist_ok=True)
    with open(ROOT / "pins.lock", "rb") as f:
        pins = list(tomllib.load(f)["pins"])
    for ver in pins:
        _, whl = common.pin_wheel(ver)
        if not whl.exists():
            print(f"  vLLM {ver} wheel not cached: its writer cubin is not staged")
            continue
        tmp = PEERS / f"_tmp_{ver}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with zipfile.ZipFile(whl) as z:
            (tmp / "C.so").write_bytes(z.read("vllm/_C_stable_libtorch.abi3.so"))
        subprocess.run([str(cuobjdump), "-xelf", "all", "C.so"], cwd=tmp, check=True, capture_output=True)
        found = None
        for cub in sorted(tmp.glob("*.sm_90.cubin")):
            if b"concat_and_cache_ds_mla_kernel" in cub.read_bytes():
                found = cub
                break
        if found is None:
            raise RuntimeError(f"no sm_90 cubin with concat_and_cache_ds_mla_kernel in {whl}")
        shutil.copy(found, out / f"cache_kernels_sm90_{ver}.cubin")
        shutil.rmtree(tmp)
    n = common.peers_bytes()
    print(f"staged peers in {PEERS}: {n / 2**20:.1f} MiB")
    return n


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------

def make_pool(fmt: str, device, dtype, seed: int = 0):
    """A paged KV pool of POOL_TOKENS tokens written by our cache writer from random latents."""
    import torch
    from kernels.mla_kv_format import resolve_kv_format
    from kernels.triton_mla_kv_cache import mla_kv_cache_write

    g = torch.Generator(device=device).manual_seed(seed)
    nb = POOL_TOKENS // BLOCK_SIZE
    f = resolve_kv_format(fmt, dtype)
    cache = torch.empty((nb, BLOCK_SIZE, f.row_elems), dtype=f.storage_dtype, device=device)
    k_scale = torch.tensor([0.02], dtype=torch.float32, device=device) if fmt == "fp8" else None
    chunk = 65536
    for s0 in range(0, POOL_TOKENS, chunk):
        kv_c = torch.randn((chunk, 512), generator=g, device=device, dtype=torch.float32)
        kv_c = (kv_c * torch.rand((chunk, 1), generator=g, device=device) * 4).to(dtype)
        k_pe = torch.randn((chunk, 64), generator=g, device=device, dtype=torch.float32).to(dtype)
        slots = torch.arange(s0, s0 + chunk, device=device, dtype=torch.int64)
        mla_kv_cache_write(kv_c, k_pe, cache, slots, fmt, k_scale)
    return cache, k_scale


def make_index_sets(T: int, n_sets: int, device, seed: int):
    """n_sets independent [T, TOPK] int32 index tensors: query row t is request t with a random
    block table over the pool; TOPK distinct positions of its context, mapped to physical slots."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    nb = POOL_TOKENS // BLOCK_SIZE
    ctx_blocks = max(TOPK // BLOCK_SIZE, min(256, nb // max(T, 1)))  # context 2k .. 16k tokens
    sets = []
    for _ in range(n_sets):
        perm = torch.randperm(nb, generator=g, device=device)
        need = T * ctx_blocks
        if need <= nb:
            tables = perm[:need].view(T, ctx_blocks)
        else:
            tables = torch.randint(0, nb, (T, ctx_blocks), generator=g, device=device)
        ctx = ctx_blocks * BLOCK_SIZE
        pos = torch.rand((T, ctx), generator=g, device=device).argsort(dim=1)[:, :TOPK]
        slots = tables.gather(1, pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE
        sets.append(slots.to(torch.int32).contiguous())
    return sets


# ------------------------------------------------------------------------------------------
# Pure gather of the same rows (the memory-side roofline of this access pattern)
# ------------------------------------------------------------------------------------------

GATHER_CONFIGS = [(16, 4, 8), (32, 4, 8), (32, 8, 4), (64, 8, 4), (16, 8, 16)]  # BLOCK_N, warps, waves


def gather_fn(pool_words, idx, num_sms: int, block_n: int, warps: int, waves: int):
    """One launch reading every row ``idx`` selects from ``pool_words`` ([slots, row_words] int32),
    split to fill ``waves`` waves of ``num_sms`` programs (bench/common.py's gather kernel)."""
    import triton

    T, topk = idx.shape
    splits = max(1, min(256, triton.cdiv(waves * num_sms, T), triton.cdiv(topk, block_n)))
    return common.gather_fn(pool_words, idx, splits, block_n, warps)


# ------------------------------------------------------------------------------------------
# Implementations under test
# ------------------------------------------------------------------------------------------

def ours_fn(q, cache, idx, fmt, k_scale, out=None, lse=None, config=None, num_splits=None):
    from kernels.triton_sparse_mla import sparse_mla_decode

    def f():
        return sparse_mla_decode(q, cache, idx, SOFTMAX_SCALE, fmt, k_scale, out=out, lse=lse,
                                 num_splits=num_splits, config=config)
    return f


def flashmla_padded_heads(H: int) -> int:
    """vLLM 0.26.0 FlashMLASparseImpl._compute_fp8_decode_padded_heads."""
    return 64 if H <= 64 else 128


def flashmla_fn(fmi, q, cache, idx, sched, as_vllm: bool = True):
    """FlashMLA's sparse FP8 decode, one query row per request: q [T, H, 576] -> [T, 1, Hpad, 576].

    ``as_vllm``: exactly what vLLM 0.26.0's FlashMLASparseImpl does per call (a zero-padded q and
    a slice copy of q into it, the kernel, the output sliced back to H heads and viewed as
    [T, H, 512] by reshape_attn_output_for_spec_decode: no copy).
    Otherwise the kernel alone on a q padded once outside (its output left padded)."""
    T, H, D = q.shape
    hp = flashmla_padded_heads(H)
    import torch

    kc = cache.view(torch.uint8).unsqueeze(-2)
    ind = idx.view(T, 1, -1)
    q_pre = q.new_zeros((T, 1, hp, D))
    q_pre[:, :, :H, :] = q.view(T, 1, H, D)

    def kernel(qq):
        return fmi.flash_mla_with_kvcache(q=qq, k_cache=kc, block_table=None, cache_seqlens=None, head_dim_v=512,
                                          tile_scheduler_metadata=sched, is_fp8_kvcache=True, indices=ind,
                                          softmax_scale=SOFTMAX_SCALE)

    if not as_vllm:
        return lambda: kernel(q_pre)

    def f():
        qq = q.view(T, 1, H, D)
        if H < hp:
            qp = qq.new_zeros((T, 1, hp, D))
            qp[:, :, :H, :] = qq
            qq = qp
        o, lse = kernel(qq)
        if H < hp:
            o = o[:, :, :H, :]
        return o.view(T, H, 512), lse
    return f


def naive_fn(q, cache, idx, fmt, k_scale):
    """Gather selected rows, dequantize to bf16, attention in PyTorch (no Triton)."""
    import torch
    from kernels.mla_kv_format import dequantize_rows, resolve_kv_format

    nb, bs, w = cache.shape
    flat = cache.view(nb * bs, w)
    f = resolve_kv_format(fmt, q.dtype)

    def fn():
        rows = flat[idx.long().clamp_min(0)]  # [T, topk, W]
        k = dequantize_rows(rows, f, k_scale, torch.float32).to(torch.bfloat16)
        s = torch.einsum("thd,tkd->thk", q, k).float() * SOFTMAX_SCALE
        s = s.masked_fill((idx < 0)[:, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None]).to(torch.bfloat16)
        return torch.einsum("thk,tkd->thd", p, k[..., :512]), lse
    return fn


# ------------------------------------------------------------------------------------------
# Accounting (pure Python)
# ------------------------------------------------------------------------------------------

def bytes_moved(H: int, T: int, fmt: str, topk: int = TOPK) -> int:
    """Bytes a decode call must move: the selected KV rows once, the indices, q, out and lse."""
    return T * topk * ROW_BYTES[fmt] + T * topk * 4 + T * H * 576 * 2 + T * H * 512 * 2 + T * H * 4


def merge_bytes(H: int, T: int, num_splits: int, block_h: int) -> dict:
    """Bytes of the split path's partial results (docs/notes/sparse_mla.md, "Merge"): written by
    the split kernel (512 fp32 + an fp32 lse per (row, head, split)); read back by the separate
    merge kernel, which also writes out (bf16) and lse; the fused merge reads the same partials, but
    each (row, head block) in one program: ``fused_bytes_per_program`` is that program's share."""
    partial = T * H * num_splits * (512 * 4 + 4)
    out = T * H * (512 * 2 + 4)
    heads = min(block_h, H)
    return {"partials_written": partial, "separate_read": partial, "out_written": out,
            "fused_programs": T * -(-H // block_h), "fused_bytes_per_program": num_splits * heads * (512 * 4 + 4)}


def gather_bytes(T: int, fmt: str, topk: int = TOPK) -> int:
    """Bytes the pure gather reads: the same rows and the indices."""
    return T * topk * (ROW_BYTES[fmt] + 4)


def n_sets_for(H: int, T: int, fmt: str, l2_bytes: int) -> int:
    return max(2, min(64, math.ceil(3 * l2_bytes / bytes_moved(H, T, fmt))))


def v2_fn(q, cache, idx, fmt, out, lse, k_scale=None, config=None):
    """The Gluon v2 kernel (H <= 16; what TRITON_MLA_SPARSE dispatches there), its own split
    policy, no fallback to v1 (an unsupported call raises); ``config``: overrides (e.g. MERGE)."""
    from kernels.triton_sparse_mla_v2 import sparse_mla_decode_v2

    def f():
        return sparse_mla_decode_v2(q, cache, idx, SOFTMAX_SCALE, fmt, k_scale, out=out, lse=lse, fallback=False,
                                    config=config)
    return f


def v2_arm(rec: dict, qs, cache, idx_sets, fmt, outs, lses, ro, rep: int, k_scale=None) -> None:
    """v2 beside v1 and FlashMLA at the same point (``v2_us``, ``v2_rel_err``; ``v2_skipped``: why
    not), so one run gives the numbers a v2 dispatch rule needs."""
    import torch
    from kernels.triton_sparse_mla_v2 import v2_unsupported_reason

    why = v2_unsupported_reason(qs[0], fmt, kv_cache=cache)
    if why is not None:
        rec["v2_skipped"] = why
        return
    try:
        fns = [v2_fn(qs[i], cache, idx_sets[i], fmt, outs[i], lses[i], k_scale) for i in range(len(qs))]
        outs[0].fill_(float("nan"))
        lses[0].fill_(float("nan"))
        fns[0]()
        rec["v2_rel_err"] = rel_err(outs[0], ro)
        rec["v2_nan"] = bool(torch.isnan(outs[0]).any() or torch.isnan(lses[0]).any())
        rec["v2_us"] = common.time_graph(fns, rep)
        from kernels.triton_sparse_mla_v2 import _PLANS_V2, _v1

        key = _v1._plan_key(qs[0], cache, idx_sets[0], SOFTMAX_SCALE, fmt, k_scale, outs[0], lses[0], None)
        plan = _PLANS_V2.get(key)
        rec["v2_num_splits"] = plan.num_splits if plan is not None else None
        rec["v2_config"] = {k: v for k, v in plan.meta.items() if k != "maxnreg"} if plan is not None else None
        if plan is not None and plan.num_splits > 1:
            # both merges of the split launch under the same replay (v2_us is the dispatch's,
            # named by v2_merge): the fused one (last-arriving split program) and the separate kernel
            rec["v2_merge"] = "fused" if plan.fused else "separate"
            for m in ("fused", "separate"):
                fm = [v2_fn(qs[i], cache, idx_sets[i], fmt, outs[i], lses[i], k_scale, {"MERGE": m})
                      for i in range(len(qs))]
                outs[0].fill_(float("nan"))
                lses[0].fill_(float("nan"))
                fm[0]()
                rec[f"v2_rel_err_{m}"] = rel_err(outs[0], ro)
                rec[f"v2_us_{m}"] = rec["v2_us"] if m == rec["v2_merge"] else common.time_graph(fm, rep)
    except Exception as e:  # noqa: BLE001  (recorded, the v1 numbers of the point still count)
        rec["v2_error"] = repr(e)[:500]


def derive(rec: dict, copy_bw: float) -> dict:
    """The ratios and rates of a decode record from its measured times (fills keys in place)."""
    H, T, fmt = rec["heads"], rec["tokens"], rec["kv_format"]
    nbytes = bytes_moved(H, T, fmt, rec.get("topk", TOPK))
    rec["bytes"] = nbytes
    rec["floor_us"] = nbytes / copy_bw * 1e6
    us = rec["us"]
    rec["achieved_GBps"] = nbytes / (us * 1e-6) / 1e9
    rec["pct_copy_bw"] = 100.0 * rec["floor_us"] / us
    rec["tflops"] = 2.0 * T * H * rec.get("topk", TOPK) * (576 + 512) / (us * 1e-6) / 1e12
    rec["kernel_over_gather"] = common.ratio(us, rec.get("gather_us"))
    if rec.get("gather_us"):
        rec["gather_pct_copy_bw"] = 100.0 * gather_bytes(T, fmt, rec.get("topk", TOPK)) / copy_bw * 1e6 / rec["gather_us"]
    rec["ratio_vs_flashmla"] = common.ratio(us, rec.get("flashmla_us"))
    rec["ratio_vs_flashmla_kernel"] = common.ratio(us, rec.get("flashmla_kernel_us"))
    if rec.get("v2_us"):
        rec["v2_over_v1"] = common.ratio(rec["v2_us"], us)
        rec["v2_ratio_vs_flashmla"] = common.ratio(rec["v2_us"], rec.get("flashmla_us"))
    # what TRITON_MLA_SPARSE runs at this point (sparse_mla_decode_v2: v2 where it applies, else v1)
    rec["path"] = "v2" if rec.get("v2_us") else "v1"
    ours = rec["v2_us"] if rec["path"] == "v2" else us
    rec["ours_us"] = ours
    rec["ours_over_gather"] = common.ratio(ours, rec.get("gather_us"))
    rec["ours_ratio_vs_flashmla"] = common.ratio(ours, rec.get("flashmla_us"))
    rec["ours_ratio_vs_flashmla_kernel"] = common.ratio(ours, rec.get("flashmla_kernel_us"))
    rec["ours_pct_copy_bw"] = 100.0 * rec["floor_us"] / ours
    return rec


def rel_err(a, ref):
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------
# One decode shape
# ------------------------------------------------------------------------------------------

def run_shape(H, T, fmt, pools, fmi, copy_bw, l2_bytes, args, config=None, num_splits=None, peers=True,
              device="cuda"):
    import torch
    from kernels.triton_sparse_mla import _make_plan, sparse_mla_decode_reference

    cache, k_scale = pools[fmt]
    n_sets = n_sets_for(H, T, fmt, l2_bytes)
    seed = (H * 1000003 + T * 1009 + len(fmt)) % 100000
    idx_sets = make_index_sets(T, n_sets, device, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    qs = [torch.randn((T, H, 576), generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
          for _ in range(n_sets)]
    outs = [torch.empty((T, H, 512), device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
    lses = [torch.empty((T, H), device=device, dtype=torch.float32) for _ in range(n_sets)]
    rec = {"heads": H, "topk": TOPK, "tokens": T, "kv_format": fmt, "n_input_sets": n_sets}

    outs[0].fill_(float("nan"))
    lses[0].fill_(float("nan"))
    ours = [ours_fn(qs[i], cache, idx_sets[i], fmt, k_scale, outs[i], lses[i], config, num_splits) for i in range(n_sets)]
    ours[0]()
    ro, rl = sparse_mla_decode_reference(qs[0], cache, idx_sets[0], SOFTMAX_SCALE, fmt, k_scale)
    rec["rel_err"] = rel_err(outs[0], ro)
    rec["head_rel_err_max"] = float(((outs[0].double() - ro).norm(dim=-1) / ro.norm(dim=-1).clamp_min(1e-30)).max())
    rec["lse_max_abs_err"] = float((lses[0].double() - rl).abs().max())
    rec["nan"] = bool(torch.isnan(outs[0]).any() or torch.isnan(lses[0]).any())
    plan = _make_plan(qs[0], cache, idx_sets[0], SOFTMAX_SCALE, fmt, k_scale, outs[0], lses[0], num_splits, config)
    rec["config"] = {k: plan.meta[k] for k in ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "PREFETCH", "DS_FOLD")}
    rec["num_splits"] = plan.tail[-2]
    rec["merge"] = plan.merge  # the merge behind "us": "fused" / "separate" (None: no split, no merge)
    rec["dispatch_cc"] = os.environ.get("GLM5_SPARSE_MLA_DISPATCH_CC") or "device"

    rec["us"] = common.time_graph(ours, args.rep)
    if plan.merge:
        # both merges of the split path at this point: "us_<merge>" (the dispatch's one is "us"),
        # the other timed right after it under the same replay, checked against the reference too
        rec["us_" + plan.merge] = rec["us"]
        for m in MERGE_MODES:
            if m == plan.merge:
                continue
            cfg_m = dict(config or {}, MERGE=m)
            fns = [ours_fn(qs[i], cache, idx_sets[i], fmt, k_scale, outs[i], lses[i], cfg_m, num_splits)
                   for i in range(n_sets)]
            outs[0].fill_(float("nan"))
            fns[0]()
            rec["rel_err_" + m] = rel_err(outs[0], ro)
            rec["nan_" + m] = bool(torch.isnan(outs[0]).any() or torch.isnan(lses[0]).any())
            rec["us_" + m] = common.time_graph(fns, args.rep)
        rec["rel_err_" + plan.merge] = rec["rel_err"]
        rec["merge_bytes"] = merge_bytes(H, T, plan.tail[-2], plan.meta["BLOCK_H"])
    v2_arm(rec, qs, cache, idx_sets, fmt, outs, lses, ro, args.rep, k_scale)
    # host cost per eager call as the backend makes it (outputs allocated by the call)
    rec["host_us_v1"] = common.host_us(ours_fn(qs[0], cache, idx_sets[0], fmt, k_scale, config=config,
                                               num_splits=num_splits), calls=args.host_calls)
    rec["host_us"] = rec["host_us_v1"]
    if rec.get("v2_us") and config is None and num_splits is None:
        from kernels.triton_sparse_mla_v2 import sparse_mla_decode_v2

        # as the backend calls it on 0.26.0: the LSE is not returned (vLLM uses it only under decode
        # context parallelism) and the output is the stream's reused buffer (reuse_out), so the
        # call allocates nothing; host_us_alloc: the output allocated by the call (0.33.0+)
        rec["host_us"] = common.host_us(lambda: sparse_mla_decode_v2(qs[0], cache, idx_sets[0], SOFTMAX_SCALE, fmt,
                                                                     k_scale, return_lse=False, reuse_out=True),
                                        calls=args.host_calls)
        rec["host_us_alloc"] = common.host_us(lambda: sparse_mla_decode_v2(qs[0], cache, idx_sets[0], SOFTMAX_SCALE,
                                                                           fmt, k_scale, return_lse=False),
                                              calls=args.host_calls)
    words = cache.view(torch.int32).reshape(-1, ROW_BYTES[fmt] // 4)  # contiguous pool: row = slot
    nsm = torch.cuda.get_device_properties(device).multi_processor_count
    best = None
    for bn, w, waves in GATHER_CONFIGS:
        us = common.time_graph([gather_fn(words, idx_sets[i], nsm, bn, w, waves) for i in range(n_sets)], args.rep)
        if best is None or us < best[0]:
            best = (us, {"BLOCK_N": bn, "num_warps": w, "waves": waves})
    rec["gather_us"], rec["gather_config"] = best

    if peers and fmi is not None and fmt == "fp8_ds_mla":
        sched, _ = fmi.get_mla_metadata()
        fms = [flashmla_fn(fmi, qs[i], cache, idx_sets[i], sched) for i in range(n_sets)]
        o_fm, lse_fm = fms[0]()
        rec["flashmla_rel_err"] = rel_err(o_fm, ro)
        lfm = lse_fm[:, :H, 0] if lse_fm.dim() == 3 else lse_fm
        rec["flashmla_lse_vs_ref_max_abs"] = float((lfm.double() - rl).abs().max())
        rec["flashmla_us"] = common.time_graph(fms, args.rep)
        sched2, _ = fmi.get_mla_metadata()
        fk = [flashmla_fn(fmi, qs[i], cache, idx_sets[i], sched2, as_vllm=False) for i in range(n_sets)]
        rec["flashmla_kernel_us"] = common.time_graph(fk, args.rep)
        rec["flashmla_padded_heads"] = flashmla_padded_heads(H)
    if peers and not args.no_naive:
        nv = [naive_fn(qs[i], cache, idx_sets[i], fmt, k_scale) for i in range(min(n_sets, 4))]
        o_nv, _ = nv[0]()
        rec["naive_rel_err"] = rel_err(o_nv, ro)
        rec["naive_us"] = common.time_graph(nv, args.rep)
    del qs, outs, lses, idx_sets
    return derive(rec, copy_bw)


# ------------------------------------------------------------------------------------------
# Prefill: one request, a chunk of query rows with causal top-k inside the request
# ------------------------------------------------------------------------------------------

def prefill_inputs(ctx: int, H: int, device, seed: int, chunk: int = PREFILL_CHUNK):
    """q [chunk, H, 576] for the last ``chunk`` positions of a ``ctx``-token request whose blocks
    sit at random places of the pool; per row the top-k positions (causal: <= the row's position;
    all of them when fewer than TOPK, the rest -1), as request positions and as pool slots."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    nb = POOL_TOKENS // BLOCK_SIZE
    nblk = ctx // BLOCK_SIZE
    table = torch.randperm(nb, generator=g, device=device)[:nblk].to(torch.int32)
    q = torch.randn((chunk, H, 576), generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    pos0 = ctx - chunk
    positions = torch.full((chunk, TOPK), -1, dtype=torch.int32, device=device)
    for r0 in range(0, chunk, 512):
        r1 = min(chunk, r0 + 512)
        p = pos0 + torch.arange(r0, r1, device=device)  # each row's own position
        keys = torch.rand((r1 - r0, ctx), generator=g, device=device)
        keys = keys.masked_fill(torch.arange(ctx, device=device)[None, :] > p[:, None], 2.0)  # future: last
        sel = keys.argsort(dim=1)[:, :TOPK]
        ok = sel <= p[:, None]
        positions[r0:r1] = torch.where(ok, sel, -1).to(torch.int32)
    lengths = (positions >= 0).sum(dim=1).to(torch.int32)
    # valid entries first (argsort put past positions before the masked future ones)
    tl_ = table.long()
    slots = torch.where(positions >= 0, tl_[positions.clamp_min(0).long() // BLOCK_SIZE] * BLOCK_SIZE
                        + positions.clamp_min(0).long() % BLOCK_SIZE, -1).to(torch.int32)
    return q, table, positions, slots, lengths


def upconvert_torch(cache, table, ctx: int):
    """PyTorch equivalent of vLLM's cp_gather_and_upconvert_fp8_kv_cache for one request:
    the request's ``ctx`` tokens of an fp8_ds_mla cache -> bf16 [ctx, 576] workspace."""
    import torch
    from kernels.mla_kv_format import dequantize_rows, resolve_kv_format

    rows = cache[table.long()].reshape(-1, cache.shape[-1])[:ctx]
    return dequantize_rows(rows, resolve_kv_format("fp8_ds_mla", torch.bfloat16), None, torch.float32).to(torch.bfloat16)


def flashmla_prefill_fns(fmi, vllm_c: bool, q, cache, table, positions, slots, lengths, ctx: int, cc_major: int):
    """What FLASHMLA_SPARSE (vLLM 0.26.0) runs for this prefill chunk, as a list of steps
    (name, fn); the full call is all steps in order."""
    import torch

    T, H, D = q.shape
    if H < MIN_HEADS_FOR_BF16_PREFILL:
        hp = flashmla_padded_heads(H)
        sched, _ = fmi.get_mla_metadata()
        kc = cache.view(torch.uint8).unsqueeze(-2)
        ind = slots.view(1, T, -1)

        def mixed():
            qq = q.unsqueeze(0)
            if H < hp:
                qp = qq.new_zeros((1, T, hp, D))
                qp[:, :, :H, :] = qq
                qq = qp
            o, _ = fmi.flash_mla_with_kvcache(q=qq, k_cache=kc, block_table=None, cache_seqlens=None, head_dim_v=512,
                                              tile_scheduler_metadata=sched, is_fp8_kvcache=True, indices=ind,
                                              softmax_scale=SOFTMAX_SCALE)
            return o[:, :, :H, :].squeeze(0)
        return [("fp8_decode_kernel_mixed_batch", mixed)], f"FP8 decode kernel, heads padded to {hp}"
    pad = 128 if cc_major == 10 else 64
    ws = torch.empty((ctx, 576), dtype=torch.bfloat16, device=q.device)
    starts = torch.zeros(1, dtype=torch.int32, device=q.device)
    bt = table.view(1, -1)

    if vllm_c:
        def upconvert():
            torch.ops._C_cache_ops.cp_gather_and_upconvert_fp8_kv_cache(cache, ws, bt, starts, 1, None)
        how = "vLLM _C cp_gather_and_upconvert_fp8_kv_cache"
    else:
        def upconvert():
            ws.copy_(upconvert_torch(cache, table, ctx))
        how = "PyTorch equivalent of cp_gather_and_upconvert_fp8_kv_cache (vLLM _C not staged)"
    ind = positions.view(T, 1, -1)

    def attn():
        qq = q
        if H % pad:
            qp = q.new_empty((T, pad, D))
            qp[:, :H, :] = q
            qq = qp
        o = fmi.flash_mla_sparse_fwd(qq, ws.view(-1, 1, 576), ind, SOFTMAX_SCALE, topk_length=lengths)[0]
        return o[:, :H, :]
    return [("upconvert", upconvert), ("flash_mla_sparse_fwd", attn)], (
        f"bf16 workspace ({how}) + flash_mla_sparse_fwd, heads padded to a multiple of {pad}")


def run_prefill(ctx, H, pools, fmi, vllm_c, args, device="cuda"):
    import torch
    from kernels.triton_sparse_mla import sparse_mla_decode_reference
    from kernels.triton_sparse_mla import sparse_mla_decode as sparse_mla_v1
    from kernels.triton_sparse_mla_v2 import sparse_mla_decode_v2 as sparse_mla_decode  # the dispatch
    from kernels.triton_sparse_mla_v2 import v2_unsupported_reason

    cache, _ = pools["fp8_ds_mla"]
    seed = ctx * 131 + H
    q, table, positions, slots, lengths = prefill_inputs(ctx, H, device, seed)
    rec = {"context": ctx, "heads": H, "tokens": q.shape[0], "topk": TOPK, "kv_format": "fp8_ds_mla"}
    # "us" is what TRITON_MLA_SPARSE runs for this prefill (v2 at <= 16 heads, v1 above)
    rec["path"] = "v1" if v2_unsupported_reason(q, "fp8_ds_mla") else "v2"
    out = sparse_mla_decode(q, cache, slots, SOFTMAX_SCALE, "fp8_ds_mla")[0]
    sample = torch.linspace(0, q.shape[0] - 1, 64, device=device).long()
    ro, _ = sparse_mla_decode_reference(q[sample], cache, slots[sample], SOFTMAX_SCALE, "fp8_ds_mla")
    rec["rel_err_sampled_rows"] = rel_err(out[sample], ro)
    rec["us"] = common.time_events([lambda: sparse_mla_decode(q, cache, slots, SOFTMAX_SCALE, "fp8_ds_mla")])
    # host time as the 0.26.0 backend calls it (LSE not returned, reused output), and allocating
    rec["host_us"] = common.host_us(lambda: sparse_mla_decode(q, cache, slots, SOFTMAX_SCALE, "fp8_ds_mla",
                                                              return_lse=False, reuse_out=True), calls=args.host_calls)
    rec["host_us_alloc"] = common.host_us(lambda: sparse_mla_decode(q, cache, slots, SOFTMAX_SCALE, "fp8_ds_mla"),
                                          calls=args.host_calls)
    # the workspace design (docs/notes/sparse_mla.md), steps 1 + 3: the request's context
    # dequantized once into a bf16 workspace, then the same kernel over it in the bfloat16 format
    # with request positions as indices
    from kernels.triton_mla_kv_cache import mla_kv_gather_dequant

    ws = torch.empty((ctx, 576), dtype=torch.bfloat16, device=device)
    bt = table.view(1, -1)
    one_len = torch.tensor([ctx], dtype=torch.int32, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)

    def ws_gather():
        mla_kv_gather_dequant(cache, bt, one_len, zero, ws, "fp8_ds_mla", max_seq_len=ctx)

    def ws_attn():
        return sparse_mla_v1(q, ws.view(ctx, 1, 576), positions, SOFTMAX_SCALE, "bfloat16")[0]

    ws_gather()
    o_ws = ws_attn()
    rec["workspace_rel_err_sampled_rows"] = rel_err(o_ws[sample], ro)
    rec["workspace_us"] = common.time_events([ws_gather, ws_attn])
    rec["workspace_steps_us"] = {"gather_dequant": common.time_events([ws_gather]),
                                 "attention_bf16": common.time_events([ws_attn])}
    if fmi is not None:
        cc = torch.cuda.get_device_capability()[0]
        steps, what = flashmla_prefill_fns(fmi, vllm_c, q, cache, table, positions, slots, lengths, ctx, cc)
        rec["flashmla_path"] = what
        for _, f in steps:
            o_fm = f()
        rec["flashmla_rel_err_sampled_rows"] = rel_err(o_fm[sample], ro)
        rec["flashmla_us"] = common.time_events([f for _, f in steps])
        if len(steps) > 1:
            rec["flashmla_steps_us"] = {n: common.time_events([f]) for n, f in steps}
        rec["ratio_vs_flashmla"] = common.ratio(rec["us"], rec["flashmla_us"])
        rec["workspace_ratio_vs_flashmla"] = common.ratio(rec["workspace_us"], rec["flashmla_us"])
    return rec


# ------------------------------------------------------------------------------------------
# Precompile (parallel warm-up of Triton's disk cache)
# ------------------------------------------------------------------------------------------

def _warm_one(item):
    import torch
    from kernels.mla_kv_format import resolve_kv_format
    from kernels.triton_sparse_mla import sparse_mla_decode

    H, fmt, config, split, T = item
    f = resolve_kv_format(fmt, torch.bfloat16)
    cache = torch.zeros((4, BLOCK_SIZE, f.row_elems), dtype=f.storage_dtype, device="cuda")
    ks = torch.ones(1, dtype=torch.float32, device="cuda") if fmt == "fp8" else None
    q = torch.zeros((T, H, 576), dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros((T, TOPK), dtype=torch.int32, device="cuda")
    sparse_mla_decode(q, cache, idx, 0.1, fmt, ks, num_splits=2 if split else 1, config=config)
    torch.cuda.synchronize()
    return True


def precompile(items, jobs: int) -> float:
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    items = list(dict.fromkeys((h, f, tuple(sorted(c.items())) if c else None, s, t) for (h, f, c, s, t) in items))
    items = [(h, f, dict(c) if c else None, s, t) for (h, f, c, s, t) in items]
    if jobs <= 1:
        for it in items:
            _warm_one(it)
    else:
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(_warm_one, items))
    return time.time() - t0


# ------------------------------------------------------------------------------------------
# Outputs (pure Python)
# ------------------------------------------------------------------------------------------

def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


DECODE_COLUMNS = ("| format | H | T | path | ours us | v1 us | gather us | ours/gather | FlashMLA us (as vLLM) | "
                  "ours/FlashMLA | FlashMLA kernel us | ours/kernel | host us | % copy BW | rel err |")


def decode_table(records: list[dict], proxy: bool = False) -> list[str]:
    lines = [DECODE_COLUMNS, "|" + "---|" * (DECODE_COLUMNS.count("|") - 1)]
    for r in records:
        if bool(r.get("sm120_proxy")) != proxy:
            continue
        # records from before the v2 dispatch have no ours_* keys: v1 ran there
        v2 = r.get("path") == "v2"
        lines.append(f"| {r['kv_format']} | {r['heads']} | {r['tokens']} | {r.get('path', 'v1')} | "
                     f"{_f(r.get('ours_us', r['us']))} | {_f(r['us'])} | {_f(r.get('gather_us'))} | "
                     f"{_f(r.get('ours_over_gather', r.get('kernel_over_gather')), '{:.2f}')} | {_f(r.get('flashmla_us'))} | "
                     f"{_f(r.get('ours_ratio_vs_flashmla', r.get('ratio_vs_flashmla')), '{:.2f}')} | "
                     f"{_f(r.get('flashmla_kernel_us'))} | "
                     f"{_f(r.get('ours_ratio_vs_flashmla_kernel', r.get('ratio_vs_flashmla_kernel')), '{:.2f}')} | "
                     f"{_f(r.get('host_us'))} | {_f(r.get('ours_pct_copy_bw', r.get('pct_copy_bw')), '{:.0f}')} | "
                     f"{_f(r.get('v2_rel_err') if v2 else r.get('rel_err'), '{:.1e}')} |")
    return lines


PREFILL_COLUMNS = ("| context | H | rows | ours us | ours via workspace us | FLASHMLA_SPARSE us | ours/FLASHMLA_SPARSE | "
                   "workspace/FLASHMLA_SPARSE | its path | host us | rel err (64 rows) |")


def prefill_table(records: list[dict], proxy: bool = False) -> list[str]:
    lines = [PREFILL_COLUMNS, "|" + "---|" * (PREFILL_COLUMNS.count("|") - 1)]
    for r in records:
        if bool(r.get("sm120_proxy")) != proxy:
            continue
        lines.append(f"| {r['context']} | {r['heads']} | {r['tokens']} | {_f(r['us'])} | {_f(r.get('workspace_us'))} | "
                     f"{_f(r.get('flashmla_us'))} | {_f(r.get('ratio_vs_flashmla'), '{:.2f}')} | "
                     f"{_f(r.get('workspace_ratio_vs_flashmla'), '{:.2f}')} | {r.get('flashmla_path', '-')} | "
                     f"{_f(r.get('host_us'))} | {_f(r.get('rel_err_sampled_rows'), '{:.1e}')} |")
    return lines


MERGE_COLUMNS = ("| format | H | T | splits | dispatch's merge | fused us | separate us | fused/separate | "
                 "partials MB | fused MB per program | rel err fused | rel err separate |")


def merge_table(records: list[dict], proxy: bool = False) -> list[str]:
    """Both merges of the split path per measured point (records with ``us_fused``)."""
    lines = [MERGE_COLUMNS, "|" + "---|" * (MERGE_COLUMNS.count("|") - 1)]
    for r in records:
        if bool(r.get("sm120_proxy")) != proxy or r.get("us_fused") is None:
            continue
        mb = r.get("merge_bytes") or {}
        lines.append(f"| {r['kv_format']} | {r['heads']} | {r['tokens']} | {r.get('num_splits', '-')} | {r['merge']} | "
                     f"{_f(r['us_fused'])} | {_f(r.get('us_separate'))} | "
                     f"{_f(common.ratio(r['us_fused'], r.get('us_separate')), '{:.2f}')} | "
                     f"{_f(mb.get('partials_written', 0) / 1e6, '{:.2f}')} | "
                     f"{_f(mb.get('fused_bytes_per_program', 0) / 1e6, '{:.3f}')} | "
                     f"{_f(r.get('rel_err_fused'), '{:.1e}')} | {_f(r.get('rel_err_separate'), '{:.1e}')} |")
    return lines


def record_key(r: dict) -> tuple:
    """What identifies a measurement across runs (a later run's record replaces it)."""
    if "context" in r:
        return (bool(r.get("sm120_proxy")), "prefill", r["context"], r["heads"])
    return (bool(r.get("sm120_proxy")), r["kv_format"], r["heads"], r["tokens"])


def run_meta(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("records", "runs")}


def merge_results(old: dict | None, new: dict) -> dict:
    """``new`` merged into an existing results file ``old``: old records whose key (record_key)
    the new run did not measure are kept, each run's metadata (command, device, copy bandwidth)
    is kept in ``runs`` next to the records it produced (records carry their command too). The
    top-level metadata is the latest non-proxy run's."""
    meta = run_meta(new)
    if not old:
        return dict(new, runs=[meta])
    done = {record_key(r) for r in new["records"]}
    kept = [r for r in old.get("records", []) if record_key(r) not in done]
    cmds = {r.get("command") for r in kept}
    runs = [m for m in old.get("runs", [run_meta(old)]) if m.get("command") in cmds] + [meta]
    base = dict(new) if not new.get("sm120_proxy") else dict(old)
    base["records"] = sorted(kept + new["records"], key=record_key)
    base["runs"] = runs
    return base


def write_outputs(result: dict, out_dir: Path, stem: str, prefill: bool = False, merge: bool = False) -> dict:
    """Write ``<stem>.json`` (merged into the existing file when ``merge``) and ``<stem>.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    old = json.loads(path.read_text()) if merge and path.exists() else None
    merged = merge_results(old, result)
    path.write_text(json.dumps(merged, indent=1))
    recs = merged["records"]
    head = [f"# Sparse MLA {'prefill' if prefill else 'decode'} on {merged['device']} (topk {TOPK})", ""]
    for run in merged["runs"]:
        head.append(f"- `{run['command']}` (copy bandwidth {run.get('copy_bw_GBps', 0):.0f} GB/s)")
    head.append("")
    table = prefill_table if prefill else decode_table
    lines = head + table(recs)
    if any(r.get("sm120_proxy") for r in recs):
        lines += ["", "SM120 proxy (DISABLE_MMA_V3=1, SM120 dispatch forced):", ""] + table(recs, proxy=True)
    if not prefill and any(r.get("us_fused") is not None for r in recs):
        lines += ["", "Merge of the split path, both variants (`us` above is the dispatch's):", ""] + merge_table(recs)
        if any(r.get("us_fused") is not None and r.get("sm120_proxy") for r in recs):
            lines += ["", "SM120 proxy:", ""] + merge_table(recs, proxy=True)
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return merged


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------

def _c(bh, bn, w, st, pref, fold=False, waves=1):
    return {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "PREFETCH": pref, "DS_FOLD": fold,
            "WAVES": waves}


SWEEP = {
    8: [_c(16, 32, 8, 1, True), _c(16, 32, 8, 1, True, waves=2), _c(16, 16, 8, 1, True),
        _c(16, 16, 4, 1, True, waves=2), _c(16, 64, 8, 1, True), _c(16, 32, 8, 2, False),
        _c(16, 32, 8, 1, True, fold=True)],
    64: [_c(64, 64, 8, 2, False, waves=2), _c(64, 64, 8, 2, False, waves=1), _c(64, 32, 8, 2, False, waves=2),
         _c(64, 32, 8, 1, True, waves=1)],
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare-peers", action="store_true", help="CPU: stage FlashMLA + writer cubins in .peers/")
    ap.add_argument("--sweep", action="store_true", help="tile-config sweep instead of the benchmark")
    ap.add_argument("--prefill", action="store_true", help="prefill case -> sparse_prefill_h200.json")
    ap.add_argument("--sm120-proxy", action="store_true",
                    help="SM120 proxy run (needs DISABLE_MMA_V3=1; forces the SM120 dispatch); records merged")
    ap.add_argument("--heads", type=int, nargs="*", default=None)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 4, 32, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768], help="prefill contexts")
    ap.add_argument("--formats", nargs="*", default=["fp8_ds_mla", "fp8", "bfloat16"])
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms) per measurement")
    ap.add_argument("--host-calls", type=int, default=1000, help="eager calls timed for host_us")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds: stop starting shapes to finish in time")
    ap.add_argument("--append", action="store_true",
                    help="merge into the existing results file (records of shapes not measured now are kept)")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--jobs", type=int, default=8, help="parallel Triton compile workers")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stem", default=None)
    args = ap.parse_args(argv)
    if args.heads is None:
        args.heads = [8, 64] if args.prefill else [8, 16, 32, 64, 128]
    if args.stem is None:
        args.stem = PREFILL_STEM if args.prefill else DECODE_STEM
    for f in args.formats:
        if f not in ROW_BYTES:
            ap.error(f"--formats: {f!r} is not one of {sorted(ROW_BYTES)}")
    if args.prefill and args.sweep:
        ap.error("--prefill and --sweep are separate runs")
    if args.time_budget is not None and args.time_budget <= 0:
        ap.error("--time-budget must be positive seconds")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare_peers:
        prepare_peers()
        return 0
    cmd = common.command_line(__file__, argv)  # as typed (before the proxy sets the dispatch override)
    if args.sm120_proxy:
        if os.environ.get("DISABLE_MMA_V3") != "1":
            print("--sm120-proxy needs DISABLE_MMA_V3=1 in the environment (set before Triton compiles)")
            return 2
        os.environ["GLM5_SPARSE_MLA_DISPATCH_CC"] = "12"
    budget = common.TimeBudget(args.time_budget)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    result = {"command": cmd, "device": props.name, "sm_count": props.multi_processor_count, "l2_bytes": l2,
              "torch": torch.__version__, "triton": triton.__version__, "topk": TOPK, "pool_tokens": POOL_TOKENS,
              "block_size": BLOCK_SIZE, "softmax_scale": SOFTMAX_SCALE, "sm120_proxy": args.sm120_proxy}
    formats = ["fp8_ds_mla"] if args.prefill else args.formats

    if not args.prefill:
        warm = []
        if args.sweep:
            for h in args.heads:
                for c in SWEEP[8 if h <= 16 else 64]:
                    for s in (False, True):
                        warm.append((h, "fp8_ds_mla", c, s, 1))
        else:
            for h in args.heads:
                for f in formats:
                    for s in (False, True):
                        for t in sorted({1, max(args.tokens)}):
                            for m in (MERGE_MODES if s else (None,)):
                                warm.append((h, f, {"MERGE": m} if m else None, s, t))
        result["compile_s"] = precompile(warm, args.jobs)
        print(f"precompiled {len(warm)} variants in {result['compile_s']:.1f}s", flush=True)

    copy_bw = common.copy_bandwidth(dev)
    result["copy_bw_GBps"] = copy_bw / 1e9
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    pin, _ = common.pin_wheel()
    fmi, why = common.load_flashmla(pin)
    result["flashmla"] = f"vllm {pin} wheel _flashmla_C" if fmi else why
    vllm_c = False
    if args.prefill:
        vllm_c, note = common.load_vllm_c(pin)
        result["vllm_c"] = note
    pools = {f: make_pool(f, dev, torch.bfloat16, seed=i) for i, f in enumerate(formats)}
    torch.cuda.synchronize()

    records, skipped = [], []
    last_cost = 0.0
    if args.prefill:
        shapes = [(c, h) for c in args.contexts for h in args.heads]
    elif args.sweep:
        shapes = [(h, t, c) for h in args.heads for t in args.tokens for c in SWEEP[8 if h <= 16 else 64]]
    else:
        shapes = [(f, h, t) for f in formats for h in args.heads for t in args.tokens]
    for shape in shapes:
        if not budget.allows(1.5 * last_cost):
            skipped.append(list(shape) if not args.sweep else [shape[0], shape[1]])
            continue
        t0 = time.monotonic()
        if args.prefill:
            r = run_prefill(shape[0], shape[1], pools, fmi, vllm_c, args)
            print(f"prefill ctx={r['context']} H={r['heads']}: ours {r['us']:.0f} us | FLASHMLA_SPARSE "
                  f"{r.get('flashmla_us') or float('nan'):.0f} us | ratio {r.get('ratio_vs_flashmla') or float('nan'):.2f} "
                  f"| host {r['host_us']:.1f} us | err {r['rel_err_sampled_rows']:.1e}", flush=True)
        elif args.sweep:
            h, t, c = shape
            r = run_shape(h, t, "fp8_ds_mla", pools, fmi, copy_bw, l2, args, config=c, peers=c is SWEEP[8 if h <= 16 else 64][0])
            print(f"H={h:3d} T={t:3d} {c}: {r['us']:8.1f} us ({r['pct_copy_bw']:.0f}% copy BW, gather x"
                  f"{r['kernel_over_gather'] or float('nan'):.2f}, err {r['rel_err']:.1e})", flush=True)
        else:
            f, h, t = shape
            r = run_shape(h, t, f, pools, fmi, copy_bw, l2, args)
            print(f"{f:10s} H={h:3d} T={t:3d}: ours {r['us']:7.1f} us | gather {r['gather_us']:6.1f} (x{r['kernel_over_gather']:.2f}) | "
                  f"FlashMLA {r.get('flashmla_us') or float('nan'):7.1f} (x{r.get('ratio_vs_flashmla') or float('nan'):.2f}) "
                  f"kernel {r.get('flashmla_kernel_us') or float('nan'):7.1f} (x{r.get('ratio_vs_flashmla_kernel') or float('nan'):.2f}) | "
                  f"host {r['host_us']:5.1f} us | {r['pct_copy_bw']:3.0f}% copy BW | err {r['rel_err']:.1e}"
                  + (f" | splits {r['num_splits']} merge {r['merge']}: fused {r['us_fused']:.1f} / separate "
                     f"{r['us_separate']:.1f} us" if r.get("merge") else f" | splits {r['num_splits']}")
                  + (f" | v2 {r['v2_us']:.1f} us (x{r.get('v2_ratio_vs_flashmla') or float('nan'):.2f} FlashMLA, "
                     f"err {r['v2_rel_err']:.1e})" if r.get("v2_us") else ""), flush=True)
        last_cost = time.monotonic() - t0
        r["command"] = cmd
        r["sm120_proxy"] = args.sm120_proxy
        records.append(r)
    result["records"] = records
    if skipped:
        result["incomplete"] = {"skipped_shapes": skipped, "time_budget_s": args.time_budget}
    result["wall_s"] = budget.elapsed()
    if args.sweep:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    else:
        write_outputs(result, Path(args.out_dir), args.stem, prefill=args.prefill,
                      merge=args.append or args.sm120_proxy)
    print(f"wrote {args.out_dir}/{args.stem}.json in {result['wall_s']:.0f}s"
          + (f" ({len(skipped)} shapes skipped by the time budget)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

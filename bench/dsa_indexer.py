#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Benchmark of the DSA indexer decode step on one GPU, three ways, in one process:

* ``triton``   : kernels/triton_dsa_indexer.fp8_paged_mqa_logits + kernels/triton_dsa_topk.persistent_topk
* ``deepgemm`` : DeepGEMM ``fp8_fp4_paged_mqa_logits`` (vendored in the pinned vLLM 0.26.0 wheel, JIT-built
                 with nvcc) + vLLM's compiled ``torch.ops._C.persistent_topk`` (and ``cooperative_topk``,
                 which 0.26.0 picks on SM90 for <= 32 rows) from the same wheel
* ``torch``    : a float32 PyTorch implementation (gather + einsum + relu + weighted sum + torch.topk)

GLM-5 indexer shapes: 32 heads x 128, k = 2048, 64-token blocks, one query token per request
(next_n = 1), every request at the full context (max_model_len = context). Each measurement is the
median over rounds of CUDA-graph replays; a graph holds R iterations that read R different copies of
the KV pool (different physical blocks) so that small shapes are not served from L2.

Peers: the pinned wheel's ``vllm/_C_stable_libtorch.abi3.so`` and ``vllm/third_party/deep_gemm`` are
taken from ``.peers/`` (``vllm_C_stable_libtorch.abi3.so[.xz]``, ``deep_gemm.tar.xz``; git-ignored,
never committed) or extracted from the cached wheel (``--wheel``). Nothing of them is committed.

Results: ``bench/results/indexer_h200.json`` (records + the command), ``.png``, ``.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import glob
import io
import json
import lzma
import math
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels"))
sys.path.insert(0, ROOT)  # bench.common

import torch  # noqa: E402

K_TOP = 2048
H, D, PAGE = 32, 128, 64
ENTRY = D + 4
DEFAULT_WHEEL = os.path.expanduser("~/.cache/glm5-overlay/wheels/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl")
PEER_DIR = "/tmp/dsa_peers"


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------
# peers
# ------------------------------------------------------------------------------------------------


def _preload(names):
    import site
    roots = site.getsitepackages() + ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
    roots += glob.glob("/usr/local/cuda-*/lib64") + glob.glob("/usr/local/cuda-*/targets/x86_64-linux/lib")
    for name in names:
        found = None
        for r in roots:
            hits = sorted(glob.glob(os.path.join(r, "**", name + "*"), recursive=True))
            if hits:
                found = hits[0]
                break
        if found:
            ctypes.CDLL(found, mode=ctypes.RTLD_GLOBAL)
            log(f"  preloaded {found}")
        else:
            log(f"  (no {name} found to preload)")


def load_peers(peers_dir: str, wheel: str, dg_cache: str):
    """Returns (deep_gemm module or None, vllm ops available: bool, notes)."""
    notes = []
    os.makedirs(PEER_DIR, exist_ok=True)
    so_dst = os.path.join(PEER_DIR, "_C_stable_libtorch.abi3.so")
    if not os.path.exists(so_dst):
        src = os.path.join(peers_dir, "vllm_C_stable_libtorch.abi3.so")
        if os.path.exists(src + ".xz"):
            with lzma.open(src + ".xz") as f, open(so_dst, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 24)
        elif os.path.exists(src):
            shutil.copy(src, so_dst)
        elif os.path.exists(wheel):
            with zipfile.ZipFile(wheel) as z, z.open("vllm/_C_stable_libtorch.abi3.so") as f, open(so_dst, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 24)
    dg_dir = os.path.join(PEER_DIR, "deep_gemm")
    if not os.path.isdir(dg_dir):
        tx = os.path.join(peers_dir, "deep_gemm.tar.xz")
        if os.path.exists(tx):
            with tarfile.open(tx) as t:
                t.extractall(PEER_DIR)
        elif os.path.exists(wheel):
            pre = "vllm/third_party/deep_gemm/"
            with zipfile.ZipFile(wheel) as z:
                for m in z.namelist():
                    if m.startswith(pre) and not m.endswith("/"):
                        out = os.path.join(dg_dir, m[len(pre):])
                        os.makedirs(os.path.dirname(out), exist_ok=True)
                        with z.open(m) as f, open(out, "wb") as g:
                            shutil.copyfileobj(f, g)
    _preload(["libcudart.so.13", "libnvrtc.so.13"])
    have_ops = False
    if os.path.exists(so_dst):
        try:
            torch.ops.load_library(so_dst)
            have_ops = hasattr(torch.ops._C, "persistent_topk")
            notes.append("vllm 0.26.0 _C_stable_libtorch loaded")
        except Exception as e:  # noqa: BLE001
            notes.append(f"vllm ops NOT loaded: {e!r}"[:400])
    else:
        notes.append("vllm ops not found (.peers/ or wheel)")
    dg = None
    if os.path.isdir(dg_dir):
        os.environ.setdefault("DG_JIT_CACHE_DIR", dg_cache)
        sys.path.insert(0, PEER_DIR)
        try:
            import deep_gemm as dg  # noqa: F401
            if hasattr(dg, "set_pdl"):
                dg.set_pdl(True)  # vLLM enables PDL on SM90+
            notes.append(f"deep_gemm {getattr(dg, '__version__', '?')} loaded from {dg_dir}")
        except Exception as e:  # noqa: BLE001
            notes.append(f"deep_gemm NOT loaded: {e!r}"[:400])
            dg = None
    else:
        notes.append("deep_gemm not found (.peers/ or wheel)")
    return dg, have_ops, notes


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------


def make_pool(num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random valid indexer cache: e4m3 bytes (no NaN codes) + positive fp32 scales."""
    kv = torch.randint(0, 256, (num_blocks, PAGE * ENTRY), dtype=torch.uint8, device="cuda", generator=gen)
    vals = kv[:, : PAGE * D]
    vals[(vals & 0x7F) == 0x7F] = 0x7E
    sc = kv[:, PAGE * D:].view(torch.float32)
    sc.uniform_(0.002, 0.02, generator=gen)
    return kv.view(num_blocks, PAGE, ENTRY)


class Shape:
    def __init__(self, ctx, batch, next_n=1, max_model_len=None):
        self.ctx, self.B, self.nn = ctx, batch, next_n
        self.mml = max_model_len or ctx
        self.nblk = (self.mml + PAGE - 1) // PAGE
        self.rows = batch * next_n

    def set_bytes(self):
        return self.B * self.ctx * ENTRY

    def logits_bytes(self):
        return (self.B * self.ctx * ENTRY + self.rows * H * D + self.rows * H * 4
                + self.B * ((self.ctx + PAGE - 1) // PAGE) * 4 + self.rows * self.ctx * 4)

    def topk_bytes(self):
        return self.rows * self.ctx * 4 + self.rows * K_TOP * 4

    def name(self):
        return f"ctx={self.ctx},T={self.B}" + (f",mml={self.mml}" if self.mml != self.ctx else "")


def build_inputs(sh: Shape, max_sets: int, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_sets = max(1, min(max_sets, math.ceil(256e6 / max(sh.set_bytes(), 1))))
    blocks_per_set = sh.B * sh.nblk
    pool = make_pool(n_sets * blocks_per_set, gen)
    bts = []
    for s in range(n_sets):
        perm = torch.randperm(blocks_per_set, device="cuda", generator=gen) + s * blocks_per_set
        bts.append(perm.view(sh.B, sh.nblk).int().contiguous())
    q = (torch.randn(sh.B, sh.nn, H, D, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    w = torch.randn(sh.rows, H, device="cuda", generator=gen) * 0.02
    ctx2d = torch.full((sh.B, sh.nn), sh.ctx, dtype=torch.int32, device="cuda")
    if sh.nn > 1:
        ctx2d -= torch.arange(sh.nn - 1, -1, -1, device="cuda", dtype=torch.int32)[None, :]
    return dict(pool=pool, bts=bts, q=q, w=w, ctx2d=ctx2d, lens=ctx2d.reshape(-1).contiguous(), n_sets=n_sets)


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


# time_graph(step, n_iter) and copy_bandwidth() live in bench/common.py (shared with
# bench/sparse_mla_decode.py); TIMING is common's dict, updated by main().
from bench.common import TIMING, copy_bandwidth  # noqa: E402
from bench.common import time_graph_steps as time_graph  # noqa: E402


# ------------------------------------------------------------------------------------------------
# the three implementations
# ------------------------------------------------------------------------------------------------


def triton_step_fns(sh, inp, logit_over=None, topk_over=None, out=None):
    """Our logits, top-k and whole step as functions of the input set; ``out``: the logits buffer
    (a new one by default), the indices and top-k scratch are the call's own."""
    import triton_dsa_indexer as I
    import triton_dsa_topk as T
    lo = logit_over or {}
    to = topk_over or {}
    if out is None:
        out = torch.empty(sh.rows, sh.mml, dtype=torch.float32, device="cuda")
    idx = torch.empty(sh.rows, K_TOP, dtype=torch.int32, device="cuda")
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    tcfg, _, _ = T.call_config(K_TOP, sh.mml, sh.rows, nsm, torch.cuda.get_device_capability(0)[0], to)
    scratch = torch.empty(T._scratch_layout(sh.rows, K_TOP, tcfg["CAP"], tcfg["SPLIT"])["total"],
                          dtype=torch.int32, device="cuda")
    ns = inp["n_sets"]

    def logits(i):
        I.fp8_paged_mqa_logits(inp["q"], inp["pool"], inp["w"], inp["ctx2d"], inp["bts"][i % ns], sh.mml,
                               clean_logits=False, out=out, **lo)

    def topk(i):
        T.persistent_topk(out, inp["lens"], idx, scratch, K_TOP, sh.mml, **to)

    def both(i):
        logits(i)
        topk(i)
    return logits, topk, both, out, idx


def topk_path_fns(sh, inp, out, over):
    """The top-k alone and the whole step (logits + top-k) with the top-k forced by ``over``
    (``{"SHORT": False}``: the radix path; ``{"SHORT": True}``: the short-row kernel), on the same
    logits buffer ``out`` as triton_step_fns, with its own indices and scratch."""
    _, topk, both, _, _ = triton_step_fns(sh, inp, None, over, out=out)
    return topk, both


def dg_step_fns(sh, inp, dg, have_ops):
    kv4 = inp["pool"].unsqueeze(-2)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sched = dg.get_paged_mqa_logits_metadata(inp["ctx2d"], PAGE, num_sms)
    ns = inp["n_sets"]
    holder = {}
    ws = torch.empty(1024 * 1024, dtype=torch.uint8, device="cuda")
    idx = torch.empty(sh.rows, K_TOP, dtype=torch.int32, device="cuda")
    fixed = torch.empty(sh.rows, sh.mml, dtype=torch.float32, device="cuda")

    def logits(i):
        holder["lg"] = dg.fp8_fp4_paged_mqa_logits((inp["q"], None), kv4, inp["w"], inp["ctx2d"], inp["bts"][i % ns],
                                                   sched, sh.mml, clean_logits=False)

    def topk_on(lg):
        torch.ops._C.persistent_topk(lg, inp["ctx2d"], idx, ws, K_TOP, lg.shape[1])

    def topk(i):  # on a fixed logits buffer (isolated top-k timing)
        topk_on(fixed)

    def coop(i):
        torch.ops._C.cooperative_topk(fixed, inp["ctx2d"], idx, ws, K_TOP, sh.ctx)

    def both(i):
        logits(i)
        topk_on(holder["lg"])

    def both_vllm(i):  # what vLLM 0.26.0 runs on SM90: cooperative_topk for <= 32 rows
        logits(i)
        if sh.rows <= 32 and hasattr(torch.ops._C, "cooperative_topk"):
            torch.ops._C.cooperative_topk(holder["lg"], inp["ctx2d"], idx, ws, K_TOP, sh.ctx)
        else:
            topk_on(holder["lg"])
    return logits, topk, coop, both, both_vllm, holder, idx, fixed


def torch_step(sh, inp, i=0):
    pool = inp["pool"]
    nb = pool.shape[0]
    flat = pool.view(nb, PAGE * ENTRY)
    vals = flat[:, : PAGE * D].view(torch.float8_e4m3fn).view(nb, PAGE, D)
    scales = flat[:, PAGE * D:].view(torch.float32).view(nb, PAGE)
    nblk = (sh.ctx + PAGE - 1) // PAGE
    bt = inp["bts"][i % inp["n_sets"]][:, :nblk].long()
    k = vals[bt].float().view(sh.B, nblk * PAGE, D)[:, : sh.ctx] * scales[bt].view(sh.B, -1)[:, : sh.ctx, None]
    s = torch.einsum("bnhd,bld->bnhl", inp["q"].float(), k).relu_()
    lg = torch.einsum("bnhl,bnh->bnl", s, inp["w"].view(sh.B, sh.nn, H)).reshape(sh.rows, sh.ctx)
    del s, k
    return torch.topk(lg, min(K_TOP, sh.ctx), dim=-1).indices


# ------------------------------------------------------------------------------------------------
# checks
# ------------------------------------------------------------------------------------------------


def exact_topk_ref(lg, lens, k):
    out = torch.full((lg.shape[0], k), -1, dtype=torch.int32, device=lg.device)
    for r in range(lg.shape[0]):
        L = int(lens[r])
        if L <= k:
            out[r, :L] = torch.arange(L, dtype=torch.int32, device=lg.device)
        else:
            o = torch.sort(lg[r, :L], descending=True, stable=True).indices[:k]
            out[r] = torch.sort(o).values.int()
    return out


def canon(x):
    y = x.long().clone()
    y[y < 0] = 1 << 40
    y = torch.sort(y, dim=-1).values
    y[y == (1 << 40)] = -1
    return y


def check_shape(sh, inp, dg, have_ops, rows_to_check=8):
    """Our logits vs DeepGEMM's (valid columns), our top-k vs the exact reference on our logits,
    overlap with persistent_topk on DeepGEMM's logits."""
    res = {}
    lf, tf, bf, out, idx = triton_step_fns(sh, inp)
    bf(0)
    torch.cuda.synchronize()
    rows = list(range(min(sh.rows, rows_to_check)))
    ref = exact_topk_ref(out[rows], inp["lens"][rows], K_TOP)
    res["topk_exact"] = bool(torch.equal(canon(idx[rows]), canon(ref)))
    if dg is not None:
        dlf, dtf, dcf, dbf, dbv, holder, didx, _ = dg_step_fns(sh, inp, dg, have_ops)
        dlf(0)
        torch.cuda.synchronize()
        lg_dg = holder["lg"]
        a = out[:, : sh.ctx].double()
        b = lg_dg[:, : sh.ctx].double()
        res["logits_rel_err_vs_deepgemm"] = float((a - b).norm() / b.norm())
        if have_ops:
            torch.ops._C.persistent_topk(lg_dg, inp["ctx2d"], didx, torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                         K_TOP, lg_dg.shape[1])
            torch.cuda.synchronize()
            ov = []
            for r in rows:
                s1 = set(idx[r].tolist()) - {-1}
                s2 = set(didx[r].tolist()) - {-1}
                ov.append(len(s1 & s2) / max(len(s2), 1))
            res["topk_overlap_vs_deepgemm_persistent"] = min(ov)
    return res


def check_writers(dg, have_ops):
    """Our K write / gather against vLLM's CUDA ops (byte equality)."""
    import triton_dsa_indexer as I
    out = {}
    if not have_ops or not hasattr(torch.ops, "_C_cache_ops"):
        return {"skipped": "no vllm cache ops"}
    g = torch.Generator(device="cuda").manual_seed(5)
    T_, nb = 5000, 200
    k = (torch.randn(T_, D, device="cuda", generator=g) * torch.empty(T_, 1, device="cuda").uniform_(0.01, 30, generator=g)).to(torch.bfloat16)
    slots = torch.randperm(nb * PAGE, device="cuda", generator=g)[:T_]
    slots[::13] = -1
    c1 = torch.randint(0, 256, (nb, PAGE, ENTRY), dtype=torch.uint8, device="cuda", generator=g)
    c2 = c1.clone()
    I.indexer_k_quant_and_cache(k, c1, slots, 128, "ue8m0")
    torch.ops._C_cache_ops.indexer_k_quant_and_cache(k, c2, slots, 128, "ue8m0")
    torch.cuda.synchronize()
    out["k_write_bytes_differ_vs_vllm"] = int((c1 != c2).sum())
    lens = [3000, 1, 0, 1999]
    bt = torch.stack([torch.randperm(nb, device="cuda", generator=g)[:60] for _ in lens]).int()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    N = int(cu[-1])
    dk1 = torch.empty(N, D, dtype=torch.float8_e4m3fn, device="cuda")
    ds1 = torch.empty(N, 4, dtype=torch.uint8, device="cuda")
    dk2, ds2 = torch.empty_like(dk1), torch.empty_like(ds1)
    I.cp_gather_indexer_k_quant_cache(c1, dk1, ds1, bt, cu)
    torch.ops._C_cache_ops.cp_gather_indexer_k_quant_cache(c1, dk2, ds2, bt, cu)
    torch.cuda.synchronize()
    out["gather_bytes_differ_vs_vllm"] = int((dk1.view(torch.uint8) != dk2.view(torch.uint8)).sum() + (ds1 != ds2).sum())
    return out


def check_prefill(dg):
    """Ragged logits vs DeepGEMM fp8_fp4_mqa_logits on one chunked-prefill shape, plus timing."""
    import triton_dsa_indexer as I
    g = torch.Generator(device="cuda").manual_seed(6)
    M, N = 4096, 8192
    q = (torch.randn(M, H, D, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    kf = (torch.randn(N, D, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    ks = torch.rand(N, device="cuda", generator=g) * 0.01 + 0.002
    w = torch.randn(M, H, device="cuda", generator=g) * 0.02
    kst = torch.zeros(M, dtype=torch.int32, device="cuda")
    ke = (torch.arange(M, device="cuda") + (N - M) + 1).int()
    res = {"shape": f"M={M},N={N},causal"}
    ours = I.fp8_mqa_logits(q, kf, ks, w, kst, ke, clean_logits=False)
    t_ours, _ = time_graph(lambda i: I.fp8_mqa_logits(q, kf, ks, w, kst, ke, clean_logits=False, out=ours), 4)
    res["triton_us"] = t_ours
    if dg is not None:
        lg = dg.fp8_fp4_mqa_logits((q, None), (kf, ks), w, kst, ke, clean_logits=False)
        mask = torch.arange(N, device="cuda")[None, :] < ke[:, None]
        a, b = ours[mask].double(), lg[mask].double()
        res["rel_err_vs_deepgemm"] = float((a - b).norm() / b.norm())
        t_dg, _ = time_graph(lambda i: dg.fp8_fp4_mqa_logits((q, None), (kf, ks), w, kst, ke, clean_logits=False), 4)
        res["deepgemm_us"] = t_dg
    return res


# ------------------------------------------------------------------------------------------------
# precompile (parallel Triton compiles in worker processes; the main process hits the disk cache)
# ------------------------------------------------------------------------------------------------


def _warm_task(task):
    import torch as _t
    sys.path.insert(0, os.path.join(ROOT, "kernels"))
    import triton_dsa_indexer as I
    import triton_dsa_topk as T
    kind = task[0]
    t0 = time.time()
    if kind == "logits":
        _, B, nn_, mml, over = task
        nblk = (mml + PAGE - 1) // PAGE
        pool = _t.zeros(4, PAGE, ENTRY, dtype=_t.uint8, device="cuda")
        q = _t.zeros(B, nn_, H, D, dtype=_t.float8_e4m3fn, device="cuda")
        w = _t.zeros(B * nn_, H, device="cuda")
        ctx = _t.ones(B, nn_, dtype=_t.int32, device="cuda")
        bt = _t.zeros(B, nblk, dtype=_t.int32, device="cuda")
        out = _t.empty(B * nn_, mml, device="cuda")
        I.fp8_paged_mqa_logits(q, pool, w, ctx, bt, mml, clean_logits=False, out=out, **over)
    elif kind == "topk":
        _, rows, width, over = task
        lg = _t.randn(rows, width, device="cuda")
        lens = _t.full((rows,), width, dtype=_t.int32, device="cuda")
        idx = _t.empty(rows, K_TOP, dtype=_t.int32, device="cuda")
        T.persistent_topk(lg, lens, idx, None, K_TOP, width, **over)
    _t.cuda.synchronize()
    return f"{task[0]}{task[1:]} {time.time() - t0:.1f}s"


def precompile(tasks, workers):
    if not tasks:
        return
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        for r in ex.map(_warm_task, tasks):
            pass
    log(f"precompiled {len(tasks)} kernel configs in {time.time() - t0:.1f}s")


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def run_shape(sh, dg, have_ops, max_sets, torch_ref=True, logit_over=None, topk_over=None, do_dg=True):
    rec = {"context": sh.ctx, "tokens": sh.B, "next_n": sh.nn, "max_model_len": sh.mml, "k": K_TOP,
           "heads": H, "head_dim": D}
    inp = build_inputs(sh, max_sets)
    R = inp["n_sets"] if inp["n_sets"] > 1 else 2
    rec["graph_iters"] = R
    lf, tf, bf, out, idx = triton_step_fns(sh, inp, logit_over, topk_over)
    rec["us"], rec["us_spread"] = time_graph(bf, R)
    rec["logits_us"], _ = time_graph(lf, R)
    rec["topk_us"], _ = time_graph(tf, R)
    # both top-k paths at every shape (topk_us / us stay "what the dispatch runs"): the short-row
    # kernel where the rows allow it (max_model_len <= SHORT_MAX), and the radix path
    import triton_dsa_topk as T
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    tcfg, _, _ = T.call_config(K_TOP, sh.mml, sh.rows, nsm, torch.cuda.get_device_capability(0)[0], topk_over)
    # "radix+bisect": the radix path whose merge kernel selects rows <= CAP with the short kernel's
    # bisection (what max_model_len > SHORT_MAX runs); "radix": SHORT=False, the radix select throughout
    rec["topk_path"] = "short" if tcfg["SHORT"] else ("radix+bisect" if tcfg.get("SHORT_SELECT") else "radix")
    if not topk_over:  # main records (a sweep variant times what it overrides)
        for path, over in (("short", {"SHORT": True}), ("radix", {"SHORT": False, "SHORT_SELECT": False})):
            if path == rec["topk_path"]:
                rec[f"topk_{path}_us"], rec[f"us_{path}_topk"] = rec["topk_us"], rec["us"]
            elif path == "radix" or sh.mml <= T.SHORT_MAX:
                ptf, pbf = topk_path_fns(sh, inp, out, over)
                rec[f"topk_{path}_us"], _ = time_graph(ptf, R)
                rec[f"us_{path}_topk"], _ = time_graph(pbf, R)
    if dg is not None and do_dg:
        dlf, dtf, dcf, dbf, dbv, holder, didx, fixed = dg_step_fns(sh, inp, dg, have_ops)
        rec["deepgemm_us"], _ = time_graph(dlf, R)
        if have_ops:
            fixed.copy_(out)  # same logits as ours for the isolated top-k timing
            rec["persistent_topk_us"], _ = time_graph(dtf, R)
            if sh.rows <= 32 and hasattr(torch.ops._C, "cooperative_topk"):
                rec["cooperative_topk_us"], _ = time_graph(dcf, R)
            rec["deepgemm_plus_topk_us"], _ = time_graph(dbf, R)
            rec["deepgemm_plus_vllm_topk_us"], _ = time_graph(dbv, R)
            rec["ratio_vs_deepgemm"] = rec["us"] / rec["deepgemm_plus_topk_us"]
            rec["ratio_vs_vllm_choice"] = rec["us"] / rec["deepgemm_plus_vllm_topk_us"]
        rec["logits_ratio_vs_deepgemm"] = rec["logits_us"] / rec["deepgemm_us"]
        del holder
    if torch_ref:
        try:
            torch_step(sh, inp)
            torch.cuda.synchronize()
            ts = []
            for _ in range(2 if sh.B * sh.ctx > 2_000_000 else 5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                torch_step(sh, inp)
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            rec["torch_us"] = statistics.median(ts)
        except torch.OutOfMemoryError:
            rec["torch_us"] = None
        torch.cuda.empty_cache()
    del inp
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=os.path.join(ROOT, ".peers"))
    ap.add_argument("--wheel", default=DEFAULT_WHEEL)
    ap.add_argument("--dg-cache", default="/tmp/dg_jit_cache")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--tokens", default="1,16,64,128")
    ap.add_argument("--extra", default="", help="extra shapes ctx:T:max_model_len;...")
    ap.add_argument("--max-sets", type=int, default=128)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--sweep", default="", help="json list of {logits:{...}, topk:{...}} variants")
    ap.add_argument("--sweep-shapes", default="32768:1,32768:16,32768:64,131072:64,4096:128")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "indexer_h200"))
    ap.add_argument("--replot", metavar="JSON", help="no GPU: write JSON's .md table and .png plot beside it, exit")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=15.0)
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; later shapes are skipped past it")
    args = ap.parse_args()
    if args.replot:  # the table and plot of a results file (written on the GPU host without the plot)
        result = json.loads(open(args.replot).read())
        stem = args.replot[:-len(".json")] if args.replot.endswith(".json") else args.replot
        write_md(result, stem + ".md")
        plot(result, stem + ".png")
        log(f"wrote {stem}.md and {stem}.png from {args.replot}")
        return
    TIMING.update(target_ms=args.target_ms, rounds=args.rounds)
    t_start = time.time()
    import triton
    import triton_dsa_indexer as I
    import triton_dsa_topk as T

    dev = torch.cuda.get_device_name(0)
    log(f"device {dev}, torch {torch.__version__}, triton {triton.__version__}")
    shapes = [Shape(c, t) for c in map(int, args.contexts.split(",")) if c for t in map(int, args.tokens.split(",")) if t]
    for e in filter(None, args.extra.split(";")):
        c, t, m = map(int, e.split(":"))
        shapes.append(Shape(c, t, 1, m))
    variants = json.loads(args.sweep) if args.sweep else []
    sweep_shapes = [Shape(*map(int, s.split(":"))) for s in args.sweep_shapes.split(",")] if variants else []

    # -- parallel Triton compiles (workers) while the main process loads peers / JITs DeepGEMM
    tasks = []
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for sh in shapes + sweep_shapes:
        for v in ([{}] + [x.get("logits", {}) for x in variants]):
            v = dict(v)
            cfg = I.paged_logits_config(sh.B, sh.nn, sh.mml, nsm, v.pop("WAVES", I.PAGED_WAVES), v.get("BLOCK_N", 64))
            cfg.update(v)
            t = ("logits", sh.B, sh.nn, sh.mml, cfg)
            if t not in tasks:
                tasks.append(t)
        for v in ([{}, {"SHORT": False, "SHORT_SELECT": False}] + [x.get("topk", {}) for x in variants]):
            cfg = T.topk_config(K_TOP, sh.mml, sh.rows, nsm)
            cfg.update(v)
            t = ("topk", 1, sh.mml, cfg)
            if all(not (x[0] == "topk" and x[3] == cfg and x[2] % 16 == sh.mml % 16) for x in tasks):
                tasks.append(t)
    pool = cf.ThreadPoolExecutor(1)
    fut = pool.submit(precompile, tasks, args.workers)

    dg, have_ops, notes = load_peers(args.peers, args.wheel, args.dg_cache)
    for n in notes:
        log("  " + n)
    checks = {}
    if dg is not None:  # JIT DeepGEMM now (nvcc), overlapping the Triton compiles
        t0 = time.time()
        sh0 = Shape(4096, 1)
        inp0 = build_inputs(sh0, 1)
        dlf = dg_step_fns(sh0, inp0, dg, have_ops)[0]
        dlf(0)
        torch.cuda.synchronize()
        log(f"deep_gemm paged logits JIT/warmup {time.time() - t0:.1f}s")
        del inp0
    fut.result()
    if not args.skip_checks:
        try:
            checks["writers"] = check_writers(dg, have_ops)
        except Exception as e:  # noqa: BLE001
            checks["writers"] = {"error": repr(e)[:300]}
        log("writers:", checks["writers"])

    copy_bw = copy_bandwidth()
    log(f"copy bandwidth (read+write): {copy_bw / 1e12:.3f} TB/s")

    records, sweep_recs = [], []
    for sh in shapes:
        if time.time() - t_start > args.time_budget:
            log(f"time budget reached, skipping {sh.name()}")
            continue
        try:
            r = run_shape(sh, dg, have_ops, args.max_sets, torch_ref=not args.no_torch)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            records.append({"context": sh.ctx, "tokens": sh.B, "error": repr(e)[:300]})
            continue
        r["logits_bytes"] = sh.logits_bytes()
        r["topk_bytes"] = sh.topk_bytes()
        r["logits_floor_us"] = sh.logits_bytes() / copy_bw * 1e6
        r["topk_floor_us"] = sh.topk_bytes() / copy_bw * 1e6
        r["logits_pct_copy_bw"] = 100 * sh.logits_bytes() / (r["logits_us"] * 1e-6) / copy_bw
        if dg is not None and "deepgemm_us" in r:
            r["deepgemm_logits_pct_copy_bw"] = 100 * sh.logits_bytes() / (r["deepgemm_us"] * 1e-6) / copy_bw
        if not args.skip_checks:
            try:
                inp = build_inputs(sh, 1, seed=1)
                r["checks"] = check_shape(sh, inp, dg, have_ops)
                del inp
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                r["checks"] = {"error": repr(e)[:300]}
        records.append(r)
        log(f"{sh.name()}: ours {r['us']:.1f} us (logits {r['logits_us']:.1f}, topk {r['topk_us']:.1f}) | "
            f"DG {r.get('deepgemm_us', float('nan')):.1f} + PT {r.get('persistent_topk_us', float('nan')):.1f} "
            f"= {r.get('deepgemm_plus_topk_us', float('nan')):.1f} | ratio {r.get('ratio_vs_deepgemm', float('nan')):.3f} "
            f"| bw {r['logits_pct_copy_bw']:.0f}% | torch {r.get('torch_us') or float('nan'):.0f} | {r.get('checks')} "
            f"| top-k {r.get('topk_path')}: short {r.get('topk_short_us', float('nan')):.1f} "
            f"radix {r.get('topk_radix_us', float('nan')):.1f} coop {r.get('cooperative_topk_us', float('nan')):.1f}")

    if not args.skip_checks and dg is not None:
        try:
            checks["prefill"] = check_prefill(dg)
        except Exception as e:  # noqa: BLE001
            checks["prefill"] = {"error": repr(e)[:300]}
        log("prefill:", checks["prefill"])

    for v in variants:
        for sh in sweep_shapes:
            if time.time() - t_start > args.time_budget:
                log("sweep: half the time budget used, stopping the sweep")
                break
            try:
                r = run_shape(sh, dg, have_ops, args.max_sets, torch_ref=False, logit_over=v.get("logits"),
                              topk_over=v.get("topk"), do_dg=False)
            except Exception as e:  # noqa: BLE001
                log(f"sweep {json.dumps(v)} {sh.name()} failed: {e!r}"[:400])
                continue
            r["variant"] = v
            r["logits_pct_copy_bw"] = 100 * sh.logits_bytes() / (r["logits_us"] * 1e-6) / copy_bw
            sweep_recs.append(r)
            log(f"sweep {json.dumps(v)} {sh.name()}: total {r['us']:.1f} logits {r['logits_us']:.1f} "
                f"topk {r['topk_us']:.1f} us ({r['logits_pct_copy_bw']:.0f}% bw)")

    result = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "device": dev, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "copy_bandwidth_Bps": copy_bw,
        "peers": notes, "checks": checks, "records": records, "sweep": sweep_recs,
        "wall_s": time.time() - t_start,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    if records:
        write_md(result, args.out + ".md")
        try:
            plot(result, args.out + ".png")
        except Exception as e:  # noqa: BLE001
            log("plot failed:", e)
    log(f"wrote {args.out}.json ({time.time() - t_start:.0f}s)")
    print_table(records)


def _f(x, fmt="{:.1f}"):
    return fmt.format(x) if isinstance(x, (int, float)) and x == x else "-"


def print_table(records):
    log("\nctx     T | triton us (logits+topk) | DG+PT us (DG, PT) | ratio | logits %bw (DG %bw) | torch us")
    for r in records:
        if "us" not in r:
            log(f"{r['context']:6d} {r['tokens']:4d} | error {r.get('error')}")
            continue
        log(f"{r['context']:6d} {r['tokens']:4d} | {_f(r['us'])} ({_f(r['logits_us'])}+{_f(r['topk_us'])}) | "
            f"{_f(r.get('deepgemm_plus_topk_us'))} ({_f(r.get('deepgemm_us'))}, {_f(r.get('persistent_topk_us'))}) | "
            f"{_f(r.get('ratio_vs_deepgemm'), '{:.2f}')} | {_f(r['logits_pct_copy_bw'], '{:.0f}')} "
            f"({_f(r.get('deepgemm_logits_pct_copy_bw'), '{:.0f}')}) | {_f(r.get('torch_us'), '{:.0f}')}")


def write_md(result, path):
    lines = [f"# DSA indexer decode step on {result['device']}", "",
             f"Command: `{result['command']}`", "",
             f"Copy bandwidth (read+write) measured in the same run: {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s. "
             "k = 2048, 32 heads x 128, next_n = 1, every request at the full context. Times are medians of "
             "CUDA-graph replays (us per step).", "",
             "| context | T | Triton logits+top-k | logits | top-k | DeepGEMM logits | persistent_topk | DG+PT (same graph) "
             "| ratio | logits % copy BW (DG) | PyTorch |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["records"]:
        if "us" not in r:
            continue
        lines.append(f"| {r['context']} | {r['tokens']} | {_f(r['us'])} | {_f(r['logits_us'])} | {_f(r['topk_us'])} | "
                     f"{_f(r.get('deepgemm_us'))} | {_f(r.get('persistent_topk_us'))} | {_f(r.get('deepgemm_plus_topk_us'))} | "
                     f"{_f(r.get('ratio_vs_deepgemm'), '{:.2f}')} | {_f(r['logits_pct_copy_bw'], '{:.0f}')} "
                     f"({_f(r.get('deepgemm_logits_pct_copy_bw'), '{:.0f}')}) | {_f(r.get('torch_us'), '{:.0f}')} |")
    lines += ["", "ratio = Triton (logits + top-k) / (DeepGEMM logits + vLLM persistent_topk), both captured the same way.", ""]
    if any("topk_radix_us" in r for r in result["records"]):
        lines += ["Top-k paths (us; `top-k` above is the dispatch's path): the short-row kernel (one launch, "
                  "max_model_len <= SHORT_MAX), the radix path (`SHORT=False`: radix select throughout; the dispatch's "
                  "`radix+bisect` selects rows <= CAP with the bisection), alone and in the whole step.", "",
                  "| context | T | dispatch | short top-k | radix top-k | step with short | step with radix | "
                  "cooperative_topk |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in result["records"]:
            if "us" not in r:
                continue
            lines.append(f"| {r['context']} | {r['tokens']} | {r.get('topk_path', '-')} | {_f(r.get('topk_short_us'))} | "
                         f"{_f(r.get('topk_radix_us'))} | {_f(r.get('us_short_topk'))} | {_f(r.get('us_radix_topk'))} | "
                         f"{_f(r.get('cooperative_topk_us'))} |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [r for r in result["records"] if "us" in r]
    ctxs = sorted({r["context"] for r in recs})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, c in zip(axes[0], ctxs):
        rs = sorted([r for r in recs if r["context"] == c], key=lambda r: r["tokens"])
        x = [r["tokens"] for r in rs]
        ax.plot(x, [r["us"] for r in rs], "o-", label="Triton logits+top-k")
        ax.plot(x, [r["logits_us"] for r in rs], "o--", label="Triton logits")
        if all("deepgemm_plus_topk_us" in r for r in rs):
            ax.plot(x, [r["deepgemm_plus_topk_us"] for r in rs], "s-", label="DeepGEMM + persistent_topk")
            ax.plot(x, [r["deepgemm_us"] for r in rs], "s--", label="DeepGEMM logits")
        ax.plot(x, [r["logits_floor_us"] for r in rs], ":", color="gray", label="logits byte floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"context {c}")
        ax.set_xlabel("tokens (requests)")
        ax.set_ylabel("us per step")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(result["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

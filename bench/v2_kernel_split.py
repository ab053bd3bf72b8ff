#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where the device time of one split ``sparse_mla_decode_v2`` call goes: the attention kernel
and the merge of its partial results, per kernel, at the dispatch's shapes (fp8_ds_mla, 32k
context, top-k 2048). Profile before rewriting the merge.

For each (H, T) and merge (the dispatch's, and the separate merge forced by
``GLM5_SPARSE_MLA_MERGE=separate`` where the dispatch fuses), over input sets that move > 3x the
L2 per pass:

* ``call_us``: CUDA-graph replay of the whole call (median per call);
* ``kernels``: per-kernel device time from ``torch.profiler`` (CUPTI) over eager calls, us per
  call, by kernel name;
* ``merge_floor_us``: the separate merge's bytes (partials read, output written) over the copy
  bandwidth measured in the same run;
* ``merge_variants``: the separate merge kernel alone on one call's partials (L2-resident, as
  after the attention kernel) with other ``BLOCK_D`` / warps than the plan's;
* ``forced_splits_us`` (``--splits``): the whole call with the dispatch's config at forced split
  counts (those the clamp keeps);
* ``configs`` (``--configs``, a JSON object name -> config override): the whole call under each
  config (its own split policy), with its split count and its output's relative L2 distance to
  the dispatch's on the same inputs (``rel_vs_dispatch``).

Writes ``--out`` (JSON: command, device, records). GPU only.

  python3 bench/v2_kernel_split.py --out bench/results/v2_kernel_split_h100.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SCALE = 256 ** -0.5
TOPK = 2048
CTX = 32768
POOL_TOKENS = 1 << 18  # 256k tokens, 168 MB: > 3x the L2
SHAPES = ((8, 4), (8, 32), (8, 64), (8, 128), (16, 32), (16, 64), (16, 128))
MERGE_VARIANTS = ((128, 4), (256, 4), (512, 4), (512, 8), (128, 1), (64, 2))  # (BLOCK_D, warps)
# one kernel launch in a CUDA graph, timed alone, carries a fixed replay cost (~7 us on an H100):
# ``merge_variants`` compare tiles with each other, ``kernels`` gives the merge's time in the call


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"8:32,16:64"`` -> [(H, T), ...]"""
    return common.parse_pairs(text)


def kernel_times(fn, calls: int) -> dict[str, float]:
    """Device us per call of each kernel ``fn`` launches (torch.profiler / CUPTI)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None)
        if dt is None:
            dt = getattr(ev, "cuda_time_total", 0.0)
        if dt:
            times[ev.key[:80]] = times.get(ev.key[:80], 0.0) + dt / calls
    return times


def measure(H: int, T: int, merge: str | None, pool, copy_bw: float, calls: int, splits=(),
            configs: dict | None = None, merge_variants: bool = True) -> dict:
    import torch

    import sparse_mla_v2_gpu as sb
    from kernels import triton_sparse_mla as v1
    from kernels import triton_sparse_mla_v2 as v2

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(H * 1000 + T)
    nb = pool.shape[0]
    n_sets = max(2, min(32, math.ceil(3 * 50e6 / (T * TOPK * 656))))
    sets = [(torch.randn((T, H, 576), generator=gen, device=dev).to(torch.bfloat16),
             sb.make_indices(T, CTX, nb, gen, dev)) for _ in range(n_sets)]
    v2._PLANS_V2.clear()
    with common.sparse_mla_merge_env(merge):
        def call(s):
            return v2.sparse_mla_decode_v2(s[0], pool, s[1], SCALE, "fp8_ds_mla", return_lse=False)

        for s in sets[:2]:
            call(s)
            call(s)
        torch.cuda.synchronize()
        key = v1._plan_key(sets[0][0], pool, sets[0][1], SCALE, "fp8_ds_mla", None, None, None, None)
        p = v2._PLANS_V2[key]
        rec = {"H": H, "T": T, "merge_env": merge, "num_splits": p.num_splits, "fused": bool(p.fused),
               "keys_m": bool(p.keys_m), "n_sets": n_sets}
        rec["call_us"] = common.time_graph([(lambda s=s: call(s)) for s in sets], rep_ms=30, warmup_ms=10)
        it = iter(range(10 ** 9))
        rec["kernels"] = kernel_times(lambda: call(sets[next(it) % n_sets]), calls)
        if p.num_splits > 1 and not p.fused and merge_variants:
            n = T * H * p.num_splits
            rec["merge_bytes"] = n * (512 + 1) * 4 + T * H * (512 * 2 + 4)
            rec["merge_floor_us"] = rec["merge_bytes"] / copy_bw * 1e6
            # the partials of one call, then the merge alone with other tile shapes
            ws = v1._workspace(sets[0][0].device, p.dev_index, v1._raw_stream(p.dev_index), p.ws_numel)
            call(sets[0])
            po = ws[:n * 512].view(n, 512)
            plse = ws[n * 512:n * 513]
            out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=dev)
            lse = torch.empty((T, H), dtype=torch.float32, device=dev)
            ref = None
            variants = {}
            block_s = v2.merge_tile(p.num_splits)[0]
            for bd, nw in MERGE_VARIANTS:
                def run(bd=bd, nw=nw):
                    v1._sparse_mla_merge_kernel[(T * H * (512 // bd),)](
                        po, plse, out, lse, H, p.num_splits, *out.stride(), *lse.stride(),
                        BLOCK_S=block_s, BLOCK_D=bd, num_warps=nw)
                run()
                if ref is None:
                    ref = out.clone()
                same = bool(torch.equal(out, ref))
                variants[f"BD{bd}_w{nw}"] = {"us": common.time_graph([run], rep_ms=20, warmup_ms=5), "same": same}
            rec["merge_variants"] = variants
        if splits:  # the dispatch's config with forced split counts (the merge as above)
            forced = {}
            for ns in splits:
                eff = v2.v2_num_splits(T, H, TOPK, v1._dispatch_major(torch.cuda.get_device_capability()[0]),
                                       torch.cuda.get_device_properties(0).multi_processor_count, num_splits=ns)
                if eff != ns:
                    continue  # clamped to another count (no empty split)
                forced[str(ns)] = common.time_graph(
                    [(lambda s=s, ns=ns: v2.sparse_mla_decode_v2(s[0], pool, s[1], SCALE, "fp8_ds_mla",
                                                                 num_splits=ns, return_lse=False)) for s in sets],
                    rep_ms=30, warmup_ms=10)
            rec["forced_splits_us"] = forced
        if configs:  # whole calls under config overrides, checked against the dispatch's output
            optin = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 101376)
            cc = v1._dispatch_major(torch.cuda.get_device_capability()[0])
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            ref = call(sets[0])[0].float()
            res = {}
            for name, c in configs.items():
                smem = v2.config_shared_bytes(v2.resolve_config_v2(H, cc, T, c))
                if smem > optin:
                    res[name] = {"skipped": f"{smem} B of shared memory > {optin}"}
                    continue

                def ccall(s, c=c):
                    return v2.sparse_mla_decode_v2(s[0], pool, s[1], SCALE, "fp8_ds_mla", config=dict(c),
                                                   fallback=False, return_lse=False)

                o = ccall(sets[0])[0].float()
                res[name] = {"rel_vs_dispatch": ((o - ref).norm() / ref.norm()).item(),
                             "num_splits": v2.v2_num_splits(T, H, TOPK, cc, sms, config=c),
                             "us": common.time_graph([(lambda s=s: ccall(s)) for s in sets], rep_ms=30, warmup_ms=10)}
            rec["configs"] = res
        torch.cuda.synchronize()
        return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{h}:{t}" for h, t in SHAPES), help="H:T,H:T,...")
    ap.add_argument("--calls", type=int, default=50, help="eager calls profiled per shape")
    ap.add_argument("--splits", default="", help="also time the dispatch's config at these forced split "
                                                 "counts (comma-separated), as forced_splits_us")
    ap.add_argument("--configs", default="", help="JSON object name -> config override: also time the whole "
                                                  "call under each (as configs)")
    ap.add_argument("--dispatch-only", action="store_true",
                    help="only the dispatch's merge, without the merge tile variants (with --configs: the configs' timings)")
    ap.add_argument("--out", default=str(Path(common.ROOT) / "bench" / "results" / "v2_kernel_split_h100.json"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("v2_kernel_split: needs a CUDA GPU", file=sys.stderr)
        return 2
    import sparse_mla_v2_gpu as sb

    configs = json.loads(args.configs) if args.configs else None
    if configs is not None and not (isinstance(configs, dict) and all(isinstance(v, dict) for v in configs.values())):
        ap.error("--configs must be a JSON object of name -> config dict")
    pool = sb.make_pool(POOL_TOKENS, "cuda")
    copy_bw = common.copy_bandwidth()
    res = common.ResultsFile(args.out, {"command": common.command_line(__file__, argv),
                                        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "copy_bw_Bps": copy_bw, "context": CTX, "topk": TOPK})

    def report(rec):
        res.add(rec)
        ks = " ".join(f"{k[:28]}={v:.1f}" for k, v in sorted(rec["kernels"].items(), key=lambda kv: -kv[1]))
        mv = " ".join(f"{k}={v['us']:.1f}{'' if v['same'] else '(!)'}" for k, v in rec.get("merge_variants", {}).items())
        mv += "".join(f" S{k}={v:.1f}" for k, v in rec.get("forced_splits_us", {}).items())
        mv += "".join(f" {k}={v['us']:.1f}(S{v['num_splits']},rel {v['rel_vs_dispatch']:.1e})" if "us" in v
                      else f" {k}=skipped" for k, v in rec.get("configs", {}).items())
        print(f"H={rec['H']} T={rec['T']} merge={rec['merge_env'] or 'dispatch'} splits={rec['num_splits']} "
              f"fused={rec['fused']} call={rec['call_us']:.1f} | {ks} | "
              f"floor={rec.get('merge_floor_us', float('nan')):.1f} | {mv}", flush=True)

    for H, T in parse_shapes(args.shapes):
        d = measure(H, T, None, pool, copy_bw, args.calls,
                    splits=[int(x) for x in args.splits.split(",") if x.strip()], configs=configs,
                    merge_variants=not args.dispatch_only)
        report(d)
        # the other merge (the fused one only up to 16 splits: past that the last arriver's
        # serial merge takes 100+ us)
        other = "separate" if d["fused"] else "fused" if 1 < d["num_splits"] <= 16 else None
        if other is not None and not args.dispatch_only:
            report(measure(H, T, other, pool, copy_bw, args.calls))
    res.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where the DSA indexer's top-k time goes, per kernel, on one GPU (no peers needed).

For each shape (``ctx:T[:max_model_len]``, GLM-5's k = 2048) the logits come from our own paged
logits kernel over the same random indexer cache as ``bench/dsa_indexer.py`` (so the value
distribution, and with it the pivot window and the bisection's step count, is the bench's), then:

* ``topk_us``     the whole top-k call as the dispatch runs it (CUDA graph, median of rounds)
* ``segment_us``  its first launch alone (``_topk_segment_kernel``: pivot window + streaming pass),
                  when the plan has one; ``merge_us`` = ``topk_us - segment_us`` (the merge
                  kernel rewrites the segment counts in place, so it cannot be replayed alone)
* ``kernels``     the plan: each launch with its grid, warps and constexprs

``--sweep`` times variants (JSON list of top-k override dicts, as ``bench/dsa_indexer.py``'s
``{"topk": ...}``; a ``"_shapes"`` entry, e.g. ``"4096:1,4096:16"``, limits a variant to those
shapes) at every shape; each variant's output is checked against the default's
(same set of indices per row, exact). ``--ncu`` runs each shape's top-k once after a warm-up and
exits, for ``ncu -k regex:_topk_``.

  python3 bench/topk_breakdown.py --out bench/results/topk_breakdown_h100
  python3 bench/topk_breakdown.py --sweep '[{"S": 512}]'
  ncu -k regex:_topk_ --section WarpStateStats ... python3 bench/topk_breakdown.py --ncu --shapes 32768:16
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import dsa_indexer as DI  # noqa: E402
from bench.common import TIMING  # noqa: E402
from bench.common import time_graph_steps as time_graph  # noqa: E402

DEFAULT_SHAPES = "4096:1,4096:16,4096:64:32768,32768:1,32768:16,32768:64,32768:128,131072:1,131072:16"


def parse_shape(s: str) -> DI.Shape:
    p = [int(x) for x in s.split(":")]
    return DI.Shape(p[0], p[1], 1, p[2] if len(p) > 2 else None)


def plan_of(T, sh, over):
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    cfg, nw, mw = T.call_config(DI.K_TOP, sh.mml, sh.rows, nsm, torch.cuda.get_device_capability(0)[0], over)
    coop = T.call_coop(cfg, DI.K_TOP, sh.mml, sh.rows, nsm)
    if coop is not None:  # one cooperative launch, grid (rows, C)
        kern, consts, w = T.coop_launch(DI.K_TOP, T._MODE_ROW_LENGTHS, cfg, coop)
        return [{"kernel": kern.fn.__name__, "grid": [sh.rows, coop[0]], "num_warps": w, "constexprs": consts}]
    plan = T._launch_plan(cfg, DI.K_TOP, T._MODE_ROW_LENGTHS, sh.mml, nw, mw)
    return [{"kernel": k.fn.__name__ if hasattr(k, "fn") else str(k),
             "grid": [sh.rows, cfg["SPLIT"]] if k is T._topk_segment_kernel else [sh.rows],
             "num_warps": w, "constexprs": c} for k, c, w in plan]


def run_shape(sh, over, base_idx=None):
    import triton_dsa_topk as T
    inp = DI.build_inputs(sh, 1)
    lf, tf, _, logits, idx = DI.triton_step_fns(sh, inp, None, over)
    lf(0)
    torch.cuda.synchronize()
    rec = {"context": sh.ctx, "tokens": sh.B, "max_model_len": sh.mml, "k": DI.K_TOP, "variant": over or {},
           "kernels": plan_of(T, sh, over)}
    rec["topk_us"], rec["topk_spread"] = time_graph(tf, 8)
    if len(rec["kernels"]) > 1:  # the segment launch alone
        real = T._launch_plan

        def first_only(*a, **k):
            return real(*a, **k)[:1]
        T._launch_plan = first_only
        try:
            rec["segment_us"], _ = time_graph(tf, 8)
        finally:
            T._launch_plan = real
        rec["merge_us"] = rec["topk_us"] - rec["segment_us"]
    tf(0)
    torch.cuda.synchronize()
    got = torch.sort(idx, dim=1).values
    if base_idx is not None:
        rec["same_as_default"] = bool(torch.equal(got, base_idx))
    else:  # the default against torch.topk's value multiset (ties may pick other positions)
        vals = logits[:, :sh.ctx]
        ref = torch.topk(vals, DI.K_TOP, dim=1).values.sort(dim=1).values
        mine = torch.gather(vals, 1, idx.long()).sort(dim=1).values
        rec["values_match_torch"] = bool(torch.equal(ref, mine))
    del inp, logits
    torch.cuda.empty_cache()
    return rec, got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--sweep", default="", help="JSON list of top-k override dicts")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "topk_breakdown_h100"))
    ap.add_argument("--ncu", action="store_true", help="run each shape's top-k once (for ncu) and exit")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=15.0)
    ap.add_argument("--time-budget", type=float, default=1e9)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    TIMING.update(rounds=args.rounds, target_ms=args.target_ms)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    variants = json.loads(args.sweep) if args.sweep else []
    if args.ncu:
        for sh in shapes:
            inp = DI.build_inputs(sh, 1)
            lf, tf, _, _, _ = DI.triton_step_fns(sh, inp, None, None)
            lf(0)
            tf(0)  # compile
            torch.cuda.synchronize()
            tf(0)  # the profiled launch(es)
            torch.cuda.synchronize()
            print(f"{sh.name()}: ran once", flush=True)
        return 0
    t0 = time.time()
    records = []
    for sh in shapes:
        if time.time() - t0 > args.time_budget:
            print(f"time budget reached, skipping {sh.name()}", flush=True)
            continue
        rec, base = run_shape(sh, None)
        records.append(rec)
        print(f"{sh.name()}: topk {rec['topk_us']:.1f} us, segment {rec.get('segment_us', float('nan')):.1f}, "
              f"merge {rec.get('merge_us', float('nan')):.1f} | {[k['kernel'] for k in rec['kernels']]} "
              f"SPLIT {rec['kernels'][0]['grid'][-1]} | values ok {rec['values_match_torch']}", flush=True)
        for v in variants:
            only = v.get("_shapes")
            if only and f"{sh.ctx}:{sh.B}" + (f":{sh.mml}" if sh.mml != sh.ctx else "") not in only.split(","):
                continue
            v = {k: x for k, x in v.items() if k != "_shapes"}
            try:
                r, _ = run_shape(sh, v, base)
            except Exception as e:  # noqa: BLE001
                records.append({"context": sh.ctx, "tokens": sh.B, "variant": v, "error": repr(e)[:300]})
                print(f"  {json.dumps(v)}: failed {e!r}"[:300], flush=True)
                continue
            records.append(r)
            print(f"  {json.dumps(v)}: topk {r['topk_us']:.1f} us, segment {r.get('segment_us', float('nan')):.1f}, "
                  f"merge {r.get('merge_us', float('nan')):.1f} | same {r['same_as_default']}", flush=True)
    import triton
    result = {"command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "records": records, "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    bad = [r for r in records if r.get("error") or r.get("same_as_default") is False
           or r.get("values_match_torch") is False]
    print(f"wrote {args.out}.json ({len(records)} records, {len(bad)} failed or mismatched)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

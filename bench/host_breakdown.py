# SPDX-License-Identifier: Apache-2.0
"""Where the host time of one eager ``sparse_mla_decode_v2`` call goes (issue 11: < 10 us).

vLLM's default piecewise CUDA graphs run attention eagerly for prefill and mixed batches, so the
wrapper's Python and launch cost is paid per layer there. For each shape (T query rows, H heads,
fp8_ds_mla, top-k 2048) this times, as medians of ``common.host_us`` (wall time of one call, the
queue drained every 16 calls outside the timed region):

* ``call``            the whole call as the 0.26.0 backend makes it (the output the stream's reused
                      buffer: ``reuse_out=True``; the LSE not returned: ``return_lse=False``,
                      written to the stream's sink)
* ``call_alloc``      the same with the output allocated by the call (0.33.0+'s backend)
* ``call_lse``        the whole call returning a newly allocated LSE too
* ``call_given_out``  the whole call with caller-provided out / lse
* ``plan_key``        the plan-cache lookup (v1's ``_plan_key`` + the dict get)
* ``empty_out`` / ``empty_lse`` / ``empty_scratch``  one ``torch.empty`` of each (the scratch is
                      no longer allocated per call: ``workspace`` is the stream workspace's lookup)
* ``kernel_run`` / ``merge_run``  one ``CompiledKernel.run`` of the attention / merge kernel
* ``kernel_launch`` / ``merge_launch``  the same launch as the direct path makes it
                      (``triton_sparse_mla.launcher``: the C entry point when ``c_launch``)
* ``data_ptr_x5``     five ``data_ptr()`` reads

for the dispatch's merge and, at split points, for both merges (``MERGE`` fused / separate).

``--indexer CTX:B,...`` also times the indexer's decode calls as vLLM makes them (32 heads x 128,
top-k 2048, B requests of CTX tokens, ``max_model_len`` = CTX; the bench/dsa_indexer.py inputs):

* ``topk_call``    ``persistent_topk`` with the caller's scratch, a key seen before (planned: the
                   compiled kernels launched directly)
* ``topk_jit``     the same call through Triton's JIT path (an override the dispatch ignores keeps
                   it unplanned: validation, dispatch and Triton's binding every call)
* ``logits_call``  ``fp8_paged_mqa_logits`` into a given logits buffer (``clean_logits=False``)
* ``step``         both, one after the other

Results: ``--out`` JSON (records + the command). GPU only.

  python3 bench/host_breakdown.py --out bench/results/host_breakdown_h100.json
  python3 bench/host_breakdown.py --shapes "" --indexer 4096:1,32768:1,32768:64 --out ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SCALE = 0.0416
SHAPES = ((1, 8), (64, 8), (128, 8), (64, 16), (8192, 8))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``T:H,T:H`` -> [(T, H), ...]"""
    return common.parse_pairs(text)


def measure(T: int, H: int, merge: str | None, calls: int) -> dict:
    import torch

    from kernels import triton_sparse_mla as v1
    from kernels import triton_sparse_mla_v2 as v2

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(T * 31 + H)
    cache = torch.randint(0, 255, (4096, 64, 656), dtype=torch.uint8, device=dev, generator=g)
    cache.view(torch.float32)[:, :, 128:132] = 0.01  # finite group scales
    q = torch.randn((T, H, 576), device=dev, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 4096 * 64, (T, 2048), device=dev, dtype=torch.int32, generator=g)
    out = torch.empty((T, H, 512), device=dev, dtype=torch.bfloat16)
    lse = torch.empty((T, H), device=dev, dtype=torch.float32)
    v2._PLANS_V2.clear()
    with common.sparse_mla_merge_env(merge):
        def call():
            return v2.sparse_mla_decode_v2(q, cache, idx, SCALE, "fp8_ds_mla", return_lse=False, reuse_out=True)

        def call_alloc():
            return v2.sparse_mla_decode_v2(q, cache, idx, SCALE, "fp8_ds_mla", return_lse=False)

        def call_lse():
            return v2.sparse_mla_decode_v2(q, cache, idx, SCALE, "fp8_ds_mla")

        def call_out():
            return v2.sparse_mla_decode_v2(q, cache, idx, SCALE, "fp8_ds_mla", out=out, lse=lse)

        for f in (call, call, call_alloc, call_out, call_out):  # plan + compile, then the direct path
            f()
        torch.cuda.synchronize()
        key = v1._plan_key(q, cache, idx, SCALE, "fp8_ds_mla", None, None, None, None)
        p = v2._PLANS_V2[key]
        rec = {"T": T, "H": H, "merge_env": merge, "num_splits": p.num_splits, "fused": bool(p.fused),
               "keys_m": bool(p.keys_m), "direct": p.kernel is not None}
        rec["call"] = common.host_us(call, calls=calls)
        rec["call_alloc"] = common.host_us(call_alloc, calls=calls)
        rec["call_lse"] = common.host_us(call_lse, calls=calls)
        rec["call_given_out"] = common.host_us(call_out, calls=calls)
        rec["plan_key"] = common.host_us(
            lambda: v2._PLANS_V2.get(v1._plan_key(q, cache, idx, SCALE, "fp8_ds_mla", None, None, None, None)),
            calls=calls)
        rec["empty_out"] = common.host_us(lambda: torch.empty((T, H, 512), dtype=q.dtype, device=dev), calls=calls)
        rec["empty_lse"] = common.host_us(lambda: torch.empty((T, H), dtype=torch.float32, device=dev), calls=calls)
        rec["data_ptr_x5"] = common.host_us(
            lambda: (q.data_ptr(), cache.data_ptr(), idx.data_ptr(), out.data_ptr(), lse.data_ptr()), calls=calls)
        if p.num_splits > 1:
            n = T * H * p.num_splits
            rec["empty_scratch"] = common.host_us(lambda: torch.empty(n * 513, dtype=torch.float32, device=dev),
                                                  calls=calls)
        k = p.kernel
        if k is not None:
            stream = v1._raw_stream(p.dev_index)
            pp = v1._workspace(q.device, p.dev_index, stream, p.ws_numel).data_ptr()  # as the direct launch
            plp = pp + T * H * p.num_splits * 512 * 4
            cntp = v1._counters(q.device, p.dev_index, stream, p.cnt_numel).data_ptr() if p.fused else plp
            rec["workspace"] = common.host_us(lambda: v1._workspace(q.device, p.dev_index, stream, p.ws_numel),
                                              calls=calls)
            args = v2.kernel_args(p, q.data_ptr(), cache.data_ptr(), idx.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                  pp, plp, cntp, lse.data_ptr())
            # the launcher's C entry point called directly (v1.launcher) or CompiledKernel.run
            rec["c_launch"] = p.launch is not k.run
            if p.num_splits == 1 or p.fused:  # a launch that needs no merge kernel after it
                rec["kernel_run"] = common.host_us(
                    lambda: k.run(p.grid[0], 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args),
                    calls=calls)
                rec["kernel_launch"] = common.host_us(lambda: p.launch(p.grid[0], 1, 1, stream, *p.head, *args),
                                                      calls=calls)
            m = p.merge_kernel
            if m is not None:
                margs = (pp, plp, out.data_ptr(), lse.data_ptr(), *p.merge_tail, *p.merge_consts)
                rec["merge_run"] = common.host_us(
                    lambda: m.run(p.merge_grid[0], 1, 1, stream, m.function, m.packed_metadata, None, None, None,
                                  *margs), calls=calls)
                rec["merge_launch"] = common.host_us(
                    lambda: p.merge_launch(p.merge_grid[0], 1, 1, stream, *p.merge_head, *margs), calls=calls)
        torch.cuda.synchronize()
        return rec


def measure_indexer(ctx: int, batch: int, calls: int) -> dict:
    import torch

    sys.path.insert(0, str(Path(common.ROOT) / "kernels"))
    import dsa_indexer as DI  # bench/dsa_indexer.py: the inputs and the calls of its timing
    import triton_dsa_topk as T

    sh = DI.Shape(ctx, batch)
    inp = DI.build_inputs(sh, max_sets=1)
    logits, topk, step, out, idx = DI.triton_step_fns(sh, inp)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    tcfg, _, _ = T.call_config(DI.K_TOP, sh.mml, sh.rows, nsm, torch.cuda.get_device_capability(0)[0])
    scratch = torch.empty(T._scratch_layout(sh.rows, DI.K_TOP, tcfg["CAP"], tcfg["SPLIT"])["total"],
                          dtype=torch.int32, device="cuda")

    def topk_jit():
        T.persistent_topk(out, inp["lens"], idx, scratch, DI.K_TOP, sh.mml, SEG_MIN=T.SEG_MIN)

    step(0)
    step(0)
    torch.cuda.synchronize()
    key = T._plan_key(out, inp["lens"], None, idx, 1, DI.K_TOP, T._MODE_ROW_LENGTHS, sh.mml, scratch)
    plan = T._PLANS.get(key)
    rec = {"context": ctx, "batch": batch, "rows": sh.rows, "planned": plan is not None,
           "topk_path": ("coop" if plan is not None and plan.coop is not None else
                         "short" if tcfg["SHORT"] else "segment+merge" if sh.mml > tcfg["CAP"] else "merge")}
    rec["topk_call"] = common.host_us(lambda: topk(0), calls=calls)
    rec["topk_jit"] = common.host_us(topk_jit, calls=calls)
    rec["logits_call"] = common.host_us(lambda: logits(0), calls=calls)
    rec["step"] = common.host_us(lambda: step(0), calls=calls)
    torch.cuda.synchronize()
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{t}:{h}" for t, h in SHAPES), help="T:H,T:H,...")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--indexer", default="", help="CTX:B,...: also the indexer's decode calls (see above)")
    ap.add_argument("--out", default=str(Path(common.ROOT) / "bench" / "results" / "host_breakdown_h100.json"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("host_breakdown: needs a CUDA GPU", file=sys.stderr)
        return 2
    res = common.ResultsFile(args.out, {"command": common.command_line(__file__, argv),
                                        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "unit": "us (median wall time of one call)"})
    for T, H in (parse_shapes(args.shapes) if args.shapes else []):
        for merge in (None, "fused", "separate"):
            rec = measure(T, H, merge, args.calls)
            if merge is not None and rec["num_splits"] == 1:
                continue  # no split: no merge to compare
            res.add(rec)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)
    for ctx, batch in (common.parse_pairs(args.indexer) if args.indexer else []):
        rec = measure_indexer(ctx, batch, args.calls)
        res.add(rec)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)
    res.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Tensor parallelism on several GPUs (issue 7): TRITON_MLA_SPARSE at TP 1/2/4/8 against FLASHMLA_SPARSE.

Runs on a machine with several GPUs (nvidia-h200-x2/-x4/-x8), the patched vLLM 0.26.0 staged as for
the one-GPU scripts (docs/BACKGROUND.md, "The GPU host of the measurements"). Two parts, each one call of the existing scripts per TP
size so every call stays inside the 10-minute limit:

  correctness  e2e/e2e_correctness.py --tp N --engines triton_fp8_ds_mla,flashmla_fp8_ds_mla
               (tiny GLM-5 with 64 heads: 8 heads per rank at TP8; latent KV and indexer replicated)
  throughput   e2e/e2e_throughput.py --tp N --contexts 4096 --batches 1,64
               --backends triton_fp8_ds_mla,flashmla_fp8_ds_mla (GLM-5-shaped, 6 layers)

then `--summarize A.json B.json ...` (here or there) writes bench/results/tp_h200.json:
per backend and TP, top-1 agreement and mean KL to the common HF float32 reference, and the change
from the same backend's TP1 run (issue: "as close to the TP1 run as FLASHMLA_SPARSE's are to its
own TP1 run" -- both are measured against the same reference, so the comparison is of the TP-induced
change in KL, not a direct vLLM-vs-vLLM KL); decode tok/s at batch 1 and 64 per backend and TP,
with the ratio to FLASHMLA_SPARSE at the same TP.

usage (GPU host):
  python3 e2e/e2e_tp.py --part correctness --tp 8      # writes $OUT/tp_correctness_tp8.json
  python3 e2e/e2e_tp.py --part throughput --tp 8       # writes $OUT/tp_throughput_tp8.json
usage (anywhere):
  python3 e2e/e2e_tp.py --summarize tp_correctness_tp1.json tp_correctness_tp8.json \\
      tp_throughput_tp1.json tp_throughput_tp8.json --out bench/results/tp_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
BACKENDS = "triton_fp8_ds_mla,flashmla_fp8_ds_mla"


def run_part(part: str, tp: int, deadline_s: float) -> int:
    env = dict(os.environ)
    # NVLink multicast must stay off on the lent multi-GPU machines (device/KINDS.md).
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if part == "correctness":
        cmd = [sys.executable, str(HERE / "e2e_correctness.py"), "--tp", str(tp), "--engines", BACKENDS,
               "--deadline-s", str(deadline_s), "--name", f"tp_correctness_tp{tp}"]
    else:
        cmd = [sys.executable, str(HERE / "e2e_throughput.py"), "--tp", str(tp), "--contexts", "4096",
               "--batches", "1,64", "--backends", BACKENDS, "--deadline-s", str(deadline_s),
               "--name", f"tp_throughput_tp{tp}"]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def summarize(paths: list[pathlib.Path]) -> dict[str, Any]:
    """Merge per-TP result files into one comparison (pure function of the files: tested on CPU)."""
    acc: dict[tuple[str, str, int], dict[str, Any]] = {}
    tput: dict[tuple[str, int, int], float] = {}
    sources = []
    for p in paths:
        d = json.loads(p.read_text())
        sources.append({"file": p.name, "command": d.get("command")})
        tp = int(d.get("tensor_parallel_size") or 1)
        for r in d.get("records", []):
            if r.get("kind") == "decode" and r.get("decode_tok_s") is not None:
                tput[(r["backend"], int(r.get("tp", tp)), int(r["batch"]))] = float(r["decode_tok_s"])
            elif r.get("mean_kl") is not None and r.get("backend", "").endswith("_SPARSE"):
                acc[(r["backend"], r.get("kv_cache_dtype", ""), tp)] = {
                    "top1_agree": r.get("top1_agree"), "mean_kl": r["mean_kl"],
                    "mean_kl_se": r.get("mean_kl_se")}
    records = []
    for (backend, kv, tp), m in sorted(acc.items()):
        base = acc.get((backend, kv, 1))
        rec = {"backend": backend, "kv_cache_dtype": kv, "tp": tp, **m}
        if base:
            rec["mean_kl_change_vs_tp1"] = m["mean_kl"] - base["mean_kl"]
            rec["top1_change_vs_tp1"] = m["top1_agree"] - base["top1_agree"]
        records.append(rec)
    for (backend, tp, batch), v in sorted(tput.items()):
        ref = tput.get(("FLASHMLA_SPARSE", tp, batch))
        records.append({"backend": backend, "tp": tp, "batch": batch, "decode_tok_s": v,
                        "ratio_vs_flashmla_same_tp": (v / ref) if ref else None})
    verdicts = []
    kv = "fp8_ds_mla"
    for tp in sorted({tp for _, _, tp in acc}):
        ours = acc.get(("TRITON_MLA_SPARSE", kv, tp)), acc.get(("TRITON_MLA_SPARSE", kv, 1))
        peer = acc.get(("FLASHMLA_SPARSE", kv, tp)), acc.get(("FLASHMLA_SPARSE", kv, 1))
        if tp == 1 or not all(ours) or not all(peer):
            continue
        d_ours = abs(ours[0]["mean_kl"] - ours[1]["mean_kl"])
        d_peer = abs(peer[0]["mean_kl"] - peer[1]["mean_kl"])
        se = max(ours[0].get("mean_kl_se") or 0.0, peer[0].get("mean_kl_se") or 0.0)
        verdicts.append({"tp": tp, "kv_cache_dtype": kv, "kl_change_ours": d_ours,
                         "kl_change_flashmla": d_peer, "pass": d_ours <= d_peer + 2 * se})
    return {"name": "tp_h200", "sources": sources, "records": records, "criteria": verdicts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["correctness", "throughput"])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--deadline-s", type=float, default=480.0)
    ap.add_argument("--summarize", nargs="+", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results/tp_h200.json"))
    a = ap.parse_args()
    if a.summarize:
        res = summarize(a.summarize)
        a.out.write_text(json.dumps(res, indent=1))
        for r in res["records"]:
            print(r)
        print(f"wrote {a.out}")
        return 0
    if not a.part:
        ap.error("--part or --summarize is required")
    return run_part(a.part, a.tp, a.deadline_s)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One v2 (and one v1) sparse MLA decode launch at a TP8 shape, for Nsight Compute.

Runs each kernel a few times to compile and warm up, then once more inside an NVTX-free marker
region that ``ncu`` selects by kernel name. Run on the GPU host (standard library + torch + triton
and this repository)::

    ncu --clock-control none -k regex:_sparse_mla_v2_kernel -s 3 -c 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \\
        python3 bench/ncu_sparse_mla_v2.py --heads 8 --tokens 64

``--kernel v1`` profiles v1 instead (``-k regex:_sparse_mla_fwd_kernel``). The shapes are the
decode bench's: fp8_ds_mla, topk 2048, a 1M-token pool (far beyond the L2), distinct random slots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import triton_sparse_mla as v1  # noqa: E402
from kernels import triton_sparse_mla_v2 as v2  # noqa: E402
from kernels.triton_mla_kv_cache import mla_kv_cache_write  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kernel", choices=("v2", "v1"), default="v2")
    ap.add_argument("--config", default=None, help="JSON config override of the kernel's dispatch")
    ap.add_argument("--calls", type=int, default=4, help="launches (ncu -s/-c pick among them)")
    args = ap.parse_args(argv)
    import json

    dev = "cuda"
    torch.manual_seed(0)
    bs, n = 64, 1 << 20
    cache = torch.empty((n // bs, bs, 656), dtype=torch.uint8, device=dev)
    for i in range(0, n, 1 << 17):  # written by our cache writer, fresh random rows
        m = 1 << 17
        mla_kv_cache_write(torch.randn((m, 512), device=dev).to(torch.bfloat16),
                           torch.randn((m, 64), device=dev).to(torch.bfloat16), cache,
                           torch.arange(i, i + m, device=dev), "fp8_ds_mla", None)
    T, H = args.tokens, args.heads
    q = torch.randn((T, H, 576), device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(n, device=dev)[:2048] for _ in range(T)]).to(torch.int32)
    out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    cfg = json.loads(args.config) if args.config else None
    fn = v2.sparse_mla_decode_v2 if args.kernel == "v2" else v1.sparse_mla_decode
    for _ in range(args.calls):
        fn(q, cache, idx, 256 ** -0.5, "fp8_ds_mla", out=out, lse=lse, config=cfg)
    torch.cuda.synchronize()
    ro, _ = v1.sparse_mla_decode_reference(q, cache, idx, 256 ** -0.5, "fp8_ds_mla")
    err = float((out.double() - ro).norm() / ro.norm())
    print(f"{args.kernel} H={H} T={T}: rel err {err:.2e}")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())

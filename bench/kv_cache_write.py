# SPDX-License-Identifier: Apache-2.0
"""MLA KV-cache write (``kernels/triton_mla_kv_cache.mla_kv_cache_write``) against vLLM's own
compiled writer (``torch.ops._C_cache_ops.concat_and_cache_mla`` of the pinned release), on a GPU.

Why: in the TP8 end-to-end profile (bench/results/e2e_h200_tp8.json, 32k batch 16) our writer took
5.0 us per layer for 16 tokens, vLLM's ``concat_and_cache_ds_mla`` 2.2 us: a decode-sized write is
a chain of dependent latencies (slot -> row address -> load -> amax -> store), so it is spread over
more programs ("split": one of the 4 latent groups or the rope part per program) below
``WRITE_SPLIT_MAX_TOKENS``, and whole rows per program ("rows") above.

Per token count N and format: both configurations of ours, what the dispatch picks, and vLLM's
writer, each timed as a CUDA graph of 8 writes to different slots (us per write); the floor is the
bytes moved (N x (1152 B read + row bytes written)) at the measured copy bandwidth. Before timing,
ours must write the same bytes as vLLM's (caches poisoned with random bytes first).

    python3 e2e/gpu_tests.py --prepare                      # here: .peers-carry/ (vLLM's _C)
    python bench/kv_cache_write.py --out-dir $OUT           # GPU host (carry .peers-carry)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

TOKENS = (1, 16, 64, 128, 512, 1024, 4096, 16384)
FORMATS = ("fp8_ds_mla", "fp8")
ROW_BYTES = {"fp8_ds_mla": 656, "fp8": 576}
GRAPH_WRITES = 8  # writes per graph replay, each to its own slots
NUM_BLOCKS, BLOCK_SIZE = 4096, 64  # a 262,144-slot cache (larger than L2 for every format)


def run_point(n: int, fmt: str, ops, copy_bw: float, dev=None) -> dict:
    """One token count and format; ``ops`` has vLLM's ``concat_and_cache_mla`` signature."""
    import torch

    from kernels.triton_mla_kv_cache import WRITE_CONFIGS, mla_kv_cache_write, write_config

    dev = dev or torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1000 + n)
    width = ROW_BYTES[fmt]
    k_scale = torch.tensor([0.037], device=dev)
    inputs = []
    perm = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=dev, generator=g)
    for w in range(GRAPH_WRITES):
        big = torch.randn((n, 512 + 64 + 40), device=dev, generator=g)
        big[:, :512] *= torch.empty((n, 1), device=dev).uniform_(0.01, 100.0, generator=g)
        big = big.to(torch.bfloat16)  # latent and rope are slices of one projection output, as in vLLM
        slots = perm[w * n:(w + 1) * n].to(torch.int64) if (w + 1) * n <= perm.numel() else \
            torch.randint(0, NUM_BLOCKS * BLOCK_SIZE, (n,), device=dev, generator=g)
        inputs.append((big[:, :512], big[:, 512 + 40:], slots))

    def cache():
        return torch.randint(0, 256, (NUM_BLOCKS, BLOCK_SIZE, width), dtype=torch.uint8, device=dev, generator=g)

    # correctness first: the bytes of every configuration equal vLLM's
    errors = {}
    kv_c, k_pe, slots = inputs[0]
    theirs = cache()
    base = theirs.clone()
    ops.concat_and_cache_mla(kv_c, k_pe, theirs, slots, fmt, k_scale)
    for name in WRITE_CONFIGS:
        ours = base.clone()
        mla_kv_cache_write(kv_c, k_pe, ours, slots, fmt, k_scale, config=name)
        errors[name] = int((ours != theirs).sum().item())

    target = cache()

    def ours_fns(config):
        return [lambda a=a: mla_kv_cache_write(a[0], a[1], target, a[2], fmt, k_scale, config=config) for a in inputs]

    theirs_fns = [lambda a=a: ops.concat_and_cache_mla(a[0], a[1], target, a[2], fmt, k_scale) for a in inputs]
    rec = {"tokens": n, "format": fmt, "dispatch": [k for k, v in WRITE_CONFIGS.items() if v == write_config(n)][0],
           "bytes_differing_from_vllm": errors}
    for name in WRITE_CONFIGS:
        rec[f"us_{name}"] = common.time_graph(ours_fns(name))
    rec["us"] = rec[f"us_{rec['dispatch']}"]
    rec["vllm_us"] = common.time_graph(theirs_fns)
    rec["ratio_vs_vllm"] = common.ratio(rec["us"], rec["vllm_us"])
    moved = n * ((512 + 64) * 2 + width)
    rec["floor_us"] = moved / copy_bw * 1e6
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--stem", default="kv_cache_write_h200")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    args = ap.parse_args(argv)
    cmd = common.command_line(__file__, argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    pin, _ = common.pin_wheel()
    ok, note = common.load_vllm_c(pin)
    if not ok:
        print(f"vLLM's writer is not available: {note}")
        return 2
    ops = torch.ops._C_cache_ops
    dev = torch.device("cuda")
    copy_bw = common.copy_bandwidth(dev)
    result = {"command": cmd, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "triton": triton.__version__, "vllm_c": note, "copy_bw_GBps": copy_bw / 1e9,
              "graph_writes": GRAPH_WRITES, "records": []}
    bad = 0
    for fmt in args.formats:
        for n in args.tokens:
            r = run_point(n, fmt, ops, copy_bw)
            r["command"] = cmd
            result["records"].append(r)
            bad += sum(r["bytes_differing_from_vllm"].values())
            print(f"{fmt:10s} N={n:6d}: ours {r['us']:6.2f} us ({r['dispatch']}; split {r['us_split']:6.2f}, rows "
                  f"{r['us_rows']:6.2f}) | vLLM {r['vllm_us']:6.2f} us | x{r['ratio_vs_vllm']:.2f} | floor "
                  f"{r['floor_us']:.2f} us | bytes != vLLM {r['bytes_differing_from_vllm']}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / (args.stem + '.json')}")
    if bad:
        print(f"FAIL: {bad} bytes differ from vLLM's writer")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Decode and prefill throughput of a GLM-5-shaped model on one GPU, per sparse MLA backend (issue 6).

Model: GLM-5 at real dimensions (hidden 6144, 64 heads, qk 192/64, v 256, q_lora 2048, kv_lora 512,
indexer 32 x 128, index_topk 2048, 256 experts top-8 + 1 shared, vocab 154880) with 6 layers (3
dense + 3 MoE, GLM-5's first six) and GLM-5-FP8's block-FP8 quantization_config; weights initialised
in place (load_format="dummy"; config.json only, from e2e/e2e_model.py --preset glm5-6l), TP1.

One engine per (backend, KV dtype), each in its own subprocess, reused across contexts and batch
sizes; decode batches replay full CUDA graphs (FULL_DECODE_ONLY; `--compile` adds vLLM's
torch.compile and piecewise graphs). Per context C (`--contexts`, 4096 and/or 32768):

* prefill: one C-token prompt alone (prefill tok/s of a single prompt), then max(batches) - 1 more
  distinct C-token prompts in one call (batched prefill tok/s). Prefix caching keeps their KV;
* decode at each batch size B (`--batches`, default 64, 16, 1): the first B prompts (prefix-cache
  hits, distinct blocks, so decode reads B x C distinct tokens) with max_tokens 1 and 1 + N; the
  difference is N decode steps: tpot_ms = dt / N, decode_tok_s = B * N / dt (one untimed pass, then
  the median of `--repeats` paired differences; N = `--new-tokens`, 256);
* one decode step profiled (torch profiler through vLLM's profiler_config, steps 3-10 of a batch-B
  generate): GPU kernel time per decode step and per layer, split into indexer / attention / rest by
  kernel name (the top kernels of each class are listed so the split can be audited). Kernels launched
  from the decode CUDA graph are told apart from the rest by their cudaGraphLaunch correlation.
* KV tokens that fit: every engine gets the same KV memory (`--kv-gib`); vLLM's reported KV cache
  size, next to bytes/token x layers arithmetic (bf16 too, for reference).
* floor: bytes a decode step must read (FP8 weights touched: attention/dense MLP, the distinct
  experts B tokens route to in expectation, the embedding row and lm_head; KV: the indexer keys of all C
  tokens and top-k latent rows per layer and sequence) over 4.3 TB/s.

Backends (`--backends`): triton_fp8_ds_mla, triton_fp8 (TRITON_MLA_SPARSE), flashmla_fp8_ds_mla
(FLASHMLA_SPARSE, fp8_ds_mla, sparse_mla_force_mqa). Results: $OUT/e2e_h200.json (records, decode: backend,
kv_cache_dtype, batch, context, decode_tok_s, tpot_ms, tpot_floor_ms, ...; prefill: backend,
kv_cache_dtype, batch, context, prefill_tok_s; per engine: KV tokens, profile), $OUT/e2e_h200_logs.txt. Run it split by
context when one call cannot hold everything (see --plan): results of several calls are merged with
--merge.

VLLM_USE_DEEP_GEMM=0 is set for the engines (block-FP8 GEMMs and MoE through CUTLASS/Triton, as for
every backend alike, so no DeepGEMM JIT of GEMM shapes at start); FLASHMLA_SPARSE's indexer still
JIT-compiles DeepGEMM's MQA-logits kernels (upstream has no other CUDA path).

usage (GPU host, staged vLLM in /tmp/site):
  python3 e2e/e2e_throughput.py --plan                       # time estimate per engine, no GPU
  python3 e2e/e2e_throughput.py --contexts 4096
  python3 e2e/e2e_throughput.py --contexts 32768 --backends triton_fp8_ds_mla,flashmla_fp8_ds_mla
  python3 e2e/e2e_throughput.py --merge a.json b.json ...    # one e2e_h200.json from several calls
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import pathlib
import re
import shlex
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import e2e_common as C  # noqa: E402

BACKENDS: dict[str, dict[str, Any]] = {
    "triton_fp8_ds_mla": {"backend": "TRITON_MLA_SPARSE", "kv": "fp8_ds_mla"},
    "triton_fp8": {"backend": "TRITON_MLA_SPARSE", "kv": "fp8"},
    "flashmla_fp8_ds_mla": {"backend": "FLASHMLA_SPARSE", "kv": "fp8_ds_mla",
                            "attention_config": {"sparse_mla_force_mqa": True}},
}
DEFAULT_BACKENDS = ["triton_fp8_ds_mla", "flashmla_fp8_ds_mla", "triton_fp8"]
PREFLIGHT_MODULES = ["vllm", "compressed_tensors", "loguru",
                     "vllm.model_executor.layers.quantization.fp8", "vllm.model_executor.models.deepseek_v2"]
MLA_BYTES = {"auto": 1152, "bfloat16": 1152, "fp8": 576, "fp8_e4m3": 576, "fp8_ds_mla": 656}
INDEXER_BYTES = 132
COPY_BW = 4.3e12  # H200 device-to-device copy, bytes/s (read + write counted), measured here

# kernel-name classes for the decode-step breakdown (lower-cased substrings; first match wins)
REST_FIRST = ("moe", "expert", "grouped_topk", "topk_softmax", "router", "silu", "act_and_mul")
INDEXER_PAT = ("indexer", "mqa_logits", "paged_logits", "ragged_logits", "topk", "top_k", "cp_gather",
               "index_q", "dsa")
ATTN_PAT = ("mla", "flash_fwd", "flashmla", "sparse_attn", "concat_and_cache", "convert_req_index",
            "merge_attn", "kv_cache", "splitkv", "sparse_fwd")


# ==============================================================================================
# Arithmetic: model bytes, KV tokens, floors, the time plan
# ==============================================================================================


def model_arith(cfg: dict[str, Any]) -> dict[str, float]:
    """Parameter counts of the GLM-5-shaped model (FP8 weights: 1 byte each + 1/16384 scales)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    qn, qr, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    attn = (H * ql + ql * nh * (qn + qr) + H * (kl + qr) + kl * nh * (qn + vd) + nh * vd * H
            + ql * ih * idim)  # FP8
    idx_bf16 = H * (idim + ih)  # wk + weights_proj: bf16 in vLLM
    dense = 3 * H * cfg["intermediate_size"]
    expert = 3 * H * cfg["moe_intermediate_size"]
    n_dense = cfg["first_k_dense_replace"]
    n_moe = cfg["num_hidden_layers"] - n_dense
    return {"attn_fp8": attn, "idx_bf16": idx_bf16, "dense_fp8": dense, "expert_fp8": expert,
            "n_dense": n_dense, "n_moe": n_moe, "layers": cfg["num_hidden_layers"],
            "E": cfg["n_routed_experts"], "k": cfg["num_experts_per_tok"],
            "shared": cfg["n_shared_experts"], "vocab": cfg["vocab_size"], "H": H,
            "topk": cfg["index_topk"]}


def decode_floor(a: dict[str, float], kv: str, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step must read, and that over COPY_BW (a lower bound on TPOT)."""
    L = a["layers"]
    # expected distinct experts hit by batch*k independent uniform picks of k from E
    E, k = a["E"], a["k"]
    hit = E * (1.0 - (1.0 - k / E) ** batch)
    w = (L * (a["attn_fp8"] + 2 * a["idx_bf16"]) + a["n_dense"] * a["dense_fp8"]
         + a["n_moe"] * (hit + a["shared"]) * a["expert_fp8"] + 2 * a["vocab"] * a["H"])  # lm_head bf16
    kvb = batch * L * (context * INDEXER_BYTES + min(context, a["topk"]) * MLA_BYTES[kv])
    return {"weight_bytes": w, "kv_bytes": kvb, "floor_ms": (w + kvb) / COPY_BW * 1e3,
            "experts_hit_per_moe_layer": hit}


def kv_tokens(kv: str, layers: int, kv_bytes: int, block: int = 64) -> int:
    per_block = block * layers * (MLA_BYTES[kv] + INDEXER_BYTES)
    return (kv_bytes // per_block) * block


def plan(contexts: list[int], batches: list[int], backends: list[str], new_tokens: int,
         repeats: int) -> dict[str, Any]:
    """Paper estimate of one call, per engine (seconds).

    Prefill, per token: 2 x (6 layers x 173 M attention + 3 x 226 M dense MLP + 3 x 9 x 37.7 M expert)
    = 5.5 GFLOP of FP8 GEMMs, + indexer logits 6 x 2 x 32 x 128 x C/2, + sparse MLA
    6 x 2 x 64 x min(C, 2048) x 1088 (about 8 GFLOP per token at C = 32k), at an assumed 300 TFLOP/s
    effective (TRITON_MLA_SPARSE's prefill runs the decode kernel per query row, ~2.5 us per token and
    layer at 64 heads on the H200: ~30 s of the 32k estimate). Decode: the byte floor x 2.5 per step.
    Engine start: ~60 s (37 GB of dummy FP8 weights, profile run, 7 graph sizes) + 30 s guessed for
    FLASHMLA_SPARSE's DeepGEMM JIT; the first job's ~25 s of imports counted once (the others overlap)."""
    import e2e_model as M

    cfg = M.build_config("glm5-6l")
    a = model_arith(cfg)
    per_tok_gemm = 2 * (a["layers"] * a["attn_fp8"] + a["n_dense"] * a["dense_fp8"]
                        + a["n_moe"] * (a["k"] + a["shared"]) * a["expert_fp8"])
    out: dict[str, Any] = {"per_engine": {}, "assumptions": plan.__doc__}
    total = 25.0
    for b in backends:
        t = 60.0 + (30.0 if b.startswith("flashmla") else 0.0)
        for c in contexts:
            nb = max(batches)
            idx = a["layers"] * 2 * 32 * 128 * c / 2
            mla = a["layers"] * 2 * 64 * min(c, 2048) * 1088
            t_pre = nb * c * (per_tok_gemm + idx + mla) / 300e12
            t_dec = 0.0
            for bt in batches:
                f = decode_floor(a, BACKENDS[b]["kv"], bt, c)["floor_ms"] * 2.5 / 1e3
                t_dec += (repeats * new_tokens + 2) * f + 1.0 + repeats * 0.7
            t += t_pre + t_dec + 8.0  # + profile
        out["per_engine"][b] = round(t)
        total += t
    out["total_s"] = round(total)
    return out


# ==============================================================================================
# Worker
# ==============================================================================================


def classify(name: str) -> str:
    n = name.lower()
    if any(p in n for p in REST_FIRST):
        return "rest"
    if any(p in n for p in INDEXER_PAT):
        return "indexer"
    if any(p in n for p in ATTN_PAT):
        return "attention"
    return "rest"


def summarize_trace(paths: list[pathlib.Path], layers: int) -> dict[str, Any]:
    """GPU kernel time per decode step (kernels launched by cudaGraphLaunch), split by class."""
    events = []
    for p in paths:
        op = gzip.open if p.suffix == ".gz" else open
        with op(p, "rt") as f:
            events += json.load(f).get("traceEvents", [])
    graph_corr = set()
    n_graph = 0
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ("cudaGraphLaunch", "cudaGraphLaunch_v10000"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                graph_corr.add(corr)
            n_graph += 1
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    in_graph = [e for e in kernels if (e.get("args") or {}).get("correlation") in graph_corr]
    use = in_graph if in_graph else kernels
    by_cls: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)
    for e in use:
        d = float(e.get("dur", 0.0))
        by_cls[classify(e["name"])] += d
        by_name[e["name"]] += d
    steps = max(len(graph_corr), 1) if in_graph else None
    tot = sum(by_cls.values())
    top: dict[str, list] = {"indexer": [], "attention": [], "rest": []}
    for name, d in sorted(by_name.items(), key=lambda kv: -kv[1]):
        c = classify(name)
        if len(top[c]) < 8:
            top[c].append([name[:120], round(d / (steps or 1), 2)])
    res = {
        "trace_files": [p.name for p in paths],
        "kernel_events": len(kernels),
        "graph_launches": n_graph,
        "graph_kernels_visible": bool(in_graph),
        "decode_steps": steps,
        "note": None if in_graph else "no kernels correlated with cudaGraphLaunch: totals cover every "
                                      "kernel in the profiled window (prefill included, if any)",
    }
    if steps:
        res["per_step_us"] = {k: round(v / steps, 1) for k, v in by_cls.items()}
        res["per_step_total_us"] = round(tot / steps, 1)
        res["per_layer_us"] = {k: round(v / steps / layers, 1) for k, v in by_cls.items()}
    else:
        res["window_total_us"] = {k: round(v, 1) for k, v in by_cls.items()}
    res["fractions"] = {k: round(v / tot, 4) for k, v in by_cls.items()} if tot else {}
    res["top_kernels_us_per_step"] = top
    return res


def worker(spec: dict[str, Any], jobdir: pathlib.Path) -> None:
    import random

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    C.worker_wait_for_go(jobdir)
    run = C.Run(jobdir / "result.json", {"name": spec["name"], "records": [], "prefill": [], "spec": spec},
                tag=spec["name"])
    res = run.results
    res["vllm_version"] = vllm.__version__
    cfg = json.loads(pathlib.Path(spec["model"], "config.json").read_text())
    a = model_arith(cfg)
    contexts, batches, N = spec["contexts"], sorted(spec["batches"], reverse=True), spec["new_tokens"]
    nb = max(batches)
    prof_dir = pathlib.Path(spec["prof_dir"])
    prof_dir.mkdir(parents=True, exist_ok=True)
    kw: dict[str, Any] = dict(
        model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        attention_backend=spec["backend"], kv_cache_dtype=spec["kv"],
        max_model_len=max(contexts) + N + 128, max_num_seqs=nb, max_num_batched_tokens=spec["chunk"],
        enable_prefix_caching=True, kv_cache_memory_bytes=int(spec["kv_gib"] * 2**30),
        gpu_memory_utilization=0.8, disable_log_stats=True,
        tensor_parallel_size=int(spec.get("tp", 1)),
        profiler_config={"profiler": "torch", "torch_profiler_dir": str(prof_dir),
                         "torch_profiler_with_stack": False, "torch_profiler_record_shapes": False,
                         "torch_profiler_use_gzip": True, "ignore_frontend": True,
                         "delay_iterations": 2, "max_iterations": spec["profile_steps"]},
    )
    if spec.get("attention_config"):
        kw["attention_config"] = spec["attention_config"]
    if spec["compile"]:
        kw["compilation_config"] = {"cudagraph_capture_sizes": sorted(set(batches) | {1, 2, 4, 8})}
    else:
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": sorted(set(batches) | {1, 2, 4, 8})}
    res["engine_kwargs"] = kw
    res["gpu_before"] = C.wait_gpu_idle(log=run.log)
    with run.phase("engine_init", fatal=True):
        t = time.time()
        llm = LLM(**kw)
        res["engine_init_s"] = round(time.time() - t, 1)
    facts = C.log_facts(jobdir / "log.txt")
    res["log_facts"] = facts
    n_layers = cfg["num_hidden_layers"]
    res["kv"] = {"kv_gib": spec["kv_gib"], "kv_cache_tokens_logged": facts.get("kv_cache_tokens_logged"),
                 "kv_tokens_arithmetic": kv_tokens(spec["kv"], n_layers, int(spec["kv_gib"] * 2**30)),
                 "bytes_per_token_all_layers": n_layers * (MLA_BYTES[spec["kv"]] + INDEXER_BYTES)}
    run.log(f"engine up in {res['engine_init_s']} s; {facts}")
    V = cfg["vocab_size"]

    def gen(prompts, max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != max_tokens * len(prompts):
            raise RuntimeError(f"generated {got} tokens, expected {max_tokens * len(prompts)}")
        return dt, outs

    # warm-up: a short request, so one-time costs (Triton JIT of the prefill paths, sampler) are not timed
    with run.phase("warmup"):
        rng = random.Random(0)
        gen([[rng.randrange(V) for _ in range(1000)] for _ in range(2)], 8)
    for ctx in contexts:
        rng = random.Random(ctx)
        prompts = [[rng.randrange(V) for _ in range(ctx)] for _ in range(nb)]
        with run.phase(f"prefill_{ctx}"):
            dt1, _ = gen(prompts[:1], 1)
            rec = {"backend": spec["backend"], "kv_cache_dtype": spec["kv"], "tp": spec.get("tp", 1), "context": ctx, "batch": 1,
                   "kind": "prefill", "prefill_tok_s": ctx / dt1, "seconds": round(dt1, 3)}
            res["prefill"].append(rec)
            run.log(f"prefill 1 x {ctx}: {ctx / dt1:,.0f} tok/s")
            if nb > 1:
                dtn, _ = gen(prompts[1:], 1)
                res["prefill"].append({"backend": spec["backend"], "kv_cache_dtype": spec["kv"], "tp": spec.get("tp", 1), "context": ctx,
                                       "batch": nb - 1, "kind": "prefill", "prefill_tok_s": (nb - 1) * ctx / dtn,
                                       "seconds": round(dtn, 3)})
                run.log(f"prefill {nb - 1} x {ctx}: {(nb - 1) * ctx / dtn:,.0f} tok/s")
        for b in batches:
            with run.phase(f"decode_{ctx}_b{b}"):
                ps = prompts[:b]
                # One untimed pass first (the first batch of this size pays one-time costs: the
                # H200 run saw 1.79 s against 0.51 s). Then paired runs, the 1-token run right
                # before the (1 + N)-token one, and the median of their differences: at 32k the
                # 1-token run alone takes 0.5-0.7 s (prefix-cache lookup of 64 x 32k tokens), so
                # a min-of-each difference over 64 steps swung by 2.5x between runs.
                gen(ps, 2)
                pairs = []
                for _ in range(spec["repeats"]):
                    t1 = gen(ps, 1)[0]
                    pairs.append((t1, gen(ps, 1 + N)[0]))
                dts = sorted(t2 - t1 for t1, t2 in pairs)
                dt = dts[len(dts) // 2]
                if dt <= 0:
                    raise RuntimeError(f"non-positive decode time: pairs {pairs}")
                fl = decode_floor(a, spec["kv"], b, ctx)
                rec = {"backend": spec["backend"], "kv_cache_dtype": spec["kv"], "tp": spec.get("tp", 1), "context": ctx, "batch": b,
                       "kind": "decode", "new_tokens": N, "decode_tok_s": b * N / dt, "tpot_ms": dt / N * 1e3,
                       "t_prefix_hit_s": [round(x, 4) for x, _ in pairs],
                       "t_generate_s": [round(x, 4) for _, x in pairs],
                       "decode_s": [round(x, 4) for x in dts],
                       "tpot_floor_ms": round(fl["floor_ms"], 3), "floor_weight_gb": round(fl["weight_bytes"] / 1e9, 3),
                       "floor_kv_gb": round(fl["kv_bytes"] / 1e9, 3)}
                res["records"].append(rec)
                run.log(f"decode ctx {ctx} batch {b}: {rec['decode_tok_s']:,.0f} tok/s, tpot {rec['tpot_ms']:.2f} ms "
                        f"(floor {fl['floor_ms']:.2f} ms)")
        if spec["profile"] and ctx == max(contexts):
            with run.phase(f"profile_{ctx}"):
                b = spec["profile_batch"] if spec["profile_batch"] in batches else min(batches, key=lambda x: abs(x - 16))
                before = set(prof_dir.rglob("*.json*"))
                llm.start_profile()
                gen(prompts[:b], 2 + spec["profile_steps"] + 2)
                llm.stop_profile()
                files: list[pathlib.Path] = []
                for _ in range(60):
                    files = sorted(set(prof_dir.rglob("*.json*")) - before)
                    if files and all(_stable(f) for f in files):
                        break
                    time.sleep(1.0)
                if not files:
                    raise RuntimeError(f"no trace file appeared in {prof_dir}")
                summ = summarize_trace(files, n_layers)
                summ.update({"context": ctx, "batch": b})
                res["profile"] = summ
                run.log(f"profile ctx {ctx} batch {b}: per layer {summ.get('per_layer_us')} us; "
                        f"graph kernels visible: {summ['graph_kernels_visible']}")
                for f in files:  # traces stay on the host: only the summary comes back
                    res.setdefault("trace_bytes", 0)
                    res["trace_bytes"] += f.stat().st_size
    run.save()


def _stable(p: pathlib.Path) -> bool:
    try:
        s1 = p.stat().st_size
        time.sleep(0.3)
        return s1 > 0 and p.stat().st_size == s1
    except OSError:
        return False


# ==============================================================================================
# Driver
# ==============================================================================================


def table(records: list[dict[str, Any]], prefill: list[dict[str, Any]]) -> str:
    dec = [r for r in records if r.get("kind") == "decode"]
    pre = list(prefill)
    ref = {(r["context"], r["batch"]): r["decode_tok_s"] for r in dec
           if r["backend"] == "FLASHMLA_SPARSE" and r["kv_cache_dtype"] == "fp8_ds_mla"}
    rows = []
    for r in sorted(dec, key=lambda r: (r["context"], r["batch"], r["backend"], r["kv_cache_dtype"])):
        base = ref.get((r["context"], r["batch"]))
        rows.append([r["context"], r["batch"], r["backend"], r["kv_cache_dtype"], r["decode_tok_s"], r["tpot_ms"],
                     r.get("tpot_floor_ms"), (r["decode_tok_s"] / base) if base else None])
    t1 = C.fmt_table(rows, ["context", "batch", "backend", "kv", "decode tok/s", "tpot ms", "floor ms",
                            "x FLASHMLA"])
    rows = [[r["context"], r["batch"], r["backend"], r["kv_cache_dtype"], r["prefill_tok_s"], r["seconds"]]
            for r in sorted(pre, key=lambda r: (r["context"], r["batch"], r["backend"]))]
    t2 = C.fmt_table(rows, ["context", "prompts", "backend", "kv", "prefill tok/s", "s"])
    return t1 + "\n\n" + t2


def driver(a: argparse.Namespace) -> int:
    import e2e_model as M

    t0 = time.time()
    deadline = t0 + a.deadline_s
    out, work = C.out_dir(), C.work_dir()
    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    names = [x.strip() for x in a.backends.split(",") if x.strip()]
    for n in names:
        if n not in BACKENDS:
            raise SystemExit(f"unknown backend {n!r}; known: {', '.join(BACKENDS)}")
    res_path = out / (a.name + ".json")
    results: dict[str, Any] = {
        "name": a.name,
        "command": "python3 " + " ".join(shlex.quote(x) for x in sys.argv),
        "settings": {"contexts": contexts, "batches": batches, "backends": names, "new_tokens": a.new_tokens,
                     "repeats": a.repeats, "kv_gib": a.kv_gib, "chunk": a.chunk, "compile": a.compile,
                     "deadline_s": a.deadline_s},
        "plan": plan(contexts, batches, names, a.new_tokens, a.repeats),
        "engines": {}, "records": [], "prefill": [],
    }
    run = C.Run(res_path, results, tag="e2e-tput")
    env = C.engine_env({"VLLM_USE_DEEP_GEMM": os.environ.get("VLLM_USE_DEEP_GEMM", "0")})
    with run.phase("preflight", fatal=True):
        # a quantized model makes vLLM import compressed_tensors (e2e/gpu-host-fp8-deps.txt)
        pf = C.preflight_imports(PREFLIGHT_MODULES, env)
        results["preflight"] = pf
        if pf.get("error") or pf.get("missing"):
            raise RuntimeError("missing on this host (stage e2e/gpu-host-fp8-deps.txt with vLLM): "
                               + json.dumps(pf.get("missing") or pf)[:2000])
    model_dir = work / "glm5-6l"
    with run.phase("model", fatal=True):
        if not M.model_is_current(model_dir, "glm5-6l", 0):
            M.write_model(model_dir, "glm5-6l", 0, log=run.log)
        cfg = json.loads((model_dir / "config.json").read_text())
        results["model"] = {"dir": str(model_dir), "config": cfg, "arith": model_arith(cfg)}
        results["kv_tokens_arithmetic"] = {k: kv_tokens(k, cfg["num_hidden_layers"], int(a.kv_gib * 2**30))
                                           for k in ("auto", "fp8", "fp8_ds_mla")}
    me = str(pathlib.Path(__file__).resolve())
    jobs = []
    for n in names:
        jd = work / "tput_jobs" / n
        jd.mkdir(parents=True, exist_ok=True)
        spec = {"name": n, "model": str(model_dir), **BACKENDS[n], "contexts": contexts, "batches": batches,
                "new_tokens": a.new_tokens, "repeats": a.repeats, "kv_gib": a.kv_gib, "chunk": a.chunk,
                "compile": a.compile, "profile": not a.no_profile, "profile_batch": a.profile_batch,
                "profile_steps": 8, "prof_dir": str(work / "prof" / n), "tp": a.tp}
        (jd / "job.json").write_text(json.dumps(spec))
        expect = results["plan"]["per_engine"][n]
        jobs.append(C.Job(n, [sys.executable, me, "--worker", str(jd)], jd, a.engine_timeout_s, env, expect * 0.7))

    def on_done(job: C.Job, res: dict[str, Any]) -> None:
        for r in res.get("records", []) + res.get("prefill", []):
            r["command"] = results["command"]
        results["engines"][job.name] = res
        results["records"] = [r for e in results["engines"].values() for r in e.get("records", [])]
        results["prefill"] = [r for e in results["engines"].values() for r in e.get("prefill", [])]
        run.save()

    with run.phase("jobs"):
        C.run_jobs(jobs, run, deadline, on_done)
    with run.phase("logs"):
        C.collect_logs(jobs, out / (a.name + "_logs.txt"))
    results["table"] = table(results["records"], results["prefill"])
    run.save()
    print("\n" + "=" * 100)
    print(f"e2e throughput ({time.time() - t0:.0f} s): {res_path}")
    for n, e in results["engines"].items():
        p = e.get("profile") or {}
        if p:
            print(f"  {n}: decode step per layer (us) {p.get('per_layer_us')} at ctx {p.get('context')} "
                  f"batch {p.get('batch')}; graph kernels visible: {p.get('graph_kernels_visible')}")
        kvi = e.get("kv") or {}
        if kvi:
            print(f"  {n}: KV tokens in {a.kv_gib} GiB: logged {kvi.get('kv_cache_tokens_logged')}, "
                  f"arithmetic {kvi.get('kv_tokens_arithmetic')}")
        for err in e.get("errors", [])[:2]:
            print(f"  {n}: ERROR {err.get('phase')}: {err.get('type')}: {str(err.get('message'))[:300]}")
    print(results["table"])
    return 1 if any(e.get("errors") for e in results["engines"].values()) else 0


def plot(records: list[dict[str, Any]], dest: pathlib.Path) -> None:
    """Decode tok/s and TPOT vs batch, one panel pair per context, one line per (backend, kv)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in records if r.get("kind") == "decode"]
    ctxs = sorted({r["context"] for r in dec})
    if not ctxs:
        raise ValueError("no decode records to plot")
    fig, axes = plt.subplots(2, len(ctxs), figsize=(5.5 * len(ctxs), 7.5), squeeze=False)
    for j, c in enumerate(ctxs):
        lines = sorted({(r["backend"], r["kv_cache_dtype"]) for r in dec if r["context"] == c})
        for b, kv in lines:
            rs = sorted((r for r in dec if r["context"] == c and (r["backend"], r["kv_cache_dtype"]) == (b, kv)),
                        key=lambda r: r["batch"])
            x = [r["batch"] for r in rs]
            axes[0][j].plot(x, [r["decode_tok_s"] for r in rs], "o-", label=f"{b} {kv}")
            axes[1][j].plot(x, [r["tpot_ms"] for r in rs], "o-", label=f"{b} {kv}")
        fl = sorted({(r["batch"], r.get("tpot_floor_ms")) for r in dec if r["context"] == c and r.get("tpot_floor_ms")})
        if fl:
            axes[1][j].plot([f[0] for f in fl], [f[1] for f in fl], "k--", label="byte floor (4.3 TB/s)")
        for i, yl in enumerate(("decode tok/s", "TPOT ms")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel(yl)
            ax.set_title(f"GLM-5-shaped, 6 layers, FP8, H200, context {c}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)


def merge(paths: list[str], dest: pathlib.Path, plot_path: str | None = None) -> int:
    merged: dict[str, Any] = {"name": "e2e_h200", "merged_from": [], "records": [], "prefill": [], "engines": {}}
    for p in paths:
        d = json.loads(pathlib.Path(p).read_text())
        merged["merged_from"].append({"file": p, "command": d.get("command"), "settings": d.get("settings")})
        merged["records"] += d.get("records", [])
        merged["prefill"] += d.get("prefill", [])
        for n, e in d.get("engines", {}).items():
            merged["engines"][f"{n}@{','.join(str(c) for c in d.get('settings', {}).get('contexts', []))}"] = {
                k: e.get(k) for k in ("kv", "profile", "log_facts", "engine_init_s", "errors", "job")}
    merged["table"] = table(merged["records"], merged["prefill"])
    C.atomic_write_json(dest, merged)
    if plot_path:
        plot(merged["records"], pathlib.Path(plot_path))
    print(merged["table"])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--batches", default="64,16,1")
    ap.add_argument("--backends", default=",".join(DEFAULT_BACKENDS))
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=24.0, help="KV cache memory of every engine")
    ap.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens")
    ap.add_argument("--compile", action="store_true", help="vLLM's torch.compile + piecewise graphs too")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-batch", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--engine-timeout-s", type=float, default=480.0)
    ap.add_argument("--name", default="e2e_h200", help="results file name under $OUT (without .json)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    ap.add_argument("--plan", action="store_true", help="print the time estimate and exit")
    ap.add_argument("--merge", nargs="+", help="merge result files into $OUT/e2e_h200.json")
    ap.add_argument("--plot", help="with --merge: also write this PNG (decode tok/s and TPOT vs batch)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        jd = pathlib.Path(a.worker)
        worker(json.loads((jd / "job.json").read_text()), jd)
        return 0
    if a.merge:
        return merge(a.merge, C.out_dir() / "e2e_h200.json", a.plot)
    if a.plan:
        contexts = [int(x) for x in a.contexts.split(",")]
        batches = [int(x) for x in a.batches.split(",")]
        print(json.dumps(plan(contexts, batches, a.backends.split(","), a.new_tokens, a.repeats), indent=1))
        return 0
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())

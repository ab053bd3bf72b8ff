#!/usr/bin/env python3
"""Decode and prefill throughput of GLM-5-shaped models on one GPU, per sparse MLA backend (issues 6, 13).

Models (config.json only, ``load_format="dummy"``, ``skip_tokenizer_init``; e2e/e2e_model.py): GLM-5 at
real dimensions with 6 layers (3 dense + 3 MoE) and GLM-5-FP8's block-FP8 quantization_config, in two
shapes (``--shapes``):

* ``tp1`` (preset ``glm5-6l``): the whole layer, 64 attention heads, as one GPU serves it at TP1;
* ``tp8`` (preset ``glm5-6l-tp8``): what ONE rank of a TP8 deployment computes (8 attention heads,
  dense MLP / 8, all 256 experts with intermediate / 8 as vLLM's default TP MoE does, vocab / 8,
  indexer and latent projections replicated), served at TP1 on one GPU; no all-reduce is modelled.
  The exact scaling is in e2e_model.py's docstring and docs/notes/e2e.md.

Arms (``--backends``): triton_fp8_ds_mla / triton_fp8 (TRITON_MLA_SPARSE, fp8_ds_mla or per-tensor
fp8 KV) against flashmla_fp8_ds_mla (FLASHMLA_SPARSE, fp8_ds_mla): same KV memory (``--kv-gib``),
same CUDA-graph settings. ``compile`` false = no torch.compile, decode batches replayed as full CUDA
graphs (FULL_DECODE_ONLY); true = vLLM's default compilation (torch.compile, FULL_AND_PIECEWISE
graphs, what ``vllm serve`` does). Capture sizes are the measured batches (x (1 + k) with MTP) plus
1/2/4/8 in both modes, so both capture every measured size. MTP arms: ``speculative_config
{"method": "mtp", "num_speculative_tokens": k}``; the draft layer's backend is vLLM's own choice
(``--mtp-draft-backend same`` forces the arm's) and is read from the engine log (the backends logged
after "Loading drafter model").

How a decode point is measured (the trustworthy part, issue 13):

* every timestamp is the ENGINE CORE's: vLLM stamps each step's outputs with ``time.monotonic()`` in
  the engine-core process (``EngineCoreOutputs.timestamp``) and keeps, per request, the first and
  last token times in ``RequestOutput.metrics`` (a ``RequestStateStats``; it exists only with
  stats logging on, so the engines run with ``disable_log_stats=False`` and a missing ``metrics`` is
  an error). Requests are fed to ``llm.llm_engine`` directly with ``output_kind=DELTA``, so every
  step returns each request's new tokens and ``metrics.last_token_ts`` is that step's timestamp:
  per-token timestamps of every request, with no frontend time, prefix-cache lookup or request
  set-up inside the measured interval;
* the window is the interval in which all B requests are decoding: from the last request's first
  token (every prefill, including the ramp while requests are still arriving, is over) to the first
  request's last token. Every step in it must carry exactly B requests (one token each without MTP),
  and the window must hold at least half the requested decode steps; otherwise the sample is
  invalid. TPOT = window / (tokens in the window / B); decode tok/s = tokens in the window / window.
  vLLM's own per-request TPOT, (last - first) / (n - 1) as in its serving benchmark and
  ``FinishedRequestStats.mean_time_per_output_token``, is recorded beside it as a cross-check;
* each point: one untimed pass, then ``--repeats`` (>= 5) timed passes of max_tokens 1 + N from the
  prefix cache (distinct prompts, so decode reads B x C distinct tokens); min / median / max and the
  relative spread (max - min) / median are recorded. A sample that is invalid, not positive, above
  2x the median or below half of it is IMPLAUSIBLE: the point gets ``ok: false``, no headline value
  (``decode_tok_s``/``tpot_ms`` null), the sample is named in the JSON and the output, and the call
  exits non-zero. Nothing is averaged over a bad sample;
* nothing else runs beside the measured engine: engine subprocesses run one after another without
  the next one's ``import vllm`` prefetched (``--prefetch-imports`` only for untimed debugging).

Prefill (``--prefill-context``, 32k): one prompt alone (1 untimed + repeats samples, fresh prompts)
and batches of ``--prefill-batch`` (16) prompts; the batched samples are the groups that fill the
prefix cache for the decode points (first group untimed; more groups when too few). Time = last
first-token minus first scheduling (engine timestamps); a prefix-cache hit inside a prefill sample
makes it invalid. Prompts of the other contexts are prefixes of the same prompts (4k = the first
4096 tokens of a 32k prompt, 128k extends 16 of them), so they cost no or less prefill.

Profile (``--profile``): the torch-profiler window of 8 decode steps at 32k batch 16 (run 1, no
compile), summarised per layer into indexer / attention / rest by kernel name (unchanged method).

Full matrix and calls (issue 13): ``--plan`` lists the engines of the matrix, their estimated device
time, and packs them into calls of at most ``--call-budget-s`` (the host allows 600 s per call) and
sessions of ``--session-budget-s`` (30 min of device time, machine start included). ``--call K`` runs
call K of that plan (deterministic for the same options) into ``$OUT/e2e_h200_callKK.json``;
``--merge`` joins call files, checks for duplicate points, and writes the merged JSON, a Markdown
table (``--table-md``) and a plot (``--plot``). Ad-hoc runs: ``--shapes``, ``--backends``,
``--contexts``, ``--batches``, ``--run``, ``--compile``, ``--mtp`` make one engine per shape x backend.

Records (``records`` of every file): kind "decode"/"prefill", shape "tp1"/"tp8", backend,
kv_cache_dtype, batch, context, compile, num_speculative_tokens, run (1 or 2: decode points at
batch >= 16 and prefill points are measured in two separate calls), decode_tok_s + tpot_ms or
prefill_tok_s (medians; null when not ok), samples, spread, ok, implausible, engine, call; per engine
the device time it used (import, init, run, wall seconds), per call the elapsed time.

VLLM_USE_DEEP_GEMM=0 for the engines (block-FP8 GEMMs via CUTLASS, MoE via Triton, every backend
alike); FLASHMLA_SPARSE's indexer still JIT-compiles DeepGEMM's MQA-logits kernels.

usage (GPU host, staged vLLM in /tmp/site):
  python3 e2e/e2e_throughput.py --plan                  # the calls and sessions of the full matrix
  python3 e2e/e2e_throughput.py --call 1                # one call of that plan -> $OUT/e2e_h200_call01.json
  python3 e2e/e2e_throughput.py --shapes tp1 --backends triton_fp8_ds_mla --contexts 4096 --batches 16,1
  python3 e2e/e2e_throughput.py --merge a.json b.json --table-md t.md --plot p.png   # anywhere
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import pathlib
import shlex
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import e2e_common as C  # noqa: E402
from gpu_tests import git_commit, tree_digest  # noqa: E402

BACKENDS: dict[str, dict[str, Any]] = {
    "triton_fp8_ds_mla": {"backend": "TRITON_MLA_SPARSE", "kv": "fp8_ds_mla"},
    "triton_fp8": {"backend": "TRITON_MLA_SPARSE", "kv": "fp8"},
    "flashmla_fp8_ds_mla": {"backend": "FLASHMLA_SPARSE", "kv": "fp8_ds_mla",
                            "attention_config": {"sparse_mla_force_mqa": True}},
}
DEFAULT_BACKENDS = ["triton_fp8_ds_mla", "flashmla_fp8_ds_mla", "triton_fp8"]
SHAPES = {"tp1": "glm5-6l", "tp8": "glm5-6l-tp8"}
PREFLIGHT_MODULES = ["vllm", "compressed_tensors", "loguru",
                     "vllm.model_executor.layers.quantization.fp8", "vllm.model_executor.models.deepseek_v2"]
MLA_BYTES = {"auto": 1152, "bfloat16": 1152, "fp8": 576, "fp8_e4m3": 576, "fp8_ds_mla": 656}
INDEXER_BYTES = 132
COPY_BW = 4.3e12  # H200 device-to-device copy, bytes/s (read + write counted), measured here
MIN_REPEATS = 5

# The matrix of issue 13 (per shape and backend unless said otherwise).
DECODE_POINTS = {4096: [128, 64, 16, 1], 32768: [128, 64, 16, 1], 131072: [16, 1]}
COMPILE_POINTS = {32768: [128, 64, 16, 1]}
MTP_POINTS = {32768: [16, 1]}
MTP_TOKENS = (1, 3)
MTP_BACKENDS = ("triton_fp8_ds_mla", "flashmla_fp8_ds_mla")
PREFILL_CONTEXT = 32768
PROFILE_POINT = (32768, 16)
RUN2_MIN_BATCH = 16

# kernel-name classes for the decode-step breakdown (lower-cased substrings; first match wins)
REST_FIRST = ("moe", "expert", "grouped_topk", "topk_softmax", "router", "silu", "act_and_mul")
INDEXER_PAT = ("indexer", "mqa_logits", "paged_logits", "ragged_logits", "topk", "top_k", "cp_gather",
               "index_q", "dsa")
ATTN_PAT = ("mla", "flash_fwd", "flashmla", "sparse_attn", "concat_and_cache", "convert_req_index",
            "merge_attn", "kv_cache", "splitkv", "sparse_fwd")


# ==============================================================================================
# Arithmetic: model bytes, KV tokens, floors
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
            "topk": cfg["index_topk"], "heads": nh, "index_heads": ih}


def decode_floor(a: dict[str, float], kv: str, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step must read with randomly routed experts, over COPY_BW (an estimate: the
    dummy weights' router does not spread tokens like random routing, see docs/notes/e2e.md)."""
    L = a["layers"]
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


# ==============================================================================================
# Measurement: samples from engine timestamps, spread, plausibility (pure functions, CPU-tested)
# ==============================================================================================


def analyze_decode(events: list[dict[str, Any]], batch: int, max_tokens: int, spec_k: int = 0,
                   min_window_frac: float = 0.5) -> dict[str, Any]:
    """One decode sample from per-step events.

    `events`: one entry per (step, request) with new tokens: {"rid", "ts" (engine-core timestamp
    of the step, seconds), "n" (new tokens in that step)}. Returns tpot_ms, decode_tok_s, step_ms,
    the window's steps and tokens, the ramp (steps before every request decodes), vLLM's per-request
    TPOT (median) and `errors` (a non-empty list makes the sample invalid)."""
    errors: list[str] = []
    per: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
    for e in events:
        if e["n"] > 0:
            per[e["rid"]].append((float(e["ts"]), int(e["n"])))
    out: dict[str, Any] = {"tpot_ms": None, "decode_tok_s": None, "errors": errors}
    if len(per) != batch:
        errors.append(f"{len(per)} requests produced tokens, expected {batch}")
        return out
    for rid, toks in per.items():
        toks.sort()
        got = sum(n for _, n in toks)
        if got != max_tokens:
            errors.append(f"request {rid}: {got} tokens, expected {max_tokens}")
    if errors:
        return out
    first = {rid: t[0][0] for rid, t in per.items()}
    last = {rid: t[-1][0] for rid, t in per.items()}
    t0, t1 = max(first.values()), min(last.values())
    all_ts = sorted({ts for t in per.values() for ts, _ in t})
    win = [ts for ts in all_ts if t0 < ts <= t1]
    by_step: dict[float, list[int]] = collections.defaultdict(list)
    for t in per.values():
        for ts, n in t:
            if t0 < ts <= t1:
                by_step[ts].append(n)
    tokens = sum(sum(v) for v in by_step.values())
    out.update(window_s=round(t1 - t0, 6), window_steps=len(win), window_tokens=tokens,
               ramp_steps=sum(1 for ts in all_ts if ts < t0),
               tail_steps=sum(1 for ts in all_ts if ts > t1))
    vllm_tpot = [(last[r] - first[r]) / (max_tokens - 1) * 1e3 for r in per] if max_tokens > 1 else []
    out["tpot_vllm_ms"] = statistics.median(vllm_tpot) if vllm_tpot else None
    bad_steps = [ts for ts in win if len(by_step[ts]) != batch]
    if bad_steps:
        errors.append(f"non-uniform batch: {len(bad_steps)} of {len(win)} window steps do not carry all "
                      f"{batch} requests")
    if spec_k == 0 and any(n != 1 for v in by_step.values() for n in v):
        errors.append("more than one token per request and step without speculative decoding")
    need = min_window_frac * (max_tokens - 1) / (1 + spec_k)
    if len(win) < max(need, 1):
        errors.append(f"window of {len(win)} steps (ramp {out['ramp_steps']}, tail {out['tail_steps']}) "
                      f"is shorter than {need:.0f}")
    if t1 - t0 <= 0 or tokens <= 0:
        errors.append(f"empty or negative window ({t1 - t0:.6f} s, {tokens} tokens)")
    if errors:
        return out
    out["tpot_ms"] = (t1 - t0) / (tokens / batch) * 1e3
    out["step_ms"] = (t1 - t0) / len(win) * 1e3
    out["decode_tok_s"] = tokens / (t1 - t0)
    out["tokens_per_step"] = tokens / batch / len(win)
    return out


def analyze_prefill(finals: list[dict[str, Any]]) -> dict[str, Any]:
    """One prefill sample from the finished requests' metrics: {"sched_ts", "first_ts", "prompt_len",
    "cached"} each. Time = last first token - first scheduling (engine-core timestamps)."""
    errors: list[str] = []
    out: dict[str, Any] = {"seconds": None, "prefill_tok_s": None, "errors": errors}
    if not finals:
        errors.append("no finished requests")
        return out
    cached = sum(int(f.get("cached") or 0) for f in finals)
    computed = sum(int(f["prompt_len"]) - int(f.get("cached") or 0) for f in finals)
    if cached:
        errors.append(f"{cached} prompt tokens came from the prefix cache: not a cold prefill")
    if any(not f.get("sched_ts") for f in finals):
        errors.append("scheduled timestamp missing (stats logging off?)")
        return out
    dt = max(f["first_ts"] for f in finals) - min(f["sched_ts"] for f in finals)
    out.update(seconds=round(dt, 6), computed_tokens=computed, requests=len(finals))
    if dt <= 0:
        errors.append(f"non-positive prefill time {dt}")
        return out
    if not errors:
        out["prefill_tok_s"] = computed / dt
    return out


def spread(values: list[float]) -> dict[str, Any]:
    v = sorted(x for x in values if x is not None)
    if not v:
        return {"n": 0}
    med = statistics.median(v)
    return {"n": len(v), "min": v[0], "median": med, "max": v[-1],
            "rel_spread": (v[-1] - v[0]) / med if med else None}


def implausible(values: list[float | None], errors: list[list[str]] | None = None,
                hi: float = 2.0, lo: float = 0.5) -> list[dict[str, Any]]:
    """Samples that must not be averaged in: invalid (errors), missing, not positive, above hi x or
    below lo x the median of the valid positive ones."""
    bad = []
    good = [x for x in values if x is not None and math.isfinite(x) and x > 0]
    med = statistics.median(good) if good else None
    for i, x in enumerate(values):
        errs = (errors or [[]] * len(values))[i]
        if errs:
            bad.append({"sample": i, "value": x, "reason": "; ".join(errs)})
        elif x is None or not math.isfinite(x):
            bad.append({"sample": i, "value": x, "reason": "missing"})
        elif x <= 0:
            bad.append({"sample": i, "value": x, "reason": "negative" if x < 0 else "zero"})
        elif med and x > hi * med:
            bad.append({"sample": i, "value": x, "reason": f"over {hi}x the median {med:.6g}"})
        elif med and x < lo * med:
            bad.append({"sample": i, "value": x, "reason": f"under {lo}x the median {med:.6g}"})
    return bad


def decode_record(base: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A decode record from its timed samples (analyze_decode outputs)."""
    tp = [s.get("tpot_ms") for s in samples]
    bad = implausible(tp, [s.get("errors") or [] for s in samples])
    rec = {**base, "kind": "decode", "repeats": len(samples),
           "samples": {"tpot_ms": tp, "decode_tok_s": [s.get("decode_tok_s") for s in samples],
                       "step_ms": [s.get("step_ms") for s in samples],
                       "tpot_vllm_ms": [s.get("tpot_vllm_ms") for s in samples],
                       "window_steps": [s.get("window_steps") for s in samples],
                       "ramp_steps": [s.get("ramp_steps") for s in samples],
                       # GPU clocks / power / temperature / clock-event reasons and host load of
                       # each pass (C.GpuSampler; None where not sampled)
                       "gpu": [s.get("gpu") for s in samples]},
           "spread": {"tpot_ms": spread(tp), "decode_tok_s": spread([s.get("decode_tok_s") for s in samples])},
           "implausible": bad}
    rec["ok"] = not bad and len(samples) >= MIN_REPEATS
    if len(samples) < MIN_REPEATS:
        rec["implausible"].append({"sample": None, "value": len(samples),
                                   "reason": f"{len(samples)} samples, at least {MIN_REPEATS} required"})
    rec["tpot_ms"] = rec["spread"]["tpot_ms"].get("median") if rec["ok"] else None
    rec["decode_tok_s"] = rec["spread"]["decode_tok_s"].get("median") if rec["ok"] else None
    return rec


def prefill_record(base: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    secs = [s.get("seconds") for s in samples]
    bad = implausible(secs, [s.get("errors") or [] for s in samples])
    rate = [s.get("prefill_tok_s") for s in samples]
    rec = {**base, "kind": "prefill", "repeats": len(samples),
           "samples": {"seconds": secs, "prefill_tok_s": rate},
           "spread": {"seconds": spread(secs), "prefill_tok_s": spread(rate)}, "implausible": bad}
    if len(samples) < MIN_REPEATS:
        bad.append({"sample": None, "value": len(samples),
                    "reason": f"{len(samples)} samples, at least {MIN_REPEATS} required"})
    rec["ok"] = not bad
    rec["prefill_tok_s"] = rec["spread"]["prefill_tok_s"].get("median") if rec["ok"] else None
    return rec


RECORD_KEYS = ("kind", "shape", "backend", "kv_cache_dtype", "batch", "context", "compile",
               "num_speculative_tokens", "run", "samples", "spread", "ok", "implausible", "engine")


def check_record(r: dict[str, Any]) -> list[str]:
    """Schema problems of one record (empty when fine)."""
    probs = [f"missing {k}" for k in RECORD_KEYS if k not in r]
    if r.get("kind") == "decode":
        probs += [f"missing {k}" for k in ("decode_tok_s", "tpot_ms") if k not in r]
    elif r.get("kind") == "prefill":
        probs += ["missing prefill_tok_s"] if "prefill_tok_s" not in r else []
    else:
        probs.append(f"kind {r.get('kind')!r}")
    if r.get("shape") not in SHAPES:
        probs.append(f"shape {r.get('shape')!r}")
    if r.get("run") not in (1, 2):
        probs.append(f"run {r.get('run')!r}")
    if r.get("ok") and r.get("implausible"):
        probs.append("ok with implausible samples")
    return probs


# ==============================================================================================
# The matrix, the time estimate, the split into calls and sessions
# ==============================================================================================


def engine_name(u: dict[str, Any]) -> str:
    n = f"{u['shape']}_{u['arm']}"
    if u["compile"]:
        n += "_compile"
    if u["mtp"]:
        n += f"_mtp{u['mtp']}"
    n += f"_run{u['run']}"
    if u.get("part"):
        n += f"_{u['part']}"
    return n


def _unit(shape, arm, compile_, mtp, run, points, prefill, profile) -> dict[str, Any]:
    pts = []
    for ctx, bs in sorted(points.items()):
        bs = [b for b in bs if run == 1 or b >= RUN2_MIN_BATCH]
        if bs:
            pts.append({"context": ctx, "batches": sorted(bs, reverse=True)})
    return {"shape": shape, "arm": arm, "compile": compile_, "mtp": mtp, "run": run, "points": pts,
            "prefill": prefill, "profile": profile if run == 1 else None}


def full_matrix(shapes=("tp1", "tp8"), arms=tuple(DEFAULT_BACKENDS), runs=(1, 2),
                mtp_arms=MTP_BACKENDS, mtp_tokens=MTP_TOKENS, with_compile=True) -> list[dict[str, Any]]:
    """Every engine of issue 13's matrix (before splitting to fit calls)."""
    units = []
    for run in runs:
        for shape in shapes:
            for arm in arms:
                units.append(_unit(shape, arm, False, 0, run, DECODE_POINTS, PREFILL_CONTEXT,
                                   {"context": PROFILE_POINT[0], "batch": PROFILE_POINT[1]}))
                if with_compile:
                    units.append(_unit(shape, arm, True, 0, run, COMPILE_POINTS, PREFILL_CONTEXT, None))
            for arm in mtp_arms:
                if arm not in arms:
                    continue
                for k in mtp_tokens:
                    units.append(_unit(shape, arm, False, k, run, MTP_POINTS, None, None))
    return [u for u in units if u["points"]]


# Calibration of the estimate (H200, bench/results/e2e_h200.json, 2026-12-02, TP1 shape):
# imports 19.5-23.4 s; engine init 12.9-52.5 s (the first engine of a fresh machine compiles Triton);
# prefill of 32k prompts 50k tok/s (TRITON_MLA_SPARSE) / 75k (FLASHMLA_SPARSE), 4k 52k / 93k;
# TPOT 2.0-2.7 ms at batch 1, 2.6-4.0 at 16, 3.7-4.8 at 64. The rest is guessed and marked so.
EST = {
    "import_s": 25.0, "init_s": 45.0, "init_flashmla_extra_s": 15.0, "compile_extra_s": 120.0,
    "mtp_extra_s": 15.0, "teardown_s": 8.0, "warmup_s": 4.0, "profile_s": 20.0,
    "preflight_s": 35.0,  # per call: the import preflight in a subprocess + model config
    # prefill seconds per token: p0 + p1 * context (TP1 fit of the two measured contexts)
    "prefill_p0": {"TRITON_MLA_SPARSE": 19.1e-6, "FLASHMLA_SPARSE": 10.35e-6},
    "prefill_p1": {"TRITON_MLA_SPARSE": 2.8e-11, "FLASHMLA_SPARSE": 8.7e-11},
    "prefill_scale": {"tp1": 1.0, "tp8": 0.5},  # guess: GEMMs and heads / 8, the indexer not
    # decode ms per step: (a0 + a1 * batch) * weight scale + a2 * batch * context
    "tpot_a0": 2.0, "tpot_a1": 0.035, "tpot_a2": 2.5e-7, "tpot_scale": {"tp1": 1.0, "tp8": 0.6},
    "mtp_step_factor": 0.25,  # per draft token, acceptance 0 assumed (dummy weights)
    "pass_setup_s": 0.05, "pass_setup_per_token_s": 0.27e-6,  # prefix-cache lookup, request set-up
    "safety": 1.2,
}


def prompt_plan(u: dict[str, Any], prefill_batch: int, repeats: int) -> dict[str, Any]:
    """Which prompt tokens an engine must prefill: decode prompt i is a prefix of base prompt i;
    returns the tokens per context that are new (not a prefix of an earlier context's prompts)."""
    order = _context_order(u)
    bmax = {p["context"]: max(p["batches"]) for p in u["points"]}
    have: dict[int, int] = {}  # prompt index -> tokens cached
    new = {}
    for ctx in order:
        n = 0
        nb = bmax.get(ctx, 0)
        if ctx == u["prefill"]:
            nb = max(nb, prefill_batch * (repeats + 1))
        for i in range(nb):
            n += max(0, ctx - have.get(i, 0))
            have[i] = max(have.get(i, 0), ctx)
        new[ctx] = n
    return {"order": order, "new_tokens": new}


def _context_order(u: dict[str, Any]) -> list[int]:
    """The prefill context first (its prompts must be cold), then the others ascending (shorter
    contexts reuse its prompts' prefixes, longer ones extend them)."""
    ctxs = sorted({p["context"] for p in u["points"]} | ({u["prefill"]} if u["prefill"] else set()))
    if u["prefill"]:
        ctxs.remove(u["prefill"])
        return [u["prefill"]] + ctxs
    return ctxs


def estimate_engine(u: dict[str, Any], new_tokens: int = 256, repeats: int = MIN_REPEATS,
                    prefill_batch: int = 16) -> dict[str, Any]:
    """Paper estimate of one engine's device seconds, itemised (EST holds the constants)."""
    be = BACKENDS[u["arm"]]["backend"]
    e = EST
    items = {"import": e["import_s"], "init": e["init_s"] + (e["init_flashmla_extra_s"] if be == "FLASHMLA_SPARSE" else 0)
             + (e["compile_extra_s"] if u["compile"] else 0) + (e["mtp_extra_s"] if u["mtp"] else 0),
             "teardown": e["teardown_s"], "warmup": e["warmup_s"]}
    pp = prompt_plan(u, prefill_batch, repeats)
    pre = 0.0
    for ctx, n in pp["new_tokens"].items():
        pre += n * (e["prefill_p0"][be] + e["prefill_p1"][be] * ctx) * e["prefill_scale"][u["shape"]]
    if u["prefill"]:  # the single-prompt samples: 1 + repeats fresh prompts
        ctx = u["prefill"]
        pre += (1 + repeats) * ctx * (e["prefill_p0"][be] + e["prefill_p1"][be] * ctx) * e["prefill_scale"][u["shape"]]
    items["prefill"] = pre
    dec = 0.0
    for p in u["points"]:
        for b in p["batches"]:
            step = ((e["tpot_a0"] + e["tpot_a1"] * b) * e["tpot_scale"][u["shape"]]
                    + e["tpot_a2"] * b * p["context"]) / 1e3
            step *= 1 + e["mtp_step_factor"] * u["mtp"]
            per_pass = e["pass_setup_s"] + e["pass_setup_per_token_s"] * b * p["context"] + (new_tokens + 1) * step
            dec += (1 + repeats) * per_pass
    items["decode"] = dec
    items["profile"] = e["profile_s"] if u.get("profile") else 0.0
    total = sum(items.values()) * e["safety"]
    return {"total_s": round(total, 1), "items_s": {k: round(v, 1) for k, v in items.items()},
            "prefill_tokens": pp["new_tokens"]}


def kv_need(u: dict[str, Any], new_tokens: int, prefill_batch: int, repeats: int) -> int:
    """KV tokens that must be resident at once (the largest context x its largest batch, or the
    prefill groups), 64-token blocks rounded up, + MTP lookahead."""
    need = 0
    for p in u["points"]:
        per = -(-(p["context"] + new_tokens + 1 + 64 + u["mtp"]) // 64) * 64
        need = max(need, max(p["batches"]) * per)
    if u["prefill"]:
        need = max(need, prefill_batch * (u["prefill"] + 64))
    return need


def split_unit(u: dict[str, Any]) -> list[dict[str, Any]]:
    """Split an engine that does not fit a call: the longest context alone, the rest together."""
    if len(u["points"]) < 2:
        return [u]
    longest = max(p["context"] for p in u["points"])
    pre = u.get("part") or ""
    a = {**u, "points": [p for p in u["points"] if p["context"] != longest], "part": pre + "a"}
    b = {**u, "points": [p for p in u["points"] if p["context"] == longest], "part": pre + "b",
         "prefill": u["prefill"] if u["prefill"] == longest else None,
         "profile": u["profile"] if (u["profile"] and u["profile"]["context"] == longest) else None}
    if not (u["profile"] and u["profile"]["context"] == longest):
        a["profile"] = u["profile"]
    a["prefill"] = None if b["prefill"] else u["prefill"]
    return [a, b]


def make_plan(units: list[dict[str, Any]], call_budget_s: float = 540.0, session_budget_s: float = 1500.0,
              new_tokens: int = 256, repeats: int = MIN_REPEATS, prefill_batch: int = 16) -> dict[str, Any]:
    """Split the engines into calls (first-fit decreasing; an engine that does not fit a call alone
    is split by context) and the calls into sessions. Run 1 and run 2 of one configuration never
    share a call. Raises when an engine cannot fit at all."""
    cap = call_budget_s - EST["preflight_s"]
    work = []
    queue = list(units)
    while queue:
        u = queue.pop(0)
        est = estimate_engine(u, new_tokens, repeats, prefill_batch)
        if est["total_s"] > cap:
            parts = split_unit(u)
            if len(parts) == 1:
                raise ValueError(f"engine {engine_name(u)} needs {est['total_s']} s, more than a call "
                                 f"holds ({cap:.0f} s) and cannot be split further")
            queue = parts + queue
            continue
        work.append({**u, "name": engine_name(u), "estimate_s": est["total_s"], "estimate": est})
    work.sort(key=lambda w: (-w["estimate_s"], w["name"]))
    calls: list[dict[str, Any]] = []
    for w in work:
        cfg = (w["shape"], w["arm"], w["compile"], w["mtp"])
        for c in calls:
            if c["load_s"] + w["estimate_s"] <= cap and not any(
                    (x["shape"], x["arm"], x["compile"], x["mtp"]) == cfg and x["run"] != w["run"]
                    for x in c["engines"]):
                c["engines"].append(w)
                c["load_s"] += w["estimate_s"]
                break
        else:
            calls.append({"engines": [w], "load_s": w["estimate_s"]})
    for c in calls:
        c["estimate_s"] = round(c["load_s"] + EST["preflight_s"], 1)
        # FLASHMLA engines last in a call: their DeepGEMM JIT happens after ours have measured
        c["engines"].sort(key=lambda w: (BACKENDS[w["arm"]]["backend"] == "FLASHMLA_SPARSE", w["name"]))
    calls.sort(key=lambda c: -c["estimate_s"])
    sessions: list[dict[str, Any]] = []
    for c in calls:
        for s in sessions:
            if s["load_s"] + c["estimate_s"] <= session_budget_s:
                s["calls"].append(c)
                s["load_s"] += c["estimate_s"]
                break
        else:
            sessions.append({"calls": [c], "load_s": c["estimate_s"]})
    out_calls = []
    for si, s in enumerate(sessions, 1):
        for c in s["calls"]:
            c["session"] = si
            c["call"] = len(out_calls) + 1
            out_calls.append(c)
    return {"calls": [{"call": c["call"], "session": c["session"], "estimate_s": c["estimate_s"],
                       "engines": c["engines"]} for c in out_calls],
            "n_calls": len(out_calls), "n_sessions": len(sessions),
            "total_estimate_s": round(sum(c["estimate_s"] for c in out_calls), 1),
            "call_budget_s": call_budget_s, "session_budget_s": session_budget_s,
            "assumptions": {k: v for k, v in EST.items()}}


def plan_text(p: dict[str, Any]) -> str:
    lines = [f"{p['n_calls']} calls in {p['n_sessions']} sessions, {p['total_estimate_s'] / 60:.0f} min of "
             f"device time estimated (calls <= {p['call_budget_s']:.0f} s, sessions <= "
             f"{p['session_budget_s']:.0f} s of call time)"]
    for c in p["calls"]:
        lines.append(f"call {c['call']:2d} (session {c['session']}): {c['estimate_s']:5.0f} s  "
                     + ", ".join(f"{w['name']} {w['estimate_s']:.0f}s" for w in c["engines"]))
    return "\n".join(lines)


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


def capture_sizes(batches: list[int], k: int) -> list[int]:
    """CUDA-graph capture sizes: every measured batch and 1/2/4/8, x (1 + k) tokens per request with
    MTP (vLLM rounds the sizes up to multiples of 1 + k and drops those above the largest)."""
    return sorted({b * (1 + k) for b in set(batches) | {1, 2, 4, 8}})


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    batches = sorted({b for p in spec["points"] for b in p["batches"]} | ({spec["prefill_batch"]} if spec["prefill"] else set()))
    k = int(spec.get("mtp") or 0)
    ctxs = [p["context"] for p in spec["points"]] + ([spec["prefill"]] if spec["prefill"] else [])
    kw: dict[str, Any] = dict(
        model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        attention_backend=spec["backend"], kv_cache_dtype=spec["kv"],
        max_model_len=max(ctxs) + spec["new_tokens"] + 128, max_num_seqs=max(batches),
        max_num_batched_tokens=spec["chunk"], enable_prefix_caching=True,
        kv_cache_memory_bytes=int(spec["kv_gib"] * 2**30), gpu_memory_utilization=0.8,
        disable_log_stats=False,  # RequestOutput.metrics (the engine timestamps) exist only with stats on
        stream_interval=1,  # a DELTA output per step (vLLM's default; > 1 would batch steps' tokens)
        tensor_parallel_size=int(spec.get("tp", 1)),
    )
    if spec.get("profile"):
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": spec["prof_dir"],
                                 "torch_profiler_with_stack": False, "torch_profiler_record_shapes": False,
                                 "torch_profiler_use_gzip": True, "ignore_frontend": True,
                                 "delay_iterations": 2, "max_iterations": spec["profile_steps"]}
    if spec.get("attention_config"):
        kw["attention_config"] = spec["attention_config"]
    sizes = capture_sizes(batches, k)
    if spec["compile"]:
        kw["compilation_config"] = {"cudagraph_capture_sizes": sizes}  # vLLM's default mode and graphs
    else:
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes}
    if k:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        if spec.get("draft_backend") == "same":
            kw["speculative_config"]["attention_backend"] = spec["backend"]
    return kw


def metrics_snapshot(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode" not in m.name:
                continue
            val = getattr(m, "value", None)
            if val is None and hasattr(m, "count"):
                val = m.count
            if isinstance(val, (int, float)):
                out[m.name] = out.get(m.name, 0.0) + float(val)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"  # type: ignore[assignment]
    return out


def spec_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
    d = {k: b[k] - a.get(k, 0.0) for k in b if isinstance(b.get(k), float)}
    drafts = next((v for k, v in d.items() if k.endswith("num_drafts")), None)
    draft_toks = next((v for k, v in d.items() if k.endswith("num_draft_tokens")), None)
    acc = next((v for k, v in d.items() if k.endswith("num_accepted_tokens")), None)
    return {"counters": d,
            "acceptance_rate": (acc / draft_toks) if acc is not None and draft_toks else None,
            "mean_accepted_per_draft": (acc / drafts) if acc is not None and drafts else None}


def worker(spec: dict[str, Any], jobdir: pathlib.Path) -> None:
    import numpy as np

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    C.worker_wait_for_go(jobdir)
    run = C.Run(jobdir / "result.json", {"name": spec["name"], "records": [], "spec": spec}, tag=spec["name"])
    res = run.results
    res["vllm_version"] = vllm.__version__
    cfg = json.loads(pathlib.Path(spec["model"], "config.json").read_text())
    a = model_arith(cfg)
    N, R, k = spec["new_tokens"], spec["repeats"], int(spec.get("mtp") or 0)
    pathlib.Path(spec["prof_dir"]).mkdir(parents=True, exist_ok=True)
    kw = engine_kwargs(spec)
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
    V = cfg["vocab_size"] - 64  # ordinary ids, below the special ones
    eng = llm.llm_engine
    render = getattr(llm, "_preprocess_cmpl_one", None)
    counter = [0]
    base_cache: dict[int, np.ndarray] = {}
    longest: dict[int, int] = collections.defaultdict(int)
    for p in spec["points"]:
        for i in range(max(p["batches"])):
            longest[i] = max(longest[i], p["context"])

    def prompt(i: int, ctx: int) -> list[int]:
        """Prompt i at context ctx: the first ctx tokens of base prompt i (so shorter contexts are
        prefix-cache hits of longer ones and every prompt is distinct from its first block on)."""
        L = max(ctx, longest.get(i, 0))
        if i not in base_cache or len(base_cache[i]) < L:
            base_cache[i] = np.random.default_rng([spec["prompt_seed"], i]).integers(0, V, L, dtype=np.int64)
        return base_cache[i][:ctx].tolist()

    def gen_steps(prompts: list[list[int]], max_tokens: int):
        """Feed the requests to the engine and step it, keeping each step's engine timestamp per
        request (output_kind DELTA: one output per request and step with new tokens)."""
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
        t0 = time.perf_counter()
        rids = []
        for p in prompts:
            counter[0] += 1
            rid = f"r{counter[0]}"
            # rendered as LLM.generate renders it (vLLM 0.26.0: LLM._preprocess_cmpl_one); LLM.enqueue
            # would force output_kind FINAL_ONLY, so the request goes to the engine directly
            tp = TokensPrompt(prompt_token_ids=p)
            eng.add_request(rid, render(tp) if render else tp, sp)
            rids.append(rid)
        events, finals = [], {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                m = o.metrics
                if m is None:
                    raise RuntimeError("RequestOutput.metrics is None: the engine runs without stats "
                                       "(disable_log_stats must be False)")
                n = len(o.outputs[0].token_ids)
                events.append({"rid": o.request_id, "ts": m.last_token_ts, "n": n})
                if o.finished:
                    finals[o.request_id] = {"first_ts": m.first_token_ts, "last_ts": m.last_token_ts,
                                            "sched_ts": m.scheduled_ts, "queued_ts": m.queued_ts,
                                            "n_gen": m.num_generation_tokens, "cached": o.num_cached_tokens or 0,
                                            "prompt_len": len(o.prompt_token_ids or [])}
        wall = time.perf_counter() - t0
        missing = set(rids) - set(finals)
        if missing:
            raise RuntimeError(f"{len(missing)} requests did not finish")
        return events, [finals[r] for r in rids], wall

    def base_rec(ctx: int, batch: int) -> dict[str, Any]:
        return {"shape": spec["shape"], "backend": spec["backend"], "kv_cache_dtype": spec["kv"],
                "context": ctx, "batch": batch, "compile": bool(spec["compile"]), "num_speculative_tokens": k,
                "run": spec["run"], "tp": spec.get("tp", 1), "engine": spec["name"], "call": spec.get("call"),
                "new_tokens": N}

    def add(rec: dict[str, Any]) -> None:
        res["records"].append(rec)
        if not rec["ok"]:
            run.log(f"IMPLAUSIBLE {rec['kind']} ctx {rec['context']} batch {rec['batch']}: {rec['implausible']}")
        run.save()

    with run.phase("warmup"):
        gen_steps([prompt(900000 + i, 1000) for i in range(2)], 8)
    order = _context_order(spec)
    pb = spec["prefill_batch"]
    for ctx in order:
        pts = [p for p in spec["points"] if p["context"] == ctx]
        bmax = max((max(p["batches"]) for p in pts), default=0)
        if ctx == spec["prefill"]:
            with run.phase(f"prefill_{ctx}"):
                samples = []
                for j in range(1 + R):  # fresh prompts, the first untimed
                    _, fin, wall = gen_steps([prompt(500000 + j, ctx)], 1)
                    s = analyze_prefill(fin)
                    s["wall_s"] = round(wall, 4)
                    if j:
                        samples.append(s)
                add(prefill_record(base_rec(ctx, 1), samples))
                n_groups = max(-(-bmax // pb), R + 1)
                samples = []
                for g in range(n_groups):
                    _, fin, wall = gen_steps([prompt(i, ctx) for i in range(g * pb, (g + 1) * pb)], 1)
                    s = analyze_prefill(fin)
                    s["wall_s"] = round(wall, 4)
                    if g:
                        samples.append(s)
                add(prefill_record(base_rec(ctx, pb), samples))
        elif bmax:
            with run.phase(f"fill_{ctx}"):
                t = time.time()
                gen_steps([prompt(i, ctx) for i in range(bmax)], 1)
                res.setdefault("fill_s", {})[str(ctx)] = round(time.time() - t, 2)
        for p in pts:
            for b in p["batches"]:
                with run.phase(f"decode_{ctx}_b{b}"):
                    ps = [prompt(i, ctx) for i in range(b)]
                    gen_steps(ps, 1 + N)  # untimed: the first pass at a size pays one-time costs
                    before = metrics_snapshot(llm) if k else None
                    samples = []
                    for _ in range(R):
                        with C.GpuSampler() as gs:
                            ev, fin, wall = gen_steps(ps, 1 + N)
                        s = analyze_decode(ev, b, 1 + N, spec_k=k)
                        s["gpu"] = gs.summary
                        hit = min(f["cached"] for f in fin)
                        if hit < ctx - 2 * 64:
                            s["errors"].append(f"prefix-cache hit of only {hit} of {ctx} tokens")
                        s["wall_s"] = round(wall, 4)
                        samples.append(s)
                    rec = decode_record(base_rec(ctx, b), samples)
                    if k:
                        rec["spec_decode"] = spec_delta(before, metrics_snapshot(llm))
                    fl = decode_floor(a, spec["kv"], b, ctx)
                    rec["tpot_floor_ms"] = round(fl["floor_ms"], 3)
                    add(rec)
                    run.log(f"decode ctx {ctx} batch {b}: tpot {rec['spread']['tpot_ms']} ms, ok {rec['ok']}")
    # The profile comes last, after every timed point. In the first TP8 run (profile at 32k, then the
    # 4k points) every 4k point was slower than the same batch at 32k in both arms (batch 1: 3.15 vs
    # 2.36 ms ours, 2.23 vs 1.92 ms FlashMLA) although 4k reads 8x less KV: a profiled window may
    # leave the engine slower (CUPTI state), so no timed point may follow one.
    prof = spec.get("profile")
    if prof:
        ctx = prof["context"]
        with run.phase(f"profile_{ctx}"):
            b = prof["batch"]
            prof_dir = pathlib.Path(spec["prof_dir"])
            before_files = set(prof_dir.rglob("*.json*"))
            llm.start_profile()
            llm.generate([TokensPrompt(prompt_token_ids=prompt(i, ctx)) for i in range(b)],
                         SamplingParams(max_tokens=2 + spec["profile_steps"] + 2, ignore_eos=True,
                                        temperature=0.0, detokenize=False), use_tqdm=False)
            llm.stop_profile()
            files: list[pathlib.Path] = []
            for _ in range(60):
                files = sorted(set(prof_dir.rglob("*.json*")) - before_files)
                if files and all(_stable(f) for f in files):
                    break
                time.sleep(1.0)
            if not files:
                raise RuntimeError(f"no trace file appeared in {prof_dir}")
            summ = summarize_trace(files, n_layers)
            summ.update({"context": ctx, "batch": b, "shape": spec["shape"], "backend": spec["backend"],
                         "kv_cache_dtype": spec["kv"]})
            res["profile"] = summ
            res["trace_bytes"] = sum(f.stat().st_size for f in files)
            run.log(f"profile ctx {ctx} batch {b}: per layer {summ.get('per_layer_us')} us")
    res["log_facts"] = C.log_facts(jobdir / "log.txt")
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


def _f(x, nd=4):
    """A number for the tables: thousands separated from 1000 on, else nd significant digits."""
    if x is None:
        return None
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{nd}g}"


def table(records: list[dict[str, Any]], fmt: str = "text") -> str:
    """Decode and prefill tables (text for the console, "md" for the README)."""
    dec = [r for r in records if r.get("kind") == "decode"]
    pre = [r for r in records if r.get("kind") == "prefill"]
    ref = {(r["shape"], r["context"], r["batch"], r["compile"], r["num_speculative_tokens"], r["run"]): r["decode_tok_s"]
           for r in dec if r["backend"] == "FLASHMLA_SPARSE" and r["kv_cache_dtype"] == "fp8_ds_mla" and r["ok"]}
    rows = []
    key = lambda r: (r["shape"], r["num_speculative_tokens"], r["compile"], r["context"], -r["batch"],  # noqa: E731
                     r["backend"], r["kv_cache_dtype"], r["run"])
    for r in sorted(dec, key=key):
        base = ref.get((r["shape"], r["context"], r["batch"], r["compile"], r["num_speculative_tokens"], r["run"]))
        sp = r["spread"]["tpot_ms"]
        rows.append([r["shape"], r["context"], r["batch"], "yes" if r["compile"] else "no", r["num_speculative_tokens"],
                     r["backend"], r["kv_cache_dtype"], r["run"],
                     _f(r["decode_tok_s"]) if r["ok"] else "FAIL", _f(r["tpot_ms"]),
                     f"{_f(sp.get('min'), 3)}-{_f(sp.get('max'), 3)}" if sp.get("n") else "-",
                     f"{100 * sp['rel_spread']:.1f}%" if sp.get("rel_spread") is not None else "-",
                     _f(r["decode_tok_s"] / base, 3) if (base and r["ok"]) else None])
    h1 = ["shape", "context", "batch", "compile", "MTP", "backend", "kv", "run", "decode tok/s", "tpot ms",
          "tpot min-max", "spread", "x FLASHMLA"]
    rows2 = []
    for r in sorted(pre, key=lambda r: (r["shape"], r["compile"], r["context"], r["batch"], r["backend"],
                                        r["kv_cache_dtype"], r["run"])):
        sp = r["spread"]["prefill_tok_s"]
        rows2.append([r["shape"], r["context"], r["batch"], "yes" if r["compile"] else "no", r["backend"],
                      r["kv_cache_dtype"], r["run"], _f(r["prefill_tok_s"]) if r["ok"] else "FAIL",
                      f"{100 * sp['rel_spread']:.1f}%" if sp.get("rel_spread") is not None else "-"])
    h2 = ["shape", "context", "prompts", "compile", "backend", "kv", "run", "prefill tok/s", "spread"]
    if fmt == "md":
        return _md(rows, h1) + "\n\n" + _md(rows2, h2)
    return C.fmt_table(rows, h1) + "\n\n" + C.fmt_table(rows2, h2)


def _md(rows: list[list[Any]], header: list[str]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join("-" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def profile_table(engines: dict[str, Any], fmt: str = "text") -> str:
    rows = []
    for n, e in sorted(engines.items()):
        p = e.get("profile") or {}
        if p.get("per_layer_us"):
            pl = p["per_layer_us"]
            rows.append([p.get("shape"), p.get("backend"), p.get("kv_cache_dtype"), p.get("context"), p.get("batch"),
                         pl.get("indexer"), pl.get("attention"), pl.get("rest"), n])
    h = ["shape", "backend", "kv", "context", "batch", "indexer us/layer", "attention us/layer", "rest us/layer", "engine"]
    return _md(rows, h) if fmt == "md" else C.fmt_table(rows, h)


def draft_backends(engines: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for n, e in sorted(engines.items()):
        spec = e.get("spec") or {}
        if spec.get("mtp"):
            lf = e.get("log_facts") or {}
            out.append({"engine": n, "backend": spec.get("backend"), "num_speculative_tokens": spec.get("mtp"),
                        "draft_backends_logged": lf.get("draft_attention_backends_logged"),
                        "target_backends_logged": lf.get("target_attention_backends_logged")})
    return out


def build_jobs(engines: list[dict[str, Any]], a: argparse.Namespace, model_dirs: dict[str, pathlib.Path],
               work: pathlib.Path, env: dict[str, str], call: int | None) -> list[C.Job]:
    me = str(pathlib.Path(__file__).resolve())
    jobs = []
    for u in engines:
        n = u.get("name") or engine_name(u)
        jd = work / "tput_jobs" / n
        jd.mkdir(parents=True, exist_ok=True)
        spec = {"name": n, "shape": u["shape"], "arm": u["arm"], "model": str(model_dirs[u["shape"]]),
                **BACKENDS[u["arm"]], "points": u["points"], "prefill": u["prefill"],
                "profile": u.get("profile") if not a.no_profile else None, "compile": u["compile"],
                "mtp": u["mtp"], "run": u["run"], "draft_backend": a.mtp_draft_backend,
                "new_tokens": a.new_tokens, "repeats": a.repeats, "kv_gib": a.kv_gib, "chunk": a.chunk,
                "prefill_batch": a.prefill_batch, "profile_steps": 8, "prof_dir": str(work / "prof" / n),
                "tp": a.tp, "call": call, "prompt_seed": 13 + 1000 * u["run"]}
        need = kv_need(u, a.new_tokens, a.prefill_batch, a.repeats)
        have = kv_tokens(spec["kv"], 6, int(a.kv_gib * 2**30))
        if need > have:
            raise SystemExit(f"{n}: needs {need:,} KV tokens resident, {a.kv_gib} GiB hold {have:,} ({spec['kv']})")
        (jd / "job.json").write_text(json.dumps(spec))
        est = u.get("estimate_s") or estimate_engine(u, a.new_tokens, a.repeats, a.prefill_batch)["total_s"]
        jobs.append(C.Job(n, [sys.executable, me, "--worker", str(jd)], jd, a.engine_timeout_s, env, est * 0.7))
    return jobs


def driver(a: argparse.Namespace, engines: list[dict[str, Any]], name: str, call: int | None,
           plan_info: dict[str, Any] | None) -> int:
    import e2e_model as M

    t0 = time.time()
    deadline = t0 + a.deadline_s
    out, work = C.out_dir(), C.work_dir()
    res_path = out / (name + ".json")
    results: dict[str, Any] = {
        "name": name, "call": call,
        "command": "python3 " + " ".join(shlex.quote(x) for x in sys.argv),
        "settings": {k: v for k, v in vars(a).items() if k not in ("merge", "worker")},
        # which code the numbers are for (the host's checkout has no .git: pass --commit)
        "commit": a.commit or git_commit(), "tree_sha256": tree_digest("overlay", "kernels"),
        "plan": plan_info, "engines": {}, "records": [],
    }
    run = C.Run(res_path, results, tag="e2e-tput")
    # the checkout's overlay/ and kernels/ over the staged vLLM (the wheel may be older: a kernel
    # change need not be re-packed), unless told not to or nothing is staged
    site = C.staged_site()
    if a.no_sync_overlay:
        results["overlay_sync"] = {"skipped": "--no-sync-overlay"}
    elif not (site / "vllm").is_dir():
        results["overlay_sync"] = {"skipped": f"no staged vLLM at {site}"}
    else:
        results["overlay_sync"] = C.sync_overlay(site)
    env = C.engine_env({"VLLM_USE_DEEP_GEMM": os.environ.get("VLLM_USE_DEEP_GEMM", "0")})
    with run.phase("preflight", fatal=True):
        pf = C.preflight_imports(PREFLIGHT_MODULES, env)
        results["preflight"] = pf
        if pf.get("error") or pf.get("missing"):
            raise RuntimeError("missing on this host (stage e2e/gpu-host-fp8-deps.txt with vLLM): "
                               + json.dumps(pf.get("missing") or pf)[:2000])
    model_dirs = {}
    with run.phase("model", fatal=True):
        results["models"] = {}
        for shape in sorted({u["shape"] for u in engines}):
            preset = SHAPES[shape]
            d = work / preset
            if not M.model_is_current(d, preset, 0):
                M.write_model(d, preset, 0, log=run.log)
            cfg = json.loads((d / "config.json").read_text())
            model_dirs[shape] = d
            results["models"][shape] = {"preset": preset, "dir": str(d), "config": cfg, "arith": model_arith(cfg)}
    jobs = build_jobs(engines, a, model_dirs, work, env, call)

    def on_done(job: C.Job, res: dict[str, Any]) -> None:
        for r in res.get("records", []):
            r["command"] = results["command"]
            r["commit"] = results["commit"]
        results["engines"][job.name] = res
        results["records"] = [r for e in results["engines"].values() for r in e.get("records", [])]
        run.save()

    with run.phase("jobs"):
        C.run_jobs(jobs, run, deadline, on_done, prefetch=a.prefetch_imports)
    with run.phase("logs"):
        C.collect_logs(jobs, out / (name + "_logs.txt"))
    results["device_time_s"] = round(time.time() - t0, 1)
    bad = [r for r in results["records"] if not r.get("ok")]
    errs = {n: e.get("errors") for n, e in results["engines"].items() if e.get("errors")}
    results["implausible_points"] = [{k: r.get(k) for k in ("engine", "kind", "context", "batch", "implausible")}
                                     for r in bad]
    results["table"] = table(results["records"])
    results["status"] = "ok" if not bad and not errs else "FAILED"
    run.save()
    print("\n" + "=" * 100)
    print(f"e2e throughput ({results['device_time_s']:.0f} s): {res_path}")
    for n, e in results["engines"].items():
        j = e.get("job") or {}
        print(f"  {n}: {j.get('status')}, import {j.get('import_s')} s, run {j.get('run_s')} s, wall {j.get('wall_s')} s")
        for err in e.get("errors", [])[:2]:
            print(f"  {n}: ERROR {err.get('phase')}: {err.get('type')}: {str(err.get('message'))[:300]}")
    for d in draft_backends(results["engines"]):
        print(f"  MTP draft backend: {d}")
    print(results["table"])
    print(profile_table(results["engines"]))
    for r in bad:
        print(f"IMPLAUSIBLE: {r.get('engine')} {r['kind']} ctx {r['context']} batch {r['batch']}: {r['implausible']}")
    return 0 if results["status"] == "ok" else 1


def plot(records: list[dict[str, Any]], dest: pathlib.Path) -> None:
    """Decode tok/s vs batch, one panel per (shape, context), one line per (backend, kv, compile, MTP),
    run 1 and run 2 as separate markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in records if r.get("kind") == "decode" and r.get("ok")]
    panels = sorted({(r["shape"], r["context"]) for r in dec})
    if not panels:
        raise ValueError("no valid decode records to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    for j, (shape, c) in enumerate(panels):
        ax = axes[0][j]
        lines = sorted({(r["backend"], r["kv_cache_dtype"], r["compile"], r["num_speculative_tokens"], r["run"])
                        for r in dec if (r["shape"], r["context"]) == (shape, c)})
        for b, kv, comp, k, run in lines:
            rs = sorted((r for r in dec if (r["shape"], r["context"], r["backend"], r["kv_cache_dtype"], r["compile"],
                                            r["num_speculative_tokens"], r["run"]) == (shape, c, b, kv, comp, k, run)),
                        key=lambda r: r["batch"])
            lo = [r["spread"]["decode_tok_s"]["min"] for r in rs]
            hi = [r["spread"]["decode_tok_s"]["max"] for r in rs]
            y = [r["decode_tok_s"] for r in rs]
            ax.errorbar([r["batch"] for r in rs], y, yerr=[[m - l for m, l in zip(y, lo)], [h - m for m, h in zip(y, hi)]],
                        fmt="o-" if run == 1 else "s--", capsize=2,
                        label=f"{b} {kv}{' compile' if comp else ''}{f' MTP{k}' if k else ''} r{run}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tok/s (median, min-max)")
        ax.set_title(f"GLM-5 6 layers FP8, {shape} shape, H200, context {c}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)


def merge(paths: list[str], dest: pathlib.Path, plot_path: str | None = None, table_md: str | None = None) -> int:
    """One file from several calls' files: records, engines (with the device time each used),
    duplicates and implausible points named; the Markdown tables and the plot from it."""
    merged: dict[str, Any] = {"name": dest.stem, "merged_from": [], "records": [], "engines": {}}
    seen: dict[tuple, str] = {}
    dups = []
    for p in paths:
        d = json.loads(pathlib.Path(p).read_text())
        if "merged_from" in d:  # an earlier merge (its calls' files may be gone): its calls as they were
            merged["merged_from"].extend(d["merged_from"])
        else:
            merged["merged_from"].append({"file": pathlib.Path(p).name, "command": d.get("command"),
                                          "call": d.get("call"), "device_time_s": d.get("device_time_s"),
                                          "status": d.get("status"), "commit": d.get("commit"),
                                          "tree_sha256": d.get("tree_sha256")})
        for r in d.get("records", []):
            if r.get("kind") not in ("decode", "prefill"):
                continue
            key = (r["kind"], r["shape"], r["backend"], r["kv_cache_dtype"], r["context"], r["batch"], r["compile"],
                   r["num_speculative_tokens"], r["run"])
            if key in seen:
                dups.append({"point": list(key), "files": [seen[key], pathlib.Path(p).name]})
                continue
            seen[key] = pathlib.Path(p).name
            merged["records"].append(r)
        for n, e in d.get("engines", {}).items():
            merged["engines"][n] = {k: e.get(k) for k in ("kv", "profile", "log_facts", "engine_init_s", "errors", "job", "spec")}
            merged["engines"][n]["kv_cache_dtype"] = (e.get("spec") or {}).get("kv")
            merged["engines"][n]["shape"] = (e.get("spec") or {}).get("shape")
    merged["duplicates"] = dups
    merged["schema_problems"] = [{"record": i, "problems": pr} for i, r in enumerate(merged["records"])
                                 if (pr := check_record(r))]
    merged["implausible_points"] = [{k: r.get(k) for k in ("engine", "kind", "context", "batch", "run", "implausible")}
                                    for r in merged["records"] if not r.get("ok")]
    merged["device_time_s"] = {"per_call": {m["file"]: m["device_time_s"] for m in merged["merged_from"]},
                               "total": round(sum(m["device_time_s"] or 0 for m in merged["merged_from"]), 1),
                               "per_engine": {n: (e.get("job") or {}).get("wall_s") for n, e in merged["engines"].items()}}
    merged["mtp_draft_backends"] = draft_backends(merged["engines"])
    merged["table"] = table(merged["records"])
    C.atomic_write_json(dest, merged)
    if table_md:
        text = (table(merged["records"], "md") + "\n\nDecode-step profile (per layer, kernels of the decode CUDA graph):\n\n"
                + profile_table(merged["engines"], "md") + "\n")
        pathlib.Path(table_md).write_text(text)
    if plot_path:
        plot(merged["records"], pathlib.Path(plot_path))
    print(merged["table"])
    bad = merged["duplicates"] or merged["schema_problems"] or merged["implausible_points"]
    for x in merged["duplicates"]:
        print(f"DUPLICATE point {x}")
    for x in merged["implausible_points"]:
        print(f"IMPLAUSIBLE {x}")
    for x in merged["schema_problems"]:
        print(f"SCHEMA {x}")
    return 1 if bad else 0


def adhoc_engines(a: argparse.Namespace) -> list[dict[str, Any]]:
    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    out = []
    for shape in a.shapes.split(","):
        for arm in [x.strip() for x in a.backends.split(",") if x.strip()]:
            if arm not in BACKENDS:
                raise SystemExit(f"unknown backend {arm!r}; known: {', '.join(BACKENDS)}")
            prof = None
            if not a.no_profile:
                ctx = max(contexts)
                b = a.profile_batch if a.profile_batch in batches else min(batches, key=lambda x: abs(x - 16))
                prof = {"context": ctx, "batch": b}
            u = _unit(shape, arm, a.compile, a.mtp, a.run, {c: batches for c in contexts},
                      a.prefill_context if (a.prefill and a.prefill_context in contexts) else None, prof)
            u["name"] = engine_name(u)
            out.append(u)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("plan and calls of the full matrix")
    g.add_argument("--plan", action="store_true", help="print the calls and sessions of the matrix and exit")
    g.add_argument("--call", type=int, help="run call K of the plan (same options as --plan)")
    g.add_argument("--matrix-shapes", default="tp1,tp8")
    g.add_argument("--matrix-backends", default=",".join(DEFAULT_BACKENDS))
    g.add_argument("--runs", default="1,2", help="run 2 repeats decode at batch >= 16 and prefill in other calls")
    g.add_argument("--no-compile-arms", action="store_true")
    g.add_argument("--no-mtp-arms", action="store_true")
    g.add_argument("--call-budget-s", type=float, default=540.0)
    g.add_argument("--session-budget-s", type=float, default=1500.0,
                   help="call time per session (30 min of device time minus machine start and transfers)")
    g = ap.add_argument_group("ad-hoc engines (without --call)")
    g.add_argument("--shapes", default="tp1")
    g.add_argument("--backends", default=",".join(DEFAULT_BACKENDS))
    g.add_argument("--contexts", default="4096")
    g.add_argument("--batches", default="64,16,1")
    g.add_argument("--run", type=int, default=1, choices=(1, 2))
    g.add_argument("--compile", action="store_true", help="vLLM's default compilation instead of FULL_DECODE_ONLY")
    g.add_argument("--mtp", type=int, default=0, help="num_speculative_tokens (0: no MTP)")
    g.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill samples at --prefill-context when it is among the contexts")
    g.add_argument("--prefill-context", type=int, default=PREFILL_CONTEXT)
    g.add_argument("--no-profile", action="store_true")
    g.add_argument("--profile-batch", type=int, default=16)
    g.add_argument("--name", help="results file name under $OUT (without .json)")
    g = ap.add_argument_group("measurement")
    g.add_argument("--new-tokens", type=int, default=256)
    g.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"timed passes per point (>= {MIN_REPEATS})")
    g.add_argument("--prefill-batch", type=int, default=16)
    g.add_argument("--kv-gib", type=float, default=24.0, help="KV cache memory of every engine")
    g.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens")
    g.add_argument("--mtp-draft-backend", choices=("auto", "same"), default="auto",
                   help="auto: vLLM picks the draft layer's backend (its default); same: the arm's")
    g.add_argument("--prefetch-imports", action="store_true",
                   help="start the next engine's imports during a measurement (never for timed work)")
    g.add_argument("--deadline-s", type=float, default=560.0)
    g.add_argument("--commit", default=None, help="the commit, where the checkout has no .git (recorded)")
    g.add_argument("--no-sync-overlay", action="store_true",
                   help="keep the staged tree's overlay and kernels (default: copy this checkout's over it)")
    g.add_argument("--engine-timeout-s", type=float, default=540.0)
    g.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    g = ap.add_argument_group("merge")
    g.add_argument("--merge", nargs="+", help="merge result files into $OUT/<--out-name>.json")
    g.add_argument("--out-name", default="e2e_h200")
    g.add_argument("--plot", help="with --merge: also write this PNG")
    g.add_argument("--table-md", help="with --merge: also write the Markdown tables here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        jd = pathlib.Path(a.worker)
        worker(json.loads((jd / "job.json").read_text()), jd)
        return 0
    if a.merge:
        return merge(a.merge, C.out_dir() / (a.out_name + ".json"), a.plot, a.table_md)
    if a.repeats < MIN_REPEATS:
        raise SystemExit(f"--repeats {a.repeats}: at least {MIN_REPEATS} timed repeats per point (issue 13)")
    if a.plan or a.call:
        units = full_matrix(tuple(a.matrix_shapes.split(",")), tuple(a.matrix_backends.split(",")),
                            tuple(int(x) for x in a.runs.split(",")),
                            mtp_tokens=() if a.no_mtp_arms else MTP_TOKENS, with_compile=not a.no_compile_arms)
        p = make_plan(units, a.call_budget_s, a.session_budget_s, a.new_tokens, a.repeats, a.prefill_batch)
        if a.plan:
            print(plan_text(p))
            return 0
        if not 1 <= a.call <= p["n_calls"]:
            raise SystemExit(f"--call {a.call}: the plan has calls 1..{p['n_calls']}")
        c = p["calls"][a.call - 1]
        info = {"call": c["call"], "session": c["session"], "estimate_s": c["estimate_s"], "n_calls": p["n_calls"],
                "n_sessions": p["n_sessions"], "engines": [w["name"] for w in c["engines"]]}
        return driver(a, c["engines"], a.name or f"e2e_h200_call{a.call:02d}", a.call, info)
    engines = adhoc_engines(a)
    est = {e["name"]: estimate_engine(e, a.new_tokens, a.repeats, a.prefill_batch)["total_s"] for e in engines}
    return driver(a, engines, a.name or "e2e_h200", None, {"estimate_s": est})


if __name__ == "__main__":
    sys.exit(main())

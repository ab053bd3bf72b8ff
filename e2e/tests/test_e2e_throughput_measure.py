"""Issue 13's measurement harness (e2e/e2e_throughput.py) on the CPU: TPOT from engine timestamps,
implausible samples, no prefetch during timed jobs, the TP8 per-rank preset, the record schema, the
plan's split into calls and sessions, merge. The end-to-end tests run the real driver and worker
against a fake vLLM (e2e/tests/fake_vllm: virtual engine clock, prefix cache, DELTA outputs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import e2e_common as C
import e2e_model as M
import e2e_throughput as T

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "e2e_throughput.py"
FAKE = HERE / "fake_vllm"


def _events(batch, steps, t0=10.0, dt=0.004, first_offsets=None, n=1):
    """Per-step events of `batch` requests: each request's first token (its prefill step) at
    t0 + offset, then one step every dt."""
    ev = []
    offs = first_offsets or [0] * batch
    for r in range(batch):  # one timestamp per engine step, shared by every request in it
        ev.append({"rid": f"q{r}", "ts": t0 + offs[r] * dt, "n": 1})
        for s in range(1, steps):
            ev.append({"rid": f"q{r}", "ts": t0 + (offs[r] + s) * dt, "n": n})
    return ev


# ---------------------------------------------------------------------------------------------
# TPOT from per-step engine timestamps
# ---------------------------------------------------------------------------------------------


def test_tpot_matches_a_hand_computed_case():
    # 3 requests, 5 tokens each (first token at 2.000 s, then steps at +10, +20, +30, +40 ms):
    # window 2.000 -> 2.040 s holds 4 steps x 3 tokens: TPOT 10 ms, 300 tok/s
    ev = []
    for r in range(3):
        for s, ts in enumerate((2.000, 2.010, 2.020, 2.030, 2.040)):
            ev.append({"rid": r, "ts": ts, "n": 1})
    s = T.analyze_decode(ev, batch=3, max_tokens=5)
    assert s["errors"] == []
    assert s["tpot_ms"] == pytest.approx(10.0)
    assert s["decode_tok_s"] == pytest.approx(300.0)
    assert s["window_steps"] == 4 and s["window_tokens"] == 12 and s["ramp_steps"] == 0
    assert s["tpot_vllm_ms"] == pytest.approx(10.0)  # (last - first) / (n - 1), vLLM's definition


def test_ramp_of_arriving_requests_is_excluded_from_the_window():
    # request 1 starts decoding 3 steps after request 0 (arrived late): the window starts at its
    # first token and ends at request 0's last, so it holds 257 - 1 - 3 uniform steps
    ev = _events(2, 257, first_offsets=[0, 3])
    s = T.analyze_decode(ev, batch=2, max_tokens=257)
    assert s["errors"] == []
    assert s["ramp_steps"] == 3 and s["tail_steps"] == 3 and s["window_steps"] == 253
    assert s["tpot_ms"] == pytest.approx(4.0)
    # ramp steps that are slow (other requests' prefill runs in them) do not move the result
    slow = [dict(e, ts=e["ts"] - (0.5 if e["ts"] < 10.0 + 3 * 0.004 - 1e-9 else 0.0)) for e in ev]
    assert T.analyze_decode(slow, 2, 257)["tpot_ms"] == pytest.approx(4.0)
    assert T.analyze_decode(slow, 2, 257)["tpot_vllm_ms"] > 4.5  # vLLM's per-request TPOT includes them


def test_invalid_decode_samples_are_named():
    assert "expected 3" in T.analyze_decode(_events(2, 9), 3, 9)["errors"][0]
    assert "tokens, expected 10" in T.analyze_decode(_events(2, 9), 2, 10)["errors"][0]
    # a window that is mostly ramp
    s = T.analyze_decode(_events(2, 20, first_offsets=[0, 15]), 2, 20)
    assert s["tpot_ms"] is None and any("window of" in e for e in s["errors"])
    # a request missing from a window step: not a batch-B decode
    ev = [e for e in _events(3, 20) if not (e["rid"] == "q2" and abs(e["ts"] - (10.0 + 7 * 0.004)) < 1e-9)]
    ev.append({"rid": "q2", "ts": 10.0 + 7.5 * 0.004, "n": 1})
    s = T.analyze_decode(ev, 3, 20)
    assert any("non-uniform" in e for e in s["errors"])
    # several tokens per step without MTP
    ev = _events(1, 5)
    ev[2]["n"] = 2
    assert any("token" in e for e in T.analyze_decode(ev, 1, 6)["errors"])


def test_spec_decode_counts_tokens_not_steps():
    # MTP: 2 tokens per step per request -> time per output token is half the step time
    ev = _events(2, 11, n=2)  # 1 + 10 x 2 = 21 tokens
    s = T.analyze_decode(ev, 2, 21, spec_k=1)
    assert s["errors"] == [] and s["step_ms"] == pytest.approx(4.0) and s["tpot_ms"] == pytest.approx(2.0)
    assert s["tokens_per_step"] == pytest.approx(2.0)


def test_prefill_sample_from_scheduled_and_first_token_times():
    fin = [{"sched_ts": 5.0, "first_ts": 5.5, "prompt_len": 1000, "cached": 0},
           {"sched_ts": 5.1, "first_ts": 6.0, "prompt_len": 1000, "cached": 0}]
    s = T.analyze_prefill(fin)
    assert s["seconds"] == pytest.approx(1.0) and s["prefill_tok_s"] == pytest.approx(2000.0) and not s["errors"]
    fin[1]["cached"] = 64
    assert "prefix cache" in T.analyze_prefill(fin)["errors"][0]


# ---------------------------------------------------------------------------------------------
# implausible samples
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad,reason", [(-0.89, "negative"), (0.0, "zero"), (9.0, "over 2"), (1.0, "under 0.5")])
def test_implausible_samples_are_named_and_not_averaged(bad, reason):
    good = [{"tpot_ms": v, "decode_tok_s": 1000 / v, "errors": []} for v in (4.0, 4.1, 3.9, 4.05)]
    rec = T.decode_record({"kind": "decode"}, good + [{"tpot_ms": bad, "decode_tok_s": None, "errors": []}])
    assert rec["ok"] is False and rec["tpot_ms"] is None and rec["decode_tok_s"] is None
    assert rec["implausible"][0]["sample"] == 4 and reason in rec["implausible"][0]["reason"]
    ok = T.decode_record({"kind": "decode"}, good + [{"tpot_ms": 4.2, "decode_tok_s": 238.1, "errors": []}])
    assert ok["ok"] and ok["tpot_ms"] == pytest.approx(4.05) and ok["implausible"] == []
    assert ok["spread"]["tpot_ms"]["rel_spread"] == pytest.approx((4.2 - 3.9) / 4.05)


def test_fewer_than_five_repeats_are_not_ok():
    rec = T.decode_record({}, [{"tpot_ms": 4.0, "decode_tok_s": 250.0, "errors": []}] * 4)
    assert not rec["ok"] and "at least 5" in rec["implausible"][-1]["reason"]
    with pytest.raises(SystemExit):
        T.main(["--repeats", "3", "--plan"])


def test_invalid_sample_makes_the_point_fail():
    samples = [{"tpot_ms": 4.0, "decode_tok_s": 250.0, "errors": []}] * 5
    samples = samples + [{"tpot_ms": None, "decode_tok_s": None, "errors": ["non-uniform batch: 3 of 200"]}]
    rec = T.decode_record({}, samples)
    assert not rec["ok"] and "non-uniform" in rec["implausible"][0]["reason"]


# ---------------------------------------------------------------------------------------------
# no prefetch during timed jobs
# ---------------------------------------------------------------------------------------------


def _sleeper(tmp_path, name, secs):
    d = tmp_path / name
    d.mkdir()
    code = (f"import time, pathlib; pathlib.Path({str(d / 'started')!r}).write_text(str(time.time())); "
            f"time.sleep({secs})")
    return C.Job(name, [sys.executable, "-c", code], d, 30)


@pytest.mark.parametrize("prefetch", [False, True])
def test_run_jobs_prefetch_is_configurable(tmp_path, prefetch):
    """Without prefetch the second job's process starts only after the first one ended; with it,
    during the first one (the old behaviour, kept for the untimed correctness jobs)."""
    a, b = _sleeper(tmp_path, "a", 1.5), _sleeper(tmp_path, "b", 0.1)
    # the sleepers never wait for "go": they start working at once, like an import would
    run = C.Run(None, {}, stream=open(os.devnull, "w"))
    C.run_jobs([a, b], run, __import__("time").time() + 60, lambda j, r: None, prefetch=prefetch)
    b_start = float((tmp_path / "b" / "started").read_text())
    if prefetch:
        assert b_start < a.t_end - 0.5
    else:
        assert b_start >= a.t_end


# ---------------------------------------------------------------------------------------------
# the TP8 per-rank preset
# ---------------------------------------------------------------------------------------------


def test_tp8_preset_has_the_per_rank_sizes():
    tp1, tp8 = M.build_config("glm5-6l"), M.build_config("glm5-6l-tp8")
    assert tp8["num_attention_heads"] == tp1["num_attention_heads"] // 8 == 8
    assert tp8["intermediate_size"] == tp1["intermediate_size"] // 8 == 1536
    assert tp8["moe_intermediate_size"] == tp1["moe_intermediate_size"] // 8 == 256
    assert tp8["vocab_size"] == tp1["vocab_size"] // 8 == 19360
    assert tp8["n_routed_experts"] == 256 and tp8["num_experts_per_tok"] == 8  # TP MoE, not EP
    same = ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "index_n_heads", "index_head_dim", "index_topk", "num_hidden_layers", "first_k_dense_replace",
            "quantization_config", "n_shared_experts")
    assert {k: tp8[k] for k in same} == {k: tp1[k] for k in same}
    assert all(0 <= t < tp8["vocab_size"] for t in tp8["eos_token_id"] + [tp8["pad_token_id"]])
    # FP8 128x128 blocks still tile every split weight
    for n in (tp8["intermediate_size"], tp8["moe_intermediate_size"], 8 * tp8["v_head_dim"],
              8 * (tp8["qk_nope_head_dim"] + tp8["qk_rope_head_dim"]), 8 * (tp8["qk_nope_head_dim"] + tp8["v_head_dim"])):
        assert n % 128 == 0
    a1, a8 = T.model_arith(tp1), T.model_arith(tp8)
    assert a8["expert_fp8"] * 8 == a1["expert_fp8"] and a8["dense_fp8"] * 8 == a1["dense_fp8"]
    # the replicated parts of attention (q_a, kv_a, indexer wq_b) are the same; the head-split ones / 8
    H = tp1["hidden_size"]
    repl = H * tp1["q_lora_rank"] + H * (tp1["kv_lora_rank"] + 64) + tp1["q_lora_rank"] * 32 * 128
    assert a8["attn_fp8"] - repl == (a1["attn_fp8"] - repl) // 8
    assert a8["idx_bf16"] == a1["idx_bf16"]


def test_tp8_preset_per_rank_counts_against_hf(tmp_path):
    """transformers' GlmMoeDsa built from the TP8 config (meta device) has 1/8 of the TP1 model's
    head-split and MLP parameters per layer and the same indexer."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    def build(preset):
        d = tmp_path / preset
        M.write_model(d, preset, 0, log=lambda *_: None)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))

    m1, m8 = build("glm5-6l"), build("glm5-6l-tp8")
    for name in ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.down_proj.weight"):
        p1 = dict(m1.model.layers[0].named_parameters())[name]
        p8 = dict(m8.model.layers[0].named_parameters())[name]
        assert p8.numel() * 8 == p1.numel(), name
    for name in ("self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight", "self_attn.q_a_proj.weight",
                 "self_attn.kv_a_proj_with_mqa.weight"):
        assert dict(m8.model.layers[0].named_parameters())[name].shape == dict(m1.model.layers[0].named_parameters())[name].shape
    e1, e8 = m1.model.layers[3].mlp.experts, m8.model.layers[3].mlp.experts
    assert e8.gate_up_proj.shape[0] == e1.gate_up_proj.shape[0] == 256
    assert e8.gate_up_proj.numel() * 8 == e1.gate_up_proj.numel()
    assert m8.lm_head.weight.numel() * 8 == m1.lm_head.weight.numel()


# ---------------------------------------------------------------------------------------------
# the matrix, the plan's split, schema
# ---------------------------------------------------------------------------------------------


def test_full_matrix_covers_issue_13():
    units = T.full_matrix()
    run1 = [u for u in units if u["run"] == 1]
    plain = [u for u in run1 if not u["compile"] and not u["mtp"]]
    assert {(u["shape"], u["arm"]) for u in plain} == {(s, b) for s in ("tp1", "tp8") for b in T.DEFAULT_BACKENDS}
    for u in plain:
        pts = {p["context"]: p["batches"] for p in u["points"]}
        assert pts == {4096: [128, 64, 16, 1], 32768: [128, 64, 16, 1], 131072: [16, 1]}
        assert u["prefill"] == 32768 and u["profile"] == {"context": 32768, "batch": 16}
    comp = [u for u in run1 if u["compile"]]
    assert len(comp) == 6 and all({p["context"] for p in u["points"]} == {32768} for u in comp)
    mtp = [u for u in run1 if u["mtp"]]
    assert {(u["shape"], u["arm"], u["mtp"]) for u in mtp} == {
        (s, b, k) for s in ("tp1", "tp8") for b in T.MTP_BACKENDS for k in (1, 3)}
    assert all(p["batches"] == [16, 1] for u in mtp for p in u["points"])
    # run 2: only batch >= 16, prefill again, no profile
    for u in (u for u in units if u["run"] == 2):
        assert all(min(p["batches"]) >= 16 for p in u["points"]) and u["profile"] is None
    assert sum(1 for u in units if u["run"] == 2 and u["prefill"]) == 12


def test_plan_splits_into_calls_that_fit_and_counts_sessions():
    units = T.full_matrix()
    p = T.make_plan(units, call_budget_s=540, session_budget_s=1500)
    assert all(c["estimate_s"] <= 540 for c in p["calls"])
    sessions = {}
    for c in p["calls"]:
        sessions[c["session"]] = sessions.get(c["session"], 0) + c["estimate_s"]
        cfgs = [(w["shape"], w["arm"], w["compile"], w["mtp"]) for w in c["engines"]]
        runs = {}
        for cfg, w in zip(cfgs, c["engines"]):
            runs.setdefault(cfg, set()).add(w["run"])
        assert all(len(r) == 1 for r in runs.values())  # run 1 and 2 of a configuration never share a call
    assert all(v <= 1500 for v in sessions.values()) and len(sessions) == p["n_sessions"]
    # every decode and prefill point of the matrix is in exactly one engine of the plan
    want = sorted((u["shape"], u["arm"], u["compile"], u["mtp"], u["run"], p_["context"], b)
                  for u in units for p_ in u["points"] for b in p_["batches"])
    got = sorted((w["shape"], w["arm"], w["compile"], w["mtp"], w["run"], p_["context"], b)
                 for c in p["calls"] for w in c["engines"] for p_ in w["points"] for b in p_["batches"])
    assert got == want
    assert sum(1 for c in p["calls"] for w in c["engines"] if w["prefill"]) == sum(1 for u in units if u["prefill"])
    # a tighter call budget forces the long-context part of an engine into its own engine
    units = T.full_matrix(with_compile=False)
    q = T.make_plan(units, call_budget_s=380, session_budget_s=1500)
    assert all(c["estimate_s"] <= 380 for c in q["calls"])
    parts = [w for c in q["calls"] for w in c["engines"] if w.get("part")]
    assert parts and {w["part"] for w in parts} == {"a", "b"}
    assert all([p_["context"] for p_ in w["points"]] == [131072] for w in parts if w["part"] == "b")
    assert sum(1 for c in q["calls"] for w in c["engines"] if w["prefill"]) == sum(1 for u in units if u["prefill"])
    with pytest.raises(ValueError, match="cannot be split"):
        T.make_plan(units, call_budget_s=120)
    assert "sessions" in T.plan_text(p)


def test_kv_memory_holds_every_engine_of_the_matrix():
    for u in T.full_matrix():
        kv = T.BACKENDS[u["arm"]]["kv"]
        assert T.kv_need(u, 256, 16, 5) <= T.kv_tokens(kv, 6, 24 * 2**30), T.engine_name(u)


def test_capture_sizes_cover_mtp_batches():
    assert T.capture_sizes([16, 1], 3) == [4, 8, 16, 32, 64]
    assert T.capture_sizes([128, 64, 16, 1], 0) == [1, 2, 4, 8, 16, 64, 128]


def test_engine_kwargs_enable_stats_and_the_arms_settings():
    spec = {"model": "/m", "backend": "TRITON_MLA_SPARSE", "kv": "fp8_ds_mla", "points": [{"context": 32768, "batches": [16, 1]}],
            "prefill": None, "prefill_batch": 16, "new_tokens": 256, "chunk": 16384, "kv_gib": 24, "compile": False,
            "mtp": 3, "draft_backend": "auto", "profile": None}
    kw = T.engine_kwargs(spec)
    assert kw["disable_log_stats"] is False and kw["stream_interval"] == 1
    assert kw["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY" and kw["compilation_config"]["mode"] == 0
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    kw = T.engine_kwargs({**spec, "compile": True, "mtp": 0, "draft_backend": "same"})
    assert set(kw["compilation_config"]) == {"cudagraph_capture_sizes"} and "speculative_config" not in kw
    kw = T.engine_kwargs({**spec, "draft_backend": "same"})
    assert kw["speculative_config"]["attention_backend"] == "TRITON_MLA_SPARSE"


def test_check_record_names_schema_problems():
    good = {"kind": "decode", "shape": "tp8", "backend": "X", "kv_cache_dtype": "fp8", "batch": 16, "context": 4096,
            "compile": False, "num_speculative_tokens": 0, "run": 2, "samples": {}, "spread": {}, "ok": True,
            "implausible": [], "engine": "e", "decode_tok_s": 1.0, "tpot_ms": 1.0}
    assert T.check_record(good) == []
    assert "missing tpot_ms" in T.check_record({k: v for k, v in good.items() if k != "tpot_ms"})
    assert T.check_record({**good, "run": 3}) and T.check_record({**good, "shape": "tp4"})
    assert T.check_record({**good, "implausible": [{"sample": 1}]})


def test_log_facts_tell_the_draft_backend(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("INFO Using AttentionBackendEnum.TRITON_MLA_SPARSE backend.\nINFO Loading drafter model...\n"
                   "INFO Using FLASHMLA_SPARSE attention backend out of potential backends: ['FLASHMLA_SPARSE'].\n")
    f = C.log_facts(log)
    assert f["target_attention_backends_logged"] == ["TRITON_MLA_SPARSE"]
    assert f["draft_attention_backends_logged"] == ["FLASHMLA_SPARSE"]
    log.write_text("INFO Using AttentionBackendEnum.TRITON_MLA_SPARSE backend.\nINFO Loading drafter model...\n")
    assert "cached" in C.log_facts(log)["draft_attention_backends_logged"]


# ---------------------------------------------------------------------------------------------
# end to end against the fake vLLM
# ---------------------------------------------------------------------------------------------


def _run_fake(tmp_path, extra_args, env_extra=None, name="fake"):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, OUT=str(out), E2E_WORK=str(work), PYTHONPATH=str(FAKE), E2E_SITE=str(tmp_path / "nosite"),
               FAKE_VLLM_EVENTS=str(tmp_path / "events.txt"), **(env_extra or {}))
    p = subprocess.run([sys.executable, str(SCRIPT), "--name", name, "--no-profile", "--new-tokens", "32",
                        "--kv-gib", "1", *extra_args], env=env, capture_output=True, text=True, timeout=300)
    res = json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else None
    return p, res


def test_fake_engine_run_writes_valid_records_without_overlap(tmp_path):
    p, res = _run_fake(tmp_path, ["--shapes", "tp1,tp8", "--backends", "triton_fp8_ds_mla", "--contexts", "1024,256",
                                  "--batches", "4,1", "--prefill-context", "1024", "--prefill-batch", "2"],
                       {"FAKE_VLLM_INIT_S": "1.0"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = res["records"]
    assert all(T.check_record(r) == [] for r in recs), [T.check_record(r) for r in recs]
    dec = [r for r in recs if r["kind"] == "decode"]
    pre = [r for r in recs if r["kind"] == "prefill"]
    assert {(r["shape"], r["context"], r["batch"]) for r in dec} == {(s, c, b) for s in ("tp1", "tp8")
                                                                     for c in (1024, 256) for b in (4, 1)}
    assert {(r["shape"], r["batch"]) for r in pre} == {(s, b) for s in ("tp1", "tp8") for b in (1, 2)}
    for r in dec:
        # the fake's virtual clock: a decode step of batch B lasts (1 + 0.02 B) ms
        assert r["ok"] and r["tpot_ms"] == pytest.approx(1 + 0.02 * r["batch"], rel=1e-6), r
        assert r["decode_tok_s"] == pytest.approx(r["batch"] / r["tpot_ms"] * 1e3, rel=1e-6)
        assert len(r["samples"]["tpot_ms"]) == 5 and r["spread"]["tpot_ms"]["rel_spread"] == pytest.approx(0, abs=1e-9)
    for r in pre:
        # cold prefill of B x 1024 tokens at 2 us per token plus 1 ms per step (one chunk per step)
        assert r["ok"] and 0.6 * 5e5 < r["prefill_tok_s"] <= 5e5, r
    # no engine's vLLM import ran while another engine process was alive
    ev = [ln.split() for ln in (tmp_path / "events.txt").read_text().splitlines()]
    spans = {}
    for what, pid, t in ev:
        spans.setdefault(pid, {})[what] = float(t)
    worker_spans = sorted((s["import"], s["exit"]) for s in spans.values() if "exit" in s and "import" in s)
    workers = [s for s in worker_spans if s[1] - s[0] > 0.9]  # the engines (the preflight import is instant)
    assert len(workers) == 2
    assert workers[1][0] >= workers[0][1]
    assert res["device_time_s"] > 0 and all(e["job"]["wall_s"] for e in res["engines"].values())


def test_fake_engines_overlap_only_with_prefetch_imports(tmp_path):
    """The opposite case of the test above, so that its overlap check can fail: with
    --prefetch-imports the second engine's vLLM import runs while the first engine works."""
    p, res = _run_fake(tmp_path, ["--shapes", "tp1,tp8", "--backends", "triton_fp8", "--contexts", "256",
                                  "--batches", "1", "--prefetch-imports"], {"FAKE_VLLM_INIT_S": "2.0"})
    assert p.returncode == 0, p.stdout[-3000:]
    spans = {}
    for what, pid, t in (ln.split() for ln in (tmp_path / "events.txt").read_text().splitlines()):
        spans.setdefault(pid, {})[what] = float(t)
    workers = sorted((s["import"], s["exit"]) for s in spans.values() if s.get("exit", 0) - s.get("import", 0) > 1.9)
    assert len(workers) == 2 and workers[1][0] < workers[0][1]


def test_fake_engine_outlier_fails_the_run_loudly(tmp_path):
    # passes: 1 warm-up, 2 fill, 3 untimed batch-4 pass, 4..8 timed -> the 3rd timed sample is 3x slower
    p, res = _run_fake(tmp_path, ["--shapes", "tp1", "--backends", "triton_fp8", "--contexts", "256", "--batches", "4,1"],
                       {"FAKE_VLLM_SLOW_PASS": "6"})
    assert p.returncode == 1
    assert "IMPLAUSIBLE" in p.stdout
    (bad,) = [r for r in res["records"] if not r["ok"]]
    assert bad["batch"] == 4 and bad["decode_tok_s"] is None and bad["implausible"][0]["sample"] == 2
    assert "over 2" in bad["implausible"][0]["reason"]
    assert res["status"] == "FAILED" and res["implausible_points"][0]["batch"] == 4
    good = [r for r in res["records"] if r["ok"]]
    assert len(good) == 1 and good[0]["batch"] == 1


def test_fake_engine_without_metrics_is_an_error(tmp_path):
    p, res = _run_fake(tmp_path, ["--shapes", "tp1", "--backends", "triton_fp8", "--contexts", "256", "--batches", "1"],
                       {"FAKE_VLLM_NO_METRICS": "1"})
    assert p.returncode == 1
    errs = json.dumps(res["engines"])
    assert "disable_log_stats must be False" in errs


def test_fake_mtp_engine_reports_the_draft_backend(tmp_path):
    p, res = _run_fake(tmp_path, ["--shapes", "tp8", "--backends", "triton_fp8_ds_mla", "--contexts", "256",
                                  "--batches", "2", "--mtp", "1"])
    assert p.returncode == 0, p.stdout[-3000:]
    (eng,) = res["engines"].values()
    assert eng["log_facts"]["draft_attention_backends_logged"] == ["FLASHMLA_SPARSE"]
    assert res["records"][0]["num_speculative_tokens"] == 1
    assert "MTP draft backend" in p.stdout
    # which code the numbers are for
    assert set(res["tree_sha256"]) == {"overlay", "kernels"} and "commit" in res
    assert "skipped" in res["overlay_sync"]  # nothing staged here; on the host: the checkout's code synced
    assert res["records"][0]["commit"] == res["commit"]
    # each timed pass carries its GPU telemetry (n = 0 here: no nvidia-smi) and the host's load
    r0 = res["records"][0]
    assert len(r0["samples"]["gpu"]) == r0["repeats"] and all("loadavg_1m" in g for g in r0["samples"]["gpu"])


def test_merge_joins_calls_flags_duplicates_and_writes_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))

    def rec(backend, kv, tok, run=1, ok=True, kind="decode", batch=16):
        r = {"kind": kind, "shape": "tp1", "backend": backend, "kv_cache_dtype": kv, "batch": batch, "context": 4096,
             "compile": False, "num_speculative_tokens": 0, "run": run, "engine": "e", "ok": ok,
             "implausible": [] if ok else [{"sample": 1, "reason": "over 2x the median"}]}
        if kind == "decode":
            r.update(decode_tok_s=tok if ok else None, tpot_ms=16000 / tok if ok else None,
                     spread={"tpot_ms": T.spread([16000 / tok] * 5), "decode_tok_s": T.spread([tok] * 5)},
                     samples={"tpot_ms": [16000 / tok] * 5})
        else:
            r.update(prefill_tok_s=tok, spread={"prefill_tok_s": T.spread([tok] * 5), "seconds": T.spread([1.0] * 5)},
                     samples={})
        return r

    f1, f2 = tmp_path / "c1.json", tmp_path / "c2.json"
    f1.write_text(json.dumps({"command": "a", "call": 1, "device_time_s": 500.0, "records": [
        rec("TRITON_MLA_SPARSE", "fp8_ds_mla", 900.0), rec("TRITON_MLA_SPARSE", "fp8_ds_mla", 5e4, kind="prefill", batch=1)],
        "engines": {"tp1_triton_fp8_ds_mla_run1": {"spec": {"kv": "fp8_ds_mla", "shape": "tp1"}, "job": {"wall_s": 400.0},
                                                   "profile": {"per_layer_us": {"indexer": 50, "attention": 60, "rest": 300},
                                                               "shape": "tp1", "backend": "TRITON_MLA_SPARSE"}}}}))
    f2.write_text(json.dumps({"command": "b", "call": 2, "device_time_s": 300.0, "records": [
        rec("FLASHMLA_SPARSE", "fp8_ds_mla", 1000.0), rec("FLASHMLA_SPARSE", "fp8_ds_mla", 1000.0, run=2)], "engines": {}}))
    md = tmp_path / "t.md"
    assert T.main(["--merge", str(f1), str(f2), "--table-md", str(md)]) == 0
    d = json.loads((tmp_path / "out" / "e2e_h200.json").read_text())
    assert len(d["records"]) == 4 and d["duplicates"] == [] and d["schema_problems"] == []
    assert d["device_time_s"]["total"] == 800.0 and d["device_time_s"]["per_engine"]["tp1_triton_fp8_ds_mla_run1"] == 400.0
    text = md.read_text()
    assert "| tp1 | 4096 | 16 | no | 0 | TRITON_MLA_SPARSE | fp8_ds_mla | 1 | 900 | 17.78 | 17.8-17.8 | 0.0% | 0.9 |" in text
    assert "| 50 | 60 | 300 |" in text and "| 50,000 |" in text
    # the same point twice, and an implausible one: named, exit 1
    f3 = tmp_path / "c3.json"
    f3.write_text(json.dumps({"command": "c", "call": 3, "records": [rec("FLASHMLA_SPARSE", "fp8_ds_mla", 1000.0),
                                                                    rec("TRITON_MLA_SPARSE", "fp8", 1.0, ok=False)]}))
    assert T.main(["--merge", str(f1), str(f2), str(f3)]) == 1
    d = json.loads((tmp_path / "out" / "e2e_h200.json").read_text())
    assert len(d["duplicates"]) == 1 and d["implausible_points"][0]["kind"] == "decode"
    assert "FAIL" in d["table"]
    # an earlier merge as an input (its calls' files gone): its calls and records carried over
    assert T.main(["--merge", str(f1), "--out-name", "first"]) == 0
    f4 = tmp_path / "c4.json"
    f4.write_text(json.dumps({"command": "d", "call": 4, "device_time_s": 100.0, "records": [
        rec("TRITON_MLA_SPARSE", "fp8_ds_mla", 950.0, run=2)], "engines": {}}))
    assert T.main(["--merge", str(tmp_path / "out" / "first.json"), str(f4), "--out-name", "both"]) == 0
    d = json.loads((tmp_path / "out" / "both.json").read_text())
    assert [m["file"] for m in d["merged_from"]] == ["c1.json", "c4.json"] and len(d["records"]) == 3
    assert d["device_time_s"]["total"] == 600.0 and "tp1_triton_fp8_ds_mla_run1" in d["engines"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert T.main(["--merge", str(f1), str(f2), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 10000


def test_matrix_engine_kwargs_are_accepted_by_vllm_engine_args():
    """Every engine of the matrix: each key names an EngineArgs field, the compilation and
    speculative configs parse (vLLM 0.26.0 installed; skipped elsewhere)."""
    pytest.importorskip("vllm.engine.arg_utils", exc_type=ImportError)
    import dataclasses

    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for u in T.full_matrix():
        spec = {"model": "/m", **T.BACKENDS[u["arm"]], "points": u["points"], "prefill": u["prefill"],
                "prefill_batch": 16, "new_tokens": 256, "chunk": 16384, "kv_gib": 24, "compile": u["compile"],
                "mtp": u["mtp"], "draft_backend": "auto", "profile": u["profile"], "prof_dir": "/tmp/p",
                "profile_steps": 8}
        kw = T.engine_kwargs(spec)
        assert set(kw) <= fields, set(kw) - fields
        cc = CompilationConfig(**kw["compilation_config"])
        assert (cc.mode is not None and int(cc.mode) == 0) != u["compile"]  # compile: vLLM's default


def test_vllm_output_processor_gives_per_step_engine_timestamps():
    """vLLM 0.26.0's own OutputProcessor (the frontend half of LLMEngine.step), fed engine-core
    outputs of a batch of 3 with a ramp: with log_stats and output_kind DELTA every step yields one
    RequestOutput per request whose metrics.last_token_ts is that step's engine timestamp, so the
    worker's events give analyze_decode exact per-token times; without log_stats metrics is None.
    Skipped where vLLM is not installed."""
    pytest.importorskip("vllm.v1.engine.output_processor", exc_type=ImportError)
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import (EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreRequest,
                                FinishReason)
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    def run(log_stats):
        op = OutputProcessor(tokenizer=None, log_stats=log_stats)
        n_tok = 6
        start = {"q0": 0, "q1": 0, "q2": 2}  # q2 arrives late: its prefill ends 2 steps later
        for rid in start:
            sp = SamplingParams(max_tokens=n_tok, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
            op.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3], mm_features=None,
                                             sampling_params=sp, pooling_params=None, arrival_time=0.0,
                                             lora_request=None, cache_salt=None, data_parallel_rank=None,
                                             external_req_id=rid), None)
        events, finals = [], {}
        for step in range(n_tok + 2):
            ts = 100.0 + 0.005 * step
            outs = []
            for rid, s0 in start.items():
                k = step - s0  # token index of this request in this step
                if 0 <= k < n_tok:
                    ev = [EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED, ts - 0.004)] if k == 0 else None
                    outs.append(EngineCoreOutput(request_id=rid, new_token_ids=[7], events=ev,
                                                 finish_reason=FinishReason.LENGTH if k == n_tok - 1 else None))
            res = op.process_outputs(outs, engine_core_timestamp=ts,
                                     iteration_stats=IterationStats() if log_stats else None)
            for o in res.request_outputs:
                if o.metrics is None:
                    return None
                events.append({"rid": o.request_id, "ts": o.metrics.last_token_ts, "n": len(o.outputs[0].token_ids)})
                if o.finished:
                    finals[o.request_id] = o.metrics
        return events, finals

    assert run(False) is None
    events, finals = run(True)
    assert len(events) == 3 * 6 and all(e["n"] == 1 for e in events)
    assert finals["q2"].first_token_ts == pytest.approx(100.010) and finals["q0"].last_token_ts == pytest.approx(100.025)
    assert finals["q2"].scheduled_ts == pytest.approx(100.006)
    s = T.analyze_decode(events, batch=3, max_tokens=6, min_window_frac=0.3)
    assert s["errors"] == [] and s["ramp_steps"] == 2 and s["window_steps"] == 3
    assert s["tpot_ms"] == pytest.approx(5.0)


def test_vllm_creates_the_engine_config_of_every_matrix_engine(tmp_path, monkeypatch):
    """EngineArgs(**engine_kwargs).create_engine_config() for every run-1 engine of the matrix on
    the CPU (device type faked as cuda): both shapes' configs, FP8 block quantization, MTP, capture
    sizes, stats on. Needs vLLM 0.26.0 (patched: TRITON_MLA_SPARSE) and compressed_tensors; skipped
    elsewhere."""
    pytest.importorskip("vllm.engine.arg_utils", exc_type=ImportError)
    pytest.importorskip("compressed_tensors")
    import vllm.platforms as pl
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(pl.current_platform, "device_type", "cuda", raising=False)
    dirs = {}
    for shape, preset in T.SHAPES.items():
        dirs[shape] = tmp_path / preset
        M.write_model(dirs[shape], preset, 0, log=lambda *_: None)
    for u in T.full_matrix(runs=(1,)):
        spec = {"model": str(dirs[u["shape"]]), **T.BACKENDS[u["arm"]], "points": u["points"], "prefill": u["prefill"],
                "prefill_batch": 16, "new_tokens": 256, "chunk": 16384, "kv_gib": 24, "compile": u["compile"],
                "mtp": u["mtp"], "draft_backend": "auto", "profile": None}
        try:
            c = EngineArgs(**T.engine_kwargs(spec)).create_engine_config()
        except ValueError as e:
            if "TRITON_MLA_SPARSE" in str(e):
                pytest.skip("stock vLLM: no TRITON_MLA_SPARSE")
            raise
        assert c.model_config.get_num_attention_heads(c.parallel_config) == (8 if u["shape"] == "tp8" else 64)
        assert c.cache_config.cache_dtype == T.BACKENDS[u["arm"]]["kv"]
        assert c.observability_config is not None
        sizes = c.compilation_config.cudagraph_capture_sizes
        for p in u["points"]:
            assert all(b * (1 + u["mtp"]) in sizes for b in p["batches"]), (T.engine_name(u), sizes)
        if u["mtp"]:
            assert c.speculative_config.num_speculative_tokens == u["mtp"] and c.speculative_config.method == "mtp"

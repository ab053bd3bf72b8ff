"""e2e/e2e_common.py and the pieces of e2e/e2e_correctness.py that run without a GPU."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import e2e_common as C
import e2e_correctness as E


# ---------------------------------------------------------------------------------------------
# prompts, grouping, KV sizing
# ---------------------------------------------------------------------------------------------


def test_prompts_mix_short_and_sparse_lengths_and_are_deterministic():
    import e2e_model as M

    cfg = M.build_config("tiny")
    p1, p2 = E.make_prompts(cfg, quick=False), E.make_prompts(cfg, quick=False)
    assert p1 == p2
    lens = [p["len"] for p in p1["logprobs"]]
    assert min(lens) == 16 and max(lens) == 4096
    assert any(L <= cfg["index_topk"] for L in lens) and sum(L > 4 * cfg["index_topk"] for L in lens) >= 4
    assert {p["set"] for p in p1["logprobs"]} == {"A", "B"}
    n_plain = cfg["vocab_size"] - 12
    assert all(0 <= t < n_plain for p in p1["logprobs"] for t in p["ids"])
    assert max(lens) + 64 <= E.MAX_MODEL_LEN
    pf = p1["prefix"]
    assert all(f[:E.PREFIX_LEN] == pf["prefix"] for f in pf["full"])
    assert pf["warm"][:E.PREFIX_LEN] == pf["prefix"] and pf["warm"][E.PREFIX_LEN:] != pf["full"][0][E.PREFIX_LEN:]
    # the preemption load must exceed the KV capacity, every single request must fit
    pre = p1["preempt"]
    assert sum(len(p) + pre["new"] for p in pre["prompts"]) > 2 * E.CAPACITY_TOKENS
    assert max(len(p) for p in pre["prompts"]) + pre["new"] < E.CAPACITY_TOKENS


def test_groups_by_capacity_keep_order_and_fit():
    items = [{"id": i, "len": L} for i, L in enumerate([100, 4096, 16, 2000, 2000, 3000, 10])]
    gs = E.groups_by_capacity(items, 5120)
    assert [it["id"] for g in gs for it in g] == list(range(7))
    for g in gs:
        assert len(g) == 1 or sum(it["len"] for it in g) <= 0.9 * 5120
    assert E.groups_by_capacity([], 100) == []


def test_kv_bytes_hold_the_capacity_in_vllm_block_arithmetic():
    for kv in ("auto", "fp8", "fp8_ds_mla"):
        for layers in (3, 4):
            b = E.kv_bytes(kv, layers, E.CAPACITY_TOKENS)
            per_block = 64 * layers * (E.MLA_BYTES[kv] + E.INDEXER_BYTES)
            assert (b // per_block) * 64 >= E.CAPACITY_TOKENS >= E.MAX_MODEL_LEN


def test_engine_kwargs_per_mode():
    import e2e_model as M

    cfg = M.build_config("tiny")
    spec = {"model": "/m", "backend": "FLASHMLA_SPARSE", "kv": "fp8_ds_mla",
            "attention_config": {"sparse_mla_force_mqa": True}, "mode": "graphs", "mtp": 3}
    kw = E.engine_kwargs(spec, cfg)
    assert kw["attention_backend"] == "FLASHMLA_SPARSE" and kw["kv_cache_dtype"] == "fp8_ds_mla"
    assert kw["attention_config"] == {"sparse_mla_force_mqa": True}
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert kw["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert kw["max_logprobs"] == -1 and kw["enable_prefix_caching"] is True
    assert kw["kv_cache_memory_bytes"] == E.kv_bytes("fp8_ds_mla", 4, E.CAPACITY_TOKENS)  # MTP layer counted
    assert E.engine_kwargs({**spec, "mode": "eager"}, cfg)["enforce_eager"] is True
    assert "compilation_config" not in E.engine_kwargs({**spec, "mode": "compile"}, cfg)
    with pytest.raises(ValueError):
        E.engine_kwargs({**spec, "mode": "fast"}, cfg)


def test_engine_kwargs_are_accepted_by_vllm_engine_args():
    """Every key names an EngineArgs field and the nested configs parse (vLLM 0.26.0 installed)."""
    pytest.importorskip("vllm.engine.arg_utils", exc_type=ImportError)
    import dataclasses

    import e2e_model as M
    from vllm.config import AttentionConfig, CompilationConfig
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    cfg = M.build_config("tiny")
    for name, eng in E.ENGINES.items():
        kw = E.engine_kwargs({"model": "/m", "mode": "graphs", **eng}, cfg)
        assert set(kw) <= fields, set(kw) - fields
        cc = CompilationConfig(**kw["compilation_config"])
        assert cc.cudagraph_mode.name == "FULL_DECODE_ONLY" and int(cc.mode) == 0
        if "attention_config" in kw:
            assert AttentionConfig(**kw["attention_config"]).sparse_mla_force_mqa is True


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


def _lp(n, v, seed, scale=5.0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, v, generator=g) * scale, dim=-1)


def test_position_metrics_zero_for_identical_and_positive_for_perturbed():
    import torch

    ref = _lp(50, 64, 0)
    m = E.position_metrics(ref, ref.clone())
    assert abs(m["kl"]).max() < 1e-6 and m["top1"].all()
    noisy = torch.log_softmax(ref + 0.5 * _lp(50, 64, 1), dim=-1)
    m2 = E.position_metrics(ref, noisy)
    assert (m2["kl"] >= -1e-6).all() and m2["kl"].mean() > 1e-3
    assert (m2["gap"] >= 0).all()
    # KL(ref || x) matches the definition
    k = (ref.exp() * (ref - noisy)).sum(-1)
    assert torch.allclose(torch.as_tensor(m2["kl"]), k, atol=1e-6)


def test_summary_record_counts_hard_disagreements_and_sets():
    import numpy as np

    prompts = [{"id": "A0", "set": "A", "len": 5}, {"id": "B0", "set": "B", "len": 400}]
    arr = {"kl": np.array([0.0, 0.1, 0.2, 0.0, 0.5]), "top1": np.array([1, 0, 1, 1, 0], dtype=bool),
           "gap": np.array([0.1, 0.2, 3.0, 1.0, 2.5]), "pid": np.array([0, 0, 1, 1, 1], dtype=np.int32)}
    r = E.summary_record("X", "fp8", arr, prompts)
    assert r["top1_agree"] == pytest.approx(0.6) and r["mean_kl"] == pytest.approx(0.16)
    assert r["hard_disagreements"] == 1 and r["max_gap_at_disagreement"] == pytest.approx(2.5)
    assert r["by_set"]["A"]["positions"] == 2 and r["by_set"]["B"]["mean_kl"] == pytest.approx(0.7 / 3)
    assert set(r["by_length"]) == {"len<=topk", "len>topk"}
    for k in ("backend", "kv_cache_dtype", "prompts", "top1_agree", "mean_kl"):
        assert k in r


def _capture_for(prompt, lp):
    import torch

    top = torch.topk(lp, lp.shape[1], -1)
    tgt = torch.as_tensor(prompt[1:])
    ids = torch.cat([tgt[:, None], top.indices], 1).to(torch.int32)
    vals = torch.cat([lp.gather(1, tgt[:, None].long()), top.values], 1)
    return ids, vals


def test_find_capture_and_dense_logprobs_round_trip():
    import torch

    V = 32
    p1, p2 = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]
    lp1, lp2 = _lp(5, V, 1), _lp(5, V, 2)
    store = [_capture_for(p2, lp2), _capture_for(p1, lp1)]
    ids, lps = E.find_capture(store, p1)
    assert torch.equal(E.dense_logprobs(ids, lps, V), lp1) and len(store) == 1
    with pytest.raises(LookupError):
        E.find_capture(store, p1)
    with pytest.raises(ValueError):
        E.dense_logprobs(*store[0], V + 1)


def test_find_capture_with_prefix_cached_rows_left_unwritten():
    import torch

    V, nc = 16, 3
    p = [5, 6, 7, 8, 9, 10, 11]
    ids, vals = _capture_for(p, _lp(6, V, 3))
    ids[:nc] = -12345  # what vLLM leaves in rows served from the cache (torch.empty)
    store = [(ids, vals)]
    got_ids, got_lps = E.find_capture(store, p, start=nc)
    d = E.dense_logprobs(got_ids[nc:], got_lps[nc:], V)
    assert d.shape == (6 - nc, V) and torch.isfinite(d).all()


def test_compare_sequences_identical_near_tie_and_real_divergence():
    a = {"tokens": [1, 2, 3, 4], "gaps": [3.0, 0.1, 5.0, 5.0], "logprobs": [-0.1, -0.5, -0.2, -0.3]}
    same = E.compare_sequences([a], [dict(a)])
    assert same["identical"] == 1 and same["all_divergences_near_ties"] and same["divergences"] == []
    tie = E.compare_sequences([a], [{"tokens": [1, 7, 8, 9], "logprobs": [-0.1, -0.6, 0, 0]}])
    assert tie["identical"] == 0 and tie["divergences"][0]["position"] == 1 and tie["all_divergences_near_ties"]
    real = E.compare_sequences([a], [{"tokens": [1, 2, 9, 9], "logprobs": [-0.1, -0.5, 0, 0]}])
    assert not real["all_divergences_near_ties"] and real["divergences"][0]["ref_gap"] == 5.0
    short = E.compare_sequences([a], [{"tokens": [1, 2], "logprobs": [-0.1, -0.5]}])
    assert short["identical"] == 0 and short["divergences"][0]["position"] == 2
    assert real["max_abs_logprob_diff_common"] == pytest.approx(0.0)


def test_bootstrap_se_and_paired_diff():
    import numpy as np

    rng = np.random.default_rng(0)
    v = rng.exponential(1.0, 4000)
    se = C.bootstrap_mean_se(v)
    assert 0.5 * v.std() / np.sqrt(v.size) < se < 2 * v.std() / np.sqrt(v.size)
    groups = np.repeat(np.arange(40), 100)
    se_g = C.bootstrap_mean_se(v + np.repeat(rng.normal(0, 1, 40), 100), groups=groups)
    assert se_g > se  # prompt-level correlation widens the interval
    a = {"kl": v, "pid": groups.astype(np.int32)}
    b = {"kl": v * 1.5, "pid": groups.astype(np.int32)}
    d = E.paired_diff(a, b)
    assert d["mean_diff"] < 0 and d["ratio"] == pytest.approx(1 / 1.5) and d["se"] > 0
    assert E.paired_diff(a, {"kl": v[:10], "pid": groups[:10]}) is None


def _synthetic(kl_ours, kl_flash, kl_auto, kl_fp8, kl_hf):
    import numpy as np

    rng = np.random.default_rng(1)
    n = 3000
    pid = np.repeat(np.arange(15), 200).astype(np.int32)
    base = rng.exponential(1.0, n)
    arrays = {k: {"kl": base * v, "pid": pid, "top1": np.ones(n, bool), "gap": np.ones(n)}
              for k, v in (("triton_fp8_ds_mla", kl_ours), ("flashmla_fp8_ds_mla", kl_flash),
                           ("triton_auto", kl_auto), ("triton_fp8", kl_fp8), ("hf_bf16", kl_hf))}
    rec = {"hard_disagreements": 0, "top1_agree": 0.99, "mean_kl": kl_ours, "max_gap_at_disagreement": 0.2}
    greedy = {"G0": {"tokens": [1, 2, 3], "gaps": [1, 1, 1], "logprobs": [0, 0, 0]}}
    results = {
        "hf": {"rope_check": {"interleaved": True}, "checkpoint_check": {"ok": True}, "greedy": greedy},
        "engines": {
            "triton_fp8_ds_mla": {"records": [rec], "greedy": greedy,
                                  "prefix_cache": {"requests": [{"num_cached_tokens": E.PREFIX_LEN, "kl_clean_vs_cached": 0.0,
                                                                 "top1_agree": 1.0}]},
                                  "preempt": {"preemptions": 7, "comparison": E.compare_sequences([greedy["G0"]], [greedy["G0"]])},
                                  "repeat": {"prompts": 2, "bitwise_identical_prompts": 2}},
            "triton_fp8_ds_mla_mtp3": {"spec": {"mtp": 3}, "greedy": greedy, "records": []},
        },
    }
    return results, arrays


def test_evaluate_passes_a_good_run_and_fails_a_worse_backend():
    results, arrays = _synthetic(1.0e-3, 1.0e-3, 0.3e-3, 1.0e-3, 0.25e-3)
    crit = E.evaluate(results, arrays)
    by = {c["criterion"]: c["pass"] for c in crit}
    assert all(v is True for v in by.values()), {k: v for k, v in by.items() if v is not True}
    assert any("MTP" in k for k in by) and any("preemption" in k for k in by) and any("prefix" in k for k in by)
    results, arrays = _synthetic(2.0e-3, 1.0e-3, 0.3e-3, 1.1e-3, 0.25e-3)
    crit = E.evaluate(results, arrays)
    ours = [c for c in crit if c["criterion"].startswith("TRITON_MLA_SPARSE fp8_ds_mla at least as close")][0]
    assert ours["pass"] is False and ours["detail"]["mean_diff"] > 0
    results, arrays = _synthetic(1.0e-3, 1.0e-3, 1.2e-3, 1.1e-3, 0.25e-3)  # bf16 KV not closer
    crit = E.evaluate(results, arrays)
    assert any(c["criterion"].startswith("bf16 KV") and c["pass"] is False for c in crit)


def test_evaluate_flags_no_preemption_and_a_prefix_miss():
    results, arrays = _synthetic(1.0e-3, 1.0e-3, 0.3e-3, 1.1e-3, 0.25e-3)
    e1 = results["engines"]["triton_fp8_ds_mla"]
    e1["preempt"]["preemptions"] = 0
    e1["prefix_cache"]["requests"][0]["num_cached_tokens"] = 0
    by = {c["criterion"]: c["pass"] for c in E.evaluate(results, arrays)}
    assert [v for k, v in by.items() if k.startswith("preemption")] == [False]
    assert [v for k, v in by.items() if k.startswith("prefix cache")] == [False]


def _prefix_requests(kls):
    return [{"num_cached_tokens": E.PREFIX_LEN, "kl_clean_vs_cached": k, "top1_agree": 0.99,
             "bitwise_identical": False} for k in kls]


def test_prefix_criterion_uses_flashmla_under_the_same_procedure():
    results, arrays = _synthetic(1.0e-3, 1.0e-3, 0.3e-3, 1.1e-3, 0.25e-3)
    e1 = results["engines"]["triton_fp8_ds_mla"]
    results["engines"]["flashmla_fp8_ds_mla"] = {"prefix_cache": {"requests": _prefix_requests(
        [1.5e-3, 1.7e-3, 1.4e-3, 1.6e-3])}}

    def prefix_verdict():
        crit = [c for c in E.evaluate(results, arrays) if c["criterion"].startswith("prefix cache:")]
        assert len(crit) == 1 and "FLASHMLA_SPARSE" in crit[0]["criterion"]
        return crit[0]

    # as close as upstream's backend (above the old run-to-run bound, which is not the yardstick)
    e1["prefix_cache"]["requests"] = _prefix_requests([1.5e-3, 1.8e-3, 1.4e-3, 1.6e-3])
    assert prefix_verdict()["pass"] is True
    # clearly worse than upstream's: a cache write that loses information
    e1["prefix_cache"]["requests"] = _prefix_requests([4.0e-3, 4.4e-3, 3.9e-3, 4.2e-3])
    verdict = prefix_verdict()
    assert verdict["pass"] is False and verdict["detail"]["mean_kl"] > verdict["detail"]["bound"]
    # a prefix miss fails whatever the KL
    e1["prefix_cache"]["requests"] = _prefix_requests([1.5e-3, 1.5e-3])
    e1["prefix_cache"]["requests"][1]["num_cached_tokens"] = 0
    assert prefix_verdict()["pass"] is False


def test_summary_table_lists_failed_engines():
    results, _ = _synthetic(1.0e-3, 1.0e-3, 0.3e-3, 1.1e-3, 0.25e-3)
    results["engines"]["flashmla_fp8_ds_mla"] = {"spec": {"backend": "FLASHMLA_SPARSE", "kv": "fp8_ds_mla"},
                                                 "records": [], "job": {"status": "timeout"},
                                                 "errors": [{"type": "timeout", "message": "worker timeout"}]}
    rec = dict(results["engines"]["triton_fp8_ds_mla"]["records"][0])
    rec.update(backend="TRITON_MLA_SPARSE", kv_cache_dtype="fp8_ds_mla", positions=10, mean_kl_se=1e-5,
               by_set={"A": {"mean_kl": 1e-3}})
    results["engines"]["triton_fp8_ds_mla"]["records"] = [rec]
    results["criteria"] = [{"criterion": "x", "pass": None, "source": "s"}]
    t = E.summary_table(results)
    assert "timeout" in t and "TRITON_MLA_SPARSE" in t and "[N/A ] x" in t


# ---------------------------------------------------------------------------------------------
# the job runner (dummy workers: no GPU, no vLLM)
# ---------------------------------------------------------------------------------------------

DUMMY = r'''
import json, pathlib, sys, time
sys.path.insert(0, {tools!r})
import e2e_common as C
jd = pathlib.Path(sys.argv[1]); mode = sys.argv[2]
time.sleep(0.3)                       # "imports"
C.worker_wait_for_go(jd)
run = C.Run(jd / "result.json", {{"records": []}}, tag=mode)
if mode == "ok":
    with run.phase("work"):
        run.results["records"].append({{"v": 1}})
elif mode == "error":
    with run.phase("work"):
        raise RuntimeError("boom")
elif mode == "hang":
    with run.phase("work"):
        run.results["records"].append({{"partial": True}})
        run.save()
        time.sleep(60)
elif mode == "crash":
    sys.exit(7)
run.save()
'''


def _jobs(tmp_path, modes, timeout=20.0, expect=1.0):
    script = tmp_path / "dummy.py"
    script.write_text(DUMMY.format(tools=str(Path(C.__file__).parent)))
    jobs = []
    for i, m in enumerate(modes):
        jd = tmp_path / f"j{i}"
        jobs.append(C.Job(f"j{i}-{m}", [sys.executable, str(script), str(jd), m], jd, timeout, None, expect))
    return jobs


def test_run_jobs_runs_in_order_prefetches_and_records_failures(tmp_path):
    jobs = _jobs(tmp_path, ["ok", "error", "crash", "hang", "ok"], timeout=6.0)
    run = C.Run(None, tag="t", stream=open(tmp_path / "log", "w"))
    done = {}
    t0 = time.time()
    C.run_jobs(jobs, run, time.time() + 60, lambda j, r: done.__setitem__(j.name, r))
    assert list(done) == [j.name for j in jobs]
    assert done["j0-ok"]["records"] == [{"v": 1}] and done["j0-ok"]["job"]["status"] == "exited"
    assert done["j1-error"]["errors"][0]["message"] == "boom"
    assert done["j2-crash"]["job"]["status"] == "exited rc=7" and done["j2-crash"]["errors"]
    assert done["j3-hang"]["job"]["status"] == "timeout" and done["j3-hang"]["records"] == [{"partial": True}]
    assert done["j4-ok"]["records"] == [{"v": 1}]
    # the next job's imports overlapped the current one: it was ready before it got its go
    r4 = (jobs[4].dir / "ready").stat().st_mtime
    assert r4 < jobs[4].t_go
    assert time.time() - t0 < 30


def test_run_jobs_skips_what_does_not_fit_the_deadline(tmp_path):
    jobs = _jobs(tmp_path, ["ok", "ok"], timeout=20.0, expect=1000.0)
    run = C.Run(None, tag="t", stream=open(tmp_path / "log", "w"))
    done = {}
    C.run_jobs(jobs, run, time.time() + 10, lambda j, r: done.__setitem__(j.name, r))
    assert all(r["job"]["status"] == "skipped" for r in done.values())
    assert all(j.proc is None for j in jobs)


def test_run_phase_records_errors_and_goes_on(tmp_path):
    run = C.Run(tmp_path / "r.json", tag="t", stream=open(tmp_path / "log", "w"))
    with run.phase("bad"):
        raise KeyError("x")
    with run.phase("good"):
        pass
    with pytest.raises(ValueError):
        with run.phase("fatal", fatal=True):
            raise ValueError("stop")
    data = json.loads((tmp_path / "r.json").read_text())
    assert [p["status"] for p in data["phases"]] == ["error", "ok", "error"]
    assert data["errors"][0]["type"] == "KeyError" and "Traceback" in data["errors"][0]["traceback"]


def test_collect_logs_keeps_key_lines(tmp_path):
    jobs = _jobs(tmp_path, ["ok"])
    jobs[0].dir.mkdir(parents=True)
    jobs[0].log_path.write_text("noise\n" * 10 + "INFO Using TRITON_MLA_SPARSE attention backend\nTraceback: x\n")
    jobs[0].status = "exited"
    C.collect_logs(jobs, tmp_path / "logs.txt")
    text = (tmp_path / "logs.txt").read_text()
    assert "Using TRITON_MLA_SPARSE attention backend" in text and "key lines (2" in text


def test_engine_env_adds_the_staged_site_and_keeps_callers_settings(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    monkeypatch.setenv("E2E_SITE", str(site))
    monkeypatch.setenv("PYTHONPATH", "/x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    env = C.engine_env({"A": "1"})
    assert env["PYTHONPATH"].split(":")[0] == str(site) and "/x" in env["PYTHONPATH"]
    assert env["HF_HUB_OFFLINE"] == "0" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["A"] == "1"


def test_log_facts_parses_the_engine_log(tmp_path):
    p = tmp_path / "log.txt"
    p.write_text("INFO [cuda.py] Using AttentionBackendEnum.TRITON_MLA_SPARSE backend.\n"
                 "INFO [cuda.py] Using FLASHMLA_SPARSE attention backend out of ...\n"
                 "INFO GPU KV cache size: 5,184 tokens\n"
                 "Maximum concurrency for 32,960 tokens per request: 165.24x\n"
                 "WARNING CUDAGraphMode.FULL_DECODE_ONLY is not supported with X; Overriding to NONE\n")
    f = C.log_facts(p)
    # explicit (--attention-backend) and auto-selected (e.g. the MTP drafter's) choices both count
    assert f["attention_backends_logged"] == ["FLASHMLA_SPARSE", "TRITON_MLA_SPARSE"]
    assert f["kv_cache_tokens_logged"] == 5184 and f["max_concurrency"] == "165.24"
    assert len(f["cudagraph_lines"]) == 1


def test_worker_hf_on_cpu_with_the_micro_model(micro_model, tmp_path):
    """The HF reference worker end to end (device cpu): reference files, records, greedy, checks."""
    pytest.importorskip("transformers")
    import numpy as np

    cfg = json.loads((micro_model / "config.json").read_text())
    n_plain = cfg["vocab_size"] - 12
    ps = C.random_prompts(n_plain, [8, 40, 30], 1)
    prompts = {"logprobs": [{"id": f"{s}{i}", "set": s, "len": len(p), "ids": p}
                            for i, (s, p) in enumerate(zip("AAB", ps))],
               "greedy": [{"id": "G0", "len": 20, "ids": C.random_prompts(n_plain, [20], 3)[0]}], "greedy_new": 4}
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    jd = tmp_path / "job"
    jd.mkdir()
    spec = {"kind": "hf", "model": str(micro_model), "prompts": str(tmp_path / "prompts.json"),
            "ref_dir": str(tmp_path / "ref"), "device": "cpu"}
    (jd / "go").write_text("go")
    E.worker_hf(spec, jd)
    res = json.loads((jd / "result.json").read_text())
    assert res["errors"] == [] and res["rope_check"]["interleaved"] and res["checkpoint_check"]["ok"]
    assert len(list((tmp_path / "ref").glob("*.pt"))) == 3
    rec = res["records"][0]
    assert rec["backend"] == "HF_TRANSFORMERS_BF16" and rec["positions"] == 7 + 39 + 29
    assert 0.0 < rec["mean_kl"] < 1.0 and len(res["greedy"]["G0"]["tokens"]) == 4
    with np.load(jd / "positions.npz") as f:
        assert f["kl"].shape == (75,) and set(np.unique(f["pid"])) == {0, 1, 2}


def test_wait_gpu_idle_polls_nvidia_smi_and_gives_up(monkeypatch):
    import subprocess
    import types

    seq = iter(["70000\n", "50000\n", "1200\n"])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=next(seq)))
    monkeypatch.setattr(C.time, "sleep", lambda s: None)
    r = C.wait_gpu_idle(max_used_mib=4096, timeout_s=60, log=lambda *_: None)
    assert r["used_mib"] == [1200]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=0, stdout="90000\n"))
    msgs = []
    r = C.wait_gpu_idle(max_used_mib=4096, timeout_s=0.0, log=msgs.append)
    assert r["used_mib"] == [90000] and msgs

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert C.gpu_used_mib() is None and C.wait_gpu_idle(log=lambda *_: None)["used_mib"] is None


def test_summarize_telemetry_reads_nvidia_smi_lines():
    lines = ["1980, 3201, 512.3, 61, 0x0000000000000000", "1755, 3201, 699.9, 66, 0x0000000000000004",
             "[N/A], 3201, 500.0, 60, 0x0", "clocks.sm [MHz], x", "1980, 3201, 520.0, 62, 0x0000000000000000"]
    s = C.summarize_telemetry(lines, with_reasons=True)
    assert s["n"] == 3
    assert s["sm_mhz"] == {"min": 1755.0, "median": 1980.0, "max": 1980.0}
    assert s["power_w"]["max"] == 699.9 and s["temp_c"]["min"] == 61.0
    assert s["reasons"] == ["0x0000000000000000", "0x0000000000000004"]
    assert C.summarize_telemetry(["1980, 3201, 512.3, 61"], with_reasons=False)["n"] == 1
    assert C.summarize_telemetry([], with_reasons=False) is None


FAKE_SMI = """#!/bin/sh
# an older driver: the renamed reasons field is unknown, the old one answers
case "$*" in
  *clocks_event_reasons*) echo "Field is not a valid field to query." >&2; exit 2 ;;
  *-lms=*) while true; do echo "1980, 3201, 512.3, 61, 0x0000000000000000"; sleep 0.05; done ;;
  *clocks_throttle_reasons*) echo "0x0000000000000000" ;;
esac
"""


def test_gpu_sampler_samples_while_the_pass_runs(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(C.GpuSampler, "_reason", False)
    with C.GpuSampler(period_ms=50) as g:
        time.sleep(0.4)
    assert C.GpuSampler._reason == "clocks_throttle_reasons.active"
    assert g.summary["n"] >= 2 and g.summary["sm_mhz"]["median"] == 1980.0
    assert g.summary["reasons"] == ["0x0000000000000000"] and "loadavg_1m" in g.summary
    # no nvidia-smi at all: nothing sampled, said so, the pass still runs
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    monkeypatch.setattr(C.GpuSampler, "_reason", False)
    with C.GpuSampler() as g:
        pass
    assert g.summary["n"] == 0 and C.GpuSampler._reason is None


def test_sync_overlay_copies_the_checkouts_code_over_the_staged_tree(tmp_path):
    assert "error" in C.sync_overlay(tmp_path / "nothing")
    (tmp_path / "vllm" / "v1" / "attention" / "ops").mkdir(parents=True)
    stale = tmp_path / "vllm" / "v1" / "attention" / "ops" / "triton_dsa_indexer.py"
    stale.write_text("# an older kernel file\n")
    res = C.sync_overlay(tmp_path)
    assert res["files"] >= 6 and "error" not in res
    assert stale.read_text() == (C.REPO / "kernels" / "triton_dsa_indexer.py").read_text()
    ov = tmp_path / "vllm" / "v1" / "attention" / "backends" / "mla" / "triton_mla_sparse.py"
    assert ov.read_text() == (C.REPO / "overlay" / "vllm" / "v1" / "attention" / "backends" / "mla" /
                              "triton_mla_sparse.py").read_text()

"""e2e/e2e_throughput.py (arithmetic, kernel classes, trace summary, merge) and
e2e/e2e_serve_check.py / e2e/gpu-host-serve-deps.txt (response checks, deps list)."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

import e2e_model as M
import e2e_serve_check as S
import e2e_throughput as T

REPO = Path(__file__).resolve().parents[2]


def test_model_arith_counts_glm5_parameters(tmp_path):
    """model_arith's counts against the parameters of transformers' own GlmMoeDsaForCausalLM built
    from the same config (on the meta device: shapes only)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = M.build_config("glm5-6l")
    a = T.model_arith(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    layers = model.model.layers

    def numel(module, keep=lambda name: True):
        return sum(p.numel() for n, p in module.named_parameters() if p.dim() >= 2 and keep(n))

    bf16_indexer = ("indexer.wk.", "indexer.weights_proj.")  # kept in bf16 by vLLM
    for layer in layers:
        attn = layer.self_attn
        assert a["attn_fp8"] == numel(attn, lambda n: not n.startswith(bf16_indexer))
        assert a["idx_bf16"] == numel(attn, lambda n: n.startswith(bf16_indexer))
    moe = [layer for layer in layers if hasattr(layer.mlp, "experts")]
    dense = [layer for layer in layers if not hasattr(layer.mlp, "experts")]
    assert (a["n_dense"], a["n_moe"]) == (len(dense), len(moe)) == (3, 3)
    assert all(a["dense_fp8"] == numel(layer.mlp) for layer in dense)
    experts = moe[0].mlp.experts
    n_experts = experts.gate_up_proj.shape[0]
    assert (a["E"], a["k"]) == (n_experts, model.config.num_experts_per_tok)
    assert a["expert_fp8"] * n_experts == sum(p.numel() for p in experts.parameters())
    assert a["shared"] * a["expert_fp8"] == numel(moe[0].mlp.shared_experts)
    assert a["vocab"] * a["H"] == model.lm_head.weight.numel()


def test_decode_floor_experts_hit_matches_a_simulation():
    """The expected number of distinct experts a decode step touches, against drawing each
    token's top-8 of 256 at random (the dummy weights' router is not trained)."""
    import torch

    a = T.model_arith(M.build_config("glm5-6l"))
    g = torch.Generator().manual_seed(0)
    for batch in (1, 4, 16, 64):
        trials = 2000
        picks = torch.rand(trials, batch, a["E"], generator=g).argsort(-1)[..., : a["k"]]
        hit = torch.zeros(trials, a["E"]).scatter_(1, picks.reshape(trials, -1), 1.0).sum(1)
        got = T.decode_floor(a, "fp8_ds_mla", batch, 4096)["experts_hit_per_moe_layer"]
        # standard error of the simulated mean is < 0.1 expert at these sizes
        assert got == pytest.approx(hit.mean().item(), abs=0.3), batch
    f1, f64 = T.decode_floor(a, "fp8_ds_mla", 1, 4096), T.decode_floor(a, "fp8_ds_mla", 64, 4096)
    assert f64["floor_ms"] > f1["floor_ms"] > 0


def test_kv_sizes_match_what_vllm_allocated_on_the_h200():
    """kv_tokens and decode_floor's KV bytes against the KV cache vLLM itself sized on the H200
    (bench/results/e2e_h200.json: `kv_cache_tokens_logged`, parsed from vLLM's log, for 24 GiB)."""
    res = json.loads((REPO / "bench" / "results" / "e2e_h200.json").read_text())
    a = T.model_arith(M.build_config("glm5-6l"))
    checked = set()
    for name, eng in res["engines"].items():
        kv = eng.get("kv_cache_dtype") or {"triton_fp8_ds_mla": "fp8_ds_mla", "flashmla_fp8_ds_mla": "fp8_ds_mla",
                                           "triton_fp8": "fp8"}[name.split("@")[0]]
        logged = eng["log_facts"]["kv_cache_tokens_logged"]
        kv_bytes = int(eng["kv"]["kv_gib"] * 2**30)
        assert T.kv_tokens(kv, a["layers"], kv_bytes) == logged, name
        # bytes per token (all layers) that vLLM's count implies, to within one 64-token block
        per_token = kv_bytes / logged
        below_topk = T.decode_floor(a, kv, 1, 1024)["kv_bytes"] / 1024
        assert below_topk <= per_token < below_topk * (1 + 64 / logged), name
        checked.add(kv)
    assert checked == {"fp8_ds_mla", "fp8"}
    # past index_topk only the indexer keys grow: 128 e4m3 bytes + one fp32 scale per token and layer
    cfg = M.build_config("glm5-6l")
    grow = (T.decode_floor(a, "fp8_ds_mla", 64, 32768)["kv_bytes"]
            - T.decode_floor(a, "fp8_ds_mla", 64, 4096)["kv_bytes"])
    assert grow == 64 * a["layers"] * (32768 - 4096) * (cfg["index_head_dim"] + 4)


@pytest.mark.parametrize("name,cls", [
    ("_sparse_mla_fwd_kernel", "attention"), ("_sparse_mla_merge_kernel", "attention"),
    ("_mla_kv_cache_write_kernel", "attention"), ("_paged_logits_kernel", "indexer"),
    ("_ragged_logits_kernel", "indexer"), ("_topk_segment_kernel", "indexer"), ("_topk_merge_kernel", "indexer"),
    ("_indexer_k_quant_cache_kernel", "indexer"), ("_cp_gather_kernel", "indexer"),
    ("void flash::flash_fwd_splitkv_mla_fp8_sparse_kernel<...>", "attention"),
    ("void deep_gemm::sm90_fp8_paged_mqa_logits<...>", "indexer"),
    ("void vllm::concat_and_cache_ds_mla_kernel<...>", "attention"),
    ("void vllm::top_k_per_row_decode<...>", "indexer"),
    ("fused_moe_kernel", "rest"), ("void vllm::moe::grouped_topk_kernel<...>", "rest"),
    ("void cutlass::device_kernel<...>", "rest"), ("rms_norm_kernel", "rest"),
    ("_convert_req_index_to_global_index_kernel", "attention"),
])
def test_kernel_classes(name, cls):
    assert T.classify(name) == cls


def _trace(tmp_path, with_graph=True):
    ev = []
    for step in range(3):
        corr = 100 + step
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": step * 1000, "dur": 5,
                   "args": {"correlation": corr}})
        for name, dur in (("_paged_logits_kernel", 30), ("_topk_segment_kernel", 10), ("_sparse_mla_fwd_kernel", 60),
                          ("fused_moe_kernel", 100)):
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": step * 1000 + 10, "dur": dur,
                       "args": {"correlation": corr if with_graph else 999}})
    ev.append({"ph": "X", "cat": "kernel", "name": "prefill_only_kernel", "ts": 0, "dur": 5000, "args": {"correlation": 7}})
    p = tmp_path / ("t.pt.trace.json.gz" if with_graph else "t.pt.trace.json")
    data = json.dumps({"traceEvents": ev})
    if with_graph:
        with gzip.open(p, "wt") as f:
            f.write(data)
    else:
        p.write_text(data)
    return p


def test_summarize_trace_counts_graph_kernels_per_step_and_layer(tmp_path):
    s = T.summarize_trace([_trace(tmp_path)], layers=2)
    assert s["graph_kernels_visible"] and s["decode_steps"] == 3
    assert s["per_step_us"] == {"indexer": 40.0, "attention": 60.0, "rest": 100.0}
    assert s["per_layer_us"]["attention"] == 30.0 and s["per_step_total_us"] == 200.0
    assert s["top_kernels_us_per_step"]["indexer"][0] == ["_paged_logits_kernel", 30.0]
    assert "prefill_only_kernel" not in json.dumps(s)


def test_summarize_trace_without_graph_kernels_says_so(tmp_path):
    s = T.summarize_trace([_trace(tmp_path, with_graph=False)], layers=2)
    assert not s["graph_kernels_visible"] and s["decode_steps"] is None and s["note"]
    assert s["window_total_us"]["rest"] == pytest.approx(5300.0)


# ---------------------------------------------------------------------------------------------
# serve check
# ---------------------------------------------------------------------------------------------

GOOD = {"id": "chatcmpl-1", "object": "chat.completion", "model": S.SERVED_NAME,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 18, "completion_tokens": 16, "total_tokens": 34}}


def test_check_chat_accepts_a_good_answer_and_names_each_problem():
    assert S.check_chat(GOOD, 16, 18) == []
    assert S.check_chat(GOOD, 16, None) == []
    bad = json.loads(json.dumps(GOOD))
    bad["object"] = "x"
    bad["choices"][0]["message"] = {"role": "user", "content": None}
    bad["choices"][0]["finish_reason"] = "abort"
    bad["usage"] = {"prompt_tokens": 0, "completion_tokens": 17}
    probs = S.check_chat(bad, 16, 18)
    assert len(probs) == 7, probs
    assert S.check_chat("Internal Server Error", 16, None)[0].startswith("not a JSON object")


def test_expected_chat_tokens_matches_the_template(micro_model):
    pytest.importorskip("transformers")
    n = S.expected_chat_tokens(micro_model, [{"role": "user", "content": "Hello! Who are you?"}])
    tok = M.build_tokenizer(M.build_config("micro")["vocab_size"])
    body = tok.encode("Hello! Who are you?").ids
    assert n == 3 + 1 + len(body) + 1 + 1  # [gMASK] <sop> <|user|> \n body <|assistant|> \n
    long = S.expected_chat_tokens(M.pathlib.Path(micro_model),
                                  [{"role": "user", "content": S.LONG_WORDS * 12}])
    assert long > M.build_config("tiny")["index_topk"]  # the long chat request runs the sparse path


def test_serve_deps_file_is_minimal_and_pinned():
    lines = [ln.strip() for ln in (REPO / "e2e" / "gpu-host-serve-deps.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    pins = dict(ln.split("==") for ln in lines)
    assert set(pins) == {"uvicorn", "watchfiles", "prometheus-fastapi-instrumentator",
                         "model-hosting-container-standards", "jmespath"}
    assert all(re.fullmatch(r"\d+(\.\d+)+", v) for v in pins.values())
    shared = REPO.parent / "shared" / "gpu-host" / "deps-py312.txt"
    if shared.exists():
        have = {ln.split("==")[0].lower() for ln in shared.read_text().splitlines() if "==" in ln}
        assert not have & set(pins)
    mods = {"uvicorn", "watchfiles", "prometheus_fastapi_instrumentator", "model_hosting_container_standards",
            "jmespath"}
    assert mods <= set(S.SERVER_MODULES)


def test_server_modules_import_where_vllm_is_installed():
    """In an environment with vLLM 0.26.0 and the serve deps (the GPU host after staging), the server
    modules import; here it only runs where vLLM is installed."""
    pytest.importorskip("vllm.entrypoints.openai.api_server", exc_type=ImportError)
    import e2e_common as C

    r = S.preflight(C.engine_env())
    assert r.get("missing") == {}, r


def test_vllm_serve_parser_accepts_the_server_flags(tmp_path, monkeypatch):
    """vLLM 0.26.0's own `serve` argument parser takes the flags the serve check passes (stock vLLM
    does not know TRITON_MLA_SPARSE, so the yardstick backend stands in for the name)."""
    pytest.importorskip("vllm.entrypoints.openai.cli_args", exc_type=ImportError)
    import vllm.platforms as pl
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not getattr(pl.current_platform, "device_type", ""):
        # CPU-only machine: the config defaults need a device name
        monkeypatch.setattr(pl.current_platform, "device_type", "cpu", raising=False)
    parser = make_arg_parser(FlexibleArgumentParser())
    for eager in (False, True):
        a = S.parse_args(["--backend", "FLASHMLA_SPARSE", "--port", "9001"] + (["--eager"] if eager else []))
        args = parser.parse_args(S.server_args(tmp_path, a))
        assert args.kv_cache_memory_bytes == 2 * 2**30 and args.served_model_name == [S.SERVED_NAME]
        assert args.kv_cache_dtype == "fp8_ds_mla" and args.port == 9001 and args.max_model_len == 4160
        assert str(args.attention_backend).endswith("FLASHMLA_SPARSE")
        assert args.attention_config.sparse_mla_force_mqa is True
        if eager:
            assert args.enforce_eager
        else:
            assert args.compilation_config.cudagraph_mode.name == "FULL_DECODE_ONLY"


def test_fp8_deps_file_names_compressed_tensors_at_vllms_pin():
    lines = [ln.strip() for ln in (REPO / "e2e" / "gpu-host-fp8-deps.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    pins = dict(ln.split("==") for ln in lines)
    assert pins == {"compressed-tensors": "0.17.0", "loguru": "0.7.3"}
    assert {"compressed_tensors", "loguru"} <= set(T.PREFLIGHT_MODULES)


def test_preflight_imports_names_every_missing_module():
    import e2e_common as C

    r = C.preflight_imports(["json", "no_such_module_e2e", "os", "another_missing_e2e"])
    assert set(r["missing"]) == {"no_such_module_e2e", "another_missing_e2e"}
    assert r["modules"]["json"] == "ok"

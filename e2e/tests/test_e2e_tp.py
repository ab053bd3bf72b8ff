"""e2e/e2e_tp.py's summary (the part of the multi-GPU plan that runs without GPUs)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import e2e_tp  # noqa: E402


def _corr(tmp, tp, kl_ours, kl_peer):
    recs = [
        {"backend": "TRITON_MLA_SPARSE", "kv_cache_dtype": "fp8_ds_mla", "top1_agree": 0.96,
         "mean_kl": kl_ours, "mean_kl_se": 1e-4},
        {"backend": "TRITON_MLA_SPARSE", "kv_cache_dtype": "auto", "top1_agree": 0.97,
         "mean_kl": 1e-3, "mean_kl_se": 1e-5},
        {"backend": "FLASHMLA_SPARSE", "kv_cache_dtype": "fp8_ds_mla", "top1_agree": 0.96,
         "mean_kl": kl_peer, "mean_kl_se": 1e-4},
        {"backend": "HF_TRANSFORMERS_BF16", "kv_cache_dtype": "bf16", "mean_kl": 1e-3},
    ]
    p = tmp / f"c{tp}.json"
    p.write_text(json.dumps({"command": "x", "tensor_parallel_size": tp, "records": recs}))
    return p


def _tput(tmp, tp, ours, peer):
    recs = [{"kind": "decode", "backend": b, "tp": tp, "batch": 64, "decode_tok_s": v}
            for b, v in (("TRITON_MLA_SPARSE", ours), ("FLASHMLA_SPARSE", peer))]
    p = tmp / f"t{tp}.json"
    p.write_text(json.dumps({"command": "y", "records": recs}))
    return p


def test_summary_compares_tp_change_and_throughput(tmp_path):
    files = [_corr(tmp_path, 1, 4.0e-3, 4.4e-3), _corr(tmp_path, 8, 4.1e-3, 4.7e-3),
             _tput(tmp_path, 8, 900.0, 1000.0)]
    res = e2e_tp.summarize(files)
    (v,) = res["criteria"]
    assert v["tp"] == 8 and v["pass"]
    assert abs(v["kl_change_ours"] - 1e-4) < 1e-12 and abs(v["kl_change_flashmla"] - 3e-4) < 1e-12
    auto8 = [r for r in res["records"] if r.get("kv_cache_dtype") == "auto" and r["tp"] == 8]
    assert auto8 and auto8[0]["mean_kl_change_vs_tp1"] == 0.0
    (t,) = [r for r in res["records"] if "decode_tok_s" in r and r["backend"] == "TRITON_MLA_SPARSE"]
    assert abs(t["ratio_vs_flashmla_same_tp"] - 0.9) < 1e-12


def test_summary_fails_when_tp_moves_ours_more(tmp_path):
    files = [_corr(tmp_path, 1, 4.0e-3, 4.4e-3), _corr(tmp_path, 4, 6.0e-3, 4.5e-3)]
    (v,) = e2e_tp.summarize(files)["criteria"]
    assert v["tp"] == 4 and not v["pass"]

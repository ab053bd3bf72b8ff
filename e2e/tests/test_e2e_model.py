"""e2e/e2e_model.py: configs, checkpoint names, weights, planted structure, tokenizer, HF checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import e2e_model as M

SHARED_GLM5 = Path(__file__).resolve().parents[2] / "tests" / "data" / "glm-5-config.json"


def test_embedded_glm5_config_matches_shared():
    assert M.GLM5_CONFIG == json.loads(SHARED_GLM5.read_text())


def test_tiny_preset_has_the_issue_shapes():
    c = M.build_config("tiny")
    assert c["model_type"] == "glm_moe_dsa" and c["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert (c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]) == (192, 64, 256, 512)
    assert c["num_attention_heads"] == 64 and c["num_key_value_heads"] == 64
    assert (c["index_n_heads"], c["index_head_dim"], c["index_topk"]) == (32, 128, 256)
    assert c["indexer_rope_interleave"] is True and c["rope_interleave"] is True
    assert c["num_hidden_layers"] == 3 and c["first_k_dense_replace"] == 1
    assert c["num_nextn_predict_layers"] == 1
    assert c["n_group"] == 1 and c["n_routed_experts"] == 16 and c["num_experts_per_tok"] == 4
    assert c["scoring_func"] == "sigmoid" and c["topk_method"] == "noaux_tc"
    assert 2048 <= c["vocab_size"] <= 4096 and c["max_position_embeddings"] >= 8192
    assert c["q_lora_rank"] < M.GLM5_CONFIG["q_lora_rank"] and c["hidden_size"] == 1024
    # specials at the top of the vocabulary, eos/pad pointing at them
    assert c["pad_token_id"] == c["vocab_size"] - len(M.SPECIAL_TOKENS)
    assert all(c["vocab_size"] - len(M.SPECIAL_TOKENS) <= e < c["vocab_size"] for e in c["eos_token_id"])


def test_glm5_6l_preset_is_glm5_fp8_shaped():
    c = M.build_config("glm5-6l")
    for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "index_topk",
              "n_routed_experts", "num_experts_per_tok", "vocab_size", "moe_intermediate_size"):
        assert c[k] == M.GLM5_CONFIG[k], k
    assert c["num_hidden_layers"] == 6 and c["first_k_dense_replace"] == 3
    assert c["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                        "weight_block_size": [128, 128]}


@pytest.mark.parametrize("bad", [{"kv_lora_rank": 256}, {"index_head_dim": 64}, {"indexer_rope_interleave": False},
                                 {"num_experts_per_tok": 32}, {"num_attention_heads": 0}, {"no_such_key": 1}])
def test_bad_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        M.build_config("tiny", bad)


def test_checkpoint_names_are_the_ones_vllm_0260_loads():
    c = M.build_config("micro")
    lay = {n: s for n, s, _ in M.checkpoint_layout(c)}
    H, nh, E = c["hidden_size"], c["num_attention_heads"], c["n_routed_experts"]
    # dense layer 0, MoE layers 1-2, MTP layer 3 (a MoE decoder layer plus its own heads)
    assert lay["model.layers.0.mlp.gate_proj.weight"] == (c["intermediate_size"], H)
    assert "model.layers.0.mlp.gate.weight" not in lay
    for li in (1, 2, 3):
        p = f"model.layers.{li}.mlp"
        assert lay[f"{p}.gate.weight"] == (E, H) and lay[f"{p}.gate.e_score_correction_bias"] == (E,)
        for e in range(E):
            for w in ("gate", "up"):
                assert lay[f"{p}.experts.{e}.{w}_proj.weight"] == (c["moe_intermediate_size"], H)
            assert lay[f"{p}.experts.{e}.down_proj.weight"] == (H, c["moe_intermediate_size"])
        assert f"{p}.shared_experts.down_proj.weight" in lay
    a = "model.layers.0.self_attn"
    # un-fused names: vLLM's load_weights stacks q_a_proj + kv_a_proj_with_mqa -> fused_qkv_a_proj
    # and wk + weights_proj -> wk_weights_proj itself
    assert lay[f"{a}.q_a_proj.weight"] == (c["q_lora_rank"], H)
    assert lay[f"{a}.kv_a_proj_with_mqa.weight"] == (576, H)
    assert lay[f"{a}.q_b_proj.weight"] == (nh * 256, c["q_lora_rank"])
    assert lay[f"{a}.kv_b_proj.weight"] == (nh * (192 + 256), 512)
    assert lay[f"{a}.o_proj.weight"] == (H, nh * 256)
    assert lay[f"{a}.indexer.wq_b.weight"] == (c["index_n_heads"] * 128, c["q_lora_rank"])
    assert lay[f"{a}.indexer.wk.weight"] == (128, H)
    assert lay[f"{a}.indexer.k_norm.weight"] == (128,) and lay[f"{a}.indexer.k_norm.bias"] == (128,)
    assert lay[f"{a}.indexer.weights_proj.weight"] == (c["index_n_heads"], H)
    for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "embed_tokens.weight"):
        assert f"model.layers.3.{n}" in lay
    assert lay["model.layers.3.eh_proj.weight"] == (H, 2 * H)
    assert lay["model.layers.3.shared_head.head.weight"] == (c["vocab_size"], H)
    assert "lm_head.weight" in lay and "model.norm.weight" in lay
    assert not [n for n in lay if "fused" in n or "wk_weights_proj" in n or "gate_up_proj" in n]
    assert not [n for n in lay if n.startswith("model.layers.4.")]


def test_weights_are_deterministic_bf16_and_seeded():
    import torch

    c = M.build_config("micro")
    w1, w2, w3 = M.make_weights(c, 0), M.make_weights(c, 0), M.make_weights(c, 1)
    assert set(w1) == {n for n, _, _ in M.checkpoint_layout(c)}
    assert all(t.dtype == torch.bfloat16 for t in w1.values())
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["model.layers.1.mlp.experts.0.up_proj.weight"],
                           w3["model.layers.1.mlp.experts.0.up_proj.weight"])
    # the MTP copies equal their sources; norms are jittered away from 1 (a norm left at 1 shows)
    assert torch.equal(w1["model.layers.3.embed_tokens.weight"], w1["model.embed_tokens.weight"])
    assert torch.equal(w1["model.layers.3.shared_head.head.weight"], w1["lm_head.weight"])
    assert (w1["model.norm.weight"].float() - 1).abs().max() > 0.05
    assert all(torch.isfinite(t.float()).all() for t in w1.values())


def test_salient_tokens_are_a_fixed_fraction_of_plain_vocab():
    c = M.build_config("tiny")
    s = M.salient_token_ids(c, 0, 0.04)
    n_plain = c["vocab_size"] - len(M.SPECIAL_TOKENS)
    assert len(s) == round(0.04 * n_plain) and max(s) < n_plain and s == sorted(set(s))
    assert s == M.salient_token_ids(c, 0, 0.04) and s != M.salient_token_ids(c, 1, 0.04)
    # a 4096-token prompt holds fewer salient tokens than index_topk in expectation (see make_weights)
    assert 0.04 * 4096 < c["index_topk"]


def test_tokenizer_exact_vocab_specials_and_round_trip():
    pytest.importorskip("tokenizers")
    c = M.build_config("tiny")
    tok = M.build_tokenizer(c["vocab_size"])
    assert tok.get_vocab_size(with_added_tokens=True) == c["vocab_size"]
    assert tok.token_to_id("<|endoftext|>") == c["pad_token_id"]
    ids = tok.encode("hello world, the quick brown fox").ids
    assert all(0 <= i < c["vocab_size"] for i in ids)
    assert tok.decode(ids) == "hello world, the quick brown fox"
    assert len(ids) < len("hello world, the quick brown fox")  # merges apply
    every = tok.decode(list(range(c["vocab_size"] - len(M.SPECIAL_TOKENS))))
    assert isinstance(every, str)
    with pytest.raises(ValueError):
        M.build_tokenizer(200)


def test_written_model_dir_and_chat_template(micro_model):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoTokenizer

    info = json.loads((micro_model / "e2e_model.json").read_text())
    assert info["weights"]["params"] > 0 and len(info["weights"]["sha256"]) == 64
    assert M.model_is_current(micro_model, "micro", 0)
    assert not M.model_is_current(micro_model, "micro", 1)
    assert not M.model_is_current(micro_model, "micro", 0, gains={"lm_head": 3.0})
    cfg = AutoConfig.from_pretrained(str(micro_model))
    assert cfg.model_type == "glm_moe_dsa" and cfg.index_topk == 16
    assert getattr(cfg, "indexer_rope_interleave", None) is True  # extra field survives HF's config
    assert getattr(cfg, "num_nextn_predict_layers", None) == 1
    tok = AutoTokenizer.from_pretrained(str(micro_model))
    assert len(tok) == cfg.vocab_size and tok.eos_token_id == cfg.pad_token_id
    for content in ("Hello there", [{"type": "text", "text": "Hello there"}]):
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)
        assert text == "[gMASK]<sop><|user|>\nHello there<|assistant|>\n"


def test_hf_loads_every_tensor_and_applies_interleaved_rope(micro_model):
    pytest.importorskip("transformers")
    rope = M.check_hf_rope_interleave()
    assert rope["interleaved"], rope
    rep = M.check_hf_checkpoint(micro_model)
    assert rep["ok"], rep
    assert rep["unused_mtp"] > 0 and rep["unused_non_mtp"] == [] and rep["problems"] == []


def test_hf_check_catches_a_missing_tensor_and_a_mismatch(micro_model, tmp_path):
    pytest.importorskip("transformers")
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(micro_model, d)
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.1.self_attn.indexer.k_norm.bias"]
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    rep = M.check_hf_checkpoint(d)
    assert not rep["ok"]
    assert any("k_norm.bias" in k for k in rep["missing_keys"]), rep["missing_keys"]
    # a model whose expert tensors differ from the checkpoint (as a wrong gate/up order or expert
    # order in the conversion would make them) is reported by name
    model, info = M.load_hf(micro_model, "cpu", "float32")
    with torch.no_grad():
        model.model.layers[2].mlp.experts.gate_up_proj[1] *= 2
    rep = M.check_hf_checkpoint(micro_model, model, info)
    assert not rep["ok"]
    assert any("layers.2.mlp.experts.gate_up_proj" in p for p in rep["problems"]), rep["problems"]


def test_rope_reference_conventions_differ():
    import torch

    x = torch.randn(5, 64, dtype=torch.float64)
    pos = torch.arange(5) * 11
    g, n = M.rope_reference(x, pos, 1e6, "gptj"), M.rope_reference(x, pos, 1e6, "neox")
    assert torch.allclose(g.norm(dim=-1), x.norm(dim=-1)) and torch.allclose(n.norm(dim=-1), x.norm(dim=-1))
    assert (g - n).abs().max() > 1e-3
    assert torch.allclose(M.rope_reference(x, torch.zeros(5, dtype=torch.long), 1e6, "gptj"), x)


def test_planted_structure_makes_the_hf_indexer_pick_every_salient_token(micro_model):
    """With the micro model (index_topk 16) and a prompt of 120 tokens holding a few salient ones, HF's
    own indexer selects every salient token for every query past them."""
    pytest.importorskip("transformers")
    import torch
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    info = json.loads((micro_model / "e2e_model.json").read_text())
    cfg = info["config"]
    sal = set(M.salient_token_ids(cfg, 0, info["gains"]["salient_frac"]))
    g = torch.Generator().manual_seed(5)
    n_plain = cfg["vocab_size"] - len(M.SPECIAL_TOKENS)
    ids = torch.randint(0, n_plain, (120,), generator=g)
    plain = [t for t in range(n_plain) if t not in sal]
    ids = torch.tensor([plain[int(t) % len(plain)] for t in ids])  # no salient tokens ...
    sal_pos = [10, 40, 41, 90]
    for k, p in enumerate(sal_pos):  # ... except these 4 (< index_topk 16)
        ids[p] = sorted(sal)[k]
    model, _ = M.load_hf(micro_model, "cpu", "float32")
    got = []
    orig = hf.GlmMoeDsaIndexer.forward

    def fwd(self, *a, **k):
        out = orig(self, *a, **k)
        got.append(out[0])
        return out

    hf.GlmMoeDsaIndexer.forward = fwd
    try:
        with torch.no_grad():
            model(input_ids=ids[None], use_cache=False)
    finally:
        hf.GlmMoeDsaIndexer.forward = orig
    assert len(got) == cfg["num_hidden_layers"]
    for layer, sel in enumerate(got):
        for q in range(95, 120):
            chosen = set(sel[q].tolist())
            assert set(sal_pos) <= chosen, (layer, q, sorted(chosen))


def test_reference_helpers_shapes_and_greedy_consistency(micro_model):
    pytest.importorskip("transformers")
    import torch

    model, _ = M.load_hf(micro_model, "cpu", "float32")
    ids = list(range(3, 40))
    lp = M.hf_logprobs(model, ids)
    assert lp.shape == (len(ids) - 1, model.config.vocab_size)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(len(ids) - 1), atol=1e-4)
    new, gaps = M.hf_greedy(model, ids, 3)
    assert len(new) == 3 and all(g >= 0 for g in gaps)
    # hf_logprobs' last row is the distribution after all but the last token: greedy step 1 and 2
    assert int(M.hf_logprobs(model, ids + [new[0]])[-1].argmax()) == new[0]
    assert int(M.hf_logprobs(model, ids + new[:2])[-1].argmax()) == new[1]

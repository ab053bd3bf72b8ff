#!/usr/bin/env python3
"""Build the GLM-5-family models the end-to-end checks serve, and the HF reference helpers.

Presets (`--preset`):

* ``tiny`` (default): a GLM-5 (``glm_moe_dsa``) scaled down for the correctness checks (issue 5,
  verification 2-4): the real attention shapes (64 heads, qk_nope 192 / qk_rope 64 / v_head 256,
  kv_lora 512 so the MLA latent is 576 wide, indexer 32 x 128, interleaved RoPE flags of the real
  config), index_topk 256 so most prompts are sparse, 3 layers (1 dense + 2 MoE, 16 experts top-4,
  n_group 1, sigmoid + noaux_tc routing) plus one MTP layer, hidden 1024, q_lora 768, vocab 4096.
  Random weights from a fixed seed, saved as bf16 safetensors under the checkpoint names that vLLM
  0.26.0's ``DeepseekV2Model.load_weights`` / ``DeepSeekMTP.load_weights`` read (the names of the real
  GLM-5 checkpoints: per-expert ``mlp.experts.E.{gate,up,down}_proj.weight``, un-fused
  ``q_a_proj`` / ``kv_a_proj_with_mqa`` / ``indexer.wk`` / ``indexer.weights_proj``,
  ``mlp.gate.e_score_correction_bias``, the MTP layer at ``model.layers.{num_hidden_layers}.*``), plus
  a byte-level BPE tokenizer built offline with `tokenizers` (tokenizer.json, tokenizer_config.json
  with a chat template) so `vllm serve` and chat completions work.
  Random weights give near-ties; the init gains below make the logits decisive (see ``GAINS``), and
  the HF reference measures and reports the top-1 vs top-2 logit gap.
* ``glm5-6l``: GLM-5 at real dimensions (hidden 6144, 64 heads, q_lora 2048, index_topk 2048, 256
  experts top-8, vocab 154880) with 6 layers (3 dense + 3 MoE, GLM-5's first six) and GLM-5-FP8's
  block-FP8 ``quantization_config`` (``quant_method: fp8``, dynamic activations, ``weight_block_size
  [128, 128]``): config.json only, for ``load_format="dummy"`` (issue 6). No weights, no tokenizer
  (the throughput engine runs with ``skip_tokenizer_init``).
* ``glm5-6l-tp8``: the TP8 per-rank shape of ``glm5-6l`` (issue 13), served at TP1 on one GPU: what
  one of 8 tensor-parallel ranks computes per layer under vLLM 0.26.0's defaults. Scaled by 1/8:
  attention heads 64 -> 8 (q_b_proj, kv_b_proj, o_proj are split over heads; FLASHMLA_SPARSE pads
  8 heads to 64 for its FP8 decode kernel exactly as it does at TP8), dense MLP intermediate
  12288 -> 1536, expert intermediate 2048 -> 256 for all 256 routed experts and the shared one
  (vLLM's default TP MoE; expert parallelism, 32 whole experts per rank, needs
  ``enable_expert_parallel`` and is not the default), vocabulary 154880 -> 19360 (vocab-parallel
  embedding and lm_head; pad/eos ids moved inside it). Unchanged (replicated on every rank):
  hidden 6144, q_lora 2048, kv_lora 512 + rope 64 (so the KV cache per token is the TP1 one), the
  indexer (32 heads x 128, top-k 2048: ReplicatedLinear / disable_tp in vLLM), the router, the
  norms, 6 layers (3 dense + 3 MoE), the MTP layer's shapes follow the same config. Not modelled:
  the TP8 all-reduces (after o_proj and after each MLP/MoE) and the logits gather; the sampler
  sees 19360 logits instead of 154880. The exact fields are ``TP8_RANK_SCALED``.
* ``micro``: the tiny model shrunk further (4 heads, hidden 256) for the CPU tests only; the head
  dims stay 192/64/256 and the latent 576.

Checks (``--check-hf``): loads the checkpoint into transformers' ``GlmMoeDsaForCausalLM`` (the
installed version; the H200 host and the CPU venv both have 5.17.0) and verifies that every HF
parameter and buffer came from the checkpoint with the same value (experts through transformers'
fused ``gate_up_proj`` / ``down_proj``), that none is missing, that the only checkpoint tensors HF
does not use are the MTP layer's, and that the HF code applies interleaved (GPT-J) RoPE in both MLA
and the indexer (source inspection plus a numerical dot-product check against GPT-J and NeoX RoPE).

Only torch, safetensors, tokenizers and the standard library are needed to build; transformers only
for ``--check-hf`` and the reference helpers.

usage:
  python e2e/e2e_model.py --out /tmp/e2e/glm5-tiny                 # build (about 10 s on 16 cores)
  python e2e/e2e_model.py --out /tmp/e2e/glm5-tiny --check-hf      # build, then verify against HF
  python e2e/e2e_model.py --out /tmp/e2e/glm5-6l --preset glm5-6l  # config only
  python e2e/e2e_model.py --out /tmp/e2e/glm5-6l-tp8 --preset glm5-6l-tp8  # config only
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import math
import os
import pathlib
import sys
import time
import zlib
from typing import Any

# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------

# GLM-5 / GLM-5.1 public config.json, as tests/data/glm-5-config.json restates it (the GPU host gets
# only this folder's scripts, so it lives here too; e2e/tests checks that the two agree).
GLM5_CONFIG: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "dtype": "bfloat16",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_nextn_predict_layers": 1,
    "first_k_dense_replace": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "head_dim": 64,
    "index_topk": 2048,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "indexer_rope_interleave": True,
    "rope_interleave": True,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 202752,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "pad_token_id": 154820,
    "eos_token_id": [154820, 154827, 154829],
    "initializer_range": 0.02,
    "use_cache": True,
}

# GLM-5-FP8 (and DeepSeek-V3) block-FP8 checkpoint format, as vLLM 0.26.0's Fp8Config.from_config
# reads it: "fp8" in quant_method -> fp8-serialized checkpoint, dynamic per-token-group activation
# quantization, 128 x 128 weight blocks. The indexer's fused wk+weights_proj is built unquantized by
# vLLM whatever this says; the router gate is a GateLinear (not a LinearBase), so it stays bf16 too.
GLM5_FP8_QUANT = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}

# Special tokens of the tiny model's tokenizer (GLM-style names), at the top of the vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<think>", "</think>",
]
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _tiny_config() -> dict[str, Any]:
    c = copy.deepcopy(GLM5_CONFIG)
    vocab = 4096
    c.update(
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_hidden_layers=3,
        num_nextn_predict_layers=1,
        first_k_dense_replace=1,
        q_lora_rank=768,
        index_topk=256,
        n_routed_experts=16,
        num_experts_per_tok=4,
        # HF builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever the config says, vLLM
        # with config.rms_norm_eps: 1e-6 makes every norm identical in both (GLM-5 itself: 1e-5).
        rms_norm_eps=1e-06,
        max_position_embeddings=8192,
    )
    c["pad_token_id"] = vocab - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index("<|endoftext|>")
    c["eos_token_id"] = [
        vocab - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(t)
        for t in ("<|endoftext|>", "<|user|>", "<|observation|>")
    ]
    c["bos_token_id"] = None
    return c


def _micro_config() -> dict[str, Any]:
    c = _tiny_config()
    vocab = 512
    c.update(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        index_topk=16,
        index_n_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
    )
    c["pad_token_id"] = vocab - len(SPECIAL_TOKENS)
    c["eos_token_id"] = [
        vocab - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(t)
        for t in ("<|endoftext|>", "<|user|>", "<|observation|>")
    ]
    return c


def _glm5_6l_config() -> dict[str, Any]:
    c = copy.deepcopy(GLM5_CONFIG)
    c.update(num_hidden_layers=6, first_k_dense_replace=3)
    c["quantization_config"] = copy.deepcopy(GLM5_FP8_QUANT)
    return c


# What one rank of a TP8 GLM-5 holds under vLLM 0.26.0's defaults (enable_expert_parallel False:
# FusedMoE splits every expert's intermediate dimension over the TP ranks, it does not spread the
# experts; EP would give 32 whole experts per rank instead). Module by module (deepseek_v2.py):
#   split by TP (/8): q_b_proj, kv_b_proj (ColumnParallel over heads), o_proj (RowParallel over
#     heads) -> num_attention_heads 64 -> 8; the dense MLP (MergedColumnParallel gate_up +
#     RowParallel down) -> intermediate_size 12288 -> 1536; the routed experts (FusedMoE, TP) and
#     the shared expert (DeepseekV2MLP, TP) -> moe_intermediate_size 2048 -> 256 (all 256 experts
#     kept); VocabParallelEmbedding and ParallelLMHead -> vocab_size 154880 -> 19360;
#   replicated (unchanged): fused q_a/kv_a projection (q_lora 2048, kv_lora 512 + rope 64), the
#     indexer (wq_b ReplicatedLinear, wk+weights_proj disable_tp: 32 heads x 128, top-k 2048), the
#     router gate (256 x 6144), the norms, hidden_size 6144.
TP8_RANK_SCALED = {"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1536,
                   "moe_intermediate_size": 256, "vocab_size": 154880 // 8}


def _glm5_6l_tp8_config() -> dict[str, Any]:
    c = _glm5_6l_config()
    c.update(TP8_RANK_SCALED)
    # special ids inside the per-rank vocabulary (the engines run with ignore_eos, so only their
    # range matters: vLLM would reject or mis-index ids past vocab_size)
    V = c["vocab_size"]
    c["pad_token_id"] = V - 60
    c["eos_token_id"] = [V - 60, V - 53, V - 51]
    return c


PRESETS = {"tiny": _tiny_config, "micro": _micro_config, "glm5-6l": _glm5_6l_config,
           "glm5-6l-tp8": _glm5_6l_tp8_config}
CONFIG_ONLY_PRESETS = ("glm5-6l", "glm5-6l-tp8")

# Init gains. Every Linear weight is N(0, (gain / sqrt(fan_in))^2), so with unit-RMS inputs its
# outputs have RMS ~ gain; on top of that make_weights plants a sparse structure (salient tokens).
# Chosen on CPU (HF fp32 vs HF bf16 and vs fp8-KV emulation, prompts of 200 and 1024 tokens; the
# numbers are in docs/notes/e2e.md) so that
#  * the embedding dominates the residual stream (embed 4 vs attention outputs ~1-2): a random
#    network is chaotic otherwise (bf16 rounding alone flipped 27% of the top-1 tokens at gain 1);
#  * within what the layers add, attention dominates (o_proj 4 vs MLP/MoE 0.3), so KV-cache errors
#    reach the logits more than bf16 rounding elsewhere (fp8-KV KL ~2-4x the bf16 KL);
#  * salient keys carry 80-99% of the attention mass (mla_salient), so the fp8 indexer's near-tie
#    flips among ordinary tokens barely move the output, as in a trained DSA model;
#  * the logits are decisive (lm_head 10): median top-1 minus top-2 gap ~1.8 nats. Scaling the
#    logits does not change which positions flip (the gap and the error scale together); it makes
#    the runner-up mass small but the KL still measurable.
GAINS: dict[str, float] = {
    "embed": 4.0,          # token embedding entries ~ N(0, embed^2)
    "qk": 1.3,             # q_b_proj and the k_nope rows of kv_b_proj (q.k/16 std ~1.6)
    "v": 1.0,              # the v rows of kv_b_proj
    "o_proj": 4.0,
    "mlp_down": 0.3,       # dense MLP and shared expert down_proj
    "moe_down": 0.3,       # routed experts down_proj
    "router": 1.0,         # router logits (sigmoid scores)
    "e_bias": 0.05,        # e_score_correction_bias ~ N(0, e_bias^2)
    "lm_head": 10.0,       # logit std
    "norm_jitter": 0.1,    # every norm weight is 1 + N(0, jitter^2): a norm left at 1 is caught
    # planted sparse structure (make_weights): salient tokens, what the indexer and MLA see of them
    "salient_frac": 0.04,
    "mu_embed": 0.7,       # shared embedding component (relative to the random part's norm)
    "sal_embed": 0.7,      # salient tokens' extra component
    "idx_key": 2.0,        # indexer key: salient component vs random part (per-dim RMS units)
    "idx_query": 2.0,      # indexer query: constant component along the salient key direction
    "idx_weight": 3.0,     # indexer head weights: constant positive part (vs the random part's ~1)
    "lat_key": 1.0,        # MLA latent: salient component vs random part
    "mla_salient": 10.0,   # attention-logit bonus of a salient key at layer 0 (~5 by layer 2)
}


def build_config(preset: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = PRESETS[preset]()
    for k, v in (overrides or {}).items():
        if k not in cfg and k not in ("index_topk_freq", "index_skip_topk_offset"):
            raise ValueError(f"override {k!r} is not a config field of preset {preset!r}")
        cfg[k] = v
    validate_config(cfg)
    return cfg


def validate_config(cfg: dict[str, Any]) -> None:
    """The invariants the vLLM and HF GLM-5 models (and the kernels) rely on; raise on violation."""
    need = [
        "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads", "index_head_dim",
        "num_hidden_layers", "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok",
        "vocab_size",
    ]
    for k in need:
        if not isinstance(cfg.get(k), int) or cfg[k] <= 0:
            raise ValueError(f"config field {k} must be a positive int, got {cfg.get(k)!r}")
    if cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] != 576:
        raise ValueError("the sparse MLA kernels need a 576-wide latent (kv_lora 512 + rope 64)")
    if cfg["index_head_dim"] != 128 or cfg["qk_rope_head_dim"] != 64:
        raise ValueError("the DSA indexer path needs index_head_dim 128 and qk_rope_head_dim 64")
    if cfg["num_experts_per_tok"] > cfg["n_routed_experts"]:
        raise ValueError("num_experts_per_tok > n_routed_experts")
    if cfg["n_routed_experts"] % cfg.get("n_group", 1):
        raise ValueError("n_routed_experts must be a multiple of n_group")
    if not cfg.get("indexer_rope_interleave", False):
        raise ValueError("GLM-5 uses interleaved indexer RoPE (vLLM reads indexer_rope_interleave)")
    if cfg["rope_parameters"].get("rope_type") != "default":
        raise ValueError("these test models use plain RoPE (rope_type default), as GLM-5 does")
    if cfg["first_k_dense_replace"] > cfg["num_hidden_layers"]:
        raise ValueError("first_k_dense_replace > num_hidden_layers")


# ----------------------------------------------------------------------------------------------
# Checkpoint layout (vLLM 0.26.0 / real GLM-5 checkpoint names)
# ----------------------------------------------------------------------------------------------


def checkpoint_layout(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init kind) for every tensor of the checkpoint, in a fixed order.

    Init kinds: "embed", "norm", "bias" (LayerNorm bias), "e_bias", or "linear:<gain key>".
    """
    H = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    qk_nope, qk_rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    V = cfg["vocab_size"]
    E = cfg["n_routed_experts"]
    n_layers = cfg["num_hidden_layers"]
    n_mtp = cfg.get("num_nextn_predict_layers", 0) or 0
    out: list[tuple[str, tuple[int, ...], str]] = []
    out.append(("model.embed_tokens.weight", (V, H), "embed"))

    def decoder_layer(p: str, layer_idx: int) -> None:
        out.append((f"{p}.input_layernorm.weight", (H,), "norm"))
        out.append((f"{p}.post_attention_layernorm.weight", (H,), "norm"))
        a = f"{p}.self_attn"
        out.append((f"{a}.q_a_proj.weight", (q_lora, H), "linear:unit"))
        out.append((f"{a}.q_a_layernorm.weight", (q_lora,), "norm"))
        out.append((f"{a}.q_b_proj.weight", (nh * (qk_nope + qk_rope), q_lora), "linear:qk"))
        out.append((f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + qk_rope, H), "linear:unit"))
        out.append((f"{a}.kv_a_layernorm.weight", (kv_lora,), "norm"))
        out.append((f"{a}.kv_b_proj.weight", (nh * (qk_nope + v_dim), kv_lora), "kv_b"))
        out.append((f"{a}.o_proj.weight", (H, nh * v_dim), "linear:o_proj"))
        i = f"{a}.indexer"
        out.append((f"{i}.wq_b.weight", (ih * idim, q_lora), "linear:unit"))
        out.append((f"{i}.wk.weight", (idim, H), "linear:unit"))
        out.append((f"{i}.k_norm.weight", (idim,), "norm"))
        out.append((f"{i}.k_norm.bias", (idim,), "bias"))
        out.append((f"{i}.weights_proj.weight", (ih, H), "linear:unit"))
        m = f"{p}.mlp"
        if layer_idx < cfg["first_k_dense_replace"]:
            I = cfg["intermediate_size"]
            out.append((f"{m}.gate_proj.weight", (I, H), "linear:unit"))
            out.append((f"{m}.up_proj.weight", (I, H), "linear:unit"))
            out.append((f"{m}.down_proj.weight", (H, I), "linear:mlp_down"))
        else:
            I = cfg["moe_intermediate_size"]
            out.append((f"{m}.gate.weight", (E, H), "linear:router"))
            out.append((f"{m}.gate.e_score_correction_bias", (E,), "e_bias"))
            for e in range(E):
                out.append((f"{m}.experts.{e}.gate_proj.weight", (I, H), "linear:unit"))
                out.append((f"{m}.experts.{e}.up_proj.weight", (I, H), "linear:unit"))
                out.append((f"{m}.experts.{e}.down_proj.weight", (H, I), "linear:moe_down"))
            Is = I * cfg["n_shared_experts"]
            out.append((f"{m}.shared_experts.gate_proj.weight", (Is, H), "linear:unit"))
            out.append((f"{m}.shared_experts.up_proj.weight", (Is, H), "linear:unit"))
            out.append((f"{m}.shared_experts.down_proj.weight", (H, Is), "linear:mlp_down"))

    for li in range(n_layers):
        decoder_layer(f"model.layers.{li}", li)
    out.append(("model.norm.weight", (H,), "norm"))
    out.append(("lm_head.weight", (V, H), "linear:lm_head"))
    for k in range(n_mtp):
        li = n_layers + k
        p = f"model.layers.{li}"
        # DeepSeek-V3 / GLM-5 MTP layout: its own copy of the embedding and of the head (vLLM shares
        # the target's embedding and drops this copy; the head is loaded), enorm / hnorm / eh_proj,
        # and a full decoder layer (MoE, since li >= first_k_dense_replace).
        out.append((f"{p}.embed_tokens.weight", (V, H), "copy:model.embed_tokens.weight"))
        out.append((f"{p}.enorm.weight", (H,), "norm"))
        out.append((f"{p}.hnorm.weight", (H,), "norm"))
        out.append((f"{p}.eh_proj.weight", (H, 2 * H), "linear:unit"))
        decoder_layer(p, li)
        out.append((f"{p}.shared_head.norm.weight", (H,), "norm"))
        out.append((f"{p}.shared_head.head.weight", (V, H), "copy:lm_head.weight"))
    names = [n for n, _, _ in out]
    if len(names) != len(set(names)):
        raise AssertionError("duplicate checkpoint names")
    return out


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def salient_token_ids(cfg: dict[str, Any], seed: int, frac: float) -> list[int]:
    """The planted 'salient' tokens: a fixed random `frac` of the ordinary (non-special) vocabulary."""
    import torch

    n_plain = cfg["vocab_size"] - len(SPECIAL_TOKENS)
    n = int(round(frac * n_plain))
    gen = torch.Generator().manual_seed(_seed_for(seed, "salient"))
    return sorted(torch.randperm(n_plain, generator=gen)[:n].tolist())


def _unit(gen, n: int, orth=()):
    import torch

    v = torch.randn(n, generator=gen, dtype=torch.float64)
    for o in orth:
        v -= (v @ o) * o
    return v / v.norm()


def make_weights(cfg: dict[str, Any], seed: int = 0, gains: dict[str, float] | None = None):
    """bf16 CPU tensors for checkpoint_layout(cfg).

    Every tensor starts from its own seeded generator (its values depend only on seed, name, shape
    and gains). On top of that random model a sparse structure is planted, as a trained DSA model
    has one, so that the sparse top-k is decisive instead of a lottery among near-ties:

    * every token embedding gets a shared component along a fixed direction mu (all queries can
      then carry a constant "look for salient keys" component), and a fixed `salient_frac` of the
      vocabulary (the salient tokens) gets a component along a second direction u;
    * in each layer's indexer, u maps through wk into one key direction d and mu through q_a_proj /
      wq_b onto d in every indexer head, and mu through weights_proj into positive head weights:
      salient keys outscore the rest by a wide margin (`idx_salient`);
    * in each layer's MLA, u maps through kv_a_proj into one latent direction, and each head's query
      gets a constant component along that direction's image through the head's W_UK: salient keys
      get an attention-logit bonus of about `mla_salient`.

    With salient tokens ~4% of a random prompt, a 4096-token prompt holds ~164 of them, fewer than
    index_topk 256: the indexer selects all of them first, the remaining slots go to near-tied
    ordinary tokens whose attention weight is e^-mla_salient smaller, so the fp8 indexer's
    near-tie flips (which a trained model also has) barely move the output, while the MLA output
    still depends on the values of ~100+ tokens spread over the whole context (the paged gather).
    """
    import torch

    g = dict(GAINS)
    g.update(gains or {})
    g["unit"] = 1.0
    qk_nope, v_dim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    nh = cfg["num_attention_heads"]
    out: dict[str, torch.Tensor] = {}
    layout = checkpoint_layout(cfg)
    for name, shape, kind in layout:
        if kind.startswith("copy:"):
            continue
        gen = torch.Generator().manual_seed(_seed_for(seed, name))
        if kind == "embed":
            t = torch.randn(shape, generator=gen) * g["embed"]
        elif kind == "norm":
            t = 1.0 + torch.randn(shape, generator=gen) * g["norm_jitter"]
        elif kind == "bias":
            t = torch.randn(shape, generator=gen) * g["norm_jitter"]
        elif kind == "e_bias":
            t = torch.randn(shape, generator=gen) * g["e_bias"]
        elif kind == "kv_b":
            fan_in = shape[1]
            t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
            t = t.view(nh, qk_nope + v_dim, fan_in)
            t[:, :qk_nope] *= g["qk"]
            t[:, qk_nope:] *= g["v"]
            t = t.reshape(shape)
        elif kind.startswith("linear:"):
            fan_in = shape[1]
            t = torch.randn(shape, generator=gen) * (g[kind[7:]] / math.sqrt(fan_in))
        else:
            raise AssertionError(kind)
        out[name] = t.float()
    if g["salient_frac"] > 0:
        _plant_salience(out, cfg, seed, g)
    for name, shape, kind in layout:
        if kind.startswith("copy:"):
            out[name] = out[kind[5:]].clone()
    # everything is stored as bf16 (e_score_correction_bias is fp32 in vLLM and HF; its bf16 value
    # is exact in fp32)
    return {n: out[n].to(torch.bfloat16).contiguous() for n, _, _ in layout}


def _plant_salience(w: dict, cfg: dict[str, Any], seed: int, g: dict[str, float]) -> None:
    import torch

    H = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    qk_nope, kv_lora = cfg["qk_nope_head_dim"], cfg["kv_lora_rank"]
    ih, idim, rope = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    gen = torch.Generator().manual_seed(_seed_for(seed, "plant"))
    mu = _unit(gen, H)
    u = _unit(gen, H, (mu,))
    sal = salient_token_ids(cfg, seed, g["salient_frac"])
    E = w["model.embed_tokens.weight"].double()
    scale = g["embed"] * math.sqrt(H)  # norm of an embedding row's random part
    E += g["mu_embed"] * scale * mu[None, :]
    E[sal] += g["sal_embed"] * scale * u[None, :]
    w["model.embed_tokens.weight"] = E.float()
    # Unit-RMS input x = e / rms(e) of a salient token: its components along mu and u (layer 0; later
    # layers see the same directions through the residual stream, diluted by what layers add).
    denom = math.sqrt(1.0 + g["mu_embed"] ** 2 + g["sal_embed"] ** 2)
    x_mu = g["mu_embed"] * math.sqrt(H) / denom
    x_u = g["sal_embed"] * math.sqrt(H) / denom
    n_layers = cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers", 0) or 0)
    for li in range(n_layers):
        a = f"model.layers.{li}.self_attn"
        lg = torch.Generator().manual_seed(_seed_for(seed, f"plant:{li}"))
        # the constant query component: q_resid's direction r (q_a_layernorm(q_a_proj(x)) of mu)
        Wqa = w[f"{a}.q_a_proj.weight"].double()
        r = Wqa @ mu
        r = r / r.norm()
        # ---- indexer: key direction d (zero-mean so LayerNorm keeps it, in the non-rope dims)
        d = torch.zeros(idim, dtype=torch.float64)
        d[rope:] = _unit(lg, idim - rope)
        d[rope:] -= d[rope:].mean()
        d /= d.norm()
        wk = w[f"{a}.indexer.wk.weight"].double()
        # salient key: u-component of x times this gives a d-component ~ idx_key x the random part
        wk += (g["idx_key"] * math.sqrt(idim) / x_u) * d[:, None] * u[None, :]
        w[f"{a}.indexer.wk.weight"] = wk.float()
        wq = w[f"{a}.indexer.wq_b.weight"].double().view(ih, idim, -1)
        wq += (g["idx_query"] * math.sqrt(idim)) * d[None, :, None] * r[None, None, :] / 0.7
        w[f"{a}.indexer.wq_b.weight"] = wq.reshape(ih * idim, -1).float()
        wp = w[f"{a}.indexer.weights_proj.weight"].double()
        wp += (g["idx_weight"] / x_mu) * torch.ones(ih, 1, dtype=torch.float64) * mu[None, :]
        w[f"{a}.indexer.weights_proj.weight"] = wp.float()
        # ---- MLA: latent direction ell carries u; head h's query gets a constant component along
        # kappa_h = W_UK_h ell
        ell = _unit(lg, kv_lora)
        Wkva = w[f"{a}.kv_a_proj_with_mqa.weight"].double()
        Wkva[:kv_lora] += (g["lat_key"] * math.sqrt(kv_lora) / x_u) * ell[:, None] * u[None, :]
        w[f"{a}.kv_a_proj_with_mqa.weight"] = Wkva.float()
        # latent of a salient token after kv_a_layernorm: fraction f of its norm along ell
        f_lat = g["lat_key"] / math.sqrt(1.0 + g["lat_key"] ** 2)
        kvb = w[f"{a}.kv_b_proj.weight"].double().view(nh, qk_nope + cfg["v_head_dim"], kv_lora)
        qb = w[f"{a}.q_b_proj.weight"].double().view(nh, qk_nope + rope, -1)
        for h in range(nh):
            kappa = kvb[h, :qk_nope] @ ell  # k_nope of a salient token ~ f_lat * sqrt(kv_lora) * kappa
            k_sal = f_lat * math.sqrt(kv_lora) * kappa
            # q_resid ~ unit RMS with a fraction ~0.7 of its norm along r (measured): q_nope gets
            # c * r.q_resid along kappa-hat; bonus = q.k / sqrt(qk_head_dim)
            c = g["mla_salient"] * math.sqrt(qk_nope + rope) / (k_sal.norm() * 0.7 * math.sqrt(r.numel()))
            qb[h, :qk_nope] += c * (k_sal / k_sal.norm())[:, None] * r[None, :]
        w[f"{a}.q_b_proj.weight"] = qb.reshape(nh * (qk_nope + rope), -1).float()


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (what tokenizers' ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly `vocab_size` ids: 256 byte tokens, programmatic merges
    ("Ġx", "xy", then longer letter strings), the special tokens at the top. Deterministic, offline."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} < 256 bytes + {len(SPECIAL_TOKENS)} specials")
    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {b2u[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    space = b2u[ord(" ")]
    level = [space] + list(letters)
    while len(merges) < n_merges:
        nxt = []
        for a in level:
            for c in letters:
                if len(merges) >= n_merges:
                    break
                tok = a + c
                if tok in vocab:
                    continue
                merges.append((a, c))
                vocab[tok] = len(vocab)
                nxt.append(tok)
        if not nxt:
            raise AssertionError("merge generation stalled")
        level = nxt
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(
            f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, want {vocab_size}"
        )
    return tok


def write_tokenizer(out: pathlib.Path, cfg: dict[str, Any]) -> None:
    V = cfg["vocab_size"]
    tok = build_tokenizer(V)
    tok.save(str(out / "tokenizer.json"))
    eos = "<|endoftext|>"
    if tok.token_to_id(eos) != cfg["pad_token_id"]:
        raise AssertionError("pad/eos id of the config and the tokenizer disagree")
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": eos,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(s)): {
                "content": s, "special": True, "lstrip": False, "rstrip": False,
                "normalized": False, "single_word": False,
            }
            for s in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"],
                    "_from_model_config": True}, indent=1)
    )


# ----------------------------------------------------------------------------------------------
# Build
# ----------------------------------------------------------------------------------------------


def write_model(out: pathlib.Path, preset: str = "tiny", seed: int = 0,
                overrides: dict[str, Any] | None = None, gains: dict[str, float] | None = None,
                log=print) -> dict[str, Any]:
    """Write the model directory; returns the info dict (also written as e2e_model.json)."""
    t0 = time.time()
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(preset, overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    info: dict[str, Any] = {"preset": preset, "seed": seed, "overrides": overrides or {},
                            "gains": {**GAINS, **(gains or {})}, "config": cfg}
    if preset in CONFIG_ONLY_PRESETS:
        info["weights"] = None
        info["note"] = "config only: serve with load_format='dummy' and skip_tokenizer_init"
    else:
        import torch
        from safetensors.torch import save_file

        w = make_weights(cfg, seed, gains)
        n_params = sum(t.numel() for t in w.values())
        path = out / "model.safetensors"
        save_file(w, str(path), metadata={"format": "pt"})
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        info["weights"] = {"file": path.name, "tensors": len(w), "params": n_params,
                           "bytes": path.stat().st_size, "sha256": h.hexdigest()}
        write_tokenizer(out, cfg)
        del w
        _ = torch  # keep the import local
    info["build_s"] = round(time.time() - t0, 2)
    (out / "e2e_model.json").write_text(json.dumps(info, indent=1))
    log(f"[e2e_model] wrote {preset} model to {out} in {info['build_s']} s"
        + (f": {info['weights']['params'] / 1e6:.1f} M params" if info.get("weights") else ""))
    return info


def model_is_current(out: pathlib.Path, preset: str, seed: int,
                     overrides: dict[str, Any] | None = None,
                     gains: dict[str, float] | None = None) -> bool:
    """True when `out` holds a complete model built with these arguments (reuse instead of rebuild)."""
    p = pathlib.Path(out) / "e2e_model.json"
    if not p.exists():
        return False
    try:
        info = json.loads(p.read_text())
    except json.JSONDecodeError:
        return False
    want_cfg = build_config(preset, overrides)
    if (info.get("preset"), info.get("seed"), info.get("config")) != (preset, seed, want_cfg):
        return False
    if info.get("gains") != {**GAINS, **(gains or {})}:
        return False
    if preset not in CONFIG_ONLY_PRESETS:
        w = info.get("weights") or {}
        f = pathlib.Path(out) / "model.safetensors"
        if not f.exists() or f.stat().st_size != w.get("bytes"):
            return False
        if not (pathlib.Path(out) / "tokenizer.json").exists():
            return False
    return True


# ----------------------------------------------------------------------------------------------
# HF transformers side: loading, checks, reference
# ----------------------------------------------------------------------------------------------


def rope_reference(x, pos, theta: float, style: str):
    """Plain RoPE on the last dim of x [..., T, D] at positions pos [T]; style 'gptj' rotates the
    pairs (x[2i], x[2i+1]) (interleaved), 'neox' the pairs (x[i], x[i + D/2])."""
    import torch

    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    if style == "gptj":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return torch.stack([o1, o2], dim=-1).flatten(-2)
    if style == "neox":
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    raise ValueError(style)


def check_hf_rope_interleave(theta: float = 1e6, seed: int = 0) -> dict[str, Any]:
    """Does the installed transformers' glm_moe_dsa apply interleaved (GPT-J) RoPE in MLA and in the
    indexer? Source inspection of the forward methods, plus a numerical check: the RoPE function they
    call must give the GPT-J q.k dot products (the layout of its output may differ, the dot products
    of a query and a key rotated the same way may not) and not the NeoX ones."""
    import torch
    import transformers
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    res: dict[str, Any] = {"transformers": transformers.__version__}
    src_attn = inspect.getsource(m.GlmMoeDsaAttention.forward)
    src_idx = inspect.getsource(m.GlmMoeDsaIndexer.forward)
    res["mla_calls_interleave"] = "apply_rotary_pos_emb_interleave(" in src_attn
    res["indexer_calls_interleave"] = "apply_rotary_pos_emb_interleave(" in src_idx
    res["indexer_reads_config_flag"] = "indexer_rope_interleave" in src_idx
    g = torch.Generator().manual_seed(seed)
    T, D = 9, 64
    q = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64)
    pos = torch.arange(T) * 37 + 5
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = pos.to(torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    qh, kh = m.apply_rotary_pos_emb_interleave(q, k, emb.cos(), emb.sin())
    dots_hf = qh[0, 0] @ kh[0, 0].T
    gq, gk = rope_reference(q[0, 0], pos, theta, "gptj"), rope_reference(k[0, 0], pos, theta, "gptj")
    nq, nk = rope_reference(q[0, 0], pos, theta, "neox"), rope_reference(k[0, 0], pos, theta, "neox")
    res["max_abs_diff_vs_gptj"] = float((dots_hf - gq @ gk.T).abs().max())
    res["max_abs_diff_vs_neox"] = float((dots_hf - nq @ nk.T).abs().max())
    res["interleaved"] = bool(
        res["mla_calls_interleave"] and res["indexer_calls_interleave"]
        and res["max_abs_diff_vs_gptj"] < 1e-9 and res["max_abs_diff_vs_neox"] > 1e-3
    )
    return res


def load_hf(model_dir, device: str = "cpu", dtype: str = "float32", attn: str = "sdpa"):
    """transformers' GlmMoeDsaForCausalLM from the checkpoint, eval mode; returns (model, loading_info)."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    td = getattr(torch, dtype)
    model, info = GlmMoeDsaForCausalLM.from_pretrained(
        str(model_dir), dtype=td, output_loading_info=True, attn_implementation=attn
    )
    model.to(device).eval()
    return model, info


def check_hf_checkpoint(model_dir, model=None, info=None) -> dict[str, Any]:
    """Every HF parameter/buffer equals its checkpoint tensor(s); nothing missing; only MTP tensors
    unused. Returns a report with "ok"."""
    import torch
    from safetensors.torch import load_file

    model_dir = pathlib.Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    if model is None:
        model, info = load_hf(model_dir, "cpu", "float32")
    ckpt = load_file(str(model_dir / "model.safetensors"))
    n_layers = cfg["num_hidden_layers"]
    mtp_prefixes = tuple(f"model.layers.{n_layers + k}." for k in range(cfg.get("num_nextn_predict_layers", 0)))
    rep: dict[str, Any] = {
        "missing_keys": sorted(info.get("missing_keys", [])) if info else None,
        "mismatched_keys": [str(x) for x in info.get("mismatched_keys", [])] if info else None,
        "unexpected_non_mtp": sorted(k for k in (info.get("unexpected_keys", []) if info else [])
                                     if not k.startswith(mtp_prefixes)),
    }
    used: set[str] = set()
    bad: list[str] = []
    sd = model.state_dict()
    for name, t in sd.items():
        if name.endswith("rotary_emb.inv_freq") or name.endswith("original_inv_freq"):
            continue
        t = t.detach().float().cpu()
        if ".mlp.experts.gate_up_proj" in name:
            p = name.replace(".experts.gate_up_proj", ".experts")
            ref = torch.stack([
                torch.cat([ckpt[f"{p}.{e}.gate_proj.weight"], ckpt[f"{p}.{e}.up_proj.weight"]], 0)
                for e in range(t.shape[0])
            ]).float()
            used.update(f"{p}.{e}.{w}_proj.weight" for e in range(t.shape[0]) for w in ("gate", "up"))
        elif ".mlp.experts.down_proj" in name:
            p = name.replace(".experts.down_proj", ".experts")
            ref = torch.stack([ckpt[f"{p}.{e}.down_proj.weight"] for e in range(t.shape[0])]).float()
            used.update(f"{p}.{e}.down_proj.weight" for e in range(t.shape[0]))
        elif name in ckpt:
            ref = ckpt[name].float()
            used.add(name)
        else:
            bad.append(f"{name}: not in the checkpoint")
            continue
        if tuple(ref.shape) != tuple(t.shape) or not torch.equal(ref, t):
            bad.append(f"{name}: value differs from the checkpoint")
    unused = sorted(set(ckpt) - used)
    rep["hf_tensors_checked"] = len(sd)
    rep["checkpoint_tensors"] = len(ckpt)
    rep["unused_non_mtp"] = [k for k in unused if not k.startswith(mtp_prefixes)]
    rep["unused_mtp"] = sum(1 for k in unused if k.startswith(mtp_prefixes))
    rep["problems"] = bad
    rep["ok"] = bool(not bad and not rep["unused_non_mtp"] and not rep["missing_keys"]
                     and not rep["unexpected_non_mtp"] and not rep["mismatched_keys"])
    return rep


def hf_logprobs(model, ids, device=None):
    """Teacher-forced log-probs [len(ids) - 1, vocab] (float32): row i is the distribution of token
    i + 1 given ids[: i + 1], the rows vLLM's prompt_logprobs returns."""
    import torch

    device = device or next(model.parameters()).device
    x = torch.as_tensor(ids, dtype=torch.long, device=device)[None]
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def hf_greedy(model, ids, n_new: int, device=None):
    """Greedy continuation by full recomputation (no KV cache in the reference path); returns the new
    token ids and, per step, the top-1 minus top-2 logit gap."""
    import torch

    device = device or next(model.parameters()).device
    seq = list(int(t) for t in ids)
    new, gaps = [], []
    with torch.no_grad():
        for _ in range(n_new):
            x = torch.as_tensor(seq, dtype=torch.long, device=device)[None]
            logits = model(input_ids=x, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            nxt = int(top2.indices[0])
            new.append(nxt)
            gaps.append(float(top2.values[0] - top2.values[1]))
            seq.append(nxt)
    return new, gaps


def _parse_kv(items: list[str]) -> dict[str, Any]:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"expected key=value, got {it!r}")
        k, v = it.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument("--gain", nargs="*", default=[], metavar="KEY=VALUE", help="init gain overrides")
    ap.add_argument("--reuse", action="store_true", help="keep an existing model built with the same arguments")
    ap.add_argument("--check-hf", action="store_true", help="verify the checkpoint against transformers")
    a = ap.parse_args(argv)
    overrides, gains = _parse_kv(a.set), {k: float(v) for k, v in _parse_kv(a.gain).items()}
    for k in gains:
        if k not in GAINS:
            raise SystemExit(f"unknown gain {k!r}; known: {sorted(GAINS)}")
    if a.reuse and model_is_current(a.out, a.preset, a.seed, overrides, gains):
        print(f"[e2e_model] reusing {a.out}")
    else:
        write_model(a.out, a.preset, a.seed, overrides, gains)
    rc = 0
    if a.check_hf:
        if a.preset in CONFIG_ONLY_PRESETS:
            raise SystemExit("--check-hf needs weights (preset tiny or micro)")
        rope = check_hf_rope_interleave()
        print("[e2e_model] HF RoPE:", json.dumps(rope))
        rep = check_hf_checkpoint(a.out)
        print("[e2e_model] HF checkpoint check:", json.dumps(rep, indent=1))
        if not (rep["ok"] and rope["interleaved"]):
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())

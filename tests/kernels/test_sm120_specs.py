# SPDX-License-Identifier: Apache-2.0
"""The SM120 compile specs of the indexer and top-k kernels are generated from their dispatch
(``paged_logits_config``, ``topk_config`` and the launch plans), not written by hand: every
configuration the dispatch picks for inputs inside the supported domain, also for inputs between
the enumeration's grid points, is one of the specs (tests/kernels/test_sm120_compile.py then
compiles each spec for sm_120 / sm_121). CPU only, no compile."""

from __future__ import annotations

import os
import random
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "kernels"))

import triton  # noqa: E402
import triton_dsa_indexer as I  # noqa: E402
import triton_dsa_topk as T  # noqa: E402


def _key(consts, drop=()):
    return tuple(sorted((k, v) for k, v in consts.items() if k not in drop))


def test_topk_specs_cover_every_launch():
    specs = T.SM120_COMPILE_SPECS()
    have = {(s["fn"].__name__, _key(s["constexprs"], ("MODE",)), s["num_warps"]) for s in specs}
    modes = {}
    for s in specs:
        modes.setdefault(s["fn"].__name__, set()).add(s["constexprs"]["MODE"])
        params = {a for a, t in s["signature"].items() if t == "constexpr"}
        assert params == set(s["constexprs"]), s["name"]
        assert params == {a for a in s["fn"].arg_names if a in params}  # names the kernel has
    want = {"_topk_segment_kernel": {0, 1, 2}, "_topk_merge_kernel": {0, 1, 2}, "_topk_short_kernel": {0, 1, 2}}
    if T.COOP:  # the cooperative select, where the dispatch picks it
        want["_topk_coop_kernel"] = {0, 1, 2}
    assert modes == want
    rng = random.Random(0)
    coops = 0
    for _ in range(3000):  # inputs between (and beyond) the enumeration's grid points
        k = rng.choice(T.SPEC_K)
        L = rng.choice([rng.randint(1, 1 << 21), rng.randint(1, 70000), rng.randint(4000, 9000)])
        rows = rng.choice([rng.randint(1, 70000), rng.randint(1, 100)])
        sms = rng.choice(T.SPEC_SMS)
        cfg = T.topk_config(k, L, rows, sms, arch_major=12)
        nw, mw = cfg.pop("num_warps"), cfg.pop("merge_warps")
        coop = T.call_coop(cfg, k, L, rows, sms)
        coops += coop is not None
        for mode in (0, 1, 2):  # the cooperative launch, and the plan a refused one falls back to
            plan = T._launch_plan(cfg, k, mode, L, nw, mw)
            if coop is not None:
                plan = [T.coop_launch(k, mode, cfg, coop)] + plan
            for kern, consts, w in plan:
                key = (kern.__name__, _key(consts, ("MODE",)), w)
                assert key in have, f"launch not among the SM120 specs: k={k} L={L} rows={rows} sms={sms}: {key}"
    assert coops > 0 or not T.COOP


def test_topk_specs_grow_with_the_dispatch():
    """A dispatch that picks one more configuration (here: k = 4096: CAP 8192, 16 warps, and the
    short-row kernel's K = 4096) is not covered by the specs of the default inputs but is by the
    specs enumerated with it."""
    base = {(_key(c), w) for _, c, w in T.dispatch_launches()}
    more = {(_key(c), w) for _, c, w in T.dispatch_launches(ks=T.SPEC_K + (4096,))}
    assert more - base
    assert all(dict(c)["CAP"] == 8192 if "CAP" in dict(c) else dict(c)["K"] == 4096 for c, _ in more - base)


def test_paged_logits_specs_cover_every_dispatch_choice():
    specs = [s for s in I.SM120_COMPILE_SPECS() if s["fn"] is I._paged_logits_kernel]
    have = {}
    for s in specs:
        c = s["constexprs"]
        assert "PROGS" not in c, "PROGS is the grid size, not a compile-time constant"
        assert c["NN_P"] == triton.next_power_of_2(c["NEXT_N"])
        key = (c["H"], c["NEXT_N"], c["BLOCK_N"], c["NUM_STAGES"], s["num_warps"])
        have.setdefault(key, set()).add((c["CLEAN"], c["CTX_2D"]))
    # every configuration with every caller flag pair (clean_logits, 2-D context lengths)
    assert all(f == {(False, False), (False, True), (True, False), (True, True)} for f in have.values())
    rng = random.Random(1)
    for _ in range(3000):
        H = rng.choice(I.SPEC_HEADS)
        nn_ = rng.choice(I.SPEC_NEXT_N)
        B = rng.randint(1, 5000)
        L = rng.randint(1, 1 << 20)
        sms = rng.choice(I.SPEC_SMS)
        cfg = I.paged_logits_config(B, nn_, L, sms, heads=H)
        assert 1 <= cfg["PROGS"] <= max(1, -(-L // cfg["BLOCK_N"]))
        key = (H, nn_, cfg["BLOCK_N"], cfg["NUM_STAGES"], cfg["num_warps"])
        assert key in have, f"paged logits config not among the SM120 specs: H={H} next_n={nn_} B={B} L={L}: {key}"


def test_ragged_and_cache_specs_cover_the_dispatch():
    specs = I.SM120_COMPILE_SPECS()
    ragged = {(s["constexprs"]["H"], s["constexprs"]["BLOCK_Q"], s["constexprs"]["CLEAN"]) for s in specs
              if s["fn"] is I._ragged_logits_kernel}
    assert ragged == {(H, 128 // H, c) for H in I.SPEC_HEADS for c in (False, True)}
    kc = {(s["signature"]["k_ptr"], s["constexprs"]["USE_UE8M0"]) for s in specs
          if s["fn"] is I._indexer_k_quant_cache_kernel}
    assert kc == {(t, u) for t in ("*bf16", "*fp16") for u in (False, True)}

# SPDX-License-Identifier: Apache-2.0
"""Exact per-row top-k (decode, prefill, persistent_topk entry) against the documented reference
(value descending, position ascending) and ``torch.topk``. CPU: interpreter with small constexprs
that exercise every path (short rows, pivot window, fallback, all-tied rows); GPU: k = 2048 at
contexts up to 300k."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

# --- interpreter setup: the shared module (also what tests/kernels/conftest.py imports) ----------
import os  # noqa: E402
import sys  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "kernels"))
from tests.triton_interpreter import _HAS_CUDA as HAS_CUDA, DEVICE, INTERPRET  # noqa: E402
# ------------------------------------------------------------------------------------------------

import triton_dsa_topk as T  # noqa: E402
from tests.kernels.fake_compiled import FakeJit, launcher_args  # noqa: E402

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU (not the interpreter)")

# small constexprs for the interpreter: rows > CAP take the pivot-sample path (the radix path:
# SHORT=False, else every call here, max_seq_len <= SHORT_MAX, would take the short-row kernel)
SMALL = dict(S=64, CAP=128, CHUNK=64, RCHUNK=32, ZSIGMA=4.5, KFILL=16, SPLIT=1, GCHUNK=32, num_warps=4, SHORT=False)
K_SMALL = 16


def _rows(kind: str, rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "randn":
        return torch.randn(rows, n, generator=g)
    if kind == "ties":  # tiny alphabet: massive ties at the k-th value
        return torch.randint(0, 4, (rows, n), generator=g).float()
    if kind == "zeros":
        return torch.zeros(rows, n)
    if kind == "increasing":  # recency-like: the top-k is the tail
        return torch.arange(n).float().repeat(rows, 1)
    if kind == "spikes":  # a block of huge values plus noise
        x = torch.randn(rows, n, generator=g)
        x[:, ::7] = 1000.0
        return x
    if kind == "negative":
        return -torch.rand(rows, n, generator=g) - 1.0
    if kind == "dups":  # repeated tokens: identical logits at many positions
        base = torch.randn(rows, 37, generator=g)
        return base.repeat(1, (n + 36) // 37)[:, :n].contiguous()
    raise ValueError(kind)


def _check(out, ref):
    got = T.canonical(out)
    assert torch.equal(got, ref), _first_diff(got, ref)


def _first_diff(got, ref):
    for r in range(got.shape[0]):
        if not torch.equal(got[r], ref[r]):
            return f"row {r}: got {got[r].tolist()[:24]} ref {ref[r].tolist()[:24]}"
    return "?"


@pytest.mark.parametrize("kind", ["randn", "ties", "zeros", "increasing", "spikes", "negative", "dups"])
def test_persistent_topk_small(kind):
    g = torch.Generator().manual_seed(sum(map(ord, kind)))  # stable across processes (not hash())
    n = 700
    lg = _rows(kind, 7, n, g)
    lens = torch.tensor([0, 5, K_SMALL, K_SMALL + 1, 100, 500, 700], dtype=torch.int32)
    out = torch.full((7, K_SMALL), -7, dtype=torch.int32, device=DEVICE)  # poison
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, K_SMALL, n, **SMALL)
    _check(out, T.persistent_topk_reference(lg, lens, K_SMALL))


def test_fallback_paths_are_exact():
    """A window that misses (negative ZSIGMA) forces the multisection fallback on every long row."""
    g = torch.Generator().manual_seed(0)
    for kind in ("randn", "ties", "spikes", "negative"):
        lg = _rows(kind, 4, 900, g)
        lens = torch.tensor([300, 600, 899, 900], dtype=torch.int32)
        for z in (-30.0, 60.0):  # window above / far too wide
            out = torch.full((4, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
            T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, K_SMALL, 900, **dict(SMALL, ZSIGMA=z))
            _check(out, T.persistent_topk_reference(lg, lens, K_SMALL))


def test_matches_torch_topk_on_distinct_values():
    g = torch.Generator().manual_seed(1)
    lg = torch.randn(5, 600, generator=g)
    lens = torch.tensor([600, 599, 300, 129, 17], dtype=torch.int32)
    out = torch.empty(5, K_SMALL, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, K_SMALL, 600, **SMALL)
    got = T.canonical(out)
    for r in range(5):
        tt = torch.topk(lg[r, : lens[r]], K_SMALL).indices
        assert torch.equal(got[r], torch.sort(tt.int()).values)


def test_ties_value_multiset_equals_torch_topk_and_lowest_index_wins():
    lg = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 3.0, 3.0] * 40])
    k = 4
    out = torch.empty(1, k, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), torch.tensor([320], dtype=torch.int32, device=DEVICE), out, None, k, 320,
                      **dict(SMALL, KFILL=4))
    got = T.canonical(out)[0]
    assert got.tolist() == [1, 2, 4, 6]  # the four lowest positions holding the max 3.0
    assert torch.equal(torch.sort(lg[0][got.long()]).values, torch.sort(torch.topk(lg[0], k).values).values)


@pytest.mark.parametrize("next_n", [1, 2, 3])
def test_decode_1d_seq_lens(next_n):
    g = torch.Generator().manual_seed(2)
    B = 3
    lg = torch.randn(B * next_n, 400, generator=g)
    seq = torch.tensor([2, 150, 400], dtype=torch.int32)
    out = torch.full((B * next_n, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
    T.top_k_per_row_decode(lg.to(DEVICE), next_n, seq.to(DEVICE), out, B * next_n, lg.stride(0), 1, K_SMALL, **SMALL)
    _check(out, T.top_k_per_row_decode_reference(lg, next_n, seq, K_SMALL))


def test_decode_2d_seq_lens_and_strided_logits():
    g = torch.Generator().manual_seed(3)
    B, nn_ = 2, 2
    big = torch.randn(B * nn_, 2 * 512, generator=g)
    lg = big[:, :512]  # row stride 1024
    seq = torch.tensor([[200, 201], [511, 512]], dtype=torch.int32)
    out = torch.full((B * nn_, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
    T.top_k_per_row_decode(big.to(DEVICE), nn_, seq.to(DEVICE), out, B * nn_, big.stride(0), 1, K_SMALL, **SMALL)
    _check(out, T.top_k_per_row_decode_reference(lg, nn_, seq, K_SMALL))


def test_prefill_rows_relative_to_start():
    g = torch.Generator().manual_seed(4)
    M, N = 6, 800
    lg = torch.randn(M, N, generator=g)
    ks = torch.tensor([0, 0, 0, 300, 300, 790], dtype=torch.int32)
    ke = torch.tensor([1, 20, 300, 301, 800, 800], dtype=torch.int32)
    out = torch.full((M, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
    T.top_k_per_row_prefill(lg.to(DEVICE), ks.to(DEVICE), ke.to(DEVICE), out, M, lg.stride(0), 1, K_SMALL, **SMALL)
    _check(out, T.top_k_per_row_prefill_reference(lg, ks, ke, K_SMALL))


def test_bad_input_raises():
    lg = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(TypeError):
        T.persistent_topk(lg.double(), torch.ones(2, dtype=torch.int32, device=DEVICE),
                          torch.empty(2, 8, dtype=torch.int32, device=DEVICE), None, 8, 64)
    with pytest.raises(ValueError):
        T.persistent_topk(lg, torch.ones(3, dtype=torch.int32, device=DEVICE),
                          torch.empty(2, 8, dtype=torch.int32, device=DEVICE), None, 8, 64)
    with pytest.raises(TypeError):
        T.persistent_topk(lg, torch.ones(2, dtype=torch.int64, device=DEVICE),
                          torch.empty(2, 8, dtype=torch.int32, device=DEVICE), None, 8, 64)


# ------------------------------------------------------------------------------------------------
# GPU: the real configuration (k = 2048, rows up to 300k)
# ------------------------------------------------------------------------------------------------


def _ref_gpu(lg, lens, k):
    """Reference on the GPU: stable sort (value desc, position asc), first k, sorted by position."""
    out = torch.full((lg.shape[0], k), -1, dtype=torch.int32)
    for r in range(lg.shape[0]):
        L = int(lens[r])
        if L <= k:
            out[r, :max(L, 0)] = torch.arange(max(L, 0), dtype=torch.int32)
            continue
        order = torch.sort(lg[r, :L], descending=True, stable=True).indices[:k]
        out[r] = torch.sort(order).values.int().cpu()
    return out


@gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["randn", "increasing", "dups", "ties"])
@pytest.mark.parametrize("width", [4096, 32768, 131072, 300000])
def test_gpu_persistent_topk_k2048(kind, width):
    g = torch.Generator().manual_seed(width)
    rows = 6
    lg = _rows(kind, rows, width, g).cuda()
    lens = torch.tensor([1, 2048, 2049, width // 3, width - 1, width], dtype=torch.int32, device="cuda")
    out = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
    T.persistent_topk(lg, lens, out, None, 2048, width)
    ref = _ref_gpu(lg, lens, 2048)
    got = T.canonical(out)
    assert torch.equal(got, ref), _first_diff(got, ref)
    if kind == "randn":  # distinct values: identical sets to torch.topk
        for r in range(rows):
            L = int(lens[r])
            if L > 2048:
                tt = torch.sort(torch.topk(lg[r, :L], 2048).indices).values.int().cpu()
                assert torch.equal(got[r], tt)
    # the register merge of long rows (MERGE_REGS, off by default until timed) writes the same
    # output in the same order, with the split the dispatch picks for 6 rows and with one program
    for over in ({"MERGE_REGS": True}, {"MERGE_REGS": True, "SPLIT": 1}):
        other = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
        T.persistent_topk(lg, lens, other, None, 2048, width, **over)
        base = out
        if "SPLIT" in over:
            base = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
            T.persistent_topk(lg, lens, base, None, 2048, width, SPLIT=1)
        assert torch.equal(other, base), over
    # the pivot window's sample select variants: SAMPLE_JOINT computes the same window as two
    # selects (same output, same order), other SAMPLE_BITS another window (same set)
    for over in ({"SAMPLE_JOINT": False}, {"SAMPLE_JOINT": False, "SAMPLE_BITS": 20},
                 {"SAMPLE_BITS": 20}, {"SAMPLE_BITS": 12}, {"merge_warps": 8}, {"MERGE_BISECT": True}):
        other = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
        T.persistent_topk(lg, lens, other, None, 2048, width, **over)
        if over.get("SAMPLE_BITS", T.SAMPLE_BITS) != T.SAMPLE_BITS:
            assert torch.equal(T.canonical(other), got), over
        else:
            assert torch.equal(other, out), over


@gpu
@needs_gpu
def test_gpu_decode_and_prefill_entries():
    g = torch.Generator().manual_seed(9)
    B, nn_, W = 8, 2, 40000
    lg = torch.randn(B * nn_, W, generator=g).cuda()
    seq = torch.randint(1, W + 1, (B,), generator=g, dtype=torch.int32).cuda()
    seq[0] = W
    out = torch.empty(B * nn_, 2048, dtype=torch.int32, device="cuda")
    T.top_k_per_row_decode(lg, nn_, seq, out, B * nn_, lg.stride(0), 1, 2048)
    r = torch.arange(B * nn_)
    lens = (seq.cpu().long()[r // nn_] - nn_ + (r % nn_) + 1).clamp(min=0)
    assert torch.equal(T.canonical(out), _ref_gpu(lg, lens, 2048))
    ks = torch.randint(0, 1000, (B * nn_,), generator=g, dtype=torch.int32).cuda()
    ke = (ks + torch.randint(0, W - 1000, (B * nn_,), generator=g, dtype=torch.int32).cuda())
    out2 = torch.empty(B * nn_, 2048, dtype=torch.int32, device="cuda")
    T.top_k_per_row_prefill(lg, ks, ke, out2, B * nn_, lg.stride(0), 1, 2048)
    assert torch.equal(T.canonical(out2), T.top_k_per_row_prefill_reference(lg.cpu(), ks.cpu(), ke.cpu(), 2048))


@gpu
@needs_gpu
def test_gpu_cuda_graph_capture():
    lg = torch.randn(4, 50000, device="cuda")
    lens = torch.tensor([50000, 3000, 10, 40000], dtype=torch.int32, device="cuda")
    out = torch.empty(4, 2048, dtype=torch.int32, device="cuda")
    cfg = T.topk_config(2048, 50000, 4, torch.cuda.get_device_properties(0).multi_processor_count)
    scratch = torch.empty(T._scratch_layout(4, 2048, cfg["CAP"], cfg["SPLIT"])["total"], dtype=torch.int32,
                          device="cuda")
    T.persistent_topk(lg, lens, out, scratch, 2048, 50000)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        T.persistent_topk(lg, lens, out, scratch, 2048, 50000)
    lg.copy_(torch.randn_like(lg))
    lens.copy_(torch.tensor([20000, 49999, 2049, 1], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(T.canonical(out), _ref_gpu(lg, lens, 2048))


@pytest.mark.parametrize("kind", ["randn", "ties", "spikes"])
def test_split_rows_match_single_program(kind):
    """SPLIT > 1 (several programs per row, merged in position order) gives the same output, in the
    same order, as one program per row."""
    g = torch.Generator().manual_seed(17)
    lg = _rows(kind, 4, 600, g)
    lens = torch.tensor([10, 300, 599, 600], dtype=torch.int32)
    outs = []
    for split in (1, 3):
        out = torch.full((4, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
        T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, K_SMALL, 600, **dict(SMALL, SPLIT=split))
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    _check(outs[1], T.persistent_topk_reference(lg, lens, K_SMALL))
    z = torch.full((4, K_SMALL), -7, dtype=torch.int32, device=DEVICE)  # forced fallback with split
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), z, None, K_SMALL, 600, **dict(SMALL, SPLIT=3, ZSIGMA=-30.0))
    _check(z, T.persistent_topk_reference(lg, lens, K_SMALL))


@pytest.mark.parametrize("kind", ["randn", "ties", "spikes", "negative", "dups", "increasing"])
@pytest.mark.parametrize("split", [1, 2, 3, 4])
def test_register_merge_writes_the_concatenating_merges_output(kind, split):
    """MERGE_REGS (the long rows' windows selected in registers straight from the segments) writes
    the same output, in the same order, as the concatenating merge, with its SEGCAP lanes per
    segment wide enough, with a SEGCAP so small that segments overflow it (those rows take the
    concatenating path), and when the window misses (the exact fallback)."""
    g = torch.Generator().manual_seed(23 + split)
    lg = _rows(kind, 5, 600, g)
    lens = torch.tensor([10, 300, 599, 600, 129], dtype=torch.int32)
    ref = T.persistent_topk_reference(lg, lens, K_SMALL)
    for extra in ({}, {"ZSIGMA": -30.0}):
        cfg = dict(SMALL, SPLIT=split, **extra)
        base = torch.full((5, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
        T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), base, None, K_SMALL, 600, **cfg)
        _check(base, ref)
        for segcap in (None, 4):
            over = dict(cfg, MERGE_REGS=True, **({"SEGCAP": segcap} if segcap else {}))
            out = torch.full((5, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
            T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, K_SMALL, 600, **over)
            assert torch.equal(out.cpu(), base.cpu()), (kind, split, extra, segcap)
    dispatch = T.topk_config(2048, 32768, 16, 132)
    plan = T._launch_plan(dispatch, 2048, 2, 32768, 8, 16)
    assert plan[-1][1]["MERGE_REGS"] == int(T.MERGE_REGS)
    assert plan[-1][1]["SEGCAP"] == T.merge_segcap(4096, dispatch["SPLIT"])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", ["randn", "ties", "spikes", "negative", "dups", "increasing"])
@pytest.mark.parametrize("split", [1, 3])
def test_bisect_merge_writes_the_radix_merges_output(kind, split, bits):
    """MERGE_BISECT (the long rows' window resolved by the register bisection on keys relative to
    the window's low end) writes the same output, in the same order, as the radix resolve: with the
    sampled window, when the window misses (the exact fallback, ZSIGMA -30) and with both digit
    widths (the bisection's top bit follows BITS x passes)."""
    g = torch.Generator().manual_seed(31 + split + bits)
    lg = _rows(kind, 5, 600, g)
    lens = torch.tensor([10, 300, 599, 600, 129], dtype=torch.int32)
    ref = T.persistent_topk_reference(lg, lens, K_SMALL)
    for extra in ({}, {"ZSIGMA": -30.0}):
        cfg = dict(SMALL, SPLIT=split, BITS=bits, **extra)
        outs = {}
        for bisect in (False, True):
            out = torch.full((5, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
            T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, K_SMALL, 600, **cfg, MERGE_BISECT=bisect)
            outs[bisect] = out.cpu()
        _check(outs[False], ref)
        assert torch.equal(outs[True], outs[False]), (kind, split, bits, extra)
    plan = T._launch_plan(T.topk_config(2048, 32768, 16, 132), 2048, 2, 32768, 8, 16)
    assert plan[-1][1]["MERGE_BISECT"] == int(T.MERGE_BISECT)


@pytest.mark.parametrize("split", [1, 2])
def test_register_merge_when_the_window_is_exactly_the_rest(split):
    """A row built so that the pivot window's low end is the k-th largest value: the window holds
    exactly the K - n_gt elements still needed and is taken whole (no selection step)."""
    L, S, k = 600, SMALL["S"], K_SMALL
    e = S * k / L
    r_lo = math.ceil(e + SMALL["ZSIGMA"] * math.sqrt(e * (1 - k / L)) + 2.0)  # the kernel's low rank
    samples = [(j * L) // S for j in range(S)]
    row = -torch.rand(L, generator=torch.Generator().manual_seed(5))  # everything else in (-1, 0]
    top = [p for p in range(L) if p not in samples][: k - (r_lo + 1)] + samples[: r_lo + 1]
    for rank, p in enumerate(top):  # distinct in their leading 20 bits
        row[p] = 1000.0 - 4 * rank
    lg = row[None, :].repeat(2, 1)
    lens = torch.tensor([L, L], dtype=torch.int32)
    cfg = dict(SMALL, SPLIT=split)
    base = torch.full((2, k), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), base, None, k, L, **cfg)
    _check(base, T.persistent_topk_reference(lg, lens, k))
    out = torch.full((2, k), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, L, **dict(cfg, MERGE_REGS=True))
    assert torch.equal(out.cpu(), base.cpu())


@pytest.mark.parametrize("split", [1, 2, 4])
def test_register_merge_with_elements_above_the_window(split):
    """k = 64 with a narrow margin: the pivot window has a finite upper end, so the segments hold
    elements above it (their lists go to the front at each segment's offset) and some rows miss the
    window (fallback): the register merge writes what the concatenating merge writes."""
    g = torch.Generator().manual_seed(31 + split)
    k = 64
    lg = _rows("randn", 6, 600, g)
    lens = torch.tensor([300, 599, 600, 450, 129, 64], dtype=torch.int32)
    cfg = dict(SMALL, SPLIT=split, ZSIGMA=1.0, KFILL=64)
    base = torch.full((6, k), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), base, None, k, 600, **cfg)
    _check(base, T.persistent_topk_reference(lg, lens, k))
    out = torch.full((6, k), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, 600, **dict(cfg, MERGE_REGS=True))
    assert torch.equal(out.cpu(), base.cpu())


@pytest.mark.parametrize("bits", [4, 8])
def test_joint_sample_select_gives_the_same_window(bits):
    """SAMPLE_JOINT (one histogram per pass while the pivot sample's two ranks share their digits,
    two after they part) computes the same window as the two separate selects, at every SPLIT
    program; fewer SAMPLE_BITS widen it (hi up, lo down) and the top-k stays the same."""
    g = torch.Generator().manual_seed(5 + bits)
    lens = torch.tensor([0, 100, 129, 300, 599, 600], dtype=torch.int32)
    cfg = dict(SMALL, BITS=bits, SPLIT=2)
    for kind in ("randn", "ties", "spikes", "negative", "increasing"):
        lg = _rows(kind, 6, 600, g)
        wins, outs = {}, {}
        for name, over in (("two", {"SAMPLE_JOINT": False, "SAMPLE_BITS": 20}),
                           ("joint", {"SAMPLE_JOINT": True, "SAMPLE_BITS": 20}),
                           ("joint12", {"SAMPLE_JOINT": True, "SAMPLE_BITS": 12})):
            lay = T._scratch_layout(6, K_SMALL, cfg["CAP"], cfg["SPLIT"])
            scratch = torch.zeros(lay["total"], dtype=torch.int32, device=DEVICE)
            out = torch.full((6, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
            T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, scratch, K_SMALL, 600, **dict(cfg, **over))
            o, n = lay["win"]
            wins[name] = scratch[o:o + n].view(6, 2).cpu()[lens > cfg["CAP"]]
            outs[name] = out.cpu()
        assert torch.equal(wins["joint"], wins["two"]), (kind, wins)
        assert bool((wins["joint12"][:, 0] <= wins["two"][:, 0]).all()), kind  # lo rounds down
        assert bool((wins["joint12"][:, 1] >= wins["two"][:, 1]).all()), kind  # hi rounds up
        # the same window writes the same output in the same order; a wider one the same set (the
        # order inside a row is: above the window, then the window's selection)
        assert torch.equal(outs["joint"], outs["two"]), kind
        ref = T.persistent_topk_reference(lg, lens, K_SMALL)
        _check(outs["two"], ref)
        _check(outs["joint12"], ref)


@pytest.mark.parametrize("bits", [4, 8])
def test_digit_widths_are_exact(bits):
    """Both radix digit widths (BITS 4: 8 passes / 5 sampled, 8: 4 / 3) give the documented top-k on
    short rows (full 32-bit select), long rows (sampled window + resolve of the window's varying
    bits) and the forced fallback."""
    g = torch.Generator().manual_seed(23 + bits)
    lens = torch.tensor([0, 9, 100, 128, 129, 400, 700], dtype=torch.int32)
    for kind in ("randn", "ties", "spikes", "negative"):
        lg = _rows(kind, 7, 700, g)
        for z in (4.5, -30.0):
            out = torch.full((7, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
            T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, K_SMALL, 700,
                              **dict(SMALL, BITS=bits, ZSIGMA=z))
            _check(out, T.persistent_topk_reference(lg, lens, K_SMALL))


def test_topk_config_rejects_other_digit_widths():
    with pytest.raises(ValueError, match="4 or 8"):
        T.topk_config(2048, 4096, bits=5)


def test_merge_digit_width_per_architecture():
    """Split rows: the merge takes 8-bit digits on SM12x only (4 spills there), the select's width
    elsewhere; unsplit rows always take the select's width."""
    split = T.topk_config(2048, 32768, 1, 132, arch_major=9)
    assert split["SPLIT"] > 1 and split["MERGE_BITS"] == T.RADIX_BITS == 4
    assert T.topk_config(2048, 32768, 1, 188, arch_major=12)["MERGE_BITS"] == 8
    assert T.topk_config(2048, 32768, 1, 132, arch_major=10)["MERGE_BITS"] == 4
    assert T.topk_config(2048, 32768, 1, 132, bits=8, arch_major=9)["MERGE_BITS"] == 8
    whole = T.topk_config(2048, 32768, 4096, 188, arch_major=12)
    assert whole["SPLIT"] == 1 and whole["MERGE_BITS"] == 4
    # the SM120 specs hold the 8-bit merges of split rows, and no 4-bit merge of a split row
    merges = [c for kern, c, _ in T.dispatch_launches() if kern is T._topk_merge_kernel]
    assert {c["BITS"] for c in merges if c["SPLIT"] > 1} == {8}


def test_large_k_counts_past_16_bits():
    """k > 8192 gives CAP 32768: the resolve's tie/above counts no longer fit the packed 16-bit scan
    (the unpacked scans run); exact, with ties at the k-th value."""
    k, n = 8200, 32768
    g = torch.Generator().manual_seed(31)
    lg = torch.randn(5, n, generator=g)
    lg[1] = torch.randint(0, 3, (n,), generator=g).float()  # ~11k ties per value
    lg[4] = 0.0  # 32768 ties: a packed count reaches 2**31, its last lane's store lands 32769 slots
    # before the row (inside row 0 of this output: a packed scan shows as a wrong row 0)
    lens = torch.tensor([n, n, 17000, 9000, n], dtype=torch.int32)
    assert T.topk_config(k, n)["CAP"] == n
    out = torch.full((5, k), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, n)
    _check(out, T.persistent_topk_reference(lg, lens, k))


@pytest.mark.parametrize("sms", [8, 132, 188])
@pytest.mark.parametrize("k,L", [(512, 3000), (2048, 40000), (2048, 300000), (4096, 1 << 20)])
def test_topk_workspace_bytes_is_the_max_over_calls(sms, k, L):
    """topk_workspace_bytes(k, R, L) is exactly the largest scratch of any call with <= R rows of
    <= L columns (brute force over every row count), and grows with R and L."""
    def need(r, l):
        cfg = T.topk_config(k, l, r, sms)
        return 4 * T._scratch_layout(r, k, cfg["CAP"], cfg["SPLIT"])["total"]

    best = 0
    prev = 0
    for R in range(1, 3 * sms + 40):
        best = max(best, need(R, L))
        got = T.topk_workspace_bytes(k, R, L, num_sms=sms)
        assert got == best, (R, got, best)
        assert got >= prev
        prev = got
    assert T.topk_workspace_bytes(k, 16384, L, num_sms=sms) >= 8 * 16384 * T.topk_config(k, L)["CAP"]
    assert T.topk_workspace_bytes(k, 100, 2 * L, num_sms=sms) >= T.topk_workspace_bytes(k, 100, L, num_sms=sms)
    assert T.topk_workspace_bytes(k, 0, L) == 0


def test_byte_workspace_of_that_size_is_used():
    """A uint8 workspace (vLLM's workspace manager) of topk_workspace_bytes is viewed as the
    scratch (written, no allocation of its own) and gives the exact result."""
    g = torch.Generator().manual_seed(41)
    lg = torch.randn(3, 600, generator=g)
    lens = torch.tensor([600, 300, 20], dtype=torch.int32)
    cfg = dict(SMALL, SPLIT=3)
    words = T._scratch_layout(3, K_SMALL, cfg["CAP"], cfg["SPLIT"])["total"]
    ws = torch.full((4 * words + 64,), 0xAB, dtype=torch.uint8, device=DEVICE)
    out = torch.full((3, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, ws, K_SMALL, 600, **cfg)
    _check(out, T.persistent_topk_reference(lg, lens, K_SMALL))
    assert (ws[: 4 * words] != 0xAB).any(), "the workspace was not used as the scratch"
    out2 = torch.full((3, K_SMALL), -7, dtype=torch.int32, device=DEVICE)
    T.top_k_per_row_decode(lg.to(DEVICE), 1, lens.view(3, 1).to(DEVICE), out2, 3, lg.stride(0), 1, K_SMALL,
                           scratch=ws, **cfg)
    _check(out2, T.persistent_topk_reference(lg, lens, K_SMALL))


def test_empty_batch_launches_nothing():
    out = torch.empty(0, K_SMALL, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(torch.empty(0, 300, device=DEVICE), torch.empty(0, dtype=torch.int32, device=DEVICE), out,
                      None, K_SMALL, 300, **SMALL)
    T.top_k_per_row_decode(torch.empty(0, 300, device=DEVICE), 1, torch.empty(0, dtype=torch.int32, device=DEVICE),
                           out, 0, 300, 1, K_SMALL, **SMALL)
    assert out.shape == (0, K_SMALL)


# ------------------------------------------------------------------------------------------------
# The short-row kernel (_topk_short_kernel: max_seq_len <= SHORT_MAX, one launch, registers only)
# ------------------------------------------------------------------------------------------------


def _short_rows(kind: str, rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "quantized":  # heavy ties: 1/8 steps of a normal, ~50 distinct values (+ 0.0: no -0.0,
        # which the kernels order below +0.0 and the float64 reference ties with it)
        return torch.round(torch.randn(rows, n, generator=g) * 8) / 8 + 0.0
    if kind == "neg_inf":  # a third of the entries -inf (masked-out positions upstream)
        x = torch.randn(rows, n, generator=g)
        x[torch.rand(rows, n, generator=g) < 0.34] = float("-inf")
        return x
    if kind == "mostly_neg_inf":  # fewer finite entries than k: -inf fills the rest
        x = torch.full((rows, n), float("-inf"))
        x[:, ::97] = torch.randn(rows, (n + 96) // 97, generator=g)
        return x
    if kind == "signed_zeros":  # -0.0 < +0.0 in the key order; ties among each
        return torch.where(torch.rand(rows, n, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
    if kind == "positive":  # common leading key bits (sign, top exponent bits)
        return torch.rand(rows, n, generator=g) * 3 + 1
    return _rows(kind, rows, n, g)


SHORT_KINDS = ["randn", "quantized", "ties", "zeros", "neg_inf", "mostly_neg_inf", "signed_zeros", "positive",
               "negative", "spikes", "dups", "increasing"]


@pytest.mark.parametrize("bisect_bits", [2, 4])
@pytest.mark.parametrize("kind", SHORT_KINDS)
def test_short_path_exact(kind, bisect_bits, seed):
    """The dispatch takes the short-row kernel for max_seq_len <= SHORT_MAX (no overrides): exact
    top-k (lowest positions win ties) on fresh random rows of every length class: empty, shorter
    than k, exactly k, k + 1, random, the full width; the same set as the radix path (SHORT=False),
    with either multisection step (2 or 4 key bits)."""
    g = torch.Generator().manual_seed(seed)
    k, n = 64, 1000
    assert T.topk_config(k, n)["SHORT"] and T._launch_plan(T.topk_config(k, n), k, 2, n, 8, 16)[0][0] is \
        T._topk_short_kernel
    lg = _short_rows(kind, 8, n, g)
    r = torch.randint(k + 2, n, (2,), generator=g).tolist()
    lens = torch.tensor([0, 1, k - 1, k, k + 1, r[0], r[1], n], dtype=torch.int32)
    out = torch.full((8, k), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, n, BISECT_BITS=bisect_bits)
    if kind != "signed_zeros":  # (the float64 reference ties -0.0 with +0.0; the kernels order them)
        _check(out, T.persistent_topk_reference(lg, lens, k))
    old = torch.full((8, k), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), old, None, k, n, **SMALL)
    assert torch.equal(T.canonical(out), T.canonical(old)), "short and radix paths select different sets"


def test_short_path_order_is_ascending_positions(seed):
    """Rows longer than k come out in ascending position order, identical to the radix path's
    output for rows <= CAP; rows <= k are 0..L-1 then -1."""
    g = torch.Generator().manual_seed(seed)
    k, n = 32, 300
    lg = torch.round(torch.randn(3, n, generator=g) * 4) / 4
    lens = torch.tensor([n, 20, 200], dtype=torch.int32)
    out = torch.empty(3, k, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, n)
    out = out.cpu()
    assert torch.equal(out[0], T.persistent_topk_reference(lg, lens, k)[0])
    assert out[1].tolist() == list(range(20)) + [-1] * (k - 20)
    assert torch.equal(out[2], torch.sort(out[2]).values)
    old = torch.empty(3, k, dtype=torch.int32, device=DEVICE)  # radix path, rows <= CAP: same order
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), old, None, k, n, SHORT=False)
    assert torch.equal(out, old.cpu())


@pytest.mark.parametrize("next_n", [1, 3])
def test_short_path_decode_rows(next_n, seed):
    """Decode's next_n rows (1-D seq_lens: row r ends at seq_lens[r // n] - n + r % n + 1) and
    2-D seq_lens, on the short kernel."""
    g = torch.Generator().manual_seed(seed)
    B, k, W = 4, 48, 900
    lg = _short_rows("quantized", B * next_n, W, g)
    seq = torch.tensor([1, k + 1, int(torch.randint(k, W, (1,), generator=g)), W], dtype=torch.int32)
    out = torch.full((B * next_n, k), -7, dtype=torch.int32, device=DEVICE)
    T.top_k_per_row_decode(lg.to(DEVICE), next_n, seq.to(DEVICE), out, B * next_n, lg.stride(0), 1, k)
    _check(out, T.top_k_per_row_decode_reference(lg, next_n, seq, k))
    seq2 = torch.randint(0, W + 1, (B, next_n), generator=g, dtype=torch.int32)
    out2 = torch.full((B * next_n, k), -7, dtype=torch.int32, device=DEVICE)
    T.top_k_per_row_decode(lg.to(DEVICE), next_n, seq2.to(DEVICE), out2, B * next_n, lg.stride(0), 1, k)
    _check(out2, T.top_k_per_row_decode_reference(lg, next_n, seq2, k))


def test_short_path_prefill_ragged_rows(seed):
    """Prefill rows [ks, ke) of one logits buffer (strided view), indices relative to ks."""
    g = torch.Generator().manual_seed(seed)
    M, N, k = 7, 1100, 40
    big = _short_rows("neg_inf", M, 2 * N, g)
    ks = torch.tensor([0, 0, 5, 100, 300, 1000, 1099], dtype=torch.int32)
    ke = torch.tensor([0, 40, 46, 1100, 1100, 1100, 1100], dtype=torch.int32)
    out = torch.full((M, k), -7, dtype=torch.int32, device=DEVICE)
    bigd = big.to(DEVICE)  # the view is taken on the device: .to() of a view copies it contiguous
    T.top_k_per_row_prefill(bigd[:, :N], ks.to(DEVICE), ke.to(DEVICE), out, M, bigd.stride(0), 1, k)
    _check(out, T.top_k_per_row_prefill_reference(big[:, :N], ks, ke, k))


@pytest.mark.parametrize("width", [T.SHORT_MAX, T.SHORT_MAX + 1])
def test_short_dispatch_threshold(width, seed):
    """max_seq_len == SHORT_MAX takes the short kernel (BLOCK 8192), one column more the radix path;
    both exact on rows around the 4096 / 8192 block sizes; SHORT=True past SHORT_MAX is refused."""
    g = torch.Generator().manual_seed(seed)
    k = 2048
    cfg = T.topk_config(k, width)
    assert cfg["SHORT"] == (width <= T.SHORT_MAX)
    lg = _short_rows("quantized", 4, width, g)
    lens = torch.tensor([4095, 4097, 8191, width], dtype=torch.int32)
    out = torch.full((4, k), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, width)
    _check(out, T.persistent_topk_reference(lg, lens, k))
    if width > T.SHORT_MAX:
        with pytest.raises(ValueError, match="SHORT_MAX"):
            T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, width, SHORT=True)


def test_short_config_blocks_and_warps():
    """BLOCK = max(1024, next power of two of max_seq_len); 4 warps up to 2048, 8 above."""
    for L, blk, nw in [(1, 1024, 4), (1024, 1024, 4), (1025, 2048, 4), (4096, 4096, 8), (4097, 8192, 8),
                       (8192, 8192, 8)]:
        c = T.topk_config(2048, L)
        assert (c["SHORT"], c["SHORT_BLOCK"], c["short_warps"]) == (True, blk, nw), L
    assert not T.topk_config(2048, 8193)["SHORT"]
    shorts = [c for kern, c, _ in T.dispatch_launches() if kern is T._topk_short_kernel]
    assert {c["BLOCK"] for c in shorts} == {1024, 2048, 4096, 8192}


@gpu
@needs_gpu
@pytest.mark.parametrize("bisect_bits", [2, 4])
@pytest.mark.parametrize("kind", ["randn", "quantized", "neg_inf", "positive", "ties"])
@pytest.mark.parametrize("width", [2048, 3000, 4096, 8192])
def test_gpu_short_path_k2048(kind, width, bisect_bits):
    g = torch.Generator().manual_seed(width + len(kind))
    rows = 6
    lg = _short_rows(kind, rows, width, g).cuda()
    lens = torch.tensor([1, 2048, min(2049, width), max(width // 2, 1), width - 1, width], dtype=torch.int32,
                        device="cuda")
    out = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
    T.persistent_topk(lg, lens, out, None, 2048, width, BISECT_BITS=bisect_bits)
    assert torch.equal(T.canonical(out), _ref_gpu(lg, lens, 2048))
    old = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
    T.persistent_topk(lg, lens, old, None, 2048, width, SHORT=False)
    if width <= T.topk_config(2048, width)["CAP"]:
        assert torch.equal(out, old)  # rows <= CAP: the same order as the radix path
    else:  # longer rows: the radix path's order differs (order inside a row is unspecified)
        assert torch.equal(T.canonical(out), T.canonical(old))
    if bisect_bits == 2:  # the warp counts timed against the dispatch's (same output, same order)
        for over in ({"short_warps": 4}, {"short_warps": 8}, {"short_warps": 16},
                     {"SHORT": False, "merge_warps": 8}):
            other = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
            T.persistent_topk(lg, lens, other, None, 2048, width, **over)
            assert torch.equal(other, old if "merge_warps" in over else out), over


@pytest.mark.parametrize("bisect_bits", [2, 4])
def test_short_path_fuzz(bisect_bits, seed):
    """Random k (1..300), widths (BLOCK 1024 / 2048 / 4096), data kinds and row lengths; the same
    output (positions in ascending order) with either multisection step."""
    import random
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(6):
        k = rng.randint(1, 300)
        n = rng.choice([rng.randint(1, 1024), rng.randint(1025, 2100), rng.randint(2049, 4096)])
        kind = rng.choice([kd for kd in SHORT_KINDS if kd != "signed_zeros"])
        lg = _short_rows(kind, 4, n, g)
        lens = torch.tensor([rng.randint(0, n) for _ in range(3)] + [n], dtype=torch.int32)
        out = torch.full((4, k), -7, dtype=torch.int32, device=DEVICE)
        T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, n, BISECT_BITS=bisect_bits)
        ref = T.persistent_topk_reference(lg, lens, k)
        got = T.canonical(out)
        assert torch.equal(got, ref), f"k={k} n={n} kind={kind} lens={lens.tolist()}: {_first_diff(got, ref)}"
        other = torch.full((4, k), -7, dtype=torch.int32, device=DEVICE)
        T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), other, None, k, n, BISECT_BITS=6 - bisect_bits)
        assert torch.equal(out.cpu(), other.cpu()), "the 2- and 4-bit steps write different outputs"


@pytest.mark.parametrize("kind", ["randn", "quantized", "neg_inf", "ties"])
def test_merge_kernel_short_rows_bisect(kind, seed):
    """Calls with max_seq_len > SHORT_MAX keep the radix path, whose merge kernel selects rows
    <= CAP in registers: with the short kernel's bisection (SHORT_SELECT, the default) it writes
    the same output, in the same order, as with the radix select (SHORT=False)."""
    g = torch.Generator().manual_seed(seed)
    k, n = K_SMALL, 700
    lg = _short_rows(kind, 7, n, g)
    lens = torch.tensor([0, 5, k, k + 1, 100, 128, 700], dtype=torch.int32)  # CAP = 128 in SMALL
    cfg = T.topk_config(k, 1 << 20)
    assert not cfg["SHORT"] and cfg["SHORT_SELECT"]
    outs = []
    for over in (dict(SMALL, SHORT_SELECT=True), dict(SMALL, SHORT_SELECT=True, BISECT_BITS=4), SMALL):
        out = torch.full((7, k), -7, dtype=torch.int32, device=DEVICE)
        T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, n, **over)
        _check(out, T.persistent_topk_reference(lg, lens, k))
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    plan = T._launch_plan(cfg, k, 2, 1 << 20, 8, 16)
    assert plan[-1][0] is T._topk_merge_kernel and plan[-1][1]["SHORT_SELECT"] == 1


@gpu
@needs_gpu
def test_gpu_short_path_cuda_graph_capture():
    """The short kernel (no scratch, no allocation) captured in a CUDA graph; new data and row
    lengths replayed."""
    lg = torch.randn(5, 4096, device="cuda")
    lens = torch.tensor([4096, 3000, 10, 2049, 2048], dtype=torch.int32, device="cuda")
    out = torch.empty(5, 2048, dtype=torch.int32, device="cuda")
    T.persistent_topk(lg, lens, out, None, 2048, 4096)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        T.persistent_topk(lg, lens, out, None, 2048, 4096)
    lg.copy_(torch.round(torch.randn_like(lg) * 8) / 8 + 0.0)
    lens.copy_(torch.tensor([4095, 4096, 2049, 1, 3333], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(T.canonical(out), _ref_gpu(lg, lens, 2048))


# ------------------------------------------------------------------------------------------------
# Cooperative select (COOP): several programs per row, grid barriers between the radix passes
# ------------------------------------------------------------------------------------------------


def test_coop_shape_rule():
    """Programs per row: powers of two, at least 2, the grid within one CTA per SM, every program
    at most COOP_MAX_BLOCK keys and (when programs are added) at least COOP_MIN_BLOCK; None where
    every row fits k or the rows alone fill the SMs."""
    assert T.coop_shape(2048, 2048, 1, 132) is None  # every row filled
    assert T.coop_shape(2048, 32768, 132, 132) is None  # 1 program per row at most
    assert T.coop_shape(2048, 1 << 20, 16, 132) is None  # 256 programs per row needed, 8 fit
    assert T.coop_shape(2048, 32768, 32, 132) is None  # 8 programs per row needed, 4 fit
    for k, L, rows, sms in ((2048, 4096, 1, 132), (2048, 32768, 1, 132), (2048, 131072, 4, 132), (2048, 32768, 16, 132),
                            (512, 9000, 2, 8), (2048, 65536, 8, 188), (2048, 8193, 1, 48)):
        c, block = T.coop_shape(k, L, rows, sms)
        assert c >= 2 and c & (c - 1) == 0 and block & (block - 1) == 0, (k, L, rows, sms, c, block)
        assert rows * c <= sms and c * block >= L and block <= T.COOP_MAX_BLOCK
        assert c == 2 or T.triton.cdiv(L, c) >= T.COOP_MIN_BLOCK
    # more CTAs per SM: more rows fit, rows x C within the slots
    assert T.coop_shape(2048, 32768, 32, 132, 2) == (8, 4096)
    assert T.coop_shape(2048, 32768, 16, 132, 2) == (16, 2048)
    assert T.coop_shape(2048, 32768, 64, 132, 4) == (8, 4096)
    assert T.coop_shape(2048, 32768, 64, 132, 2) is None


def test_coop_ctas_per_sm_option():
    """COOP_CTAS_PER_SM (an override) widens the cooperative grid: the same exact output with a
    shape one CTA per SM does not admit; values outside 1..COOP_MAX_CTAS_PER_SM are refused."""
    g = torch.Generator().manual_seed(11)
    lg = torch.randn(3, 5000, generator=g)
    lens = torch.tensor([5000, 4000, 2600], dtype=torch.int32)
    assert T.coop_shape(512, 5000, 3, 8, 1) == (2, 4096) and T.coop_shape(512, 5000, 3, 8, 2) == (4, 2048)
    cfg, _, _ = T.call_config(512, 5000, 3, 8, 0, {"COOP": True, "COOP_CTAS_PER_SM": 2})
    assert T.call_coop(cfg, 512, 5000, 3, 8) == (4, 2048)
    out = torch.full((3, 512), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, 512, 5000, COOP=True, COOP_CTAS_PER_SM=2)
    assert torch.equal(out.cpu(), T.persistent_topk_reference(lg, lens, 512))
    for buf in T._COOP_BUFS.values():
        assert not buf.any()
    for bad in (0, T.COOP_MAX_CTAS_PER_SM + 1, 1.5):
        with pytest.raises(ValueError, match="COOP_CTAS_PER_SM"):
            T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, 512, 5000, COOP=True, COOP_CTAS_PER_SM=bad)


@pytest.mark.parametrize("kind", ["randn", "quantized", "ties", "neg_inf", "spikes", "dups", "increasing"])
def test_coop_exact_and_in_position_order(kind, seed):
    """The cooperative select (interpreter: one launch per phase) against the reference: the same
    positions in ascending order (the short kernel's output exactly), rows shorter than k filled,
    ragged lengths, ties at the k-th value to the lowest positions; its state buffer is all zero
    afterwards (the graph-safety invariant), also after a call with more rows."""
    g = torch.Generator().manual_seed(seed)
    for rows, n, k in ((3, 3000, 512), (2, 5000, 2048), (1, 2100, 2048)):
        lg = _short_rows(kind, rows, n, g)
        lens = torch.tensor([n, k - 3, n // 2 + 7][:rows], dtype=torch.int32)
        assert T.coop_shape(k, n, rows, 8) is not None
        out = torch.full((rows, k), -7, dtype=torch.int32, device=DEVICE)
        T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, k, n, COOP=True)
        ref = T.persistent_topk_reference(lg, lens, k)
        assert torch.equal(out.cpu(), ref), f"rows={rows} n={n} k={k}: {_first_diff(out.cpu(), ref)}"
        for buf in T._COOP_BUFS.values():
            assert not buf.any(), "cooperative state left non-zero"


def test_coop_dispatch_and_refuses_nothing_it_cannot_do():
    """COOP is the dispatch's choice only for rows the short kernel cannot take (> SHORT_MAX; it
    beat the cooperative select on 4k rows); merge bisection everywhere but SM12x. Where
    coop_shape says no, COOP=True takes the normal path (same output)."""
    assert T.topk_config(2048, 32768)["COOP"] is T.COOP
    assert T.topk_config(2048, T.SHORT_MAX)["COOP"] is False
    assert T.topk_config(2048, 32768, arch_major=9)["MERGE_BISECT"] is T.MERGE_BISECT
    assert T.topk_config(2048, 32768, arch_major=12)["MERGE_BISECT"] is False
    assert T.call_config(2048, 32768, 1, 132, 9, {"SHORT": False})[0]["COOP"] is False
    g = torch.Generator().manual_seed(3)
    lg = torch.randn(9, 1500, generator=g)  # 9 rows x 2 programs > 8 SMs: no cooperative launch
    lens = torch.full((9,), 1500, dtype=torch.int32)
    assert T.coop_shape(512, 1500, 9, 8) is None
    out = torch.full((9, 512), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, 512, 1500, COOP=True)
    assert torch.equal(out.cpu(), T.persistent_topk_reference(lg, lens, 512))


@gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["randn", "quantized", "neg_inf", "ties", "increasing"])
@pytest.mark.parametrize("width,rows", [(4096, 1), (4096, 16), (8192, 4), (32768, 1), (32768, 16), (131072, 4),
                                        (300000, 1)])
def test_gpu_coop_k2048(kind, width, rows):
    """The cooperative select on the GPU (one cooperative launch, spin barriers): exact against the
    reference, in ascending position order, ragged lengths (one row shorter than k), the state
    zero afterwards; the same output as the default path (same set, and for rows the short
    kernel takes, the same order)."""
    g = torch.Generator().manual_seed(width + rows + len(kind))
    lg = _short_rows(kind, rows, width, g).cuda()
    lens = torch.randint(2049, width + 1, (rows,), generator=g, dtype=torch.int32)
    lens[0] = width
    if rows > 1:
        lens[1] = 100
    lens = lens.cuda()
    assert T.coop_shape(2048, width, rows, T._num_sms(0)) is not None
    out = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
    T.persistent_topk(lg, lens, out, None, 2048, width, COOP=True)
    torch.cuda.synchronize()
    ref = _ref_gpu(lg, lens, 2048)
    assert torch.equal(out.cpu(), ref), _first_diff(out.cpu(), ref)
    for buf in T._COOP_BUFS.values():
        assert not buf.any()
    base = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
    T.persistent_topk(lg, lens, base, None, 2048, width, COOP=False)
    assert torch.equal(T.canonical(base), ref)


@gpu
@needs_gpu
@pytest.mark.parametrize("ctas", [2, 4])
@pytest.mark.parametrize("width,rows", [(32768, 16), (32768, 32), (32768, 64), (131072, 8)])
def test_gpu_coop_ctas_per_sm(ctas, width, rows):
    """COOP_CTAS_PER_SM 2 / 4: a cooperative grid of several CTAs per SM, exact against the
    reference where the driver launches it; where it cannot make the grid co-resident, the call
    warns and takes the other path (still exact)."""
    sms = T._num_sms(0)
    if T.coop_shape(2048, width, rows, sms, ctas) is None:
        pytest.skip(f"no cooperative shape for {rows} rows of {width} at {ctas} CTAs per SM on {sms} SMs")
    g = torch.Generator().manual_seed(width + rows + ctas)
    lg = _short_rows("randn", rows, width, g).cuda()
    lens = torch.randint(2049, width + 1, (rows,), generator=g, dtype=torch.int32)
    lens[0] = width
    lens = lens.cuda()
    out = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a refused launch: the other path
        T.persistent_topk(lg, lens, out, None, 2048, width, COOP=True, COOP_CTAS_PER_SM=ctas)
    torch.cuda.synchronize()
    assert torch.equal(T.canonical(out), _ref_gpu(lg, lens, 2048))
    for buf in T._COOP_BUFS.values():
        assert not buf.any()


@gpu
@needs_gpu
def test_gpu_coop_cuda_graph_capture():
    """The cooperative launch captured in a CUDA graph as vLLM captures (warm-up on the capture
    stream, which creates that stream's state, then the capture on it) and replayed on new logits
    and lengths (the state buffer's zero invariant carries from replay to replay). A capture on a
    stream with no state yet takes the segment path (no zeroing that only a replay would run)."""
    lg = torch.randn(4, 32768, device="cuda")
    lens = torch.tensor([32768, 3000, 10, 20000], dtype=torch.int32, device="cuda")
    out = torch.empty(4, 2048, dtype=torch.int32, device="cuda")
    for warm in (True, False):
        s = torch.cuda.Stream()
        key = ("cuda", torch.cuda.current_device(), s.cuda_stream)
        with torch.cuda.stream(s):
            if warm:
                T.persistent_topk(lg, lens, out, None, 2048, 32768, COOP=True)  # compile, create the state
            s.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                T.persistent_topk(lg, lens, out, None, 2048, 32768, COOP=True)
        assert (key in T._COOP_BUFS) is warm
        for i in range(3):
            lg.copy_(torch.round(torch.randn_like(lg) * 8) / 8 + 0.0)
            lens.copy_(torch.tensor([32768 - i, 4096, 2049 + i, 1], dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            got = out.cpu() if warm else T.canonical(out).cpu()  # the segment path: same set
            assert torch.equal(got, _ref_gpu(lg, lens, 2048)), f"warm-up {warm}, replay {i}"
        if warm:
            assert not T._COOP_BUFS[key].any()


@pytest.mark.parametrize("sms", [8, 48, 132, 188])
def test_coop_buffer_covers_every_admitted_call(sms):
    """The cooperative state is allocated once per (device, stream) at coop_buffer_words: every
    (rows, C) coop_shape admits fits it (so a graph capture never grows it)."""
    need = 0
    for ctas in range(1, T.COOP_MAX_CTAS_PER_SM + 1):
        for rows in range(1, sms * ctas + 1):
            for L in (2049, 4096, 8193, 32768, 131072, 1 << 20):
                cs = T.coop_shape(2048, L, rows, sms, ctas)
                if cs is not None:
                    need = max(need, rows * (T._COOP_STATE + 2 * cs[0]))
    assert 0 < need <= T.coop_buffer_words(sms)


def test_coop_refused_launch_takes_the_other_path(monkeypatch):
    """A cooperative launch the driver refuses (too large for the SMs it can use) is not an error
    for the caller: a warning, False (nothing launched), and that launch shape (grid size, keys
    per program) is remembered, so the call and later ones of that shape take the other path (same
    output); other launch errors propagate."""
    g = torch.Generator().manual_seed(5)
    lg = torch.randn(2, 3000, generator=g)
    lens = torch.tensor([3000, 2500], dtype=torch.int32)
    calls = []

    class Refusing:
        def __init__(self, msg):
            self.msg = msg

        def __getitem__(self, grid):
            def run(*a, **k):
                calls.append(grid)
                raise RuntimeError(self.msg)
            return run

    monkeypatch.setattr(T, "_COOP_REFUSED", set())
    real = T._topk_coop_kernel
    monkeypatch.setattr(T, "_topk_coop_kernel", Refusing("Triton Error [CUDA]: too many blocks in cooperative launch"))
    out = torch.full((2, 512), -7, dtype=torch.int32)
    with pytest.warns(RuntimeWarning, match="cooperative"):  # on_gpu=True: the cooperative launch
        assert T._launch_coop(lg, lens, lens, out, 1, 512, T._MODE_ROW_LENGTHS, dict(KFILL=512), (4, 1024),
                              True, 8) == (False, None)
    assert calls == [(2, 4)] and T._COOP_REFUSED == {(0, 8, 1024)} and torch.all(out == -7)
    monkeypatch.setattr(T, "_topk_coop_kernel", Refusing("Triton Error [CUDA]: an illegal memory access"))
    with pytest.raises(RuntimeError, match="illegal"):
        T._launch_coop(lg, lens, lens, out, 1, 512, T._MODE_ROW_LENGTHS, dict(KFILL=512), (4, 1024), True, 8)
    # a refused size: the entry takes the other path without trying the cooperative launch again
    monkeypatch.setattr(T, "_topk_coop_kernel", real)
    c, block = T.coop_shape(512, 3000, 2, 8)
    monkeypatch.setattr(T, "_COOP_REFUSED", {(0, 2 * c, block)})
    monkeypatch.setattr(T, "_launch_coop", lambda *a, **k: pytest.fail("a refused size was launched again"))
    out = torch.full((2, 512), -7, dtype=torch.int32, device=DEVICE)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, 512, 3000, COOP=True)
    assert torch.equal(out.cpu(), T.persistent_topk_reference(lg, lens, 512))
    # the same grid size at other keys per program (other registers per CTA) is still tried
    tried = []
    monkeypatch.setattr(T, "_COOP_REFUSED", {(0, 2 * c, 2 * block)})
    monkeypatch.setattr(T, "_launch_coop", lambda *a, **k: tried.append(a[8]) or (False, None))
    out.fill_(-7)
    T.persistent_topk(lg.to(DEVICE), lens.to(DEVICE), out, None, 512, 3000, COOP=True)
    assert tried == [(c, block)] and torch.equal(out.cpu(), T.persistent_topk_reference(lg, lens, 512))


# ------------------------------------------------------------------------------------------------
# Planned calls (host time): the second call of a key launches the compiled kernels directly
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def planned(monkeypatch):
    """Every top-k kernel replaced by a FakeJit, a fixed raw stream, an empty plan cache."""
    fakes = {}
    for name in ("_topk_short_kernel", "_topk_segment_kernel", "_topk_merge_kernel", "_topk_coop_kernel"):
        fakes[name] = FakeJit(getattr(T, name))
        monkeypatch.setattr(T, name, fakes[name])
    monkeypatch.setattr(T, "_raw_stream", lambda index: 4321)
    monkeypatch.setattr(T, "_PLANS", {})
    monkeypatch.setattr(T, "_COOP_REFUSED", set())
    return fakes


def _check_direct(fake, n_before: int):
    """The direct launches after the first n_before JIT launches repeat them argument for argument."""
    jit = fake.launches[:n_before]
    direct = fake.compiled.calls
    assert len(direct) == len(jit) and direct
    for (grid, args, kw), got in zip(jit, direct):
        c = fake.compiled
        assert got[:9] == (grid[0], grid[1] if len(grid) > 1 else 1, 1, 4321, c.function, c.packed_metadata,
                           None, None, None)
        assert got[9:] == launcher_args(fake, args, kw)
        assert len(got) - 9 == len(fake.arg_names)


@pytest.mark.parametrize("path", ["short", "segment_merge", "merge_only"])
def test_planned_call_launches_what_triton_launched(planned, monkeypatch, path):
    """A key's first call binds, specializes and launches through Triton's JIT path and keeps the
    compiled kernels; its next calls (other tensors, same key) hand the launcher the same argument
    list with the new pointers, without validating or dispatching again."""
    k, rows = 64, 3
    if path == "short":
        width, kernels = 300, ["_topk_short_kernel"]
    else:  # rows past SHORT_MAX, no cooperative select: the radix path (segments past CAP = 4096)
        monkeypatch.setattr(T, "SHORT_MAX", 256)
        monkeypatch.setattr(T, "COOP", False)
        width = 5000 if path == "segment_merge" else 600
        kernels = (["_topk_segment_kernel"] if path == "segment_merge" else []) + ["_topk_merge_kernel"]
    dispatch = T.topk_config(k, width, rows, 8)
    lg = torch.randn(rows, width)
    lens = torch.tensor([width, width // 2, 7], dtype=torch.int32)
    scratch = torch.empty(T.topk_workspace_bytes(k, rows, width, num_sms=8) // 4 + 64, dtype=torch.int32)
    out = torch.empty(rows, k, dtype=torch.int32)
    T.persistent_topk(lg, lens, out, scratch, k, width)
    assert len(T._PLANS) == 1
    n_jit = {name: len(planned[name].launches) for name in kernels}
    assert all(n == 1 for n in n_jit.values()) and not any(planned[n].launches for n in planned if n not in kernels)
    # same key, new tensors: the direct path (validation and dispatch would see the same key)
    lg2, lens2, out2 = torch.randn(rows, width), lens.clone(), torch.empty(rows, k, dtype=torch.int32)
    monkeypatch.setattr(T, "topk_config", lambda *a, **kw: pytest.fail("a planned call dispatched again"))
    T.persistent_topk(lg2, lens2, out2, scratch, k, width)
    for name in kernels:
        fake = planned[name]
        assert len(fake.launches) == 1  # no second JIT launch
        (got,) = fake.compiled.calls
        (grid, args, kw) = fake.launches[0]
        # the JIT launch's arguments with this call's pointers in place of the first call's
        swap = {t.data_ptr(): t2.data_ptr() for t, t2 in ((lg, lg2), (lens, lens2), (out, out2))}
        want = tuple(swap.get(v, v) if isinstance(v, int) else v for v in launcher_args(fake, args, kw))
        assert got[9:] == want, name
        assert got[:4] == (grid[0], grid[1], 1, 4321)
    if path != "short":  # the caller's scratch, at the layout's 16-byte aligned offsets
        lay = T._scratch_layout(rows, k, dispatch["CAP"], dispatch["SPLIT"])
        ptrs = launcher_args(planned["_topk_merge_kernel"], planned["_topk_merge_kernel"].launches[0][1], {})[8:15]
        assert ptrs == tuple(scratch.data_ptr() + 4 * v[0] for n, v in lay.items() if n != "total")


def test_planned_cooperative_call(planned, monkeypatch):
    """A cooperative select's plan launches the cooperative kernel directly (its state from the
    stream's buffer); a refusal there takes the segment path, compiled once through Triton."""
    real_coop = T._launch_coop
    # the CPU stands in for a GPU: the cooperative launch as one launch (no phases)
    monkeypatch.setattr(T, "_launch_coop", lambda *a: real_coop(*a[:9], True, a[10]))
    k, rows, width = 64, 1, 9000
    lg = torch.randn(rows, width)
    lens = torch.tensor([width - 3], dtype=torch.int32)
    out = torch.empty(rows, k, dtype=torch.int32)
    T.persistent_topk(lg, lens, out, None, k, width)
    fake = planned["_topk_coop_kernel"]
    assert len(fake.launches) == 1 and fake.launches[0][2]["launch_cooperative_grid"] is True
    T.persistent_topk(lg, lens, out, None, k, width)
    _check_direct(fake, 1)
    (plan,) = T._PLANS.values()
    buf = next(b for key, b in T._COOP_BUFS.items() if key[0] == "cpu")
    assert fake.compiled.calls[0][9 + 8] == buf.data_ptr()
    # the driver refuses the cooperative launch: warned, remembered, the other path compiled once
    def refuse(*a):
        raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")
    plan.coop_direct = (refuse,) + plan.coop_direct[1:]
    with pytest.warns(RuntimeWarning, match="cooperative"):
        T.persistent_topk(lg, lens, out, None, k, width)
    assert T._COOP_REFUSED == {plan.coop_key}
    seg, merge = planned["_topk_segment_kernel"], planned["_topk_merge_kernel"]
    assert len(seg.launches) == 1 and len(merge.launches) == 1 and plan.direct is not None
    T.persistent_topk(lg, lens, out, None, k, width)  # now the segment path, directly
    assert len(seg.launches) == 1 and len(seg.compiled.calls) == 1 and len(merge.compiled.calls) == 1


def test_calls_that_are_not_planned(planned, monkeypatch):
    """Overrides (tuning), a launch hook (profilers) and a pointer that is not 16-byte aligned take
    Triton's path every time; another stride is another key."""
    k, width = 64, 300
    lg = torch.randn(2, width)
    lens = torch.tensor([width, 9], dtype=torch.int32)
    out = torch.empty(2, k, dtype=torch.int32)
    short = planned["_topk_short_kernel"]
    for _ in range(2):
        T.persistent_topk(lg, lens, out, None, k, width, short_warps=4)
    assert len(short.launches) == 2 and not T._PLANS
    big = torch.randn(2 * width + 1)
    mis = big[1:].view(2, width)
    assert mis.data_ptr() % 16
    for _ in range(2):
        T.persistent_topk(mis, lens, out, None, k, width)
    assert len(short.launches) == 4 and not T._PLANS
    T.persistent_topk(lg, lens, out, None, k, width)
    T.persistent_topk(lg, lens, out, None, k, width)
    assert len(short.launches) == 5 and len(short.compiled.calls) == 1 and len(T._PLANS) == 1
    monkeypatch.setattr(T, "_hooks_off", lambda: False)
    T.persistent_topk(lg, lens, out, None, k, width)
    assert len(short.launches) == 6 and len(short.compiled.calls) == 1
    monkeypatch.setattr(T, "_hooks_off", lambda: True)
    wide = torch.randn(2, width + 16)[:, :width]
    T.persistent_topk(wide, lens, out, None, k, width)
    assert len(short.launches) == 7 and len(T._PLANS) == 2


@gpu
@needs_gpu
@pytest.mark.parametrize("width, rows", [(4096, 3), (32768, 1), (32768, 64), (131072, 8)])
def test_gpu_planned_calls_match_triton_launches(monkeypatch, width, rows):
    """The direct launches of a planned call (a key's second call on) write what Triton's JIT
    launch of the same call writes, bit for bit, on new data, eagerly and replayed from a CUDA graph
    captured on a side stream after a warm-up there (as vLLM captures), on the dispatch's paths:
    short rows, the cooperative select (32k, one row), segments + merge."""
    monkeypatch.setattr(T, "_PLANS", {})
    g = torch.Generator().manual_seed(width + rows)
    lg = torch.randn(rows, width, generator=g).cuda()
    lens = torch.randint(1, width + 1, (rows,), generator=g, dtype=torch.int32).cuda()
    lens[0] = width
    out = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
    T.persistent_topk(lg, lens, out, None, 2048, width)  # Triton's path; the plan is kept
    assert torch.equal(T.canonical(out), _ref_gpu(lg, lens, 2048))
    (plan,) = T._PLANS.values()
    assert plan.direct is not None or plan.coop_direct is not None

    def jit_launch():  # an override the dispatch ignores: not planned, Triton's path every time
        o = torch.full((rows, 2048), -7, dtype=torch.int32, device="cuda")
        T.persistent_topk(lg, lens, o, None, 2048, width, SEG_MIN=T.SEG_MIN)
        return o

    real_config = T.topk_config
    for i in range(2):
        lg.copy_(torch.round(torch.randn_like(lg) * 8) / 8 + 0.0)  # ties at the k-th value too
        out.fill_(-7)
        monkeypatch.setattr(T, "topk_config", lambda *a, **k: pytest.fail("the planned call dispatched"))
        T.persistent_topk(lg, lens, out, None, 2048, width)
        monkeypatch.setattr(T, "topk_config", real_config)
        assert torch.equal(out, jit_launch()), f"eager call {i}"
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        T.persistent_topk(lg, lens, out, None, 2048, width)  # warm-up on the capture stream
        s.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            T.persistent_topk(lg, lens, out, None, 2048, width)
    for i in range(2):
        lg.copy_(torch.randn_like(lg))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, jit_launch()), f"replay {i}"
    assert len(T._PLANS) == 1

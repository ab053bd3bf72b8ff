# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the pure-Python parts of bench/common.py, bench/sparse_mla_decode.py and
bench/readme_tables.py: argument parsing, peer staging, the time budget, ratio and byte math on
fixed inputs, result merging, table generation; the gather kernel and the prefill inputs on CPU."""

from __future__ import annotations

import json
import lzma
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.triton_interpreter import INTERPRET, torch  # noqa: E402  (sets TRITON_INTERPRET without CUDA)

from bench import common  # noqa: E402
from bench import readme_tables as RT  # noqa: E402
from bench import sparse_mla_decode as B  # noqa: E402


# ---------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------

def test_parse_defaults_and_modes():
    a = B.parse_args([])
    assert a.heads == [8, 16, 32, 64, 128] and a.tokens == [1, 4, 32, 64, 128]
    assert a.formats == ["fp8_ds_mla", "fp8", "bfloat16"] and a.stem == "sparse_decode_h200"
    assert a.host_calls == 1000 and a.time_budget is None and not a.append
    p = B.parse_args(["--prefill"])
    assert p.heads == [8, 64] and p.contexts == [8192, 32768] and p.stem == "sparse_prefill_h200"
    t = B.parse_args(["--time-budget", "540", "--heads", "8", "--sm120-proxy"])
    assert t.time_budget == 540 and t.heads == [8] and t.sm120_proxy


@pytest.mark.parametrize("argv, msg", [
    (["--formats", "fp4"], "--formats"),
    (["--prefill", "--sweep"], "separate runs"),
    (["--time-budget", "0"], "positive"),
])
def test_parse_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        B.parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_sm120_proxy_requires_disable_mma_v3(monkeypatch, capsys):
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    assert B.main(["--sm120-proxy"]) == 2
    assert "DISABLE_MMA_V3=1" in capsys.readouterr().out


def test_command_line_records_env(monkeypatch):
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    monkeypatch.setenv("GLM5_SPARSE_MLA_DISPATCH_CC", "12")
    cmd = common.command_line(str(ROOT / "bench" / "sparse_mla_decode.py"), ["--sm120-proxy", "--heads", "8"])
    assert cmd == "DISABLE_MMA_V3=1 GLM5_SPARSE_MLA_DISPATCH_CC=12 python bench/sparse_mla_decode.py --sm120-proxy --heads 8"


# ---------------------------------------------------------------------------------------------
# byte and ratio math on fixed inputs
# ---------------------------------------------------------------------------------------------

def test_bytes_moved_fixed():
    # H=8, T=1, fp8_ds_mla: 2048 rows x 656 + 2048 x 4 (indices) + q 8x576x2 + out 8x512x2 + lse 8x4
    assert B.bytes_moved(8, 1, "fp8_ds_mla") == 2048 * 656 + 8192 + 9216 + 8192 + 32 == 1369120
    assert B.bytes_moved(64, 128, "fp8") == 128 * 2048 * 580 + 128 * 64 * (1152 + 1024 + 4)
    assert B.gather_bytes(32, "bfloat16") == 32 * 2048 * 1156


def test_derive_ratios_fixed():
    r = {"heads": 8, "tokens": 32, "kv_format": "fp8_ds_mla", "us": 60.0, "gather_us": 24.0,
         "flashmla_us": 50.0, "flashmla_kernel_us": 40.0}
    B.derive(r, copy_bw=4.0e12)
    nbytes = B.bytes_moved(8, 32, "fp8_ds_mla")
    assert r["bytes"] == nbytes
    assert r["kernel_over_gather"] == pytest.approx(2.5)
    assert r["ratio_vs_flashmla"] == pytest.approx(1.2)
    assert r["ratio_vs_flashmla_kernel"] == pytest.approx(1.5)
    assert r["floor_us"] == pytest.approx(nbytes / 4.0e12 * 1e6)
    assert r["pct_copy_bw"] == pytest.approx(100 * r["floor_us"] / 60.0)
    assert r["gather_pct_copy_bw"] == pytest.approx(100 * 32 * 2048 * 660 / 4.0e12 * 1e6 / 24.0)
    assert r["tflops"] == pytest.approx(2 * 32 * 8 * 2048 * 1088 / 60e-6 / 1e12)
    r2 = B.derive({"heads": 8, "tokens": 1, "kv_format": "fp8", "us": 10.0}, 4.0e12)
    assert r2["kernel_over_gather"] is None and r2["ratio_vs_flashmla"] is None
    assert common.ratio(1.0, 0.0) is None and common.ratio(None, 2.0) is None
    assert "v2_over_v1" not in r2
    r3 = B.derive({"heads": 8, "tokens": 32, "kv_format": "fp8_ds_mla", "us": 60.0, "flashmla_us": 50.0,
                   "v2_us": 40.0}, 4.0e12)
    assert r3["v2_over_v1"] == pytest.approx(40 / 60) and r3["v2_ratio_vs_flashmla"] == pytest.approx(0.8)


def test_v2_arm_says_why_it_did_not_run():
    """The v2 arm records why a point has no v2 time (here: no CUDA, or a format v2 lacks) instead
    of failing the point."""
    q = torch.zeros(2, 8, 576, dtype=torch.float16)
    rec: dict = {}
    B.v2_arm(rec, [q], None, [None], "fp8_ds_mla", [None], [None], None, rep=1)
    assert "v2_us" not in rec and rec["v2_skipped"]
    rec = {}
    B.v2_arm(rec, [q], None, [None], "fp8", [None], [None], None, rep=1)
    assert "CUDA" in rec["v2_skipped"] or "Gluon" in rec["v2_skipped"]


def test_merge_bytes_fixed():
    # H=64, T=16 (the end-to-end profile's shape), 16 splits of one 64-head block
    mb = B.merge_bytes(64, 16, 16, 64)
    assert mb["partials_written"] == mb["separate_read"] == 16 * 64 * 16 * 2052 == 33619968
    assert mb["out_written"] == 16 * 64 * 1028 and mb["fused_programs"] == 16
    assert mb["fused_bytes_per_program"] == 16 * 64 * 2052
    # H=8 in a 16-head block: the fused program reads the 8 real heads' partials only
    assert B.merge_bytes(8, 1, 64, 16)["fused_bytes_per_program"] == 64 * 8 * 2052
    assert B.MERGE_MODES == __import__("kernels.triton_sparse_mla", fromlist=["x"]).MERGE_MODES


def test_merge_table_and_md_output(tmp_path):
    recs = [_rec("fp8_ds_mla", 8, 1, 10.0), _rec("fp8_ds_mla", 8, 128, 170.0), _rec("fp8_ds_mla", 64, 128, 300.0)]
    recs[0].update(merge="separate", num_splits=64, us_separate=10.0, us_fused=14.0, rel_err_fused=4.5e-3,
                   rel_err_separate=4.4e-3, merge_bytes=B.merge_bytes(8, 1, 64, 16))
    recs[1].update(merge="fused", num_splits=2, us_fused=170.0, us_separate=173.4, rel_err_fused=4.4e-3,
                   rel_err_separate=4.4e-3, merge_bytes=B.merge_bytes(8, 128, 2, 16))
    recs[2].update(merge=None, num_splits=1)  # no split: no merge row
    lines = B.merge_table(recs)
    assert lines[0] == B.MERGE_COLUMNS and len(lines) == 4
    assert lines[2] == "| fp8_ds_mla | 8 | 1 | 64 | separate | 14.0 | 10.0 | 1.40 | 1.05 | 1.051 | 4.5e-03 | 4.4e-03 |"
    assert lines[3].startswith("| fp8_ds_mla | 8 | 128 | 2 | fused | 170.0 | 173.4 | 0.98 |")
    # the decode table (and so the README's) is unchanged by the new keys
    assert B.decode_table(recs)[2] == B.decode_table([_rec("fp8_ds_mla", 8, 1, 10.0)])[2]
    B.write_outputs(_result(recs, "python bench/sparse_mla_decode.py"), tmp_path, "d")
    md = (tmp_path / "d.md").read_text()
    assert "Merge of the split path, both variants" in md and lines[2] in md
    B.write_outputs(_result([_rec("fp8_ds_mla", 8, 1, 10.0)], "python bench/sparse_mla_decode.py"), tmp_path, "e")
    assert "Merge of the split path" not in (tmp_path / "e.md").read_text()  # an old results file


def test_flashmla_padding_rule():
    assert [B.flashmla_padded_heads(h) for h in (1, 8, 64, 65, 128)] == [64, 64, 64, 128, 128]


# ---------------------------------------------------------------------------------------------
# time budget, statistics
# ---------------------------------------------------------------------------------------------

def test_time_budget_with_fake_clock():
    now = [100.0]
    b = common.TimeBudget(60, reserve_s=10, clock=lambda: now[0])
    assert b.allows(49.0) and not b.allows(51.0)
    now[0] = 140.0
    assert b.elapsed() == 40 and b.left() == 20 and b.allows(9.0) and not b.allows(11.0)
    assert common.TimeBudget(None).allows(1e9)
    assert common.median([3, 1, 2]) == 2
    with pytest.raises(ValueError):
        common.median([])


# ---------------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------------

def test_pin_wheel_reads_pins_lock():
    pin, wheel = common.pin_wheel()
    assert pin == "0.26.0" and wheel.name == "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert common.pin_wheel("0.33.0")[1].name.startswith("vllm-0.33.0")
    with pytest.raises(ValueError, match="not in pins.lock"):
        common.pin_wheel("0.1.0")


def test_stage_members_from_a_wheel(tmp_path):
    whl = tmp_path / "fake.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("vllm/_flashmla_C.abi3.so", b"\x7fELF" + b"x" * 100)
        z.writestr("vllm/third_party/flashmla/flash_mla_interface.py", "X = 1\n")
        z.writestr("vllm/big.so", b"\x7fELF" + b"y" * 5000)
    peers = tmp_path / "peers"
    d = common.stage_members(common.FLASHMLA_MEMBERS, "0.26.0", peers, wheel=whl)
    assert d == peers / "0.26.0"
    assert (d / "vllm/_flashmla_C.abi3.so").read_bytes().startswith(b"\x7fELF")
    for init in ("vllm/__init__.py", "vllm/third_party/__init__.py", "vllm/third_party/flashmla/__init__.py"):
        assert (d / init).exists()
    common.stage_members({"vllm/big.so": "vllm/big.so"}, "0.26.0", peers, compress=True, wheel=whl)
    xz = d / "vllm/big.so.xz"
    assert lzma.decompress(xz.read_bytes()) == b"\x7fELF" + b"y" * 5000
    assert common.peers_bytes(peers) == sum(p.stat().st_size for p in peers.rglob("*") if p.is_file())
    with pytest.raises(FileNotFoundError, match="not cached"):
        common.stage_members(common.FLASHMLA_MEMBERS, "0.26.0", peers, wheel=tmp_path / "missing.whl")


def test_load_vllm_c_says_why(tmp_path):
    ok, why = common.load_vllm_c("0.26.0", carry=tmp_path)
    assert not ok and "e2e/gpu_tests.py --prepare" in why
    (tmp_path / "manifest.json").write_text(json.dumps({"pins": {"0.26.0": {"torch": "0.0.1", "name": "x.so",
                                                                             "path": "x.so.xz", "sha256": "0" * 64}}}))
    ok, why = common.load_vllm_c("0.26.0", carry=tmp_path)
    assert not ok and "built for torch 0.0.1" in why
    ok, why = common.load_vllm_c("0.33.0", carry=tmp_path)
    assert not ok and "no vLLM 0.33.0 library" in why


def test_load_flashmla_without_wheel_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "WHEEL_DIR", tmp_path)
    fmi, why = common.load_flashmla("0.26.0", peers=tmp_path / "peers")
    assert fmi is None and "not cached" in why


# ---------------------------------------------------------------------------------------------
# results merging and tables
# ---------------------------------------------------------------------------------------------

def _rec(fmt, h, t, us, proxy=False, cmd="python bench/sparse_mla_decode.py"):
    r = B.derive({"heads": h, "tokens": t, "kv_format": fmt, "us": us, "gather_us": us / 2,
                  "flashmla_us": us * 2, "flashmla_kernel_us": us, "host_us": 7.5, "rel_err": 4.4e-3}, 4e12)
    r["sm120_proxy"] = proxy
    r["command"] = cmd
    return r


def _result(recs, cmd, proxy=False):
    return {"command": cmd, "device": "NVIDIA H200", "copy_bw_GBps": 4000.0, "topk": 2048, "sm120_proxy": proxy,
            "records": recs}


def test_merge_keeps_unmeasured_and_replaces_measured():
    c1, c2 = "python bench/sparse_mla_decode.py", "DISABLE_MMA_V3=1 python bench/sparse_mla_decode.py --sm120-proxy"
    main = _result([_rec("fp8_ds_mla", 8, 1, 10.0), _rec("fp8_ds_mla", 8, 32, 60.0)], c1)
    m1 = B.merge_results(None, main)
    assert m1["runs"] == [B.run_meta(main)] and len(m1["records"]) == 2
    proxy = _result([_rec("fp8_ds_mla", 8, 1, 12.0, True, c2)], c2, proxy=True)
    m2 = B.merge_results(m1, proxy)
    assert m2["command"] == c1  # top level stays the main run's
    assert [(r["sm120_proxy"], r["tokens"]) for r in m2["records"]] == [(False, 1), (False, 32), (True, 1)]
    assert [r["command"] for r in m2["runs"]] == [c1, c2]
    # a later main run of one shape replaces that record only; both runs stay
    c3 = "python bench/sparse_mla_decode.py --tokens 32 --append"
    m3 = B.merge_results(m2, _result([_rec("fp8_ds_mla", 8, 32, 40.0, cmd=c3)], c3))
    us = {(r["sm120_proxy"], r["tokens"]): r["us"] for r in m3["records"]}
    assert us == {(False, 1): 10.0, (False, 32): 40.0, (True, 1): 12.0}
    assert [r["command"] for r in m3["runs"]] == [c1, c2, c3] and m3["command"] == c3


def test_tables_and_readme_sections(tmp_path):
    recs = [_rec("fp8_ds_mla", 8, 1, 10.0), _rec("fp8", 8, 1, 9.0), _rec("fp8_ds_mla", 8, 1, 12.0, True)]
    res = dict(_result(recs, "python bench/sparse_mla_decode.py"), runs=[{"command": "python bench/sparse_mla_decode.py"}])
    lines = B.decode_table(recs)
    assert lines[0] == B.DECODE_COLUMNS and len(lines) == 4  # header, rule, two non-proxy rows
    # a point where v1 ran (no v2 time): "ours" is its time
    assert lines[2] == ("| fp8_ds_mla | 8 | 1 | v1 | 10.0 | 10.0 | 5.0 | 2.00 | 20.0 | 0.50 | 10.0 | 1.00 | 7.5 | "
                        f"{recs[0]['pct_copy_bw']:.0f} | 4.4e-03 |")
    # where v2 ran, "ours" is v2's time, its ratios and its error; v1's time stays beside it
    v2rec = B.derive(dict(_rec("fp8_ds_mla", 8, 64, 100.0), v2_us=60.0, v2_rel_err=5e-3), 4e12)
    assert v2rec["path"] == "v2" and v2rec["ours_us"] == 60.0
    assert v2rec["ours_ratio_vs_flashmla"] == 60.0 / v2rec["flashmla_us"]
    row = B.decode_table([v2rec])[2]
    assert row.startswith("| fp8_ds_mla | 8 | 64 | v2 | 60.0 | 100.0 | ") and row.endswith(" | 5.0e-03 |")
    assert len(B.decode_table(recs, proxy=True)) == 3
    (tmp_path / "sparse_decode_h200.json").write_text(json.dumps(res))
    pre = {"device": "NVIDIA H200", "topk": 2048, "runs": [{"command": "python bench/sparse_mla_decode.py --prefill"}],
           "records": [{"context": 8192, "heads": 8, "tokens": 8192, "us": 900.0, "flashmla_us": 1000.0,
                        "ratio_vs_flashmla": 0.9, "workspace_us": 500.0, "workspace_ratio_vs_flashmla": 0.5, "flashmla_path": "FP8 decode kernel, heads padded to 64",
                        "host_us": 8.0, "rel_err_sampled_rows": 4e-3}]}
    (tmp_path / "sparse_prefill_h200.json").write_text(json.dumps(pre))
    readme = ("intro\n<!-- sparse-mla-decode:begin -->\nstale\n<!-- sparse-mla-decode:end -->\nmiddle\n"
              "<!-- sparse-mla-decode-tp:begin -->\n<!-- sparse-mla-decode-tp:end -->\n"
              "<!-- sparse-mla-prefill:begin -->\n<!-- sparse-mla-prefill:end -->\n"
              "<!-- sparse-mla-prefill-h100:begin -->\n<!-- sparse-mla-prefill-h100:end -->\nend\n")
    out = RT.render_readme(readme, tmp_path)
    assert out.startswith("intro\n") and out.endswith("end\n") and "\nmiddle\n" in out and "stale" not in out
    assert "| fp8_ds_mla | 8 | 1 | v1 | 10.0 |" in out and "| fp8 | 8 | 1 |" not in out  # fp8_ds_mla rows only
    assert "SM120 proxy" in out and "| 8192 | 8 | 8192 | 900.0 | 500.0 | 1000.0 | 0.90 | 0.50 |" in out
    assert "`python bench/sparse_mla_decode.py --prefill`" in out
    assert "no decode results yet" in out  # the TP table's file is not there
    (tmp_path / f"{RT.TP_DECODE_STEM}.json").write_text(json.dumps(dict(res, device="NVIDIA H100 80GB HBM3")))
    out = RT.render_readme(readme, tmp_path)
    assert out.count("| fp8_ds_mla | 8 | 1 | v1 | 10.0 |") == 2 and "NVIDIA H100 80GB HBM3, topk" in out
    assert RT.render_readme(out, tmp_path) == out  # idempotent
    (tmp_path / "sparse_prefill_h200.json").unlink()
    assert "no prefill results yet" in RT.render_readme(readme, tmp_path)
    with pytest.raises(ValueError, match="exactly one"):
        RT.replace_section("no markers", "sparse-mla-decode", ["x"])
    with pytest.raises(ValueError, match="comes before"):
        RT.replace_section("<!-- a:end -->\n<!-- a:begin -->", "a", ["x"])


def test_committed_readme_tables_are_current():
    """README.md's sparse-MLA tables are what bench/readme_tables.py makes of the committed JSON."""
    assert RT.main(["--check"]) == 0


# ---------------------------------------------------------------------------------------------
# CPU runs of the gather kernel (interpreter) and of the prefill inputs
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not INTERPRET, reason="CPU interpreter run")
@pytest.mark.parametrize("row_bytes", [656, 576, 1152])
def test_gather_reads_exactly_the_selected_rows(row_bytes):
    g = torch.Generator().manual_seed(1)
    words = torch.randint(-2**20, 2**20, (300, row_bytes // 4), dtype=torch.int32, generator=g)
    idx = torch.randint(0, 300, (3, 50), dtype=torch.int32, generator=g)
    idx[1, :7] = -1  # padding: read nothing
    idx[2, 5:9] = 300 + torch.arange(4, dtype=torch.int32)  # past the pool: read nothing either
    f = B.gather_fn(words, idx, num_sms=2, block_n=16, warps=4, waves=2)
    f()
    out = f.out.view(3, -1, f.W)  # [T, splits, W] partial checksums
    got = out.sum(1)[:, :row_bytes // 4].to(torch.int32)
    ok = (idx >= 0) & (idx < 300)
    want = torch.stack([words[idx[t][ok[t]].long()].sum(0) for t in range(3)]).to(torch.int32)
    assert torch.equal(got, want)
    assert torch.equal(out.sum(1)[:, row_bytes // 4:], torch.zeros_like(out.sum(1)[:, row_bytes // 4:]))


def test_prefill_inputs_are_causal_topk():
    ctx, chunk = 2560, 600
    q, table, pos, slots, lengths = B.prefill_inputs(ctx, 2, "cpu", seed=3, chunk=chunk)
    assert q.shape == (chunk, 2, 576) and pos.shape == slots.shape == (chunk, B.TOPK)
    p = ctx - chunk + torch.arange(chunk)
    assert torch.equal(lengths, torch.clamp(p + 1, max=B.TOPK).to(torch.int32))
    for r in (0, 86, 87, 599):
        v = pos[r][pos[r] >= 0].long()
        assert len(v) == lengths[r] and len(set(v.tolist())) == len(v) and int(v.max()) <= int(p[r])
        assert (pos[r][len(v):] == -1).all()  # valid entries first, then padding
        want = table.long()[v // B.BLOCK_SIZE] * B.BLOCK_SIZE + v % B.BLOCK_SIZE
        assert torch.equal(slots[r][: len(v)].long(), want) and (slots[r][len(v):] == -1).all()


# ---------------------------------------------------------------------------------------------
# the FlashMLA call shapes (a stand-in records what the bench hands the interface)
# ---------------------------------------------------------------------------------------------

class _FakeFlashMLA:
    def __init__(self):
        self.calls = []

    def get_mla_metadata(self):
        return object(), None

    def flash_mla_with_kvcache(self, **kw):
        self.calls.append(("decode", kw))
        q = kw["q"]
        return q[..., :512] * 2, torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def flash_mla_sparse_fwd(self, q, kv, indices, scale, topk_length=None):
        self.calls.append(("sparse_fwd", dict(q=q, kv=kv, indices=indices, topk_length=topk_length)))
        return q[..., :512] * 3, None, None


def test_flashmla_decode_as_vllm_and_kernel_alone():
    fmi = _FakeFlashMLA()
    T, H = 3, 8
    q = torch.randn(T, H, 576)
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
    idx = torch.zeros(T, 16, dtype=torch.int32)
    o, _ = B.flashmla_fn(fmi, q, cache, idx, object())()
    kw = fmi.calls[-1][1]
    assert kw["q"].shape == (T, 1, 64, 576) and torch.equal(kw["q"][:, 0, :H], q) and not kw["q"][:, :, H:].any()
    assert kw["indices"].shape == (T, 1, 16) and kw["k_cache"].shape == (4, 64, 1, 656)
    # sliced back as a view, as reshape_attn_output_for_spec_decode does (no copy)
    assert o.shape == (T, H, 512) and o.stride() == (64 * 512, 512, 1) and torch.equal(o, 2 * q[..., :512])
    fmi.calls.clear()
    B.flashmla_fn(fmi, q, cache, idx, object(), as_vllm=False)()
    assert fmi.calls[-1][1]["q"].shape == (T, 1, 64, 576)


@pytest.mark.parametrize("H", [8, 64])
def test_flashmla_prefill_paths(H):
    """Below 32 heads FLASHMLA_SPARSE runs its FP8 decode kernel over all rows (heads padded to
    64); from 32 heads: upconvert into the bf16 workspace, then flash_mla_sparse_fwd over it with
    request positions as indices and the valid counts as topk_length."""
    fmi = _FakeFlashMLA()
    ctx, chunk = 2560, 40
    q, table, pos, slots, lengths = B.prefill_inputs(ctx, H, "cpu", seed=5, chunk=chunk)
    q = q.float()
    cache = torch.randint(0, 100, (B.POOL_TOKENS // B.BLOCK_SIZE, B.BLOCK_SIZE, 656), dtype=torch.uint8)
    cache[..., 512:528] = torch.full((1,), 0.5).view(torch.uint8).repeat(4)  # finite scales
    steps, what = B.flashmla_prefill_fns(fmi, False, q, cache, table, pos, slots, lengths, ctx, cc_major=9)
    outs = [f() for _, f in steps]
    if H < 32:
        assert [n for n, _ in steps] == ["fp8_decode_kernel_mixed_batch"] and "padded to 64" in what
        kw = fmi.calls[-1][1]
        assert kw["q"].shape == (1, chunk, 64, 576) and torch.equal(kw["indices"][0], slots)
        assert outs[-1].shape == (chunk, H, 512)
    else:
        assert [n for n, _ in steps] == ["upconvert", "flash_mla_sparse_fwd"] and "PyTorch equivalent" in what
        kw = fmi.calls[-1][1]
        assert kw["q"].shape == (chunk, 64, 576) and kw["kv"].shape == (ctx, 1, 576)
        assert torch.equal(kw["indices"][:, 0], pos) and torch.equal(kw["topk_length"], lengths)
        # the workspace holds the request's tokens in order, dequantized
        want = B.upconvert_torch(cache, table, ctx)
        assert torch.equal(kw["kv"][:, 0], want)
        tok = 1234
        blk, off = table[tok // B.BLOCK_SIZE].item(), tok % B.BLOCK_SIZE
        from kernels.mla_kv_format import dequantize_rows, resolve_kv_format
        row = dequantize_rows(cache[blk, off], resolve_kv_format("fp8_ds_mla", torch.bfloat16), None, torch.float32)
        assert torch.equal(want[tok], row.to(torch.bfloat16))
        assert outs[-1].shape == (chunk, H, 512)
        steps128, what128 = B.flashmla_prefill_fns(fmi, False, q, cache, table, pos, slots, lengths, ctx, cc_major=10)
        steps128[-1][1]()
        assert fmi.calls[-1][1]["q"].shape == (chunk, 128, 576) and "multiple of 128" in what128


def test_naive_path_matches_reference_on_cpu():
    from kernels.triton_mla_kv_cache import mla_kv_cache_write_reference
    from kernels.triton_sparse_mla import sparse_mla_decode_reference

    n = 4 * 64
    cache = torch.empty(4, 64, 656, dtype=torch.uint8)
    mla_kv_cache_write_reference(torch.randn(n, 512).bfloat16(), torch.randn(n, 64).bfloat16(), cache,
                                 torch.arange(n), "fp8_ds_mla")
    q = torch.randn(2, 4, 576).bfloat16()
    idx = torch.randint(0, n, (2, 40), dtype=torch.int32)
    idx[0, :5] = -1
    o, _ = B.naive_fn(q, cache, idx, "fp8_ds_mla", None)()
    ro, _ = sparse_mla_decode_reference(q, cache, idx, B.SOFTMAX_SCALE, "fp8_ds_mla")
    assert B.rel_err(o, ro) < 2e-2


def test_time_events_is_the_time_of_one_pass_over_all_steps(monkeypatch):
    """A two-step operation (e.g. gather + attention) costs the sum of its steps: the prefill
    bench once divided by the number of steps too and showed half the time."""
    import torch

    from bench import common

    clock = {"us": 0.0}

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            self.t = clock["us"]

        def synchronize(self):
            pass

        def elapsed_time(self, other):  # ms, like torch.cuda.Event
            return (other.t - self.t) / 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def step(us):
        return lambda: clock.__setitem__("us", clock["us"] + us)

    assert common.time_events([step(10.0), step(30.0)]) == pytest.approx(40.0)
    assert common.time_events([step(25.0)]) == pytest.approx(25.0)


def test_sm120_occupancy_padding_math():
    """--sm120-occupancy: the padded shared memory leaves an SM90 SM exactly the CTAs SM120's
    100 KB holds (1 KB reserved per CTA on both), never less than the kernel uses, and within
    the 227 KB one CTA may take."""
    from bench import sparse_mla_v2_gpu as V

    for shared, want in ((95232, 1), (101376, 1), (54784, 1), (46336, 2), (30000, 3), (8192, 11)):
        n, padded = V.sm120_padded_shared(shared)
        assert n == want == V.SM120_SM_SHARED // (shared + V.CTA_RESERVED), (shared, n)
        assert padded >= shared and padded <= 232448
        on_sm90 = V.SM90_SM_SHARED // (padded + V.CTA_RESERVED)
        assert on_sm90 == n, (shared, padded, on_sm90)
    with pytest.raises(ValueError, match="SM120"):
        V.sm120_padded_shared(109568)  # KEYS_M at BLOCK_N 64: SM90 only

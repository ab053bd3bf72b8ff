# SPDX-License-Identifier: Apache-2.0
"""kernels/mla_kv_format.py: the one table of MLA KV row layouts (CPU, no Triton kernel runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kernels import mla_kv_format as F
from kernels.triton_mla_kv_cache import mla_kv_cache_write_reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name, model_dtype, canon, code, storage, elems, nbytes, scale",
    [
        ("fp8_ds_mla", torch.bfloat16, "fp8_ds_mla", F.FMT_DS_MLA, torch.uint8, 656, 656, "per_group_in_row"),
        ("fp8_ds_mla", None, "fp8_ds_mla", F.FMT_DS_MLA, torch.uint8, 656, 656, "per_group_in_row"),
        ("fp8", torch.bfloat16, "fp8", F.FMT_FP8, torch.uint8, 576, 576, "per_tensor"),
        ("fp8_e4m3", torch.float16, "fp8", F.FMT_FP8, torch.uint8, 576, 576, "per_tensor"),
        ("auto", torch.bfloat16, "bfloat16", F.FMT_16BIT, torch.bfloat16, 576, 1152, "none"),
        ("auto", torch.float16, "float16", F.FMT_16BIT, torch.float16, 576, 1152, "none"),
        ("bfloat16", None, "bfloat16", F.FMT_16BIT, torch.bfloat16, 576, 1152, "none"),
        ("bf16", torch.float16, "bfloat16", F.FMT_16BIT, torch.bfloat16, 576, 1152, "none"),
        ("float16", None, "float16", F.FMT_16BIT, torch.float16, 576, 1152, "none"),
        ("half", None, "float16", F.FMT_16BIT, torch.float16, 576, 1152, "none"),
        ("fp16", None, "float16", F.FMT_16BIT, torch.float16, 576, 1152, "none"),
    ],
)
def test_aliases_and_sizes(name, model_dtype, canon, code, storage, elems, nbytes, scale):
    f = F.resolve_kv_format(name, model_dtype)
    assert (f.name, f.code, f.storage_dtype, f.row_elems, f.row_bytes, f.scale) == (
        canon, code, storage, elems, nbytes, scale)
    assert f.row_elems * storage.itemsize == f.row_bytes
    assert F.resolve_kv_format(name, model_dtype) is f  # cached: one object per (name, dtype)
    assert F.kv_cache_row_elems(name) == elems
    assert f.is_fp8 == (code != F.FMT_16BIT)


def test_ds_mla_layout_offsets():
    """fp8_ds_mla: latent [0, 512), 4 fp32 scales [512, 528), 64 x 16-bit rope [528, 656): the
    offsets the Triton decode and writer kernels hard-code (kernels/triton_*_mla*.py)."""
    f = F.resolve_kv_format("fp8_ds_mla", torch.float16)
    assert (f.latent_offset, f.scale_offset, f.rope_offset, f.scale_group, f.row_align) == (0, 512, 528, 128, 16)
    assert f.rope_dtype == torch.float16 and f.latent_dtype == torch.float8_e4m3fn
    assert f.rope_offset + 2 * F.ROPE_DIM == f.row_bytes
    g = F.resolve_kv_format("fp8", None)
    assert (g.rope_offset, g.scale_offset, g.row_align) == (512, None, 1)
    h = F.resolve_kv_format("auto", torch.bfloat16)
    assert (h.rope_offset, h.row_align) == (1024, 2)


@pytest.mark.parametrize("bad", ["int4", "fp8_e5m2", "FP8", "", None])
def test_unknown_names_raise(bad):
    with pytest.raises(ValueError, match="unknown MLA kv_format"):
        F.resolve_kv_format(bad, torch.bfloat16)


def test_auto_needs_model_dtype_and_16bit():
    with pytest.raises(ValueError, match="needs the model dtype"):
        F.resolve_kv_format("auto")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        F.resolve_kv_format("fp8", torch.float32)


def test_row_bytes():
    assert F.kv_cache_row_bytes("fp8_ds_mla") == 656
    assert F.kv_cache_row_bytes("fp8_e4m3") == 576
    assert F.kv_cache_row_bytes("auto", torch.bfloat16) == 1152
    assert F.kv_cache_row_bytes("bfloat16") == 1152


def test_check_kv_cache_views_and_errors():
    ds = F.resolve_kv_format("fp8_ds_mla", torch.bfloat16)
    c = torch.zeros((3, 16, 1, 656), dtype=torch.float8_e4m3fn)
    v = F.check_kv_cache(c, ds, torch.bfloat16)
    assert v.shape == (3, 16, 656) and v.dtype == torch.uint8
    with pytest.raises(ValueError, match="rows of 656"):
        F.check_kv_cache(torch.zeros((3, 16, 576), dtype=torch.uint8), ds)
    with pytest.raises(ValueError, match="1-byte cache"):
        F.check_kv_cache(torch.zeros((3, 16, 656), dtype=torch.bfloat16), ds)
    with pytest.raises(ValueError, match="contiguous in its last"):
        F.check_kv_cache(torch.zeros((3, 656, 16), dtype=torch.uint8).transpose(1, 2), ds)
    big = torch.zeros((3 * 16 * 656 + 8,), dtype=torch.uint8)
    with pytest.raises(ValueError, match="16-byte aligned"):
        F.check_kv_cache(big[8:].view(3, 16, 656), ds)
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, 1, W\]"):
        F.check_kv_cache(torch.zeros((3, 16, 2, 656), dtype=torch.uint8), ds)
    b16 = F.resolve_kv_format("bfloat16", torch.float16)
    cb = torch.zeros((2, 4, 576), dtype=torch.bfloat16)
    assert F.check_kv_cache(cb, b16) is not None  # the writer: storage dtype only
    with pytest.raises(ValueError, match="must match q dtype"):
        F.check_kv_cache(cb, b16, torch.float16)  # the readers: also the query's dtype
    with pytest.raises(ValueError, match="needs a torch.bfloat16 cache"):
        F.check_kv_cache(cb.half(), b16)


@pytest.mark.parametrize("kv_format, model_dtype", [("fp8_ds_mla", torch.bfloat16), ("fp8_ds_mla", torch.float16),
                                                    ("fp8", torch.bfloat16), ("auto", torch.float16)])
def test_dequantize_rows_inverts_the_writer(kv_format, model_dtype, seed):
    """Rows written by the writer's reference dequantize (through the layout table) back to the
    input within e4m3's half-ulp (relative 2^-4 of each value), the rope exactly
    where it is stored as 16-bit."""
    n = 37
    kv_c = (torch.randn((n, 512)) * (torch.rand((n, 1)) * 4 + 0.1)).to(model_dtype)
    k_pe = torch.randn((n, 64)).to(model_dtype)
    fmt = F.resolve_kv_format(kv_format, model_dtype)
    cache = torch.zeros((5, 8, fmt.row_elems), dtype=fmt.storage_dtype)
    slots = torch.randperm(40)[:n]
    # fp8: a k_scale that keeps every value/k_scale inside e4m3's range (the writer saturates)
    ks = float(torch.cat([kv_c, k_pe], -1).float().abs().max()) / 400 if kv_format == "fp8" else None
    mla_kv_cache_write_reference(kv_c, k_pe, cache, slots, kv_format, ks)
    rows = cache.view(40, fmt.row_elems)[slots]
    got = F.dequantize_rows(rows, fmt, ks)
    assert got.dtype == torch.float64 and got.shape == (n, 576)
    want = torch.cat([kv_c, k_pe], dim=-1).double()
    if fmt.code == F.FMT_16BIT:
        assert torch.equal(got, want)
        return
    if fmt.code == F.FMT_DS_MLA:
        assert torch.equal(got[:, 512:], want[:, 512:])
        # x / s in e4m3 (s = amax / 448): half an ulp, relative 2^-4 for normals, 2^-10 * s for
        # subnormals (e4m3 has 3 mantissa bits, subnormal step 2^-9)
        x = want[:, :512]
        s = (x.abs().unflatten(-1, (4, 128)).amax(-1, keepdim=True) / 448).expand(-1, -1, 128).flatten(-2)
        bound = torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10) * 1.0001
        assert ((got[:, :512] - x).abs() <= bound).all()
    else:
        # value/k_scale in e4m3: relative half-ulp 2^-4, or the subnormal step 2^-9 * k_scale / 2
        err = (got - want).abs()
        assert (err <= torch.maximum(want.abs() * 2.0 ** -4, torch.full_like(want, 2.0 ** -10 * ks)) * 1.0001).all()


def test_kernels_load_by_file_path():
    """tools/sm120_check.py imports kernel files by path as modules of a package named after
    their folder (load_module), so the kernels' plain relative imports resolve there as in
    kernels/ and inside vLLM; the kernel files carry no by-path import fallback of their own."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sm120_check
    finally:
        sys.path.remove(str(ROOT / "tools"))
    for stem in ("triton_sparse_mla", "triton_mla_kv_cache", "triton_sparse_mla_v2"):
        text = (ROOT / "kernels" / f"{stem}.py").read_text()
        assert "spec_from_file_location" not in text and "__package__" not in text, stem
        mod = sm120_check.load_module(ROOT / "kernels" / f"{stem}.py")
        assert mod.__package__ and mod.__name__.endswith("." + stem)
        v1 = mod if stem != "triton_sparse_mla_v2" else mod._v1
        kvf = getattr(v1, "_kvf", None) or mod._kvf
        assert kvf.kv_cache_row_bytes("fp8_ds_mla") == 656 and kvf.__name__ == f"{mod.__package__}.mla_kv_format"
        if stem != "triton_mla_kv_cache":
            assert v1.LATENT_DIM == 512 and v1.HEAD_DIM == 576

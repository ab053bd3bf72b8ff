# SPDX-License-Identifier: Apache-2.0
"""MLA KV-cache writer: bytes vs the PyTorch reference of vLLM's writer (CPU interpreter and GPU),
and on the GPU vs vLLM's own compiled writer kernels (0.26.0 and 0.33.0 cubins, staged in
.peers-carry/ by e2e/gpu_tests.py --prepare)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.triton_mla_kv_cache import (
    WRITE_CONFIGS,
    WRITE_SPLIT_MAX_TOKENS,
    dequantize_mla_kv_cache,
    mla_kv_cache_write,
    mla_kv_cache_write_reference,
    write_config,
)
from tests.triton_interpreter import DEVICE

ROOT = Path(__file__).resolve().parents[2]
WIDTH = {"fp8_ds_mla": 656, "fp8": 576, "fp8_e4m3": 576}


def _cache(fmt, nb, bs, dtype, device, poison=True):
    if fmt in WIDTH:
        c = torch.empty((nb, bs, WIDTH[fmt]), dtype=torch.uint8, device=device)
        return c.fill_(0xA5) if poison else c.zero_()
    c = torch.empty((nb, bs, 576), dtype=dtype, device=device)
    return c.fill_(float("nan")) if poison else c.zero_()


def _inputs(n, dtype, device, strided=False, scale=3.0):
    if strided:  # views with row strides != width, like slices of a fused projection output
        big = torch.randn((n, 512 + 64 + 40), device=device, dtype=torch.float32).to(dtype)
        kv_c, k_pe = big[:, :512], big[:, 512 + 40:]
        kv_c.mul_(scale)
        return kv_c, k_pe
    amp = torch.rand((n, 1), device=device) * scale
    kv_c = (torch.randn((n, 512), device=device) * amp).to(dtype)
    k_pe = torch.randn((n, 64), device=device).to(dtype)
    return kv_c, k_pe


def _check(fmt, dtype, n, nb, bs, device, strided=False, scale_format="arbitrary_fp32", k_scale=None, config=None):
    kv_c, k_pe = _inputs(n, dtype, device, strided)
    # distinct slots, some padding (-1) tokens
    slots = torch.randperm(nb * bs, device=device)[:n].to(torch.int64)
    slots[torch.rand(n, device=device) < 0.2] = -1
    a = _cache(fmt, nb, bs, dtype, device)
    b = a.clone()
    kw = {"ds_scale_format": scale_format}
    mla_kv_cache_write(kv_c, k_pe, a, slots, fmt, k_scale, config=config, **kw)
    mla_kv_cache_write_reference(kv_c, k_pe, b, slots, fmt, k_scale, **kw)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "kernel bytes differ from the reference"
    # untouched slots keep their poison, written ones hold a faithful quantization
    written = slots[slots >= 0]
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=device)
    untouched[written] = False
    flat = a.view(nb * bs, -1).view(torch.uint8)
    poison = _cache(fmt, 1, 1, dtype, device).view(1, -1).view(torch.uint8)
    assert torch.equal(flat[untouched], poison.expand(int(untouched.sum()), -1))
    deq = dequantize_mla_kv_cache(a, fmt, k_scale, rope_dtype=dtype).view(nb * bs, 576)
    keep = slots >= 0
    src = torch.cat([kv_c.float(), k_pe.float()], dim=-1)[keep]
    got = deq[slots[keep]]
    if fmt in ("auto", "bfloat16", "float16"):
        assert torch.equal(got, src)
    else:
        ks = 1.0 if k_scale is None else float(k_scale)
        if fmt == "fp8_ds_mla":
            assert torch.equal(got[:, 512:], src[:, 512:])  # rope stored verbatim
            amax = src[:, :512].abs().unflatten(-1, (4, 128)).amax(-1).repeat_interleave(128, -1)
            bound = amax / 448 * (2 if scale_format == "pow2_fp32" else 1) * 8 * 0.5 + 1e-30
            err = (got[:, :512] - src[:, :512]).abs()
            # e4m3 keeps 3 mantissa bits: |err| <= 2^-4 |x| (normals) or half a subnormal step
            assert bool((err <= torch.maximum(src[:, :512].abs() / 16, bound / 64 + 1e-30)).all())
        else:
            want = src.clamp(-448 * ks, 448 * ks)  # beyond 448 * k_scale the e4m3 value saturates
            err = (got - want).abs()
            # The writer divides by k_scale in fp32 and the cache dequantizes with the fp32 k_scale:
            # half an e4m3 step of ks32, plus the fp32 division's rounding (an x / k_scale just
            # below a rounding tie can land on it: seed 257467233 did, 1e-11 past ks * 2^-10).
            ks32 = float(torch.tensor(ks, dtype=torch.float32))
            lim = torch.maximum(want.abs() / 16, torch.full_like(src, ks32 * 2.0 ** -10)) + want.abs() * 2.0 ** -22
            assert bool((err <= lim).all())


@pytest.mark.parametrize("config", sorted(WRITE_CONFIGS))
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_matches_reference(fmt, dtype, config, seed):
    ks = 0.05 if fmt == "fp8" else None
    _check(fmt, dtype, 13, 4, 16, DEVICE, k_scale=ks, config=config)


def test_write_config_dispatch():
    # decode-sized batches split each row over 5 programs, prefill-sized ones write whole rows
    assert write_config(1) == write_config(WRITE_SPLIT_MAX_TOKENS) == WRITE_CONFIGS["split"]
    assert write_config(WRITE_SPLIT_MAX_TOKENS + 1) == write_config(16384) == WRITE_CONFIGS["rows"]
    kv_c, k_pe = _inputs(2, torch.float16, DEVICE, False)
    cache = _cache("fp8_ds_mla", 1, 16, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="config must be one of"):
        mla_kv_cache_write(kv_c, k_pe, cache, torch.arange(2, device=DEVICE), "fp8_ds_mla", config="fast")


def test_write_pow2_scales_and_strided_views(seed):
    _check("fp8_ds_mla", torch.bfloat16, 11, 3, 16, DEVICE, strided=True, scale_format="pow2_fp32")
    _check("fp8", torch.bfloat16, 9, 3, 16, DEVICE, strided=True, k_scale=torch.tensor([0.03], device=DEVICE))


def test_write_scale_edge_cases():
    """All-zero group (FLT_MIN / 2^-13 scale), saturation, ties of the e4m3 rounding."""
    n = 4
    kv_c = torch.zeros((n, 512), dtype=torch.bfloat16, device=DEVICE)
    kv_c[1, :128] = 336.0  # 336/448 = 0.75 -> pow2 scale 1.0
    kv_c[2] = torch.linspace(-3, 3, 512).to(torch.bfloat16)
    kv_c[3, 5] = -1e30
    k_pe = torch.randn((n, 64), device=DEVICE).to(torch.bfloat16)
    slots = torch.arange(n, device=DEVICE, dtype=torch.int64)
    for sf in ("arbitrary_fp32", "pow2_fp32"):
        a = _cache("fp8_ds_mla", 1, 16, torch.bfloat16, DEVICE)
        b = a.clone()
        mla_kv_cache_write(kv_c, k_pe, a, slots, "fp8_ds_mla", ds_scale_format=sf)
        mla_kv_cache_write_reference(kv_c, k_pe, b, slots, "fp8_ds_mla", ds_scale_format=sf)
        assert torch.equal(a, b)
        sc = a[0, :n, 512:528].contiguous().view(torch.float32)
        if sf == "pow2_fp32":
            assert float(sc[0, 0]) == 2.0 ** -13 and float(sc[1, 0]) == 1.0
        else:
            assert float(sc[0, 0]) == 1.1754943508222875e-38 and float(sc[1, 0]) == 0.75
    # fp8 per-tensor: values beyond 448 * k_scale saturate to +-448
    a = _cache("fp8", 1, 16, torch.bfloat16, DEVICE)
    mla_kv_cache_write(kv_c, k_pe, a, slots, "fp8", 0.5)
    assert int(a[0, 3, 5]) == 0xFE  # -448


def test_write_out_of_range_slot_and_errors():
    kv_c, k_pe = _inputs(3, torch.bfloat16, DEVICE)
    a = _cache("fp8_ds_mla", 2, 16, torch.bfloat16, DEVICE)
    before = a.clone()
    slots = torch.tensor([32, 40, -5], device=DEVICE, dtype=torch.int64)  # 32, 40 >= 2 * 16
    mla_kv_cache_write(kv_c, k_pe, a, slots, "fp8_ds_mla")
    assert torch.equal(a, before)  # nothing written, nothing outside the pool touched
    with pytest.raises(ValueError, match="slot"):
        mla_kv_cache_write(kv_c, k_pe, a, slots, "fp8_ds_mla", validate=True)
    with pytest.raises(ValueError, match="kv_format"):
        mla_kv_cache_write(kv_c, k_pe, a, slots, "fp4")
    with pytest.raises(ValueError, match="rows of 656"):
        mla_kv_cache_write(kv_c, k_pe, a[..., :576], slots, "fp8_ds_mla")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mla_kv_cache_write(kv_c.float(), k_pe.float(), a, slots, "fp8_ds_mla")
    with pytest.raises(ValueError, match="ds_scale_format"):
        mla_kv_cache_write(kv_c, k_pe, a, slots, "fp8_ds_mla", ds_scale_format="ue8m0")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 24), bs=st.sampled_from([16, 64]), fmt=st.sampled_from(["fp8_ds_mla", "fp8", "bfloat16"]),
       sf=st.sampled_from(["arbitrary_fp32", "pow2_fp32"]))
def test_write_property(n, bs, fmt, sf):
    nb = max(1, -(-n // bs)) + 1
    _check(fmt, torch.bfloat16, n, nb, bs, DEVICE, scale_format=sf, k_scale=0.07 if fmt == "fp8" else None)


# --------------------------------------------------------------------------------------------
# GPU: GLM-5-sized writes, and byte equality with vLLM's compiled writer kernels
# --------------------------------------------------------------------------------------------

# staged by `python3 e2e/gpu_tests.py --prepare` (.peers-carry/) or bench/sparse_mla_decode.py
# --prepare-peers (.peers/); required under GLM5_REQUIRE_PEERS=1 (tests/kernels/vllm_peers.py)
CUBIN_DIRS = (ROOT / ".peers-carry" / "vllm_cubins", ROOT / ".peers" / "vllm_cubins")
_MANGLED = {  # <bf16 input, uint8 cache, kFp8E4M3>; 0.33.0 added a `skip_scale` bool (false) to the fp8 writer
    ("0.26.0", "fp8_ds_mla"): "_ZN4vllm30concat_and_cache_ds_mla_kernelI13__nv_bfloat16hLNS_18Fp8KVCacheDataTypeE1EEEvPKT_S5_PT0_PKliiiiiiiPKf",
    ("0.33.0", "fp8_ds_mla"): "_ZN4vllm30concat_and_cache_ds_mla_kernelI13__nv_bfloat16hLNS_18Fp8KVCacheDataTypeE1EEEvPKT_S5_PT0_PKliiiiiiiPKf",
    ("0.26.0", "fp8"): "_ZN4vllm27concat_and_cache_mla_kernelI13__nv_bfloat16hLNS_18Fp8KVCacheDataTypeE1EEEvPKT_S5_PT0_PKliiiiiiiPKf",
    ("0.33.0", "fp8"): "_ZN4vllm27concat_and_cache_mla_kernelI13__nv_bfloat16hLNS_18Fp8KVCacheDataTypeE1ELb0EEEvPKT_S5_PT0_PKliiiiiiiPKf",
}


def _vllm_write(version, fmt, kv_c, k_pe, cache, slots, k_scale):
    """Run vLLM's own writer kernel (sm_90 cubin from the release wheel) via CuPy."""
    from tests.kernels import vllm_peers

    try:
        import cupy as cp
    except ImportError:
        vllm_peers.unavailable("CuPy is not installed (it launches vLLM's writer cubins)")
    import numpy as np

    name = f"cache_kernels_sm90_{version}.cubin"
    path = next((d / name for d in CUBIN_DIRS if (d / name).exists()), None)
    if path is None:
        vllm_peers.unavailable(f"{name} not staged (python3 e2e/gpu_tests.py --prepare)")
    mod = cp.RawModule(path=str(path))
    fn = mod.get_function(_MANGLED[(version, fmt)])
    n = kv_c.shape[0]
    block = 96 if fmt == "fp8_ds_mla" else 512
    args = (kv_c.data_ptr(), k_pe.data_ptr(), cache.data_ptr(), slots.data_ptr(),
            np.int32(cache.stride(0)), np.int32(cache.stride(1)), np.int32(kv_c.stride(0)), np.int32(k_pe.stride(0)),
            np.int32(512), np.int32(64), np.int32(cache.shape[1]), k_scale.data_ptr())
    args = tuple(np.uint64(a) if isinstance(a, int) else a for a in args)
    torch.cuda.synchronize()
    fn((n,), (block,), args)
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(WRITE_CONFIGS))
@pytest.mark.parametrize("version,fmt,sf", [("0.26.0", "fp8_ds_mla", "arbitrary_fp32"), ("0.33.0", "fp8_ds_mla", "pow2_fp32"),
                                            ("0.26.0", "fp8", None), ("0.33.0", "fp8", None)])
def test_write_bytes_equal_vllm_kernel(version, fmt, sf, config, seed):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("vLLM cubins staged for sm_90")
    n, nb, bs = 4096, 96, 64
    kv_c, k_pe = _inputs(n, torch.bfloat16, "cuda", strided=True, scale=20.0)
    kv_c[0].zero_()
    kv_c[1, :128] = 336.0
    slots = torch.randperm(nb * bs, device="cuda")[:n].to(torch.int64)
    slots[::7] = -1
    ks = torch.tensor([0.037], device="cuda")
    a = _cache(fmt, nb, bs, torch.bfloat16, "cuda")
    b = a.clone()
    c = a.clone()
    mla_kv_cache_write(kv_c, k_pe, a, slots, fmt, ks, ds_scale_format=sf or "arbitrary_fp32", config=config)
    mla_kv_cache_write_reference(kv_c, k_pe, b, slots, fmt, ks, ds_scale_format=sf or "arbitrary_fp32")
    _vllm_write(version, fmt, kv_c, k_pe, c, slots, ks)
    assert torch.equal(b, c), f"reference differs from vLLM {version}'s kernel in {(b != c).sum().item()} bytes"
    assert torch.equal(a, c), f"Triton writer differs from vLLM {version}'s kernel in {(a != c).sum().item()} bytes"


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(WRITE_CONFIGS))
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "bfloat16"])
def test_write_gpu_large(fmt, config, seed):
    _check(fmt, torch.bfloat16, 8192, 160, 64, "cuda", strided=True, k_scale=0.02 if fmt == "fp8" else None,
           config=config)


# --------------------------------------------------------------------------------------------
# Gather + dequantize whole request contexts into a 16-bit workspace
# --------------------------------------------------------------------------------------------

from kernels.mla_kv_format import dequantize_rows, resolve_kv_format  # noqa: E402
from kernels.triton_mla_kv_cache import mla_kv_gather_dequant, mla_kv_gather_dequant_reference  # noqa: E402


@pytest.mark.parametrize("fmt, kscale_tensor", [("fp8_ds_mla", False), ("fp8", False), ("fp8", True), ("auto", False)])
def test_gather_dequant_matches_reference(fmt, kscale_tensor, seed):
    """Two requests of different lengths (one not a block multiple, one spanning blocks of a
    shuffled table) land at their workspace offsets, bit-identical to the reference; rows outside
    the requests stay untouched; a zero-length request writes nothing."""
    dev = DEVICE
    dt = torch.bfloat16 if dev == "cuda" else torch.float16  # the interpreter: fp16 (see test_sparse_mla.py)
    nb, bs = 6, 16
    ks = 0.05
    cache = _cache(fmt, nb, bs, dt, dev)
    n = nb * bs
    kv_c, k_pe = _inputs(n, dt, dev)
    mla_kv_cache_write_reference(kv_c, k_pe, cache, torch.arange(n, device=dev), fmt, ks if fmt == "fp8" else None)
    table = torch.tensor([[4, 1, 0, 0], [2, 5, 3, 0], [0, 0, 0, 0]], dtype=torch.int32, device=dev)
    lens = torch.tensor([21, 40, 0], dtype=torch.int32, device=dev)
    starts = torch.tensor([3, 30, 70], dtype=torch.int32, device=dev)
    k_arg = (torch.tensor([ks], device=dev) if kscale_tensor else ks) if fmt == "fp8" else None
    ws = torch.full((80, 576), float("nan"), dtype=dt, device=dev)
    mla_kv_gather_dequant(cache, table, lens, starts, ws, fmt, k_arg, validate=True)
    ref = torch.full_like(ws, float("nan"))
    mla_kv_gather_dequant_reference(cache, table, lens, starts, ref, fmt, k_arg)
    assert torch.equal(ws.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(ws), torch.nan_to_num(ref))
    written = torch.zeros(80, dtype=torch.bool)
    written[3:24] = True
    written[30:70] = True
    assert not ws[written.to(dev)].isnan().any() and ws[~written.to(dev)].isnan().all()
    # token 17 of request 1 = block table[1, 1] = 5, offset 1
    f = resolve_kv_format(fmt, dt)
    row = dequantize_rows(cache.view(-1, cache.shape[-1])[5 * bs + 1], f, k_arg, torch.float32)
    assert torch.equal(ws[30 + 17], row.to(dt))


def test_gather_dequant_errors():
    cache = torch.zeros((2, 16, 656), dtype=torch.uint8)
    ws = torch.zeros((40, 576), dtype=torch.float16)
    t = torch.zeros((1, 2), dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="workspace must be"):
        mla_kv_gather_dequant(cache, t, one, one, ws[:, :512], "fp8_ds_mla")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mla_kv_gather_dequant(cache, t, one, one, ws.float(), "fp8_ds_mla")
    with pytest.raises(ValueError, match="block_table"):
        mla_kv_gather_dequant(cache, t.long(), one, one, ws, "fp8_ds_mla")
    with pytest.raises(ValueError, match="seq_lens"):
        mla_kv_gather_dequant(cache, t, one.long(), one, ws, "fp8_ds_mla")
    with pytest.raises(ValueError, match="rows of 656"):
        mla_kv_gather_dequant(cache[..., :576], t, one, one, ws, "fp8_ds_mla")
    with pytest.raises(ValueError, match="overflows the workspace"):
        mla_kv_gather_dequant(cache, t, torch.tensor([20], dtype=torch.int32), torch.tensor([30], dtype=torch.int32),
                              ws, "fp8_ds_mla", validate=True)
    with pytest.raises(ValueError, match="exceeds its block table"):
        mla_kv_gather_dequant(cache, t, torch.tensor([33], dtype=torch.int32), one, ws, "fp8_ds_mla", validate=True)

"""bench/kv_cache_write.py on the CPU: the byte comparison against the peer writer and the record,
with Triton's interpreter for our writer, our reference standing in for vLLM's op, and a fake clock."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.triton_interpreter import INTERPRET, torch  # noqa: E402  (sets TRITON_INTERPRET without CUDA)
from bench import common, kv_cache_write  # noqa: E402
from kernels.triton_mla_kv_cache import WRITE_CONFIGS, mla_kv_cache_write_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU test (Triton's interpreter); the GPU runs the bench itself")


class _RefOps:
    def __init__(self, corrupt=False):
        self.corrupt = corrupt

    def concat_and_cache_mla(self, kv_c, k_pe, cache, slots, fmt, k_scale):
        mla_kv_cache_write_reference(kv_c, k_pe, cache, slots, fmt, k_scale)
        if self.corrupt:
            cache.view(-1)[int(slots[0]) * cache.shape[-1]] ^= 1


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(kv_cache_write, "NUM_BLOCKS", 8)
    monkeypatch.setattr(kv_cache_write, "GRAPH_WRITES", 2)
    monkeypatch.setattr(common, "time_graph", lambda fns: float(len(fns)))


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8"])
def test_record_and_byte_check(small, fmt):
    r = kv_cache_write.run_point(5, fmt, _RefOps(), 1e12, dev=torch.device("cpu"))
    assert r["bytes_differing_from_vllm"] == {k: 0 for k in WRITE_CONFIGS}
    assert r["dispatch"] == "split" and r["us"] == r["us_split"] and r["ratio_vs_vllm"] == 1.0
    assert r["floor_us"] == pytest.approx(5 * (1152 + kv_cache_write.ROW_BYTES[fmt]) / 1e12 * 1e6)


def test_a_differing_byte_is_counted(small):
    r = kv_cache_write.run_point(3, "fp8_ds_mla", _RefOps(corrupt=True), 1e12, dev=torch.device("cpu"))
    assert all(v >= 1 for v in r["bytes_differing_from_vllm"].values())

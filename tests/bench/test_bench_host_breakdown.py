# SPDX-License-Identifier: Apache-2.0
"""bench/host_breakdown.py and bench/v2_kernel_split.py on CPU: their shape parsing and that they
refuse to run without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import host_breakdown  # noqa: E402
import v2_kernel_split  # noqa: E402


@pytest.mark.parametrize("mod", [host_breakdown, v2_kernel_split], ids=["host_breakdown", "v2_kernel_split"])
def test_parse_shapes(mod):
    assert mod.parse_shapes("1:8,8192:16") == [(1, 8), (8192, 16)]
    with pytest.raises(ValueError):
        mod.parse_shapes("1x8")


@pytest.mark.parametrize("mod,name", [(host_breakdown, "host_breakdown"), (v2_kernel_split, "v2_kernel_split")])
def test_needs_a_gpu(mod, name, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert mod.main(["--shapes", "1:8"]) == 2
    assert f"{name}: needs a CUDA GPU" in capsys.readouterr().err

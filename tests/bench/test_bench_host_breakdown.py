# SPDX-License-Identifier: Apache-2.0
"""bench/host_breakdown.py on CPU: its shape parsing and that it refuses to run without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import host_breakdown  # noqa: E402


def test_parse_shapes():
    assert host_breakdown.parse_shapes("1:8,8192:16") == [(1, 8), (8192, 16)]
    with pytest.raises(ValueError):
        host_breakdown.parse_shapes("1x8")


def test_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert host_breakdown.main(["--shapes", "1:8"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

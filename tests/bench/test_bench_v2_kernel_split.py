# SPDX-License-Identifier: Apache-2.0
"""bench/v2_kernel_split.py on CPU: its shape parsing and that it refuses to run without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import v2_kernel_split  # noqa: E402


def test_parse_shapes():
    assert v2_kernel_split.parse_shapes("8:32,16:128") == [(8, 32), (16, 128)]
    with pytest.raises(ValueError):
        v2_kernel_split.parse_shapes("8x32")


def test_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert v2_kernel_split.main(["--shapes", "8:32"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

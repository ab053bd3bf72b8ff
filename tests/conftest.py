"""Shared pytest setup for tests/ (tool, kernels, integration).

* markers: ``gpu`` (runs only where CUDA is available; skipped otherwise), ``real_wheel`` (uses
  the pinned vLLM release wheels; they are downloaded once into the wheel cache).
"""
from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "real_wheel: uses the pinned vLLM release wheels (downloaded once, cached)")


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_items:
            item.add_marker(skip)

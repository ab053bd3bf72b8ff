# SPDX-License-Identifier: Apache-2.0
"""Shared setup of the kernel tests (generic: used by every tests/kernels/test_*.py).

* ``gpu`` marker: ``@pytest.mark.gpu`` tests run only where CUDA is available (they are skipped
  otherwise, e.g. on the CPU CI machine).
* Interpreter switch: without CUDA, Triton kernels run in its interpreter. ``TRITON_INTERPRET=1``
  is set here before anything imports triton, unless the environment already decides
  (``TRITON_INTERPRET=0`` forces compiled kernels; ``GLM5_FORCE_INTERPRET=1`` forces the
  interpreter even with a GPU). ``interpreter`` fixture / ``INTERPRET`` tell a test which mode runs.
* Triton 3.6 interpreter fix: with NumPy >= 2.3 its ``tensor.__index__`` fails on runtime-int loop
  bounds (``range(0, n)`` with ``n`` a kernel argument: "only 0-dimensional arrays can be
  converted to Python scalars"). Triton 3.8 squeezes the value; the same one-line fix is applied
  here to the interpreter of older Tritons. It changes nothing for compiled kernels.
* Seeding: every test gets a fresh, logged seed (``GLM5_TEST_SEED`` fixes it to reproduce a
  failure); ``seed`` fixture returns it after seeding torch/random.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # `kernels` importable whatever the working directory
    sys.path.insert(0, _ROOT)

from tests.triton_interpreter import _HAS_CUDA, INTERPRET, torch  # noqa: E402  (sets TRITON_INTERPRET)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA and not INTERPRET:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compiled Triton (interpreter or no CUDA here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def interpreter() -> bool:
    """True when Triton kernels run in the interpreter (CPU)."""
    return INTERPRET


@pytest.fixture
def seed(request) -> int:
    """Seed torch and random with a fresh value per test (or GLM5_TEST_SEED); printed on failure."""
    env = os.environ.get("GLM5_TEST_SEED")
    s = int(env) if env else random.SystemRandom().randrange(2**31)
    random.seed(s)
    if torch is not None:
        torch.manual_seed(s)
    request.node.user_properties.append(("seed", s))
    print(f"[seed] {request.node.nodeid}: GLM5_TEST_SEED={s}")
    return s

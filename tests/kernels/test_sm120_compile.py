# SPDX-License-Identifier: Apache-2.0
"""SM120/SM121 readiness without a GPU: every kernels/*.py that defines SM120_COMPILE_SPECS compiles
each configuration its dispatch can choose for GPUTarget("cuda", 120, 32) and ("cuda", 121, 32)
within 101,376 B of shared memory and without register spills (tools/sm120_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for p in (ROOT / "kernels").glob("*.py") if "SM120_COMPILE_SPECS" in p.read_text())


def test_some_kernel_file_has_specs():
    assert FILES, "no kernels/*.py defines SM120_COMPILE_SPECS"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_sm120_compile(path, tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compile for real (the interpreter replaces @triton.jit)
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "sm120_check.py"), str(path), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    print(res.stdout[-6000:])
    assert res.returncode == 0, f"sm120_check failed for {path.name}:\n{res.stdout[-4000:]}\n{res.stderr[-2000:]}"

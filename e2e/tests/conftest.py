"""Fixtures for the CPU tests of the end-to-end harness (e2e/e2e_*.py).

The harness itself runs on the GPU host; here we test everything that needs neither vLLM's engine
nor a GPU: the model builder (vs transformers' GlmMoeDsaForCausalLM), the planted sparse structure,
the tokenizer, the metrics and criteria, the job runner, the profile summariser, the arithmetic.
Tests that need transformers / safetensors / tokenizers (or vLLM) skip when they are missing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "e2e"
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory):
    """The `micro` preset built once per session (4 heads, hidden 256; real 192/64/256 head dims)."""
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    import e2e_model as M

    d = tmp_path_factory.mktemp("micro")
    M.write_model(d, "micro", seed=0, log=lambda *_: None)
    return d

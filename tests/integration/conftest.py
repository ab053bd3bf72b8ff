"""Fixtures for tests that run against an installed, patched vLLM on a CPU-only machine.

These tests need the overlay's patched vLLM importable (`tools/run_tests.py` installs the
patched wheel of each pin into its own environment and runs them there with
GLM5_OVERLAY_REQUIRE_VLLM=1, which turns a missing or unpatched vLLM into a failure instead
of a skip).

vLLM's CUDA platform module cannot be imported without a GPU driver: its first line loads
`vllm._C_stable_libtorch`, which links libcuda.so.1. The `simulated_cuda` fixture stands in
for exactly that import and for the device capability, and nothing else, so vLLM's own
selector code runs unmodified.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.triton_interpreter import _HAS_CUDA, INTERPRET  # noqa: E402  (sets TRITON_INTERPRET)

if not _HAS_CUDA:
    # vLLM disables Triton at import when no GPU driver is active, except in a distributed
    # worker whose CUDA_VISIBLE_DEVICES is empty; claim that case so vLLM's own Triton kernels
    # (index conversion) run in the interpreter next to ours. Must precede `import vllm`.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# GLM-5's public config.json, as ../shared/models/glm-5/config.json restates it (a copy lives in the
# repository because CI's clean clone has no ../shared; test_glm5_config checks the two agree).
GLM5_CONFIG = REPO / "tests" / "data" / "glm-5-config.json"
SHARED_GLM5_CONFIG = REPO.parent / "shared" / "models" / "glm-5" / "config.json"
OVERLAY_BACKEND_MODULE = "vllm.v1.attention.backends.mla.triton_mla_sparse"


def _require_patched_vllm():
    strict = os.environ.get("GLM5_OVERLAY_REQUIRE_VLLM") == "1"
    try:
        import vllm  # noqa: F401
        import importlib

        importlib.import_module(OVERLAY_BACKEND_MODULE)
    except ImportError as exc:
        if strict:
            pytest.fail(f"patched vLLM is not importable here: {exc}")
        pytest.skip(f"patched vLLM not installed in this environment ({exc})")


@pytest.fixture(scope="session")
def vllm_module():
    _require_patched_vllm()
    import vllm

    return vllm


@pytest.fixture(scope="session")
def glm5_model_dir(tmp_path_factory, vllm_module):
    """A model folder holding only GLM-5's config.json (no weights, no tokenizer)."""
    if not GLM5_CONFIG.exists():
        pytest.fail(f"GLM-5 config not found at {GLM5_CONFIG}")
    d = tmp_path_factory.mktemp("glm5")
    (d / "config.json").write_text(GLM5_CONFIG.read_text())
    return d


def _model_config(directory):
    """vLLM's ModelConfig for the config.json in `directory`, built on the CPU platform (model
    inspection imports attention modules that need the CUDA binaries on a CUDA platform)."""
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(directory),
        tokenizer=str(directory),
        skip_tokenizer_init=True,
        dtype="bfloat16",
    )


@pytest.fixture(scope="session")
def glm5_model_config(glm5_model_dir):
    """vLLM's ModelConfig for the full GLM-5 config."""
    return _model_config(glm5_model_dir)


@pytest.fixture(scope="session")
def glm5_variant(tmp_path_factory, vllm_module):
    """`make(name, **fields)`: vLLM's ModelConfig for GLM-5's config.json with `fields` added
    (e.g. GLM-5.2's IndexCache fields), one per name."""
    made = {}

    def make(name: str, **fields):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            (d / "config.json").write_text(json.dumps({**glm5_config_dict(), **fields}))
            made[name] = _model_config(d)
        return made[name]

    return make


@pytest.fixture
def simulated_cuda(monkeypatch, vllm_module):
    """Make vLLM's current platform its CUDA platform with a chosen device capability.

    Yields a function `set_capability(major, minor)`; the selector's cache is cleared
    around the test so each capability is selected afresh.
    """
    monkeypatch.setitem(
        sys.modules,
        "vllm._C_stable_libtorch",
        sys.modules.get("vllm._C_stable_libtorch")
        or types.ModuleType("vllm._C_stable_libtorch"),
    )
    import vllm.platforms as platforms
    import vllm.platforms.cuda as cuda
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention import selector

    capability = {"value": DeviceCapability(12, 0)}
    platform_cls = cuda.CudaPlatform
    monkeypatch.setattr(
        platform_cls,
        "get_device_capability",
        classmethod(lambda cls, device_id=0: capability["value"]),
    )
    monkeypatch.setattr(platforms, "_current_platform", platform_cls())
    selector._cached_get_attn_backend.cache_clear()

    def set_capability(major: int, minor: int = 0) -> None:
        capability["value"] = DeviceCapability(major, minor)
        selector._cached_get_attn_backend.cache_clear()

    yield set_capability
    selector._cached_get_attn_backend.cache_clear()


def glm5_config_dict() -> dict:
    return json.loads(GLM5_CONFIG.read_text())


def triton_indexer_wired() -> bool:
    """Whether this pin's patched sparse_attn_indexer can run the Triton DSA kernels (every
    pin's series wires it)."""
    import inspect

    from vllm.model_executor.layers import sparse_attn_indexer

    return "indexer_backend" in inspect.signature(
        sparse_attn_indexer.sparse_attn_indexer
    ).parameters


@pytest.fixture
def require_triton_indexer(vllm_module):
    # Every pin's series wires it: a patched tree without it is a broken patch, so fail.
    if not triton_indexer_wired():
        pytest.fail(
            "the Triton DSA indexer is not wired into this pin's sparse_attn_indexer "
            "(no indexer_backend parameter): the pin's indexer patch is missing or broken"
        )

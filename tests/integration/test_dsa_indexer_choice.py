"""Which DSA indexer runs (``kernel_config.sparse_indexer_backend``, resolved by
``vllm/v1/attention/ops/sparse_indexer_backend.py``): with "auto", DeepGEMM only where its kernels
are built for the device and its JIT finds a compiler; the Triton kernels otherwise, or when
TRITON_MLA_SPARSE serves the model; "deep_gemm" and "triton" as asked, where they can run. Runs
under each pin's patched vLLM (vLLM's own selector and platform code; the device capability
simulated, see conftest.py), so every case runs on every pin.

The toolchain probe (``find_deep_gemm_jit_toolchain``) is tested on fake CUDA homes: folders
holding an ``nvcc`` shell script that prints a release number, as the real one does.
"""

from __future__ import annotations

import logging
import os
import stat

import pytest

from tests.integration.test_vllm_selection import BACKEND, _flashinfer_sm120, _select

FOUND = ("found", True)
MISSING = ("missing", False)


@pytest.fixture
def choice(vllm_module, monkeypatch):
    """`decide(glm5_model_config, kv_cache_dtype, backend=None, toolchain=True)`: (use_triton,
    reason, the info lines logged) for a model whose attention selection is made with `backend`,
    with DeepGEMM importable and its JIT toolchain found or not."""
    import vllm.utils.deep_gemm as deep_gemm
    from vllm.config import set_current_vllm_config
    from vllm.logger import _print_info_once, _print_warning_once
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: True)
    # cached per process in vLLM; the capability changes from test to test here
    mx = getattr(deep_gemm, "mqa_logits_use_mx_scales", None)
    if mx is not None and hasattr(mx, "cache_clear"):
        mx.cache_clear()

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    sib.logger.addHandler(handler)
    old_level, old_disabled = sib.logger.level, sib.logger.disabled
    sib.logger.setLevel(logging.DEBUG)
    # a logging.config.dictConfig run by an earlier test (vLLM's CLI parsing) may have disabled
    # the loggers that existed then
    sib.logger.disabled = False

    def decide(model_config, kv_cache_dtype, backend=None, toolchain=True, nvcc=(12, 9),
               requested=None):
        import vllm.platforms as platforms

        # vllm.utils.deep_gemm bound the platform of its import (the CPU one here); in a
        # serving process that is the CUDA platform the capability is simulated on
        monkeypatch.setattr(deep_gemm, "current_platform", platforms._current_platform)
        if mx is not None and hasattr(mx, "cache_clear"):
            mx.cache_clear()
        found = sib.JitToolchain(True, "nvcc %d.%d at /fake/bin/nvcc" % nvcc, nvcc)
        missing = sib.JitToolchain(False, "no nvcc at /fake/bin/nvcc")
        monkeypatch.setattr(sib, "deep_gemm_jit_toolchain", lambda: found if toolchain else missing)
        _print_info_once.cache_clear()
        _print_warning_once.cache_clear()
        records.clear()
        _, vllm_config = _select(model_config, kv_cache_dtype, backend=backend)
        if requested is not None:
            vllm_config.kernel_config.sparse_indexer_backend = requested
        with set_current_vllm_config(vllm_config):  # as during model construction
            chosen, reason = sib.choose_sparse_indexer_backend(vllm_config)
            resolved = sib.resolve_sparse_indexer_backend(vllm_config)
        assert resolved == chosen
        # decided once: the answer is now the config's, and asking again changes nothing
        assert vllm_config.kernel_config.sparse_indexer_backend == chosen
        assert sib.resolve_sparse_indexer_backend(vllm_config) == chosen
        assert chosen in ("deep_gemm", "triton")
        return chosen == "triton", reason, list(records)

    yield decide
    sib.logger.removeHandler(handler)
    sib.logger.setLevel(old_level)
    sib.logger.disabled = old_disabled
    if mx is not None and hasattr(mx, "cache_clear"):
        mx.cache_clear()


def _mx_scales() -> bool:
    import vllm.utils.deep_gemm as deep_gemm

    return getattr(deep_gemm, "mqa_logits_use_mx_scales", lambda: False)()


def _info(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.INFO]


# --- the decision, one test per case ------------------------------------------------------------


def test_sm90_with_toolchain_runs_deepgemm(simulated_cuda, glm5_model_config, choice):
    simulated_cuda(9, 0)
    use_triton, reason, _ = choice(glm5_model_config, "fp8_ds_mla", toolchain=True)
    assert not use_triton
    assert "FLASHMLA_SPARSE serves" in reason and "SM90" in reason and "nvcc 12.9" in reason


def test_sm90_without_toolchain_runs_triton(simulated_cuda, glm5_model_config, choice):
    simulated_cuda(9, 0)
    use_triton, reason, _ = choice(glm5_model_config, "fp8_ds_mla", toolchain=False)
    assert use_triton
    assert "cannot JIT-compile" in reason and "no nvcc at /fake/bin/nvcc" in reason


@pytest.mark.parametrize("minor", [0, 1])
@pytest.mark.parametrize("toolchain", [True, False])
def test_sm12x_runs_triton_with_triton_mla_sparse(
    simulated_cuda, monkeypatch, glm5_model_config, choice, minor, toolchain
):
    """SM120/SM121 without FlashInfer's SM120 sparse MLA: vLLM picks TRITON_MLA_SPARSE, and the
    indexer runs on Triton whatever the toolchain."""
    _flashinfer_sm120(monkeypatch, available=False)
    simulated_cuda(12, minor)
    use_triton, reason, _ = choice(glm5_model_config, "fp8_ds_mla", toolchain=toolchain)
    assert use_triton
    assert reason == f"{BACKEND} serves the sparse MLA layers (vLLM's choice)"


@pytest.mark.parametrize("minor", [0, 1])
def test_sm12x_with_flashinfer_follows_the_toolchain(
    simulated_cuda, monkeypatch, glm5_model_config, choice, minor
):
    """SM120/SM121 with FlashInfer's SM120 sparse MLA serving the model: the vendored DeepGEMM
    has SM120 builds of the indexer kernels (sm120_fp8_mqa_logits.cuh,
    sm120_fp8_paged_mqa_logits.cuh at both pins), so it runs when its JIT finds nvcc."""
    _flashinfer_sm120(monkeypatch, available=True)
    simulated_cuda(12, minor)
    use_triton, reason, _ = choice(glm5_model_config, "fp8_ds_mla", toolchain=True)
    assert not use_triton
    assert "FLASHINFER_MLA_SPARSE_SM120 serves" in reason and f"SM12{minor}" in reason
    use_triton, reason, _ = choice(glm5_model_config, "fp8_ds_mla", toolchain=False)
    assert use_triton
    assert "cannot JIT-compile" in reason


@pytest.mark.parametrize(
    "capability,backend,nvcc,deepgemm",
    [((12, 0), None, (12, 7), False), ((12, 0), None, (12, 8), True),
     ((12, 1), None, (12, 8), False), ((12, 1), None, (12, 9), True),
     ((10, 0), "FLASHMLA_SPARSE", (12, 4), False), ((9, 0), None, (12, 4), True)],
)
def test_nvcc_must_know_the_device(
    simulated_cuda, monkeypatch, glm5_model_config, choice, capability, backend, nvcc, deepgemm
):
    """An nvcc that DeepGEMM accepts (0.26.0's takes 12.3+) but that predates the device
    (sm_100/sm_120 from CUDA 12.8, sm_121 from 12.9) cannot build its kernels: Triton."""
    _flashinfer_sm120(monkeypatch, available=True)
    simulated_cuda(*capability)
    use_triton, reason, _ = choice(
        glm5_model_config, "fp8_ds_mla", backend=backend, toolchain=True, nvcc=nvcc
    )
    if _mx_scales():  # 0.33.0 on SM100: DeepGEMM whatever the nvcc
        assert not use_triton
        return
    assert use_triton == (not deepgemm), reason
    if not deepgemm:
        sm = "SM%d%d" % capability
        assert f"cannot JIT-compile its kernels for {sm}" in reason
        assert "nvcc %d.%d at /fake/bin/nvcc" % nvcc in reason


def test_sm100_with_toolchain_runs_deepgemm(simulated_cuda, glm5_model_config, choice):
    simulated_cuda(10, 0)
    use_triton, reason, _ = choice(
        glm5_model_config, "fp8_ds_mla", backend="FLASHMLA_SPARSE", toolchain=True
    )
    assert not use_triton
    if _mx_scales():  # 0.33.0: the indexer cache holds MX scales on SM100
        assert "MX scales on SM100" in reason
    else:
        assert "FLASHMLA_SPARSE serves" in reason and "SM100" in reason


def test_sm100_without_toolchain(simulated_cuda, glm5_model_config, choice):
    """0.26.0: Triton. 0.33.0: DeepGEMM still (only it reads the MX-scale cache), with a warning
    instead of an exception."""
    simulated_cuda(10, 0)
    use_triton, reason, records = choice(
        glm5_model_config, "fp8_ds_mla", backend="FLASHMLA_SPARSE", toolchain=False
    )
    if _mx_scales():
        assert not use_triton
        warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "no nvcc at /fake/bin/nvcc" in warnings[0]
    else:
        assert use_triton
        assert "cannot JIT-compile" in reason


def test_requested_triton_backend_is_honoured(simulated_cuda, glm5_model_config, choice):
    """--attention-backend TRITON_MLA_SPARSE puts the indexer on Triton where DeepGEMM could run
    (except where the cache holds MX scales, test_vllm_selection.py)."""
    simulated_cuda(9, 0)
    use_triton, reason, _ = choice(glm5_model_config, "fp8", backend=BACKEND, toolchain=True)
    assert use_triton
    assert reason == f"{BACKEND} serves the sparse MLA layers (requested)"


def test_requested_other_backend_keeps_deepgemm(
    simulated_cuda, monkeypatch, glm5_model_config, choice
):
    """An explicitly requested DeepGEMM-era backend is not overridden on SM12x either."""
    _flashinfer_sm120(monkeypatch, available=True)
    simulated_cuda(12, 0)
    use_triton, reason, _ = choice(
        glm5_model_config, "fp8_ds_mla", backend="FLASHINFER_MLA_SPARSE_SM120", toolchain=True
    )
    assert not use_triton
    assert "FLASHINFER_MLA_SPARSE_SM120 serves" in reason


def test_unsupported_architecture_runs_triton(simulated_cuda, glm5_model_config, choice):
    simulated_cuda(8, 9)
    use_triton, reason, _ = choice(glm5_model_config, "fp8", backend=BACKEND, toolchain=True)
    assert use_triton
    assert reason == "DeepGEMM's indexer kernels are built for SM90, SM10x and SM12x, not SM89"


def test_missing_deepgemm_runs_triton(simulated_cuda, monkeypatch, glm5_model_config, choice):
    import vllm.utils.deep_gemm as deep_gemm

    simulated_cuda(9, 0)
    monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: False)
    use_triton, reason, _ = choice(glm5_model_config, "fp8_ds_mla", toolchain=True)
    assert use_triton and reason == "DeepGEMM is not installed"


@pytest.mark.parametrize("toolchain", [True, False])
def test_logs_path_and_reason_once(simulated_cuda, glm5_model_config, choice, toolchain):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    simulated_cuda(9, 0)
    use_triton, reason, records = choice(glm5_model_config, "fp8_ds_mla", toolchain=toolchain)
    path = "Triton kernels" if use_triton else "DeepGEMM"
    assert _info(records) == [f"DSA indexer: {path} ({reason})"]
    assert records[0].name == sib.__name__  # vLLM's logger for the module
    # every indexer layer and metadata builder asks; the line is logged once
    records.clear()
    _, vllm_config = _select(glm5_model_config, "fp8_ds_mla")
    with set_current_vllm_config(vllm_config):
        for _ in range(3):
            assert (sib.resolve_sparse_indexer_backend(vllm_config) == "triton") == use_triton
    assert _info(records) == []


# --- the toolchain probe ------------------------------------------------------------------------


def _fake_nvcc(folder, release="12.9", exit_code=0):
    """`folder/nvcc`, printing what `nvcc --version` prints for `release`."""
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.41'\n"
        f"exit {exit_code}\n"
    )
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return nvcc


@pytest.fixture
def probe(vllm_module, monkeypatch, tmp_path):
    """`run(env, jit=None)`: find_deep_gemm_jit_toolchain with only `env` as the environment and
    /usr/local/cuda moved to tmp_path/default-cuda (absent unless a test makes it)."""
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    monkeypatch.setattr(sib, "_DEFAULT_CUDA_HOME", str(tmp_path / "default-cuda"))

    def run(env, jit=None):
        env = {"PATH": str(tmp_path / "empty-path"), **env}
        return sib.find_deep_gemm_jit_toolchain(jit or sib.vendored_deep_gemm_jit(), env)

    return run


def _jit(min_nvcc, nvrtc):
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    return sib.DeepGemmJit(version="x", min_nvcc=min_nvcc, nvrtc_switch=nvrtc)


def test_probe_finds_nothing_without_a_toolkit(probe):
    result = probe({})
    assert not result.found and result.detail.startswith("no CUDA toolkit")


def test_probe_cuda_home(probe, tmp_path):
    from vllm.v1.attention.ops.sparse_indexer_backend import JitToolchain

    nvcc = _fake_nvcc(tmp_path / "cuda" / "bin")
    assert probe({"CUDA_HOME": str(tmp_path / "cuda")}) == JitToolchain(
        True, f"nvcc 12.9 at {nvcc}", (12, 9)
    )
    # CUDA_PATH when CUDA_HOME is unset or empty
    assert probe({"CUDA_HOME": "", "CUDA_PATH": str(tmp_path / "cuda")}).found


def test_probe_nvcc_on_path_and_default_home(probe, tmp_path):
    nvcc = _fake_nvcc(tmp_path / "tk" / "bin")
    result = probe({"PATH": str(tmp_path / "tk" / "bin")})
    assert result.found and result.detail == f"nvcc 12.9 at {nvcc}"
    _fake_nvcc(tmp_path / "default-cuda" / "bin", release="13.0")
    result = probe({})
    assert result.found and result.detail.startswith("nvcc 13.0 at ")


def test_probe_home_without_nvcc(probe, tmp_path):
    (tmp_path / "cuda" / "include").mkdir(parents=True)
    result = probe({"CUDA_HOME": str(tmp_path / "cuda")})
    assert not result.found and result.detail == f"no nvcc at {tmp_path / 'cuda' / 'bin' / 'nvcc'}"
    result = probe({"CUDA_HOME": str(tmp_path / "nowhere")})
    assert not result.found and "does not exist" in result.detail


def test_probe_nvcc_override(probe, tmp_path):
    (tmp_path / "cuda").mkdir()
    nvcc = _fake_nvcc(tmp_path / "elsewhere")
    result = probe({"CUDA_HOME": str(tmp_path / "cuda"), "DG_JIT_NVCC_COMPILER": str(nvcc)})
    assert result.found and result.detail == f"nvcc 12.9 at {nvcc}"


@pytest.mark.parametrize(
    "release,min_nvcc,found",
    [("12.3", (12, 3), True), ("12.8", (12, 9), False), ("12.9", (12, 9), True),
     ("13.0", (12, 9), True), ("12.2", (12, 3), False)],
)
def test_probe_nvcc_version(probe, tmp_path, release, min_nvcc, found):
    _fake_nvcc(tmp_path / "cuda" / "bin", release=release)
    result = probe({"CUDA_HOME": str(tmp_path / "cuda")}, jit=_jit(min_nvcc, False))
    assert result.found == found, result
    if not found:
        assert "needs %d.%d or newer" % min_nvcc in result.detail


@pytest.mark.parametrize("output", ["broken", "exit"])
def test_probe_broken_nvcc_does_not_raise(probe, tmp_path, output):
    home = tmp_path / "cuda"
    if output == "broken":
        (home / "bin").mkdir(parents=True)
        (home / "bin" / "nvcc").write_text("#!/bin/sh\necho 'no version here'\n")
        os.chmod(home / "bin" / "nvcc", 0o755)
    else:
        _fake_nvcc(home / "bin", release="", exit_code=1)
    result = probe({"CUDA_HOME": str(home)})
    assert not result.found and result.detail.endswith("--version names no release")


def test_probe_nvrtc_only_where_deepgemm_has_it(probe, tmp_path):
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    env = {"CUDA_HOME": str(home), "DG_JIT_USE_NVRTC": "1"}
    assert not probe(env, jit=_jit((12, 3), True)).found  # no headers yet
    (home / "include" / "cuda_fp8.h").write_text("")
    assert probe(env, jit=_jit((12, 3), True)).found
    assert "NVRTC" in probe(env, jit=_jit((12, 3), True)).detail
    # a DeepGEMM without NVRTC still needs nvcc
    assert not probe(env, jit=_jit((12, 9), False)).found
    assert not probe({**env, "DG_JIT_USE_NVRTC": "0"}, jit=_jit((12, 3), True)).found


def test_pin_probe_follows_the_pins_entry(probe, tmp_path):
    """The installed pin's own DeepGEMM: nvcc 12.8 is enough for 0.26.0's DeepGEMM 2.5.0, not for
    0.33.0's 2.8.1; NVRTC counts on 0.26.0 only."""
    from vllm.v1.attention.ops import sparse_indexer_backend as sib

    jit = sib.vendored_deep_gemm_jit()
    _fake_nvcc(tmp_path / "cuda" / "bin", release="12.8")
    assert probe({"CUDA_HOME": str(tmp_path / "cuda")}).found == (jit.min_nvcc <= (12, 8))
    home = tmp_path / "nvrtc"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda_fp8.h").write_text("")
    assert probe({"CUDA_HOME": str(home), "DG_JIT_USE_NVRTC": "1"}).found == jit.nvrtc_switch

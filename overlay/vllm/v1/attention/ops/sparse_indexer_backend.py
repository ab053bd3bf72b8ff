# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which kernels run the DSA sparse-attention indexer on CUDA.

``kernel_config.sparse_indexer_backend`` picks them:

- ``"deep_gemm"``: DeepGEMM's ``fp8_fp4_mqa_logits`` / ``fp8_fp4_paged_mqa_logits``
  with vLLM's compiled cache and top-k ops (the upstream path);
- ``"triton"``: the Triton kernels in ``triton_dsa_indexer.py`` and
  ``triton_dsa_topk.py`` (no DeepGEMM, no JIT-built CUDA);
- ``"auto"`` (default): ``choose_sparse_indexer_backend`` below.

``resolve_sparse_indexer_backend`` decides once per engine, when the first
indexer layer (``SparseAttnIndexer``) is built: it writes the answer back into
the config and logs it with the reason. The indexer's metadata builder, built
after the model, takes the resolved value (``resolved_sparse_indexer_backend``)
and carries it to the op in ``DeepseekV32IndexerMetadata.indexer_backend``.

DeepGEMM is vendored in every vLLM wheel, so ``has_deep_gemm()`` is true even
where it cannot run: its kernels are JIT-compiled on first use, which needs a
CUDA toolkit (``find_deep_gemm_jit_toolchain``) whose nvcc knows the device.
"""

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

DEEP_GEMM = "deep_gemm"
TRITON = "triton"
# The sparse MLA backend whose attention stack runs without JIT-built CUDA:
# where it serves the model, "auto" keeps the indexer on Triton too.
TRITON_MLA_SPARSE = "TRITON_MLA_SPARSE"


# ---------------------------------------------------------------------------------------------
# DeepGEMM's JIT toolchain
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeepGemmJit:
    """How the DeepGEMM vendored in a release (``vllm/third_party/deep_gemm``)
    JIT-compiles the indexer's kernels (``fp8_fp4_mqa_logits``,
    ``fp8_fp4_paged_mqa_logits``, ``get_paged_mqa_logits_metadata``) on first use.

    Both known versions find the CUDA home the same way -- ``CUDA_HOME``, then
    ``CUDA_PATH``, then the folder above ``bin/`` of the ``nvcc`` on ``PATH``,
    then ``/usr/local/cuda`` if it exists (2.5.0: ``_find_cuda_home`` in its
    ``__init__.py``; 2.8.1: the same order in its compiled extension) -- and
    compile with ``$DG_JIT_NVCC_COMPILER`` or ``<home>/bin/nvcc``, refusing an
    nvcc older than ``min_nvcc`` (2.5.0: "NVCC version should be >= 12.3";
    2.8.1: "NVCC version must be at least 12.9"). 2.5.0 alone can compile with
    NVRTC instead (``DG_JIT_USE_NVRTC`` set to a non-zero integer; its extension
    links ``libnvrtc``), against the headers in ``<home>/include``.
    """

    # ``__version__`` of the vendored copy
    version: str
    min_nvcc: tuple[int, int]
    # whether DG_JIT_USE_NVRTC=1 switches the JIT to NVRTC
    nvrtc_switch: bool


# The vendored versions (vLLM 0.26: 2.5.0; 0.33 and 0.34: 2.8.1), read from the
# wheels' deep_gemm/__init__.py and compiled extension.
KNOWN_DEEP_GEMM_JITS: dict[str, DeepGemmJit] = {
    "2.5.0": DeepGemmJit(version="2.5.0", min_nvcc=(12, 3), nvrtc_switch=True),
    "2.8.1": DeepGemmJit(version="2.8.1", min_nvcc=(12, 9), nvrtc_switch=False),
}


def vendored_deep_gemm_version() -> str | None:
    """``__version__`` of ``vllm/third_party/deep_gemm``, read from its source
    (importing it loads its CUDA extension)."""
    try:
        spec = importlib.util.find_spec("vllm.third_party.deep_gemm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    init = Path(list(spec.submodule_search_locations)[0]) / "__init__.py"
    try:
        m = re.search(r"__version__ = ['\"]([^'\"]+)['\"]", init.read_text())
    except OSError:
        return None
    return m.group(1) if m else None


@functools.cache
def vendored_deep_gemm_jit() -> DeepGemmJit:
    """The JIT facts of this tree's DeepGEMM; an unknown version is taken to need
    what the newest known one needs."""
    version = vendored_deep_gemm_version() or "unknown"
    if version in KNOWN_DEEP_GEMM_JITS:
        return KNOWN_DEEP_GEMM_JITS[version]
    newest = KNOWN_DEEP_GEMM_JITS["2.8.1"]
    return DeepGemmJit(version, newest.min_nvcc, newest.nvrtc_switch)


# DeepGEMM's last resort for the CUDA home, in both vendored versions (a module constant so
# that tests can move it).
_DEFAULT_CUDA_HOME = "/usr/local/cuda"


@dataclass(frozen=True)
class JitToolchain:
    """What DeepGEMM's JIT would compile the indexer kernels with on this host."""

    found: bool
    # what was found, or what is missing (it goes into the log line)
    detail: str
    # the release of the nvcc found (None with NVRTC or when nothing was found)
    nvcc_release: tuple[int, int] | None = None


def _nvcc_floor_for_device(major: int, minor: int) -> tuple[int, int]:
    """The first nvcc release that compiles for this device: CUDA 12.8 added sm_100 and
    sm_120, 12.9 sm_103 and sm_121 (and the ``f`` family targets DeepGEMM uses from 12.9)."""
    if (major, minor) in ((10, 3), (12, 1)):
        return (12, 9)
    if major in (10, 12):
        return (12, 8)
    return (12, 0)


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env.get(name, "0") or "0")
    except ValueError:
        return 0


def _deep_gemm_cuda_home(env: Mapping[str, str]) -> str | None:
    """The CUDA home DeepGEMM would use: CUDA_HOME, CUDA_PATH, the nvcc on PATH, then
    /usr/local/cuda (``DeepGemmJit`` has where each version does this)."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return _DEFAULT_CUDA_HOME if os.path.exists(_DEFAULT_CUDA_HOME) else None


def _nvcc_release(nvcc: str) -> tuple[int, int] | None:
    """``nvcc --version``'s release, read as DeepGEMM reads it; None when it cannot."""
    try:
        out = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_deep_gemm_jit_toolchain(
    jit: DeepGemmJit, environ: Mapping[str, str] | None = None
) -> JitToolchain:
    """Whether the vendored DeepGEMM described by ``jit`` finds a compiler for its JIT
    here, looked for the way DeepGEMM looks for it. Never raises: anything missing or
    broken is a ``JitToolchain(False, why)``."""
    env = os.environ if environ is None else environ
    home = _deep_gemm_cuda_home(env)
    if home is None:
        return JitToolchain(
            False,
            f"no CUDA toolkit (CUDA_HOME and CUDA_PATH unset, no nvcc on PATH, no "
            f"{_DEFAULT_CUDA_HOME})",
        )
    if not os.path.isdir(home):
        return JitToolchain(False, f"the CUDA home {home} does not exist")
    if jit.nvrtc_switch and _env_int(env, "DG_JIT_USE_NVRTC"):
        header = os.path.join(home, "include", "cuda_fp8.h")
        if os.path.isfile(header):
            return JitToolchain(True, f"NVRTC (DG_JIT_USE_NVRTC) with the headers of {home}")
        return JitToolchain(False, f"DG_JIT_USE_NVRTC is set but {header} does not exist")
    nvcc = env.get("DG_JIT_NVCC_COMPILER") or os.path.join(home, "bin", "nvcc")
    if not (os.path.isfile(nvcc) and os.access(nvcc, os.X_OK)):
        return JitToolchain(False, f"no nvcc at {nvcc}")
    release = _nvcc_release(nvcc)
    if release is None:
        return JitToolchain(False, f"{nvcc} --version names no release")
    version = "%d.%d" % release
    if release < jit.min_nvcc:
        return JitToolchain(
            False,
            f"nvcc {version} at {nvcc}; DeepGEMM {jit.version} needs "
            f"{'%d.%d' % jit.min_nvcc} or newer",
        )
    return JitToolchain(True, f"nvcc {version} at {nvcc}", release)


@functools.cache
def deep_gemm_jit_toolchain() -> JitToolchain:
    """``find_deep_gemm_jit_toolchain`` for this tree's DeepGEMM, once per process."""
    return find_deep_gemm_jit_toolchain(vendored_deep_gemm_jit())


# ---------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------


def indexer_cache_uses_mx_scales() -> bool:
    """Whether vLLM writes the indexer K cache with MX (UE8M0 x4) scales on this
    device (vLLM's ``deep_gemm.mqa_logits_use_mx_scales``, SM100, where the
    release has it); the Triton kernels read fp32 scales only."""
    from vllm.utils import deep_gemm

    mx = getattr(deep_gemm, "mqa_logits_use_mx_scales", None)
    return bool(mx()) if mx is not None else False


def selected_sparse_mla_backend(vllm_config: "VllmConfig") -> str:
    """Name of the backend vLLM's selector picks for this model's sparse MLA
    layers (the selection is cached, so the MLA layers get the same answer)."""
    from vllm.v1.attention.selector import get_attn_backend

    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    # MLA attends over the latent (kv_lora_rank) plus the rope dims: 576 for
    # DeepSeek-V3.2 and GLM-5, as MLAAttention asks the selector.
    head_size = getattr(hf_config, "kv_lora_rank", 512) + getattr(
        hf_config, "qk_rope_head_dim", 64
    )
    num_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
    backend = get_attn_backend(
        head_size,
        model_config.dtype,
        vllm_config.cache_config.cache_dtype,
        use_mla=True,
        use_sparse=True,
        num_heads=num_heads,
    )
    return backend.get_name()


def _auto_choice(vllm_config: "VllmConfig") -> tuple[str, str]:
    """What "auto" resolves to on a CUDA platform, in order:

    1. the indexer cache holds MX scales (vLLM 0.33+ on SM100): DeepGEMM, its only reader;
    2. DeepGEMM is not importable: Triton;
    3. the device is not one DeepGEMM's indexer kernels are built for (vLLM's
       ``support_deep_gemm``: SM90, SM10x, SM12x): Triton;
    4. TRITON_MLA_SPARSE serves the sparse MLA layers (``--attention-backend``, or vLLM's
       choice on SM12x): Triton, so the attention stack has no JIT-built CUDA;
    5. DeepGEMM's JIT toolchain is not found (``deep_gemm_jit_toolchain``), or its nvcc
       predates the device (``_nvcc_floor_for_device``): Triton;
    6. otherwise DeepGEMM, as upstream.
    """
    from vllm.platforms import current_platform
    from vllm.utils.deep_gemm import has_deep_gemm

    cap = current_platform.get_device_capability()
    sm = f"SM{cap.major}{cap.minor}" if cap is not None else "this device"
    if indexer_cache_uses_mx_scales():
        return DEEP_GEMM, (
            f"vLLM stores the indexer cache with MX scales on {sm}, which only DeepGEMM reads"
        )
    if not has_deep_gemm():
        return TRITON, "DeepGEMM is not installed"
    if not current_platform.support_deep_gemm():
        return TRITON, (
            f"DeepGEMM's indexer kernels are built for SM90, SM10x and SM12x, not {sm}"
        )
    backend = selected_sparse_mla_backend(vllm_config)
    if backend == TRITON_MLA_SPARSE:
        requested = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        requested = getattr(requested, "name", requested) == TRITON_MLA_SPARSE
        how = "requested" if requested else "vLLM's choice"
        return TRITON, f"{TRITON_MLA_SPARSE} serves the sparse MLA layers ({how})"
    toolchain = deep_gemm_jit_toolchain()
    if not toolchain.found:
        return TRITON, f"DeepGEMM cannot JIT-compile its kernels here: {toolchain.detail}"
    floor = _nvcc_floor_for_device(cap.major, cap.minor) if cap is not None else (12, 0)
    if toolchain.nvcc_release is not None and toolchain.nvcc_release < floor:
        return TRITON, (
            f"DeepGEMM cannot JIT-compile its kernels for {sm}: {toolchain.detail}, and nvcc "
            f"compiles for {sm} from {'%d.%d' % floor}"
        )
    return DEEP_GEMM, (
        f"{backend} serves the sparse MLA layers, {sm} is supported and DeepGEMM "
        f"{vendored_deep_gemm_jit().version} compiles with {toolchain.detail}"
    )


def choose_sparse_indexer_backend(vllm_config: "VllmConfig") -> tuple[str, str]:
    """(``"deep_gemm"`` or ``"triton"``, why) for this config on a CUDA platform,
    without changing the config: an explicit ``sparse_indexer_backend`` is checked
    against what can run (a ``ValueError`` when it cannot), ``"auto"`` is decided as
    ``_auto_choice`` documents."""
    from vllm.platforms import current_platform
    from vllm.utils.deep_gemm import has_deep_gemm

    requested = vllm_config.kernel_config.sparse_indexer_backend
    how = f"kernel_config.sparse_indexer_backend={requested!r}"
    if requested == "auto":
        return _auto_choice(vllm_config)
    if requested == TRITON:
        if indexer_cache_uses_mx_scales():
            raise ValueError(
                f"{how}: vLLM stores the indexer cache with MX scales on this device, "
                "which only DeepGEMM reads; use 'auto' or 'deep_gemm'."
            )
        return TRITON, how
    if requested == DEEP_GEMM:
        if not has_deep_gemm():
            raise ValueError(f"{how}, but DeepGEMM is not installed.")
        if not current_platform.support_deep_gemm():
            raise ValueError(
                f"{how}, but DeepGEMM's indexer kernels are built for SM90, SM10x and "
                "SM12x only; use 'auto' or 'triton'."
            )
        return DEEP_GEMM, how
    raise ValueError(f"unknown {how}; expected 'auto', 'deep_gemm' or 'triton'.")


# Marks a KernelConfig whose sparse_indexer_backend this module has resolved (an
# explicit value is checked and logged once too, so the value alone cannot say).
_RESOLVED = "_sparse_indexer_backend_resolved"


def resolve_sparse_indexer_backend(vllm_config: "VllmConfig") -> str:
    """``kernel_config.sparse_indexer_backend`` resolved to ``"deep_gemm"`` or
    ``"triton"``, decided once: the first call (the first indexer layer) chooses,
    logs the path and the reason once (info), and writes the answer back into the
    config, which every later caller (the other layers, the metadata builders, the
    MTP drafter's layers) then reads. Off CUDA the platform's own indexer ops run
    and this answers ``"deep_gemm"`` (the upstream path) without touching the config.
    A missing DeepGEMM toolchain never raises here: it picks the Triton kernels or,
    where only DeepGEMM can run, warns that its first kernel build will fail."""
    from vllm.platforms import current_platform

    kernel_config = vllm_config.kernel_config
    if not current_platform.is_cuda():
        return DEEP_GEMM
    if getattr(kernel_config, _RESOLVED, False):
        return kernel_config.sparse_indexer_backend
    backend, reason = choose_sparse_indexer_backend(vllm_config)
    logger.info_once(
        f"DSA indexer: {'Triton kernels' if backend == TRITON else 'DeepGEMM'} ({reason})"
    )
    if backend == DEEP_GEMM and not deep_gemm_jit_toolchain().found:
        logger.warning_once(
            "DSA indexer: DeepGEMM must run here but its JIT toolchain was not found "
            f"({deep_gemm_jit_toolchain().detail}): its first kernel build will fail; "
            "install a CUDA toolkit with nvcc >= "
            f"{'%d.%d' % vendored_deep_gemm_jit().min_nvcc} or set CUDA_HOME"
        )
    kernel_config.sparse_indexer_backend = backend
    setattr(kernel_config, _RESOLVED, True)
    return backend


def resolved_sparse_indexer_backend(vllm_config: "VllmConfig") -> str:
    """What ``resolve_sparse_indexer_backend`` decided for this engine's indexer
    layers, for the indexer's metadata builder (built after the model). Models
    whose indexer is not a ``SparseAttnIndexer`` run indexer ops of their own
    (DeepGEMM's, reading its schedule metadata): nothing was resolved for them,
    and this answers ``"deep_gemm"``, the upstream path."""
    kernel_config = vllm_config.kernel_config
    if getattr(kernel_config, _RESOLVED, False):
        return kernel_config.sparse_indexer_backend
    return DEEP_GEMM

"""vLLM's own compiled cache ops, loaded for byte-for-byte comparisons on the GPU.

`python3 e2e/gpu_tests.py --prepare` (run on the CPU machine) takes `vllm/_C_stable_libtorch.abi3.so`
from the pinned release wheel in the wheel cache, xz-compresses it into the git-ignored
`.peers-carry/` folder and writes `.peers-carry/manifest.json`; the folder travels with the
checkout to the GPU host (53 MiB). There this module decompresses it once into the temporary
directory, checks its sha256 and loads it into torch, which registers `torch.ops._C_cache_ops`.

The library is built against the pin's torch (0.26.0: torch 2.11.0), so it loads only next to that
torch with CUDA. Without it the tests skip -- unless `GLM5_REQUIRE_PEERS=1` (set by
e2e/gpu_tests.py), which turns a missing or unloadable library into a failure.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import lzma
import os
import shutil
import site
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / ".peers-carry"
MANIFEST = CARRY / "manifest.json"
REQUIRE_ENV = "GLM5_REQUIRE_PEERS"


class PeerMissing(RuntimeError):
    pass


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def unavailable(why: str):
    """Skip, or fail where the GPU run requires the peers."""
    if required():
        pytest.fail(f"{why} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(why)


def manifest() -> dict:
    if not MANIFEST.exists():
        raise PeerMissing(f"{MANIFEST} not staged (python3 e2e/gpu_tests.py --prepare)")
    return json.loads(MANIFEST.read_text())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def unpacked(entry: dict) -> Path:
    """The manifest entry's library, decompressed (once) and checked against its sha256."""
    src = CARRY / entry["path"]
    if not src.exists():
        raise PeerMissing(f"{src} listed in the manifest but missing")
    dst = Path(tempfile.gettempdir()) / "glm5-peers" / entry["sha256"][:16] / entry["name"]
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        # a part file per process: the GPU test shards start side by side and all unpack at once
        tmp = dst.with_suffix(f".part{os.getpid()}")
        with lzma.open(src) as f, open(tmp, "wb") as g:
            shutil.copyfileobj(f, g, 1 << 24)
        tmp.replace(dst)
    if _sha256(dst) != entry["sha256"]:
        dst.unlink()
        raise PeerMissing(f"{dst} does not match the manifest's sha256 (corrupt carry?)")
    return dst


def _preload_cudart(soname: str) -> None:
    """The library links libcudart by soname; torch's CUDA wheels keep it under site-packages."""
    roots = site.getsitepackages() + ["/usr/local/cuda/lib64"]
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "**", soname + "*"), recursive=True)) + sorted(
            glob.glob(os.path.join(root, soname + "*")))
        if hits:
            ctypes.CDLL(hits[0], mode=ctypes.RTLD_GLOBAL)
            return


@functools.cache
def _load(pin: str):
    m = manifest()
    entry = m["pins"].get(pin)
    if entry is None:
        raise PeerMissing(f"the manifest has no vLLM {pin} library (pins staged: {sorted(m['pins'])})")
    if not torch.cuda.is_available():
        raise PeerMissing("vLLM's compiled ops need CUDA")
    have = torch.__version__.split("+")[0]
    if have != entry["torch"]:
        raise PeerMissing(f"vLLM {pin}'s compiled ops are built for torch {entry['torch']}, this is torch {have}")
    lib = unpacked(entry)
    _preload_cudart("libcudart.so.13")
    try:
        torch.ops.load_library(str(lib))
    except Exception as e:  # noqa: BLE001  (report any loader error as the reason)
        raise PeerMissing(f"loading vLLM {pin}'s {entry['name']} failed: {e!r}"[:500]) from e
    if not hasattr(torch.ops, "_C_cache_ops"):
        raise PeerMissing(f"vLLM {pin}'s {entry['name']} registered no _C_cache_ops")
    return torch.ops._C_cache_ops


def cache_ops(pin: str = "0.26.0"):
    """torch.ops._C_cache_ops of vLLM `pin`, or skip/fail (see the module docstring)."""
    try:
        return _load(pin)
    except PeerMissing as e:
        unavailable(str(e))

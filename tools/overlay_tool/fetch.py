"""The release wheel cache: download with pip, verify sha256 on every use."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Callable

from .safety import owned_tempdir
from .safety import run as run_child
from .errors import FetchError
from .pins import Pin
from .project import sha256_file

PIP_ARGS_ENV = "GLM5_OVERLAY_PIP_DOWNLOAD_ARGS"  # extra pip download arguments (e.g. a local --find-links)


def sha256_with_progress(path: Path) -> str:
    import hashlib

    from tqdm import tqdm

    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", disable=None, leave=False) as bar:
        while block := f.read(1 << 22):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def cached_wheel(pin: Pin, cache: Path) -> Path:
    return cache / pin.wheel


def verify_sha256(path: Path, expected: str) -> None:
    """Raise unless the cached file's sha256 is the pinned one (checked on every use)."""
    digest = sha256_with_progress(path)
    if digest != expected:
        raise FetchError(
            f"sha256 mismatch for {path}:\n  expected {expected} (pins.lock)\n  found    {digest}\n"
            f"the file was not used or changed; delete it to download it again"
        )


def fetch_verified(path: Path, expected: str, download: Callable[[Path], Path], *, what: str, plan: str,
                   dry_run: bool = False, log=print) -> Path:
    """A pinned file: ``path`` in the cache (sha256 checked on every use), or first downloaded by
    ``download(tmp)`` (which returns the file it wrote into the temporary folder ``tmp``), checked,
    then moved into the cache; a failed or mismatching download leaves nothing cached. ``plan``
    is what --dry-run prints instead of downloading."""
    if path.exists():
        verify_sha256(path, expected)
        log(f"{what}: {path} (sha256 verified)")
        return path
    if dry_run:
        log(plan)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with owned_tempdir(".download-", path.parent) as tmp:
        got = download(tmp)
        digest = sha256_file(got)
        if digest != expected:
            raise FetchError(
                f"sha256 mismatch for the downloaded {path.name}:\n  expected {expected} (pins.lock)\n"
                f"  found    {digest}\nthe download was discarded; nothing was cached"
            )
        os.replace(got, path)
    log(f"{what}: {path} (downloaded, sha256 verified)")
    return path


def pip_download_cmd(version: str, dest: Path) -> list[str]:
    """The pip command that downloads vLLM <version>'s x86_64 release wheel into `dest`."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--platform", "manylinux_2_28_x86_64", "--progress-bar", "on", "--dest", str(dest),
        f"vllm=={version}",
    ] + shlex.split(os.environ.get(PIP_ARGS_ENV, ""))


def download_unpinned(version: str, cache: Path, log=print) -> Path:
    """Download vLLM <version>'s release wheel (not in pins.lock yet: no sha256 to check) into the
    cache, for `port`, which then pins that file's sha256. A cached vllm-<version>-*.whl is reused."""
    have = sorted(cache.glob(f"vllm-{version}-*.whl")) if cache.is_dir() else []
    if len(have) == 1:
        log(f"wheel: {have[0]} (cached, not pinned yet: its sha256 is what gets pinned)")
        return have[0]
    if len(have) > 1:
        raise FetchError(f"{cache} holds several vllm-{version} wheels ({', '.join(h.name for h in have)}); "
                         f"pass the right one with --wheel")
    cache.mkdir(parents=True, exist_ok=True)
    with owned_tempdir(".download-", cache) as tmp:
        cmd = pip_download_cmd(version, tmp)
        log(f"downloading vllm=={version} with pip ...")
        r = run_child(cmd, env=dict(os.environ, PIP_NO_INPUT="1"))
        if r.returncode != 0:
            raise FetchError(f"pip download of vllm=={version} failed (exit {r.returncode}); command: {shlex.join(cmd)}")
        got = sorted(p.name for p in tmp.iterdir())
        if len(got) != 1 or not (got[0].startswith(f"vllm-{version}-") and got[0].endswith(".whl")):
            raise FetchError(f"pip downloaded {got or 'nothing'}, expected one vllm-{version}-*.whl")
        path = cache / got[0]
        os.replace(tmp / got[0], path)
        log(f"wheel: {path} (downloaded)")
        return path


def fetch(pin: Pin, cache: Path, dry_run: bool = False, log=print) -> Path:
    """Return the pinned release wheel from the cache, downloading it first if absent."""

    def download(tmp: Path) -> Path:
        cmd = pip_download_cmd(pin.version, tmp)
        log(f"downloading vllm=={pin.version} with pip ...")
        r = run_child(cmd, env=dict(os.environ, PIP_NO_INPUT="1"))  # its own process group: no terminal input
        if r.returncode != 0:
            raise FetchError(f"pip download of vllm=={pin.version} failed (exit {r.returncode}); command: {shlex.join(cmd)}")
        got = sorted(p.name for p in tmp.iterdir())
        if got != [pin.wheel]:
            raise FetchError(f"pip downloaded {got or 'nothing'}, expected exactly {pin.wheel} (pins.lock)")
        return tmp / pin.wheel

    return fetch_verified(cached_wheel(pin, cache), pin.sha256, download, what="wheel", dry_run=dry_run, log=log,
                          plan=f"would download vllm=={pin.version} ({pin.wheel}) into {cache} and check sha256 {pin.sha256}")

"""vLLM's own tests, run against our changes: the pin's sdist (release wheels have no tests/),
pinned in pins.lock (sdist, sdist_sha256), fetched and verified like the wheels, the files listed in
patches/<version>/tests/files extracted from it, and our test patches (patches/<version>/tests/series,
headers as for the other patches) applied to them.

`tools/apply.py upstream-tests --vllm V --out DIR` writes that bundle (DIR/tests/..., vLLM's
pyproject.toml for its pytest configuration, and DIR/upstream-tests.json naming what it holds);
export-pr carries each test patch into its concern's series as an edit of vLLM's file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import FetchError, PatchError, RefusedError, UsageError
from .fetch import fetch_verified
from .patches import PatchFile, load_series, require_valid
from .pins import Pin
from .safety import owned_tempdir
from .safety import run as run_child

SDIST_CACHE_ENV = "GLM5_OVERLAY_SDISTS"
BUNDLE_MANIFEST = "upstream-tests.json"


def default_sdist_cache() -> Path:
    env = os.environ.get(SDIST_CACHE_ENV)
    return Path(env).expanduser() if env else Path("~/.cache/glm5-overlay/sdists").expanduser()


def _require_sdist(pin: Pin) -> None:
    if not pin.sdist or not pin.sdist_sha256:
        raise UsageError(f"pins.lock: [pins.\"{pin.version}\"] has no sdist/sdist_sha256 (vLLM's tests come from the sdist)")


def fetch_sdist(pin: Pin, cache: Path, dry_run: bool = False, log=print) -> Path:
    """The pinned sdist from the cache (sha256 checked on every use), downloaded first if absent."""
    _require_sdist(pin)

    def download(tmp: Path) -> Path:
        part = tmp / pin.sdist_name
        log(f"downloading {pin.sdist} ...")
        try:
            with urllib.request.urlopen(pin.sdist, timeout=60) as r, open(part, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
        except OSError as e:  # URLError, HTTPError, timeouts are OSErrors
            raise FetchError(f"download of {pin.sdist} failed: {e}") from None
        return part

    return fetch_verified(cache / pin.sdist_name, pin.sdist_sha256, download, what="sdist", dry_run=dry_run, log=log,
                          plan=f"would download {pin.sdist} into {cache} and check sha256 {pin.sdist_sha256}")


@dataclass(frozen=True)
class TestSet:
    """patches/<version>/tests: the upstream files to extract and our patches of them."""
    dir: Path
    files: list[str]
    patches: list[PatchFile]


def load_test_set(patches_dir: Path) -> TestSet | None:
    d = patches_dir / "tests"
    if not d.is_dir():
        return None
    manifest = d / "files"
    if not manifest.is_file():
        raise UsageError(f"{d}: no 'files' list (the upstream test files to extract)")
    files = []
    for n, line in enumerate(manifest.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("/") or ".." in Path(line).parts:
            raise UsageError(f"{manifest}:{n}: '{line}' is not a relative path inside vLLM's source")
        files.append(line)
    patches = load_series(d)
    require_valid(patches)
    for p in patches:
        for fp in p.files:
            if fp.path not in files:
                raise UsageError(f"{p.path}: edits {fp.path}, which {manifest} does not list")
    return TestSet(d, files, patches)


def _read_members(sdist: Path, pin: Pin, files: list[str]) -> dict[str, bytes]:
    prefix = f"vllm-{pin.version}/"
    out: dict[str, bytes] = {}
    with tarfile.open(sdist, "r:gz") as t:
        for name in files:
            try:
                m = t.getmember(prefix + name)
            except KeyError:
                raise UsageError(f"{sdist.name} has no {name} (patches/{pin.version}/tests/files)") from None
            if not m.isfile():
                raise UsageError(f"{sdist.name}: {name} is not a regular file")
            out[name] = t.extractfile(m).read()
    return out


def _apply(files: dict[str, bytes], patch: PatchFile) -> dict[str, bytes]:
    """`files` with `patch` applied (git apply, no fuzz), in a private git repository (never the
    repository the working directory may sit in)."""
    with owned_tempdir("glm5-upstream-tests-") as td:
        td = Path(td)
        run_child(["git", "init", "-q", str(td)], capture_output=True, check=True)
        for name, data in files.items():
            (td / name).parent.mkdir(parents=True, exist_ok=True)
            (td / name).write_bytes(data)
        r = run_child(["git", "apply", "--verbose", str(patch.path.resolve())], cwd=td, capture_output=True, text=True)
        if r.returncode != 0:
            raise PatchError(f"{patch.path.name} does not apply to vLLM's files:\n{(r.stderr or r.stdout).strip()}")
        return {name: (td / name).read_bytes() for name in files}


def patched_files(project, pin: Pin, cache: Path, log=print) -> tuple[TestSet, dict[str, bytes], list[tuple[PatchFile, dict[str, tuple[bytes, bytes]]]]]:
    """The pin's test set, the extracted files after all patches, and per patch the (before, after)
    content of each file it edits."""
    ts = load_test_set(project.patches_dir(pin))
    if ts is None:
        raise UsageError(f"patches/{pin.version}/tests does not exist: no vLLM tests are patched for {pin.version}")
    sdist = fetch_sdist(pin, cache, log=log)
    files = _read_members(sdist, pin, ts.files)
    steps = []
    for p in ts.patches:
        new = _apply(files, p)
        steps.append((p, {fp.path: (files[fp.path], new[fp.path]) for fp in p.files}))
        files = new
    return ts, files, steps


def write_bundle(project, pin: Pin, cache: Path, out: Path, dry_run: bool = False, log=print) -> Path:
    """Extract the pin's listed test files from its sdist into `out`, apply the test patches, and
    write out/upstream-tests.json. `out` must not exist, be empty or be such a bundle (replaced)."""
    ts = load_test_set(project.patches_dir(pin))
    if ts is None:
        raise UsageError(f"patches/{pin.version}/tests does not exist: no vLLM tests are patched for {pin.version}")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / BUNDLE_MANIFEST).is_file())):
        raise RefusedError(f"{out} exists and is not a bundle written by upstream-tests (no {BUNDLE_MANIFEST}): not replaced")
    if dry_run:
        fetch_sdist(pin, cache, dry_run=True, log=log)
        log(f"would write {out}/: {len(ts.files)} file(s) of vLLM {pin.version}'s sdist + {len(ts.patches)} test patch(es)")
        return out
    _, files, steps = patched_files(project, pin, cache, log)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    manifest = {
        "vllm": pin.version,
        "sdist": pin.sdist,
        "sdist_sha256": pin.sdist_sha256,
        "patches": [p.name for p, _ in steps],
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
        "patched": sorted({f for _, ch in steps for f in ch}),
    }
    (out / BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(len(d) for d in files.values())
    log(f"wrote {out}/: {len(files)} file(s) of vllm-{pin.version}.tar.gz ({size / 1024:.0f} KiB), "
        f"patched by {', '.join(p.name for p, _ in steps) or 'nothing'}")
    return out

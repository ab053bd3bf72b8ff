"""Build: repack the patched tree as a wheel (release binaries reused unchanged)."""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import ExternalError, RefusedError, ToolError
from .patches import FIXED_EPOCH, PatchFile
from .pins import Pin
from .project import OverlayFile, sha256_file
from .safety import child_kwargs, owned_tempdir
from .tree import Tree, _fault, progress

LOCAL_TAG = "glm5"


def overlay_hash(pin: Pin, patches: list[PatchFile], overlay: list[OverlayFile]) -> str:
    """Hash of what the build is made of: pin, series (names and bytes) and overlay (paths, bytes, modes)."""
    h = hashlib.sha256()
    h.update(f"vllm {pin.version} {pin.sha256}\n".encode())
    for p in patches:
        h.update(f"patch {p.name} {p.sha256}\n".encode())
    for f in sorted(overlay, key=lambda f: f.dest):
        h.update(f"file {f.dest} {f.sha256} {f.mode:o}\n".encode())
    return h.hexdigest()


def local_version(pin: Pin, patches: list[PatchFile], overlay: list[OverlayFile]) -> str:
    return f"{pin.version}+{LOCAL_TAG}.{overlay_hash(pin, patches, overlay)[:10]}"


@dataclass
class BuildResult:
    wheel: Path
    version: str
    sha256: str
    head: str
    drift: bool


def drift_of(tree: Tree, patches: list[PatchFile], overlay: list[OverlayFile]) -> tuple[bool, str]:
    """(True, why) when HEAD's content is not what the series and overlay produce from the baseline."""
    expected = tree.simulate(tree.base, patches, overlay).commit
    a = tree.g.out("rev-parse", f"{expected}^{{tree}}")
    b = tree.g.out("rev-parse", "HEAD^{tree}")
    if a == b:
        return False, ""
    diff = tree.changed_paths(expected, "HEAD")
    shown = ", ".join(f"{st} {p}" for p, st in sorted(diff.items())[:10])
    return True, f"the tree differs from patches/{tree.pin.version} + overlay in: {shown}"


def build_wheel(
    tree: Tree,
    pin: Pin,
    patches: list[PatchFile],
    overlay: list[OverlayFile],
    out_dir: Path,
    allow_drift: bool = False,
    dry_run: bool = False,
    log=print,
) -> BuildResult:
    tree.recover()
    tree.require_clean("build")
    head = tree.g.rev("HEAD")
    assert head
    drift, why = drift_of(tree, patches, overlay)
    version = local_version(pin, patches, overlay)
    if drift:
        if not allow_drift:
            raise RefusedError(
                f"{why}.\nThe wheel's version would not describe its content: run `refresh` to export "
                f"the commits as patches (or `apply` to bring the tree up to date), or pass --allow-drift"
            )
        version += f".wip{head[:10]}"
    info = sorted(tree.path.glob("*.dist-info"))
    if len(info) != 1:
        raise ToolError(f"{tree.path}: expected one .dist-info folder, found {len(info)}")
    old_info = info[0]
    tags = [line.split(":", 1)[1].strip() for line in (old_info / "WHEEL").read_text().splitlines() if line.startswith("Tag:")]
    wheel_name = f"vllm-{version}-{_tagline(tags)}.whl"
    dest = out_dir / wheel_name
    if dry_run:
        log(f"would build {dest}")
        return BuildResult(dest, version, "", head, drift)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = tree.g.run("ls-files", "-z").stdout.decode("utf-8").split("\0")
    with owned_tempdir("glm5-build-", out_dir) as td:
        staging = Path(td) / f"vllm-{version}"
        with progress(total=len(files), desc="staging tree", unit="file") as bar:
            for rel in files:
                if not rel:
                    continue
                src = tree.path / rel
                dst = staging / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
                bar.update()
        new_info = staging / f"vllm-{version}.dist-info"
        (staging / old_info.name).rename(new_info)
        (new_info / "RECORD").unlink(missing_ok=True)
        meta = new_info / "METADATA"
        text = meta.read_text(encoding="utf-8")
        meta.unlink()  # a hard link to the tree's file: write a new one
        new_text, n = re.subn(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M)
        if n != 1:
            raise ToolError(f"{old_info.name}/METADATA has no Version: line")
        meta.write_text(new_text, encoding="utf-8")
        tmp_out = Path(td) / "out"
        tmp_out.mkdir()
        _pack(staging, tmp_out, total=sum((tree.path / r).stat().st_size for r in files if r))
        built = tmp_out / wheel_name
        if not built.exists():
            raise ExternalError(f"wheel pack did not write {wheel_name} (wrote {[p.name for p in tmp_out.iterdir()]})")
        os.replace(built, dest)
    for old_build in out_dir.glob(f"vllm-{pin.version}+{LOCAL_TAG}.*.whl"):
        if old_build != dest:  # earlier builds of this pin (each ~300 MB)
            old_build.unlink()
    digest = sha256_file(dest)
    log(f"built {dest}")
    return BuildResult(dest, version, digest, head, drift)


def _tagline(tags: list[str]) -> str:
    impls = sorted({t.split("-")[0] for t in tags})
    abis = sorted({t.split("-")[1] for t in tags})
    plats = sorted({t.split("-")[2] for t in tags})
    return "-".join([".".join(impls), ".".join(abis), ".".join(plats)])


def _pack(staging: Path, out: Path, total: int) -> None:
    """`wheel pack` (rewrites RECORD), with zip times fixed for a reproducible wheel."""
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(FIXED_EPOCH))
    cmd = [sys.executable, "-m", "wheel", "pack", "--dest-dir", str(out), str(staging)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **child_kwargs())
    done = threading.Event()

    def watch():
        # progress: bytes of the growing wheel against the (roughly 0.45x compressed) input size
        with progress(total=max(1, int(total * 0.45)), desc="wheel pack", unit="B", unit_scale=True) as bar:
            while not done.wait(0.5):
                size = sum(p.stat().st_size for p in out.glob("*.whl")) if out.exists() else 0
                bar.n = min(size, bar.total)
                bar.refresh()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        _fault("during-pack")
        output, _ = proc.communicate()
    except BaseException:  # Ctrl-C / SIGTERM: no orphaned `wheel pack` writing on
        proc.kill()
        proc.wait()
        raise
    finally:
        done.set()
        t.join()
    if proc.returncode != 0:
        raise ExternalError(f"{shlex.join(cmd)} failed:\n{output.decode('utf-8', 'replace')[-2000:]}")


def build_checkout(tree: Tree, pin: Pin, release_wheel: Path, version: str, out_dir: Path,
                   no_build_isolation: bool = False, dry_run: bool = False, log=print) -> BuildResult:
    """--checkout mode: build the user's vLLM checkout against the pinned release's binaries."""
    tree.recover()
    tree.require_clean("build")
    head = tree.g.rev("HEAD")
    env = dict(
        os.environ,
        VLLM_USE_PRECOMPILED="1",
        VLLM_PRECOMPILED_WHEEL_LOCATION=str(release_wheel),
        VLLM_VERSION_OVERRIDE=version,
        SETUPTOOLS_SCM_PRETEND_VERSION=version,
    )
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir"]
    if dry_run:
        log(f"would run VLLM_USE_PRECOMPILED=1 VLLM_PRECOMPILED_WHEEL_LOCATION={release_wheel} "
            f"VLLM_VERSION_OVERRIDE={version} pip wheel --no-deps {tree.path}")
        return BuildResult(out_dir / "?", version, "", head or "", False)
    out_dir.mkdir(parents=True, exist_ok=True)
    with owned_tempdir("glm5-build-", out_dir) as td:
        full = cmd + [td] + (["--no-build-isolation"] if no_build_isolation else []) + [str(tree.path)]
        log(f"building {tree.path} with VLLM_USE_PRECOMPILED=1 against {release_wheel.name} ...")
        r = subprocess.run(full, env=env, **child_kwargs())
        if r.returncode != 0:
            raise ExternalError(f"{shlex.join(full)} failed (exit {r.returncode})")
        wheels = list(Path(td).glob("*.whl"))
        if len(wheels) != 1:
            raise ExternalError(f"pip wheel produced {[w.name for w in wheels]}, expected one wheel")
        dest = out_dir / wheels[0].name
        os.replace(wheels[0], dest)
    left = tree.g.status_lines()
    if left:
        log(f"warning: the build left changes in {tree.path} (`git status` there): {', '.join(left[:5])}")
    log(f"built {dest}")
    return BuildResult(dest, version, sha256_file(dest), head or "", False)

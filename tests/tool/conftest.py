"""Fixtures of the overlay tool's tests: synthetic vLLM wheels and projects, and the real pins.

A synthetic "vLLM" is a tiny pure-Python wheel (plus one fake compiled file) that the tests build
on the fly, so every failure path runs in a second; the real pinned wheels are used by
test_real_wheels.py, through one session-scoped baseline per pin.
"""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "apply.py"
sys.path.insert(0, str(REPO / "tools"))

MODEL_LINES = [f"value_{i} = {i}\n" for i in range(1, 41)]
BASE_FILES = {
    "vllm/__init__.py": "from vllm.version import __version__\n",
    "vllm/version.py": "__version__ = '{version}'\n",
    "vllm/model.py": "".join(MODEL_LINES),
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/ops/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/registry.py": (
        "import enum\n\n\nclass AttentionBackendEnum(enum.Enum):\n"
        "    FLASH_ATTN = 'vllm.v1.attention.backends.flash_attn.FlashAttentionBackend'\n"
    ),
}
COMPILED = "vllm/_C.abi3.so"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(dest_dir: Path, version: str, files: dict[str, str] | None = None, compiled: bytes | None = None,
               requires: list[str] | None = None) -> Path:
    """A valid vllm-<version>-py3-none-any.whl with RECORD hashes and a fake compiled file
    (requires: Requires-Dist lines of its METADATA)."""
    files = dict(BASE_FILES if files is None else files)
    files = {k: v.replace("{version}", version) for k, v in files.items()}
    content = {k: v.encode() for k, v in files.items()}
    content[COMPILED] = compiled if compiled is not None else bytes(range(256)) * 64
    info = f"vllm-{version}.dist-info"
    reqs = "".join(f"Requires-Dist: {r}\n" for r in requires or [])
    content[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n{reqs}\nsynthetic\n".encode()
    content[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{k},sha256={_b64(v)},{len(v)}\n" for k, v in content.items()) + f"{info}/RECORD,,\n"
    path = dest_dir / f"vllm-{version}-py3-none-any.whl"
    dest_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in content.items():
            zi = zipfile.ZipInfo(name, (2026, 1, 1, 0, 0, 0))
            zi.external_attr = (0o755 if name == COMPILED else 0o644) << 16
            zf.writestr(zi, data)
        zf.writestr(zipfile.ZipInfo(f"{info}/RECORD", (2026, 1, 1, 0, 0, 0)), record)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Proj:
    root: Path
    cache: Path
    versions: list[str]

    def run(self, *args: str, env: dict | None = None, check_rc: int | None = None, timeout: int = 600):
        e = dict(os.environ)
        e.pop("GLM5_OVERLAY_FAULT", None)
        e.update(env or {})
        cmd = [sys.executable, str(TOOL), "--project", str(self.root), "--wheel-cache", str(self.cache), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout)
        r.out = r.stdout + r.stderr  # type: ignore[attr-defined]
        if check_rc is not None:
            assert r.returncode == check_rc, f"exit {r.returncode} != {check_rc}\n{r.out}"
        return r

    def tree(self, version: str) -> Path:
        return self.root / "work" / version / "tree"

    def patches(self, version: str) -> Path:
        return self.root / "patches" / version

    def write_lock(self, wheels: dict[str, Path], default: str | None = None) -> None:
        lines = [f'default = "{default or self.versions[0]}"\n']
        for v, w in wheels.items():
            lines.append(
                f'\n[pins."{v}"]\nwheel = "{w.name}"\nsha256 = "{sha256(w)}"\ntorch = "2.13.0"\ntriton = "==3.6.0"\n'
            )
        (self.root / "pins.lock").write_text("".join(lines))


def make_project(tmp: Path, versions=("9.9.0",), files: dict[str, str] | None = None) -> Proj:
    root = tmp / "proj"
    cache = tmp / "cache"
    for d in ("overlay", "kernels", "tests/kernels"):
        (root / d).mkdir(parents=True, exist_ok=True)
    wheels = {v: make_wheel(cache, v, files) for v in versions}
    p = Proj(root, cache, list(versions))
    p.write_lock(wheels)
    for v in versions:
        p.patches(v).mkdir(parents=True, exist_ok=True)
        (p.patches(v) / "series").write_text("# empty\n")
    return p


def git(cwd: Path, *args: str, check: bool = True) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="Dev", GIT_AUTHOR_EMAIL="dev@example.com",
               GIT_COMMITTER_NAME="Dev", GIT_COMMITTER_EMAIL="dev@example.com")
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if check:
        assert r.returncode == 0, r.stderr
    return r.stdout.strip()


HEADER = """{subject}

Why this patch exists: {why}

Concern: {concern}
Forwarded: no
Last-Update: 2026-12-02
"""


def commit_edit(tree: Path, edits: dict[str, str | None], subject: str, concern: str = "routing", why: str = "a test") -> None:
    """Edit files in a tree (None deletes) and commit them with a valid patch header."""
    for rel, text in edits.items():
        p = tree / rel
        if text is None:
            p.unlink()
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", HEADER.format(subject=subject, why=why, concern=concern))


def snapshot(tree: Path) -> dict:
    """Everything that 'the tree is as it was' means: HEAD, branch, refs, status, file bytes."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(tree):
        if ".git" in dirnames:
            dirnames.remove(".git")
        for f in filenames:
            p = Path(dirpath) / f
            files[str(p.relative_to(tree))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return {
        "head": git(tree, "rev-parse", "HEAD"),
        "branch": git(tree, "rev-parse", "--abbrev-ref", "HEAD"),
        "refs": git(tree, "for-each-ref", "--format=%(refname) %(objectname)"),
        "status": git(tree, "status", "--porcelain"),
        "files": files,
    }


def model_with(changes: dict[int, str], insert_top: int = 0) -> str:
    lines = list(MODEL_LINES)
    for i, text in changes.items():
        lines[i - 1] = text
    return "".join([f"# header {i}\n" for i in range(insert_top)] + lines)


@pytest.fixture
def proj(tmp_path) -> Proj:
    return make_project(tmp_path)


@pytest.fixture
def proj_with_patch(tmp_path) -> Proj:
    """A project whose 9.9.0 series has one patch (value_20 -> twenty), authored via apply+refresh."""
    p = make_project(tmp_path)
    p.run("apply", check_rc=0)
    commit_edit(p.tree("9.9.0"), {"vllm/model.py": model_with({20: "value_20 = 'twenty'\n"})}, "[Model] Twenty as a word")
    p.run("refresh", check_rc=0)
    return p

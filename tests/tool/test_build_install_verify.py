"""build (repacked wheel), install (venv, refusals), verify (a)/(b)/(c), revert/uninstall."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import COMPILED, commit_edit, git, make_project, make_wheel, model_with, sha256, snapshot

VERIFY_TOML = """
[[import]]
module = "vllm.v1.attention.ops.triton_k"

[[attribute]]
object = "vllm.v1.attention.backends.registry:AttentionBackendEnum"
name = "TRITON_K"
value = "vllm.v1.attention.ops.triton_k.K"
"""


@pytest.fixture
def built(tmp_path):
    p = make_project(tmp_path)
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    reg = (t / "vllm/v1/attention/backends/registry.py").read_text() + "    TRITON_K = 'vllm.v1.attention.ops.triton_k.K'\n"
    commit_edit(t, {"vllm/v1/attention/backends/registry.py": reg, "vllm/model.py": model_with({20: "value_20 = 'twenty'\n"})},
                "[Attention] Register TRITON_K", concern="triton-k")
    p.run("refresh", check_rc=0)
    (p.root / "kernels" / "triton_k.py").write_text("K = 'kernel'\n")
    (p.root / "overlay" / "verify.toml").write_text(VERIFY_TOML)
    p.run("apply", check_rc=0)
    r = p.run("build", check_rc=0)
    assert "built " in r.out
    return p


def _wheel(p):
    b = json.loads((p.root / "work" / "9.9.0" / "build.json").read_text())
    from pathlib import Path

    return Path(b["wheel"]), b


def test_build_repacks_with_local_version_and_is_reproducible(built):
    p = built
    w, b = _wheel(p)
    assert w.name.startswith("vllm-9.9.0+glm5.") and w.name.endswith("-py3-none-any.whl")
    assert b["version"] == w.name.split("-")[1]
    with zipfile.ZipFile(w) as zf:
        names = zf.namelist()
        meta = zf.read(f"vllm-{b['version']}.dist-info/METADATA").decode()
        assert f"Version: {b['version']}" in meta
        with zipfile.ZipFile(p.cache / "vllm-9.9.0-py3-none-any.whl") as rz:
            assert zf.read(COMPILED) == rz.read(COMPILED)  # binaries reused unchanged
        assert "vllm/v1/attention/ops/triton_k.py" in names
    first = sha256(w)
    w.unlink()
    p.run("build", check_rc=0)
    assert sha256(w) == first  # same series + overlay -> same bytes


def test_build_refuses_unexported_commits(built):
    p = built
    t = p.tree("9.9.0")
    commit_edit(t, {"vllm/version.py": "__version__ = 'dev'\n"}, "[Misc] Local experiment")
    before = snapshot(t)
    r = p.run("build", check_rc=5)
    assert "the tree differs from patches/9.9.0 + overlay in: M vllm/version.py" in r.out
    assert "run `refresh`" in r.out
    assert snapshot(t) == before
    r = p.run("build", "--allow-drift", check_rc=0)
    w, b = _wheel(p)
    assert ".wip" in b["version"]


def test_wheel_check_catches_unexplained_changes(built, tmp_path):
    from overlay_tool.verify import check_wheel

    p = built
    w, b = _wheel(p)
    release = p.cache / "vllm-9.9.0-py3-none-any.whl"
    expected = {"vllm/model.py": "M", "vllm/v1/attention/backends/registry.py": "M", "vllm/v1/attention/ops/triton_k.py": "A"}
    with zipfile.ZipFile(w) as zf:
        exp_sha = {k: __import__("hashlib").sha256(zf.read(k)).hexdigest() for k in expected}
    ok = check_wheel(release, w, b["version"], expected, exp_sha)
    assert ok["ok"], ok["problems"]
    assert ok["compiled_files"] == 1 and ok["compiled_identical"] == 1
    assert ok["untouched_identical"] == ok["untouched"] == ok["release_files"] - 2
    # a wheel with one more changed file and no compiled file
    bad = tmp_path / w.name
    with zipfile.ZipFile(w) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            if info.filename == COMPILED:
                continue
            data = src.read(info)
            if info.filename == "vllm/version.py":
                data = b"__version__ = 'tampered'\n"
            dst.writestr(info, data)
    res = check_wheel(release, bad, b["version"], expected, exp_sha)
    assert not res["ok"]
    assert "vllm/version.py: modified in the built wheel, but the series/overlay say unchanged" in res["problems"]
    assert f"{COMPILED}: missing in the built wheel, but the series/overlay say unchanged" in res["problems"]
    assert f"{COMPILED}: compiled file missing or changed" in res["problems"]
    assert any("vllm/version.py: content does not match the built wheel's RECORD" in x for x in res["problems"])


@pytest.fixture
def installed(built, tmp_path):
    venv = tmp_path / "venv"
    r = built.run("--venv", str(venv), "install", "--deps", "none", check_rc=0, timeout=900)
    assert (venv / ".glm5-overlay-venv").exists()
    return built, venv


def _vllm_version(venv):
    return subprocess.run([str(venv / "bin/python"), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                          capture_output=True, text=True).stdout.strip()


def test_verify_passes_and_writes_reports(installed):
    p, venv = installed
    r = p.run("--venv", str(venv), "verify", check_rc=0, timeout=900)
    assert "verification PASSED" in r.out
    rep = json.loads((p.root / "work/9.9.0/report.json").read_text())
    assert rep["ok"] and rep["tree_check"]["ok"] and rep["imports"]["ok"]
    targets = {c["target"]: c["ok"] for c in rep["imports"]["checks"]}
    assert targets == {"vllm": True, "vllm.v1.attention.ops.triton_k": True,
                       "vllm.v1.attention.backends.registry:AttentionBackendEnum.TRITON_K": True}
    assert rep["kernels"]["skipped"].endswith("has no tests yet")
    md = (p.root / "work/9.9.0/report.md").read_text()
    assert "(a) Wheel content: PASS" in md and "(b) Imports and registrations: PASS" in md
    assert "PASS: attribute `vllm.v1.attention.backends.registry:AttentionBackendEnum.TRITON_K`" in md


def test_verify_fails_on_a_missing_registration(installed):
    p, venv = installed
    (p.root / "overlay" / "verify.toml").write_text(VERIFY_TOML + '\n[[attribute]]\nobject = "vllm.v1.attention.backends.registry:AttentionBackendEnum"\nname = "NOT_THERE"\n')
    r = p.run("--venv", str(venv), "verify", check_rc=8, timeout=900)
    assert "AttentionBackendEnum has no attribute NOT_THERE" in r.out
    assert "(b) Imports and registrations: FAIL" in (p.root / "work/9.9.0/report.md").read_text()


def test_verify_without_verify_toml_says_so(installed):
    p, venv = installed
    (p.root / "overlay" / "verify.toml").unlink()
    r = p.run("--venv", str(venv), "verify", check_rc=0, timeout=900)
    rep = json.loads((p.root / "work/9.9.0/report.json").read_text())
    assert rep["imports"]["scope"] == "overlay/verify.toml is absent: only `import vllm` was checked"


def test_bad_verify_toml_is_a_usage_error(built):
    p = built
    (p.root / "overlay" / "verify.toml").write_text('[[attribute]]\nobject = "vllm.registry.Enum"\nname = "X"\n')
    r = p.run("apply", check_rc=2)
    assert "[[attribute]] #1: object 'vllm.registry.Enum' must be 'package.module:Name'" in r.out
    r = p.run("check", check_rc=2)
    assert "must be 'package.module:Name'" in r.out


def test_revert_and_uninstall(installed):
    p, venv = installed
    assert _vllm_version(venv).startswith("9.9.0+glm5.")
    r = p.run("--venv", str(venv), "--dry-run", "revert", check_rc=0)
    assert "would run:" in r.out and _vllm_version(venv).startswith("9.9.0+glm5.")
    r = p.run("--venv", str(venv), "revert", check_rc=0, timeout=900)
    assert "stock vllm 9.9.0 reinstalled" in r.out and _vllm_version(venv) == "9.9.0"
    r = p.run("--venv", str(venv), "uninstall", check_rc=0)
    assert "is not a patched build; left alone" in r.out and _vllm_version(venv) == "9.9.0"
    p.run("--venv", str(venv), "install", "--deps", "none", check_rc=0, timeout=900)
    r = p.run("--venv", str(venv), "uninstall", check_rc=0, timeout=900)
    assert "removed vllm 9.9.0+glm5." in r.out and _vllm_version(venv) == ""


def test_install_refuses_to_replace_a_users_vllm_or_torch(built, tmp_path):
    p = built
    venv = tmp_path / "user-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run(pip + [str(p.cache / "vllm-9.9.0-py3-none-any.whl")], check=True)
    r = p.run("--venv", str(venv), "install", "--deps", "none", check_rc=5)
    assert "vllm 9.9.0 is installed and would be replaced" in r.out and "nothing was installed" in r.out
    assert _vllm_version(venv) == "9.9.0"
    # a torch other than the pinned one (a stand-in distribution named torch)
    fake = make_wheel(tmp_path / "faketorch", "0.0.1", {"torch_stub/__init__.py": ""})
    renamed = tmp_path / "faketorch" / "torch-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(fake) as src, zipfile.ZipFile(renamed, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            name = info.filename.replace("vllm-0.0.1.dist-info", "torch-0.0.1.dist-info")
            if name.endswith("METADATA"):
                data = data.replace(b"Name: vllm", b"Name: torch")
            if name.endswith("RECORD"):
                data = data.replace(b"vllm-0.0.1.dist-info", b"torch-0.0.1.dist-info")
            if name.startswith("vllm/"):
                continue
            dst.writestr(name, data)
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "uninstall", "-y", "-q", "vllm"], check=True)
    subprocess.run(pip + [str(renamed)], check=True)
    r = p.run("--venv", str(venv), "--dry-run", "install", "--deps", "full", check_rc=5)
    assert "torch 0.0.1 is installed; vLLM 9.9.0 needs torch 2.13.0 and pip would replace it" in r.out


def test_kernel_tests_run_in_the_environment(tmp_path):
    from overlay_tool.verify import kernel_tests

    root = tmp_path / "proj"
    d = root / "tests" / "kernels"
    d.mkdir(parents=True)
    res = kernel_tests(__import__("pathlib").Path(sys.executable), root, d, cuda=False)
    assert res == {"ok": True, "skipped": "tests/kernels has no tests yet", "ran": False}
    (d / "test_k.py").write_text("import os\n\ndef test_interp():\n    assert os.environ['TRITON_INTERPRET'] == '1'\n")
    res = kernel_tests(__import__("pathlib").Path(sys.executable), root, d, cuda=False)
    assert res["ok"] and res["ran"] and res["interpreter"] and "1 passed" in res["summary"]
    (d / "test_k.py").write_text("def test_bad():\n    assert 1 == 2\n")
    res = kernel_tests(__import__("pathlib").Path(sys.executable), root, d, cuda=False)
    assert not res["ok"] and "1 failed" in res["summary"]


def test_kernel_tests_show_progress_while_they_run(tmp_path):
    """verify (c) streams pytest's output: the first test's result arrives while a later test is
    still running, not after the run."""
    import time

    from overlay_tool.verify import kernel_tests

    root = tmp_path / "proj"
    d = root / "tests" / "kernels"
    d.mkdir(parents=True)
    gate = tmp_path / "gate"
    (d / "test_slow.py").write_text(
        "import pathlib, time\n\ndef test_fast():\n    pass\n\n"
        f"def test_waits_for_the_first_dot():\n    gate = pathlib.Path({str(gate)!r})\n"
        "    t = time.time()\n    while not gate.exists():\n        assert time.time() - t < 60, 'no progress was streamed'\n"
        "        time.sleep(0.05)\n")
    seen = []

    def echo(chunk: bytes) -> None:
        seen.append((time.time(), chunk))
        if b"." in chunk:
            gate.touch()

    res = kernel_tests(__import__("pathlib").Path(sys.executable), root, d, cuda=False, echo=echo)
    assert res["ok"] and "2 passed" in res["summary"], res
    assert b"2 passed" in b"".join(c for _, c in seen)

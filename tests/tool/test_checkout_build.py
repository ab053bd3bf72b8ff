"""--checkout mode: patches as commits on overlay/<version>, build with VLLM_USE_PRECOMPILED."""
from __future__ import annotations

import json
import subprocess

from conftest import BASE_FILES, git, snapshot

SETUP = """
import json, os
from setuptools import setup
keys = ("VLLM_USE_PRECOMPILED", "VLLM_PRECOMPILED_WHEEL_LOCATION", "VLLM_VERSION_OVERRIDE")
rec = os.environ.get("GLM5_TEST_BUILD_RECORD")
if rec:
    json.dump({k: os.environ.get(k) for k in keys}, open(rec, "w"))
setup(name="vllm", version=os.environ.get("VLLM_VERSION_OVERRIDE", "0"), packages=["vllm"])
"""


def test_checkout_build_uses_precompiled_release(proj_with_patch, tmp_path):
    p = proj_with_patch
    co = tmp_path / "vllm-src"
    co.mkdir()
    for rel, text in BASE_FILES.items():
        if rel.count("/") == 1:  # the top-level package is enough for the build
            f = co / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text.replace("{version}", "9.9.0"))
    (co / "setup.py").write_text(SETUP)
    (co / ".gitignore").write_text("build/\n*.egg-info/\n")
    git(co, "init", "-q", "-b", "main")
    git(co, "add", "-A")
    git(co, "commit", "-q", "-m", "vLLM 9.9.0 sources")
    git(co, "tag", "v9.9.0")
    p.run("--checkout", str(co), "apply", check_rc=0)
    assert git(co, "rev-parse", "--abbrev-ref", "HEAD") == "overlay/9.9.0"
    rec = tmp_path / "build-env.json"
    r = p.run("--checkout", str(co), "build", "--no-build-isolation", env={"GLM5_TEST_BUILD_RECORD": str(rec)}, check_rc=0)
    env = json.loads(rec.read_text())
    assert env["VLLM_USE_PRECOMPILED"] == "1"
    assert env["VLLM_PRECOMPILED_WHEEL_LOCATION"] == str(p.cache / "vllm-9.9.0-py3-none-any.whl")
    assert env["VLLM_VERSION_OVERRIDE"].startswith("9.9.0+glm5.")
    b = json.loads((p.root / "work/9.9.0/build.json").read_text())
    assert b["managed"] is False and "+glm5." in b["wheel"]
    out = subprocess.run(["unzip", "-p", b["wheel"], "vllm/model.py"], capture_output=True, text=True).stdout
    assert "value_20 = 'twenty'" in out  # the patched checkout was built
    before = snapshot(co)
    assert before["status"] == ""

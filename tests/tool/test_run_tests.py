"""tools/run_tests.py: which torch builds it accepts, and where step 4 writes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("run_tests", REPO / "tools" / "run_tests.py")
run_tests = importlib.util.module_from_spec(spec)
sys.modules["run_tests"] = run_tests
spec.loader.exec_module(run_tests)


def _fake_python(tmp_path: Path, version: str) -> Path:
    p = tmp_path / f"python-{version.replace('+', '_')}"
    p.write_text(f"#!/bin/sh\necho {version}\n")
    p.chmod(0o755)
    return p


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.13.0+cu130", "2.13.0"])
def test_any_torch_2_13_0_build_is_accepted(tmp_path, version):
    assert run_tests.check_torch(_fake_python(tmp_path, version)) == version


@pytest.mark.parametrize("version", ["2.12.1+cpu", "2.14.0", ""])
def test_another_torch_is_refused(tmp_path, version):
    with pytest.raises(SystemExit, match="expected torch 2.13.0"):
        run_tests.check_torch(_fake_python(tmp_path, version))


def test_step_4_builds_outside_the_main_jobs_work_folder(tmp_path):
    """Run the tool with step 4's arguments as a dry run: its tree and report folder are
    work/test-run/<pin>/, not the main job's work/<pin>/."""
    import subprocess

    cmd = run_tests.pin_build_command(Path(sys.executable), "0.26.0", tmp_path / "venv")
    work = REPO / "work" / "test-run" / "0.26.0"
    assert cmd[cmd.index("--work") + 1] == str(work / "tree") and cmd[cmd.index("--out") + 1] == str(work)
    r = subprocess.run([*cmd[:2], "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "--work DIR" in r.stdout and "--out DIR" in r.stdout
    # the test's own tree always follows patches/<pin>, whatever an earlier run left in it
    assert cmd[cmd.index("all"):cmd.index("all") + 3] == ["all", "--rebuild", "--force"]
    r = subprocess.run([*cmd[:2], "all", "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "--rebuild" in r.stdout and "--force" in r.stdout

#!/usr/bin/env python3
"""The project's test command (README, .ci/run): python3 tools/run_tests.py

On a fresh CPU machine it makes what the tests need and runs them, stopping at the first failure:

  1. venv .venv-test/main: torch 2.13.0, triton of the default pin (pins.lock), the tool's
     dependencies and test extras (pyproject.toml)    -> pytest tests/ e2e/tests/
  2. venv .venv-test/triton-<pin>: torch 2.13.0 + triton of the newest pin
                                                      -> pytest tests/kernels/test_sm120_compile.py
  3. tools/apply.py check (every pin: apply to a fresh tree, re-export, compare)
  4. for every pin: tools/apply.py fetch/apply/build, install the patched wheel --deps minimal
     (--no-deps + what the import checks need) into .venv-test/vllm-<pin> (torch 2.13.0),
     verify (a) wheel content and (b) imports/registrations, then pytest tests/integration there
     with GLM5_OVERLAY_REQUIRE_VLLM=1. Tree, build and report go to work/test-run/<pin>/, never to
     the main job's work/<pin>/.

torch 2.13.0 is whichever build pip finds (the CPU one where it is offered; a CUDA build runs the
CPU tests as well). Virtual environments are reused while their requirements hash matches. Options: --skip-vllm
(steps 1-2 only), --keep-going (run every step, fail at the end).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENVS = REPO / ".venv-test"
# Any build of torch 2.13.0 will do: the CPU one (what this machine's pip finds first) or a CUDA one
# (which runs the CPU tests as well); the tests never load vLLM's compiled ops.
TORCH_VERSION = "2.13.0"
CPU_TORCH = f"torch=={TORCH_VERSION}"
TEST_WORK = REPO / "work" / "test-run"
PY = sys.executable


def say(msg: str) -> None:
    print(f"[run_tests] {msg}", flush=True)


def pins() -> tuple[str, dict]:
    data = tomllib.loads((REPO / "pins.lock").read_text())
    return data["default"], data["pins"]


def project_requirements() -> list[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    proj = data["project"]
    return list(proj["dependencies"]) + list(proj.get("optional-dependencies", {}).get("test", []))


def venv(name: str, requirements: list[str]) -> Path:
    """A venv under .venv-test/ with exactly these requirements installed (reused while they match)."""
    path = VENVS / name
    digest = hashlib.sha256(json.dumps([sys.version_info[:2], requirements]).encode()).hexdigest()
    stamp = path / ".requirements-hash"
    python = path / "bin" / "python"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        say(f"reusing {path.relative_to(REPO)} (requirements unchanged)")
        return python
    if path.exists():
        shutil.rmtree(path)
    say(f"creating {path.relative_to(REPO)}: {' '.join(requirements)}")
    run([PY, "-m", "venv", str(path)])
    run([str(python), "-m", "pip", "install", "--progress-bar", "off", *requirements])
    if CPU_TORCH in requirements:
        check_torch(python)
    stamp.write_text(digest + "\n")
    return python


def check_torch(python: Path) -> str:
    """The venv's torch must be 2.13.0, whichever build (+cpu, +cu*, or PyPI's plain one)."""
    r = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    version = r.stdout.strip()
    if r.returncode != 0 or version.split("+")[0] != TORCH_VERSION:
        raise SystemExit(f"{python}: expected torch {TORCH_VERSION} (any build), got "
                         f"{version or 'none'} {r.stderr[-300:]}")
    return version


def pin_build_command(tool_py: Path, version: str, venv_dir: Path) -> list[str]:
    """Step 4's build + install + verify of one pin: tree, wheel and report under
    work/test-run/<pin>/, never the main job's work/<pin>/. The tree is the test's own, so it is
    always rebuilt from patches/<pin> (--rebuild --force): the tests see the committed series even
    when an earlier run's tree holds other patch commits."""
    work = TEST_WORK / version
    return [str(tool_py), "tools/apply.py", "--vllm", version, "--work", str(work / "tree"), "--out", str(work),
            "--venv", str(venv_dir), "all", "--rebuild", "--force", "--deps", "minimal", "--no-kernel-tests"]


def run(cmd: list[str], env: dict | None = None, allow_no_tests: bool = False) -> None:
    say("$ " + " ".join(str(c) for c in cmd))
    r = subprocess.run(cmd, cwd=REPO, env=env)
    if r.returncode == 5 and "pytest" in cmd and not allow_no_tests:
        raise StepFailed("pytest collected no tests")
    if r.returncode != 0:
        raise StepFailed(f"exit {r.returncode}")


class StepFailed(Exception):
    pass


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-vllm", action="store_true", help="steps 1-2 only (no vLLM builds)")
    ap.add_argument("--keep-going", action="store_true", help="run every step even after a failure")
    args = ap.parse_args()
    if sys.version_info < (3, 11):
        say("needs Python >= 3.11")
        return 2
    default, table = pins()
    newest = max(table, key=lambda v: tuple(int(x) for x in v.split(".")))
    results: list[tuple[str, str, float]] = []

    def step(name: str, fn) -> bool:
        t0 = time.time()
        say(f"=== {name}")
        try:
            fn()
            results.append((name, "ok", time.time() - t0))
            return True
        except StepFailed as e:
            results.append((name, f"FAILED ({e})", time.time() - t0))
            say(f"{name}: FAILED ({e})")
            return False

    tests_req = [CPU_TORCH, f"triton{table[default]['triton']}", "numpy", *project_requirements()]
    main_py: list[Path] = []

    def s1():
        main_py.append(venv("main", tests_req))
        run([str(main_py[0]), "-m", "pytest", "-p", "no:cacheprovider", "tests/", "e2e/tests/"], env=clean_env())

    def s2():
        compile_test = REPO / "tests" / "kernels" / "test_sm120_compile.py"
        if not compile_test.exists():
            say(f"tests/kernels/test_sm120_compile.py does not exist yet: step skipped")
            return
        py = venv(f"triton-{newest}", [CPU_TORCH, f"triton{table[newest]['triton']}", "numpy", "pytest", "hypothesis"])
        run([str(py), "-m", "pytest", "-p", "no:cacheprovider", "tests/kernels/test_sm120_compile.py"], env=clean_env())

    ok = step("1. pytest tests/ e2e/tests/ (torch 2.13.0, triton " + table[default]["triton"] + ")", s1)
    if ok or args.keep_going:
        ok = step(f"2. SM120 compile check (triton {table[newest]['triton']})", s2) and ok
    if not args.skip_vllm and (ok or args.keep_going):
        tool_py = main_py[0] if main_py else venv("main", tests_req)

        def s3():
            run([str(tool_py), "tools/apply.py", "check"], env=clean_env())

        ok = step("3. tools/apply.py check (every pin)", s3) and ok
        for v in sorted(table, key=lambda v: tuple(int(x) for x in v.split("."))):
            if not (ok or args.keep_going):
                break

            def s4(v=v):
                vpy = venv(f"vllm-{v}", [CPU_TORCH, "pytest", "hypothesis"])
                run(pin_build_command(tool_py, v, vpy.parent.parent), env=clean_env())
                integ = REPO / "tests" / "integration"
                if integ.is_dir() and any(integ.glob("test_*.py")):
                    run([str(vpy), "-m", "pytest", "-p", "no:cacheprovider", "tests/integration"],
                        env=clean_env(GLM5_OVERLAY_REQUIRE_VLLM="1"))
                else:
                    say("tests/integration has no tests yet")

            ok = step(f"4. vLLM {v}: build, install --deps minimal, verify, tests/integration", s4) and ok
    say("=== summary")
    for name, res, secs in results:
        say(f"{res:>8}  {secs:7.0f} s  {name}")
    failed = [r for r in results if r[1] != "ok"]
    say(f"{'FAILED' if failed else 'all'} {len(results) - len(failed)} of {len(results)} steps passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

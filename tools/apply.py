#!/usr/bin/env python3
"""tools/apply.py: pinned vLLM release -> patched, installed, verified vLLM.

Run `python3 tools/apply.py --help`. The implementation is in tools/overlay_tool/. On a machine
without the tool's own dependencies (pyproject.toml: GitPython, wheel, packaging, tqdm, pip) it
first makes .venv-tool/ with them and runs itself from there.
"""
import os
import subprocess
import sys

if sys.version_info < (3, 11):
    sys.exit("tools/apply.py needs Python >= 3.11 (tomllib)")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def _bootstrap(missing: str) -> None:
    import tomllib

    venv = os.path.join(REPO, ".venv-tool")
    python = os.path.join(venv, "bin", "python")
    if os.environ.get("GLM5_OVERLAY_BOOTSTRAPPED") == "1":
        sys.exit(f"error: {missing} is missing in {sys.prefix}: pip install -e {REPO}")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    if not os.path.exists(python):
        print(f"tools/apply.py: {missing} is not installed here; making {venv} with {', '.join(deps)}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *deps], check=True)
    env = dict(os.environ, GLM5_OVERLAY_BOOTSTRAPPED="1")
    os.execve(python, [python, os.path.abspath(__file__), *sys.argv[1:]], env)


try:
    import git  # noqa: F401  (GitPython)
    import packaging  # noqa: F401
    import tqdm  # noqa: F401
    import wheel  # noqa: F401
except ModuleNotFoundError as e:
    _bootstrap(e.name)

from overlay_tool.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""tools/apply.py: pinned vLLM release -> patched, installed, verified vLLM.

Run `python3 tools/apply.py --help`. The implementation is in tools/overlay_tool/. On a machine
without the tool's own dependencies (pyproject.toml: GitPython, wheel, packaging, tqdm, pip) it
first makes .venv-tool/ with them (pip install runs again only when pyproject.toml's dependencies
change: .venv-tool/.glm5-requirements holds their hash) and runs itself from there.
"""
import os
import subprocess
import sys

if sys.version_info < (3, 11):
    sys.exit("tools/apply.py needs Python >= 3.11 (tomllib)")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)


# module -> the distribution that provides it (what the user has to install)
_PROVIDERS = {"git": "GitPython", "packaging": "packaging", "tqdm": "tqdm", "wheel": "wheel"}
STAMP = ".glm5-requirements"  # in .venv-tool/: sha256 of the requirements it was made with


def requirements_digest(deps: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(sorted(deps)).encode()).hexdigest()


def venv_is_current(venv: str, deps: list[str]) -> bool:
    """True when `venv` was made (or last updated) by this script with exactly `deps`."""
    try:
        with open(os.path.join(venv, STAMP)) as f:
            return f.read().strip() == requirements_digest(deps) and os.path.exists(os.path.join(venv, "bin", "python"))
    except OSError:
        return False


def _bootstrap(missing: str) -> None:
    import tomllib

    what = f"the Python module '{missing}' ({_PROVIDERS.get(missing, missing)})"
    venv = os.path.join(REPO, ".venv-tool")
    python = os.path.join(venv, "bin", "python")
    if os.environ.get("GLM5_OVERLAY_BOOTSTRAPPED") == "1":
        sys.exit(f"error: {what} is missing in {sys.prefix}: pip install -e {REPO}")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    print(f"tools/apply.py: {what} is missing in {sys.prefix}; running from {venv} "
          f"({', '.join(deps)})", flush=True)
    if not os.path.exists(python):
        print(f"tools/apply.py: making {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if not venv_is_current(venv, deps):
        subprocess.run([python, "-m", "pip", "install", "-q", *deps], check=True)
        with open(os.path.join(venv, STAMP), "w") as f:
            f.write(requirements_digest(deps) + "\n")
    env = dict(os.environ, GLM5_OVERLAY_BOOTSTRAPPED="1")
    os.execve(python, [python, os.path.abspath(__file__), *sys.argv[1:]], env)


try:
    import git  # noqa: F401  (GitPython)
    import packaging  # noqa: F401
    import tqdm  # noqa: F401
    import wheel  # noqa: F401
except ModuleNotFoundError as e:
    _bootstrap(e.name)
except ImportError as e:  # GitPython is there but finds no git executable
    sys.exit(f"error: git is not installed or not on PATH (GitPython: {str(e).splitlines()[0]})")

from overlay_tool.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

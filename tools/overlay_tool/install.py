"""Install the patched wheel into a virtual environment; put stock vLLM back."""
from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from .safety import run as run_child
from .errors import ExternalError, RefusedError, UsageError
from .pins import Pin

MARKER = ".glm5-overlay-venv"
# What `import vllm` and the registration checks import beyond torch, measured by importing
# vllm, vllm.v1.attention.backend, ...backends.registry, ...layers.attention.mla_attention and
# ...backends.mla.flashinfer_mla_sparse_sm120 from each pinned wheel installed with --no-deps next
# to CPU torch (tools/run_tests.py and README "CI" say how). Used by `--deps minimal`.
IMPORT_DEPS = [
    # every pin
    "numpy", "packaging", "regex", "psutil", "pyzmq", "urllib3", "transformers", "cbor2",
    "aiohttp", "requests", "openai-harmony", "openai", "einops",
    # 0.33.0 adds (0.34.0 needs nothing more: verify (b) passes with this list)
    "pillow", "pybase64", "cachetools", "msgspec", "cloudpickle", "uvloop", "py-cpuinfo",
    "prometheus_client", "xgrammar", "fastapi", "partial_json_parser", "llguidance",
]


@dataclass
class Venv:
    path: Path
    python: Path
    current: bool  # the running environment (--venv current)

    @property
    def ours(self) -> bool:
        return (self.path / MARKER).is_file()


def resolve_venv(arg: str | None, default: Path) -> Venv:
    if arg == "current":
        return Venv(Path(sys.prefix), Path(sys.executable), True)
    path = Path(arg).expanduser().resolve() if arg else default
    return Venv(path, path / "bin" / "python", False)


def ensure_venv(v: Venv, pin: Pin, dry_run: bool, log=print) -> None:
    if v.current or v.python.exists():
        return
    if v.path.exists() and any(v.path.iterdir()):
        raise RefusedError(f"{v.path} exists but is not a virtual environment (no bin/python); choose another --venv")
    if dry_run:
        log(f"would create a virtual environment at {v.path}")
        return
    log(f"creating virtual environment {v.path}")
    r = run_child([sys.executable, "-m", "venv", str(v.path)])
    if r.returncode != 0:
        raise ExternalError(f"python -m venv {v.path} failed")
    (v.path / MARKER).write_text(json.dumps({"created_by": "tools/apply.py", "vllm": pin.version}) + "\n")


_PROBE = r"""
import json, importlib.metadata as md
out = {}
for n in ("torch", "triton", "vllm", "pytest"):
    try:
        out[n] = md.version(n)
    except md.PackageNotFoundError:
        out[n] = None
print(json.dumps(out))
"""


def installed(v: Venv) -> dict[str, str | None]:
    if not v.python.exists():
        return {"torch": None, "triton": None, "vllm": None, "pytest": None}
    r = run_child([str(v.python), "-c", _PROBE], capture_output=True, text=True)
    if r.returncode != 0:
        raise ExternalError(f"{v.python} does not run: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)


def base(version: str | None) -> str | None:
    return version.split("+")[0] if version else None


def is_patched(version: str | None) -> bool:
    return bool(version and "+glm5." in version)


def pip(v: Venv, args: list[str], dry_run: bool, log=print) -> None:
    cmd = [str(v.python), "-m", "pip", *args]
    if dry_run:
        log(f"would run: {shlex.join(cmd)}")
        return
    log(f"$ {shlex.join(cmd)}")
    # PIP_NO_INPUT: pip runs in a process group of its own, where reading the terminal would stop it
    r = run_child(cmd, env=dict(os.environ, PIP_NO_INPUT="1"))
    if r.returncode != 0:
        raise ExternalError(f"pip failed (exit {r.returncode}): {shlex.join(cmd)}")


def install(
    pin: Pin,
    wheel: Path,
    v: Venv,
    deps: str,
    allow_replace: bool,
    dry_run: bool,
    extra: list[str] | None = None,
    log=print,
) -> dict:
    """Install the patched wheel. deps: full (wheel + its requirements + the pinned torch),
    minimal (wheel --no-deps + IMPORT_DEPS; the pinned torch only if no torch is there) or none."""
    if deps not in ("full", "minimal", "none"):
        raise UsageError(f"--deps must be full, minimal or none, not {deps!r}")
    ensure_venv(v, pin, dry_run, log)
    have = installed(v) if v.python.exists() else {"torch": None, "vllm": None}
    problems = []
    if have["torch"] and base(have["torch"]) != pin.torch and deps == "full":
        problems.append(f"torch {have['torch']} is installed; vLLM {pin.version} needs torch {pin.torch} and pip would replace it")
    if have["vllm"] and not is_patched(have["vllm"]) and not v.ours:
        problems.append(f"vllm {have['vllm']} is installed and would be replaced")
    if problems and not allow_replace:
        raise RefusedError(
            f"refusing to change {v.path}:\n  " + "\n  ".join(problems)
            + "\nnothing was installed; use a fresh --venv (the default), or pass --allow-replace"
        )
    if deps == "full":
        pip(v, ["install", str(wheel), f"torch=={pin.torch}", *(extra or [])], dry_run, log)
    else:
        pip(v, ["install", "--no-deps", "--force-reinstall", str(wheel)], dry_run, log)
        if deps == "minimal":
            pkgs = list(IMPORT_DEPS)
            if not have["torch"]:
                pkgs.append(f"torch=={pin.torch}")
            elif base(have["torch"]) != pin.torch:
                log(f"note: keeping torch {have['torch']} (vLLM {pin.version} pins {pin.torch}); "
                    f"the release's compiled ops are built for {pin.torch} and are not exercised")
            # never let a dependency move torch or triton away from what is there / pinned
            cfile = v.path / ".glm5-constraints.txt"
            torch_req = f"torch=={have['torch']}" if have.get("torch") else f"torch=={pin.torch}"
            triton_req = f"triton=={have['triton']}" if have.get("triton") else f"triton{pin.triton}"
            lines = [torch_req, triton_req]
            if not dry_run:
                cfile.write_text("\n".join(lines) + "\n")
            cons = ["-c", str(cfile)]
            pip(v, ["install", *cons, *pkgs, *(extra or [])], dry_run, log)
    return installed(v) if not dry_run else have


def revert(pin: Pin, release_wheel: Path, v: Venv, dry_run: bool, log=print) -> str:
    have = installed(v)
    if not is_patched(have["vllm"]):
        return f"{v.path}: vllm {have['vllm'] or '(not installed)'} is not a patched build; nothing to revert"
    if base(have["vllm"]) != pin.version:
        raise RefusedError(f"{v.path} has vllm {have['vllm']}, not a build of {pin.version}; pass --vllm {base(have['vllm'])}")
    pip(v, ["install", "--no-deps", "--force-reinstall", str(release_wheel)], dry_run, log)
    return f"{v.path}: stock vllm {pin.version} reinstalled (was {have['vllm']})"


def uninstall(v: Venv, dry_run: bool, log=print) -> str:
    have = installed(v)
    if not is_patched(have["vllm"]):
        return f"{v.path}: vllm {have['vllm'] or '(not installed)'} is not a patched build; left alone"
    pip(v, ["uninstall", "-y", "vllm"], dry_run, log)
    return f"{v.path}: removed vllm {have['vllm']}"

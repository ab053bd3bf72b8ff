"""Verification: (a) wheel content, (b) imports and registrations, (c) kernel tests; reports."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import selectors
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from .safety import child_kwargs, owned_tempdir
from .project import VerifySpec
from .tree import progress

COMPILED = re.compile(r"\.(so|pyd|dylib|dll)(\.[0-9.]+)?$")


def _is_dist_info(name: str) -> bool:
    return name.split("/", 1)[0].endswith(".dist-info")


def _record(zf: zipfile.ZipFile) -> dict[str, str]:
    names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(names) != 1:
        raise ValueError(f"{len(names)} RECORD files")
    out = {}
    for row in csv.reader(io.StringIO(zf.read(names[0]).decode("utf-8"))):
        if len(row) >= 2 and row[1].startswith("sha256="):
            digest = row[1][7:]
            out[row[0]] = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return out


def check_wheel(
    release: Path,
    built: Path,
    version: str,
    expected: dict[str, str],
    expected_sha: dict[str, str],
) -> dict:
    """(a): untouched files byte-identical to the release, compiled files present, changed set exact.

    expected: path -> A/M/D (what the series and overlay change); expected_sha: path -> sha256 of
    the content the series and overlay give A/M paths.
    """
    problems: list[str] = []
    with zipfile.ZipFile(release) as rz:
        rel = {k: v for k, v in _record(rz).items() if not _is_dist_info(k)}
    actual_sha: dict[str, str] = {}
    with zipfile.ZipFile(built) as bz:
        record = _record(bz)
        infos = [i for i in bz.infolist() if not i.is_dir()]
        with progress(total=sum(i.file_size for i in infos), desc="verifying wheel", unit="B", unit_scale=True) as bar:
            for info in infos:
                h = hashlib.sha256()
                with bz.open(info) as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        bar.update(len(block))
                d = h.hexdigest()
                if info.filename.endswith(".dist-info/RECORD"):
                    continue
                if record.get(info.filename) != d:
                    problems.append(f"{info.filename}: content does not match the built wheel's RECORD")
                if not _is_dist_info(info.filename):
                    actual_sha[info.filename] = d
        meta = [n for n in bz.namelist() if n.endswith(".dist-info/METADATA")]
        if len(meta) != 1 or f"\nVersion: {version}\n" not in "\n" + bz.read(meta[0]).decode("utf-8", "replace"):
            problems.append(f"built wheel's METADATA does not say Version: {version}")
    actual: dict[str, str] = {}
    for path, sha in rel.items():
        if path not in actual_sha:
            actual[path] = "D"
        elif actual_sha[path] != sha:
            actual[path] = "M"
    for path in actual_sha:
        if path not in rel:
            actual[path] = "A"
    for path in sorted(set(actual) | set(expected)):
        a, e = actual.get(path), expected.get(path)
        if a != e:
            what = {None: "unchanged", "A": "added", "M": "modified", "D": "missing"}
            problems.append(f"{path}: {what[a]} in the built wheel, but the series/overlay say {what[e]}")
        elif a in ("A", "M") and actual_sha[path] != expected_sha.get(path):
            problems.append(f"{path}: content differs from what the series/overlay produce")
    compiled = sorted(p for p in rel if COMPILED.search(p))
    compiled_bad = [p for p in compiled if actual_sha.get(p) != rel[p]]
    for p in compiled_bad:
        if p not in expected:
            problems.append(f"{p}: compiled file missing or changed")
    untouched = [p for p in rel if p not in expected]
    return {
        "ok": not problems,
        "problems": problems,
        "release_files": len(rel),
        "untouched_identical": sum(1 for p in untouched if actual_sha.get(p) == rel[p]),
        "untouched": len(untouched),
        "compiled_files": len(compiled),
        "compiled_identical": len(compiled) - len(compiled_bad),
        "changed": {p: actual[p] for p in sorted(actual)},
    }


_CHECKER = r'''
import enum, hashlib, importlib, importlib.metadata as md, json, os, sys, traceback
spec = json.load(open(sys.argv[1]))
res = {"checks": [], "files": []}
def tb(e):
    return "".join(traceback.format_exception_only(type(e), e)).strip()
try:
    res["installed_version"] = md.version("vllm")
except Exception as e:
    res["installed_version"] = None
try:
    import torch
    res["torch"] = torch.__version__
    res["cuda"] = bool(torch.cuda.is_available())
except BaseException as e:
    res["torch"] = None; res["cuda"] = False
try:
    import vllm
    res["checks"].append({"kind": "import", "target": "vllm", "ok": True})
    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
    res["vllm_file"] = vllm.__file__
except BaseException as e:
    res["checks"].append({"kind": "import", "target": "vllm", "ok": False, "error": tb(e)})
    root = None
if root:
    for path, want in sorted(spec["files"].items()):
        p = os.path.join(root, path)
        if want is None:
            ok = not os.path.exists(p)
        else:
            try:
                ok = hashlib.sha256(open(p, "rb").read()).hexdigest() == want
            except OSError:
                ok = False
        res["files"].append({"path": path, "ok": ok})
for c in spec["imports"]:
    r = {"kind": "import", "target": c["module"]}
    if c["gpu"] and not res["cuda"]:
        r.update(ok=None, skipped="needs a GPU")
    else:
        try:
            importlib.import_module(c["module"]); r["ok"] = True
        except BaseException as e:
            r.update(ok=False, error=tb(e))
    res["checks"].append(r)
for c in spec["attributes"]:
    r = {"kind": "attribute", "target": c["object"] + "." + c["name"]}
    if c["gpu"] and not res["cuda"]:
        r.update(ok=None, skipped="needs a GPU"); res["checks"].append(r); continue
    try:
        mod, qual = c["object"].split(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        if not hasattr(obj, c["name"]):
            r.update(ok=False, error=f"{c['object']} has no attribute {c['name']}")
        else:
            v = getattr(obj, c["name"])
            if isinstance(v, enum.Enum):
                v = v.value
            if c.get("value") is not None and str(v) != c["value"]:
                r.update(ok=False, error=f"value is {str(v)!r}, expected {c['value']!r}")
            else:
                r.update(ok=True, value=str(v)[:200])
    except BaseException as e:
        r.update(ok=False, error=tb(e))
    res["checks"].append(r)
json.dump(res, open(sys.argv[2], "w"))
'''


def check_imports(python: Path, spec: VerifySpec | None, version: str, files: dict[str, str | None], timeout: int = 900) -> dict:
    """(b): in the installed environment, import vllm and the overlay's modules, check registrations."""
    payload = spec.to_json() if spec else {"imports": [], "attributes": []}
    payload["files"] = files
    with owned_tempdir("glm5-verify-") as td:
        sp, op = Path(td) / "spec.json", Path(td) / "out.json"
        sp.write_text(json.dumps(payload))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        t0 = time.time()
        try:
            r = subprocess.run(
                [str(python), "-c", _CHECKER, str(sp), str(op)], cwd=td, env=env,
                capture_output=True, text=True, timeout=timeout, **child_kwargs(),
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "problems": [f"import checks did not finish in {timeout} s"], "checks": []}
        if r.returncode != 0 or not op.exists():
            return {"ok": False, "problems": [f"checker crashed (exit {r.returncode}): {r.stderr.strip()[-1500:]}"], "checks": []}
        res = json.loads(op.read_text())
    res["seconds"] = round(time.time() - t0, 1)
    problems = []
    if res.get("installed_version") != version:
        problems.append(f"installed vllm is {res.get('installed_version')}, expected {version}")
    for c in res["checks"]:
        if c["ok"] is False:
            problems.append(f"{c['kind']} {c['target']}: {c.get('error')}")
    for f in res["files"]:
        if not f["ok"]:
            problems.append(f"installed {f['path']} is not the patched content")
    res["ok"] = not problems
    res["problems"] = problems
    res["scope"] = (
        f"import vllm plus {len(payload['imports'])} import(s) and {len(payload['attributes'])} attribute check(s) "
        f"from {spec.path.name}" if spec else "overlay/verify.toml is absent: only `import vllm` was checked"
    )
    return res


def _echo_stdout(chunk: bytes) -> None:
    out = getattr(sys.stdout, "buffer", None)
    if out is not None:
        out.write(chunk)
    else:
        sys.stdout.write(chunk.decode(errors="replace"))
    sys.stdout.flush()


def run_streaming(cmd: list[str], cwd: Path, env: dict, timeout: float, echo=_echo_stdout,
                  keep: int = 256_000) -> tuple[int | None, str]:
    """Run cmd with stdout and stderr merged, handing each chunk to echo as it arrives (pytest's
    progress dots show while the tests run); returns (exit code, the output's last `keep` bytes),
    or (None, ...) after killing it at the timeout."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            **child_kwargs())
    deadline = time.monotonic() + timeout
    buf = bytearray()
    fd = proc.stdout.fileno()
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    proc.kill()
                    proc.wait()
                    proc.stdout.close()
                    return None, buf.decode(errors="replace")
                if not sel.select(timeout=min(left, 1.0)):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                if echo is not None:
                    echo(chunk)
                buf += chunk
                if len(buf) > 2 * keep:
                    del buf[:-keep]
    except BaseException:  # Ctrl-C / SIGTERM: end pytest with the tool
        proc.kill()
        proc.wait()
        raise
    proc.stdout.close()
    return proc.wait(), bytes(buf[-keep:]).decode(errors="replace")


def kernel_tests(python: Path, project_root: Path, tests_dir: Path, cuda: bool, timeout: int = 3600,
                 echo=_echo_stdout) -> dict:
    """(c): pytest tests/kernels in the installed environment (TRITON_INTERPRET=1 without a GPU);
    pytest's output is streamed to echo (stdout) while it runs."""
    tests = sorted(tests_dir.glob("test_*.py")) + sorted(tests_dir.glob("*_test.py")) if tests_dir.is_dir() else []
    if not tests:
        return {"ok": True, "skipped": f"{tests_dir.relative_to(project_root)} has no tests yet", "ran": False}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if not cuda:
        env["TRITON_INTERPRET"] = "1"
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests_dir.relative_to(project_root))]
    t0 = time.time()
    rc, output = run_streaming(cmd, project_root, env, timeout, echo)
    if rc is None:
        return {"ok": False, "ran": True, "problems": [f"kernel tests did not finish in {timeout} s"]}
    tail = output.strip().splitlines()[-15:]
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed|error)", line)), tail[-1] if tail else "")
    return {
        "ok": rc == 0,
        "ran": True,
        "exit": rc,
        "interpreter": not cuda,
        "summary": summary.strip("= "),
        "seconds": round(time.time() - t0, 1),
        "problems": [] if rc == 0 else [f"pytest exit {rc}: {summary}"]
        + [line for line in tail if line.startswith(("FAILED ", "ERROR "))],
    }


def write_reports(out_dir: Path, report: dict) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jp, mp = out_dir / "report.json", out_dir / "report.md"
    jp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    mp.write_text(markdown(report))
    return jp, mp


def _mark(ok) -> str:
    return {True: "PASS", False: "FAIL", None: "skipped"}[ok]


def markdown(r: dict) -> str:
    L = [f"# Patched vLLM {r['pin']['version']}: verification report", ""]
    L.append(f"- result: **{_mark(r['ok'])}**")
    L.append(f"- written: {r['written']} by `{r['command']}`")
    L.append(f"- release wheel: `{r['pin']['wheel']}` sha256 `{r['pin']['sha256']}`")
    if r.get("build"):
        b = r["build"]
        L.append(f"- built wheel: `{b['wheel']}` (version `{b['version']}`, sha256 `{b['sha256']}`)")
    if r.get("venv"):
        L.append(f"- environment: `{r['venv']['path']}` (torch {r['venv'].get('torch')}, deps: {r['venv'].get('deps')})")
    L += ["", "## Patches", ""]
    for p in r.get("patches", []):
        L.append(f"- `{p['name']}`: {p['status']}" + "".join(f"\n  - {o}" for o in p.get("offsets", [])))
    if not r.get("patches"):
        L.append("- (series is empty)")
    L += ["", "## Overlay files", ""]
    for f in r.get("overlay", []):
        L.append(f"- `{f['dest']}` from `{f['source']}` sha256 `{f['sha256']}`")
    if not r.get("overlay"):
        L.append("- (none)")
    a = r.get("tree_check")
    L += ["", f"## (a) Wheel content: {_mark(a['ok']) if a else 'not run'}", ""]
    if a:
        L.append(f"- {a['untouched_identical']} of {a['untouched']} untouched files byte-identical to the release wheel (dist-info aside)")
        L.append(f"- {a['compiled_identical']} of {a['compiled_files']} compiled files present and identical")
        L.append(f"- changed: " + (", ".join(f"{st} `{p}`" for p, st in a["changed"].items()) or "nothing"))
        L += [f"- problem: {p}" for p in a["problems"]]
    b = r.get("imports")
    L += ["", f"## (b) Imports and registrations: {_mark(b['ok']) if b else 'not run'}", ""]
    if b:
        L.append(f"- scope: {b.get('scope')}")
        L.append(f"- torch {b.get('torch')}, CUDA available: {b.get('cuda')}, took {b.get('seconds')} s")
        for c in b.get("checks", []):
            L.append(f"- {_mark(c['ok'])}: {c['kind']} `{c['target']}`" + (f" ({c['skipped']})" if c.get("skipped") else "") + (f": {c['error']}" if c.get("error") else ""))
        ok_files = sum(1 for f in b.get("files", []) if f["ok"])
        L.append(f"- installed changed files with the patched content: {ok_files} of {len(b.get('files', []))}")
        L += [f"- problem: {p}" for p in b.get("problems", [])]
    c = r.get("kernels")
    L += ["", f"## (c) Kernel tests: {_mark(c['ok'] if c and c.get('ran') else None) if c else 'not run'}", ""]
    if c:
        if c.get("ran"):
            L.append(f"- {c['summary']} ({'TRITON_INTERPRET=1' if c['interpreter'] else 'GPU'}, {c['seconds']} s)")
            L += [f"- {p}" for p in c.get("problems", [])]
        else:
            L.append(f"- skipped: {c['skipped']}")
    if r.get("timings"):
        L += ["", "## Timings", ""] + [f"- {k[:-2]}: {v} s" for k, v in r["timings"].items()]
    if r.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(L) + "\n"


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) if sys.argv else "?"

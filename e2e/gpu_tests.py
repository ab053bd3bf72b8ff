#!/usr/bin/env python3
"""GPU evidence for the kernels: `pytest tests/kernels` on a GPU, plainly and with DISABLE_MMA_V3=1
(Triton's mma.sync path, what SM120 runs), in one call, into one results file.

  python3 e2e/gpu_tests.py --prepare             # here (CPU): stage vLLM 0.26.0's compiled cache ops
                                                 # and every pin's MLA cache-writer cubin into
                                                 # .peers-carry/ (git-ignored, ~56 MiB)
  python3 e2e/gpu_tests.py                       # GPU host: both modes -> $OUT/gpu_tests_h200.json
  python3 e2e/gpu_tests.py --modes plain         # one mode (when both do not fit one call) ...
  python3 e2e/gpu_tests.py --merge a.json b.json # ... then combine the partial files (here);
                                                 # a.json:plain takes only that mode of a.json

Each mode runs `python -m pytest tests/kernels -v -rfEs --junitxml=...` in fresh processes with
GLM5_REQUIRE_PEERS=1 (--jobs N of them per mode side by side, each taking every N-th test through
e2e/pytest_shard.py; with N > 1 the modes also run side by side: the suite is bound by Triton's
compiles, which use one CPU core each), so the byte comparisons against vLLM's compiled ops
(tests/kernels/test_vllm_cache_ops.py) fail instead of skipping when .peers-carry/ did not come
along. The JSON records, per mode, the passed / failed / error / skipped counts, the failing test
ids and the skip reasons, and for the run the exact command, the commit (git, or --commit where the
checkout has no .git), the sha256 of kernels/ and tests/kernels/ (so a stale result is visible),
torch / triton / CUDA versions and the GPU. It is rewritten after each mode, so a run cut off at
the call's limit still returns the modes that finished; a mode cut off mid-way keeps the results
of the tests that had finished (from pytest's -v lines) and counts as failed.

Exit status: 0 only when every requested mode ran to the end with no failure and no error; 1
otherwise (also for --merge); 2 for usage errors.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / ".peers-carry"
MODES = {"plain": {}, "mma-v2": {"DISABLE_MMA_V3": "1"}}
NAME = "gpu_tests_h200"
COUNT_KEYS = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
# the compiled library holding vLLM's cache ops (torch.ops._C_cache_ops)
PEER_LIBRARY = "vllm/_C_stable_libtorch.abi3.so"


def log(msg: str) -> None:
    print(f"[gpu_tests] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# --prepare (CPU machine): the pinned wheel's compiled cache ops, xz-compressed
# ---------------------------------------------------------------------------------------------


def wheel_cache() -> Path:
    env = os.environ.get("GLM5_OVERLAY_WHEELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "glm5-overlay" / "wheels"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(pin: str, wheel: Path, expected_sha256: str, torch_version: str, out: Path = CARRY,
            preset: int = 6) -> dict:
    """Write out/vllm-<pin>/_C_stable_libtorch.abi3.so.xz and out/manifest.json; returns the manifest."""
    if not wheel.exists():
        raise SystemExit(f"{wheel} is not in the wheel cache: run `python3 tools/apply.py --vllm {pin} fetch`")
    got = sha256_file(wheel)
    if got != expected_sha256:
        raise SystemExit(f"{wheel}: sha256 {got} is not pins.lock's {expected_sha256}")
    name = Path(PEER_LIBRARY).name
    rel = f"vllm-{pin}/{name}.xz"
    dst = out / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    (out / "README.txt").write_text(
        "Staged by `python3 e2e/gpu_tests.py --prepare` from the pinned vLLM release wheel; git-ignored,\n"
        "carried to the GPU host for tests/kernels/test_vllm_cache_ops.py. Not part of the project.\n")
    h = hashlib.sha256()
    size = 0
    t0 = time.time()
    with zipfile.ZipFile(wheel) as z, z.open(PEER_LIBRARY) as f, lzma.open(dst.with_suffix(".part"), "wb",
                                                                        preset=preset) as g:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
            size += len(chunk)
            g.write(chunk)
    dst.with_suffix(".part").replace(dst)
    man_path = out / "manifest.json"
    man = json.loads(man_path.read_text()) if man_path.exists() else {"pins": {}}
    man["pins"][pin] = {"name": name, "path": rel, "sha256": h.hexdigest(), "bytes": size,
                        "xz_bytes": dst.stat().st_size, "torch": torch_version,
                        "wheel": wheel.name, "wheel_sha256": got}
    man_path.write_text(json.dumps(man, indent=1) + "\n")
    log(f"staged {PEER_LIBRARY} of {wheel.name} as {dst.relative_to(REPO) if dst.is_relative_to(REPO) else dst} "
        f"({size / 2**20:.1f} MiB -> {dst.stat().st_size / 2**20:.1f} MiB xz, {time.time() - t0:.0f} s)")
    return man


def cuobjdump() -> Path:
    try:
        import triton
    except ImportError as e:
        raise SystemExit(f"--prepare needs triton (its cuobjdump extracts vLLM's cubins): {e}") from e
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise SystemExit(f"{tool} not found (triton without its NVIDIA tools)")
    return tool


def stage_writer_cubin(pin: str, wheel: Path, expected_sha256: str, out: Path = CARRY) -> dict:
    """The sm_90 cubin holding vLLM `pin`'s MLA cache writers (concat_and_cache_[ds_]mla_kernel),
    for tests/kernels/test_mla_kv_cache.py, which launches them through CuPy: the only way to run
    0.33.0's writer (its library needs torch 2.14) next to the H200 host's torch 2.11."""
    got = sha256_file(wheel)
    if got != expected_sha256:
        raise SystemExit(f"{wheel}: sha256 {got} is not pins.lock's {expected_sha256}")
    dst = out / "vllm_cubins" / f"cache_kernels_sm90_{pin}.cubin"
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        with zipfile.ZipFile(wheel) as z, z.open(PEER_LIBRARY) as f, open(tmp / "C.so", "wb") as g:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                g.write(chunk)
        subprocess.run([str(cuobjdump()), "-xelf", "all", "C.so"], cwd=tmp, check=True, capture_output=True)
        found = [c for c in sorted(tmp.glob("*.sm_90.cubin")) if b"concat_and_cache_ds_mla_kernel" in c.read_bytes()]
        if not found:
            raise SystemExit(f"no sm_90 cubin with concat_and_cache_ds_mla_kernel in {wheel.name}")
        dst.write_bytes(found[0].read_bytes())
    man_path = out / "manifest.json"
    man = json.loads(man_path.read_text()) if man_path.exists() else {"pins": {}}
    man.setdefault("cubins", {})[pin] = {"path": str(dst.relative_to(out)), "sha256": sha256_file(dst),
                                         "wheel": wheel.name, "wheel_sha256": got}
    man_path.write_text(json.dumps(man, indent=1) + "\n")
    log(f"staged the sm_90 MLA cache-writer cubin of {wheel.name} ({dst.stat().st_size / 2**20:.1f} MiB)")
    return man


def carry_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------
# running one mode, reading pytest's results
# ---------------------------------------------------------------------------------------------


def _nodeid(classname: str, name: str, file: str | None) -> str:
    if file:
        return f"{file}::{name}"
    parts = classname.split(".")
    # tests.kernels.test_x[.TestClass] -> tests/kernels/test_x.py[::TestClass]
    for i in range(len(parts), 0, -1):
        if parts[i - 1].startswith("test_"):
            return "/".join(parts[:i]) + ".py" + "".join(f"::{p}" for p in parts[i:]) + f"::{name}"
    return f"{classname}::{name}"


def parse_junit(xml_text: str, detail_limit: int = 4000) -> dict:
    """Counts, failing ids, each failure's text (assertion and traceback, its last
    ``detail_limit`` characters) and skip reasons from pytest's --junitxml output."""
    root = ET.fromstring(xml_text)
    counts = dict.fromkeys(COUNT_KEYS, 0)
    failed, errors, skip_reasons, details = [], [], {}, {}
    for case in root.iter("testcase"):
        nid = _nodeid(case.get("classname", ""), case.get("name", ""), case.get("file"))
        kids = {c.tag: c for c in case}
        bad = kids.get("failure", kids.get("error"))
        if bad is not None:
            details[nid] = ((bad.get("message") or "") + "\n" + (bad.text or "")).strip()[-detail_limit:]
        if "failure" in kids:
            counts["failed"] += 1
            failed.append(nid)
        elif "error" in kids:
            counts["error"] += 1
            errors.append(nid)
        elif "skipped" in kids:
            sk = kids["skipped"]
            if sk.get("type") == "pytest.xfail":
                counts["xfailed"] += 1
            else:
                counts["skipped"] += 1
                reason = (sk.get("message") or "").strip()
                skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failed": failed, "errors": errors, "skip_reasons": skip_reasons,
            "failure_details": details}


_VERBOSE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
           "XFAIL": "xfailed", "XPASS": "xpassed"}


def parse_verbose(text: str) -> dict:
    """The same from pytest -v's per-test lines (what is left when a run is cut off)."""
    counts = dict.fromkeys(COUNT_KEYS, 0)
    failed, errors = [], []
    for line in text.splitlines():
        m = _VERBOSE.match(line.strip())
        if not m:
            continue
        nid, status = m.group(1), _STATUS[m.group(2)]
        counts[status] += 1
        if status == "failed":
            failed.append(nid)
        elif status == "error":
            errors.append(nid)
    # a run cut off before its end has no failure texts (pytest prints them last)
    return {"counts": counts, "failed": failed, "errors": errors, "skip_reasons": {}, "failure_details": {}}


def _cut_off_in(text: str) -> str | None:
    """The test that was running when a shard was stopped (pytest -v's unfinished last line)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines and "::" in lines[-1] and not _VERBOSE.match(lines[-1].strip()):
        return lines[-1].strip().split(" ")[0]
    return None


def run_pytest(cmd: list[str], cwd: Path, env: dict, deadline: float, log_path: Path | None = None,
               shard: int = 0, jobs: int = 1) -> dict:
    """Run one pytest process (``cmd``, without --junitxml) in ``cwd`` until the ``time.monotonic()``
    ``deadline``, then kill its process group. With ``jobs > 1`` it runs shard ``shard`` of ``jobs``
    (e2e/pytest_shard.py, put alone on PYTHONPATH: e2e/ holds a tests/ folder of its own). Returns
    returncode (None when killed), timed_out, seconds, the output text, and the JUnit XML text
    (None when the run was killed or wrote none); the caller parses what it needs."""
    env = dict(env)
    cmd = list(cmd)
    with tempfile.TemporaryDirectory() as td:
        if jobs > 1:
            shutil.copyfile(REPO / "e2e" / "pytest_shard.py", Path(td) / "pytest_shard.py")
            env["PYTHONPATH"] = os.pathsep.join([env.get("PYTHONPATH", ""), td]).strip(os.pathsep)
            env["GLM5_TEST_SHARD"] = f"{shard}/{jobs}"
            cmd += ["-p", "pytest_shard"]
        xml = Path(td) / "junit.xml"
        out_path = log_path or Path(td) / "out.log"
        t0 = time.time()
        with open(out_path, "wb") as fh:
            proc = subprocess.Popen([*cmd, f"--junitxml={xml}"], cwd=cwd, env=env, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = False
            try:
                rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, 9)
                proc.wait()
                rc = None
        text = out_path.read_text(errors="replace")
        junit = xml.read_text() if (not timed_out and xml.exists()) else None
    return {"returncode": rc, "timed_out": timed_out, "seconds": round(time.time() - t0, 1), "text": text,
            "junit": junit}


def _summary_line(text: str, pattern: str = r"\d+ (passed|failed|error|skipped)") -> str:
    return next((ln.strip("= ") for ln in reversed(text.splitlines()) if re.search(pattern, ln)), "")


def _run_shard(mode: str, tests: str, shard: int, jobs: int, deadline: float, log_dir: Path | None,
               extra_env: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", *MODES["mma-v2"])}
    env.update(MODES[mode])
    env["GLM5_REQUIRE_PEERS"] = "1"
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "pytest", *tests.split(), "-v", "-rfEs", "-p", "no:cacheprovider"]
    run = run_pytest(cmd, REPO, env, deadline, (log_dir / f"{mode}.{shard}.log") if log_dir else None, shard, jobs)
    text = run["text"]
    if run["junit"] is not None:
        res = parse_junit(run["junit"])
    else:
        res = parse_verbose(text)
        res["cut_off_in"] = _cut_off_in(text)
    res.update(returncode=run["returncode"], timed_out=run["timed_out"], seconds=run["seconds"],
               summary=_summary_line(text))
    return res


def run_mode(mode: str, tests: str, timeout_s: float, extra_env: dict | None = None, jobs: int = 1,
             log_dir: Path | None = None) -> dict:
    """``pytest tests`` in ``mode``'s environment as ``jobs`` processes side by side (each runs
    every jobs-th test, e2e/pytest_shard.py), combined into one result."""
    shown = " ".join([*(f"{k}={v}" for k, v in MODES[mode].items()), "GLM5_REQUIRE_PEERS=1",
                      "python -m pytest", tests, "-v", "-rfEs", "-p no:cacheprovider"])
    if jobs > 1:
        shown += f"  (as {jobs} shards: GLM5_TEST_SHARD=i/{jobs} -p pytest_shard)"
    log(f"mode {mode}: {shown}")
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        shards = list(ex.map(lambda i: _run_shard(mode, tests, i, jobs, deadline, log_dir, extra_env), range(jobs)))
    res = {"counts": {k: sum(s["counts"][k] for s in shards) for k in COUNT_KEYS},
           "failed": [n for s in shards for n in s["failed"]],
           "errors": [n for s in shards for n in s["errors"]],
           "skip_reasons": {},
           "failure_details": {k: v for s in shards for k, v in s["failure_details"].items()}}
    for s in shards:
        for reason, n in s["skip_reasons"].items():
            res["skip_reasons"][reason] = res["skip_reasons"].get(reason, 0) + n
    timed_out = any(s["timed_out"] for s in shards)
    # a shard left with no test exits 5 ("no tests"): fine when the others ran some
    rcs = [0 if (s["returncode"] == 5 and jobs > 1 and not sum(s["counts"].values())
                 and sum(res["counts"].values())) else s["returncode"] for s in shards]
    res.update({"env": {**MODES[mode], "GLM5_REQUIRE_PEERS": "1"}, "pytest_command": shown, "jobs": jobs,
                "returncode": None if timed_out else max(rcs), "timed_out": timed_out,
                "seconds": max(s["seconds"] for s in shards),
                "summary": " | ".join(s["summary"] for s in shards)})
    cut = [s["cut_off_in"] for s in shards if s.get("cut_off_in")]
    if cut:
        res["cut_off_in"] = cut
    if jobs > 1:
        res["shards"] = [{"counts": s["counts"], "seconds": s["seconds"], "returncode": s["returncode"],
                          "timed_out": s["timed_out"]} for s in shards]
    res["ok"] = mode_ok(res)
    return res


def mode_ok(res: dict) -> bool:
    c = res["counts"]
    return (not res.get("timed_out") and res.get("returncode") == 0 and c["failed"] == 0 and c["error"] == 0
            and sum(c.values()) > 0)


# ---------------------------------------------------------------------------------------------
# the results file
# ---------------------------------------------------------------------------------------------


def tree_digest(*folders: str) -> dict:
    """sha256 over the .py files of each folder (path + content), to tell which code a result is for."""
    out = {}
    for folder in folders:
        h = hashlib.sha256()
        for p in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")
        out[folder] = h.hexdigest()
    return out


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


def environment() -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["capability"] = list(torch.cuda.get_device_capability(0))
        else:
            info["gpu"] = None
    except Exception as e:  # noqa: BLE001  (recorded, the tests will say more)
        info["torch"] = f"not importable: {e!r}"[:200]
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton"] = f"not importable: {e!r}"[:200]
    return info


def peers_summary() -> dict | None:
    man = CARRY / "manifest.json"
    if not man.exists():
        return None
    m = json.loads(man.read_text())
    return {"libraries": {pin: {k: e[k] for k in ("name", "sha256", "wheel", "torch")}
                          for pin, e in m.get("pins", {}).items()},
            "cubins": {pin: {k: e[k] for k in ("path", "sha256", "wheel")} for pin, e in m.get("cubins", {}).items()}}


def summarize(doc: dict) -> dict:
    doc["totals"] = {k: sum(m["counts"][k] for m in doc["modes"].values()) for k in COUNT_KEYS}
    doc["ok"] = bool(doc["modes"]) and all(m["ok"] for m in doc["modes"].values()) and not doc.get("problems")
    return doc


def merge(docs: list[dict], command: str) -> dict:
    """One results file from partial ones (each mode once; same commit and code)."""
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]
    out = {k: first[k] for k in ("name", "commit", "tree_sha256", "environment", "tests") if k in first}
    out["command"] = command
    out["merged_from"] = [{"command": d["command"], "modes": sorted(d["modes"])} for d in docs]
    out["modes"] = {}
    for d in docs:
        for key in ("commit", "tree_sha256"):
            if d.get(key) != first.get(key):
                raise ValueError(f"cannot merge results of different code: {key} {d.get(key)} vs {first.get(key)}")
        for key in ("gpu", "torch", "triton"):
            if d["environment"].get(key) != first["environment"].get(key):
                raise ValueError(f"cannot merge results from different environments: {key} "
                                 f"{d['environment'].get(key)} vs {first['environment'].get(key)}")
        for mode, res in d["modes"].items():
            if mode in out["modes"]:
                raise ValueError(f"mode {mode} appears in more than one file")
            out["modes"][mode] = res
    out["peers"] = first.get("peers")
    return summarize(out)


def load_part(spec: str) -> dict:
    """`file.json` or `file.json:mode[,mode]` (only those modes of it, e.g. the one that finished)."""
    path, only = spec, ""
    if ".json:" in spec:
        path, only = spec.rsplit(":", 1)
    doc = json.loads(Path(path).read_text())
    if only:
        keep = only.split(",")
        missing = [m for m in keep if m not in doc["modes"]]
        if missing:
            raise ValueError(f"{path} has no mode(s) {missing} (it has {sorted(doc['modes'])})")
        doc["modes"] = {m: doc["modes"][m] for m in keep}
    return doc


def write(doc: dict, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def report(doc: dict) -> None:
    for mode, m in doc["modes"].items():
        c = m["counts"]
        log(f"{mode}: {'ok' if m['ok'] else 'FAILED'}  passed {c['passed']}, failed {c['failed']}, "
            f"errors {c['error']}, skipped {c['skipped']}{', TIMED OUT' if m.get('timed_out') else ''} "
            f"({m['seconds']} s)")
        for nid in m["failed"] + m["errors"]:
            log(f"  {mode}: {nid}")
            detail = m.get("failure_details", {}).get(nid)
            if detail:
                tail = [ln for ln in detail.splitlines() if ln.strip()][-4:]
                for ln in tail:
                    log(f"      {ln[:200]}")
        for nid in m.get("cut_off_in", []):
            log(f"  {mode}: stopped while running {nid}")
    for problem in doc.get("problems", []):
        log(f"FAILED: {problem}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="CPU machine: stage vLLM's compiled cache ops in .peers-carry/")
    ap.add_argument("--vllm", default=None, help="--prepare: the pin (default: pins.lock's default)")
    ap.add_argument("--modes", default="plain,mma-v2", help=f"comma-separated, of {sorted(MODES)}")
    ap.add_argument("--tests", default="tests/kernels",
                    help="pytest path(s), space-separated (default tests/kernels)")
    ap.add_argument("--deadline-s", type=float, default=570.0,
                    help="wall-clock budget of the whole call; a mode still running then is stopped and "
                         "counts as failed (default 570)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="pytest processes per mode, side by side (default: the CPU cores less 2, shared by the modes, at most 8 per mode); "
                         "with more than one mode, the modes also run side by side")
    ap.add_argument("--logs", default=None, help="folder for each pytest process's full output (default: none kept)")
    ap.add_argument("--commit", default=None, help="the commit, where the checkout has no .git")
    ap.add_argument("--out", default=None, help="results folder (default $OUT, else bench/results)")
    ap.add_argument("--name", default=NAME, help=f"results file name without .json (default {NAME})")
    ap.add_argument("--allow-no-gpu", action="store_true",
                    help="do not fail when no CUDA GPU is visible (the script's own CPU tests)")
    ap.add_argument("--merge", nargs="+", metavar="JSON[:MODES]",
                    help="combine partial results files into --out/--name; FILE.json:plain,mma-v2 keeps only those modes")
    a = ap.parse_args(argv)
    command = "python3 e2e/gpu_tests.py" + "".join(" " + shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    out_dir = Path(a.out or os.environ.get("OUT") or REPO / "bench" / "results")

    if a.prepare:
        lock = tomllib.loads((REPO / "pins.lock").read_text())
        pin = a.vllm or lock["default"]
        if pin not in lock["pins"]:
            ap.error(f"unknown pin {pin}; pins.lock has {sorted(lock['pins'])}")
        p = lock["pins"][pin]
        prepare(pin, wheel_cache() / p["wheel"], p["sha256"], p["torch"])
        for v, pv in sorted(lock["pins"].items()):
            w = wheel_cache() / pv["wheel"]
            if not w.exists():
                raise SystemExit(f"{w} is not in the wheel cache: run `python3 tools/apply.py --vllm {v} fetch`")
            stage_writer_cubin(v, w, pv["sha256"])
        size = carry_bytes(CARRY)
        log(f".peers-carry/ holds {size / 2**20:.1f} MiB; carry it with the call (64 MiB in all, checkout included)")
        return 0

    if a.merge:
        try:
            doc = merge([load_part(spec) for spec in a.merge], command)
        except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
            log(f"merge failed: {e}")
            return 2
        path = write(doc, out_dir, a.name)
        report(doc)
        log(f"wrote {path}: {'ok' if doc['ok'] else 'FAILURES'}")
        return 0 if doc["ok"] else 1

    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"unknown mode(s) {bad}; choose from {sorted(MODES)}")
    t_end = time.monotonic() + a.deadline_s
    doc = {"name": a.name, "command": command, "commit": a.commit or git_commit(),
           "tree_sha256": tree_digest("kernels", "tests/kernels"), "environment": environment(),
           "tests": a.tests, "peers": peers_summary(), "modes": {}}
    if doc["commit"] is None:
        log("no commit known (no .git here): pass --commit")
    if not doc["environment"].get("gpu") and not a.allow_no_gpu:
        # the GPU tests would all skip: that is not evidence
        doc["problems"] = ["no CUDA GPU visible to torch: the @gpu tests cannot run here"]
        log(doc["problems"][0])
    if a.jobs is not None and a.jobs < 1:
        ap.error("--jobs must be at least 1")
    # the suite is bound by Triton's compiles (one core each): fill the cores, two kept for the rest
    jobs = a.jobs or max(1, min(8, ((os.cpu_count() or 1) - 2) // len(modes)))
    log_dir = Path(a.logs) if a.logs else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    if jobs == 1:
        for mode in modes:
            # one after the other, each may use what is left: one complete mode beats two cut-off ones
            doc["modes"][mode] = run_mode(mode, a.tests, max(t_end - time.monotonic(), 1.0), log_dir=log_dir)
            path = write(summarize(doc), out_dir, a.name)
            log(f"wrote {path}")
    else:
        with ThreadPoolExecutor(max_workers=len(modes)) as ex:
            done = dict(zip(modes, ex.map(lambda m: run_mode(m, a.tests, max(t_end - time.monotonic(), 1.0),
                                                             jobs=jobs, log_dir=log_dir), modes)))
        doc["modes"] = {m: done[m] for m in modes}
        path = write(summarize(doc), out_dir, a.name)
        log(f"wrote {path}")
    report(doc)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

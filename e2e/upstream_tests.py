#!/usr/bin/env python3
"""vLLM's own sparse MLA backend test, `test_sparse_backend_decode_correctness`
(tests/v1/attention/test_sparse_mla_backends.py of vLLM 0.26.0), with TRITON_MLA_SPARSE in its
backend list, run on the GPU host against the staged vLLM; every backend of the list runs, so
FlashMLA's counts sit beside ours.

  python3 e2e/upstream_tests.py --prepare        # here: .upstream-tests/bundle (vLLM's test files
                                                 # from the pinned sdist + patches/0.26.0/tests,
                                                 # `tools/apply.py upstream-tests`) and
                                                 # .upstream-tests/wheels (e2e/upstream-tests-deps.txt)
  python3 e2e/upstream_tests.py --commit <sha>   # GPU host, carrying .upstream-tests, with the patched
                                                 # vLLM 0.26.0 staged in /tmp/site
                                                 # -> $OUT/upstream_sparse_mla_tests_h200.json
  python3 e2e/upstream_tests.py --merge $FILES/upstream_sparse_mla_tests_h200.json
                                                 # here: -> bench/results/ (several partial files
                                                 # of different backends combine into one)

On the host: the carried wheels are installed (pip --no-index --no-deps --target
/tmp/upstream-tests-site, after the staged site on PYTHONPATH) only where the host lacks their
module, so no host package is shadowed; overlay/vllm and kernels/ of this checkout are copied over
the staged tree first (as docs/notes/e2e.md does for kernel work; --no-sync-overlay keeps the
staged files), so the run tests this commit's backend; the test module's import closure is
imported once in a subprocess and every missing module is named; then `python -m pytest
tests/v1/attention/test_sparse_mla_backends.py -k test_sparse_backend_decode_correctness` runs in
the bundle as --jobs processes side by side (e2e/pytest_shard.py), within --deadline-s (a run cut
off keeps the tests that had finished, from pytest's -v lines, and fails).

The JSON holds per backend (the test's ids: FlashMLA, FlashInferTRTLLM, TritonMLASparse) the
passed / failed / error / skipped counts, the failing ids with their texts and the skip reasons,
and for the run the command, pytest's command, the commit, the vLLM version, the bundle's sdist
sha256 and test patches, sha256 digests of overlay/ and kernels/, torch / triton / CUDA and the GPU.
A short table is printed last. Exit status: 0 only when the run finished with no failure and no
error and ran at least one test; 1 otherwise (also --merge of a failing result); 2 usage errors.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from e2e_common import engine_env, preflight_imports, staged_site, sync_overlay  # noqa: E402
from gpu_tests import (COUNT_KEYS, _cut_off_in, _nodeid, _summary_line, environment, git_commit,  # noqa: E402
                       run_pytest, tree_digest)

NAME = "upstream_sparse_mla_tests_h200"
CARRY = REPO / ".upstream-tests"
BUNDLE = CARRY / "bundle"
WHEELS = CARRY / "wheels"
DEPS_FILE = HERE / "upstream-tests-deps.txt"
DEPS_SITE = Path(os.environ.get("UPSTREAM_TESTS_SITE", "/tmp/upstream-tests-site"))
TEST_FILE = "tests/v1/attention/test_sparse_mla_backends.py"
TEST_NAME = "test_sparse_backend_decode_correctness"
# the test's backend_cls ids (ours added by patches/0.26.0/tests)
BACKENDS = ("FlashMLA", "FlashInferTRTLLM", "TritonMLASparse")
OURS = "TritonMLASparse"
# The test builds its VllmConfig from this model's Hugging Face config (ModelConfig reads config.json
# from the hub or its cache); the offline host has neither, so the runner gives it a cache holding
# e2e/data/deepseek-v2-lite-chat-config.json, the fields of that model's config.json (the test then
# replaces what it reads: hf_text_config, head counts, head size, index_topk).
HF_MODEL = "deepseek-ai/DeepSeek-V2-Lite-Chat"
HF_CONFIG = HERE / "data" / "deepseek-v2-lite-chat-config.json"
HF_STAND_IN = Path(os.environ.get("UPSTREAM_TESTS_HF_CACHE", "/tmp/upstream-tests-hf/hub"))
# the import closure the preflight checks (tests.utils: dist_init imports it in the fixture)
PREFLIGHT = ["pytest", "tests.conftest", "tests.utils", "tests.v1.attention.utils",
             "tests.v1.attention.test_mla_backends", "vllm.v1.attention.backends.mla.triton_mla_sparse"]


def log(msg: str) -> None:
    print(msg, flush=True)


def mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20 if path.exists() else 0.0


# ---------------------------------------------------------------------------------------------
# here: the folder to carry
# ---------------------------------------------------------------------------------------------


def read_deps(path: Path = DEPS_FILE) -> list[str]:
    return [ln.split("#")[0].strip() for ln in path.read_text().splitlines() if ln.split("#")[0].strip()]


def prepare(pin: str | None) -> int:
    cmd = [sys.executable, str(REPO / "tools" / "apply.py"), "upstream-tests", "--out", str(BUNDLE)]
    if pin:
        cmd[2:2] = ["--vllm", pin]
    log("$ " + shlex.join(cmd))
    if subprocess.run(cmd, cwd=REPO).returncode != 0:
        log("tools/apply.py upstream-tests failed")
        return 1
    if WHEELS.exists():
        shutil.rmtree(WHEELS)
    WHEELS.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", "-d", str(WHEELS), *read_deps()]
    log("$ " + shlex.join(cmd))
    if subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PIP_NO_INPUT="1")).returncode != 0:
        log("pip download failed")
        return 1
    log(f".upstream-tests/ holds {mib(CARRY):.1f} MiB (bundle {mib(BUNDLE):.1f}, wheels {mib(WHEELS):.1f}); "
        "carry it with the call: carry=[\".upstream-tests\"]")
    return 0


# ---------------------------------------------------------------------------------------------
# there: environment, carried wheels, overlay
# ---------------------------------------------------------------------------------------------


def wheel_modules(whl: Path) -> list[str]:
    """The top-level import names a wheel installs (top_level.txt, else its RECORD's top folders)."""
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        top = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        if top:
            mods = [ln.strip() for ln in z.read(top[0]).decode().splitlines() if ln.strip()]
            if mods:
                return mods
    mods = set()
    for n in names:
        first = n.split("/")[0]
        if first.endswith((".dist-info", ".data")) or first.startswith("_") and first.endswith(".pth"):
            continue
        mods.add(first[:-3] if first.endswith(".py") else first.split(".")[0])
    return sorted(m for m in mods if m.isidentifier())


def missing_modules(mods: list[str], env: dict) -> set[str]:
    code = ("import importlib.util, json, sys\n"
            "out = []\n"
            "for m in sys.argv[1:]:\n"
            "    try:\n"
            "        ok = importlib.util.find_spec(m) is not None\n"
            "    except Exception:\n"
            "        ok = False\n"
            "    if not ok:\n"
            "        out.append(m)\n"
            "print('MISSING' + json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", code, *mods], env=env, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("MISSING")), None)
    return set(json.loads(line[len("MISSING"):])) if line else set(mods)


def install_missing_wheels(env: dict, wheels: Path | None = None, site: Path | None = None) -> dict:
    """Install each carried wheel whose modules the host lacks into `site` (appended to PYTHONPATH)."""
    wheels, site = wheels or WHEELS, site or DEPS_SITE
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    per = {w: wheel_modules(w) for w in found}
    missing = missing_modules(sorted({m for ms in per.values() for m in ms}), env)
    need = [w for w, ms in per.items() if ms and any(m in missing for m in ms)]
    res = {"carried": [w.name for w in found], "installed": [w.name for w in need], "site": str(site)}
    if need:
        site.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
               "--target", str(site), *map(str, need)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            res["error"] = (p.stderr or p.stdout)[-2000:]
    return res


def hf_cache(env: dict) -> Path:
    """The hub cache the tests will read (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    return Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def model_config_source(env: dict, stand_in: Path | None = None) -> dict:
    """Where HF_MODEL's config.json comes from: the host's hub cache when it holds it, else a cache of
    our own with the stand-in (HF_HUB_CACHE is pointed there in `env`)."""
    stand_in = stand_in or HF_STAND_IN
    repo = "models--" + HF_MODEL.replace("/", "--")
    have = sorted((hf_cache(env) / repo / "snapshots").glob("*/config.json"))
    if have:
        return {"source": "host hub cache", "path": str(have[-1])}
    rev = "0" * 40
    snap = stand_in / repo / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HF_CONFIG, snap / "config.json")
    (stand_in / repo / "refs").mkdir(parents=True, exist_ok=True)
    (stand_in / repo / "refs" / "main").write_text(rev)
    env["HF_HUB_CACHE"] = str(stand_in)
    return {"source": f"stand-in {HF_CONFIG.relative_to(REPO)} (the host's hub cache has no {HF_MODEL})",
            "path": str(snap / "config.json"),
            "sha256": hashlib.sha256(HF_CONFIG.read_bytes()).hexdigest()}


def vllm_version(env: dict) -> str | None:
    code = ("import importlib.metadata as md, importlib.util, pathlib, re\n"
            "try:\n"
            "    print('VERSION' + md.version('vllm'))\n"
            "except Exception:\n"
            "    s = importlib.util.find_spec('vllm')\n"
            "    p = pathlib.Path(s.origin).parent / '_version.py' if s and s.origin else None\n"
            "    m = re.search(r\"version = (?:__version__ = )?'([^']+)'\", p.read_text()) if p and p.exists() else None\n"
            "    print('VERSION' + (m.group(1) if m else ''))\n")
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("VERSION")), "VERSION")
    return line[len("VERSION"):] or None


# ---------------------------------------------------------------------------------------------
# running pytest, reading its results per backend
# ---------------------------------------------------------------------------------------------


def backend_of(nodeid: str) -> str:
    m = re.search(r"\[(.*)\]$", nodeid)
    if m:
        for part in m.group(1).split("-"):
            if part in BACKENDS:
                return part
    return "other"


def parse_junit_cases(xml_text: str, detail_limit: int = 3000) -> list[dict]:
    """One record per test case of pytest's --junitxml: id, status, failure text / skip reason."""
    out = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        nid = _nodeid(case.get("classname", ""), case.get("name", ""), case.get("file"))
        kids = {c.tag: c for c in case}
        rec = {"id": nid, "status": "passed"}
        bad = kids.get("failure", kids.get("error"))
        if bad is not None:
            rec["status"] = "failed" if "failure" in kids else "error"
            rec["detail"] = ((bad.get("message") or "") + "\n" + (bad.text or "")).strip()[-detail_limit:]
        elif "skipped" in kids:
            sk = kids["skipped"]
            rec["status"] = "xfailed" if sk.get("type") == "pytest.xfail" else "skipped"
            rec["reason"] = (sk.get("message") or "").strip()
        out.append(rec)
    return out


_VERBOSE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
           "XFAIL": "xfailed", "XPASS": "xpassed"}


def parse_verbose_cases(text: str) -> list[dict]:
    """The same from pytest -v's lines (what is left of a run that was cut off; no texts)."""
    out = []
    for line in text.splitlines():
        m = _VERBOSE.match(line.strip())
        if m:
            out.append({"id": m.group(1), "status": _STATUS[m.group(2)]})
    return out


def by_backend(cases: list[dict]) -> dict:
    res: dict = {}
    for c in cases:
        b = res.setdefault(backend_of(c["id"]), {"counts": dict.fromkeys(COUNT_KEYS, 0), "failed": [], "errors": [],
                                                 "failure_details": {}, "skip_reasons": {}})
        b["counts"][c["status"]] += 1
        if c["status"] in ("failed", "error"):
            b["failed" if c["status"] == "failed" else "errors"].append(c["id"])
            if c.get("detail"):
                b["failure_details"][c["id"]] = c["detail"]
        elif c["status"] == "skipped":
            r = c.get("reason", "")
            b["skip_reasons"][r] = b["skip_reasons"].get(r, 0) + 1
    return {k: res[k] for k in [*BACKENDS, "other"] if k in res}


def pytest_command(selection: str) -> list[str]:
    return [sys.executable, "-m", "pytest", TEST_FILE, "-k", selection, "-v", "-rfEs", "-p", "no:cacheprovider"]


def run_shard(bundle: Path, selection: str, shard: int, jobs: int, env: dict, deadline: float,
              log_dir: Path | None) -> dict:
    run = run_pytest(pytest_command(selection), bundle, env, deadline,
                     (log_dir / f"pytest.{shard}.log") if log_dir else None, shard, jobs)
    text, rc, timed_out = run["text"], run["returncode"], run["timed_out"]
    cases = parse_junit_cases(run["junit"]) if run["junit"] is not None else parse_verbose_cases(text)
    res = {"cases": cases, "returncode": rc, "timed_out": timed_out, "seconds": run["seconds"],
           "summary": _summary_line(text, r"\d+ (passed|failed|error|skipped|deselected)"),
           "tail": text[-3000:] if (rc not in (0, 1) or timed_out) else ""}
    if timed_out:
        res["cut_off_in"] = _cut_off_in(text)
    return res


def summarize(doc: dict) -> dict:
    doc["totals"] = {k: sum(b["counts"][k] for b in doc["backends"].values()) for k in COUNT_KEYS}
    ran = doc["totals"]["passed"] + doc["totals"]["failed"] + doc["totals"]["error"]
    doc["ok"] = (not doc.get("problems") and not doc.get("timed_out") and ran > 0
                 and doc["totals"]["failed"] == 0 and doc["totals"]["error"] == 0)
    return doc


def write(doc: dict, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def table(doc: dict) -> str:
    rows = [("backend", "passed", "failed", "error", "skipped")]
    for b, r in doc["backends"].items():
        c = r["counts"]
        rows.append((b + (" (ours)" if b == OURS else ""), c["passed"], c["failed"], c["error"], c["skipped"]))
    t = doc["totals"]
    rows.append(("total", t["passed"], t["failed"], t["error"], t["skipped"]))
    w = [max(len(str(r[i])) for r in rows) for i in range(5)]
    return "\n".join("  ".join(str(x).ljust(w[i]) if i == 0 else str(x).rjust(w[i]) for i, x in enumerate(r))
                     for r in rows)


def report(doc: dict) -> None:
    for b, r in doc["backends"].items():
        for nid in r["failed"] + r["errors"]:
            log(f"FAILED {nid}")
            tail = [ln for ln in r["failure_details"].get(nid, "").splitlines() if ln.strip()][-3:]
            for ln in tail:
                log(f"    {ln[:200]}")
    for p in doc.get("problems", []):
        log(f"PROBLEM: {p}")
    log(f"{TEST_NAME} ({doc.get('vllm') or 'vLLM ?'}, {doc['environment'].get('gpu')}, commit {doc.get('commit')}): "
        f"{'ok' if doc['ok'] else 'FAILED'}{', TIMED OUT' if doc.get('timed_out') else ''}")
    log(table(doc))


def merge(docs: list[dict], command: str) -> dict:
    """One results file from runs of different backends (same commit, bundle, GPU, vLLM). A backend
    from a run stopped at its deadline (possibly unfinished) is replaced by the same backend from a
    run that finished; a backend in two finished runs, or only in stopped ones twice, is refused.
    Backends kept from a stopped run are marked ``"complete": false`` and keep the merge's
    ``timed_out`` (so ``ok``) false."""
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]
    out = {k: v for k, v in first.items() if k not in ("backends", "totals", "ok", "command", "runs", "timed_out",
                                                        "problems")}
    out["command"] = command
    out["merged_from"] = [{"command": d["command"], "backends": sorted(d["backends"]),
                           "timed_out": bool(d.get("timed_out"))} for d in docs]
    out["backends"], out["problems"] = {}, []
    for d in docs:
        for key in ("commit", "vllm", "bundle", "tree_sha256"):
            if d.get(key) != first.get(key):
                raise ValueError(f"cannot merge results of different code: {key} {d.get(key)} vs {first.get(key)}")
        for key in ("gpu", "torch", "triton"):
            if d["environment"].get(key) != first["environment"].get(key):
                raise ValueError(f"cannot merge results from different environments: {key}")
        stopped = bool(d.get("timed_out"))
        for b, r in d["backends"].items():
            have = out["backends"].get(b)
            if have is not None and (have["complete"] or stopped):
                raise ValueError(f"backend {b} appears in more than one file (only a run stopped at its deadline "
                                 f"may be replaced, by one that finished)")
            out["backends"][b] = dict(r, complete=not stopped)
        out["problems"] += [p for p in d.get("problems", []) if not (stopped and p.startswith("stopped at"))]
    partial = [b for b, r in out["backends"].items() if not r["complete"]]
    out["timed_out"] = bool(partial)
    if partial:
        out["problems"].append(f"stopped at a deadline, not re-run: {', '.join(partial)} (counts are of the tests "
                               "that finished)")
    out["backends"] = {k: out["backends"][k] for k in [*BACKENDS, "other"] if k in out["backends"]}
    return summarize(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="here: write .upstream-tests/ (bundle + wheels) to carry")
    ap.add_argument("--vllm", default=None, help="--prepare: the pin (default: pins.lock's default, 0.26.0)")
    ap.add_argument("--bundle", default=str(BUNDLE), help="the test bundle (default .upstream-tests/bundle)")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help=f"the test's backend ids to run (default all: {','.join(BACKENDS)})")
    ap.add_argument("--site", default=str(staged_site()), help="the staged vLLM (default $E2E_SITE, else /tmp/site)")
    ap.add_argument("--no-sync-overlay", action="store_true",
                    help="do not copy this checkout's overlay/vllm and kernels/ over the staged tree")
    ap.add_argument("--jobs", type=int, default=None, help="pytest processes side by side (default: 1 per 4 CPU cores, at most 4)")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="budget of the pytest run (default 560)")
    ap.add_argument("--logs", default=None, help="folder for each pytest process's output (default: none kept)")
    ap.add_argument("--commit", default=None, help="the commit, where the checkout has no .git")
    ap.add_argument("--out", default=None, help="results folder (default $OUT, else bench/results)")
    ap.add_argument("--name", default=NAME, help=f"results file name without .json (default {NAME})")
    ap.add_argument("--allow-no-gpu", action="store_true", help="do not fail when no CUDA GPU is visible")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine results files into --out/--name (here)")
    a = ap.parse_args(argv)
    command = "python3 e2e/upstream_tests.py" + "".join(" " + shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    out_dir = Path(a.out or os.environ.get("OUT") or REPO / "bench" / "results")

    if a.prepare:
        return prepare(a.vllm)
    if a.merge:
        try:
            doc = merge([json.loads(Path(p).read_text()) for p in a.merge], command)
        except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
            log(f"merge failed: {e}")
            return 2
        path = write(doc, Path(a.out or REPO / "bench" / "results"), a.name)
        report(doc)
        log(f"wrote {path}")
        return 0 if doc["ok"] else 1

    backends = [b for b in a.backends.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        ap.error(f"unknown backend id(s) {bad}; the test's are {list(BACKENDS)}")
    if a.jobs is not None and a.jobs < 1:
        ap.error("--jobs must be at least 1")
    bundle = Path(a.bundle).resolve()
    manifest = bundle / "upstream-tests.json"
    if not manifest.is_file():
        log(f"{manifest} missing: run `python3 e2e/upstream_tests.py --prepare` here and carry .upstream-tests")
        return 2
    t_start = time.monotonic()
    selection = TEST_NAME + (" and (" + " or ".join(backends) + ")" if set(backends) != set(BACKENDS) else "")
    env = engine_env({"E2E_SITE": a.site})
    site = Path(a.site)
    if site.is_dir() and str(site) not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(x for x in [str(site), env.get("PYTHONPATH", "")] if x)
    doc = {"name": a.name, "command": command, "commit": a.commit or git_commit(),
           "bundle": json.loads(manifest.read_text()), "tree_sha256": tree_digest("overlay", "kernels"),
           "environment": environment(), "test": f"{TEST_FILE}::{TEST_NAME}", "selection": selection,
           "backends": {}, "problems": []}
    if doc["commit"] is None:
        log("no commit known (no .git here): pass --commit")
    if not doc["environment"].get("gpu") and not a.allow_no_gpu:
        doc["problems"].append("no CUDA GPU visible to torch: the test module skips itself without CUDA")
    doc["overlay_sync"] = {"skipped": True} if a.no_sync_overlay else sync_overlay(site)
    if "error" in doc["overlay_sync"]:
        doc["problems"].append(f"overlay sync: {doc['overlay_sync']['error']}")
    doc["wheels"] = install_missing_wheels(env)
    if doc["wheels"]["installed"]:
        env["PYTHONPATH"] = os.pathsep.join([env.get("PYTHONPATH", ""), doc["wheels"]["site"]]).strip(os.pathsep)
    if "error" in doc["wheels"]:
        doc["problems"].append(f"installing carried wheels failed: {doc['wheels']['error']}")
    log(f"carried wheels installed (host lacked their modules): {doc['wheels']['installed'] or 'none'}")
    doc["model_config"] = model_config_source(env)
    log(f"{HF_MODEL} config.json: {doc['model_config']['source']}")
    doc["vllm"] = vllm_version(env)
    pf_env = dict(env, PYTHONPATH=os.pathsep.join([str(bundle), env.get("PYTHONPATH", "")]).strip(os.pathsep))
    t0 = time.monotonic()
    doc["preflight"] = preflight_imports(PREFLIGHT, pf_env)
    log(f"preflight imports ({time.monotonic() - t0:.0f} s): "
        + (json.dumps(doc["preflight"].get("missing") or "all ok") if "error" not in doc["preflight"] else doc["preflight"]["error"]))
    if doc["preflight"].get("missing") or "error" in doc["preflight"]:
        doc["problems"].append("preflight: " + json.dumps(doc["preflight"].get("missing") or doc["preflight"].get("error")))
    jobs = a.jobs or max(1, min(4, (os.cpu_count() or 1) // 4))
    shown = "python -m pytest " + shlex.join(pytest_command(selection)[3:])
    doc["pytest_command"] = f"cd <bundle> && PYTHONPATH={env.get('PYTHONPATH', '')} {shown}" + (
        f"  (as {jobs} shards: GLM5_TEST_SHARD=i/{jobs} -p pytest_shard)" if jobs > 1 else "")
    log(f"running: {doc['pytest_command']}")
    log_dir = Path(a.logs) if a.logs else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    deadline = t_start + a.deadline_s
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        shards = list(ex.map(lambda i: run_shard(bundle, selection, i, jobs, env, deadline, log_dir), range(jobs)))
    cases = [c for s in shards for c in s["cases"]]
    doc["backends"] = by_backend(cases)
    doc["timed_out"] = any(s["timed_out"] for s in shards)
    doc["seconds"] = round(time.monotonic() - t_start, 1)
    doc["shards"] = [{k: s.get(k) for k in ("returncode", "timed_out", "seconds", "summary", "cut_off_in", "tail")
                      if s.get(k) not in (None, "")} | {"tests": len(s["cases"])} for s in shards]
    for i, s in enumerate(shards):
        # pytest: 0 all passed, 1 some failed (counted per test), 5 nothing collected in this shard
        if s["returncode"] not in (0, 1, 5) and not s["timed_out"]:
            doc["problems"].append(f"pytest shard {i} exited {s['returncode']}: {s['tail'][-800:]}")
    if doc["timed_out"]:
        doc["problems"].append(f"stopped at --deadline-s {a.deadline_s:.0f}: the tests that had not finished are not counted")
    summarize(doc)
    path = write(doc, out_dir, a.name)
    log(f"wrote {path}")
    report(doc)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

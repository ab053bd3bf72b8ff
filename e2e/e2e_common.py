"""Harness shared by the end-to-end scripts (e2e/e2e_correctness.py, e2e_throughput.py,
e2e_serve_check.py): phase logging with timings, results written as they come, engine jobs in
their own subprocesses (one GPU engine at a time; the next job's `import vllm` overlapped with the
current one unless the caller turns that off, as the timed throughput runs do), the environment the staged vLLM needs, and small statistics helpers.

Standard library only at import time (numpy/torch/vllm are imported where used), so the drivers
start fast and the CPU tests can import it anywhere.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent

# What the staged vLLM on the offline GPU host needs (the staging helper prints the same;
# docs/BACKGROUND.md, "The GPU host of the measurements").
STAGED_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def out_dir() -> pathlib.Path:
    """$OUT (the device tool's folder that comes back), else ./e2e_out."""
    p = pathlib.Path(os.environ.get("OUT") or "e2e_out")
    p.mkdir(parents=True, exist_ok=True)
    return p


def work_dir(default: str = "/tmp/e2e_work") -> pathlib.Path:
    """Big intermediate files (model, reference log-probs, traces): never under $OUT."""
    p = pathlib.Path(os.environ.get("E2E_WORK") or default)
    p.mkdir(parents=True, exist_ok=True)
    return p


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ plus STAGED_ENV (not overriding what the caller set) and /tmp/site on PYTHONPATH
    when the staged install is there and PYTHONPATH does not name it yet."""
    env = dict(os.environ)
    for k, v in STAGED_ENV.items():
        env.setdefault(k, v)
    site = str(staged_site())
    pp = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if pathlib.Path(site, "vllm").is_dir() and site not in pp:
        pp.insert(0, site)
    if pp:
        env["PYTHONPATH"] = os.pathsep.join(pp)
    env.update(extra or {})
    return env


def staged_site() -> pathlib.Path:
    """Where the staged vLLM lives on the GPU host (E2E_SITE, default /tmp/site)."""
    return pathlib.Path(os.environ.get("E2E_SITE", "/tmp/site"))


def sync_overlay(site: pathlib.Path) -> dict[str, Any]:
    """Copy this checkout's overlay/vllm/** and kernels/*.py over the staged vLLM tree (where
    tools/apply.py places them), so a run measures the checkout's code, not what was packed."""
    import shutil

    dest = pathlib.Path(site) / "vllm"
    if not dest.is_dir():
        return {"error": f"{dest} does not exist (no staged vLLM)"}
    copied = []
    for src in sorted((REPO / "overlay" / "vllm").rglob("*.py")):
        t = dest / src.relative_to(REPO / "overlay" / "vllm")
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, t)
        copied.append(str(t.relative_to(site)))
    for src in sorted((REPO / "kernels").glob("*.py")):
        t = dest / "v1" / "attention" / "ops" / src.name
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, t)
        copied.append(str(t.relative_to(site)))
    return {"site": str(site), "files": len(copied)}


def atomic_write_json(path: pathlib.Path, obj: Any) -> None:
    path = pathlib.Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default))
    os.replace(tmp, path)


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, pathlib.Path):
        return str(o)
    return repr(o)


class Run:
    """A script run: a clock, a log with elapsed times, phases, and a results dict that is written
    to `path` after every phase (so a run killed at its time limit still leaves what it had)."""

    def __init__(self, path: pathlib.Path | None, results: dict[str, Any] | None = None,
                 tag: str = "e2e", stream=None):
        self.t0 = time.time()
        self.path = pathlib.Path(path) if path else None
        self.tag = tag
        self.stream = stream or sys.stdout
        self.results: dict[str, Any] = results if results is not None else {}
        self.results.setdefault("phases", [])
        self.results.setdefault("errors", [])

    def elapsed(self) -> float:
        return time.time() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.tag} {self.elapsed():7.1f}s] {msg}", file=self.stream, flush=True)

    def save(self) -> None:
        if self.path is not None:
            self.results["elapsed_s"] = round(self.elapsed(), 1)
            atomic_write_json(self.path, self.results)

    @contextlib.contextmanager
    def phase(self, name: str, fatal: bool = False):
        """Time a phase; on an exception record it (phase name, type, message, traceback tail) and
        go on unless `fatal`."""
        t = time.time()
        self.log(f"phase {name}: start")
        rec = {"phase": name, "status": "running"}
        self.results["phases"].append(rec)
        try:
            yield rec
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - we record and go on by design
            rec["status"] = "error"
            err = {"phase": name, "type": type(e).__name__, "message": str(e)[:2000],
                   "traceback": traceback.format_exc()[-6000:]}
            self.results["errors"].append(err)
            self.log(f"phase {name}: ERROR {type(e).__name__}: {str(e)[:500]}")
            if fatal:
                rec["seconds"] = round(time.time() - t, 2)
                self.save()
                raise
        finally:
            rec["seconds"] = round(time.time() - t, 2)
            if rec["status"] != "running":
                self.log(f"phase {name}: {rec['status']} in {rec['seconds']} s")
            self.save()


# ----------------------------------------------------------------------------------------------
# Engine jobs in subprocesses
# ----------------------------------------------------------------------------------------------


class Job:
    """One worker subprocess: `argv` runs a worker that (1) does its heavy imports, (2) touches
    `<dir>/ready`, (3) waits for `<dir>/go`, (4) does its GPU work and writes `<dir>/result.json`."""

    def __init__(self, name: str, argv: list[str], jobdir: pathlib.Path, timeout_s: float,
                 env: dict[str, str] | None = None, expect_s: float | None = None):
        self.name = name
        self.argv = argv
        self.dir = pathlib.Path(jobdir)
        self.timeout_s = timeout_s
        self.expect_s = expect_s if expect_s is not None else timeout_s
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "log.txt"
        self.t_start = self.t_go = self.t_end = None
        self.status = "pending"
        self.returncode = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for f in ("ready", "go", "result.json"):
            (self.dir / f).unlink(missing_ok=True)
        self.t_start = time.time()
        logf = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(REPO), start_new_session=True)
        logf.close()
        self.status = "started"

    def go(self) -> None:
        self.t_go = time.time()
        (self.dir / "go").write_text("go")
        self.status = "running"

    def abort(self, reason: str) -> None:
        (self.dir / "go").write_text("abort:" + reason)
        self.status = "aborted"

    def kill_group(self) -> None:
        """Kill the worker's process group (the worker and what it started, e.g. vLLM's engine core)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.returncode = rc
                self.status = "exited" if rc == 0 else f"exited rc={rc}"
                break
            if time.time() > deadline:
                self.kill_group()
                self.proc.wait()
                self.returncode = self.proc.returncode
                self.status = "timeout"
                break
            time.sleep(0.5)
        self.t_end = time.time()
        # stragglers of the group (an engine core left behind by a crashed worker) hold GPU memory
        self.kill_group()

    def result(self) -> dict[str, Any]:
        p = self.dir / "result.json"
        res: dict[str, Any] = {}
        if p.exists():
            try:
                res = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                res = {"errors": [{"phase": "result", "type": "JSONDecodeError", "message": str(e)}]}
        res.setdefault("errors", [])
        res["job"] = {
            "name": self.name, "status": self.status, "returncode": self.returncode,
            "import_s": _rnd(self._ready_time()),
            "run_s": _rnd(self.t_end - self.t_go) if (self.t_end and self.t_go) else None,
            "wall_s": _rnd(self.t_end - self.t_start) if (self.t_end and self.t_start) else None,
        }
        if self.status not in ("exited",):
            res["errors"].append({"phase": "job", "type": self.status,
                                  "message": f"worker {self.status}; log tail:\n" + tail(self.log_path, 3000)})
        return res

    def _ready_time(self):
        r = self.dir / "ready"
        if r.exists() and self.t_start:
            return r.stat().st_mtime - self.t_start
        return None


def _rnd(x):
    return None if x is None else round(x, 1)


def run_jobs(jobs: list[Job], run: Run, deadline: float,
             on_done: Callable[[Job, dict[str, Any]], None], prefetch: bool = True) -> None:
    """Run jobs one at a time on the GPU, in order. With `prefetch`, job i+1 is started (imports
    only) while job i runs (a job may also have been started by the caller already); without it
    (timed work: nothing may run beside the measured engine) job i+1's process starts only after
    job i's process group is gone. A job whose expected duration does not fit before `deadline` is
    skipped; a running job is killed at min(its timeout, deadline)."""
    for i, job in enumerate(jobs):
        now = time.time()
        if now + min(job.expect_s, job.timeout_s) > deadline:
            run.log(f"job {job.name}: SKIPPED, expected {job.expect_s:.0f} s, {deadline - now:.0f} s left")
            if job.proc is not None:
                job.abort("time budget")
                job.wait(time.time() + 30)
            job.status = "skipped"
            res = {"errors": [{"phase": "job", "type": "skipped",
                               "message": f"not started: expected {job.expect_s:.0f} s, "
                                          f"{deadline - now:.0f} s of the time budget left"}],
                   "job": {"name": job.name, "status": "skipped"}}
            on_done(job, res)
            continue
        if job.proc is None:
            job.start()
        nxt = jobs[i + 1] if i + 1 < len(jobs) else None
        if prefetch and nxt is not None and nxt.proc is None:
            nxt.start()  # its imports overlap this job's GPU work
        job.go()
        run.log(f"job {job.name}: go (timeout {min(job.timeout_s, deadline - time.time()):.0f} s)")
        job.wait(min(time.time() + job.timeout_s, deadline))
        res = job.result()
        run.log(f"job {job.name}: {job.status} after {res['job'].get('run_s')} s "
                f"(imports took {res['job'].get('import_s')} s), {len(res['errors'])} error(s)")
        on_done(job, res)


def worker_wait_for_go(jobdir: pathlib.Path, poll_s: float = 0.2) -> None:
    """Called by a worker after its imports: signal readiness, wait for the driver's go."""
    jobdir = pathlib.Path(jobdir)
    (jobdir / "ready").write_text("ready")
    go = jobdir / "go"
    while not go.exists():
        time.sleep(poll_s)
    msg = go.read_text()
    if msg.startswith("abort"):
        print(f"[worker] aborted by the driver: {msg}", flush=True)
        sys.exit(3)


def preflight_imports(modules: list[str], env: dict[str, str] | None = None, timeout_s: float = 240.0) -> dict[str, Any]:
    """Import each module in a fresh interpreter with `env`; name every one that fails at once."""
    code = (
        "import importlib, json\n"
        "out = {}\n"
        f"for m in {list(modules)!r}:\n"
        "    try:\n"
        "        importlib.import_module(m); out[m] = 'ok'\n"
        "    except Exception as e:\n"
        "        out[m] = f'{type(e).__name__}: {e}'\n"
        "print('PREFLIGHT' + json.dumps(out))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PREFLIGHT")), None)
    if line is None:
        return {"error": f"preflight produced no result (rc {p.returncode}): {p.stderr[-2000:]}"}
    res = json.loads(line[len("PREFLIGHT"):])
    return {"modules": res, "missing": {m: e for m, e in res.items() if e != "ok"}}


def gpu_used_mib() -> list[int] | None:
    """Memory in use per GPU from nvidia-smi (None without it). Never initialises CUDA here: a CUDA
    context in vLLM's frontend process would make vLLM spawn its engine core instead of forking."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        return [int(x) for x in out.stdout.split()]
    except ValueError:
        return None


# GPU state sampled during each timed pass (GpuSampler): a pass that ran at lower clocks, hotter or
# power-capped than its neighbours explains its time without the code. The reasons field was renamed
# in newer drivers (clocks_throttle_reasons -> clocks_event_reasons); the first one the driver knows
# is used, none when neither is.
TELEMETRY_FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _reason_field() -> str | None:
    for f in REASON_FIELDS:
        try:
            r = subprocess.run(["nvidia-smi", f"--query-gpu={f}", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode == 0 and r.stdout.strip():
            return f
    return None


def summarize_telemetry(lines: list[str], with_reasons: bool) -> dict[str, Any] | None:
    """nvidia-smi CSV lines (sm MHz, mem MHz, W, C[, reasons bitmask]) -> min / median / max of each
    and the distinct reason masks seen; lines that do not parse ("[N/A]", a header) are skipped."""
    cols: dict[str, list[float]] = {k: [] for k in ("sm_mhz", "mem_mhz", "power_w", "temp_c")}
    reasons: set[str] = set()
    n = 0
    for ln in lines:
        parts = [x.strip() for x in ln.split(",")]
        if len(parts) < 4 + int(with_reasons):
            continue
        try:
            vals = [float(x) for x in parts[:4]]
        except ValueError:
            continue
        n += 1
        for k, v in zip(cols, vals):
            cols[k].append(v)
        if with_reasons:
            reasons.add(parts[4])
    if not n:
        return None
    out: dict[str, Any] = {"n": n}
    for k, v in cols.items():
        v = sorted(v)
        out[k] = {"min": v[0], "median": v[len(v) // 2], "max": v[-1]}
    if with_reasons:
        out["reasons"] = sorted(reasons)
    return out


class GpuSampler:
    """``with GpuSampler() as g: <timed pass>`` then ``g.summary``: nvidia-smi samples GPU ``gpu``'s
    SM and memory clocks, power, temperature and active clock-event reasons every ``period_ms``
    in its own process while the pass runs (never CUDA in this process); None without nvidia-smi.
    Also the host's 1-minute load average at the end (other work on the host)."""

    _reason: str | None | bool = False  # probed once per process

    def __init__(self, gpu: int = 0, period_ms: int = 200):
        self.gpu, self.period_ms = gpu, period_ms
        self.proc: subprocess.Popen | None = None
        self.summary: dict[str, Any] | None = None

    def __enter__(self) -> "GpuSampler":
        if GpuSampler._reason is False:
            GpuSampler._reason = _reason_field()
        fields = ",".join(TELEMETRY_FIELDS + ((GpuSampler._reason,) if GpuSampler._reason else ()))
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "-i", str(self.gpu), f"--query-gpu={fields}",
                                          "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        lines: list[str] = []
        if self.proc is not None:
            self.proc.terminate()
            try:
                out, _ = self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
            lines = (out or "").splitlines()
        self.summary = summarize_telemetry(lines, bool(GpuSampler._reason))
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = None
        if self.summary is not None:
            self.summary["loadavg_1m"] = load
        else:
            self.summary = {"n": 0, "loadavg_1m": load}


def wait_gpu_idle(max_used_mib: int = 4096, timeout_s: float = 60.0, log=print) -> dict[str, Any]:
    """Wait until the previous engine's memory is released (vLLM checks at start that
    gpu_memory_utilization x total is free)."""
    t0 = time.time()
    used = gpu_used_mib()
    while used is not None and max(used) > max_used_mib and time.time() - t0 < timeout_s:
        time.sleep(1.0)
        used = gpu_used_mib()
    waited = round(time.time() - t0, 1)
    if used is not None and max(used) > max_used_mib:
        log(f"GPU still has {used} MiB in use after {waited} s; going on")
    return {"used_mib": used, "waited_s": waited}


def tail(path: pathlib.Path, n_chars: int) -> str:
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError:
        return ""
    return data[-n_chars:].decode("utf-8", "replace")


KEY_LOG_PATTERNS = (
    "attention backend", "Using ", "cudagraph", "CUDAGraph", "CUDA graph", "KV cache", "kv_cache",
    "Error", "ERROR", "Traceback", "raise ", "Exception", "WARNING", "warn", "Killed", "preempt",
    "FlashMLA", "DeepGEMM", "deep_gemm", "triton", "Triton", "Maximum concurrency", "memory",
)


def collect_logs(jobs: list[Job], dest: pathlib.Path, head_chars: int = 20000,
                 tail_chars: int = 60000, key_lines: int = 200) -> None:
    """One text file with, per job: its key log lines (backend choice, graphs, errors...), the head
    and the tail of its log. Keeps the files that come back from the device few and small."""
    with open(dest, "w") as f:
        for job in jobs:
            f.write(f"\n{'=' * 100}\n== job {job.name}: {job.status}\n{'=' * 100}\n")
            try:
                text = job.log_path.read_text(errors="replace")
            except OSError:
                f.write("(no log)\n")
                continue
            keys = [ln for ln in text.splitlines() if any(p in ln for p in KEY_LOG_PATTERNS)]
            f.write(f"-- key lines ({len(keys)}, last {key_lines}):\n")
            f.write("\n".join(ln[:400] for ln in keys[-key_lines:]) + "\n")
            if len(text) <= head_chars + tail_chars:
                f.write("-- full log:\n" + text + "\n")
            else:
                f.write("-- head:\n" + text[:head_chars] + "\n-- ... --\n-- tail:\n" + text[-tail_chars:] + "\n")


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


def bootstrap_mean_se(values, n_boot: int = 400, seed: int = 0, groups=None) -> float:
    """Standard error of the mean of `values` by bootstrap. With `groups` (one label per value) whole
    groups (prompts) are resampled, which respects the correlation of positions within a prompt."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    if groups is None:
        idx = rng.integers(0, v.size, size=(n_boot, v.size))
        means = v[idx].mean(axis=1)
    else:
        g = np.asarray(groups)
        labels = np.unique(g)
        members = [np.nonzero(g == lab)[0] for lab in labels]
        means = np.empty(n_boot)
        for b in range(n_boot):
            pick = rng.integers(0, len(labels), size=len(labels))
            sel = np.concatenate([members[k] for k in pick])
            means[b] = v[sel].mean()
    return float(means.std(ddof=1))


def fmt_table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in cells]
    lines.insert(1, "-+-".join("-" * x for x in w))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if c != c:
            return "nan"
        if c == 0:
            return "0"
        a = abs(c)
        return f"{c:.3e}" if (a < 1e-2 or a >= 1e5) else f"{c:.4g}"
    return "-" if c is None else str(c)


def random_prompts(n_plain_vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Token-id prompts, uniform over the ordinary vocabulary (ids below the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(n_plain_vocab) for _ in range(L)] for L in lengths]


def safe_float(x) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def log_facts(log_path: pathlib.Path) -> dict[str, Any]:
    """What a vLLM engine said about itself in its log: the attention backend(s) it chose (both
    the auto-selection and the explicit-backend message), KV cache size and concurrency, and the
    CUDA-graph lines."""
    import re

    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    facts: dict[str, Any] = {}
    m = re.findall(r"Using (\w+) attention backend", text)
    m += re.findall(r"Using AttentionBackendEnum\.(\w+) backend", text)
    if m:
        facts["attention_backends_logged"] = sorted(set(m))
    # with MTP, what is selected after "Loading drafter model" is the draft layer's (vLLM never
    # inherits the target's backend for the drafter unless the speculative config names one; an
    # identical selection is cached and not logged again)
    cut = text.find("Loading drafter model")
    if cut >= 0:
        pat = r"Using (?:AttentionBackendEnum\.)?(\w+?)(?: attention)? backend"
        facts["target_attention_backends_logged"] = sorted(set(re.findall(pat, text[:cut])) - {"standard"})
        facts["draft_attention_backends_logged"] = (sorted(set(re.findall(pat, text[cut:])) - {"standard"})
                                                    or "none logged: the target's selection, cached")
    m = re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)
    if m:
        facts["kv_cache_tokens_logged"] = int(m[-1].replace(",", ""))
    m = re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text)
    if m:
        facts["max_concurrency"] = m[-1][1]
    cg = [ln.strip()[:300] for ln in text.splitlines()
          if ("cudagraph" in ln.lower() or "cuda graph" in ln.lower())
          and any(w in ln for w in ("not support", "Overrid", "downgrad", "fall", "captur", "Captur", "disabl"))]
    if cg:
        facts["cudagraph_lines"] = cg[-8:]
    return facts

# SPDX-License-Identifier: Apache-2.0
"""Shared parts of the benchmark scripts (bench/*.py): timing (CUDA graphs, CUDA events, eager
host time), the device's copy bandwidth, a time budget, the command line recorded in results, and
the peers: FlashMLA and vLLM's compiled ops taken from the pinned release wheel, staged into the
git-ignored ``.peers/`` folder (small enough to travel with the checkout to a GPU machine) and
loaded from there.

The pure-Python parts (peer staging, the budget, the statistics) import no torch at module level,
so they run and are tested on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import shutil
import statistics
import sys
import time
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
WHEEL_DIR = Path(os.environ.get("GLM5_WHEEL_DIR", str(Path.home() / ".cache" / "glm5-overlay" / "wheels")))

# What the benchmarks take from a release wheel, by purpose: {name in .peers/<pin>/: member of the wheel}.
FLASHMLA_MEMBERS = {
    "vllm/_flashmla_C.abi3.so": "vllm/_flashmla_C.abi3.so",
    "vllm/third_party/flashmla/flash_mla_interface.py": "vllm/third_party/flashmla/flash_mla_interface.py",
}
CARRY = ROOT / ".peers-carry"  # vLLM's _C, staged by `python3 e2e/gpu_tests.py --prepare` (~56 MiB)


def pin_wheel(pin: str | None = None) -> tuple[str, Path]:
    """(pin, path of its cached release wheel), from pins.lock (the only place versions live)."""
    with open(ROOT / "pins.lock", "rb") as f:
        lock = tomllib.load(f)
    pin = pin or lock["default"]
    if pin not in lock.get("pins", {}):
        raise ValueError(f"pin {pin!r} not in pins.lock (have {sorted(lock.get('pins', {}))})")
    return pin, WHEEL_DIR / lock["pins"][pin]["wheel"]


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that produced a results file, as typed from the repository root."""
    args = sys.argv[1:] if argv is None else list(argv)
    rel = os.path.relpath(os.path.abspath(script), ROOT)
    envs = [f"{k}={os.environ[k]}" for k in ("DISABLE_MMA_V3", "GLM5_SPARSE_MLA_DISPATCH_CC") if os.environ.get(k)]
    return " ".join(envs + ["python", rel] + args)


# ------------------------------------------------------------------------------------------
# Peers: staged from the cached wheel into .peers/<pin>/, loaded from there
# ------------------------------------------------------------------------------------------

_STAGED_NOTE = "# staged by bench/common.py from the vLLM release wheel (not part of the project)\n"


def stage_members(members: dict[str, str], pin: str | None = None, peers: Path = PEERS, compress: bool = False,
                  wheel: Path | None = None) -> Path:
    """Extract ``members`` ({dest name: wheel member}) of the pin's cached wheel into
    ``peers/<pin>/`` (``.xz``-compressed when ``compress``); every folder above a staged ``.py``
    gets an ``__init__.py`` so ``vllm.third_party.flashmla`` imports from there. Returns the
    folder. Raises FileNotFoundError when the wheel is not cached."""
    pin, default_wheel = pin_wheel(pin)
    wheel = wheel or default_wheel
    if not wheel.exists():
        raise FileNotFoundError(f"vLLM {pin} wheel not cached at {wheel} (tools/apply.py fetch downloads it)")
    dest = peers / pin
    with zipfile.ZipFile(wheel) as z:
        for name, member in members.items():
            out = dest / (name + (".xz" if compress else ""))
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src:
                if compress:
                    with lzma.open(out, "wb", preset=6) as dst:
                        shutil.copyfileobj(src, dst, 1 << 24)
                else:
                    with open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 24)
            if name.endswith(".py"):
                d = out.parent
                while d != dest:
                    init = d / "__init__.py"
                    if not init.exists():
                        init.write_text(_STAGED_NOTE)
                    d = d.parent
    return dest


def peers_bytes(peers: Path = PEERS) -> int:
    """Bytes under the peers folder (what carrying it costs)."""
    if not peers.exists():
        return 0
    return sum(p.stat().st_size for p in peers.rglob("*") if p.is_file())


def load_flashmla(pin: str | None = None, peers: Path = PEERS):
    """Import FlashMLA's ``flash_mla_interface`` staged under ``peers/<pin>/`` (staging it first
    when the wheel is cached). Returns ``(module, None)`` or ``(None, why)``."""
    pin, wheel = pin_wheel(pin)
    base = peers / pin
    if not (base / "vllm" / "_flashmla_C.abi3.so").exists():
        if not wheel.exists():
            return None, f"FlashMLA not staged in {base} and the {pin} wheel is not cached"
        stage_members(FLASHMLA_MEMBERS, pin, peers)
    sys.path.insert(0, str(base))
    try:
        from vllm.third_party.flashmla import flash_mla_interface as fmi  # noqa: E402
    except Exception as e:  # depends on the device image (driver, torch ABI)
        return None, f"FlashMLA import failed: {type(e).__name__}: {e}"
    finally:
        sys.path.remove(str(base))
    return fmi, None


def load_vllm_c(pin: str | None = None, carry: Path | None = None):
    """Load vLLM's ``_C_stable_libtorch`` (registers ``torch.ops._C_cache_ops``) from the
    ``.peers-carry/`` folder that ``python3 e2e/gpu_tests.py --prepare`` stages (xz + manifest with
    sha256 and the torch it is built for; the same files tests/kernels/vllm_peers.py loads).
    Returns ``(True, note)`` or ``(False, why)``."""
    import ctypes
    import glob
    import hashlib
    import json
    import site
    import tempfile

    import torch

    pin, _ = pin_wheel(pin)
    carry = carry or CARRY
    man = carry / "manifest.json"
    if not man.exists():
        return False, f"{man} not staged (python3 e2e/gpu_tests.py --prepare)"
    entry = json.loads(man.read_text()).get("pins", {}).get(pin)
    if entry is None:
        return False, f"{man} has no vLLM {pin} library"
    have = torch.__version__.split("+")[0]
    if have != entry["torch"]:
        return False, f"vLLM {pin}'s compiled ops are built for torch {entry['torch']}, this is torch {have}"
    dst = Path(tempfile.gettempdir()) / "glm5-peers" / entry["sha256"][:16] / entry["name"]
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        part = dst.with_suffix(f".part{os.getpid()}")  # benches may start side by side
        with lzma.open(carry / entry["path"]) as f, open(part, "wb") as g:
            shutil.copyfileobj(f, g, 1 << 24)
        part.replace(dst)
    h = hashlib.sha256()
    with open(dst, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    if h.hexdigest() != entry["sha256"]:
        dst.unlink()
        return False, f"{dst} does not match the manifest's sha256"
    for root in site.getsitepackages() + ["/usr/local/cuda/lib64"]:  # libcudart by soname (torch's wheels)
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so.13*"), recursive=True))
        if hits:
            ctypes.CDLL(hits[0], mode=ctypes.RTLD_GLOBAL)
            break
    try:
        torch.ops.load_library(str(dst))
    except Exception as e:  # depends on the device image
        return False, f"vLLM {pin} _C load failed: {type(e).__name__}: {e}"[:400]
    if not hasattr(torch.ops, "_C_cache_ops"):
        return False, f"vLLM {pin}'s {entry['name']} registered no _C_cache_ops"
    return True, f"vLLM {pin} _C_stable_libtorch loaded from {carry}"


# ------------------------------------------------------------------------------------------
# Time budget
# ------------------------------------------------------------------------------------------


class TimeBudget:
    """Wall-clock budget of one run: ``left()`` seconds remain; ``allows(cost_s)`` says whether
    a step estimated at ``cost_s`` still fits before the reserve kept for writing results."""

    def __init__(self, seconds: float | None, reserve_s: float = 20.0, clock=time.monotonic):
        self.seconds = seconds
        self.reserve_s = reserve_s
        self.clock = clock
        self.t0 = clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def allows(self, cost_s: float = 0.0) -> bool:
        return self.left() - self.reserve_s >= cost_s


# ------------------------------------------------------------------------------------------
# Statistics and ratios (pure Python)
# ------------------------------------------------------------------------------------------


def median(xs) -> float:
    xs = list(xs)
    if not xs:
        raise ValueError("median of no values")
    return float(statistics.median(xs))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


# ------------------------------------------------------------------------------------------
# GPU timing
# ------------------------------------------------------------------------------------------


def time_graph(fns, rep_ms: int = 60, warmup_ms: int = 20) -> float:
    """Median microseconds per call of a CUDA graph that runs every fn in ``fns`` once (warmed
    up eagerly on a side stream first, then captured on that stream, as vLLM captures: compiles,
    lazy metadata and per-stream state happen outside the capture)."""
    import torch
    import triton

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(g.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del g
    return ms * 1e3 / len(fns)


def time_events(fns, reps: int = 5, rounds: int = 5) -> float:
    """Median microseconds of one pass over ``fns`` (all of them, in order: the steps of one
    operation), CUDA events around ``reps`` passes, eager (for calls long enough that host overhead
    hides behind the GPU: prefill-sized work)."""
    import torch

    for f in fns:
        f()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            for f in fns:
                f()
        b.record()
        b.synchronize()
        res.append(a.elapsed_time(b) * 1e3 / reps)  # per pass, not per step
    return median(res)


def host_us(fn, calls: int = 1000, sync_every: int = 16, warmup: int = 20) -> float:
    """Median wall time (us) of one eager call of ``fn`` over ``calls`` calls: the host cost of a
    launch (validation, allocation, launcher), not the GPU time. The queue is drained every
    ``sync_every`` calls outside the timed region, so a call never waits for a full launch queue."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    clock = time.perf_counter
    for i in range(calls):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    torch.cuda.synchronize()
    return median(ts) * 1e6


TIMING = {"target_ms": 15.0, "rounds": 5}  # defaults of time_graph_steps (scripts may update them)


def time_graph_steps(step, n_iter: int, target_ms: float | None = None, rounds: int | None = None):
    """step(i) enqueues iteration i. Captures n_iter iterations in one CUDA graph; returns the
    median per-iteration time in microseconds over ``rounds`` rounds of replays, and the spread
    (max - min) / median. (Moved from bench/dsa_indexer.py.)"""
    import torch

    target_ms = TIMING["target_ms"] if target_ms is None else target_ms
    rounds = TIMING["rounds"] if rounds is None else rounds
    s = torch.cuda.Stream()  # warm-up and capture on one stream, as vLLM captures
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(n_iter):
            step(i)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, min(200, int(target_ms / 1e3 / one)))
    res = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        res.append(a.elapsed_time(b) * 1e3 / (reps * n_iter))
    del g
    return statistics.median(res), (max(res) - min(res)) / statistics.median(res)


def copy_bandwidth(device=None) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written): a 2 GiB copy, five
    rounds of five copies between CUDA events, median. (Moved from bench/dsa_indexer.py; both
    benchmark scripts use it.)"""
    import torch

    x = torch.empty(2 << 30, dtype=torch.uint8, device=device or "cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    res = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            y.copy_(x)
        b.record()
        b.synchronize()
        res.append(2 * x.numel() * 5 / (a.elapsed_time(b) * 1e-3))
    del x, y
    torch.cuda.empty_cache()
    return statistics.median(res)


# ---------------------------------------------------------------------------------------------
# Pure gather of selected KV rows: the memory-side limit of sparse attention's access pattern
# ---------------------------------------------------------------------------------------------

_GATHER = None


def _gather_kernel():
    global _GATHER
    if _GATHER is None:
        import triton
        import triton.language as tl

        @triton.jit
        def gather_rows(pool, idx, out, topk, num_slots, stride_it, ROW_WORDS: tl.constexpr, W: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
            """Program (t, s): read rows idx[t, s-th share] of the pool (ROW_WORDS int32 each; indices
            < 0 or >= num_slots read nothing, as in the attention kernels) and store their
            column-wise checksum (so no load can be dropped)."""
            t = tl.program_id(0)
            s = tl.program_id(1)
            per = tl.cdiv(topk, SPLITS)
            lo = s * per
            hi = tl.minimum(lo + per, topk)
            cols = tl.arange(0, W)
            acc = tl.zeros([W], dtype=tl.int32)
            for n in range(lo, hi, BLOCK_N):
                rn = n + tl.arange(0, BLOCK_N)
                m = rn < hi
                r = tl.load(idx + t.to(tl.int64) * stride_it + rn, mask=m, other=-1)
                ok = m & (r >= 0) & (r < num_slots)
                r = tl.where(ok, r, 0).to(tl.int64)
                x = tl.load(pool + r[:, None] * ROW_WORDS + cols[None, :],
                            mask=ok[:, None] & (cols[None, :] < ROW_WORDS), other=0)
                acc += tl.sum(x, 0)
            tl.store(out + (t * SPLITS + s) * W + cols, acc)

        _GATHER = gather_rows
    return _GATHER


def gather_fn(pool_words, idx, splits: int, block_n: int, warps: int, out=None):
    """One launch (returned as a closure) reading every row ``idx`` ([T, topk] int32) selects from
    ``pool_words`` ([slots, row_words] int32), each row's top-k range split over ``splits``
    programs. ``f.out`` holds the [T, splits, W] checksums (W = row_words rounded up to a power of
    two), for tests."""
    import torch
    import triton

    T, topk = idx.shape
    row_words = pool_words.shape[1]
    W = triton.next_power_of_2(row_words)
    if out is None:
        out = torch.empty(T * splits * W, dtype=torch.int32, device=idx.device)
    elif out.numel() < T * splits * W:
        raise ValueError(f"gather output holds {out.numel()} words, needs {T * splits * W}")
    k = _gather_kernel()

    def f():
        k[(T, splits)](pool_words, idx, out, topk, pool_words.shape[0], idx.stride(0), ROW_WORDS=row_words, W=W,
                       BLOCK_N=block_n, SPLITS=splits, num_warps=warps)
    f.out, f.W = out, W
    return f


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"a:b,c:d"`` -> [(a, b), (c, d)] (shape lists of the bench scripts)."""
    out = []
    for part in text.split(","):
        a, b = part.split(":")
        out.append((int(a), int(b)))
    return out


@contextlib.contextmanager
def sparse_mla_merge_env(merge: str | None):
    """``GLM5_SPARSE_MLA_MERGE=merge`` inside the block (None: unchanged). It steers the dispatch's
    merge without a config, which would take the planning path on every call."""
    if merge is None:
        yield
        return
    os.environ["GLM5_SPARSE_MLA_MERGE"] = merge
    try:
        yield
    finally:
        os.environ.pop("GLM5_SPARSE_MLA_MERGE", None)


class ResultsFile:
    """A results JSON (``header`` + ``records`` + ``complete`` + ``wall_s``) rewritten after every
    record: a run stopped by its time limit keeps what it measured."""

    def __init__(self, path, header: dict):
        self.path = Path(path)
        self.t0 = time.time()
        self.records: list[dict] = []
        self.doc = dict(header, records=self.records, complete=False)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, rec: dict) -> None:
        self.records.append(rec)
        self.write()

    def finish(self) -> None:
        self.doc["complete"] = True
        self.write()
        print(f"wrote {self.path}")

    def write(self) -> None:
        self.doc["wall_s"] = time.time() - self.t0
        self.path.write_text(json.dumps(self.doc, indent=1) + "\n")

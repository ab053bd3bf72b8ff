"""What keeps the tool from losing work: one lock per tree, owned temporary folders, child processes
that end with the tool, and signals handled like Ctrl-C.

- TreeLock: an OS file lock (fcntl.flock) on a file beside the tree (in the git directory for a
  --checkout). Every command that writes to a tree takes it; a second one fails at once (exit 5) or
  waits (--wait). The kernel drops the lock when its process dies, so a stale lock never blocks.
- owned_tempdir: a temporary folder with a locked owner file beside it (<name>.owner). It is removed
  on every exit path the process lives through; clean_stale() removes the folders of owners that
  died (SIGKILL) -- the owner lock of a dead process is free.
- child processes run in a process group of their own (so a terminal's Ctrl-C reaches only the
  tool, which then ends each child's whole group: run(), kill_group()), and get
  PR_SET_PDEATHSIG=SIGKILL (Linux): a direct child ends with the tool even when the tool is killed
  with SIGKILL (a `git checkout` or `wheel pack` left running would write on).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import RefusedError

OWNER_SUFFIX = ".owner"


# ------------------------------------------------------------------------ lock
class TreeLock:
    """fcntl.flock on `path`; `what` names the thing locked in messages."""

    def __init__(self, path: Path, what: str, wait: bool = False, log=None):
        self.path = path
        self.what = what
        self.wait = wait
        self.log = log
        self.fd: int | None = None

    def __enter__(self) -> "TreeLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                if not self.wait:
                    raise RefusedError(
                        f"another tools/apply.py command{holder} is working on {self.what} (lock {self.path}); "
                        f"wait for it to finish, or pass --wait to wait for it"
                    ) from None
                if self.log:
                    self.log(f"waiting for another tools/apply.py command{holder} working on {self.what} ...")
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {' '.join(sys.argv[1:])[:300]}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock; the file stays (removing it would race a waiter)
            self.fd = None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 400, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    pid, _, args = text.partition(" ")
    return f" (pid {pid}: {args})" if pid.isdigit() else ""


def is_locked(path: Path) -> bool:
    """True when some process holds the lock on `path` (used by status, which does not lock)."""
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# ------------------------------------------------------------------ temp dirs
@contextmanager
def owned_tempdir(prefix: str, dir: Path | str | None = None):
    """A temporary folder `<dir>/<prefix>XXXX` owned by this process through `<folder>.owner`.

    The owner file is created and locked before the folder exists and removed after it is gone,
    so every such folder has an owner file whose lock tells whether its owner is alive.
    """
    parent = Path(dir) if dir is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale(parent, prefix)
    fd, owner = tempfile.mkstemp(prefix=prefix, suffix=OWNER_SUFFIX, dir=parent)
    folder = Path(owner[: -len(OWNER_SUFFIX)])
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        folder.mkdir()
        yield folder
    finally:
        try:
            if folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            Path(owner).unlink(missing_ok=True)
            os.close(fd)


def release_owned(folder: Path) -> None:
    """Forget ownership of `folder` before renaming it away (create_baseline): remove its owner file."""
    Path(str(folder) + OWNER_SUFFIX).unlink(missing_ok=True)


def clean_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove `<parent>/<prefix>*` folders whose owner process is gone. Returns what was removed."""
    removed = []
    try:
        owners = [p for p in parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(OWNER_SUFFIX)]
    except OSError:
        return removed
    for owner in owners:
        try:
            fd = os.open(owner, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            folder = Path(str(owner)[: -len(OWNER_SUFFIX)])
            if folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            owner.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return removed


def clean_stale_tmp() -> list[Path]:
    """Stale folders of dead tools/apply.py runs in $TMPDIR (temporary indexes, scratch trees)."""
    tmp = Path(tempfile.gettempdir())
    return [d for p in ("glm5-index-", "glm5-scratch-", "glm5-msg-", "glm5-verify-") for d in clean_stale(tmp, p)]


# ------------------------------------------------------------ child processes
_PR_SET_PDEATHSIG = 1
_libc = None


def _child_setup() -> None:  # runs in the child between fork and exec
    os.setpgid(0, 0)
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def child_kwargs() -> dict:
    """subprocess keyword arguments: the child leads a process group of its own and (Linux) dies
    with the tool. Whoever starts it ends its group on every exit path (run() and kill_group())."""
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.prctl  # noqa: B018
        except (OSError, AttributeError):
            _libc = None
    return {"preexec_fn": _child_setup}


def kill_group(proc: subprocess.Popen) -> None:
    """End a child started with child_kwargs() and everything it started (its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def run(cmd, *, input=None, capture_output=False, timeout=None, check=False, **kw) -> subprocess.CompletedProcess:
    """subprocess.run, with the child in its own process group that is ended when the tool is
    interrupted (Ctrl-C, SIGTERM, SIGHUP) or times out, and (Linux) killed with the tool."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    with subprocess.Popen(cmd, **kw, **child_kwargs()) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:  # KeyboardInterrupt (also SIGTERM/SIGHUP, see handle_signals), TimeoutExpired
            kill_group(proc)
            raise
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        r.check_returncode()
    return r


# ------------------------------------------------------------------- signals
def _as_interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def handle_signals() -> None:
    """SIGTERM and SIGHUP end the tool like Ctrl-C: everything rolls back, exit 130."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:  # `nohup tools/apply.py` keeps ignoring hangups
            signal.signal(s, _as_interrupt)


def held_open(path: Path) -> list[int]:
    """PIDs of live processes that have `path` open (Linux /proc); [] where that cannot be read."""
    pids = []
    try:
        target = os.path.realpath(path)
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            fddir = f"/proc/{d}/fd"
            try:
                for fd in os.listdir(fddir):
                    try:
                        if os.readlink(f"{fddir}/{fd}") == target:
                            pids.append(int(d))
                            break
                    except OSError:
                        continue
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.ENOENT, errno.EPERM):
                    raise
    except OSError:
        return []
    return pids

"""The vLLM git tree: baseline from the release wheel, transactional apply, recovery, export.

Every change to a tree is computed first, off to the side (a temporary index and new commit
objects: the work tree, the index and the branches are not touched), and only when every patch
and the overlay succeeded is the result checked out in one step, guarded by a journal in the
git directory. A failure or an interruption before that step leaves the tree exactly as it was;
an interruption during it is undone by the next command that opens the tree.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import signal
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import INTERRUPTED, PatchError, PinError, RefusedError, ToolError, UsageError
from .gitutil import Git
from .patches import FIXED_EPOCH, AUTHOR, PatchFile, normalize_export
from .pins import Pin
from .project import OverlayFile

JOURNAL = "glm5-overlay-apply.json"
OVERLAY_TRAILER = "Glm5-Overlay"
WHEEL_TRAILER = "Wheel-Sha256"
FAULT_ENV = "GLM5_OVERLAY_FAULT"  # fault injection for the tests (see the interrupted-apply tests in tests/tool/test_apply.py)

FORMAT_PATCH_OPTS = [
    "--full-index", "--zero-commit", "--no-signature", "--no-stat", "--keep-subject",
    "--no-renames", "--no-color", "--src-prefix=a/", "--dst-prefix=b/", "--no-numbered",
    "--no-thread", "--diff-algorithm=myers",
]


def progress(**kw):
    from tqdm import tqdm

    return tqdm(**kw, disable=None, leave=False)


def log(msg: str) -> None:
    print(msg, flush=True)


def _fault(point: str) -> None:
    """Fault injection: GLM5_OVERLAY_FAULT=<point>[:sigkill]; only the tests set it."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    name, _, how = spec.partition(":")
    if name != point:
        return
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise KeyboardInterrupt(f"fault injected at {point}")


# -------------------------------------------------------------------- baseline
def _record_hashes(zf: zipfile.ZipFile) -> dict[str, str]:
    names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(names) != 1:
        raise ToolError(f"wheel has {len(names)} RECORD files")
    out = {}
    for row in csv.reader(io.StringIO(zf.read(names[0]).decode("utf-8"))):
        if len(row) >= 2 and row[1]:
            algo, _, digest = row[1].partition("=")
            if algo == "sha256":
                out[row[0]] = digest
    return out


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def zip_mode(info: zipfile.ZipInfo) -> str:
    return "100755" if (info.external_attr >> 16) & 0o111 else "100644"


COMPILED_RE = re.compile(r"\.(so|pyd|dylib|dll)(\.[0-9.]+)?$")


def create_baseline(dest: Path, pin: Pin, wheel: Path, checkout: bool = True, binaries: bool = True) -> Git:
    """Make `dest` a git repository whose first commit is the release wheel's content.

    The commit (tagged v<version>, on branch overlay/<version>) has a fixed author and date, so
    it is the same commit everywhere. Built in a temporary folder next to `dest` and renamed into
    place when complete: an interrupted run leaves no half-made tree. binaries=False leaves the
    compiled files out (scratch trees for check/export-pr: patches never touch them).
    """
    if dest.exists():
        raise RefusedError(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        g = Git.init(tmp, pin.branch)
        _fast_import(g, pin, wheel, binaries)
        if checkout:
            with progress(total=1, desc="checking out baseline", unit="tree"):
                g.run("read-tree", "-u", "--reset", "HEAD")
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Git(dest)


def _fast_import(g: Git, pin: Pin, wheel: Path, binaries: bool = True) -> None:
    import subprocess

    from .gitutil import _BASE_CONFIG, git_env

    with zipfile.ZipFile(wheel) as zf:
        record = _record_hashes(zf)
        infos = [i for i in zf.infolist() if not i.is_dir() and (binaries or not COMPILED_RE.search(i.filename))]
        total = sum(i.file_size for i in infos)
        proc = subprocess.Popen(
            ["git", *_BASE_CONFIG, "-c", "core.bigFileThreshold=1m", "fast-import", "--quiet", "--done"],
            cwd=g.worktree,
            stdin=subprocess.PIPE,
            env=git_env(),
        )
        assert proc.stdin is not None
        w = proc.stdin
        entries = []
        try:
            with progress(total=total, desc=f"importing {wheel.name}", unit="B", unit_scale=True) as bar:
                for mark, info in enumerate(infos, 1):
                    data = zf.read(info)
                    want = record.get(info.filename)
                    if want is not None and _b64(hashlib.sha256(data).digest()) != want:
                        raise ToolError(f"{wheel.name}: {info.filename} does not match the wheel's RECORD")
                    if want is None and not info.filename.endswith(".dist-info/RECORD"):
                        raise ToolError(f"{wheel.name}: {info.filename} has no sha256 in RECORD")
                    w.write(b"blob\nmark :%d\ndata %d\n" % (mark, len(data)))
                    w.write(data)
                    w.write(b"\n")
                    entries.append((zip_mode(info), mark, info.filename))
                    bar.update(info.file_size)
            msg = (
                f"vLLM {pin.version} release wheel\n\nUnpacked from {pin.wheel}"
                f"{'' if binaries else ' (compiled files left out)'}.\n\n"
                f"{WHEEL_TRAILER}: {pin.sha256}\n"
            ).encode()
            ident = AUTHOR.encode()
            w.write(b"commit refs/heads/%s\nmark :%d\n" % (pin.branch.encode(), len(infos) + 1))
            w.write(b"author %s %d +0000\ncommitter %s %d +0000\n" % (ident, FIXED_EPOCH, ident, FIXED_EPOCH))
            w.write(b"data %d\n%s\n" % (len(msg), msg))
            for mode, mark, name in entries:
                w.write(b"M %s :%d %s\n" % (mode.encode(), mark, _quote(name)))
            w.write(b"\nreset refs/tags/%s\nfrom :%d\n\ndone\n" % (pin.tag.encode(), len(infos) + 1))
            w.close()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.wait() != 0:
            raise ToolError("git fast-import failed while importing the release wheel")


def _quote(path: str) -> bytes:
    if any(c in path for c in '"\n\\') or path.startswith(" "):
        return json.dumps(path).encode()
    return path.encode("utf-8")


# -------------------------------------------------------------------- the tree
@dataclass
class PatchStep:
    name: str
    status: str  # "applied" | "already-applied"
    commit: str | None = None
    offsets: list[str] = field(default_factory=list)


@dataclass
class OverlayStep:
    added: list[OverlayFile] = field(default_factory=list)
    updated: list[OverlayFile] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[OverlayFile] = field(default_factory=list)
    commit: str | None = None

    @property
    def changed(self) -> bool:
        return bool(self.added or self.updated or self.removed)


@dataclass
class Simulation:
    start: str
    commit: str  # the resulting commit (== start when nothing changes)
    patches: list[PatchStep]
    overlay: OverlayStep

    @property
    def changed(self) -> bool:
        return self.commit != self.start


class Tree:
    """A vLLM tree for one pin: the tool's own (managed) or a user's vLLM checkout."""

    def __init__(self, path: Path, pin: Pin, managed: bool):
        self.path = path
        self.pin = pin
        self.managed = managed
        self.g = Git(path)
        self.journal = self.g.git_dir / JOURNAL

    # ------------------------------------------------------------------ open
    @classmethod
    def open(cls, path: Path, pin: Pin, managed: bool) -> "Tree":
        if not path.exists():
            raise UsageError(f"{path} does not exist")
        t = cls(path, pin, managed)
        t._check_pin()
        return t

    def _check_pin(self) -> None:
        base = self.g.rev(f"refs/tags/{self.pin.tag}")
        if base is None:
            other = [t for t in self.g.out("tag", "--list", "v*").split() if re.fullmatch(r"v\d+\.\d+\.\d+\S*", t)]
            held = f" it has {', '.join(other)}" if other else " it has no v<version> tag"
            raise PinError(f"{self.path} is not a vLLM {self.pin.version} tree: no tag {self.pin.tag};{held}")
        if self.managed:
            msg = self.g.out("log", "-1", "--format=%B", base)
            m = re.search(rf"^{WHEEL_TRAILER}: ([0-9a-f]{{64}})$", msg, re.M)
            if not m or m.group(1) != self.pin.sha256:
                raise PinError(
                    f"{self.path} was made from a wheel with sha256 {m.group(1) if m else '(unknown)'}, "
                    f"but pins.lock pins vLLM {self.pin.version} at {self.pin.sha256}; "
                    f"move the tree away and run apply again"
                )
        self.base = base

    # --------------------------------------------------------------- state
    def require_clean(self, action: str) -> None:
        dirty = self.g.status_lines()
        if dirty:
            shown = "\n  ".join(dirty[:15]) + ("\n  ..." if len(dirty) > 15 else "")
            raise RefusedError(
                f"{self.path} has uncommitted changes; refusing to {action} (nothing was touched):\n  {shown}\n"
                f"commit them (then `refresh` exports commits as patches) or move them away"
            )

    def start_point(self) -> str:
        """The commit the series is applied on; refuses states the tool must not change."""
        branch = self.g.current_branch()
        head = self.g.rev("HEAD")
        if branch == self.pin.branch:
            if self.g.run("merge-base", "--is-ancestor", self.base, head, check=False).returncode != 0:
                raise RefusedError(f"{self.path}: branch {branch} does not descend from {self.pin.tag}")
            return head  # type: ignore[return-value]
        if self.g.rev(f"refs/heads/{self.pin.branch}"):
            raise RefusedError(
                f"{self.path}: branch {self.pin.branch} exists but is not checked out (HEAD is "
                f"{branch or 'detached'}); check it out to continue it, or delete it yourself"
            )
        if head != self.base:
            raise PinError(
                f"{self.path}: HEAD ({branch or 'detached'} at {head[:12] if head else '?'}) is not at {self.pin.tag} "
                f"({self.base[:12]}); check out {self.pin.tag} first"
            )
        return head

    # ----------------------------------------------------------- simulate
    def simulate(self, start: str, patches: list[PatchFile], overlay: list[OverlayFile] | None) -> Simulation:
        """Apply the series (and overlay) on `start` in a temporary index; return the new commit."""
        with tempfile.TemporaryDirectory(prefix="glm5-index-") as td:
            env = {"GIT_INDEX_FILE": str(Path(td) / "index")}
            g = self.g
            g.run("read-tree", start, env=env)
            parent = start
            steps: list[PatchStep] = []
            # Patches whose commits the tree already holds, in series order, count as applied.
            # (Checking each patch by reverse-applying it to the final tree is not enough: a later
            # patch that edits the same lines hides an earlier one.)
            done = self._applied_prefix(start, patches)
            for n, p in enumerate(patches, 1):
                if n <= done:
                    steps.append(PatchStep(p.name, "already-applied"))
                    continue
                r = g.run("apply", "--cached", "--check", "-v", str(p.path), env=env, check=False)
                if r.returncode == 0:
                    g.run("apply", "--cached", str(p.path), env=env)
                    tree = g.out("write-tree", env=env)
                    parent = self._commit_from_patch(p, tree, parent)
                    steps.append(PatchStep(p.name, "applied", parent, _offsets(r.stderr.decode("utf-8", "replace"))))
                else:
                    rr = g.run("apply", "--cached", "--check", "-R", str(p.path), env=env, check=False)
                    if rr.returncode != 0:
                        raise PatchError(describe_apply_failure(p, r.stderr.decode("utf-8", "replace"), self.path))
                    steps.append(PatchStep(p.name, "already-applied"))
                _fault(f"after-patch-{n}")
            ov = OverlayStep()
            if overlay is not None:
                parent = self._overlay_commit(parent, overlay, env, ov)
            return Simulation(start, parent, steps, ov)

    def _commit_from_patch(self, p: PatchFile, tree: str, parent: str) -> str:
        with tempfile.TemporaryDirectory() as td:
            msgf, patchf = Path(td) / "msg", Path(td) / "patch"
            r = self.g.run("mailinfo", "-k", str(msgf), str(patchf), input=p.data)
            info = {}
            for line in r.stdout.decode("utf-8", "replace").splitlines():
                k, _, v = line.partition(": ")
                info[k] = v
            body = msgf.read_text(encoding="utf-8")
        message = info.get("Subject", "").strip() + "\n"
        if body.strip():
            message += "\n" + body.rstrip("\n") + "\n"
        env = {
            "GIT_AUTHOR_NAME": info.get("Author") or "unknown",
            "GIT_AUTHOR_EMAIL": info.get("Email") or "unknown",
            "GIT_AUTHOR_DATE": info.get("Date") or "",
        }
        if not env["GIT_AUTHOR_DATE"]:
            del env["GIT_AUTHOR_DATE"]
        return self.g.out("commit-tree", tree, "-p", parent, "-F", "-", input=message.encode(), env=env)

    def placed_files(self, start: str) -> set[str]:
        """Destination paths written by earlier overlay commits between the baseline and `start`."""
        out = self.g.out("log", "--format=%B%x00", f"{self.base}..{start}")
        placed = set()
        for msg in out.split("\x00"):
            if re.search(rf"^{OVERLAY_TRAILER}: ", msg, re.M):
                for m in re.finditer(r"^[0-9a-f]{64}  (\S+)", msg, re.M):
                    placed.add(m.group(1))
        return placed

    def _overlay_commit(self, parent: str, files: list[OverlayFile], env: dict, ov: OverlayStep) -> str:
        g = self.g
        dests = [f.dest for f in files]
        if dests:
            upstream = set(g.out("ls-tree", "-r", "--name-only", self.base, "--", *dests).splitlines())
            clash = [f for f in files if f.dest in upstream]
            if clash:
                lines = "\n  ".join(f"{f.source} -> {f.dest}" for f in clash)
                raise PatchError(
                    f"overlay would replace upstream file(s) of vLLM {self.pin.version}:\n  {lines}\n"
                    f"overlay and kernels files must be new files (rename them); edits of upstream files are patches"
                )
        current = {}
        for line in g.out("ls-files", "-s", "--", *dests, env=env).splitlines() if dests else []:
            meta, path = line.split("\t", 1)
            mode, sha, _ = meta.split()
            current[path] = (mode, sha)
        if files:
            paths = "".join(str(f.path) + "\n" for f in files)
            blobs = g.out("hash-object", "-w", "--no-filters", "--stdin-paths", input=paths.encode()).split()
        else:
            blobs = []
        for f, blob in zip(files, blobs):
            mode = f"{f.mode:o}"
            if current.get(f.dest) == (mode, blob):
                ov.unchanged.append(f)
                continue
            (ov.updated if f.dest in current else ov.added).append(f)
            g.run("update-index", "--add", "--cacheinfo", f"{mode},{blob},{f.dest}", env=env)
        wanted = set(dests)
        for stale in sorted(self.placed_files(parent) - wanted):
            if g.out("ls-files", "--", stale, env=env):
                g.run("update-index", "--force-remove", "--", stale, env=env)
                ov.removed.append(stale)
        if not ov.changed:
            return parent
        tree = g.out("write-tree", env=env)
        digest = hashlib.sha256("".join(f"{f.sha256}  {f.dest}\n" for f in sorted(files, key=lambda f: f.dest)).encode()).hexdigest()
        lines = [f"{f.sha256}  {f.dest}  ({f.source})" for f in sorted(files, key=lambda f: f.dest)]
        msg = (
            f"GLM-5 overlay: {len(files)} file(s) from overlay/ and kernels/\n\n"
            + ("\n".join(lines) + "\n\n" if lines else "")
            + ("".join(f"removed  {r}\n" for r in ov.removed) + "\n" if ov.removed else "")
            + f"{OVERLAY_TRAILER}: {digest}\n"
        )
        ov.commit = g.out("commit-tree", tree, "-p", parent, "-F", "-", input=msg.encode())
        return ov.commit

    # -------------------------------------------------------------- apply
    def apply(self, patches: list[PatchFile], overlay: list[OverlayFile] | None, dry_run: bool = False) -> Simulation:
        self.recover()
        self.require_clean("apply patches")
        start = self.start_point()
        sim = self.simulate(start, patches, overlay)
        if dry_run or not sim.changed:
            return sim
        self._switch(start, sim.commit)
        return sim

    def _switch(self, start: str, target: str) -> None:
        """Check out `target` on branch overlay/<version>, guarded by the journal."""
        branch = self.g.current_branch()
        added = self.g.out("diff", "--name-only", "--diff-filter=A", "--no-renames", start, target).splitlines()
        journal = {
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "version": self.pin.version,
            "orig_head": start,
            "orig_branch": branch,
            "target": target,
            "branch": self.pin.branch,
            "created_branch": self.g.rev(f"refs/heads/{self.pin.branch}") is None,
            "added": added,
        }
        tmp = self.journal.with_suffix(".tmp")
        tmp.write_text(json.dumps(journal, indent=1))
        os.replace(tmp, self.journal)
        old_term = signal.signal(signal.SIGTERM, _sigterm)
        try:
            _fault("before-checkout")
            self.g.run("checkout", "-q", "-B", self.pin.branch, target)
            _fault("after-checkout")
        except BaseException as e:
            msg = self.recover(force=True)
            if isinstance(e, KeyboardInterrupt):
                raise ToolError(f"interrupted; {msg}", INTERRUPTED) from None
            raise
        finally:
            signal.signal(signal.SIGTERM, old_term)
        self.journal.unlink()

    def recover(self, force: bool = False) -> str | None:
        """Undo an apply that was interrupted while checking out its result."""
        if not self.journal.exists():
            return None
        j = json.loads(self.journal.read_text())
        if not force and j.get("pid") != os.getpid() and _alive(j.get("pid")):
            raise RefusedError(f"{self.path}: another apply (pid {j['pid']}) is running; wait for it to finish")
        lock = self.g.git_dir / "index.lock"
        if lock.exists():
            lock.unlink()
        g = self.g
        orig, branch = j["orig_head"], j.get("orig_branch")
        if branch:
            g.run("update-ref", f"refs/heads/{branch}", orig)
            g.run("checkout", "-q", "-f", branch)
        else:
            g.run("checkout", "-q", "-f", "--detach", orig)
        if j.get("created_branch") and branch != j["branch"]:
            if g.rev(f"refs/heads/{j['branch']}") in (j["target"], orig):
                g.run("branch", "-q", "-D", j["branch"])
        tracked = set(g.out("ls-files", "--", *j.get("added", [])).splitlines()) if j.get("added") else set()
        for rel in j.get("added", []):
            p = self.path / rel
            if rel not in tracked and p.is_file():
                p.unlink()
                _prune_empty_dirs(p.parent, self.path)
        self.journal.unlink()
        return (
            f"an apply started {j.get('started')} (pid {j.get('pid')}) was interrupted; "
            f"restored {branch or 'detached HEAD'} at {orig[:12]}"
        )

    # --------------------------------------------------------------- export
    def _applied_prefix(self, start: str, patches: list[PatchFile]) -> int:
        """How many leading patches of the series the tree's patch commits are, byte for byte."""
        if start == self.base:
            return 0
        n = 0
        for sha, p in zip(self.patch_commits(start), patches):
            if self.export_commit(sha) != p.path.read_bytes():
                break
            n += 1
        return n

    def patch_commits(self, upto: str = "HEAD") -> list[str]:
        """Commits after the baseline that are patches (not overlay commits), oldest first."""
        out = self.g.out("log", "--reverse", "--format=%H%x01%B%x00", f"{self.base}..{upto}")
        commits = []
        for rec in out.split("\x00"):
            rec = rec.strip("\n")
            if not rec:
                continue
            sha, _, msg = rec.partition("\x01")
            if re.search(rf"^{OVERLAY_TRAILER}: ", msg, re.M):
                continue
            if len(self.g.out("rev-list", "--parents", "-n1", sha).split()) > 2:
                raise RefusedError(f"{self.path}: commit {sha[:12]} is a merge; patches must be a linear history")
            commits.append(sha)
        return commits

    def export_commit(self, sha: str) -> bytes:
        data = self.g.run("format-patch", "-1", "--stdout", *FORMAT_PATCH_OPTS, sha).stdout
        return normalize_export(data)

    def subject(self, sha: str) -> str:
        return self.g.out("log", "-1", "--format=%s", sha)

    def changed_paths(self, a: str, b: str) -> dict[str, str]:
        """path -> status letter (A/M/D) between two commits."""
        out = self.g.out("diff", "--name-status", "--no-renames", a, b)
        res = {}
        for line in out.splitlines():
            st, _, path = line.partition("\t")
            res[path] = st[0]
        return res


def _sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune_empty_dirs(d: Path, top: Path) -> None:
    while d != top and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


def _offsets(stderr: str) -> list[str]:
    out, cur = [], None
    for line in stderr.splitlines():
        m = re.match(r"^Checking patch (.+)\.\.\.$", line)
        if m:
            cur = m.group(1)
            continue
        m = re.match(r"^Hunk #(\d+) succeeded at (\d+)(?: \(offset (-?\d+) lines?\))?\.", line)
        if m and m.group(3):
            out.append(f"{cur}: hunk #{m.group(1)} applied at line {m.group(2)} (offset {m.group(3)} lines)")
    return out


def describe_apply_failure(p: PatchFile, stderr: str, where: Path) -> str:
    lines = stderr.splitlines()
    detail = None
    for i, line in enumerate(lines):
        m = re.match(r"^error: patch failed: (.+):(\d+)$", line)
        if m:
            path, ln = m.group(1), int(m.group(2))
            h = p.hunk_at(path, ln)
            hunk = f"hunk #{h.index} ({h.header.split(' @@')[0]} @@)" if h else f"the hunk at line {ln}"
            searched = []
            if "error: while searching for:" in lines:
                j = lines.index("error: while searching for:") + 1
                while j < len(lines) and not lines[j].startswith("error: "):
                    searched.append(lines[j])
                    j += 1
            shown = "\n      ".join(s for s in searched[:8])
            detail = (
                f"{path}, {hunk}: its context is not in the file (upstream drifted; no fuzz is allowed)"
                + (f"\n    expected lines:\n      {shown}" if shown else "")
            )
            break
        m = re.match(r"^error: (.+?): (No such file or directory|does not exist in index)$", line)
        if m:
            h = next((f for f in p.files if m.group(1) in (f.old_path, f.new_path)), None)
            n = len(h.hunks) if h else 0
            detail = f"{m.group(1)}, hunk #1 of {n}: the file does not exist in the tree"
            break
        m = re.match(r"^error: (.+?): already exists in (index|working directory)$", line)
        if m:
            detail = f"{m.group(1)}: the patch creates it but it already exists (with other content)"
            break
    if detail is None:
        detail = "git apply said:\n    " + "\n    ".join(lines[-10:])
    return f"patch {p.name} does not apply to {where}:\n  {detail}\nthe tree was left as it was"

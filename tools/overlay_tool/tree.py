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
import signal
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import INTERRUPTED, CheckoutError, PatchError, PinError, RefusedError, ToolError, UsageError
from .gitutil import Git
from .patches import AUTHOR, AUTHOR_NAME, FIXED_EPOCH, PatchFile, normalize_export
from .pins import Pin
from .project import OverlayFile
from .safety import child_kwargs, held_open, kill_group, owned_tempdir

JOURNAL = "glm5-overlay-apply.json"  # what an unfinished command was changing (see Tree._switch)
SYNC = "glm5-overlay-sync.json"  # patches/<version> and HEAD when the tree was last applied/refreshed
PORT_STATE = "glm5-overlay-port.json"  # a `port` in progress into this tree (tools/overlay_tool/port.py)
LOCK = "glm5-overlay.lock"  # --checkout trees: the lock lives in the git directory
BACKUP_REF = "refs/glm5-overlay/before-rebuild"  # HEAD before `apply --rebuild` replaced the commits
OVERLAY_TRAILER = "Glm5-Overlay"
WHEEL_TRAILER = "Wheel-Sha256"
# Fault injection for the tests (tests/tool/test_recovery.py): GLM5_OVERLAY_FAULT=<point>[:sigkill].
# Points: baseline-imported, after-patch-<n>, before-checkout, checkout-partial (leaves part of the
# switch unwritten), after-checkout, mid-restore (recovery: branch moved back, files not yet),
# during-pack (build, while `wheel pack` runs).
# <how>: raise KeyboardInterrupt (default) or send the process sigkill / sigterm / sighup.
FAULT_ENV = "GLM5_OVERLAY_FAULT"

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


def fault_active(point: str) -> bool:
    return os.environ.get(FAULT_ENV, "").partition(":")[0] == point


def _fault(point: str) -> None:
    """Fault injection: GLM5_OVERLAY_FAULT=<point>[:sigkill]; only the tests set it."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    name, _, how = spec.partition(":")
    if name != point:
        return
    if how in ("sigkill", "sigterm", "sighup"):
        os.kill(os.getpid(), getattr(signal, how.upper()))
        time.sleep(5)  # the handler (SIGTERM/SIGHUP: safety.handle_signals) raises here
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
    # The temporary tree is owned (tools/overlay_tool/safety.py): removed on every exit path, and by
    # the next run if this process is killed.
    with owned_tempdir(dest.name + ".tmp-", dest.parent) as tmp:
        g = Git.init(tmp, pin.branch)
        _fast_import(g, pin, wheel, binaries)
        _fault("baseline-imported")
        if checkout:
            with progress(total=1, desc="checking out baseline", unit="tree"):
                g.run("read-tree", "-u", "--reset", "HEAD")
        try:
            tmp.rename(dest)
        except OSError:
            if dest.exists():
                raise RefusedError(f"{dest} was created by something else while this command made it; "
                                   f"nothing of it was changed") from None
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
            **child_kwargs(),
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
            kill_group(proc)
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
        with owned_tempdir("glm5-index-") as td:
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
        with owned_tempdir("glm5-msg-") as td:
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
    def apply(self, patches: list[PatchFile], overlay: list[OverlayFile] | None, dry_run: bool = False,
              fingerprint: str | None = None, rebuild: bool = False, force: bool = False) -> Simulation:
        """Bring the tree to patches/ + overlay (all or nothing).

        fingerprint: patches_fingerprint() of patches/<version> (recorded for `refresh`/`status`).
        rebuild: re-apply the series from the baseline, replacing the tree's patch commits (the old
        HEAD is kept as BACKUP_REF); allowed when the tree holds nothing patches/ lacks, or with force.
        """
        if not dry_run:
            self.recover()
        self.require_clean("apply patches")
        start = self.start_point()
        commits = self.patch_commits(start)
        state = self.sync_state(fingerprint) if fingerprint else None
        rec = self.read_sync()
        mismatch = None if rebuild else self.first_mismatch(commits, patches)
        if rec is not None:
            safe = rec.get("head") == start and bool(rec.get("exported"))
        else:  # not recorded (a tree of an earlier version of the tool): safe if every commit is the tool's own
            safe = (rebuild or mismatch is not None) and self.only_tool_commits(start)
        if mismatch is not None and state in ("patches-newer", None) and safe:
            # patches/ changed (a pull, or an edit there) and the tree holds nothing patches/ lacks (it is
            # as last applied/refreshed, or every commit is one this tool made from a patch file):
            # re-applying the series loses nothing (the old HEAD is kept as a ref)
            why = ("the tree did not" if state else "the tree holds only commits this tool made from patch files")
            log(f"patches/{self.pin.version} differs from the tree's commits and {why}: re-applying the series "
                f"from {self.pin.tag} (the old HEAD stays as {BACKUP_REF})")
            rebuild = True
        if rebuild:
            if not safe and not force:
                raise RefusedError(
                    f"{self.path}: `apply --rebuild` would replace the tree's patch commits, and the tree holds "
                    f"commits that were never exported to patches/{self.pin.version} (or its last apply/refresh "
                    f"is not recorded); run `refresh` first to keep them, or add --force to replace them anyway "
                    f"(the old HEAD is then kept as {BACKUP_REF})"
                )
            try:
                sim = self.simulate(self.base, patches, overlay)
            except PatchError as fresh:
                raise self._fresh(fresh) from None
            sim.start = start
            if dry_run:
                return sim
            if sim.changed:
                self.g.run("update-ref", "-m", "apply --rebuild", BACKUP_REF, start)
                self._switch(start, sim.commit)
            if fingerprint:
                self.write_sync(fingerprint, exported=True)
            return sim
        if mismatch is not None:
            try:  # a series that does not apply to a fresh baseline is named as such (patch and hunk)
                self.simulate(self.base, patches, overlay)
            except PatchError as fresh:
                raise self._fresh(fresh) from None
            raise RefusedError(self._mismatch_message(mismatch, commits, patches, state))
        try:
            sim = self.simulate(start, patches, overlay)
        except PatchError as e:
            raise self.diagnose(patches, overlay, e) from None
        if dry_run:
            return sim
        if sim.changed:
            self._switch(start, sim.commit)
        if fingerprint:
            # exported: every patch commit of the tree is a series entry (nothing only the tree holds)
            self.write_sync(fingerprint, exported=len(commits) <= len(patches))
        return sim

    def only_tool_commits(self, start: str) -> bool:
        """True when every commit after the baseline was written by this tool (its fixed committer
        identity and date): patch commits made from patch files and overlay commits, nothing of a user's."""
        out = self.g.out("log", "--format=%cn%x01%ct", f"{self.base}..{start}")
        return all(line == f"{AUTHOR_NAME}\x01{FIXED_EPOCH}" for line in out.splitlines())

    def first_mismatch(self, commits: list[str], patches: list[PatchFile]) -> int | None:
        """0-based index of the first tree patch commit whose export is not the series entry there."""
        for i, (sha, p) in enumerate(zip(commits, patches)):
            if self.export_commit(sha) != p.data:
                return i
        return None

    def _mismatch_message(self, i: int, commits: list[str], patches: list[PatchFile], state: str | None) -> str:
        v = self.pin.version
        what = (f"the tree's patch commit {i + 1} ({commits[i][:12]} '{self.subject(commits[i])}') is not "
                f"patches/{v}/{patches[i].name} (series entry {i + 1})")
        keep = (f"to keep patches/{v}: `tools/apply.py apply --rebuild` (re-applies the series from {self.pin.tag}; "
                f"the old HEAD is kept as {BACKUP_REF}); to keep the tree: `tools/apply.py refresh --force` "
                f"(overwrites patches/{v} with the tree's commits)")
        if state == "patches-newer" and not (self.read_sync() or {}).get("exported"):
            state = "both"  # the tree also held commits that were never exported
        if state == "patches-newer":
            why = f"patches/{v} was edited after this tree was last applied/refreshed, and the tree has not changed since"
            keep = (f"to keep patches/{v}: `tools/apply.py apply --rebuild` (the tree holds nothing patches/ lacked); "
                    f"to keep the tree: `tools/apply.py refresh --force`")
        elif state == "tree-newer":
            why = f"the tree's commits were changed after its last apply/refresh (patches/{v} was not)"
            keep = (f"to keep the tree: `tools/apply.py refresh` (exports the commits); to drop the tree's changes: "
                    f"`tools/apply.py apply --rebuild --force` (old HEAD kept as {BACKUP_REF})")
        elif state == "both":
            why = (f"patches/{v} was edited after the tree was last applied/refreshed, and the tree holds commits "
                   f"that patches/{v} does not have")
            keep = (f"nothing chooses for you: save one side first; `tools/apply.py refresh --force` keeps the tree "
                    f"(overwrites patches/{v}), `tools/apply.py apply --rebuild --force` keeps patches/{v} "
                    f"(old HEAD kept as {BACKUP_REF})")
        else:
            why = ("the tree and patches/ disagree (which side changed is not recorded, and the tree holds commits "
                   "this tool did not make)")
            keep = (f"to keep patches/{v}: `tools/apply.py apply --rebuild --force` (the old HEAD is kept as {BACKUP_REF}); "
                    f"to keep the tree: `tools/apply.py refresh --force` (overwrites patches/{v} with the tree's commits)")
        return f"{self.path}: {why}: {what}; nothing was touched.\n{keep}"

    def diagnose(self, patches: list[PatchFile], overlay: list[OverlayFile] | None, err: PatchError) -> ToolError:
        """A patch failed on this tree: name the patch and hunk as they fail on a fresh baseline."""
        try:
            self.simulate(self.base, patches, overlay)
        except PatchError as fresh:
            return self._fresh(fresh)
        return RefusedError(
            f"patches/{self.pin.version} applies to a fresh {self.pin.tag} tree but not on top of this tree's "
            f"commits ({err}); the tree holds commits that patches/ does not have.\n"
            f"to keep the tree: `tools/apply.py refresh`; to keep patches/{self.pin.version}: "
            f"`tools/apply.py apply --rebuild --force` (old HEAD kept as {BACKUP_REF})"
        )

    def _fresh(self, err: PatchError) -> PatchError:
        return PatchError(str(err).replace(f"does not apply to {self.path}:", f"does not apply to a fresh {self.pin.tag} tree:", 1))

    # ----------------------------------------------------------- sync record
    def read_sync(self) -> dict | None:
        p = self.g.git_dir / SYNC
        try:
            return json.loads(p.read_text())
        except FileNotFoundError:
            return None
        except (ValueError, OSError):
            return None  # unreadable: as if never recorded (only refines messages and refresh's guard)

    def write_sync(self, fingerprint: str, exported: bool) -> None:
        rec = {"version": self.pin.version, "head": self.g.rev("HEAD"), "patches": fingerprint, "exported": exported,
               "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        p = self.g.git_dir / SYNC
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        os.replace(tmp, p)

    def sync_state(self, fingerprint: str) -> str | None:
        """None (never recorded) | in-sync | patches-newer | tree-newer | both."""
        rec = self.read_sync()
        if rec is None:
            return None
        same_head = rec.get("head") == self.g.rev("HEAD")
        same_patches = rec.get("patches") == fingerprint
        return {(True, True): "in-sync", (True, False): "patches-newer",
                (False, True): "tree-newer", (False, False): "both"}[(same_head, same_patches)]

    # ---------------------------------------------------------- the switch
    def verify_tree(self, commit: str) -> list[str]:
        """What differs between the working tree (and index) and `commit`; [] when equal (ignored files aside)."""
        problems = []
        head = self.g.rev("HEAD")
        if head != commit:
            problems.append(f"HEAD is {head[:12] if head else '?'}, not {commit[:12]}")
        out = self.g.run("status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames", user_config=True).stdout
        for rec in out.decode("utf-8", "replace").split("\0"):
            if rec:
                problems.append(rec)
        return problems

    def _switch(self, start: str, target: str) -> None:
        """Check out `target` on branch overlay/<version>, guarded by the journal.

        The journal says what this step may change: HEAD/branch from (orig_branch, orig_head) to
        (branch, target), and the files in `paths` from their content at orig_head to that at
        target. Recovery (`recover`) undoes exactly that, and refuses when the tree holds anything else.
        """
        branch = self.g.current_branch()
        paths = self.changed_paths(start, target)
        journal = {
            "kind": "switch",
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "version": self.pin.version,
            "orig_head": start,
            "orig_branch": branch,
            "target": target,
            "branch": self.pin.branch,
            "branch_before": self.g.rev(f"refs/heads/{self.pin.branch}"),
            "created_branch": self.g.rev(f"refs/heads/{self.pin.branch}") is None,
            "paths": sorted(paths),
            "added": sorted(p for p, st in paths.items() if st == "A"),
        }
        tmp = self.journal.with_suffix(".tmp")
        tmp.write_text(json.dumps(journal, indent=1))
        os.replace(tmp, self.journal)
        try:
            _fault("before-checkout")
            self.g.run("checkout", "-q", "-B", self.pin.branch, target)
            if fault_active("checkout-partial"):
                self._leave_part_unwritten(start, paths)
            _fault("after-checkout")
            problems = self.verify_tree(target)
        except BaseException as e:
            msg = self.recover(force=True)
            if isinstance(e, KeyboardInterrupt):
                raise ToolError(f"interrupted; {msg}", INTERRUPTED) from None
            raise
        if problems:
            shown = "\n  ".join(problems[:20]) + (f"\n  ... ({len(problems) - 20} more)" if len(problems) > 20 else "")
            head = f"checking out {target[:12]} in {self.path} left the working tree different from that commit (git reported success):\n  {shown}\n"
            try:
                msg = self.recover(force=True)
            except ToolError as e:
                raise CheckoutError(head + f"restoring the earlier state failed too:\n{e}\n"
                                    f"fix what stops writing there (permissions, disk space), then run apply again "
                                    f"(it restores first); the journal {self.journal} is kept") from None
            raise CheckoutError(head + f"rolled back: {msg}; fix what stops writing there (permissions, disk space) and run apply again")
        self.journal.unlink()

    def _leave_part_unwritten(self, start: str, paths: dict[str, str]) -> None:
        """Fault point checkout-partial: put every other switched file back as it was at `start`."""
        for rel in sorted(paths)[::2]:
            p = self.path / rel
            if paths[rel] == "A":
                p.unlink(missing_ok=True)
            else:
                p.write_bytes(self.g.run("cat-file", "blob", f"{start}:{rel}").stdout)

    # ------------------------------------------------------------- recovery
    def read_journal(self) -> dict | None:
        try:
            text = self.journal.read_text()
        except FileNotFoundError:
            return self._port_record()
        try:
            j = json.loads(text)
            if not isinstance(j, dict) or j.get("kind", "switch") not in ("switch", "stopped-port"):
                raise ValueError("unknown kind")
            if j.get("kind", "switch") == "switch":
                for k in ("orig_head", "target", "branch"):
                    if not isinstance(j.get(k), str):
                        raise ValueError(f"no {k}")
        except ValueError as e:
            raise RefusedError(
                f"{self.journal} (the record of an unfinished tools/apply.py command) is unreadable ({e}); "
                f"what that command changed is unknown, so nothing was touched. Check the tree yourself "
                f"(git status, git log in {self.path}), then drop the record: tools/apply.py recover --forget"
            ) from None
        return j

    def _port_record(self) -> dict | None:
        """A port in progress (its state file; no journal): reported as a stopped port, which writing
        commands refuse and recovery leaves alone."""
        p = self.g.git_dir / PORT_STATE
        if not p.exists():
            return None
        try:
            st = json.loads(p.read_text())
            what = (f"port {st.get('from')} -> {st.get('to')}, "
                    + ({"conflict": "stopped at a conflict", "picking": "killed while starting a merge"}.get(
                        st.get("stage"), "interrupted") + ("" if st.get("current") is None or st.get("stage") not in ("conflict", "picking")
                                                           else f" in {st['sources'][st['current']]['name']}"))
                    + "; `tools/apply.py port --continue` / `--skip` / `--abort`")
            started = st.get("started")
        except (ValueError, OSError, KeyError, IndexError, TypeError, AttributeError):
            what, started = "port (its record is unreadable)", None
        return {"kind": "stopped-port", "what": what, "started": started, "port_state": str(p)}

    def recovery_problems(self, j: dict) -> list[str]:
        """Changes in the tree that the interrupted switch did not make (empty: recovery is safe)."""
        g = self.g
        problems = []
        orig, target, obranch, nbranch = j["orig_head"], j["target"], j.get("orig_branch"), j["branch"]
        head, branch = g.rev("HEAD"), g.current_branch()
        if (branch, head) not in ((obranch, orig), (nbranch, target)):
            problems.append(f"HEAD is {branch or 'detached'} at {head[:12] if head else '?'} (the apply left it at "
                            f"{obranch or 'detached'} {orig[:12]} or {nbranch} {target[:12]}): commits or a checkout since")
        nref = g.rev(f"refs/heads/{nbranch}")
        before = j.get("branch_before", None if j.get("created_branch") else orig)
        if nref not in (before, target):
            problems.append(f"branch {nbranch} is at {nref[:12] if nref else '(deleted)'}: moved since")
        if obranch and obranch != nbranch and g.rev(f"refs/heads/{obranch}") != orig:
            problems.append(f"branch {obranch} moved since (was {orig[:12]})")
        if g.run("cat-file", "-e", f"{target}^{{commit}}", check=False).returncode != 0:
            return problems + [f"the target commit {target[:12]} is gone"]
        if "paths" in j:
            ours = set(j["paths"])
        else:  # journals of earlier versions of the tool
            ours = set(self.changed_paths(orig, target))
        out = g.run("status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames", user_config=True).stdout
        dirty = [rec[3:] for rec in out.decode("utf-8", "surrogateescape").split("\0") if rec]
        foreign = [p for p in dirty if p not in ours]
        problems += [f"{p}: changed, not by the interrupted apply" for p in foreign]
        mine = [p for p in dirty if p in ours]
        if mine:
            lit = {"GIT_LITERAL_PATHSPECS": "1"}  # file names are not patterns

            def blobs(commit):
                res = {}
                for line in g.out("ls-tree", "-r", commit, "--", *mine, env=lit).splitlines():
                    meta, path = line.split("\t", 1)
                    res[path] = meta.split()[2]
                return res

            allowed_o, allowed_t = blobs(orig), blobs(target)
            idx = {}
            for line in g.out("ls-files", "-s", "--", *mine, env=lit).splitlines():
                meta, path = line.split("\t", 1)
                idx[path] = meta.split()[1]
            present = [p for p in mine if (self.path / p).is_file() and not (self.path / p).is_symlink()]
            wt = dict(zip(present, g.out("hash-object", "--no-filters", "--stdin-paths",
                                         input="".join(p + "\n" for p in present).encode()).split())) if present else {}
            for p in mine:
                ok = {allowed_o.get(p), allowed_t.get(p)}
                if (self.path / p).is_symlink():
                    problems.append(f"{p}: now a symbolic link")
                    continue
                if wt.get(p) not in ok:
                    problems.append(f"{p}: its content is neither the version before nor after the interrupted apply")
                elif idx.get(p) not in ok:
                    problems.append(f"{p}: staged content is neither the version before nor after the interrupted apply")
        return problems

    def recover(self, force: bool = False) -> str | None:
        """Undo a switch that was interrupted; refuses when the tree changed in other ways since.

        force: called by the command that wrote the journal itself (its own interrupted switch).
        """
        j = self.read_journal()
        if j is None:
            return None
        if j.get("kind") == "stopped-port":
            raise RefusedError(
                f"{self.path}: a port ({j.get('what', 'stopped at a conflict')}, started {j.get('started')}) is in "
                f"progress here; recovery leaves it alone. Finish or abort it first, or drop its record with "
                f"tools/apply.py recover --forget"
            )
        where = f"an apply started {j.get('started')} (pid {j.get('pid')})"
        if not force:
            problems = self.recovery_problems(j)
            if problems:
                shown = "\n  ".join(problems[:20]) + (f"\n  ... ({len(problems) - 20} more)" if len(problems) > 20 else "")
                raise RefusedError(
                    f"{self.path}: {where} was interrupted while switching "
                    f"{j.get('orig_branch') or 'detached HEAD'} at {j['orig_head'][:12]} to {j['branch']} at "
                    f"{j['target'][:12]}, and the tree changed since in ways that apply did not make:\n  {shown}\n"
                    f"nothing was touched (your changes are kept). Either undo those changes, or keep the tree as it "
                    f"is now (git status / git log there; once your changes are saved elsewhere, `git checkout -f "
                    f"{j['orig_head'][:12]}` there gives the state before the apply) and then drop the record: "
                    f"tools/apply.py recover --forget"
                )
        lock = self.g.git_dir / "index.lock"
        if lock.exists():
            pids = held_open(lock)
            if pids:
                raise RefusedError(f"{lock} is held by a running process (pid {', '.join(map(str, pids))}); "
                                   f"wait for it to finish, then run the command again")
            lock.unlink()  # left by a git that this tool ran and that died with it
        g = self.g
        orig, branch = j["orig_head"], j.get("orig_branch")
        if branch:
            g.run("update-ref", f"refs/heads/{branch}", orig)
            _fault("mid-restore")
            g.run("checkout", "-q", "-f", branch)
        else:
            g.run("checkout", "-q", "-f", "--detach", orig)
        if branch != j["branch"]:
            if j.get("created_branch"):
                if g.rev(f"refs/heads/{j['branch']}") in (j["target"], orig):
                    g.run("branch", "-q", "-D", j["branch"])
            elif j.get("branch_before") and g.rev(f"refs/heads/{j['branch']}") == j["target"]:
                g.run("update-ref", f"refs/heads/{j['branch']}", j["branch_before"])
        tracked = set(g.out("ls-files", "--", *j.get("added", [])).splitlines()) if j.get("added") else set()
        for rel in j.get("added", []):
            p = self.path / rel
            if rel not in tracked and p.is_file():
                p.unlink()
                _prune_empty_dirs(p.parent, self.path)
        left = self.verify_tree(orig)
        if left:
            raise CheckoutError(
                f"restoring {self.path} to {orig[:12]} left it different from that commit:\n  "
                + "\n  ".join(left[:20]) + f"\nthe journal {self.journal} is kept; fix what stops writing there and run the command again"
            )
        self.journal.unlink()
        return f"{where} was interrupted; restored {branch or 'detached HEAD'} at {orig[:12]}"

    def forget_journal(self) -> str | None:
        """`recover --forget`: drop the record of an unfinished command, leaving the tree as it is."""
        port = self.g.git_dir / PORT_STATE
        if not self.journal.exists():
            if port.exists():  # a port in progress: forgetting it leaves the tree as it is (mid-merge, maybe)
                port.unlink()
                return "a port in progress (its record; the tree and refs/glm5-port/* are left as they are)"
            return None
        try:
            j = json.loads(self.journal.read_text())
            what = f"{j.get('kind', 'switch')} started {j.get('started')} (pid {j.get('pid')})"
        except (ValueError, OSError, AttributeError):
            what = "an unreadable record"
        self.journal.unlink()
        return what

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


def lock_path(path: Path, managed: bool) -> Path:
    """The lock file of a tree: beside the tool's own tree (it must exist before the tree does),
    in the git directory of a --checkout."""
    if managed:
        return path.parent / f".{path.name}.lock"
    return Git(path).git_dir / LOCK

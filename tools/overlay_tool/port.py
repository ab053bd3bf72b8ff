"""`port --from OLD --to NEW`: carry patches/OLD/series onto vLLM NEW with three-way merges.

How it works:
- OLD's series is applied to a scratch OLD baseline (as `check` does), which gives one commit per
  patch whose parent is the exact OLD source the patch was written against. Those commits are
  fetched into NEW's tree (refs/glm5-port/*), so every patch's merge base is known.
- Each patch, in order, is tried on NEW's HEAD off to the side (temporary index, new commit objects):
  `git apply` as `apply` does it (clean, or offset: applied at shifted lines), else a three-way
  merge of its commit onto HEAD (`git merge-tree`, the merge a cherry-pick makes: merged), else
  it is a conflict. The commits that apply are checked out in one journaled switch (tree.py), with
  the patch's commit message and author unchanged.
- At a conflict the tree is left mid-cherry-pick of that patch for the user (conflict markers in the
  files); `port --continue` goes on once the user resolved it (staged, or committed), `--skip`
  drops that patch, `--abort` ends the port and keeps what was ported.
- The port's state lives in .git/glm5-overlay-port.json (PORT_STATE) from start to finish; every
  change of the tree is recorded there before it is made, so a killed run (SIGKILL) is resumed by
  `port --continue` (and a killed switch is rolled back first, as `recover` does). While the file
  exists, other writing commands refuse the tree (tree.Tree.read_journal reports a stopped port).
- When every patch is ported: `refresh` writes patches/NEW/ and `check` runs for NEW.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import PATCH, FetchError, PinError, RefusedError, ToolError, UsageError
from .gitutil import Git
from .patches import PatchFile, load_series
from .pins import Pin, load_lock
from .safety import owned_tempdir
from .safety import run as run_child
from .tree import PORT_STATE, Tree, _fault, create_baseline

SOURCE_REFS = "refs/glm5-port"  # OLD's series commits (and their OLD parents) fetched into NEW's tree
SAVED_REF = "refs/glm5-overlay/port-saved"  # the work tree of a conflict dropped by --skip/--abort


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------ new pin
def wheel_torch(wheel: Path) -> str | None:
    """The torch version the vLLM wheel pins (Requires-Dist: torch==X), or None."""
    import zipfile

    from packaging.requirements import InvalidRequirement, Requirement

    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise PinError(f"{wheel.name}: has {len(names)} METADATA files")
        text = zf.read(names[0]).decode("utf-8", "replace")
    for line in text.split("\n\n")[0].splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        try:
            req = Requirement(line.partition(":")[2].strip())
        except InvalidRequirement:
            continue
        if req.name.lower() == "torch" and (req.marker is None or "extra" not in str(req.marker)):
            specs = list(req.specifier)
            if len(specs) == 1 and specs[0].operator == "==":
                return specs[0].version
    return None


def torch_triton(torch_version: str, log=log) -> str:
    """torch==X's own triton requirement (Linux x86_64), read with pip from the torch wheel's metadata
    (`pip install --dry-run --report`: no install; pip reads only the metadata where the index serves it)."""
    from packaging.requirements import Requirement

    from .fetch import PIP_ARGS_ENV
    import shlex
    import sys

    with owned_tempdir("glm5-scratch-pip-") as td:
        report = Path(td) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
               "--report", str(report), "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
               "--python-version", "3.12", "--target", str(Path(td) / "target"), f"torch=={torch_version}",
               ] + shlex.split(os.environ.get(PIP_ARGS_ENV, ""))
        log(f"reading torch=={torch_version}'s triton requirement with pip ...")
        r = run_child(cmd, env=dict(os.environ, PIP_NO_INPUT="1"), capture_output=True)
        if r.returncode != 0 or not report.exists():
            raise FetchError(f"pip could not read torch=={torch_version}'s metadata (exit {r.returncode}): "
                             f"{r.stderr.decode('utf-8', 'replace').strip()[-500:]}\ncommand: {shlex.join(cmd)}\n"
                             f"pass --triton SPEC (torch's Requires-Dist for triton, e.g. '==3.6.0') instead")
        data = json.loads(report.read_text())
    env = {"platform_system": "Linux", "platform_machine": "x86_64", "sys_platform": "linux", "python_version": "3.12",
           "os_name": "posix", "platform_python_implementation": "CPython", "implementation_name": "cpython"}
    for item in data.get("install", []):
        for line in item.get("metadata", {}).get("requires_dist", []) or []:
            req = Requirement(line)
            if req.name.lower() == "triton" and (req.marker is None or req.marker.evaluate(dict(env, extra=""))):
                return str(req.specifier)
    raise PinError(f"torch=={torch_version} declares no triton requirement for Linux x86_64; pass --triton SPEC")


def pin_entry(pin: Pin) -> str:
    return (f'\n[pins."{pin.version}"]\nwheel = "{pin.wheel}"\nsha256 = "{pin.sha256}"\n'
            f'torch = "{pin.torch}"\ntriton = "{pin.triton}"\n')


def add_pin(lock_path: Path, pin: Pin) -> None:
    """Append the pin's table to pins.lock (comments and other entries kept byte for byte)."""
    text = lock_path.read_text()
    new = text + ("" if text.endswith("\n") else "\n") + pin_entry(pin)
    tmp = lock_path.with_name(lock_path.name + ".tmp")
    tmp.write_text(new)
    try:
        load_lock(tmp).get(pin.version)  # the result must parse, with the new pin in it
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, lock_path)


def new_pin(project, version: str, cache: Path, wheel_arg: str | None, torch_arg: str | None, triton_arg: str | None,
            log=log) -> tuple[Pin, Path]:
    """The Pin for an unpinned release: its wheel (--wheel, the cache or pip), sha256, torch, triton."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    from .fetch import download_unpinned
    from .project import sha256_file

    try:
        Version(version)
    except InvalidVersion:
        raise UsageError(f"--to {version!r} is not a version") from None
    if wheel_arg:
        src = Path(wheel_arg).expanduser().resolve()
        if not src.is_file():
            raise UsageError(f"--wheel {src} does not exist")
        if not (src.name.startswith(f"vllm-{version}-") and src.name.endswith(".whl")):
            raise UsageError(f"--wheel {src.name} is not a vllm-{version}-*.whl file")
        wheel = cache / src.name
        if wheel.exists() and sha256_file(wheel) != sha256_file(src):
            raise FetchError(f"{wheel} exists with other content than {src}; remove one of them")
        if not wheel.exists():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache / (src.name + ".tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, wheel)
            log(f"wheel: copied {src} into {cache}")
    else:
        wheel = download_unpinned(version, cache, log)
    torch = torch_arg or wheel_torch(wheel)
    if not torch:
        raise PinError(f"{wheel.name} pins no torch (no Requires-Dist: torch==X); pass --torch VERSION")
    if triton_arg:
        try:
            SpecifierSet(triton_arg)
        except InvalidSpecifier:
            raise UsageError(f"--triton {triton_arg!r} is not a version specifier (e.g. '==3.6.0')") from None
        triton = triton_arg
    else:
        triton = torch_triton(torch, log)
    pin = Pin(version, wheel.name, sha256_file(wheel), torch, triton)
    return pin, wheel


# ------------------------------------------------------------------- engine
@dataclass
class Outcome:
    name: str
    status: str  # clean | offset | merged | conflict | resolved | upstream | skipped
    commit: str | None = None  # the new HEAD after this patch (None: conflict)
    detail: list[str] = field(default_factory=list)


def _offsets(stderr: str) -> list[str]:
    from .tree import _offsets as tree_offsets

    return tree_offsets(stderr)


def prepare_sources(g: Git, old_pin: Pin, old_wheel: Path, patches: list[PatchFile], log=log) -> list[dict]:
    """Apply OLD's series to a scratch OLD baseline and fetch its commits into `g` (refs/glm5-port/*).
    Returns [{name, commit, parent}] for the patches that change OLD (those that reverse-apply are left out)."""
    from .ops import scratch_tree

    with scratch_tree(old_pin, old_wheel) as old:
        sim = old.simulate(old.base, patches, None)
        sources, parent = [], old.base
        for p, s in zip(patches, sim.patches):
            if s.commit is None:
                log(f"  {p.name}: already in vLLM {old_pin.version} (reverse-applies there): left out")
                continue
            sources.append({"name": p.name, "commit": s.commit, "parent": parent, "file": str(p.path),
                            "data": p.data.decode("utf-8", "surrogateescape")})
            parent = s.commit
        old.g.run("update-ref", f"{SOURCE_REFS}/{old_pin.version}/tip", parent)
        old.g.run("update-ref", f"{SOURCE_REFS}/{old_pin.version}/base", old.base)
        g.run("fetch", "-q", "--no-tags", str(old.path), f"+{SOURCE_REFS}/*:{SOURCE_REFS}/*")
    return sources


def _commit_like(g: Git, tree: str, parent: str, src: str) -> str:
    """A commit of `tree` on `parent` with `src`'s message and author (committer: the tool's fixed one)."""
    raw = g.run("cat-file", "commit", src).stdout
    head, _, message = raw.partition(b"\n\n")
    m = re.search(rb"^author (.*) <(.*)> (\d+ [+-]\d{4})$", head, re.M)
    env = {"GIT_AUTHOR_NAME": m.group(1).decode(), "GIT_AUTHOR_EMAIL": m.group(2).decode(),
           "GIT_AUTHOR_DATE": "@" + m.group(3).decode()} if m else {}
    return g.out("commit-tree", tree, "-p", parent, "-F", "-", input=message, env=env)


def _hunk_patches(data: bytes) -> dict[str, list[tuple[str, bytes]]]:
    """path -> [(hunk header, a patch of that hunk alone)] for a format-patch file."""
    text = data.decode("utf-8", "surrogateescape")
    body = text[text.find("\ndiff --git ") + 1:]
    out: dict[str, list[tuple[str, bytes]]] = {}
    for section in re.split(r"(?m)^(?=diff --git )", body):
        if not section.startswith("diff --git "):
            continue
        lines = section.split("\n")
        m = re.match(r"^diff --git a/(.+) b/(.+)$", lines[0])
        path = m.group(2) if m else lines[0]
        i = next((k for k, l in enumerate(lines) if l.startswith("@@ ")), len(lines))
        header, hunks, cur = lines[:i], [], None
        for l in lines[i:]:
            if l.startswith("@@ "):
                cur = [l]
                hunks.append(cur)
            elif cur is not None:
                cur.append(l)  # (refresh writes patches without a signature: nothing follows the last hunk)
        for h in hunks:
            while h and h[-1] == "":
                h.pop()
            out.setdefault(path, []).append((h[0].split(" @@")[0] + " @@", ("\n".join(header + h) + "\n").encode("utf-8", "surrogateescape")))
    return out


def failing_hunks(g: Git, head: str, patch: PatchFile, paths: list[str]) -> dict[str, list[str]]:
    """For each path: the patch's hunks that do not apply to `head` as they are (git apply, no fuzz)."""
    res: dict[str, list[str]] = {}
    with owned_tempdir("glm5-index-") as td:
        env = {"GIT_INDEX_FILE": str(Path(td) / "index")}
        g.run("read-tree", head, env=env)
        for path, hunks in _hunk_patches(patch.data).items():
            if path not in paths:
                continue
            for n, (hdr, data) in enumerate(hunks, 1):
                f = Path(td) / "hunk.patch"
                f.write_bytes(data)
                if g.run("apply", "--cached", "--check", str(f), env=env, check=False).returncode != 0:
                    res.setdefault(path, []).append(f"hunk #{n} ({hdr})")
    return res


def try_patch(g: Git, head: str, src: dict, patch_path: Path) -> Outcome:
    """Port one patch onto `head` off to the side (nothing checked out)."""
    name = src["name"]
    with owned_tempdir("glm5-index-") as td:
        env = {"GIT_INDEX_FILE": str(Path(td) / "index")}
        g.run("read-tree", head, env=env)
        r = g.run("apply", "--cached", "--check", "-v", str(patch_path), env=env, check=False)
        if r.returncode == 0:
            g.run("apply", "--cached", str(patch_path), env=env)
            tree = g.out("write-tree", env=env)
            offs = _offsets(r.stderr.decode("utf-8", "replace"))
            return Outcome(name, "offset" if offs else "clean", _commit_like(g, tree, head, src["commit"]), offs)
    # A three-way merge of the patch's commit onto head with the patch's OLD parent as the base: what
    # `git cherry-pick` does. (merge-tree of git < 2.40 has no --merge-base: `ours` is head's tree on
    # that parent, which makes the parent the merge base.)
    ours = g.out("commit-tree", g.out("rev-parse", f"{head}^{{tree}}"), "-p", src["parent"], "-m", "port: ours")
    r = g.run("merge-tree", "--write-tree", "--name-only", ours, src["commit"], check=False)
    out = r.stdout.decode("utf-8", "replace")
    first, _, rest = out.partition("\n")
    if r.returncode == 0:
        if first.strip() == g.out("rev-parse", f"{head}^{{tree}}"):
            return Outcome(name, "upstream", head, ["the merge changes nothing: vLLM already has this change (dropped)"])
        return Outcome(name, "merged", _commit_like(g, first.strip(), head, src["commit"]))
    if r.returncode != 1:
        raise ToolError(f"git merge-tree failed for {name}: {r.stderr.decode('utf-8', 'replace').strip()}")
    files_part, _, msgs = rest.partition("\n\n")
    files = sorted(set(l for l in files_part.splitlines() if l.strip()))
    detail = [l for l in msgs.splitlines() if l.startswith("CONFLICT")]
    return Outcome(name, "conflict", None, detail + [f"file: {f}" for f in files])


def describe_conflict(g: Git, head: str, patch: PatchFile, o: Outcome, worktree: Path | None) -> list[str]:
    files = [d[len("file: "):] for d in o.detail if d.startswith("file: ")]
    hunks = failing_hunks(g, head, patch, files)
    lines = [d for d in o.detail if not d.startswith("file: ")]
    for f in files:
        where = ""
        if worktree is not None and (worktree / f).is_file():
            regions, start = [], None
            for n, l in enumerate((worktree / f).read_text(errors="replace").splitlines(), 1):
                if l.startswith("<<<<<<< "):
                    start = n
                elif l.startswith(">>>>>>> ") and start is not None:
                    regions.append(f"{start}-{n}")
                    start = None
            if regions:
                where = f"; conflict markers at lines {', '.join(regions)}"
        h = ", ".join(hunks.get(f, [])) or "(each hunk applies alone; together they conflict)"
        lines.append(f"{f}: not applying as is: {h}{where}")
    return lines


# ------------------------------------------------------------------ the port
class Port:
    """A port into NEW's tree, with its state file (.git/glm5-overlay-port.json)."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self.g = tree.g
        self.path = tree.g.git_dir / PORT_STATE
        self.state: dict = {}

    def load(self) -> bool:
        try:
            self.state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return False
        except ValueError as e:
            raise RefusedError(f"{self.path} (the record of a port in progress) is unreadable ({e}); nothing was "
                               f"touched; check the tree yourself, then `port --abort` or remove that file") from None
        return True

    def save(self, **kw) -> None:
        self.state.update(kw)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        os.replace(tmp, self.path)

    # ----------------------------------------------------------------- info
    @property
    def done(self) -> list[dict]:
        return self.state.setdefault("done", [])

    def last_head(self) -> str:
        return self.done[-1]["head"] if self.done else self.tree.base

    def patch(self, i: int) -> PatchFile:
        from .patches import parse_patch_bytes

        src = self.state["sources"][i]
        data = self.state["sources"][i].get("data")
        p = Path(src["file"])
        return parse_patch_bytes(src["name"], p, data.encode("utf-8", "surrogateescape") if data else p.read_bytes())

    # ---------------------------------------------------------------- steps
    def run_from(self, i: int, log=log) -> bool:
        """Port sources[i:]; True when all are ported, False when stopped at a conflict."""
        srcs = self.state["sources"]
        n = len(srcs)
        head = self.last_head()
        pending: list[dict] = []
        conflict = None
        for k in range(i, n):
            src = srcs[k]
            with owned_tempdir("glm5-msg-") as td:  # the patch as recorded at the start (patches/OLD may change since)
                pf = Path(td) / "p.patch"
                pf.write_bytes(self.patch(k).data)
                o = try_patch(self.g, head, src, pf)
            if o.status == "conflict":
                conflict = (k, o)
                break
            log(f"  [{k + 1}/{n}] {src['name']}: {o.status}" + "".join(f"\n      {d}" for d in o.detail))
            head = o.commit
            pending.append({"name": src["name"], "status": o.status, "head": head, "detail": o.detail})
            _fault(f"port-after-patch-{k + 1}")
        if pending and head == self.last_head():  # nothing to check out (patches vLLM already has)
            self.done.extend(pending)
            self.save(stage="running", pending=[])
        elif pending:
            self.save(stage="switching", pending=pending)
            self.tree._switch(self.last_head(), head)
            _fault("port-switched")
            self.done.extend(pending)
            self.save(stage="running", pending=[])
        if conflict is None:
            return True
        k, o = conflict
        if self.stop_at(k, o, log):
            return False
        return self.run_from(k + 1, log)

    def stop_at(self, k: int, o: Outcome, log=log) -> bool:
        """Leave the tree mid-cherry-pick of source k (conflict markers in the files); True when it stopped."""
        src = self.state["sources"][k]
        self.save(stage="picking", current=k)
        _fault("port-picking")
        r = self.g.run("cherry-pick", "--no-rerere-autoupdate", src["commit"], check=False)
        if r.returncode == 0:  # merge-tree said conflict and cherry-pick did not: take the commit
            self.done.append({"name": src["name"], "status": "merged", "head": self.g.rev("HEAD"), "detail": []})
            self.save(stage="running")
            log(f"  [{k + 1}/{len(self.state['sources'])}] {src['name']}: merged")
            return False
        if not (self.g.git_dir / "CHERRY_PICK_HEAD").exists():
            raise ToolError(f"git cherry-pick of {src['name']} failed without stopping at a conflict:\n"
                            + r.stderr.decode("utf-8", "replace").strip())
        lines = describe_conflict(self.g, self.last_head(), self.patch(k), o, self.tree.path)
        self.save(stage="conflict", current=k, conflict=lines)
        n = len(self.state["sources"])
        log(f"  [{k + 1}/{n}] {src['name']}: CONFLICT")
        for l in lines:
            log(f"      {l}")
        return True

    def resume(self, skip: bool = False, log=log) -> int | None:
        """What --continue/--skip do first: settle the state the last run left; returns the next index
        to port, or None when it stopped at a conflict again."""
        st = self.state.get("stage")
        g = self.g
        head = g.rev("HEAD")
        if st == "switching":
            pend = self.state.get("pending") or []
            if pend and head == pend[-1]["head"]:
                self.done.extend(pend)  # the switch completed, its record did not
            self.save(stage="running", pending=[])
            st = "running"
        if st == "picking":  # killed during the cherry-pick that leaves a conflict: redo it
            k = self.state["current"]
            src = self.state["sources"][k]
            ours = set(self.tree.changed_paths(src["parent"], src["commit"]))
            dirty = self._dirty_paths()
            foreign = [p for p in dirty if p not in ours]
            if head != self.last_head() or foreign:
                raise RefusedError(f"{self.tree.path}: a port was killed while starting the merge of {src['name']}, and "
                                   f"the tree changed since ({', '.join(foreign[:5]) or 'HEAD moved'}); nothing was "
                                   f"touched; put it back to {self.last_head()[:12]} or `port --abort`")
            self._reset_to_head()
            if skip:
                return self._skip(k, log)
            o = try_patch(g, head, src, self._patch_file(k))
            if o.status != "conflict" or not self.stop_at(k, o, log):
                if o.status != "conflict":  # cannot happen unless git changed: port it the normal way
                    return k
                return k + 1
            return None
        if st == "conflict":
            k = self.state["current"]
            if skip:
                return self._skip(k, log)
            self._take_resolution(k, log)
            return k + 1
        if head != self.last_head():
            raise RefusedError(f"{self.tree.path}: HEAD is {head[:12] if head else '?'}, not the last ported patch's "
                               f"commit {self.last_head()[:12]}; the tree changed since the port stopped. Nothing was "
                               f"touched; put HEAD back, or `port --abort`")
        if skip:
            raise RefusedError("no patch is stopped at a conflict: nothing to skip")
        self.tree.require_clean("continue the port")
        return len(self.done)

    def _patch_file(self, k: int) -> Path:
        d = self.g.git_dir / "glm5-port-patch.tmp"
        d.write_bytes(self.patch(k).data)
        return d

    def _dirty_paths(self) -> list[str]:
        out = self.g.run("status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames").stdout
        return [rec[3:] for rec in out.decode("utf-8", "surrogateescape").split("\0") if rec]

    def _reset_to_head(self) -> None:
        g = self.g
        if (g.git_dir / "CHERRY_PICK_HEAD").exists():
            g.run("cherry-pick", "--abort", check=False)
        g.run("read-tree", "-u", "--reset", "HEAD")
        for f in ("CHERRY_PICK_HEAD", "MERGE_MSG"):
            (g.git_dir / f).unlink(missing_ok=True)

    def save_work(self) -> str | None:
        """Keep the work tree of a stopped merge (the user's half-done resolution) as a commit at SAVED_REF."""
        g = self.g
        if not g.status_lines():
            return None
        with owned_tempdir("glm5-index-") as td:
            env = {"GIT_INDEX_FILE": str(Path(td) / "index")}
            g.run("read-tree", "HEAD", env=env)
            g.run("add", "-A", env=env)
            tree = g.out("write-tree", env=env)
        c = g.out("commit-tree", tree, "-p", g.rev("HEAD"), "-m", "work tree of a stopped port, saved by --skip/--abort")
        g.run("update-ref", SAVED_REF, c)
        return c

    def _skip(self, k: int, log=log) -> int:
        src = self.state["sources"][k]
        if self.g.rev("HEAD") != self.last_head():
            raise RefusedError(f"{src['name']} was already committed (HEAD moved past {self.last_head()[:12]}); "
                               f"use `port --continue` to keep that commit")
        saved = self.save_work()
        self._reset_to_head()
        self.done.append({"name": src["name"], "status": "skipped", "head": self.last_head(),
                          "detail": [f"your work tree was saved as {SAVED_REF} ({saved[:12]})"] if saved else []})
        self.save(stage="running", conflict=[])
        log(f"  {src['name']}: skipped (not ported)" + (f"; the work tree was saved as {SAVED_REF}" if saved else ""))
        return k + 1

    def _take_resolution(self, k: int, log=log) -> None:
        g = self.g
        src = self.state["sources"][k]
        last = self.last_head()
        head = g.rev("HEAD")
        unmerged = sorted(set(l.split("\t", 1)[1] for l in g.out("ls-files", "-u").splitlines() if "\t" in l))
        hint = f"resolve them, `git add` them (and commit, or let `port --continue` commit with {src['name']}'s message)"
        if unmerged:
            raise RefusedError(f"{src['name']} still has unresolved files in {self.tree.path}: {', '.join(unmerged)}; "
                               f"{hint}; or `port --skip` (drop this patch) / `port --abort`")
        cp = (g.git_dir / "CHERRY_PICK_HEAD").exists()
        if head == last:
            unstaged = g.out("diff", "--name-only").splitlines()
            if unstaged:
                raise RefusedError(f"{src['name']}: unstaged changes in {', '.join(unstaged[:10])}: `git add` them "
                                   f"(the staged state is what gets committed), then `port --continue`")
            if not g.out("diff", "--cached", "--name-only"):
                raise RefusedError(f"{src['name']}: nothing is staged and nothing was committed (was the cherry-pick "
                                   f"aborted?); resolve and stage it, or `port --skip` to drop this patch")
            g.run("commit", "--no-verify", "-q", "-C", src["commit"], "--cleanup=verbatim")
            for f in ("CHERRY_PICK_HEAD", "MERGE_MSG"):
                (g.git_dir / f).unlink(missing_ok=True)
            head = g.rev("HEAD")
            note = []
        else:
            if cp:
                raise RefusedError(f"{self.tree.path}: HEAD moved while a cherry-pick of {src['name']} is still in "
                                   f"progress; finish it (`git cherry-pick --continue`) first")
            if g.run("merge-base", "--is-ancestor", last, head, check=False).returncode != 0:
                raise RefusedError(f"{self.tree.path}: HEAD {head[:12]} does not descend from the last ported "
                                   f"commit {last[:12]}; nothing was touched")
            if g.out("rev-list", "--merges", f"{last}..{head}"):
                raise RefusedError(f"{self.tree.path}: merges after {last[:12]}; patches must be a linear history")
            self.tree.require_clean(f"take the commits after {last[:12]} as {src['name']}")
            note = []
            new = g.out("rev-list", "--reverse", f"{last}..{head}").split()
            want = g.run("cat-file", "commit", src["commit"]).stdout.partition(b"\n\n")[2]
            if len(new) != 1 or g.run("cat-file", "commit", new[0]).stdout.partition(b"\n\n")[2] != want:
                note = [f"taken as you committed it: {len(new)} commit(s), message(s) not {src['name']}'s exactly"]
        self.done.append({"name": src["name"], "status": "resolved", "head": head, "detail": note})
        self.save(stage="running", conflict=[])
        log(f"  {src['name']}: conflict resolved by you ({head[:12]})" + "".join(f"\n      {d}" for d in note))


def summary(port: Port, log=log) -> dict[str, int]:
    counts: dict[str, int] = {}
    n = len(port.state["sources"])
    for i, d in enumerate(port.done, 1):
        counts[d["status"]] = counts.get(d["status"], 0) + 1
    log(f"port {port.state['from']} -> {port.state['to']}: {len(port.done)}/{n} patch(es) done: "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    for d in port.done:
        log(f"  {d['name']}: {d['status']}")
    return counts


STATUS_HELP = ("clean: applied as is; offset: applied at shifted lines (git apply, no fuzz); merged: a three-way "
               "merge with its OLD base was needed, no conflict; conflict: stopped for you; upstream: vLLM already "
               "has it (dropped); skipped: dropped by --skip")


def dry_run(project, old_pin: Pin, old_wheel: Path, new_pin_: Pin, new_wheel: Path, patches: list[PatchFile], log=log) -> list[Outcome]:
    """Classify every patch in a temporary NEW baseline (removed afterwards); a conflicting patch is
    left out of the later ones' base, as `--skip` would."""
    outcomes = []
    with owned_tempdir(f"glm5-scratch-{new_pin_.version}-") as td:
        g = create_baseline(td / "tree", new_pin_, new_wheel, checkout=False, binaries=False)
        sources = prepare_sources(g, old_pin, old_wheel, patches, log)
        head = g.rev(f"refs/tags/{new_pin_.tag}")
        n = len(sources)
        for k, src in enumerate(sources):
            o = try_patch(g, head, src, Path(src["file"]))
            if o.status == "conflict":
                o.detail = describe_conflict(g, head, load_patch(src), o, None)
                log(f"  [{k + 1}/{n}] {src['name']}: conflict" + ("" if any(x.status == "conflict" for x in outcomes) else
                    " (a real port stops here; later patches are classified without it)"))
            else:
                log(f"  [{k + 1}/{n}] {src['name']}: {o.status}")
                head = o.commit
            for d in o.detail:
                log(f"      {d}")
            outcomes.append(o)
    return outcomes


def load_patch(src: dict) -> PatchFile:
    from .patches import parse_patch_file

    p = parse_patch_file(Path(src["file"]))
    p.name = src["name"]
    return p


# ---------------------------------------------------------------- the verb
def _has_patches(pdir: Path) -> bool:
    from .patches import read_series

    if not pdir.is_dir():
        return False
    try:
        return bool(any(pdir.glob("*.patch")) or read_series(pdir))
    except UsageError:
        return True


def _drop_refs(g: Git) -> None:
    for ref in g.out("for-each-ref", "--format=%(refname)", SOURCE_REFS).splitlines():
        g.run("update-ref", "-d", ref)
    (g.git_dir / "glm5-port-patch.tmp").unlink(missing_ok=True)


def _find_ported_tree(ctx) -> str:
    found = sorted(p.parent.parent.parent.name for p in (ctx.project.root / "work").glob(f"*/tree/.git/{PORT_STATE}"))
    if len(found) != 1:
        raise UsageError("name the release being ported to with --to VERSION ("
                         + (f"ports in progress: {', '.join(found)}" if found else "no port in progress under work/") + ")")
    return found[0]


def cmd_port(ctx) -> int:
    from .safety import TreeLock
    from .tree import lock_path

    ns = ctx.ns
    mode = "continue" if ns.port_continue else "skip" if ns.port_skip else "abort" if ns.port_abort else "start"
    if mode != "start":
        if ns.port_from or ns.wheel or ns.torch or ns.triton or ctx.dry_run:
            raise UsageError(f"--{mode} takes only --to (and --work/--wait): the rest was given when the port started")
        version = ns.port_to or _find_ported_tree(ctx)
        pin = ctx.project.pin(version)
        path = Path(ctx.work).expanduser().resolve() if ctx.work else ctx.project.default_tree(pin)
        if not path.exists():
            raise UsageError(f"{path} does not exist: no port into {version} to {mode}")
        with TreeLock(lock_path(path, True), str(path), ctx.wait, log):
            return _resume(ctx, pin, path, mode)
    if not ns.port_from or not ns.port_to:
        raise UsageError("port needs --from OLD and --to NEW (or --continue / --skip / --abort)")
    if ns.port_from == ns.port_to:
        raise UsageError("--from and --to name the same release")
    project = ctx.project
    from .fetch import fetch

    old_pin = project.pin(ns.port_from)
    patches = load_series(project.patches_dir(old_pin))
    new_v = ns.port_to
    pinned = new_v in project.lock.pins
    path = Path(ctx.work).expanduser().resolve() if ctx.work else project.root / "work" / new_v / "tree"
    pdir = project.root / "patches" / new_v
    if not ctx.dry_run:
        if _has_patches(pdir):
            raise RefusedError(f"patches/{new_v} already holds a series; port would overwrite it. Nothing was "
                               f"touched; move it away first (or port into another --work tree and compare)")
        if path.exists() and not pinned:
            raise RefusedError(f"{path} exists but vLLM {new_v} is not in pins.lock: it is not a tree this tool made "
                               f"for {new_v}; nothing was touched; move it away first")
        if path.exists() and (path / ".git" / PORT_STATE).exists():
            raise RefusedError(f"a port into {path} is in progress: `port --continue`, `--skip` or `--abort`")
    old_wheel = fetch(old_pin, ctx.cache, False, log)
    if pinned:
        if ns.wheel or ns.torch or ns.triton:
            raise UsageError(f"vLLM {new_v} is already in pins.lock: --wheel/--torch/--triton are for a new release")
        new = project.pin(new_v)
        new_wheel = fetch(new, ctx.cache, False, log)
    else:
        new, new_wheel = new_pin(project, new_v, ctx.cache, ns.wheel, ns.torch, ns.triton, log)
        log(f"vLLM {new_v}: {new.wheel}, sha256 {new.sha256}, torch {new.torch}, triton {new.triton}")
    if ctx.dry_run:
        log(f"dry run: classifying the {len(patches)} patch(es) of patches/{old_pin.version} on a temporary "
            f"{new.tag} tree (nothing else is written" + ("" if pinned else "; pins.lock would get the entry above") + ")")
        outs = dry_run(project, old_pin, old_wheel, new, new_wheel, patches, log)
        counts: dict[str, int] = {}
        for o in outs:
            counts[o.status] = counts.get(o.status, 0) + 1
        log(f"port {old_pin.version} -> {new_v} (dry run): " + (", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no patches"))
        log(f"  ({STATUS_HELP})")
        return 0
    if not pinned:
        add_pin(project.lock_path or project.root / "pins.lock", new)
        project._lock = None
        log(f"pins.lock: added [pins.\"{new_v}\"]")
    with TreeLock(lock_path(path, True), str(path), ctx.wait, log):
        return _start(ctx, old_pin, old_wheel, patches, new, new_wheel, path)


def _start(ctx, old_pin: Pin, old_wheel: Path, patches, new: Pin, new_wheel: Path, path: Path) -> int:
    created = False
    if path.exists():
        tree = Tree.open(path, new, True)
        if (tree.g.git_dir / PORT_STATE).exists():
            raise RefusedError(f"a port into {path} is in progress: `port --continue`, `--skip` or `--abort`")
        j = tree.read_journal()
        if j is not None:
            raise RefusedError(f"{path} holds the record of an interrupted command ({j.get('kind')}); run "
                               f"`tools/apply.py --vllm {new.version} recover` first")
        tree.require_clean("port into it")
        if tree.g.rev("HEAD") != tree.base or tree.g.current_branch() != new.branch:
            raise RefusedError(f"{path} already has commits or another branch checked out (HEAD "
                               f"{tree.g.current_branch() or 'detached'} at {tree.g.rev('HEAD')[:12]}, not {new.branch} "
                               f"at {new.tag}); port never overwrites a tree: move it away (or port into --work DIR)")
        log(f"porting into {path} (at {new.tag}, nothing on it yet)")
    else:
        log(f"creating {path} from {new_wheel.name}")
        create_baseline(path, new, new_wheel, checkout=True)
        created = True
        tree = Tree.open(path, new, True)
    port = Port(tree)
    try:
        port.save(kind="port", **{"from": old_pin.version, "to": new.version}, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  pid=os.getpid(), stage="preparing", sources=[], done=[], pending=[])
        log(f"applying patches/{old_pin.version} ({len(patches)} patch(es)) to a scratch {old_pin.tag} tree for the merge bases ...")
        sources = prepare_sources(tree.g, old_pin, old_wheel, patches, log)
        port.save(sources=sources, stage="running")
    except BaseException:
        if created:
            shutil.rmtree(path, ignore_errors=True)  # nothing of the port is in it yet
        else:
            _drop_refs(tree.g)
            port.path.unlink(missing_ok=True)
        raise
    log(f"porting {len(sources)} patch(es) onto {new.tag}:")
    return _drive(ctx, port, 0)


def _drive(ctx, port: Port, i: int | None) -> int:
    from .errors import INTERRUPTED

    try:
        finished = port.run_from(i, log) if i is not None else False
    except KeyboardInterrupt:
        raise ToolError(f"interrupted; {port.tree.path} holds the patches ported so far; "
                        f"`tools/apply.py port --continue` goes on, `--abort` ends the port", INTERRUPTED) from None
    if not finished:
        k = port.state["current"]
        name = port.state["sources"][k]["name"]
        summary(port, log)
        log(f"stopped at a conflict in {name}: {port.tree.path} is mid-merge (git status shows the files). Resolve "
            f"the conflict markers, `git add` the files (and `git commit` if you like: the message is the patch "
            f"header), then `tools/apply.py port --continue`; `--skip` drops this patch, `--abort` ends the port")
        return PATCH
    return _finish(ctx, port)


def _finish(ctx, port: Port) -> int:
    from .errors import CHECK, REFUSED
    from .fetch import fetch
    from .ops import check, refresh

    tree = port.tree
    summary(port, log)
    log(f"  ({STATUS_HELP})")
    _drop_refs(tree.g)
    port.path.unlink()
    v = tree.pin.version
    pdir = ctx.project.patches_dir(tree.pin)
    if _has_patches(pdir):
        log(f"patches/{v} appeared while the port ran; it was not overwritten: compare, then "
            f"`tools/apply.py --vllm {v} refresh --force` to write the ported series")
        return REFUSED
    log(f"refresh {v}:")
    refresh(tree, ctx.project, False, log, force=True)  # patches/NEW holds no series (checked above)
    log(f"check {v}:")
    problems = check(ctx.project, tree.pin, fetch(tree.pin, ctx.cache, False, log), log)
    if problems:
        log(f"check {v}: FAILED")
        for p in problems:
            log("  " + p.replace("\n", "\n  "))
        return CHECK
    log(f"check {v}: OK; next: `tools/apply.py --vllm {v}` (adds the overlay, builds, installs, verifies)")
    return 0


def _resume(ctx, pin: Pin, path: Path, mode: str) -> int:
    tree = Tree.open(path, pin, True)
    port = Port(tree)
    if not port.load():
        raise RefusedError(f"no port in progress in {path} (nothing to {mode})")
    if tree.journal.exists():  # a switch of the port was killed: undo it as `recover` does
        msg = tree.recover()
        if msg:
            log(f"recovered: {msg}")
    if port.state.get("stage") == "preparing":
        if mode == "abort":
            _drop_refs(tree.g)
            port.path.unlink()
            log(f"port aborted before any patch was ported; {path} is at {pin.tag}")
            return 0
        old_pin = ctx.project.pin(port.state["from"])
        from .fetch import fetch

        patches = load_series(ctx.project.patches_dir(old_pin))
        port.save(sources=prepare_sources(tree.g, old_pin, fetch(old_pin, ctx.cache, False, log), patches, log),
                  stage="running", done=[], pending=[])
    if mode == "abort":
        return _abort(port)
    try:
        i = port.resume(skip=(mode == "skip"), log=log)
    except KeyboardInterrupt:
        from .errors import INTERRUPTED

        raise ToolError("interrupted; `tools/apply.py port --continue` goes on", INTERRUPTED) from None
    return _drive(ctx, port, i)


def _abort(port: Port) -> int:
    g, tree = port.g, port.tree
    st = port.state.get("stage")
    head = g.rev("HEAD")
    if st == "switching":
        pend = port.state.get("pending") or []
        if pend and head == pend[-1]["head"]:
            port.done.extend(pend)
    saved = None
    if st in ("conflict", "picking") or (g.git_dir / "CHERRY_PICK_HEAD").exists():
        saved = port.save_work()
        port._reset_to_head()
    _drop_refs(g)
    port.path.unlink()
    names = [d["name"] for d in port.done if d["status"] not in ("skipped", "upstream")]
    log(f"port {port.state.get('from')} -> {port.state.get('to')} aborted: {tree.path} is on "
        f"{g.current_branch() or 'detached HEAD'} at {g.rev('HEAD')[:12]}: {tree.pin.tag} + {len(names)} ported patch(es)"
        + (": " + ", ".join(names) if names else ""))
    if saved:
        log(f"  the work tree of the stopped merge was saved as {SAVED_REF} ({saved[:12]}; `git show {SAVED_REF}`)")
    log(f"  patches/{tree.pin.version} was not written (`refresh --allow-fewer` exports the ported commits); "
        f"to port again from scratch, move {tree.path} away")
    return 0

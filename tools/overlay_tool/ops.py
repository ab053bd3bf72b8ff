"""refresh, check, status and export-pr."""
from __future__ import annotations

import difflib
import re
import shutil
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

from .errors import CheckError, PatchError, RefusedError, UsageError
from .patches import (
    TITLE_RE,
    FIXED_DATE,
    format_series,
    load_series,
    parse_message,
    parse_patch_bytes,
    patch_file_name,
    patches_fingerprint,
    read_series,
    require_valid,
    validate_header,
    validate_series,
)
from .pins import Pin
from .project import OverlayFile, Project
from .safety import owned_tempdir
from .safety import run as run_child
from .tree import FORMAT_PATCH_OPTS, Tree, create_baseline


@contextmanager
def scratch_tree(pin: Pin, wheel: Path):
    """A throw-away baseline repository (no work tree) for check and export-pr."""
    with owned_tempdir(f"glm5-scratch-{pin.version}-") as td:
        create_baseline(td / "tree", pin, wheel, checkout=False, binaries=False)
        yield Tree.open(td / "tree", pin, managed=True)


# ---------------------------------------------------------------------- refresh
def export_tree(tree: Tree, project: Project) -> list[tuple[str, bytes]]:
    """Export the tree's patch commits as (file name, bytes); refuses commits that are not patches."""
    overlay_dests = {f.dest for f in project.overlay_files()} | tree.placed_files("HEAD")
    problems, out = [], []
    for i, c in enumerate(tree.patch_commits(), 1):
        touched = tree.g.out("diff-tree", "--no-commit-id", "--name-only", "-r", "--no-renames", c).splitlines()
        subject = tree.subject(c)
        where = f"commit {c[:12]} ({subject})"
        if not touched:
            problems.append(f"{where}: changes nothing; drop it (git rebase -i in {tree.path})")
            continue
        bad = [t for t in touched if t in overlay_dests]
        if bad:
            problems.append(f"{where}: edits overlay-placed file(s) {', '.join(bad)}: edit them in overlay/ or kernels/ instead")
        data = tree.export_commit(c)
        pf = parse_patch_bytes("(export)", tree.path, data)
        problems += validate_header(pf.header, where)
        out.append((patch_file_name(i, pf.header.subject), data))
    if problems:
        raise CheckError("cannot export the tree's commits as patches:\n  " + "\n  ".join(problems))
    return out


def refresh(tree: Tree, project: Project, dry_run: bool, log=print, force: bool = False, allow_fewer: bool = False) -> bool:
    """Write the tree's patch commits to patches/<version>/ (series + files). Returns True if anything changed.

    Refuses (exit 5) a tree with an unfinished command's journal, a tree behind patches/ (patches/
    edited since the tree was last applied/refreshed) unless force, and an export with fewer
    patches than the series holds unless allow_fewer.
    """
    v = tree.pin.version
    j = tree.read_journal()
    if j is not None and j.get("kind") == "stopped-port":
        raise RefusedError(
            f"{tree.path} is in the middle of an interrupted command ({j.get('what', 'a port')}, started "
            f"{j.get('started')}); refresh would export a half-ported tree. Nothing was written"
        )
    if j is not None:
        raise RefusedError(
            f"{tree.path} is in the middle of an interrupted command ({j.get('kind', 'switch')} started {j.get('started')}); "
            f"refresh would export a half-switched tree. Run `tools/apply.py recover` (or apply, which recovers first), "
            f"then refresh"
        )
    tree.require_clean("refresh")
    pdir = project.patches_dir(tree.pin)
    fp = patches_fingerprint(pdir)
    state = tree.sync_state(fp)
    if state in ("patches-newer", "both") and not force:
        raise RefusedError(
            f"patches/{v} was edited after {tree.path} was last applied/refreshed"
            + (" (and the tree's commits changed too)" if state == "both" else "")
            + f"; refresh would overwrite those edits with the tree's commits. Nothing was written.\n"
            f"to keep patches/{v}: `tools/apply.py apply --rebuild` (re-applies it to the tree); "
            f"to keep the tree: `tools/apply.py refresh --force`"
        )
    exported = export_tree(tree, project)
    old_names = read_series(pdir) if (pdir / "series").exists() else []
    new_names = [n for n, _ in exported]
    if len(new_names) < len(old_names) and not allow_fewer:
        raise RefusedError(
            f"refresh would export {len(new_names)} patch(es) from {tree.path}, but patches/{v}/series holds "
            f"{len(old_names)}; the tree lacks commits for the series (is it at {tree.pin.tag} or an old branch?). "
            f"Nothing was written. Run `tools/apply.py apply` to bring the tree up to patches/{v}, or pass "
            f"--allow-fewer if dropping patches is what you want"
        )
    changed = False
    for name, data in exported:
        path = pdir / name
        old = path.read_bytes() if path.exists() else None
        if old != data:
            changed = True
            log(f"{'would write' if dry_run else 'wrote'} patches/{tree.pin.version}/{name}" + (" (new)" if old is None else " (changed)"))
            if dry_run and old is not None:
                log(_diff(old, data, name))
            if not dry_run:
                pdir.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    for stale in sorted(set(p.name for p in pdir.glob("*.patch")) - set(new_names)) if pdir.is_dir() else []:
        changed = True
        log(f"{'would remove' if dry_run else 'removed'} patches/{tree.pin.version}/{stale} (no longer a commit in the tree)")
        if not dry_run:
            (pdir / stale).unlink()
    series = format_series(new_names)
    sp = pdir / "series"
    if not sp.exists() or sp.read_text() != series:
        changed = True
        log(f"{'would write' if dry_run else 'wrote'} patches/{tree.pin.version}/series ({len(new_names)} patches)")
        if not dry_run:
            pdir.mkdir(parents=True, exist_ok=True)
            sp.write_text(series)
    if not changed:
        log(f"patches/{tree.pin.version} is up to date with {tree.path} ({len(new_names)} patches)")
    elif old_names != new_names:
        log(f"series: {old_names} -> {new_names}")
    if not dry_run:
        tree.write_sync(patches_fingerprint(pdir), exported=True)
    return changed


def _diff(a: bytes, b: bytes, name: str, limit: int = 60) -> str:
    lines = list(difflib.unified_diff(
        a.decode("utf-8", "replace").splitlines(), b.decode("utf-8", "replace").splitlines(),
        f"committed/{name}", f"exported/{name}", lineterm="", n=1))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more diff lines)"]
    return "\n".join(lines)


# ------------------------------------------------------------------------ check
def check(project: Project, pin: Pin, wheel: Path, log=print) -> list[str]:
    """Apply patches/<version> (and the overlay) to a fresh baseline, re-export, compare. Returns problems."""
    pdir = project.patches_dir(pin)
    if not (pdir / "series").exists():
        return [f"patches/{pin.version}/series does not exist (an empty series is a file with no entries)"]
    patches = load_series(pdir)
    problems = validate_series(patches)
    listed = {p.name for p in patches}
    for stray in sorted(p.name for p in pdir.glob("*.patch") if p.name not in listed):
        problems.append(f"patches/{pin.version}/{stray} is not listed in the series (remove it or run refresh)")
    overlay = project.overlay_files()
    spec = project.verify_spec()
    concerns = project.concerns_spec()
    if concerns:
        for f in overlay:
            owners = concerns.concern_of(f.source)
            if len(owners) > 1:
                problems.append(f"{f.source} is claimed by several concerns in overlay/CONCERNS.toml: {owners}")
            elif not owners:
                log(f"note: {f.source} belongs to no concern in overlay/CONCERNS.toml (export-pr will refuse)")
    with scratch_tree(pin, wheel) as tree:
        sim = tree.simulate(tree.base, patches, overlay)
        for step in sim.patches:
            if step.status == "already-applied":
                problems.append(f"{step.name}: already in the vLLM {pin.version} release (it reverse-applies): drop it")
            for o in step.offsets:
                log(f"note: {step.name}: {o}")
        commits = [s.commit for s in sim.patches if s.commit]
        for i, (c, p) in enumerate(zip(commits, [p for p, s in zip(patches, sim.patches) if s.commit]), 1):
            data = tree.export_commit(c)
            want = patch_file_name(i, parse_patch_bytes(p.name, p.path, data).header.subject)
            if want != p.name:
                problems.append(f"{p.name}: refresh would name it {want} (series position {i})")
            if data != p.data:
                problems.append(f"{p.name}: re-export differs from the committed file (run refresh from a tree, or fix it):\n" + _diff(p.data, data, p.name))
        log(f"check {pin.version}: {len(patches)} patch(es) applied to a fresh {pin.tag} tree, "
            f"{len(overlay)} overlay file(s) placed{'' if spec is None else ', verify.toml parsed'}")
    return problems


# ----------------------------------------------------------------------- status
def status(project: Project, pin: Pin, tree_path: Path, managed: bool, log=print) -> None:
    """Print the tree's state against patches/ + overlay. Reports problems; raises only on usage/pin errors."""
    from .build import drift_of
    from .safety import is_locked
    from .tree import lock_path

    pdir = project.patches_dir(pin)
    v = pin.version
    try:
        patches = load_series(pdir)
    except UsageError as e:
        log(f"patches/{v}: ERROR: {e}")
        patches = None
    overlay = project.overlay_files()
    log(f"tree: {tree_path}")
    if not tree_path.exists():
        log("  (not created yet: `apply` creates it)")
        return
    tree = Tree.open(tree_path, pin, managed)
    if is_locked(lock_path(tree_path, managed)):
        log("  LOCKED: another tools/apply.py command is working on this tree now; what follows may be mid-change")
    try:
        j = tree.read_journal()
    except RefusedError as e:
        log("  JOURNAL UNREADABLE: " + str(e).replace("\n", "\n  "))
        j = None
    if j is not None and j.get("kind") == "stopped-port":
        log(f"  PORT IN PROGRESS: {j.get('what', 'a port stopped at a conflict')} (started {j.get('started')}); "
            f"recovery leaves it alone; `recover --forget` drops its record")
    elif j is not None:
        problems = tree.recovery_problems(j)
        log(f"  INTERRUPTED: an apply started {j.get('started')} was interrupted; "
            + ("the next apply/build (or `recover`) restores the tree first" if not problems else
               "the tree changed since, so recovery will refuse (it keeps your changes): " + "; ".join(problems[:5])))
    head = tree.g.rev("HEAD")
    log(f"  HEAD {head[:12] if head else '?'} on {tree.g.current_branch() or 'detached HEAD'}; baseline {pin.tag} {tree.base[:12]}")
    dirty = tree.g.status_lines()
    if dirty:
        log(f"  uncommitted changes: {len(dirty)} path(s): " + ", ".join(dirty[:5]))
    fp = patches_fingerprint(pdir)
    state = tree.sync_state(fp)
    log("  " + {
        None: f"patches/{v} sync: not recorded (the tree was not applied/refreshed by this version of the tool)",
        "in-sync": f"patches/{v} sync: unchanged since the tree was last applied/refreshed",
        "patches-newer": f"patches/{v} was EDITED after the tree was last applied/refreshed (the tree did not change): "
                         f"keep patches/: `apply` (re-applies the series); keep the tree: `refresh --force`",
        "tree-newer": f"the tree changed after its last apply/refresh (patches/{v} did not): `refresh` exports it",
        "both": f"BOTH patches/{v} and the tree changed since the tree was last applied/refreshed: save one side, then "
                f"`refresh --force` (keep the tree) or `apply --rebuild --force` (keep patches/)",
    }[state])
    if patches is None or head is None:
        return
    commits = tree.patch_commits(head)
    mismatch = tree.first_mismatch(commits, patches)
    fresh_error = None
    try:
        tree.simulate(tree.base, patches, overlay)
    except PatchError as e:
        fresh_error = e
    if fresh_error is not None:
        log(f"  DRIFT: patches/{v} does not apply to a fresh {pin.tag} tree: "
            + str(fresh_error).replace(f"does not apply to {tree.path}:", f"does not apply to a fresh {pin.tag} tree:").replace("\n", "\n  "))
    elif mismatch is not None:
        log(f"  commits: the tree's patch commit {mismatch + 1} ('{tree.subject(commits[mismatch])}') is not series entry "
            f"{mismatch + 1} ({patches[mismatch].name}): the tree and patches/ disagree (see the sync line above)")
    else:
        try:
            sim = tree.simulate(head, patches, overlay)
            for s in sim.patches:
                log(f"  patch {s.name}: {'applied' if s.status == 'already-applied' else 'NOT applied (run apply)'}")
            ov = sim.overlay
            if ov.changed:
                log(f"  overlay: {len(ov.added)} to add, {len(ov.updated)} to update, {len(ov.removed)} to remove (run apply)")
            else:
                log(f"  overlay: {len(ov.unchanged)} file(s) in place")
        except PatchError as e:
            log("  does not apply on top of this tree's commits: " + str(e).replace("\n", "\n  "))
    exported = None
    try:
        exported = export_tree(tree, project)
    except CheckError as e:
        log("  " + str(e).replace("\n", "\n  "))
    if exported is not None:
        files = {p.name: p.data for p in patches}
        unexported = [n for n, d in exported if files.get(n) != d]
        if unexported:
            log(f"  commits not yet in patches/{v}: {', '.join(unexported)} (run refresh)")
    if fresh_error is not None:
        log(f"  content: unknown (patches/{v} does not apply to a fresh {pin.tag} tree)")
    else:
        drift, why = drift_of(tree, patches, overlay)
        log(f"  content: {'DRIFT: ' + why if drift else 'matches patches/' + v + ' + overlay'}")


# -------------------------------------------------------------------- export-pr
def _upstreamable(p) -> bool:
    fwd = [v.lower() for v in p.header.fields.get("Forwarded", [])]
    return not (fwd and all(v.startswith("not-needed") for v in fwd))


def plan_concerns(project: Project, patches, overlay: list[OverlayFile]):
    spec = project.concerns_spec()
    groups: "OrderedDict[str, dict]" = OrderedDict()
    for p in patches:
        groups.setdefault(p.header.concern, {"patches": [], "files": []})["patches"].append(p)
    problems = []
    for f in overlay:
        owners = spec.concern_of(f.source) if spec else []
        if len(owners) != 1:
            problems.append(
                f"{f.source}: " + ("no concern claims it in overlay/CONCERNS.toml" if not owners else f"claimed by {owners}")
            )
            continue
        groups.setdefault(owners[0], {"patches": [], "files": []})["files"].append(f)
    if problems:
        raise UsageError("every overlay/kernels file must belong to exactly one concern (overlay/CONCERNS.toml):\n  " + "\n  ".join(problems))
    return groups, spec


def export_pr(project: Project, pin: Pin, wheel: Path, out: Path, only: str | None, signoff: str | None,
              include_not_needed: bool, dry_run: bool, log=print) -> list[Path]:
    patches = load_series(project.patches_dir(pin))
    require_valid(patches)
    overlay = project.overlay_files()
    groups, spec = plan_concerns(project, patches, overlay)
    if only:
        if only not in groups:
            raise UsageError(f"no concern '{only}' (concerns: {', '.join(groups) or 'none'})")
        groups = OrderedDict([(only, groups[only])])
    ident = signoff or _git_identity(project.root)
    m = re.fullmatch(r"\s*(.+?)\s*<([^<>\s]+@[^<>\s]+)>\s*", ident or "")
    if not m:
        raise UsageError("DCO sign-off needs an identity: pass --signoff 'Name <email>' or set git user.name/user.email")
    name, email = m.group(1), m.group(2)
    # our patches of vLLM's own tests (patches/<pin>/tests), each carried into its concern's series
    # as an edit of vLLM's file (the file comes from the pinned sdist: the wheel has no tests/)
    from .upstream_tests import default_sdist_cache, load_test_set, patched_files

    test_steps = []
    ts = load_test_set(project.patches_dir(pin))
    if ts is not None and ts.patches:
        stray = sorted({p.header.concern for p in ts.patches} - set(groups))
        if stray and not only:
            raise UsageError(f"patches/{pin.version}/tests: test patches name concern(s) {', '.join(stray)} "
                             "that have no patches or files")
        if any(p.header.concern in groups for p in ts.patches):
            test_steps = [(p, ch) for p, ch in patched_files(project, pin, default_sdist_cache(), log=log)[2]
                          if p.header.concern in groups]
    written: list[Path] = []
    with scratch_tree(pin, wheel) as tree:
        for concern, grp in groups.items():
            pset = [p for p in grp["patches"] if include_not_needed or _upstreamable(p)]
            skipped = [p.name for p in grp["patches"] if p not in pset]
            if skipped:
                log(f"{concern}: leaving out {', '.join(skipped)} (Forwarded: not-needed: already upstream)")
            if not pset and not grp["files"]:
                log(f"{concern}: nothing to send upstream")
                continue
            try:
                sim = tree.simulate(tree.base, pset, None)
            except PatchError as e:
                raise PatchError(f"concern {concern}: its patches do not apply to {pin.tag} on their own "
                                 f"(they need another concern's patches first):\n{e}") from None
            parent = tree.base
            env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": FIXED_DATE}
            for step, p in zip(sim.patches, pset):
                h = p.header
                msg = f"{h.subject}\n\n{h.description}\n\nSigned-off-by: {name} <{email}>\n"
                treeid = tree.g.out("rev-parse", f"{step.commit}^{{tree}}")
                parent = tree.g.out("commit-tree", treeid, "-p", parent, "-F", "-", input=msg.encode(), env=env)
            title = None
            c = spec.concerns.get(concern) if spec else None
            if grp["files"]:
                title = c.title if c and c.title else None
                if not title:
                    raise UsageError(f"overlay/CONCERNS.toml: [concern.{concern}] needs a title (e.g. '[Kernel] ...') for its files")
                if not TITLE_RE.match(title):
                    raise UsageError(f"overlay/CONCERNS.toml: [concern.{concern}] title must start with tags like [Kernel]: {title!r}")
                parent = _files_commit(tree, parent, grp["files"], title, c.description if c else None, name, email, env)
            carried = []
            if c and c.tests:
                from .carry import carry_test, module_map

                mods = module_map(overlay)
                own = set(module_map(grp["files"]))
                carried = [(src, dest, carry_test(project.root, src, dest, mods, own)) for src, dest in c.tests]
                parent = _tests_commit(tree, parent, carried, title or pset[0].header.subject, name, email, env)
            edits = [(p, ch) for p, ch in test_steps if p.header.concern == concern]
            upstream_base = last_edit = None
            if edits:
                upstream_base, last_edit = _upstream_test_commits(tree, parent, edits, name, email, env)
            dest = out / concern
            if dry_run:
                log(f"would write {dest}/ ({len(pset)} patch(es), {len(grp['files'])} file(s), {len(carried)} test(s), "
                    f"{len(edits)} edit(s) of vLLM's tests)")
                continue
            if dest.exists():
                shutil.rmtree(dest)
            dest.mkdir(parents=True)
            tree.g.run("format-patch", *FORMAT_PATCH_OPTS, "-o", str(dest), f"{tree.base}..{parent}")
            if edits:
                # after the series: the edits of vLLM's own test files (not in the wheel-made tree: they
                # are diffed against the sdist's files, which the series' target, vLLM's repository, has)
                n = len(list(dest.glob("*.patch")))
                tree.g.run("format-patch", *FORMAT_PATCH_OPTS, f"--start-number={n + 1}", "-o", str(dest),
                           f"{upstream_base}..{last_edit}")
            for f in sorted(dest.glob("*.patch")):
                f.write_bytes(re.sub(rb"(?m)^Date: .*$", b"Date: " + FIXED_DATE.encode(), f.read_bytes(), count=1))
            pr = _pr_body(concern, pset, grp["files"], title or pset[0].header.subject, c, pin, carried, project.root, edits)
            (dest / "PR.md").write_text(pr)
            written.append(dest)
            log(f"{concern}: wrote {dest}/ ({len(list(dest.glob('*.patch')))} patch(es) + PR.md)")
    return written


def _files_commit(tree: Tree, parent: str, files: list[OverlayFile], title, description, name, email, env) -> str:
    with owned_tempdir("glm5-index-") as td:
        ienv = dict(env, GIT_INDEX_FILE=str(Path(td) / "index"))
        tree.g.run("read-tree", parent, env=ienv)
        blobs = tree.g.out("hash-object", "-w", "--no-filters", "--stdin-paths",
                           input="".join(f"{f.path}\n" for f in files).encode()).split()
        for f, b in zip(files, blobs):
            tree.g.run("update-index", "--add", "--cacheinfo", f"{f.mode:o},{b},{f.dest}", env=ienv)
        treeid = tree.g.out("write-tree", env=ienv)
    body = (description.strip() + "\n\n") if description else ""
    body += "".join(f"- {f.dest}\n" for f in files)
    msg = f"{title}\n\n{body}\nSigned-off-by: {name} <{email}>\n"
    return tree.g.out("commit-tree", treeid, "-p", parent, "-F", "-", input=msg.encode(), env=env)


def _tests_commit(tree: Tree, parent: str, carried, title: str, name, email, env) -> str:
    """One commit adding the concern's tests at their vLLM paths (rewritten by carry.carry_test)."""
    with owned_tempdir("glm5-index-") as td:
        ienv = dict(env, GIT_INDEX_FILE=str(Path(td) / "index"))
        tree.g.run("read-tree", parent, env=ienv)
        for src, dest, data in carried:
            blob = tree.g.out("hash-object", "-w", "--no-filters", "--stdin", input=data)
            tree.g.run("update-index", "--add", "--cacheinfo", f"100644,{blob},{dest}", env=ienv)
        treeid = tree.g.out("write-tree", env=ienv)
    subject = "[Test] " + re.sub(r"^(\[[^\]]*\] *)+", "", title)
    body = "The tests of the change above, in vLLM's layout (imports from vLLM's paths).\n\n"
    body += "".join(f"- {dest}\n" for _, dest, _ in carried)
    msg = f"{subject}\n\n{body}\nSigned-off-by: {name} <{email}>\n"
    return tree.g.out("commit-tree", treeid, "-p", parent, "-F", "-", input=msg.encode(), env=env)


def _upstream_test_commits(tree: Tree, parent: str, edits, name, email, env) -> tuple[str, str]:
    """A commit adding vLLM's test files as the sdist has them (the base, not exported), then one
    commit per test patch with its edit (message: the patch's subject and why, signed off)."""
    before: dict[str, bytes] = {}
    for _, changes in edits:
        for path, (old, _) in changes.items():
            before.setdefault(path, old)

    def commit(files: dict[str, bytes], base: str, msg: str) -> str:
        with owned_tempdir("glm5-index-") as td:
            ienv = dict(env, GIT_INDEX_FILE=str(Path(td) / "index"))
            tree.g.run("read-tree", base, env=ienv)
            for path, data in files.items():
                blob = tree.g.out("hash-object", "-w", "--no-filters", "--stdin", input=data)
                tree.g.run("update-index", "--add", "--cacheinfo", f"100644,{blob},{path}", env=ienv)
            treeid = tree.g.out("write-tree", env=ienv)
        return tree.g.out("commit-tree", treeid, "-p", base, "-F", "-", input=msg.encode(), env=env)

    base = commit(before, parent, "vLLM's test files as released (the base of the edits below)\n")
    last = base
    for p, changes in edits:
        h = p.header
        msg = f"{h.subject}\n\n{h.description}\n\nSigned-off-by: {name} <{email}>\n"
        last = commit({path: new for path, (_, new) in changes.items()}, last, msg)
    return base, last


def _pr_body(concern, patches, files, title, c, pin, carried=(), root: Path | None = None, edits=()) -> str:
    L = [f"# {title}", "", "## Purpose", ""]
    for p in patches:
        L += [p.header.description, ""]
    if c and c.description:
        L += [c.description.strip(), ""]
    L += ["## Changes", ""]
    L += [f"- {p.header.subject}" for p in patches]
    L += [f"- new file `{f.dest}`" for f in files]
    L += [f"- new test `{dest}` (the project's `{src}`)" for src, dest, _ in carried]
    edited = sorted({path for _, ch in edits for path in ch})
    L += [f"- {p.header.subject} (edits vLLM's `{'`, `'.join(sorted(ch))}`)" for p, ch in edits]
    refs = []
    for p in patches:
        for k in ("Origin", "Bug", "Bug-Upstream", "Applied-Upstream", "Forwarded"):
            refs += [f"- {p.name}: {k}: {v}" for v in p.header.fields.get(k, [])]
    if refs:
        L += ["", "## References", ""] + refs
    L += ["", "## Test Plan", "",
          f"Prepared against vLLM {pin.tag} by `tools/apply.py export-pr` (concern `{concern}`)."]
    if carried or edited:
        L += ["", "Run inside vLLM's tree (the kernel tests need a CUDA GPU for the compiled kernels):", "", "```bash"]
        L += [f"pytest -v {' '.join([dest for _, dest, _ in carried] + edited)}", "```"]
    if c and c.not_carried:
        L += ["", "Not carried (tests of the overlay project that cannot run inside vLLM's tree as they are):", ""]
        L += [f"- `{src}`: {why}" for src, why in c.not_carried]
    L += ["", "## Test Result", ""]
    if c and c.results and root is not None:
        from .carry import results_section

        L += ["Measured with the overlay project's harness (numbers read from its result files at export time):", ""]
        L += results_section(root, c.results)
    else:
        L += ["The patched build passes `tools/apply.py` verification (tree, imports/registrations, kernel tests)."]
    L += [""]
    return "\n".join(L).replace("\n\n\n", "\n\n")


def _git_identity(root: Path) -> str | None:
    try:
        n = run_child(["git", "config", "user.name"], cwd=root, capture_output=True, text=True).stdout.strip()
        e = run_child(["git", "config", "user.email"], cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return f"{n} <{e}>" if n and e else None

"""Command line of tools/apply.py."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from . import errors
from .errors import ToolError, UsageError
from .project import Project, default_cache_dir

DESCRIPTION = """\
Turn a pinned vLLM release into a patched, installed, verified vLLM.

With no subcommand: fetch -> apply -> build -> install -> verify for the pin (default: pins.lock's
default), then print where the report is.

subcommands:
  fetch      download the pinned release wheel with pip (cached; sha256 checked on every use)
  apply      make the tree (wheel unpacked into git, tagged v<version>) and apply patches/<version>/series
             (one commit per patch, no fuzz) and overlay/ + kernels/ (one commit); all or nothing
  build      repack the patched tree as vllm-<version>+glm5.<hash> (release binaries reused unchanged)
  install    install the built wheel into a venv (default: one per pin, with the pinned torch)
  verify     (a) wheel vs release, (b) imports + registrations in the venv, (c) tests/kernels; report
  status     pin, applied patches, unexported commits, drift, installed build
  check      apply each pin's series to a fresh tree, re-export, fail if it differs (the CI gate)
  refresh    export the tree's commits to patches/<version>/ (deterministic)
  recover    undo an interrupted apply now (what apply/build do first); --forget drops its record
  revert     put stock vLLM back into the venv;   uninstall: remove the patched vLLM from the venv
  export-pr  one format-patch series per concern for upstream, DCO signed-off, with PR.md
             (default: the newest pin, not pins.lock's default: upstream PRs go against main)
  upstream-tests  vLLM's own tests of the pin (from its sdist, pinned in pins.lock) with our test patches
             (patches/<version>/tests) applied, written to --out DIR for a GPU host
  port       carry patches/OLD/series onto a new vLLM release (three-way merges; stops at a conflict for you;
             --continue / --skip / --abort), pinning the release in pins.lock if needed; then refresh + check

Commands that write to a tree (all, apply, build, refresh, recover, port) take the tree's lock; a second
one fails at once with exit 5 (--wait: wait for the lock instead).
"""

# verb -> one-line description (the first line of `<verb> --help`)
VERB_HELP = {
    "all": "fetch -> apply -> build -> install -> verify (what `tools/apply.py` without a subcommand does)",
    "fetch": "download the pinned release wheel with pip into the cache and check its sha256",
    "apply": "make the tree and apply patches/<version>/series and overlay/ + kernels/ to it, all or nothing",
    "build": "repack the patched tree as vllm-<version>+glm5.<hash> (release binaries reused unchanged)",
    "install": "install the last built wheel into a virtual environment (default: one per pin)",
    "verify": "check the built wheel, the installed vLLM's imports and registrations, and run tests/kernels",
    "status": "show the pin, the tree's patches, unexported commits, drift, interruptions and the installed build",
    "check": "apply each pin's series to a fresh tree, re-export and fail if anything differs (the CI gate)",
    "refresh": "export the tree's patch commits to patches/<version>/ (series + files, deterministic)",
    "recover": "undo an interrupted apply in the tree now (refuses when the tree changed since), or --forget its record",
    "revert": "put stock vLLM of the pin back into the environment",
    "uninstall": "remove the patched vLLM from the environment",
    "export-pr": "write one format-patch series + PR.md per concern for upstream, DCO signed-off, against the newest "
                 "pin in pins.lock (upstream PRs go against vLLM's main; --vllm VERSION picks another pin)",
    "upstream-tests": "extract the vLLM test files patches/<version>/tests/files lists from the pin's sdist (downloaded, "
                      "sha256 checked against pins.lock, cached in $GLM5_OVERLAY_SDISTS or ~/.cache/glm5-overlay/sdists) "
                      "and apply patches/<version>/tests/series to them, into --out DIR",
    "port": "carry patches/OLD/series onto vLLM NEW: commit each patch that applies (clean, at an offset, or by a "
            "three-way merge with its OLD base), stop at a conflict for you to resolve, then refresh + check NEW",
}
VERBS = list(VERB_HELP)

# common option -> the verbs it applies to (the top-level parser takes every one of them)
_TREE = {"all", "apply", "build", "verify", "status", "refresh", "recover"}
OPTION_VERBS = {
    "--vllm": set(VERBS) - {"port"},
    "--work": _TREE | {"port"},
    "--checkout": _TREE,
    "--venv": {"all", "install", "verify", "status", "revert", "uninstall"},
    "--wheel-cache": {"all", "fetch", "apply", "build", "verify", "status", "check", "revert", "export-pr", "port"},
    "--out": {"all", "build", "install", "verify", "status", "export-pr", "upstream-tests"},
    "--dry-run": {"all", "fetch", "apply", "build", "install", "refresh", "revert", "uninstall", "export-pr", "port",
                  "upstream-tests"},
    "--wait": {"all", "apply", "build", "refresh", "recover", "port"},
    "--debug": set(VERBS),
}
WRITES_TREE = {"all", "apply", "build", "refresh", "recover"}


def _common(p: argparse.ArgumentParser, suppress: bool, verb: str | None = None) -> None:
    d = argparse.SUPPRESS if suppress else None
    g = p.add_argument_group("common options")

    def add(flag, **kw):
        if verb is None or verb in OPTION_VERBS[flag]:
            g.add_argument(flag, **kw)

    add("--vllm", metavar="VERSION", default=d, help="the pin to use (default: pins.lock's default; check: every pin; export-pr: the newest pin)")
    add("--work", metavar="DIR", default=d, help="the tool's vLLM git tree (default: work/<version>/tree)")
    add("--checkout", metavar="PATH", default=d, help="use your own vLLM git checkout (clean, at tag v<version>) instead")
    add("--venv", metavar="DIR", default=d, help="environment to install into (default: .venv-vllm-<version>; 'current': this one)")
    add("--wheel-cache", metavar="DIR", default=d, help="release wheel cache (default: $GLM5_OVERLAY_WHEELS or ~/.cache/glm5-overlay/wheels)")
    add("--out", metavar="DIR", default=d, help="reports and built wheels (default: work/<version>/); export-pr, upstream-tests: output folder")
    g.add_argument("--project", metavar="DIR", default=d, help=argparse.SUPPRESS)
    g.add_argument("--lock", metavar="FILE", default=d, help=argparse.SUPPRESS)
    flag_default = argparse.SUPPRESS if suppress else False
    add("--dry-run", action="store_true", default=flag_default, help="say what would change, change nothing")
    add("--wait", action="store_true", default=flag_default, help="if another command holds the tree's lock, wait for it (default: exit 5 at once)")
    add("--debug", action="store_true", default=flag_default, help="print the traceback of an internal error")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/apply.py", description=DESCRIPTION, epilog=errors.EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p, suppress=False)
    sub = p.add_subparsers(dest="verb", metavar="SUBCOMMAND")
    sp = {}
    for v in VERBS:
        sp[v] = sub.add_parser(v, description=VERB_HELP[v], epilog=errors.EXIT_CODES_HELP,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        _common(sp[v], suppress=True, verb=v)
    for v in ("all", "apply"):
        sp[v].add_argument("--rebuild", action="store_true",
                           help="re-apply the series from the baseline, replacing the tree's patch commits (keep patches/ "
                                "over the tree; refused when the tree holds unexported commits, unless --force)")
        sp[v].add_argument("--force", action="store_true", help="with --rebuild: replace unexported commits too (the old HEAD is kept as a ref)")
    sp["refresh"].add_argument("--force", action="store_true", help="overwrite patches/<version> even if it was edited after the tree's last apply/refresh")
    sp["refresh"].add_argument("--allow-fewer", action="store_true", help="allow exporting fewer patches than the series holds")
    sp["recover"].add_argument("--forget", action="store_true", help="drop the record of the interrupted command and leave the tree as it is")
    for v in ("all", "build"):
        sp[v].add_argument("--allow-drift", action="store_true", help="build even if the tree has commits not in patches/ (version gets .wip<commit>)")
        sp[v].add_argument("--no-build-isolation", action="store_true", help="--checkout builds: pass --no-build-isolation to pip wheel")
    for v in ("all", "install"):
        sp[v].add_argument("--deps", choices=["full", "minimal", "none"], default="full",
                           help="full: the wheel's requirements and the pinned torch; minimal: --no-deps + what the import checks need; none: --no-deps")
        sp[v].add_argument("--allow-replace", action="store_true", help="allow replacing an installed torch/vLLM that is not the tool's")
    for v in ("all", "verify"):
        sp[v].add_argument("--no-kernel-tests", action="store_true", help="skip (c)")
    sp["export-pr"].add_argument("--concern", help="only this concern")
    sp["export-pr"].add_argument("--signoff", metavar="'NAME <EMAIL>'", help="DCO identity (default: git config user.name/user.email)")
    sp["export-pr"].add_argument("--include-not-needed", action="store_true", help="also export patches marked 'Forwarded: not-needed'")
    pp = sp["port"]
    pp.description = VERB_HELP["port"] + "\n\n" + PORT_HELP
    pp.add_argument("--from", dest="port_from", metavar="OLD", help="the pin whose patches/OLD/series is carried over")
    pp.add_argument("--to", dest="port_to", metavar="NEW", help="the release to port to (added to pins.lock if absent); "
                    "with --continue/--skip/--abort: the port to go on with (default: the only one under work/)")
    g = pp.add_mutually_exclusive_group()
    g.add_argument("--continue", dest="port_continue", action="store_true",
                   help="go on after you resolved the conflict (staged with git add, or committed)")
    g.add_argument("--skip", dest="port_skip", action="store_true",
                   help="drop the patch stopped at a conflict (your work tree is saved as refs/glm5-overlay/port-saved) and go on")
    g.add_argument("--abort", dest="port_abort", action="store_true",
                   help="end the port: the tree keeps v<NEW> + the patches ported so far; the stopped merge is undone "
                        "(saved as refs/glm5-overlay/port-saved); patches/NEW is not written")
    pp.add_argument("--wheel", metavar="FILE", help="NEW's release wheel from a file (copied into the cache) instead of pip download")
    pp.add_argument("--torch", metavar="VERSION", help="the torch NEW pins (default: the wheel's Requires-Dist: torch==X)")
    pp.add_argument("--triton", metavar="SPEC", help="that torch's triton requirement, e.g. '==3.6.0' (default: read with pip from torch's metadata)")
    return p


PORT_HELP = """  tools/apply.py port --from 0.33.0 --to 0.34.0 [--dry-run]
  tools/apply.py port --continue | --skip | --abort  [--to 0.34.0]

Each patch of patches/OLD/series, in order, becomes one commit on NEW's tree (work/NEW/tree, made from
NEW's wheel), message and author unchanged. Per patch: clean (applies as is), offset (applies at
shifted lines), merged (needed a three-way merge with the OLD source it was written against: no
conflict), conflict (the port stops: the tree is left mid-cherry-pick with conflict markers; the
patch, files and hunks are named), upstream (NEW already has it: dropped), skipped (--skip).
When every patch is ported: refresh (writes patches/NEW/ + series) and check for NEW.
--dry-run: the same classification in a temporary tree; pins.lock, patches/ and work/ untouched
(NEW's wheel is downloaded into the wheel cache). Refuses (exit 5) a NEW tree with commits or edits,
and an existing patches/NEW series. A killed or interrupted port: `port --continue` resumes it.
Exit 6: stopped at a conflict; 7: ported but check failed."""


class Ctx:
    def __init__(self, ns: argparse.Namespace):
        g = lambda k, d=None: getattr(ns, k, d) if getattr(ns, k, None) is not None else d  # noqa: E731
        self.ns = ns
        root = Path(g("project") or Path(__file__).resolve().parents[2]).resolve()
        self.project = Project(root, Path(g("lock")).resolve() if g("lock") else None)
        self.version = g("vllm")
        self.dry_run = bool(g("dry_run", False))
        self.cache = Path(g("wheel_cache")).expanduser().resolve() if g("wheel_cache") else default_cache_dir()
        self.work = g("work")
        self.checkout = g("checkout")
        self.venv_arg = g("venv")
        self.out_arg = g("out")
        self.wait = bool(g("wait", False))
        self.t_start = time.time()
        if self.work and self.checkout:
            raise UsageError("--work and --checkout exclude each other")

    @property
    def pin(self):
        return self.project.pin(self.version)

    def out_dir(self, pin) -> Path:
        return Path(self.out_arg).resolve() if self.out_arg else self.project.out_dir(pin)

    def tree_path(self, pin) -> tuple[Path, bool]:
        if self.checkout:
            return Path(self.checkout).expanduser().resolve(), False
        return (Path(self.work).expanduser().resolve() if self.work else self.project.default_tree(pin)), True


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------- steps
def step_fetch(ctx: Ctx, pin) -> Path:
    from .fetch import fetch

    done = getattr(ctx, "_fetched", {})
    if pin.version not in done:
        t0 = time.time()
        done[pin.version] = fetch(pin, ctx.cache, ctx.dry_run, log)
        ctx._fetched = done
        ctx.fetch_s = round(time.time() - t0, 1)  # run() fetches before taking the lock: `all` reports this
    return done[pin.version]


def step_apply(ctx: Ctx, pin, wheel: Path):
    from .patches import load_series
    from .tree import Tree, create_baseline

    patches = load_series(ctx.project.patches_dir(pin))
    overlay = ctx.project.overlay_files()
    ctx.project.verify_spec()  # malformed overlay/verify.toml or CONCERNS.toml: fail before changing anything
    ctx.project.concerns_spec()
    path, managed = ctx.tree_path(pin)
    from .patches import patches_fingerprint

    fingerprint = patches_fingerprint(ctx.project.patches_dir(pin))
    if managed and not path.exists():
        if ctx.dry_run:
            log(f"would create {path} from {wheel.name} (tag {pin.tag}) and apply {len(patches)} patch(es) + {len(overlay)} overlay file(s)")
            from .ops import scratch_tree

            with scratch_tree(pin, wheel) as t:
                sim = t.simulate(t.base, patches, overlay)
            _print_sim(sim, dry=True)
            return None, sim, patches, overlay
        log(f"creating {path} from {wheel.name}")
        create_baseline(path, pin, wheel, checkout=True)
        created = True
    elif not path.exists():
        raise UsageError(f"--checkout {path} does not exist")
    else:
        created = False
    try:
        tree = Tree.open(path, pin, managed)
        msg = None if ctx.dry_run else tree.recover()
        if msg:
            log(f"recovered: {msg}")
        try:
            sim = tree.apply(patches, overlay, dry_run=ctx.dry_run, fingerprint=fingerprint,
                             rebuild=getattr(ctx.ns, "rebuild", False), force=getattr(ctx.ns, "force", False))
        except KeyboardInterrupt:
            raise ToolError(f"interrupted before anything was changed; {path} is as it was", errors.INTERRUPTED) from None
    except BaseException:
        if created:  # the tree did not exist before this run: leave no tree behind
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        raise
    _print_sim(sim, dry=ctx.dry_run)
    if not sim.changed:
        log(f"{path}: already up to date ({pin.branch} at {sim.commit[:12]})")
    elif not ctx.dry_run:
        log(f"{path}: {pin.branch} now at {sim.commit[:12]}")
    return tree, sim, patches, overlay


def _print_sim(sim, dry: bool) -> None:
    w = "would apply" if dry else "applied"
    for s in sim.patches:
        log(f"  {s.name}: {w if s.status == 'applied' else 'already applied'}")
        for o in s.offsets:
            log(f"    {o}")
    ov = sim.overlay
    if ov.changed:
        log(f"  overlay: {len(ov.added)} added, {len(ov.updated)} updated, {len(ov.removed)} removed ({'would commit' if dry else 'one commit'})")
        for f in ov.added + ov.updated:
            log(f"    {f.dest}  sha256 {f.sha256}")
        for r in ov.removed:
            log(f"    removed {r}")
    else:
        log(f"  overlay: {len(ov.unchanged)} file(s), nothing to change")


def step_build(ctx: Ctx, pin, tree, patches, overlay, wheel: Path):
    from .build import build_checkout, build_wheel, local_version

    out = ctx.out_dir(pin)
    ns = ctx.ns
    if tree.managed:
        res = build_wheel(tree, pin, patches, overlay, out / "dist", getattr(ns, "allow_drift", False), ctx.dry_run, log)
    else:
        res = build_checkout(tree, pin, wheel, local_version(pin, patches, overlay), out / "dist",
                             getattr(ns, "no_build_isolation", False), ctx.dry_run, log)
    if not ctx.dry_run:
        (out / "build.json").write_text(json.dumps({
            "wheel": str(res.wheel), "version": res.version, "sha256": res.sha256, "head": res.head,
            "tree": str(tree.path), "managed": tree.managed, "drift": res.drift,
        }, indent=1) + "\n")
    return res


def _last_build(ctx: Ctx, pin):
    from .build import BuildResult
    from .project import sha256_file

    f = ctx.out_dir(pin) / "build.json"
    if not f.exists():
        raise UsageError(f"nothing built for {pin.version} yet ({f} missing): run build first")
    b = json.loads(f.read_text())
    w = Path(b["wheel"])
    if not w.exists() or sha256_file(w) != b["sha256"]:
        raise UsageError(f"{w} is missing or changed since it was built: run build again")
    return BuildResult(w, b["version"], b["sha256"], b["head"], b["drift"]), b


def step_install(ctx: Ctx, pin, build):
    from .install import install, resolve_venv

    v = resolve_venv(ctx.venv_arg, ctx.project.default_venv(pin))
    deps = getattr(ctx.ns, "deps", "full")
    have = install(pin, build.wheel, v, deps, getattr(ctx.ns, "allow_replace", False), ctx.dry_run, log=log)
    return v, have, deps


def step_verify(ctx: Ctx, pin, wheel: Path, tree, patches, overlay, build, v, deps, sim=None, timings=None) -> int:
    import hashlib

    from .project import sha256_file
    from .verify import check_imports, check_wheel, command_line, kernel_tests, now, write_reports

    # The wheel is checked against the commit it was built from (build refuses a tree whose content
    # is not the series + overlay, so that commit is what they say); overlay/kernels edited since
    # the build are reported as a note.
    expected_commit = build.head
    if tree.g.run("cat-file", "-e", f"{expected_commit}^{{commit}}", check=False).returncode != 0:
        raise UsageError(f"the build's commit {expected_commit[:12]} is not in {tree.path}: run build again")
    changes = tree.changed_paths(tree.base, expected_commit)
    exp_sha = {}
    for path, st in changes.items():
        if st != "D":
            data = tree.g.run("cat-file", "blob", f"{expected_commit}:{path}").stdout
            exp_sha[path] = hashlib.sha256(data).hexdigest()
    report = {
        "pin": {"version": pin.version, "wheel": pin.wheel, "sha256": pin.sha256, "torch": pin.torch, "triton": pin.triton},
        "written": now(),
        "command": command_line(),
        "tree": {"path": str(tree.path), "managed": tree.managed, "head": tree.g.rev("HEAD")},
        "patches": [{"name": s.name, "status": s.status, "offsets": s.offsets} for s in (sim.patches if sim else [])]
        or [{"name": p.name, "status": "in series"} for p in patches],
        "overlay": [{"source": f.source, "dest": f.dest, "sha256": f.sha256} for f in overlay],
        "build": {"wheel": str(build.wheel), "version": build.version, "sha256": build.sha256},
        "notes": [],
        "timings": dict(timings or {}),
    }
    if tree.managed:
        from .build import drift_of

        stale, why = drift_of(tree, patches, overlay)
        if stale and not build.drift:
            report["notes"].append(f"patches/ or overlay/kernels changed since this build ({why}); run the tool again to rebuild")
    t0 = time.time()
    log("verify (a): built wheel against the release wheel ...")
    report["tree_check"] = check_wheel(wheel, build.wheel, build.version, changes, exp_sha)
    report["tree_check"]["seconds"] = round(time.time() - t0, 1)
    from .install import installed

    have = installed(v)
    report["venv"] = {"path": str(v.path), "python": str(v.python), "deps": deps, **have}
    if have.get("torch") and have["torch"].split("+")[0] != pin.torch:
        report["notes"].append(f"torch {have['torch']} in the environment, not the pinned {pin.torch}: compiled ops not exercised")
    spec = ctx.project.verify_spec()
    if spec and spec.pins is not None and pin.version not in spec.pins:
        report["notes"].append(f"{spec.path.name} lists pins {list(spec.pins)}; not applied to {pin.version}")
        spec = None
    log("verify (b): import vllm and registrations in " + str(v.path) + " ...")
    files = {p: exp_sha.get(p) for p in changes}
    report["imports"] = check_imports(v.python, spec, build.version, files)
    if getattr(ctx.ns, "no_kernel_tests", False):
        report["kernels"] = {"ok": True, "ran": False, "skipped": "--no-kernel-tests"}
    else:
        if (ctx.project.kernel_tests_dir).is_dir() and any(ctx.project.kernel_tests_dir.glob("test_*.py")) and not have.get("pytest"):
            from .install import pip

            log("installing pytest and hypothesis into the environment for the kernel tests")
            pip(v, ["install", "pytest", "hypothesis"], False, log)
        log("verify (c): kernel tests ...")
        report["kernels"] = kernel_tests(v.python, ctx.project.root, ctx.project.kernel_tests_dir, bool(report["imports"].get("cuda")))
    report["ok"] = bool(report["tree_check"]["ok"] and report["imports"]["ok"] and report["kernels"]["ok"])
    jp, mp = write_reports(ctx.out_dir(pin), report)
    for sec in ("tree_check", "imports", "kernels"):
        for p in report[sec].get("problems", []):
            log(f"  FAIL {sec}: {p}")
    log(f"report: {mp} (and {jp.name})")
    log(f"verification {'PASSED' if report['ok'] else 'FAILED'} for vLLM {build.version}")
    return errors.OK if report["ok"] else errors.VERIFY


def _open_tree(ctx: Ctx, pin):
    from .tree import Tree

    path, managed = ctx.tree_path(pin)
    if not path.exists():
        raise UsageError(f"{path} does not exist: run apply first")
    return Tree.open(path, pin, managed)


# ------------------------------------------------------------------- verbs
def run(ns: argparse.Namespace) -> int:
    ctx = Ctx(ns)
    verb = ns.verb or "all"
    if verb == "check":
        return cmd_check(ctx)
    if verb == "port":
        from .port import cmd_port

        return cmd_port(ctx)
    if verb == "export-pr" and not ctx.version:
        pin = ctx.project.pin(ctx.project.lock.newest)  # upstream PRs go against vLLM's main: the newest pin
        log(f"export-pr: vLLM {pin.version}, the newest pin (--vllm VERSION for another)")
    else:
        pin = ctx.pin
    if not ctx.dry_run:
        _clean_stale(ctx, pin)
    if verb in WRITES_TREE and not ctx.dry_run:  # a dry run writes nothing: no lock, no work/ folder
        from .safety import TreeLock
        from .tree import lock_path

        path, managed = ctx.tree_path(pin)
        if not managed and not path.exists():
            raise UsageError(f"--checkout {path} does not exist")
        if not path.exists() and verb not in ("all", "apply"):
            raise UsageError(f"{path} does not exist: run apply first")
        if verb in ("all", "apply", "build"):
            step_fetch(ctx, pin)  # before the lock: the cache is shared, and a failed fetch leaves no work/ folder
        with TreeLock(lock_path(path, managed), str(path), ctx.wait, log):
            return run_verb(ctx, verb, pin)
    return run_verb(ctx, verb, pin)


def _clean_stale(ctx: Ctx, pin) -> None:
    """Remove what killed runs left for this pin (their owners are dead): temporary trees, build
    folders, downloads. Live runs' folders are kept (their owner files are locked)."""
    from .safety import clean_stale

    path, managed = ctx.tree_path(pin)
    removed = []
    if managed:
        removed += clean_stale(path.parent, f"{path.name}.tmp-")
    removed += clean_stale(ctx.out_dir(pin) / "dist", "glm5-build-")
    removed += clean_stale(ctx.cache, ".download-")
    for d in removed:
        log(f"removed {d} (left by a run that was killed)")


def run_verb(ctx: Ctx, verb: str, pin) -> int:
    ns = ctx.ns
    if verb == "recover":
        return cmd_recover(ctx, pin)
    if verb == "fetch":
        step_fetch(ctx, pin)
        return 0
    if verb == "status":
        return cmd_status(ctx, pin)
    if verb in ("revert", "uninstall"):
        from .install import resolve_venv, revert, uninstall

        v = resolve_venv(ctx.venv_arg, ctx.project.default_venv(pin))
        if not v.python.exists():
            raise UsageError(f"{v.path} is not a virtual environment")
        if verb == "revert":
            log(revert(pin, step_fetch(ctx, pin), v, ctx.dry_run, log))
        else:
            log(uninstall(v, ctx.dry_run, log))
        return 0
    if verb == "refresh":
        from .ops import refresh

        refresh(_open_tree(ctx, pin), ctx.project, ctx.dry_run, log,
                force=getattr(ns, "force", False), allow_fewer=getattr(ns, "allow_fewer", False))
        return 0
    if verb == "upstream-tests":
        from .upstream_tests import default_sdist_cache, write_bundle

        out = Path(ctx.out_arg).resolve() if ctx.out_arg else ctx.project.out_dir(pin) / "upstream-tests"
        write_bundle(ctx.project, pin, default_sdist_cache(), out, ctx.dry_run, log)
        return 0
    if verb == "export-pr":
        from .ops import export_pr

        out = Path(ctx.out_arg).resolve() if ctx.out_arg else ctx.project.out_dir(pin) / "export-pr"
        wheel = step_fetch(ctx, pin)
        export_pr(ctx.project, pin, wheel, out, ns.concern, ns.signoff, ns.include_not_needed, ctx.dry_run, log)
        return 0
    t_start = ctx.t_start
    wheel = step_fetch(ctx, pin)
    if verb == "apply":
        step_apply(ctx, pin, wheel)
        return 0
    from .patches import load_series

    if verb == "build":
        tree = _open_tree(ctx, pin)
        step_build(ctx, pin, tree, load_series(ctx.project.patches_dir(pin)), ctx.project.overlay_files(), wheel)
        return 0
    if verb == "install":
        build, _ = _last_build(ctx, pin)
        step_install(ctx, pin, build)
        return 0
    if verb == "verify":
        from .install import resolve_venv

        build, b = _last_build(ctx, pin)
        tree = _open_tree(ctx, pin)
        v = resolve_venv(ctx.venv_arg, ctx.project.default_venv(pin))
        if not v.python.exists():
            raise UsageError(f"{v.path} is not a virtual environment: run install first")
        return step_verify(ctx, pin, wheel, tree, load_series(ctx.project.patches_dir(pin)), ctx.project.overlay_files(), build, v, "unknown")
    # all: fetch -> apply -> build -> install -> verify
    timings = {"fetch_s": getattr(ctx, "fetch_s", round(time.time() - t_start, 1))}
    t0 = time.time()
    tree, sim, patches, overlay = step_apply(ctx, pin, wheel)
    timings["apply_s"] = round(time.time() - t0, 1)
    if ctx.dry_run:
        log("dry run: would build, install into " + str(ctx.venv_arg or ctx.project.default_venv(pin)) + " and verify")
        return 0
    t0 = time.time()
    build = step_build(ctx, pin, tree, patches, overlay, wheel)
    timings["build_s"] = round(time.time() - t0, 1)
    t0 = time.time()
    v, have, deps = step_install(ctx, pin, build)
    timings["install_s"] = round(time.time() - t0, 1)
    t0 = time.time()
    rc = step_verify(ctx, pin, wheel, tree, patches, overlay, build, v, deps, sim, timings)
    log(f"done in {time.time() - t_start:.0f} s ({', '.join(f'{k[:-2]} {v:.0f} s' for k, v in timings.items())}, verify {time.time() - t0:.0f} s)")
    return rc


def cmd_status(ctx: Ctx, pin) -> int:
    from .fetch import cached_wheel
    from .install import installed, resolve_venv
    from .ops import status

    log(f"pin: vLLM {pin.version} (torch {pin.torch}, triton {pin.triton}); lock default {ctx.project.lock.default}")
    w = cached_wheel(pin, ctx.cache)
    log(f"wheel: {w} {'(cached)' if w.exists() else '(not downloaded)'}")
    path, managed = ctx.tree_path(pin)
    status(ctx.project, pin, path, managed, log)
    v = resolve_venv(ctx.venv_arg, ctx.project.default_venv(pin))
    if v.python.exists():
        h = installed(v)
        log(f"venv: {v.path}: vllm {h['vllm']}, torch {h['torch']}")
    else:
        log(f"venv: {v.path} (not created)")
    bj = ctx.out_dir(pin) / "build.json"
    if bj.exists():
        log(f"last build: {json.loads(bj.read_text())['version']}")
    return 0


def cmd_recover(ctx: Ctx, pin) -> int:
    tree = _open_tree(ctx, pin)
    if getattr(ctx.ns, "forget", False):
        what = tree.forget_journal()
        log(f"{tree.path}: dropped the record of {what}; the tree was left as it is" if what else f"{tree.path}: nothing to forget")
        return 0
    msg = tree.recover()
    log(f"recovered: {msg}" if msg else f"{tree.path}: nothing to recover")
    return 0


def cmd_check(ctx: Ctx) -> int:
    from .ops import check

    pins = [ctx.project.pin(ctx.version)] if ctx.version else [ctx.project.lock.pins[v] for v in sorted(ctx.project.lock.pins)]
    failed = False
    for pin in pins:
        wheel = step_fetch(ctx, pin)
        t0 = time.time()
        problems = check(ctx.project, pin, wheel, log)
        if problems:
            failed = True
            log(f"check {pin.version}: FAILED ({time.time() - t0:.0f} s)")
            for p in problems:
                log("  " + p.replace("\n", "\n  "))
        else:
            log(f"check {pin.version}: OK ({time.time() - t0:.0f} s)")
    return errors.CHECK if failed else 0


def main(argv: list[str] | None = None) -> int:
    from .safety import clean_stale_tmp, handle_signals

    handle_signals()  # SIGTERM / SIGHUP: like Ctrl-C (roll back, exit 130)
    ns = parser().parse_args(argv)
    debug = bool(getattr(ns, "debug", False))
    try:
        clean_stale_tmp()  # temporary indexes/trees of runs that were killed
        return run(ns)
    except ToolError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return errors.INTERRUPTED
    except OSError as e:  # permission denied, disk full, read-only file system, ...
        if debug:
            traceback.print_exc()
        where = f": {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") if e.filename else ""
        print(f"error: {e.strerror or e}{where} (file system error; nothing further was changed)", file=sys.stderr, flush=True)
        return errors.FILESYSTEM
    except Exception as e:
        if debug:
            traceback.print_exc()
        print(f"error: internal error (a bug in tools/apply.py): {type(e).__name__}: {e}"
              + ("" if debug else "; run again with --debug for the traceback"), file=sys.stderr, flush=True)
        return errors.INTERNAL

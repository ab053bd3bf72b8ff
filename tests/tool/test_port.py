"""`tools/apply.py port --from OLD --to NEW` (issue 15) on synthetic releases.

OLD = 9.9.0 with a three-patch series (model.py line 20, model.py line 5, registry.py); NEW = 9.9.1,
whose model.py differs per test: unchanged (clean), shifted (offset), a changed context line
(three-way merge), the patched line itself changed (conflict). Every test checks the tree's
commits and files and the patches written, not only messages.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import zipfile
from pathlib import Path

import pytest
from conftest import BASE_FILES, MODEL_LINES, commit_edit, git, make_project, make_wheel, model_with, sha256, snapshot

STATE = Path(".git") / "glm5-overlay-port.json"
JOURNAL = Path(".git") / "glm5-overlay-apply.json"
REGISTRY = BASE_FILES["vllm/v1/attention/backends/registry.py"]
P1 = "[Model] Twenty as a word"
P2 = "[Model] Five as a word"
P3 = "[Attention] Register Triton"
NAMES = ["0001-Model-Twenty-as-a-word.patch", "0002-Model-Five-as-a-word.patch", "0003-Attention-Register-Triton.patch"]

UNCHANGED = "".join(MODEL_LINES)
SHIFTED = model_with({}, insert_top=3)  # three lines above: every model.py hunk applies at an offset
CONTEXT = model_with({18: "value_18 = 18  # upstream\n"})  # a context line of patch 1: needs a merge
CONFLICT = model_with({20: "value_20 = 20  # upstream\n"})  # the line patch 1 changes


def _series_project(tmp_path: Path, new_model: str | None, pinned: bool = True):
    """9.9.0 with the three-patch series in patches/9.9.0 (authored with apply + refresh); a 9.9.1
    release wheel whose model.py is `new_model`, pinned in pins.lock or (pinned=False) only in `index`."""
    p = make_project(tmp_path)
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    commit_edit(t, {"vllm/model.py": model_with({20: "value_20 = 'twenty'\n"})}, P1)
    commit_edit(t, {"vllm/model.py": model_with({20: "value_20 = 'twenty'\n", 5: "value_5 = 'five'\n"})}, P2, concern="words")
    commit_edit(t, {"vllm/v1/attention/backends/registry.py": REGISTRY + "    TRITON = 'triton'\n"}, P3, concern="backend")
    p.run("refresh", check_rc=0)
    assert sorted(x.name for x in p.patches("9.9.0").glob("*.patch")) == NAMES
    files = dict(BASE_FILES)
    if new_model is not None:
        files["vllm/model.py"] = new_model
    index = tmp_path / "index"
    w_old = p.cache / "vllm-9.9.0-py3-none-any.whl"
    w_new = make_wheel(p.cache if pinned else index, "9.9.1", files, requires=["torch==2.13.0", "numpy"])
    if pinned:
        p.write_lock({"9.9.0": w_old, "9.9.1": w_new})
    p.index = index  # type: ignore[attr-defined]
    p.new_wheel = w_new  # type: ignore[attr-defined]
    return p


def _subjects(tree: Path) -> list[str]:
    return git(tree, "log", "--reverse", "--format=%s", "v9.9.1..HEAD").splitlines()


def _status_lines(out: str) -> dict[str, str]:
    """patch name -> status from the summary lines ('  <name>: <status>')."""
    res = {}
    for line in out.splitlines():
        s = line.strip()
        for n in NAMES:
            if s.startswith(n + ": "):
                res[n] = s[len(n) + 2:]
    return res


def _header(patch_text: str) -> str:
    return patch_text.split("\ndiff --git ")[0]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.is_dir() else {}


# ------------------------------------------------------------------ outcomes
def test_clean_port_gives_the_same_patches_and_passes_check(tmp_path):
    p = _series_project(tmp_path, UNCHANGED)
    lock_before = (p.root / "pins.lock").read_bytes()
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=0)
    assert _status_lines(r.out) == {n: "clean" for n in NAMES}, r.out
    t = p.tree("9.9.1")
    assert _subjects(t) == [P1, P2, P3]
    assert git(t, "status", "--porcelain") == "" and not (t / STATE).exists()
    assert git(t, "for-each-ref", "refs/glm5-port") == ""
    # model.py and registry.py are the same in both releases: the ported patches are byte-identical
    assert _files(p.patches("9.9.1")) == _files(p.patches("9.9.0"))
    assert "check 9.9.1: OK" in r.out
    assert (p.root / "pins.lock").read_bytes() == lock_before
    assert (t / "vllm/model.py").read_text() == model_with({20: "value_20 = 'twenty'\n", 5: "value_5 = 'five'\n"})
    assert (t / "vllm/version.py").read_text() == "__version__ = '9.9.1'\n"


def test_offsets_are_reported_and_the_patches_rewritten_at_the_new_lines(tmp_path):
    p = _series_project(tmp_path, SHIFTED)
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=0)
    assert _status_lines(r.out) == {NAMES[0]: "offset", NAMES[1]: "offset", NAMES[2]: "clean"}, r.out
    assert "hunk #1 applied at line 20 (offset 3 lines)" in r.out
    t = p.tree("9.9.1")
    want = model_with({20: "value_20 = 'twenty'\n", 5: "value_5 = 'five'\n"}, insert_top=3)
    assert (t / "vllm/model.py").read_text() == want
    new = (p.patches("9.9.1") / NAMES[0]).read_text()
    assert "@@ -20,7 +20,7 @@" in new and "@@ -17,7 +17,7 @@" in (p.patches("9.9.0") / NAMES[0]).read_text()
    assert (p.patches("9.9.1") / NAMES[2]).read_bytes() == (p.patches("9.9.0") / NAMES[2]).read_bytes()
    assert "check 9.9.1: OK" in r.out


def test_a_changed_context_line_is_merged_three_way(tmp_path):
    p = _series_project(tmp_path, CONTEXT)
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=0)
    assert _status_lines(r.out) == {NAMES[0]: "merged", NAMES[1]: "clean", NAMES[2]: "clean"}, r.out
    t = p.tree("9.9.1")
    want = model_with({18: "value_18 = 18  # upstream\n", 20: "value_20 = 'twenty'\n", 5: "value_5 = 'five'\n"})
    assert (t / "vllm/model.py").read_text() == want
    new = (p.patches("9.9.1") / NAMES[0]).read_text()
    assert " value_18 = 18  # upstream\n" in new and "+value_20 = 'twenty'\n" in new
    # the header (commit message) is carried unchanged
    old = (p.patches("9.9.0") / NAMES[0]).read_text()
    assert _header(old) == _header(new)
    assert "check 9.9.1: OK" in r.out


# ------------------------------------------------------------------ conflict
def _stop_at_conflict(tmp_path, model=CONFLICT):
    p = _series_project(tmp_path, model)
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=6)
    return p, p.tree("9.9.1"), r


def test_a_conflict_stops_mid_merge_with_patch_file_and_hunk_named(tmp_path):
    p, t, r = _stop_at_conflict(tmp_path)
    assert f"stopped at a conflict in {NAMES[0]}" in r.out
    assert "vllm/model.py: not applying as is: hunk #1 (@@ -17,7 +17,7 @@)" in r.out and "conflict markers at lines" in r.out
    assert (t / ".git/CHERRY_PICK_HEAD").exists()
    text = (t / "vllm/model.py").read_text()
    assert "<<<<<<< " in text and "value_20 = 20  # upstream" in text and "value_20 = 'twenty'" in text
    assert _subjects(t) == [] and (t / STATE).exists()
    assert not p.patches("9.9.1").exists()
    # the other writing commands leave the tree alone; status says why
    before = snapshot(t)
    for verb in ("refresh", "recover"):
        rr = p.run("--vllm", "9.9.1", verb, check_rc=5)
        assert "port 9.9.0 -> 9.9.1" in rr.out, rr.out
    assert "PORT IN PROGRESS: port 9.9.0 -> 9.9.1, stopped at a conflict in " + NAMES[0] in p.run("--vllm", "9.9.1", "status", check_rc=0).out
    # a second port into the tree is refused
    assert "in progress" in p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=5).out
    # the tree's lock is respected: while another command holds it, --continue/--abort exit 5 at once
    fd = os.open(p.root / "work/9.9.1/.tree.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for mode in ("--continue", "--abort"):
            assert "another tools/apply.py command" in p.run("port", mode, check_rc=5).out
    finally:
        os.close(fd)
    assert snapshot(t) == before
    # --continue before resolving: refused, nothing touched
    rr = p.run("port", "--continue", check_rc=5)
    assert "still has unresolved files" in rr.out and "vllm/model.py" in rr.out
    assert snapshot(t) == before


RESOLVED = model_with({20: "value_20 = 'twenty'  # upstream\n", 5: "value_5 = 'five'\n"})


@pytest.mark.parametrize("how", ["commit", "stage"])
def test_continue_after_the_user_resolves(tmp_path, how):
    p, t, _ = _stop_at_conflict(tmp_path)
    (t / "vllm/model.py").write_text(model_with({20: "value_20 = 'twenty'  # upstream\n"}))
    git(t, "add", "vllm/model.py")
    if how == "commit":
        git(t, "-c", "core.editor=true", "commit", "-q")  # the editor keeps the message git prepared
    r = p.run("port", "--continue", check_rc=0)
    assert _status_lines(r.out) == {NAMES[0]: "resolved", NAMES[1]: "clean", NAMES[2]: "clean"}, r.out
    assert _subjects(t) == [P1, P2, P3]
    assert (t / "vllm/model.py").read_text() == RESOLVED
    assert git(t, "status", "--porcelain") == "" and not (t / STATE).exists() and not (t / ".git/CHERRY_PICK_HEAD").exists()
    new = (p.patches("9.9.1") / NAMES[0]).read_text()
    assert "-value_20 = 20  # upstream\n+value_20 = 'twenty'  # upstream\n" in new
    assert _header(new) == _header((p.patches("9.9.0") / NAMES[0]).read_text())
    assert (p.patches("9.9.1") / "series").read_text().splitlines()[-3:] == NAMES
    assert "check 9.9.1: OK" in r.out


def test_skip_drops_the_conflicting_patch_and_keeps_the_users_work(tmp_path):
    p, t, _ = _stop_at_conflict(tmp_path)
    (t / "vllm/model.py").write_text("half done\n")
    r = p.run("port", "--skip", check_rc=0)
    assert _status_lines(r.out) == {NAMES[0]: "skipped", NAMES[1]: "clean", NAMES[2]: "clean"}, r.out
    assert _subjects(t) == [P2, P3]
    assert git(t, "show", "refs/glm5-overlay/port-saved:vllm/model.py") == "half done"
    assert [x.name for x in sorted(p.patches("9.9.1").glob("*.patch"))] == ["0001-Model-Five-as-a-word.patch",
                                                                           "0002-Attention-Register-Triton.patch"]


def test_abort_keeps_what_was_ported_and_saves_the_stopped_merge(tmp_path):
    # patch 1 applies, patch 2 conflicts (NEW changed line 5)
    p, t, r = _stop_at_conflict(tmp_path, model_with({5: "value_5 = 5  # upstream\n"}))
    assert f"stopped at a conflict in {NAMES[1]}" in r.out
    assert _subjects(t) == [P1]
    ported = git(t, "rev-parse", "HEAD")
    (t / "vllm/model.py").write_text("my half resolution\n")
    r = p.run("port", "--abort", check_rc=0)
    assert "aborted" in r.out and "1 ported patch(es): " + NAMES[0] in r.out
    assert git(t, "rev-parse", "HEAD") == ported and git(t, "status", "--porcelain") == ""
    assert git(t, "rev-parse", "--abbrev-ref", "HEAD") == "overlay/9.9.1"
    assert (t / "vllm/model.py").read_text() == model_with({5: "value_5 = 5  # upstream\n", 20: "value_20 = 'twenty'\n"})
    assert not (t / STATE).exists() and not (t / ".git/CHERRY_PICK_HEAD").exists()
    assert git(t, "for-each-ref", "refs/glm5-port") == ""
    assert git(t, "show", "refs/glm5-overlay/port-saved:vllm/model.py") == "my half resolution"
    assert not p.patches("9.9.1").exists()
    assert "no port in progress" in p.run("port", "--continue", check_rc=2).out
    assert "no port in progress" in p.run("port", "--continue", "--to", "9.9.1", check_rc=5).out
    p.run("--vllm", "9.9.1", "refresh", "--allow-fewer", check_rc=0)  # the tree is usable again
    assert [x.name for x in p.patches("9.9.1").glob("*.patch")] == [NAMES[0]]


# ------------------------------------------------------------------ dry run
def test_dry_run_classifies_and_touches_nothing(tmp_path):
    p = _series_project(tmp_path, CONFLICT, pinned=False)
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    old_tree = snapshot(p.tree("9.9.0"))
    lock = (p.root / "pins.lock").read_bytes()
    patches = {d.name: _files(d) for d in (p.root / "patches").iterdir()}
    r = p.run("--dry-run", "port", "--from", "9.9.0", "--to", "9.9.1", "--wheel", str(p.new_wheel), "--triton", "==3.6.0",
              env={"TMPDIR": str(tmp)}, check_rc=0)
    assert "[1/3] 0001-Model-Twenty-as-a-word.patch: conflict (a real port stops here" in r.out
    assert "vllm/model.py: not applying as is: hunk #1 (@@ -17,7 +17,7 @@)" in r.out
    assert "[2/3] 0002-Model-Five-as-a-word.patch: clean" in r.out and "[3/3] 0003-Attention-Register-Triton.patch: clean" in r.out
    assert "torch 2.13.0, triton ==3.6.0" in r.out
    assert (p.root / "pins.lock").read_bytes() == lock
    assert {d.name: _files(d) for d in (p.root / "patches").iterdir()} == patches
    assert not (p.root / "work" / "9.9.1").exists() and snapshot(p.tree("9.9.0")) == old_tree
    assert list(tmp.iterdir()) == []  # the temporary trees are gone


def test_dry_run_of_a_merge_says_merged(tmp_path):
    p = _series_project(tmp_path, CONTEXT)
    r = p.run("--dry-run", "port", "--from", "9.9.0", "--to", "9.9.1", check_rc=0)
    assert "[1/3] 0001-Model-Twenty-as-a-word.patch: merged" in r.out and "(dry run): 2 clean, 1 merged" in r.out
    assert not (p.root / "work" / "9.9.1").exists() and not p.patches("9.9.1").exists()


# ------------------------------------------------------------------ new pin
def _torch_wheel(index: Path, version: str, triton: str) -> None:
    with zipfile.ZipFile(index / f"torch-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr("torch/__init__.py", "")
        zf.writestr(f"torch-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\nRequires-Dist: filelock\n"
                    f"Requires-Dist: triton{triton}; platform_system == \"Linux\" and platform_machine == \"x86_64\"\n\n")
        zf.writestr(f"torch-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"torch-{version}.dist-info/RECORD", "")


def test_an_unpinned_release_is_downloaded_and_pinned(tmp_path):
    p = _series_project(tmp_path, UNCHANGED, pinned=False)
    _torch_wheel(p.index, "2.13.0", "==3.7.1")
    lock = (p.root / "pins.lock").read_text()
    env = {"GLM5_OVERLAY_PIP_DOWNLOAD_ARGS": f"--no-index --find-links {p.index}"}
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", env=env, check_rc=0)
    new = (p.root / "pins.lock").read_text()
    assert new.startswith(lock)  # earlier entries and comments kept byte for byte
    assert new[len(lock):] == (f'\n[pins."9.9.1"]\nwheel = "vllm-9.9.1-py3-none-any.whl"\nsha256 = "{sha256(p.new_wheel)}"\n'
                               f'torch = "2.13.0"\ntriton = "==3.7.1"\n')
    assert sha256(p.cache / "vllm-9.9.1-py3-none-any.whl") == sha256(p.new_wheel)
    assert _status_lines(r.out) == {n: "clean" for n in NAMES} and "check 9.9.1: OK" in r.out
    p.run("--vllm", "9.9.1", "status", check_rc=0)


# ------------------------------------------------------------- never overwrite
def test_an_existing_tree_with_work_or_an_existing_series_is_refused(tmp_path):
    p = _series_project(tmp_path, UNCHANGED)
    (p.patches("9.9.1")).mkdir()
    (p.patches("9.9.1") / "series").write_text("# empty\n")
    p.run("--vllm", "9.9.1", "apply", check_rc=0)  # an empty tree at v9.9.1
    (p.patches("9.9.1") / "series").unlink()
    t = p.tree("9.9.1")
    commit_edit(t, {"vllm/version.py": "__version__ = 'mine'\n"}, "[Misc] Mine")
    before = snapshot(t)
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=5)
    assert "already has commits" in r.out and snapshot(t) == before
    git(t, "reset", "-q", "--hard", "v9.9.1")
    (t / "vllm/model.py").write_text("edited\n")
    before = snapshot(t)
    assert "uncommitted changes" in p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=5).out
    assert snapshot(t) == before
    git(t, "checkout", "-q", "--", "vllm/model.py")
    (p.patches("9.9.1") / "0001-x.patch").write_text("hand-made\n")
    assert "already holds a series" in p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=5).out
    assert (p.patches("9.9.1") / "0001-x.patch").read_text() == "hand-made\n"
    (p.patches("9.9.1") / "0001-x.patch").unlink()
    # a clean tree at v9.9.1 with nothing on it is used as it is
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=0)
    assert _subjects(t) == [P1, P2, P3]


# ------------------------------------------------------------------ kills
def _reference(tmp_path, model) -> dict[str, bytes]:
    ref = _series_project(tmp_path / "ref", model)
    ref.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=0)
    return _files(ref.patches("9.9.1"))


@pytest.mark.parametrize("point,how", [
    ("port-after-patch-2", "sigkill"),  # computed off to the side, nothing checked out yet
    ("after-checkout", "sigkill"),  # inside the switch: the journal is left, recovery undoes the switch
    ("port-switched", "sigkill"),  # the switch is done, the port's record not yet updated
    ("port-after-patch-1", "sigterm"),  # SIGTERM: handled like Ctrl-C (exit 130)
    ("after-patch-2", "sigkill"),  # while OLD's series is applied to the scratch OLD tree (before any patch is ported)
])
def test_a_killed_port_is_completed_by_continue(tmp_path, point, how):
    want = _reference(tmp_path, CONTEXT)
    (tmp_path / "p").mkdir()
    p = _series_project(tmp_path / "p", CONTEXT)
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", env={"GLM5_OVERLAY_FAULT": f"{point}:{how}"})
    assert r.returncode == (-signal.SIGKILL if how == "sigkill" else 130), r.out
    t = p.tree("9.9.1")
    assert (t / STATE).exists() and not p.patches("9.9.1").exists()
    if point == "after-checkout":
        assert (t / JOURNAL).exists()
    rr = p.run("--vllm", "9.9.1", "refresh", check_rc=5)  # the half-done port is not exported
    assert ("in the middle of an interrupted command" if point == "after-checkout" else "port 9.9.0 -> 9.9.1") in rr.out
    r = p.run("port", "--continue", check_rc=0)
    assert _subjects(t) == [P1, P2, P3]
    assert _files(p.patches("9.9.1")) == want
    assert git(t, "status", "--porcelain") == "" and not (t / STATE).exists() and not (t / JOURNAL).exists()
    assert "check 9.9.1: OK" in r.out


def test_a_port_killed_while_starting_the_merge_stops_at_the_conflict_again(tmp_path):
    p = _series_project(tmp_path, CONFLICT)
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", env={"GLM5_OVERLAY_FAULT": "port-picking:sigkill"})
    assert r.returncode == -signal.SIGKILL
    t = p.tree("9.9.1")
    assert json.loads((t / STATE).read_text())["stage"] == "picking"
    r = p.run("port", "--continue", check_rc=6)
    assert f"stopped at a conflict in {NAMES[0]}" in r.out and (t / ".git/CHERRY_PICK_HEAD").exists()
    (t / "vllm/model.py").write_text(model_with({20: "value_20 = 'twenty'  # upstream\n"}))
    git(t, "add", "vllm/model.py")
    p.run("port", "--continue", check_rc=0)
    assert _subjects(t) == [P1, P2, P3] and (t / "vllm/model.py").read_text() == RESOLVED


def test_help_lists_port(tmp_path):
    p = make_project(tmp_path)
    assert "port " in p.run("--help", check_rc=0).out
    h = p.run("port", "--help", check_rc=0).out
    for opt in ("--from OLD", "--to NEW", "--continue", "--skip", "--abort", "--dry-run", "--wheel FILE", "--triton SPEC"):
        assert opt in h
    assert "--vllm VERSION" not in h


def test_a_patch_vllm_already_has_is_dropped_as_upstream(tmp_path):
    p = make_project(tmp_path)
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    commit_edit(t, {"vllm/model.py": model_with({20: "value_20 = 'twenty'\n"})}, P1)
    commit_edit(t, {"vllm/v1/attention/backends/registry.py": REGISTRY + "    TRITON = 'triton'\n"}, P3, concern="backend")
    p.run("refresh", check_rc=0)
    files = dict(BASE_FILES, **{"vllm/v1/attention/backends/registry.py": REGISTRY + "    TRITON = 'triton'\n"})
    p.write_lock({"9.9.0": p.cache / "vllm-9.9.0-py3-none-any.whl", "9.9.1": make_wheel(p.cache, "9.9.1", files)})
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", "--triton", "==3.6.0", check_rc=2)  # pinned: no --triton
    r = p.run("port", "--from", "9.9.0", "--to", "9.9.1", check_rc=0)
    assert "0001-Model-Twenty-as-a-word.patch: clean" in r.out and "0002-Attention-Register-Triton.patch: upstream" in r.out
    assert _subjects(p.tree("9.9.1")) == [P1]
    assert [x.name for x in p.patches("9.9.1").glob("*.patch")] == [NAMES[0]]
    assert "check 9.9.1: OK" in r.out


def test_recover_forget_drops_the_ports_record_and_leaves_the_tree(tmp_path):
    p, t, _ = _stop_at_conflict(tmp_path)
    before = snapshot(t)
    r = p.run("--vllm", "9.9.1", "recover", "--forget", check_rc=0)
    assert "dropped the record of a port in progress" in r.out
    assert not (t / STATE).exists() and snapshot(t) == before  # still mid-merge, as the user left it
    assert "no port in progress" in p.run("port", "--continue", "--to", "9.9.1", check_rc=5).out


def test_continue_keeps_a_resolution_committed_with_another_message(tmp_path):
    p, t, _ = _stop_at_conflict(tmp_path)
    (t / "vllm/model.py").write_text(model_with({20: "value_20 = 'twenty'  # upstream\n"}))
    git(t, "add", "vllm/model.py")
    msg = "[Model] Twenty as a word, on 9.9.1\n\nWhy this patch exists: a test\n\nConcern: routing\nForwarded: no\nLast-Update: 2026-12-03\n"
    git(t, "commit", "-q", "-m", msg)
    r = p.run("port", "--continue", check_rc=0)
    assert "taken as you committed it" in r.out
    assert _subjects(t) == ["[Model] Twenty as a word, on 9.9.1", P2, P3]
    first = sorted(p.patches("9.9.1").glob("*.patch"))[0]
    assert first.name == "0001-Model-Twenty-as-a-word-on-9.9.1.patch" and "Last-Update: 2026-12-03" in first.read_text()

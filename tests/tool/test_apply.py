"""apply: baseline tree, one commit per patch, overlay commit, and every failure path."""
from __future__ import annotations

import json
import signal

from conftest import commit_edit, git, make_project, model_with, snapshot


def test_apply_creates_tagged_baseline_patch_commits_and_overlay(proj_with_patch):
    p = proj_with_patch
    (p.root / "kernels" / "triton_new_op.py").write_text("def op():\n    return 1\n")
    (p.root / "overlay" / "vllm" / "v1" / "attention" / "backends").mkdir(parents=True)
    (p.root / "overlay" / "vllm" / "v1" / "attention" / "backends" / "new_backend.py").write_text("X = 1\n")
    t = p.tree("9.9.0")
    git(t, "reset", "-q", "--hard", "v9.9.0")  # drop the authoring commit: apply from the patch file
    r = p.run("apply", check_rc=0)
    assert "overlay: 2 added" in r.out
    log = git(t, "log", "--format=%s").splitlines()
    assert log[0].startswith("GLM-5 overlay: 2 file(s)")
    assert log[1] == "[Model] Twenty as a word"
    assert log[2] == "vLLM 9.9.0 release wheel"
    assert git(t, "rev-parse", "v9.9.0") == git(t, "rev-list", "--max-parents=0", "HEAD")
    assert git(t, "rev-parse", "--abbrev-ref", "HEAD") == "overlay/9.9.0"
    assert (t / "vllm/v1/attention/ops/triton_new_op.py").read_text() == "def op():\n    return 1\n"
    body = git(t, "log", "-1", "--format=%B")
    import hashlib

    digest = hashlib.sha256(b"def op():\n    return 1\n").hexdigest()
    assert f"{digest}  vllm/v1/attention/ops/triton_new_op.py  (kernels/triton_new_op.py)" in body
    # the patch commit carries the fixed author, so its id is the same on every machine
    assert git(t, "log", "-1", "--format=%an <%ae> %ad", "HEAD~1", "--date=raw") == (
        "GLM-5 overlay <glm5-overlay@users.noreply.github.com> 1767225600 +0000"
    )


def test_baseline_and_patch_commits_are_reproducible(proj_with_patch, tmp_path):
    p = proj_with_patch
    head1 = git(p.tree("9.9.0"), "rev-parse", "HEAD")
    import shutil

    shutil.rmtree(p.root / "work")
    p.run("apply", check_rc=0)
    # the tree made by hand (author Dev) and the one applied from the patch file have different
    # histories; applying twice from the patch file gives the same commit ids
    head2 = git(p.tree("9.9.0"), "rev-parse", "HEAD")
    shutil.rmtree(p.root / "work")
    p.run("apply", check_rc=0)
    assert git(p.tree("9.9.0"), "rev-parse", "HEAD") == head2
    assert head1  # (the authoring tree's commit had the developer as author)


def test_double_apply_is_a_no_op(proj_with_patch):
    p = proj_with_patch
    before = snapshot(p.tree("9.9.0"))
    r = p.run("apply", check_rc=0)
    assert "already applied" in r.out and "already up to date" in r.out
    assert snapshot(p.tree("9.9.0")) == before


def test_reapply_when_a_later_patch_edits_an_earlier_patchs_lines(proj_with_patch):
    """Patch 2 rewrites the line patch 1 added: reverse-applying patch 1 to the final tree fails,
    yet a second apply (e.g. the main job run again) must see both as applied and change nothing."""
    p = proj_with_patch
    t = p.tree("9.9.0")
    commit_edit(t, {"vllm/model.py": model_with({20: "value_20 = 'TWENTY'\n"})}, "[Model] Twenty in capitals")
    p.run("refresh", check_rc=0)
    p.run("apply", check_rc=0)
    before = snapshot(t)
    r = p.run("apply", check_rc=0)
    assert r.out.count("already applied") == 2 and "already up to date" in r.out
    assert snapshot(t) == before


def test_offsets_are_reported_no_fuzz(tmp_path):
    # the patch was written against a file with 3 more lines at the top: applies with an offset
    p = make_project(tmp_path)
    p.run("apply", check_rc=0)
    commit_edit(p.tree("9.9.0"), {"vllm/model.py": model_with({20: "value_20 = 'twenty'\n"})}, "[Model] Twenty")
    p.run("refresh", check_rc=0)
    from conftest import BASE_FILES, make_wheel

    files = dict(BASE_FILES, **{"vllm/model.py": model_with({}, insert_top=3)})
    w = make_wheel(p.cache / "v2", "9.9.0", files)
    (p.cache / w.name).unlink()
    w.rename(p.cache / w.name)
    p.write_lock({"9.9.0": p.cache / w.name})
    import shutil

    shutil.rmtree(p.root / "work")
    r = p.run("apply", check_rc=0)
    assert "hunk #1 applied at line 20 (offset 3 lines)" in r.out


def test_drifted_context_fails_names_patch_file_hunk_and_keeps_tree(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    # a second patch written for a different upstream (its second hunk's context is not there)
    commit_edit(t, {"vllm/model.py": model_with({2: "value_2 = 'two'\n", 20: "value_20 = 'twenty'\n", 35: "value_35 = 'x'\n"})}, "[Model] More words")
    p.run("refresh", check_rc=0)
    p2 = p.patches("9.9.0") / "0002-Model-More-words.patch"
    text = p2.read_text().replace(" value_33 = 33\n", " value_33 = 'drifted'\n")
    p2.write_text(text)
    git(t, "reset", "-q", "--hard", "HEAD~1")  # tree back to patch 1 only
    before = snapshot(t)
    r = p.run("apply", check_rc=6)
    assert "patch 0002-Model-More-words.patch does not apply" in r.out
    assert "vllm/model.py, hunk #2 (@@ -32,7 +32,7 @@)" in r.out
    assert "context is not in the file" in r.out
    assert "value_33 = 'drifted'" in r.out  # what it looked for
    assert snapshot(t) == before


def test_missing_file_fails_and_keeps_tree(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    commit_edit(t, {"vllm/extra.py": "a = 1\n"}, "[Misc] Add extra")
    commit_edit(t, {"vllm/extra.py": "a = 2\n"}, "[Misc] Change extra")
    p.run("refresh", check_rc=0)
    series = p.patches("9.9.0") / "series"
    names = [n for n in series.read_text().split() if n.endswith(".patch")]
    series.write_text("\n".join([names[0], names[2]]) + "\n")  # drop the patch that creates the file
    (p.patches("9.9.0") / names[1]).unlink()
    git(t, "reset", "-q", "--hard", "HEAD~2")
    before = snapshot(t)
    r = p.run("apply", check_rc=6)
    assert f"patch {names[2]} does not apply" in r.out
    assert "vllm/extra.py, hunk #1 of 1: the file does not exist in the tree" in r.out
    assert snapshot(t) == before


def test_failed_first_apply_leaves_no_tree(tmp_path):
    p = make_project(tmp_path)
    p.run("apply", check_rc=0)
    commit_edit(p.tree("9.9.0"), {"vllm/model.py": model_with({20: "x = 0\n"})}, "[Model] X")
    p.run("refresh", check_rc=0)
    pf = next(p.patches("9.9.0").glob("0001-*.patch"))
    pf.write_text(pf.read_text().replace(" value_19 = 19\n", " value_19 = 'gone'\n"))
    import shutil

    shutil.rmtree(p.root / "work")
    r = p.run("apply", check_rc=6)
    assert "does not apply" in r.out
    assert not p.tree("9.9.0").exists() and not any((p.root / "work" / "9.9.0").glob("tree*"))


def test_dirty_tree_is_refused_and_untouched(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    (t / "vllm/model.py").write_text("my work in progress\n")
    (t / "notes.txt").write_text("untracked notes\n")
    before = snapshot(t)
    r = p.run("apply", check_rc=5)
    assert "has uncommitted changes; refusing to apply patches (nothing was touched)" in r.out
    assert "M vllm/model.py" in r.out and "?? notes.txt" in r.out
    assert snapshot(t) == before
    r = p.run("refresh", check_rc=5)
    assert snapshot(t) == before
    r = p.run("build", check_rc=5)
    assert snapshot(t) == before


def _checkout(tmp_path, p, tag="v9.9.0"):
    """A 'vLLM developer checkout': a git repo with the release content at tag v9.9.0."""
    co = tmp_path / "vllm-src"
    import shutil

    shutil.copytree(p.tree("9.9.0"), co)
    git(co, "checkout", "-q", "-b", "main", tag)
    git(co, "branch", "-q", "-D", "overlay/9.9.0")
    return co


def test_checkout_mode_applies_on_new_branch(proj_with_patch, tmp_path):
    p = proj_with_patch
    co = _checkout(tmp_path, p)
    r = p.run("--checkout", str(co), "apply", check_rc=0)
    assert git(co, "rev-parse", "--abbrev-ref", "HEAD") == "overlay/9.9.0"
    assert git(co, "log", "-1", "--format=%s", "overlay/9.9.0") == "[Model] Twenty as a word"
    assert git(co, "rev-parse", "main") == git(co, "rev-parse", "v9.9.0")  # the user's branch untouched
    assert "value_20 = 'twenty'" in (co / "vllm/model.py").read_text()
    assert "applied" in r.out


def test_dirty_checkout_is_refused_and_untouched(proj_with_patch, tmp_path):
    p = proj_with_patch
    co = _checkout(tmp_path, p)
    (co / "vllm/version.py").write_text("__version__ = 'mine'\n")
    before = snapshot(co)
    r = p.run("--checkout", str(co), "apply", check_rc=5)
    assert f"{co} has uncommitted changes" in r.out and "M vllm/version.py" in r.out
    assert snapshot(co) == before


def test_checkout_not_at_tag_is_refused(proj_with_patch, tmp_path):
    p = proj_with_patch
    co = _checkout(tmp_path, p)
    commit_edit(co, {"vllm/version.py": "__version__ = 'dev'\n"}, "[Misc] dev")
    before = snapshot(co)
    r = p.run("--checkout", str(co), "apply", check_rc=3)
    assert "is not at v9.9.0" in r.out
    assert snapshot(co) == before


def test_existing_overlay_branch_not_checked_out_is_refused(proj_with_patch, tmp_path):
    p = proj_with_patch
    co = _checkout(tmp_path, p)
    git(co, "branch", "overlay/9.9.0", "v9.9.0")
    before = snapshot(co)
    r = p.run("--checkout", str(co), "apply", check_rc=5)
    assert "branch overlay/9.9.0 exists but is not checked out" in r.out
    assert snapshot(co) == before


def test_wrong_pin_is_refused(tmp_path):
    p = make_project(tmp_path, versions=("9.9.0", "9.8.0"))
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    before = snapshot(t)
    r = p.run("--vllm", "9.8.0", "--work", str(t), "apply", check_rc=3)
    assert f"{t} is not a vLLM 9.8.0 tree: no tag v9.8.0; it has v9.9.0" in r.out
    assert snapshot(t) == before
    r = p.run("--vllm", "1.0.0", "apply", check_rc=3)
    assert "vLLM 1.0.0 is not pinned" in r.out and "pinned: 9.8.0, 9.9.0" in r.out


def test_tree_from_another_wheel_is_refused(proj_with_patch):
    p = proj_with_patch
    from conftest import BASE_FILES, make_wheel

    w = make_wheel(p.cache / "other", "9.9.0", dict(BASE_FILES, **{"vllm/model.py": "other\n"}))
    p.write_lock({"9.9.0": w})
    t = p.tree("9.9.0")
    before = snapshot(t)
    r = p.run("--wheel-cache", str(p.cache / "other"), "apply", check_rc=3)
    assert "was made from a wheel with sha256" in r.out and "move the tree away" in r.out
    assert snapshot(t) == before


def test_interrupted_apply_between_patches_keeps_tree(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    git(t, "reset", "-q", "--hard", "v9.9.0")
    before = snapshot(t)
    r = p.run("apply", env={"GLM5_OVERLAY_FAULT": "after-patch-1"}, check_rc=130)
    assert "interrupted before anything was changed" in r.out
    assert snapshot(t) == before


def test_interrupted_checkout_is_rolled_back(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    git(t, "reset", "-q", "--hard", "v9.9.0")
    before = snapshot(t)
    r = p.run("apply", env={"GLM5_OVERLAY_FAULT": "after-checkout"}, check_rc=130)
    assert "interrupted; an apply started" in r.out and "restored overlay/9.9.0" in r.out
    assert snapshot(t) == before


def test_killed_apply_is_recovered_by_the_next_command(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    git(t, "reset", "-q", "--hard", "v9.9.0")
    before = snapshot(t)
    r = p.run("apply", env={"GLM5_OVERLAY_FAULT": "after-checkout:sigkill"})
    assert r.returncode == -signal.SIGKILL
    journal = t / ".git" / "glm5-overlay-apply.json"
    assert json.loads(journal.read_text())["orig_head"] == before["head"]
    r = p.run("status", check_rc=0)
    assert "INTERRUPTED" in r.out
    # the library's recovery restores exactly the state before the killed apply ...
    from overlay_tool.pins import load_lock
    from overlay_tool.tree import Tree

    pin = load_lock(p.root / "pins.lock").get("9.9.0")
    msg = Tree.open(t, pin, managed=True).recover()
    assert "was interrupted; restored overlay/9.9.0 at" in msg
    assert snapshot(t) == before
    # ... and apply does it by itself and then applies
    p.run("apply", env={"GLM5_OVERLAY_FAULT": "before-checkout:sigkill"})
    r = p.run("apply", check_rc=0)
    assert "recovered: an apply started" in r.out
    assert "value_20 = 'twenty'" in (t / "vllm/model.py").read_text()


def test_overlay_clash_with_upstream_file_is_refused(proj_with_patch):
    p = proj_with_patch
    (p.root / "kernels" / "__init__.py").write_text("")
    r = p.run("apply", check_rc=2)
    assert "kernels/__init__.py would replace vllm/v1/attention/ops/__init__.py" in r.out
    (p.root / "kernels" / "__init__.py").unlink()
    (p.root / "overlay" / "vllm").mkdir()
    (p.root / "overlay" / "vllm" / "model.py").write_text("shadow\n")
    before = snapshot(p.tree("9.9.0"))
    r = p.run("apply", check_rc=6)
    assert "overlay would replace upstream file(s) of vLLM 9.9.0" in r.out and "overlay/vllm/model.py -> vllm/model.py" in r.out
    assert snapshot(p.tree("9.9.0")) == before


def test_overlay_updates_and_removals_are_new_commits(proj_with_patch):
    p = proj_with_patch
    k = p.root / "kernels" / "triton_a.py"
    k.write_text("A = 1\n")
    (p.root / "kernels" / "triton_b.py").write_text("B = 1\n")
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    k.write_text("A = 2\n")
    (p.root / "kernels" / "triton_b.py").unlink()
    r = p.run("apply", check_rc=0)
    assert "0 added, 1 updated, 1 removed" in r.out
    assert (t / "vllm/v1/attention/ops/triton_a.py").read_text() == "A = 2\n"
    assert not (t / "vllm/v1/attention/ops/triton_b.py").exists()
    assert "removed  vllm/v1/attention/ops/triton_b.py" in git(t, "log", "-1", "--format=%B")
    assert git(t, "status", "--porcelain") == ""


def test_dry_run_changes_nothing(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    git(t, "reset", "-q", "--hard", "v9.9.0")
    (p.root / "kernels" / "triton_a.py").write_text("A = 1\n")
    before = snapshot(t)
    r = p.run("--dry-run", "apply", check_rc=0)
    assert "would apply" in r.out and "would commit" in r.out
    assert snapshot(t) == before

"""refresh (the author workflow), check (the CI gate) and status."""
from __future__ import annotations

from conftest import commit_edit, git, make_project, model_with, snapshot


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_refresh_is_deterministic_and_check_passes(proj_with_patch):
    p = proj_with_patch
    before = _files(p.patches("9.9.0"))
    assert list(before) == ["0001-Model-Twenty-as-a-word.patch", "series"]
    text = before["0001-Model-Twenty-as-a-word.patch"].decode()
    assert text.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
                           "From: GLM-5 overlay <glm5-overlay@users.noreply.github.com>\n"
                           "Date: Thu, 1 Jan 2026 00:00:00 +0000\nSubject: [Model] Twenty as a word\n")
    assert "index " in text and ".." in text and "Concern: routing" in text
    # re-export from the authoring tree and from a tree applied from the files: no churn
    r = p.run("refresh", check_rc=0)
    assert "is up to date" in r.out
    import shutil

    shutil.rmtree(p.root / "work")
    p.run("apply", check_rc=0)
    p.run("refresh", check_rc=0)
    assert _files(p.patches("9.9.0")) == before
    r = p.run("check", check_rc=0)
    assert "check 9.9.0: OK" in r.out


def test_author_workflow_adds_a_patch(proj_with_patch):
    p = proj_with_patch
    (p.root / "kernels" / "triton_k.py").write_text("K = 1\n")
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    # the author edits an upstream file on top of the overlay commit and commits it
    commit_edit(t, {"vllm/v1/attention/backends/registry.py": (t / "vllm/v1/attention/backends/registry.py").read_text()
                    + "    TRITON_K = 'vllm.v1.attention.ops.triton_k.K'\n"}, "[Attention] Register TRITON_K", concern="triton-k")
    r = p.run("status", check_rc=0)
    assert "commits not yet in patches/9.9.0: 0002-Attention-Register-TRITON_K.patch" in r.out
    r = p.run("--dry-run", "refresh", check_rc=0)
    assert "would write patches/9.9.0/0002-Attention-Register-TRITON_K.patch (new)" in r.out
    assert not (p.patches("9.9.0") / "0002-Attention-Register-TRITON_K.patch").exists()
    p.run("refresh", check_rc=0)
    assert (p.patches("9.9.0") / "series").read_text().splitlines()[-2:] == [
        "0001-Model-Twenty-as-a-word.patch", "0002-Attention-Register-TRITON_K.patch"]
    p.run("check", check_rc=0)
    r = p.run("status", check_rc=0)
    assert "content: matches patches/9.9.0 + overlay" in r.out and "not yet in patches" not in r.out


def test_refresh_refuses_a_commit_without_a_valid_header(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    (t / "vllm/version.py").write_text("__version__ = 'x'\n")
    git(t, "commit", "-q", "-am", "quick fix")
    before = _files(p.patches("9.9.0"))
    r = p.run("refresh", check_rc=7)
    assert "cannot export the tree's commits as patches" in r.out
    assert "subject must start with vLLM title tag(s)" in r.out
    assert "needs exactly one 'Concern: <lowercase-words>' field" in r.out
    assert "needs an upstream status" in r.out and "Last-Update" in r.out
    assert _files(p.patches("9.9.0")) == before


def test_refresh_refuses_edits_of_overlay_files(proj_with_patch):
    p = proj_with_patch
    (p.root / "kernels" / "triton_k.py").write_text("K = 1\n")
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    commit_edit(t, {"vllm/v1/attention/ops/triton_k.py": "K = 2\n"}, "[Kernel] Tweak K")
    before = _files(p.patches("9.9.0"))
    r = p.run("refresh", check_rc=7)
    assert "edits overlay-placed file(s) vllm/v1/attention/ops/triton_k.py: edit them in overlay/ or kernels/ instead" in r.out
    assert _files(p.patches("9.9.0")) == before


def test_check_fails_on_a_hand_edited_patch(proj_with_patch):
    p = proj_with_patch
    f = p.patches("9.9.0") / "0001-Model-Twenty-as-a-word.patch"
    f.write_text(f.read_text().replace("Why this patch exists: a test", "Why this patch exists: edited by hand"))
    r = p.run("check", check_rc=0)  # a message edit that round-trips is fine
    f.write_text(f.read_text().replace("Date: Thu, 1 Jan 2026 00:00:00 +0000", "Date: Fri, 2 Jan 2026 00:00:00 +0000"))
    r = p.run("check", check_rc=7)
    assert "0001-Model-Twenty-as-a-word.patch: re-export differs from the committed file" in r.out
    assert "-Date: Fri, 2 Jan 2026" in r.out and "+Date: Thu, 1 Jan 2026" in r.out


def test_check_fails_on_stray_and_already_applied_patches(proj_with_patch, tmp_path):
    p = proj_with_patch
    (p.patches("9.9.0") / "0009-stray.patch").write_text("x")
    r = p.run("check", check_rc=7)
    assert "patches/9.9.0/0009-stray.patch is not listed in the series" in r.out
    (p.patches("9.9.0") / "0009-stray.patch").unlink()
    # a release that already contains the change: the patch reverse-applies
    from conftest import BASE_FILES, make_wheel

    w = make_wheel(tmp_path / "w2", "9.9.0", dict(BASE_FILES, **{"vllm/model.py": model_with({20: "value_20 = 'twenty'\n"})}))
    p.write_lock({"9.9.0": w})
    r = p.run("--wheel-cache", str(tmp_path / "w2"), "check", check_rc=7)
    assert "0001-Model-Twenty-as-a-word.patch: already in the vLLM 9.9.0 release (it reverse-applies): drop it" in r.out


def test_check_fails_on_a_patch_that_does_not_apply(proj_with_patch):
    p = proj_with_patch
    f = p.patches("9.9.0") / "0001-Model-Twenty-as-a-word.patch"
    f.write_text(f.read_text().replace(" value_18 = 18\n", " value_18 = 'eighteen'\n"))
    r = p.run("check", check_rc=6)
    assert "patch 0001-Model-Twenty-as-a-word.patch does not apply" in r.out and "hunk #1" in r.out


def test_check_covers_every_pin(tmp_path):
    p = make_project(tmp_path, versions=("9.9.0", "9.8.0"))
    r = p.run("check", check_rc=0)
    assert "check 9.8.0: OK" in r.out and "check 9.9.0: OK" in r.out
    (p.patches("9.8.0") / "series").unlink()
    r = p.run("check", check_rc=7)
    assert "patches/9.8.0/series does not exist" in r.out


def test_series_errors_are_usage_errors(proj_with_patch):
    p = proj_with_patch
    (p.patches("9.9.0") / "series").write_text("missing.patch\n")
    r = p.run("apply", check_rc=2)
    assert "missing.patch is listed but" in r.out and "does not exist" in r.out


def test_status_reports_drift(proj_with_patch):
    p = proj_with_patch
    t = p.tree("9.9.0")
    git(t, "reset", "-q", "--hard", "v9.9.0")
    r = p.run("status", check_rc=0)
    assert "0001-Model-Twenty-as-a-word.patch: NOT applied (run apply)" in r.out
    assert "content: DRIFT" in r.out
    before = snapshot(t)
    assert snapshot(t) == before

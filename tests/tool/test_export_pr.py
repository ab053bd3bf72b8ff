"""export-pr: one signed-off format-patch series per concern, overlay files by overlay/CONCERNS.toml."""
from __future__ import annotations

from conftest import commit_edit, make_project, model_with

CONCERNS = """
[concern.triton-k]
title = "[Kernel] Add the Triton K kernel"
description = "K, in Triton."
paths = ["kernels/triton_k.py"]

[concern.docs]
title = "[Doc] Overlay notes"
paths = ["overlay/vllm/notes/*"]
"""


def _project(tmp_path):
    p = make_project(tmp_path)
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    commit_edit(t, {"vllm/model.py": model_with({20: "value_20 = 'twenty'\n"})}, "[Model] Twenty", concern="words")
    reg = (t / "vllm/v1/attention/backends/registry.py").read_text() + "    TRITON_K = 'k'\n"
    commit_edit(t, {"vllm/v1/attention/backends/registry.py": reg}, "[Attention] Register TRITON_K", concern="triton-k")
    commit_edit(t, {"vllm/model.py": model_with({20: "value_20 = 'twenty'\n", 30: "value_30 = 'thirty'\n"})}, "[Model] Thirty", concern="words")
    p.run("refresh", check_rc=0)
    (p.root / "kernels" / "triton_k.py").write_text("K = 1\n")
    (p.root / "overlay" / "vllm" / "notes").mkdir(parents=True)
    (p.root / "overlay" / "vllm" / "notes" / "README.txt").write_text("notes\n")
    (p.root / "overlay" / "CONCERNS.toml").write_text(CONCERNS)
    return p


def test_export_pr_per_concern(tmp_path):
    p = _project(tmp_path)
    out = tmp_path / "prs"
    r = p.run("--out", str(out), "export-pr", "--signoff", "Ada Lovelace <ada@example.com>", check_rc=0)
    assert sorted(x.name for x in out.iterdir()) == ["docs", "triton-k", "words"]
    words = sorted(x.name for x in (out / "words").glob("*.patch"))
    assert words == ["0001-Model-Twenty.patch", "0002-Model-Thirty.patch"]
    k = sorted(x.name for x in (out / "triton-k").glob("*.patch"))
    assert k == ["0001-Attention-Register-TRITON_K.patch", "0002-Kernel-Add-the-Triton-K-kernel.patch"]
    kp = (out / "triton-k" / k[1]).read_text()
    assert "Subject: [Kernel] Add the Triton K kernel" in kp and "+++ b/vllm/v1/attention/ops/triton_k.py" in kp
    for f in (out / "words").glob("*.patch"):
        text = f.read_text()
        assert "Signed-off-by: Ada Lovelace <ada@example.com>" in text
        assert "From: Ada Lovelace <ada@example.com>" in text
        assert "Concern:" not in text and "Last-Update:" not in text  # internal fields stay home
    pr = (out / "words" / "PR.md").read_text()
    assert pr.startswith("# [Model] Twenty\n") and "## Purpose" in pr and "Why this patch exists: a test" in pr
    assert "- [Model] Thirty" in pr
    # the 'words' series applies to the bare release on its own
    r2 = p.run("--out", str(out), "export-pr", "--concern", "words", "--signoff", "A <a@b.c>", check_rc=0)
    assert "words: wrote" in r2.out


def test_export_pr_refuses_unmapped_files_and_missing_identity(tmp_path):
    p = _project(tmp_path)
    (p.root / "kernels" / "triton_orphan.py").write_text("O = 1\n")
    r = p.run("--out", str(tmp_path / "prs"), "export-pr", "--signoff", "A <a@b.c>", check_rc=2)
    assert "kernels/triton_orphan.py: no concern claims it in overlay/CONCERNS.toml" in r.out
    (p.root / "kernels" / "triton_orphan.py").unlink()
    r = p.run("--out", str(tmp_path / "prs"), "export-pr", "--signoff", "nobody", check_rc=2)
    assert "DCO sign-off needs an identity" in r.out
    assert not (tmp_path / "prs").exists()


def test_export_pr_leaves_out_backports(tmp_path):
    p = _project(tmp_path)
    f = next(p.patches("9.9.0").glob("0002-*.patch"))
    f.write_text(f.read_text().replace("Forwarded: no", "Forwarded: not-needed"))
    r = p.run("--out", str(tmp_path / "prs"), "export-pr", "--concern", "triton-k", "--signoff", "A <a@b.c>", check_rc=0)
    assert "leaving out 0002-Attention-Register-TRITON_K.patch (Forwarded: not-needed" in r.out
    assert [x.name for x in sorted((tmp_path / "prs" / "triton-k").glob("*.patch"))] == ["0001-Kernel-Add-the-Triton-K-kernel.patch"]


def test_export_pr_names_a_concern_that_depends_on_another(tmp_path):
    p = make_project(tmp_path)
    p.run("apply", check_rc=0)
    t = p.tree("9.9.0")
    commit_edit(t, {"vllm/model.py": model_with({20: "value_20 = 'twenty'\n"})}, "[Model] Twenty", concern="a")
    commit_edit(t, {"vllm/model.py": model_with({20: "value_20 = 'TWENTY'\n"})}, "[Model] Louder", concern="b")
    p.run("refresh", check_rc=0)
    r = p.run("--out", str(tmp_path / "prs"), "export-pr", "--signoff", "A <a@b.c>", check_rc=6)
    assert "concern b: its patches do not apply to v9.9.0 on their own" in r.out


def test_export_pr_defaults_to_the_newest_pin(tmp_path):
    # "10.0.0" sorts before "9.9.0" as a string: the newest is picked by version order, and not the
    # lock's default (9.9.0): upstream PRs go against vLLM's main
    p = make_project(tmp_path, versions=("9.9.0", "10.0.0"))
    (p.root / "kernels" / "triton_k.py").write_text("K = 1\n")
    (p.root / "overlay" / "CONCERNS.toml").write_text(CONCERNS.split("[concern.docs]")[0])
    r = p.run("export-pr", "--signoff", "A <a@b.c>", check_rc=0)
    assert "export-pr: vLLM 10.0.0, the newest pin" in r.out
    assert (p.root / "work" / "10.0.0" / "export-pr" / "triton-k" / "PR.md").is_file()
    assert "against vLLM v10.0.0" in (p.root / "work" / "10.0.0" / "export-pr" / "triton-k" / "PR.md").read_text()
    assert not (p.root / "work" / "9.9.0").exists()
    r = p.run("--vllm", "9.9.0", "export-pr", "--signoff", "A <a@b.c>", check_rc=0)
    assert "newest pin" not in r.out
    assert (p.root / "work" / "9.9.0" / "export-pr" / "triton-k" / "PR.md").is_file()
    h = p.run("export-pr", "--help", check_rc=0).out
    assert "newest" in h and "pin in pins.lock" in h

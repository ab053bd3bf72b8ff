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


CARRIED = '''
[concern.triton-k.tests]
"tests/kernels/test_k.py" = "tests/kernels/attention/test_triton_k.py"
"tests/kernels/test_k_bare.py" = "tests/kernels/attention/test_triton_k_bare.py"

[concern.triton-k.not_carried]
"tests/kernels/test_k_interp.py" = "imports the project's tests/triton_interpreter.py"

[[concern.triton-k.results]]
file = "bench/results/k_tests.json"
kind = "pytest"
label = "kernel tests"

[[concern.triton-k.results]]
file = "bench/results/k_bench.json"
kind = "records"
where = { fmt = "fp8" }
keys = ["fmt", "tokens"]
values = ["ratio_vs_peer"]
'''

K_TEST = '''# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

from kernels import triton_k
from kernels.triton_k import K


@pytest.mark.gpu
def test_k(seed):
    assert K == triton_k.K == 1
'''


K_BARE = '''# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

import os  # noqa: E402
import sys  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "kernels"))
from tests.triton_interpreter import _HAS_CUDA as HAS_CUDA, DEVICE, INTERPRET  # noqa: E402

import triton_k as T  # noqa: E402

gpu = pytest.mark.gpu


def test_k_bare():
    assert T.K == 1
'''


def _project_with_tests(tmp_path):
    import json

    p = _project(tmp_path)
    (p.root / "overlay" / "CONCERNS.toml").write_text(CONCERNS + CARRIED)
    (p.root / "tests" / "kernels" / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.fixture\ndef seed():\n    return 1\n")
    (p.root / "tests" / "kernels" / "test_k.py").write_text(K_TEST)
    (p.root / "tests" / "kernels" / "test_k_bare.py").write_text(K_BARE)
    res = p.root / "bench" / "results"
    res.mkdir(parents=True)
    (res / "k_tests.json").write_text(json.dumps({
        "commit": "abc1234", "command": "python3 e2e/gpu_tests.py", "environment": {"gpu": "Test GPU 9000"},
        "modes": {"plain": {"counts": {"passed": 417, "failed": 0, "error": 0, "skipped": 3}}}}))
    (res / "k_bench.json").write_text(json.dumps({"device": "Test GPU 9000", "command": "python bench/k.py", "records": [
        {"fmt": "fp8", "tokens": 1, "ratio_vs_peer": 0.8125},
        {"fmt": "fp8", "tokens": 64, "ratio_vs_peer": 1.375},
        {"fmt": "bf16", "tokens": 1, "ratio_vs_peer": 9.5}]}))
    return p


def test_export_pr_carries_tests_in_vllm_layout(tmp_path):
    p = _project_with_tests(tmp_path)
    out = tmp_path / "prs"
    p.run("--out", str(out), "export-pr", "--concern", "triton-k", "--signoff", "A <a@b.c>", check_rc=0)
    k = sorted(x.name for x in (out / "triton-k").glob("*.patch"))
    assert k == ["0001-Attention-Register-TRITON_K.patch", "0002-Kernel-Add-the-Triton-K-kernel.patch",
                 "0003-Test-Add-the-Triton-K-kernel.patch"]
    t = (out / "triton-k" / k[2]).read_text()
    assert "Subject: [Test] Add the Triton K kernel" in t
    assert "+++ b/tests/kernels/attention/test_triton_k.py" in t
    assert "+from vllm.v1.attention.ops import triton_k\n" in t
    assert "+from vllm.v1.attention.ops.triton_k import K\n" in t
    assert "from kernels" not in t and "pytest.mark.gpu" not in t
    assert '+@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")' in t
    assert "+def seed():\n+    return 1\n" in t  # the project's fixture, as its conftest.py has it
    assert "+# SPDX-FileCopyrightText: Copyright contributors to the vLLM project" in t
    # the project's sys.path set-up, interpreter module and bare kernel imports, in vLLM's terms
    assert "+++ b/tests/kernels/attention/test_triton_k_bare.py" in t
    assert "+import vllm.v1.attention.ops.triton_k as T  # noqa: E402\n" in t
    assert "+HAS_CUDA = torch.cuda.is_available()\n" in t
    assert '+INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"\n' in t
    assert ('+DEVICE = "cuda" if (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1") '
            'else "cpu"\n') in t
    assert '+gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")\n' in t
    assert "sys.path" not in t and "_ROOT" not in t and "import sys" not in t and "tests.triton_interpreter" not in t
    pr = (out / "triton-k" / "PR.md").read_text()
    assert "pytest -v tests/kernels/attention/test_triton_k.py tests/kernels/attention/test_triton_k_bare.py" in pr
    assert "- new test `tests/kernels/attention/test_triton_k.py` (the project's `tests/kernels/test_k.py`)" in pr
    assert "- `tests/kernels/test_k_interp.py`: imports the project's tests/triton_interpreter.py" in pr


def test_export_pr_test_plan_reads_the_results_files(tmp_path):
    import json

    p = _project_with_tests(tmp_path)
    out = tmp_path / "prs"
    p.run("--out", str(out), "export-pr", "--concern", "triton-k", "--signoff", "A <a@b.c>", check_rc=0)
    pr = (out / "triton-k" / "PR.md").read_text()
    assert "## Test Plan" in pr and "## Test Result" in pr
    assert "`plain`: 417 passed, 0 failed, 0 error, 3 skipped" in pr and "commit abc1234" in pr
    assert "| fp8 | 1 | 0.81 |" in pr and "| fp8 | 64 | 1.38 |" in pr and "bf16" not in pr
    assert "Test GPU 9000" in pr and "`bench/results/k_bench.json`" in pr
    # numbers come from the file at export time
    f = p.root / "bench" / "results" / "k_tests.json"
    f.write_text(f.read_text().replace("417", "418"))
    p.run("--out", str(out), "export-pr", "--concern", "triton-k", "--signoff", "A <a@b.c>", check_rc=0)
    assert "`plain`: 418 passed" in (out / "triton-k" / "PR.md").read_text()
    # per backend (e2e/upstream_tests.py), a backend from a run stopped at its deadline says so
    f.write_text(json.dumps({"commit": "abc1234", "command": "python3 e2e/upstream_tests.py", "environment": {},
                             "backends": {"Ours": {"counts": {"passed": 5, "failed": 0, "skipped": 1}, "complete": True},
                                          "Peer": {"counts": {"passed": 2, "failed": 0, "skipped": 0}, "complete": False}}}))
    p.run("--out", str(out), "export-pr", "--concern", "triton-k", "--signoff", "A <a@b.c>", check_rc=0)
    pr = (out / "triton-k" / "PR.md").read_text()
    assert "`Ours`: 5 passed, 0 failed, 1 skipped\n" in pr
    assert "`Peer`: 2 passed, 0 failed, 0 skipped (from a run stopped at its deadline: not every case finished)" in pr


def test_export_pr_refuses_a_test_that_cannot_run_in_vllm(tmp_path):
    p = _project_with_tests(tmp_path)
    f = p.root / "tests" / "kernels" / "test_k.py"
    f.write_text(f.read_text().replace("import torch\n", "import torch\nfrom tests.kernels import vllm_peers\n"))
    r = p.run("--out", str(tmp_path / "prs"), "export-pr", "--concern", "triton-k", "--signoff", "A <a@b.c>", check_rc=2)
    assert "test tests/kernels/test_k.py -> tests/kernels/attention/test_triton_k.py cannot run inside vLLM's tree" in r.out
    assert "'from tests.kernels import vllm_peers' is a project module" in r.out
    f.write_text(K_TEST.replace("def test_k(seed):", "def test_k(seed):\n    open(ROOT / \"kernels\" / \"triton_k.py\")"))
    r = p.run("--out", str(tmp_path / "prs"), "export-pr", "--concern", "triton-k", "--signoff", "A <a@b.c>", check_rc=2)
    assert "names a path of the project's checkout" in r.out
    f.write_text(K_TEST.replace("def test_k(seed)", "def test_k(seed, gpu_peer)"))
    (p.root / "tests" / "kernels" / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.fixture\ndef seed():\n    return 1\n\n\n@pytest.fixture\ndef gpu_peer():\n    return 2\n")
    r = p.run("--out", str(tmp_path / "prs"), "export-pr", "--concern", "triton-k", "--signoff", "A <a@b.c>", check_rc=2)
    assert "uses the project's fixtures gpu_peer" in r.out


def test_export_pr_carries_our_edit_of_vllms_own_test(tmp_path):
    """patches/<pin>/tests: each test patch goes into its concern's series, last, as an edit of vLLM's
    file (diffed against the pinned sdist's file, which vLLM's repository has at the tag)."""
    import subprocess

    from test_sdist_tests import TEST_V1, TEST_V2, _env, add_upstream_tests

    p = _project(tmp_path)
    cache = add_upstream_tests(p, tmp_path, concern="triton-k")
    out = tmp_path / "prs"
    p.run("--out", str(out), "export-pr", "--signoff", "Ada <ada@example.com>", env=_env(cache), check_rc=0)
    names = sorted(x.name for x in (out / "triton-k").glob("*.patch"))
    assert names == ["0001-Attention-Register-TRITON_K.patch", "0002-Kernel-Add-the-Triton-K-kernel.patch",
                     "0003-Test-Run-test_x-on-OURS.patch"]
    edit = (out / "triton-k" / names[2]).read_text()
    assert "Subject: [Test] Run test_x on OURS" in edit and "Signed-off-by: Ada <ada@example.com>" in edit
    assert "Concern:" not in edit and "--- a/tests/v1/attention/test_x.py" in edit and "new file" not in edit
    assert not any("test_x" in (out / "words" / n).read_text() for n in (x.name for x in (out / "words").glob("*.patch")))
    pr = (out / "triton-k" / "PR.md").read_text()
    assert "edits vLLM's `tests/v1/attention/test_x.py`" in pr and "pytest -v tests/v1/attention/test_x.py" in pr
    # it applies to vLLM's file as released
    repo = tmp_path / "vllm-repo"
    (repo / "tests/v1/attention").mkdir(parents=True)
    (repo / "tests/v1/attention/test_x.py").write_text(TEST_V1)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    r = subprocess.run(["git", "apply", str(out / "triton-k" / names[2])], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (repo / "tests/v1/attention/test_x.py").read_text() == TEST_V2


def test_export_pr_refuses_a_test_patch_of_an_unknown_concern(tmp_path):
    from test_sdist_tests import _env, add_upstream_tests

    p = _project(tmp_path)
    cache = add_upstream_tests(p, tmp_path, concern="nobody")
    r = p.run("--out", str(tmp_path / "prs"), "export-pr", "--signoff", "A <a@b.c>", env=_env(cache), check_rc=2)
    assert "nobody" in r.out and "no patches or files" in r.out


def test_carried_seed_fixture_is_the_conftest_fixture():
    """The `seed` fixture a carried test takes along is tests/kernels/conftest.py's, as written there
    (same AST, decorator included), with the imports it reads; and it seeds like the original."""
    import ast
    import random

    import pytest
    import torch
    from conftest import REPO

    from overlay_tool.carry import carry_test, conftest_fixture, module_map
    from overlay_tool.project import Project

    mods = module_map(Project(REPO).overlay_files())
    text = carry_test(REPO, "tests/kernels/test_sparse_mla.py", "tests/kernels/attention/test_triton_sparse_mla.py",
                      mods, set(mods)).decode()

    def seed_def(src: str) -> ast.FunctionDef:
        return next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "seed")

    source = (REPO / "tests" / "kernels" / "conftest.py").read_text()
    assert ast.dump(seed_def(text)) == ast.dump(seed_def(source))
    fixture_src, imports = conftest_fixture(REPO, "seed")
    assert fixture_src in text and sorted(imports) == ["import os", "import pytest", "import random", "import torch"]
    for line in imports:  # every name it reads is imported at the top level of the carried file
        assert any(ln.split("  #")[0] == line for ln in text.splitlines()), line
    # it runs: a fixed GLM5_TEST_SEED seeds torch and random and is returned
    ns = {"pytest": pytest}
    exec(compile("\n".join(imports) + "\n" + fixture_src, "carried", "exec"), ns)
    node = type("N", (), {"nodeid": "t", "user_properties": []})()
    req = type("R", (), {"node": node})()
    mp = pytest.MonkeyPatch()
    mp.setenv("GLM5_TEST_SEED", "1234")
    try:
        assert ns["seed"].__wrapped__(req) == 1234
    finally:
        mp.undo()
    assert random.random() == random.Random(1234).random() and node.user_properties == [("seed", 1234)]
    assert torch.initial_seed() == 1234


def test_every_test_the_real_concerns_carry_rewrites_for_vllm():
    """Each test this repository's overlay/CONCERNS.toml carries into vLLM's tree rewrites without
    a problem (imports from vLLM's paths, project helpers such as tests/kernels/fake_compiled.py
    carried into the file) and compiles: export-pr refuses the whole concern otherwise (a carried
    test once imported that helper and stopped it)."""
    import ast

    from conftest import REPO
    from overlay_tool.carry import carry_test, module_map
    from overlay_tool.ops import plan_concerns
    from overlay_tool.project import Project

    project = Project(REPO)
    overlay = project.overlay_files()
    groups, spec = plan_concerns(project, [], overlay)
    mods = module_map(overlay)
    n = 0
    for name, c in spec.concerns.items():
        own = set(module_map(groups.get(name, {}).get("files", [])))
        for src, dest in c.tests:
            text = carry_test(REPO, src, dest, mods, own).decode()
            ast.parse(text)  # valid Python after the rewrite
            assert "tests.kernels" not in text and "fake_compiled import" not in text, src
            if "FakeCompiled" in text:
                assert "class FakeCompiled" in text, src
            n += 1
    assert n >= 5
